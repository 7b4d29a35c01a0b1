"""The stage node's step book (`protocols.stepbook`), driven in memory: every transition and the races that
the daemon's history has fixed, in milliseconds."""

from __future__ import annotations

from protocols.stepbook import MicrobatchKey, StepBook


def key(origin: str, iteration: int, microbatch: int) -> MicrobatchKey:
    return MicrobatchKey(origin, iteration, microbatch)


def test_steps_only_when_every_planned_microbatch_finished() -> None:
    book = StepBook(expiry_s=30.0)
    assert book.take(key("d", 0, 0), ("d",), expected=2, now=0.0)
    assert book.ready(held=1, now=0.1) is None
    book.finish(key("d", 0, 0), applied=True, now=0.0)
    assert book.ready(held=0, now=0.2) is None  # the second planned microbatch has not arrived
    assert book.take(key("d", 0, 1), ("d",), expected=2, now=0.3)
    book.finish(key("d", 0, 1), applied=False, now=0.0)  # aborted
    decision = book.ready(held=0, now=0.4)
    assert decision is not None and (len(decision.updates), decision.applied, decision.iteration) == (1, 1, 0)
    assert decision.shares == (1,)  # the update is the mean over the one microbatch applied


def test_each_update_says_how_many_microbatches_it_applied() -> None:
    book = StepBook(expiry_s=30.0)
    for origin, count in (("d1", 3), ("d2", 1)):
        for mb in range(count):
            assert book.take(key(origin, 0, mb), (origin,), expected=count, now=0.0)
            book.finish(key(origin, 0, mb), applied=True, now=0.0)
    decision = book.ready(held=0, now=0.1)
    assert decision is not None and dict(zip(decision.updates, decision.shares, strict=True)) == {
        ("d1", 0): 3,
        ("d2", 0): 1,
    }


def test_the_decision_names_the_latest_iteration_applied() -> None:
    book = StepBook(expiry_s=30.0)
    for k in (key("d", 4, 0), key("d", 5, 0), key("d", 6, 0)):
        assert book.take(k, (k.origin,), expected=1, now=0.0)
    book.finish(key("d", 4, 0), applied=True, now=0.0)
    book.finish(key("d", 5, 0), applied=True, now=0.0)
    book.finish(key("d", 6, 0), applied=False, now=0.0)  # aborted: its tick holds no gradient
    decision = book.ready(held=0, now=0.1)
    assert decision is not None and (len(decision.updates), decision.iteration) == (2, 5)


def test_a_step_of_aborted_microbatches_only_applies_nothing() -> None:
    book = StepBook(expiry_s=30.0)
    assert book.take(key("d", 0, 0), ("d",), expected=1, now=0.0)
    book.finish(key("d", 0, 0), applied=False, now=0.1)
    decision = book.ready(held=0, now=0.2)
    assert decision is not None and (len(decision.updates), decision.applied, decision.iteration) == (
        0,
        0,
        None,
    )


def test_duplicates_and_late_messages_are_refused() -> None:
    book = StepBook(expiry_s=30.0)
    assert book.take(key("d", 0, 0), ("d",), expected=1, now=0.0)
    assert not book.take(key("d", 0, 0), ("d",), expected=1, now=0.0)  # duplicate
    book.finish(key("d", 0, 0), applied=True, now=0.0)
    book.finish(key("d", 0, 0), applied=True, now=0.0)  # never counted twice
    decision = book.ready(held=0, now=1.0)
    assert decision is not None and decision.applied == 1
    assert not book.take(key("d", 0, 5), ("d",), expected=1, now=2.0)  # the group is closed
    # closed groups are forgotten after ten expiry periods (and their numbers never come back)
    assert book.take(key("d", 1, 0), ("d",), expected=1, now=400.0)
    book.finish(key("d", 1, 0), applied=True, now=400.0)
    assert book.ready(held=0, now=400.0) is not None
    assert book.take(key("d", 0, 6), ("d",), expected=1, now=401.0)


def test_groups_that_never_complete_expire_and_their_microbatches_are_dropped() -> None:
    book = StepBook(expiry_s=5.0)
    assert book.take(key("d", 3, 0), ("d",), expected=2, now=0.0)
    assert book.take(key("d", 3, 1), ("d",), expected=2, now=0.0)
    book.finish(key("d", 3, 0), applied=True, now=0.0)
    assert book.expire(now=4.0) == {key("d", 3, 1)}  # still waiting: microbatch 1 is live
    assert book.ready(held=1, now=4.0) is None
    assert book.expire(now=6.0) == frozenset()  # expired: the caller drops what microbatch 1 held
    assert key("d", 3, 1) not in book and book.tries(key("d", 3, 1)) is None
    decision = book.ready(held=0, now=6.0)
    assert decision is not None and len(decision.updates) == 1


def test_groups_of_several_data_nodes_step_together() -> None:
    book = StepBook(expiry_s=30.0)
    for origin in ("a", "b"):
        assert book.take(key(origin, 0, 0), (origin,), expected=1, now=0.0)
        book.finish(key(origin, 0, 0), applied=True, now=0.0)
    decision = book.ready(held=0, now=1.0)
    assert decision is not None and len(decision.updates) == 2


def test_an_abort_that_arrives_before_its_group_is_remembered() -> None:
    book = StepBook(expiry_s=5.0)
    book.finish(key("d", 0, 1), applied=False, now=0.0)  # microbatch 1 died upstream, before reaching us
    assert book.ready(held=0, now=0.1) is None  # an abort alone is no group to step for
    assert book.take(key("d", 0, 0), ("d",), expected=2, now=0.2)
    assert not book.take(key("d", 0, 1), ("d",), expected=2, now=0.3)  # an aborted microbatch is refused
    book.finish(key("d", 0, 0), applied=True, now=0.4)
    decision = book.ready(held=0, now=0.5)  # no waiting for the microbatch that will never come
    assert decision is not None and decision.applied == 1
    # an early abort older than the expiry is forgotten; one for a closed group is ignored
    book.finish(key("d", 1, 0), applied=False, now=1.0)
    book.finish(key("d", 2, 0), applied=False, now=7.0)
    book.finish(key("d", 0, 1), applied=False, now=7.0)
    assert book.take(key("d", 1, 1), ("d",), expected=2, now=7.1)
    book.finish(key("d", 1, 1), applied=True, now=7.2)
    assert book.ready(held=0, now=7.3) is None


def test_every_held_microbatch_is_waited_for_even_when_aborts_fill_the_count() -> None:
    book = StepBook(expiry_s=30.0)
    assert book.take(key("d", 0, 0), ("d",), expected=2, now=0.0)  # planned: mb0 and mb1
    assert book.take(key("d", 0, 2), ("d",), expected=2, now=0.1)  # mb2 re-routed here
    book.finish(key("d", 0, 1), applied=False, now=0.2)  # mb1 died upstream
    book.finish(key("d", 0, 2), applied=True, now=0.3)
    assert book.open_groups == {("d", 0)}  # mb0 is still held: its backward must find it
    assert book.ready(held=0, now=0.4) is None
    book.finish(key("d", 0, 0), applied=True, now=0.5)
    decision = book.ready(held=0, now=0.6)
    assert decision is not None and decision.applied == 2


def test_a_microbatch_taken_while_a_step_waits_is_not_dropped() -> None:
    # the daemon expires, then awaits its compute thread: a microbatch taken meanwhile belongs to an open
    # group and stays in the book (an old bug dropped it and stalled its group)
    book = StepBook(expiry_s=30.0)
    assert book.take(key("d", 0, 0), ("d",), expected=1, now=0.0)
    book.finish(key("d", 0, 0), applied=True, now=0.1)
    live = book.expire(now=0.2)
    assert live == frozenset()
    assert book.take(key("d", 1, 0), ("d",), expected=1, now=0.3)  # arrives during the await
    assert book.ready(held=1, now=0.4) is None  # held: no step under a pending backward pass
    assert key("d", 1, 0) in book and book.expire(now=0.5) == {key("d", 1, 0)}


def test_only_a_peer_a_microbatch_was_sent_to_may_return_its_gradient() -> None:
    book, k = StepBook(expiry_s=30.0), key("data", 4, 1)
    assert book.take(k, ("data", "s1"), expected=1, now=0.0)
    tries = book.tries(k)
    assert tries is not None
    tries |= {"s3-dead", "s3-alive"}  # the router tried a dead replica, then re-routed
    assert book.may_send_gradient(k, "s3-alive") and book.may_send_gradient(k, "s3-dead")
    assert not book.may_send_gradient(k, "mallory")  # whatever path mallory's message claims
    assert not book.may_send_gradient(key("data", 4, 2), "s3-alive")  # not taken
    assert all(book.may_abort(k, p) for p in ("data", "s1", "s3-alive"))
    assert not book.may_abort(k, "mallory")
    assert book.may_abort(key("data", 9, 0), "anyone")  # not taken here: the book bounds what it does
    assert book.take(key("data", 5, 0), ("data",), expected=1, now=0.0)
    assert len(book) == 2
    book.finish(k, applied=True, now=0.1)
    assert k not in book and book.tries(k) is None and len(book) == 1
    assert not book.may_send_gradient(k, "s3-alive")  # a second gradient for a finished microbatch


def test_plain_tuples_name_the_same_microbatch() -> None:
    book = StepBook(expiry_s=30.0)
    assert book.take(("d", 0, 0), ("d",), expected=1, now=0.0)  # type: ignore[arg-type]
    assert ("d", 0, 0) in book and key("d", 0, 0) in book
    assert key("d", 0, 0).group == ("d", 0)


def test_a_newer_iterations_forward_waits_for_the_older_step_and_does_not_block_it() -> None:
    # one data node: it starts iteration 1 as soon as its gradients are back, before this node stepped
    book = StepBook(expiry_s=30.0)
    assert book.take(key("d", 0, 0), ("d",), expected=1, now=0.0)
    book.finish(key("d", 0, 0), applied=True, now=0.1)
    assert book.take(key("d", 1, 0), ("d",), expected=1, now=0.2)  # taken, not run yet
    assert book.waits(1) and not book.waits(0)
    decision = book.ready(held=0, now=0.3)  # iteration 0 steps alone: iteration 1 is open, not held
    assert decision is not None and (len(decision.updates), decision.iteration) == (1, 0)
    assert not book.waits(1) and book.ready(held=1, now=0.4) is None
    book.finish(key("d", 1, 0), applied=True, now=0.5)
    decision = book.ready(held=0, now=0.6)
    assert decision is not None and decision.iteration == 1


def test_groups_of_two_data_nodes_in_one_iteration_step_together() -> None:
    book = StepBook(expiry_s=30.0)
    for origin in ("a", "b"):
        assert book.take(key(origin, 4, 0), (origin,), expected=1, now=0.0)
    book.finish(key("a", 4, 0), applied=True, now=0.1)
    assert book.take(key("a", 5, 0), ("a",), expected=1, now=0.2)  # a moved on; b's microbatch is held
    assert book.waits(5) and book.ready(held=1, now=0.3) is None
    book.finish(key("b", 4, 0), applied=True, now=0.4)
    decision = book.ready(held=0, now=0.5)
    assert decision is not None and (len(decision.updates), decision.applied, decision.iteration) == (2, 2, 4)


def test_a_data_node_that_moved_on_expects_nothing_more_of_its_older_iteration() -> None:
    # two microbatches were planned through this node; one was re-routed elsewhere and never arrives
    book = StepBook(expiry_s=30.0)
    assert book.take(key("d", 7, 0), ("d",), expected=2, now=0.0)
    book.finish(key("d", 7, 0), applied=True, now=0.1)
    assert book.ready(held=0, now=0.2) is None  # still expecting the second one
    assert book.take(key("d", 8, 0), ("d",), expected=1, now=0.3)  # the data node finished iteration 7
    decision = book.ready(held=0, now=0.4)
    assert decision is not None and decision.iteration == 7


def test_groups_that_complete_together_are_separate_updates_oldest_first() -> None:
    """Two data nodes' groups of one tick, and an older one, finishing in any order: one update each, in
    (iteration, data node) order; never merged, so the timing cannot change how many updates a tick makes."""
    for order in ([("e", 3), ("d", 3), ("d", 2)], [("d", 2), ("d", 3), ("e", 3)]):
        book = StepBook(expiry_s=30.0)
        for origin, iteration in order:
            assert book.take(key(origin, iteration, 0), (origin,), expected=1, now=0.0)
        for origin, iteration in order:
            book.finish(key(origin, iteration, 0), applied=True, now=0.0)
        decision = book.ready(held=0, now=0.1)
        assert decision is not None
        assert decision.updates == (("d", 2), ("d", 3), ("e", 3)) and decision.iteration == 3
        assert book.groups == set()


def test_groups_lists_what_is_not_stepped_yet() -> None:
    book = StepBook(expiry_s=30.0)
    assert book.take(key("d", 1, 0), ("d",), expected=1, now=0.0)
    assert book.take(key("e", 2, 0), ("e",), expected=1, now=0.0)
    book.finish(key("e", 2, 0), applied=True, now=0.0)  # complete, but newer than an open group
    assert book.ready(held=0, now=0.1) is None
    # d sent work in tick 1, so it is awaited in tick 2 as well
    assert book.groups == {("d", 1), ("e", 2), ("d", 2)} and book.open_groups == {("d", 1), ("d", 2)}


def test_a_data_node_that_sent_work_last_tick_is_awaited_before_this_tick_steps() -> None:
    """d's tick-5 work finished first; e sent work in tick 4, so tick 5 steps only once e's tick-5 work
    finished too, and both updates ran their forwards on the weights of tick 4, whoever was ahead."""
    book = StepBook(expiry_s=30.0)
    for origin in ("d", "e"):
        assert book.take(key(origin, 4, 0), (origin,), expected=1, now=0.0)
        book.finish(key(origin, 4, 0), applied=True, now=0.1)
    assert book.ready(held=0, now=0.2) is not None  # tick 4
    assert book.take(key("d", 5, 0), ("d",), expected=1, now=1.0)
    book.finish(key("d", 5, 0), applied=True, now=1.5)
    assert book.ready(held=0, now=1.6) is None  # e is awaited
    assert book.take(key("d", 6, 0), ("d",), expected=1, now=1.7) and book.waits(6)  # d waits for the step
    assert book.take(key("e", 5, 0), ("e",), expected=1, now=2.0)
    book.finish(key("e", 5, 0), applied=True, now=2.5)
    decision = book.ready(held=0, now=2.6)
    assert decision is not None and decision.updates == (("d", 5), ("e", 5))


def test_an_awaited_data_node_that_moved_on_or_never_comes_holds_the_step_no_longer() -> None:
    book = StepBook(expiry_s=30.0, await_s=5.0)
    for origin in ("d", "e", "f"):
        assert book.take(key(origin, 4, 0), (origin,), expected=1, now=0.0)
        book.finish(key(origin, 4, 0), applied=True, now=0.0)
    assert book.ready(held=0, now=0.1) is not None
    assert book.take(key("d", 5, 0), ("d",), expected=1, now=1.0)
    book.finish(key("d", 5, 0), applied=True, now=1.0)
    assert book.take(key("e", 6, 0), ("e",), expected=1, now=1.2)  # e sent its tick 5 elsewhere
    assert book.ready(held=0, now=1.3) is None  # f is still awaited in tick 5
    book.expire(now=6.1)  # f died, or is very late: its await ends
    decision = book.ready(held=0, now=6.2)
    assert decision is not None and decision.updates == (("d", 5),)
    assert book.take(key("f", 5, 0), ("f",), expected=1, now=7.0)  # late: taken, for a later step
    book.finish(key("f", 5, 0), applied=True, now=7.1)
    decision = book.ready(held=0, now=7.2)
    assert decision is not None and decision.updates == (("f", 5),)


def test_an_abort_for_an_awaited_group_waits_for_its_forwards() -> None:
    # e's microbatch 1 died upstream before its microbatch 0 reached this node: the group still expects 0
    book = StepBook(expiry_s=30.0)
    for origin in ("d", "e"):
        assert book.take(key(origin, 4, 0), (origin,), expected=1, now=0.0)
        book.finish(key(origin, 4, 0), applied=True, now=0.0)
    book.ready(held=0, now=0.1)
    assert book.take(key("d", 5, 0), ("d",), expected=1, now=1.0)
    book.finish(key("d", 5, 0), applied=True, now=1.0)
    book.finish(key("e", 5, 1), applied=False, now=1.1)  # an abort for the awaited group
    assert book.ready(held=0, now=1.2) is None
    assert book.take(key("e", 5, 0), ("e",), expected=2, now=1.3)
    book.finish(key("e", 5, 0), applied=True, now=1.4)
    decision = book.ready(held=0, now=1.5)
    assert decision is not None and decision.updates == (("d", 5), ("e", 5)) and decision.applied == 2


def test_the_first_tick_waits_for_the_runs_data_nodes() -> None:
    """No tick before says who sends in the first one: it waits for `first_tick_senders` data nodes, so the
    second one's first forward runs on the initial weights too, and at most `await_s` for one that never
    comes."""
    book = StepBook(expiry_s=30.0, await_s=10.0, first_tick_senders=2)
    assert book.take(key("d", 0, 0), ("d",), expected=1, now=0.0)
    book.finish(key("d", 0, 0), applied=True, now=0.5)
    assert book.ready(held=0, now=0.6) is None  # e has not sent yet
    assert book.take(key("e", 0, 0), ("e",), expected=1, now=1.0)
    book.finish(key("e", 0, 0), applied=True, now=1.5)
    decision = book.ready(held=0, now=1.6)
    assert decision is not None and decision.updates == (("d", 0), ("e", 0))
    lone = StepBook(expiry_s=30.0, await_s=10.0, first_tick_senders=2)
    assert lone.take(key("d", 3, 0), ("d",), expected=1, now=0.0)
    lone.finish(key("d", 3, 0), applied=True, now=0.5)
    assert lone.ready(held=0, now=9.9) is None
    decision = lone.ready(held=0, now=10.1)  # the other data node never came
    assert decision is not None and decision.updates == (("d", 3),)
    assert lone.take(key("d", 4, 0), ("d",), expected=1, now=10.2)  # later ticks: no wait for anyone
    lone.finish(key("d", 4, 0), applied=True, now=10.3)
    assert lone.ready(held=0, now=10.4) is not None


def test_the_plan_names_who_sends_in_a_tick() -> None:
    """A run that skips: e sent work in tick 4 but its tick-5 paths leave this node out, and the forwards
    say so (`senders`): tick 5 steps without waiting for e. In tick 6 the plan sends e's work here again:
    e is awaited, although it sent nothing in tick 5."""
    book = StepBook(expiry_s=30.0, await_s=10.0)
    for origin in ("d", "e"):
        assert book.take(key(origin, 4, 0), (origin,), expected=1, now=0.0, senders=frozenset("de"))
        book.finish(key(origin, 4, 0), applied=True, now=0.1)
    assert book.ready(held=0, now=0.2) is not None
    assert book.take(key("d", 5, 0), ("d",), expected=1, now=1.0, senders=frozenset("d"))
    book.finish(key("d", 5, 0), applied=True, now=1.1)
    decision = book.ready(held=0, now=1.2)  # no await for e
    assert decision is not None and decision.updates == (("d", 5),)
    assert book.take(key("d", 6, 0), ("d",), expected=1, now=2.0, senders=frozenset("de"))
    book.finish(key("d", 6, 0), applied=True, now=2.1)
    assert book.ready(held=0, now=2.2) is None  # e is named: awaited
    assert book.take(key("e", 6, 0), ("e",), expected=1, now=2.5, senders=frozenset("de"))
    book.finish(key("e", 6, 0), applied=True, now=2.6)
    decision = book.ready(held=0, now=2.7)
    assert decision is not None and decision.updates == (("d", 6), ("e", 6))


def test_a_named_sender_that_moved_on_or_never_comes_holds_the_step_no_longer() -> None:
    book = StepBook(expiry_s=30.0, await_s=5.0)
    assert book.take(key("e", 7, 0), ("e",), expected=1, now=0.0, senders=frozenset("e"))
    book.finish(key("e", 7, 0), applied=True, now=0.1)
    assert book.ready(held=0, now=0.2) is not None
    # d's plan (another view) says e sends here in tick 6, but e is past it already
    assert book.take(key("d", 6, 0), ("d",), expected=1, now=1.0, senders=frozenset("def"))
    book.finish(key("d", 6, 0), applied=True, now=1.1)
    assert book.ready(held=0, now=1.2) is None  # f, never seen, is named: awaited
    book.expire(now=6.1)  # for at most await_s
    decision = book.ready(held=0, now=6.2)
    assert decision is not None and decision.updates == (("d", 6),)


def test_the_first_tick_waits_for_the_senders_the_plan_names() -> None:
    book = StepBook(expiry_s=30.0, await_s=10.0, first_tick_senders=2)
    assert book.take(key("d", 0, 0), ("d",), expected=1, now=0.0, senders=frozenset("d"))
    book.finish(key("d", 0, 0), applied=True, now=0.5)
    decision = book.ready(held=0, now=0.6)  # the other data node's paths skip this node: no wait
    assert decision is not None and decision.updates == (("d", 0),)
    named = StepBook(expiry_s=30.0, await_s=10.0, first_tick_senders=1)
    assert named.take(key("d", 0, 0), ("d",), expected=1, now=0.0, senders=frozenset("de"))
    named.finish(key("d", 0, 0), applied=True, now=0.5)
    assert named.ready(held=0, now=0.6) is None  # e is named, though the run starts with one data node
    assert named.take(key("e", 0, 0), ("e",), expected=1, now=1.0, senders=frozenset("de"))
    named.finish(key("e", 0, 0), applied=True, now=1.5)
    decision = named.ready(held=0, now=1.6)
    assert decision is not None and decision.updates == (("d", 0), ("e", 0))


def test_a_forward_that_names_nobody_does_not_undo_the_names_of_its_tick() -> None:
    """f's forward was re-routed here (it names nobody): the tick still waits only for the named senders,
    not for every data node of the tick before, whichever forward came first."""
    for order in (("d", "f"), ("f", "d")):
        book = StepBook(expiry_s=30.0, await_s=10.0)
        for origin in "def":
            assert book.take(key(origin, 4, 0), (origin,), expected=1, now=0.0, senders=frozenset("def"))
            book.finish(key(origin, 4, 0), applied=True, now=0.1)
        assert book.ready(held=0, now=0.2) is not None
        for origin in order:
            named = frozenset("df") if origin == "d" else None
            assert book.take(key(origin, 5, 0), (origin,), expected=1, now=1.0, senders=named)
            book.finish(key(origin, 5, 0), applied=True, now=1.1)
        decision = book.ready(held=0, now=1.2)  # e is named by nobody: not awaited
        assert decision is not None and decision.updates == (("d", 5), ("f", 5)), order


def test_a_sender_awaited_in_vain_is_not_awaited_again_in_that_tick() -> None:
    book = StepBook(expiry_s=30.0, await_s=5.0)
    assert book.take(key("d", 6, 0), ("d",), expected=1, now=0.0, senders=frozenset("de"))
    book.finish(key("d", 6, 0), applied=True, now=0.1)
    book.expire(now=5.1)  # e's plan (another view) sent its work elsewhere
    decision = book.ready(held=0, now=5.2)
    assert decision is not None and decision.updates == (("d", 6),) and decision.waited_out == (("e", 6),)
    assert book.take(key("f", 6, 0), ("f",), expected=1, now=5.4, senders=frozenset("def"))  # f is late
    book.finish(key("f", 6, 0), applied=True, now=5.5)
    decision = book.ready(held=0, now=5.6)  # e, waited out once, holds the step no more
    assert decision is not None and decision.updates == (("f", 6),) and decision.waited_out == ()
    moved_on = StepBook(expiry_s=30.0, await_s=5.0)
    assert moved_on.take(key("d", 6, 0), ("d",), expected=1, now=0.0, senders=frozenset("de"))
    assert moved_on.take(key("e", 7, 0), ("e",), expected=1, now=0.5, senders=frozenset("de"))
    moved_on.finish(key("d", 6, 0), applied=True, now=0.6)
    decision = moved_on.ready(held=0, now=0.7)  # e moved on: not a wait that ran out
    assert decision is not None and decision.updates == (("d", 6),) and decision.waited_out == ()


def test_a_data_node_whose_record_shows_a_tick_finished_is_awaited_in_it_no_longer() -> None:
    """d's plan named e here in tick 6, e's own plan (another view) sent its work elsewhere: e's record
    showing step 7 ends the wait (about a second later), not `await_s`."""
    book = StepBook(expiry_s=30.0, await_s=10.0)
    assert book.take(key("d", 6, 0), ("d",), expected=1, now=0.0, senders=frozenset("de"))
    book.finish(key("d", 6, 0), applied=True, now=0.1)
    book.passed("e", 5)
    assert book.ready(held=0, now=0.2) is None  # e is at tick 6 still
    book.passed("e", 6)
    decision = book.ready(held=0, now=1.5)
    assert decision is not None and decision.updates == (("d", 6),) and decision.waited_out == ()
    assert book.take(key("d", 6, 1), ("d",), expected=1, now=1.6) is False  # closed
    assert book.take(key("f", 6, 0), ("f",), expected=1, now=1.7, senders=frozenset("ef"))
    book.finish(key("f", 6, 0), applied=True, now=1.8)
    decision = book.ready(held=0, now=1.9)  # e finished tick 6: not awaited again
    assert decision is not None and decision.updates == (("f", 6),)


def test_a_data_node_that_finished_a_tick_half_here_is_not_waited_for() -> None:
    # d planned 2 microbatches through this node, one came, the other was re-routed elsewhere
    book = StepBook(expiry_s=30.0)
    assert book.take(key("d", 3, 0), ("d",), expected=2, now=0.0, senders=frozenset("d"))
    book.finish(key("d", 3, 0), applied=True, now=0.1)
    assert book.ready(held=0, now=0.2) is None
    book.passed("d", 3)
    decision = book.ready(held=0, now=1.2)
    assert decision is not None and decision.updates == (("d", 3),) and decision.applied == 1
