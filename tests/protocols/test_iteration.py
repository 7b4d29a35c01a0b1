"""The data node's iteration (`protocols.iteration`), driven in memory: every transition and the races that
the daemon's history has fixed, in milliseconds."""

from __future__ import annotations

import pytest

from protocols.errors import LocalProtocolError
from protocols.iteration import (
    DataIteration,
    ForgedReturn,
    MicrobatchState,
    StaleMessage,
    WrongSender,
)
from protocols.iteration_events import (
    AbortPath,
    AbortReceived,
    ApplyGradient,
    BackwardFailed,
    Closed,
    ComputeLoss,
    Drop,
    GradientApplied,
    GradientReturned,
    HeadFailed,
    IterationOutcome,
    LossComputed,
    PeersChecked,
    Ping,
    Returned,
    RouteNotice,
    Send,
    SendGradient,
    Sent,
    Start,
    Suspect,
    Tick,
    Unsent,
)

ME = "data"
PATHS = {0: (ME, "s1a", "s2a", ME), 1: (ME, "s1b", "s2b", ME)}
NONCES = {0: 11, 1: 12}
State = MicrobatchState


def started(evaluation: bool = False, timeout_s: float = 30.0) -> DataIteration:
    iteration = DataIteration(
        me=ME, number=7, paths=PATHS, nonces=NONCES, timeout_s=timeout_s, evaluation=evaluation
    )
    assert iteration.handle(Start(now=0.0)) == (Send(0, PATHS[0], 11), Send(1, PATHS[1], 12))
    return iteration


def returned(mb: int, path: tuple[str, ...] | None = None, nonce: int | None = None) -> Returned:
    return Returned(ME, 7, mb, NONCES[mb] if nonce is None else nonce, path or PATHS[mb])


def gradient(mb: int, peer: str) -> GradientReturned:
    return GradientReturned(peer, ME, 7, mb, NONCES[mb])


def sent_and_back(iteration: DataIteration, mb: int) -> None:
    """Microbatch `mb` sent to its planned first hop, its activations back and its loss computed."""
    iteration.tries(mb).add(PATHS[mb][1])  # the router records its try before it calls
    assert iteration.handle(Sent(mb, PATHS[mb])) == ()
    assert iteration.handle(returned(mb)) == (ComputeLoss(mb),)
    assert iteration.awaits_loss(mb)
    assert iteration.handle(LossComputed(mb, 2.0 + mb)) == (SendGradient(mb),)


def lost(mb: int, reason: str, path: tuple[str, ...] | None = None) -> tuple[Drop, AbortPath]:
    return Drop(mb, reason), AbortPath(mb, path or PATHS[mb], reason)


def test_a_training_microbatch_goes_out_comes_back_and_is_applied() -> None:
    iteration = started()
    sent_and_back(iteration, 0)
    assert iteration.state(0) is State.BACKWARD and not iteration.may_apply(0)
    assert iteration.handle(gradient(0, "s1a")) == (ApplyGradient(0),)
    assert iteration.may_apply(0) and not iteration.awaits_loss(0)
    assert iteration.handle(GradientApplied(0)) == ()  # microbatch 1 is still pending
    assert iteration.state(0) is State.DONE and not iteration.closed
    sent_and_back(iteration, 1)
    iteration.handle(gradient(1, "s1b"))
    outcome = IterationOutcome(losses=(2.0, 3.0), lost=0, timed_out=False, reroutes=0)
    assert iteration.handle(GradientApplied(1)) == (Closed(outcome),)
    assert iteration.closed and iteration.outcome == outcome


def test_an_evaluation_ends_when_its_losses_are_known() -> None:
    iteration = started(evaluation=True)
    for mb in (0, 1):
        iteration.handle(Sent(mb, PATHS[mb]))
        assert iteration.handle(returned(mb)) == (ComputeLoss(mb),)
    assert iteration.handle(LossComputed(0, 4.0)) == ()  # no gradient goes back
    (closed,) = iteration.handle(LossComputed(1, 5.0))
    assert closed == Closed(IterationOutcome((4.0, 5.0), 0, False, 0))


def test_a_data_node_told_of_a_lost_microbatch_aborts_it_along_the_whole_path() -> None:
    # the abort's sender may sit further down the path than nodes that hold the microbatch and take aborts
    # only from peers they know: the data node tells the whole path (81f3244)
    iteration = started()
    iteration.handle(Sent(0, PATHS[0]))
    assert iteration.may_abort("s2a", ME, 7, 0) and not iteration.may_abort("mallory", ME, 7, 0)
    assert iteration.handle(AbortReceived(ME, 7, 0, "s2a overloaded")) == lost(0, "s2a overloaded")
    assert iteration.state(0) is State.LOST
    assert iteration.handle(AbortReceived(ME, 7, 0, "again")) == ()  # lost once
    with pytest.raises(StaleMessage):
        iteration.handle(returned(0))  # nothing of a lost microbatch is taken back


def test_aborts_of_other_iterations_or_data_nodes_change_nothing() -> None:
    iteration = started()
    assert iteration.handle(AbortReceived(ME, 6, 0, "old")) == ()
    assert iteration.handle(AbortReceived("other", 7, 0, "theirs")) == ()
    assert iteration.handle(AbortReceived(ME, 7, 9, "unknown")) == ()
    assert iteration.may_abort("anyone", ME, 7, 9) and iteration.may_abort("anyone", ME, 6, 0)  # then ignored
    assert iteration.state(0) is State.PLANNED


def test_a_microbatch_pending_two_seconds_after_a_peer_on_its_path_fell_silent_is_lost() -> None:
    iteration = started()
    for mb in (0, 1):
        iteration.handle(Sent(mb, PATHS[mb]))
    assert iteration.handle(Tick(now=1.0)) == (Ping(("s1a", "s1b", "s2a", "s2b")),)
    assert iteration.handle(PeersChecked(now=1.0, silent=frozenset({"s2a"}))) == ()  # maybe only slow
    assert iteration.handle(Tick(now=2.0)) == (Ping(("s1a", "s1b", "s2a", "s2b")),)  # asked again
    assert iteration.handle(PeersChecked(now=2.999, silent=frozenset({"s2a"}))) == ()  # within the grace
    assert iteration.state(0) is State.SENT
    dead = PeersChecked(now=3.0, silent=frozenset({"s2a"}))
    assert iteration.handle(dead) == (Suspect("s2a"), *lost(0, "peer s2a is dead"))
    assert iteration.state(1) is State.SENT  # its path never held s2a
    assert iteration.handle(Tick(now=4.0)) == (Ping(("s1b", "s2b")),)  # the dead are not asked again


def test_a_peer_that_answers_again_within_the_grace_was_only_slow() -> None:
    # a replica busy with its NoLoCo round on a loaded machine misses a ping: suspected at once, it left
    # the next plan and its data node sent half the step's microbatches
    iteration = started()
    for mb in (0, 1):
        iteration.handle(Sent(mb, PATHS[mb]))
    assert iteration.handle(PeersChecked(now=1.0, silent=frozenset({"s2a"}))) == ()
    assert iteration.handle(PeersChecked(now=2.0, silent=frozenset())) == ()  # it answered
    assert iteration.handle(PeersChecked(now=3.5, silent=frozenset({"s2a"}))) == ()  # silent afresh
    assert iteration.handle(PeersChecked(now=5.0, silent=frozenset({"s2a"}))) == ()  # 1.5 s, not 2.5 s
    assert iteration.state(0) is State.SENT
    assert iteration.handle(PeersChecked(now=5.5, silent=frozenset({"s2a"})))[0] == Suspect("s2a")
    assert iteration.state(0) is State.LOST


def test_a_microbatch_on_a_path_through_an_unreachable_peer_is_lost_at_once() -> None:
    iteration = started()
    for mb in (0, 1):
        iteration.handle(Sent(mb, PATHS[mb]))
    checked = PeersChecked(now=1.0, silent=frozenset({"s2a", "s2b"}), unreachable=frozenset({"s2a"}))
    assert iteration.handle(checked) == (Suspect("s2a"), *lost(0, "peer s2a is dead"))
    assert iteration.state(1) is State.SENT  # s2b only did not answer in time: it may be slow


def test_a_path_that_came_back_without_a_planned_peer_suspects_it() -> None:
    # the last stage died: the stage before skipped it and sent the activations home before its Route notice
    iteration = started()
    iteration.handle(Sent(0, PATHS[0]))
    skipped = (ME, "s1a", ME)
    assert iteration.handle(returned(0, skipped)) == (ComputeLoss(0), Suspect("s2a"))


def test_a_microbatch_re_routed_around_a_dead_peer_is_not_lost() -> None:
    iteration = started()
    iteration.handle(Sent(0, PATHS[0]))
    iteration.handle(PeersChecked(now=1.0, silent=frozenset({"s2a"})))
    rerouted = (ME, "s1a", "s2c", ME)  # s1a found s2a dead and sent the hop to s2c
    assert iteration.handle(RouteNotice("s1a", ME, 7, 0, NONCES[0], rerouted, hop=1)) == (Suspect("s2a"),)
    assert iteration.path(0) == rerouted
    assert iteration.handle(PeersChecked(now=5.0, silent=frozenset())) == ()
    assert iteration.state(0) is State.SENT
    assert iteration.handle(Tick(now=5.0)) == (Ping(("s1a", "s1b", "s2b", "s2c")),)  # s2c is watched now
    assert iteration.outcome is None


def test_route_notices_out_of_order_or_after_the_return_change_nothing() -> None:
    iteration = started()
    iteration.handle(Sent(0, PATHS[0]))
    later = (ME, "s1a", "s2a", "s3b", ME)
    earlier = (ME, "s1a", "s2c", "s3a", ME)
    iteration.handle(RouteNotice("s2a", ME, 7, 0, NONCES[0], later, hop=2))
    iteration.handle(RouteNotice("s1a", ME, 7, 0, NONCES[0], earlier, hop=1))  # older news
    assert iteration.path(0) == later
    iteration.handle(returned(0, later))
    iteration.handle(RouteNotice("s3b", ME, 7, 0, NONCES[0], (ME, "s1a", "s2a", "s3b", "s4", ME), hop=3))
    assert iteration.path(0) == later  # its activations are back: the notice is old news
    iteration.handle(LossComputed(0, 1.0))
    iteration.handle(AbortReceived(ME, 7, 1, "x"))
    iteration.tries(0).add("s1a")
    iteration.handle(gradient(0, "s1a"))
    (closed,) = iteration.handle(GradientApplied(0))
    assert closed.outcome.reroutes == 1


def test_a_route_notice_that_overtakes_the_first_hops_ack_keeps_its_path() -> None:
    iteration = started()
    noticed = (ME, "s1c", "s2c", ME)
    iteration.handle(RouteNotice("s1c", ME, 7, 0, NONCES[0], noticed, hop=1))
    iteration.handle(Sent(0, (ME, "s1c", "s2a", ME)))  # what the first hop was sent: older than the notice
    assert iteration.state(0) is State.SENT and iteration.path(0) == noticed


def test_activations_that_overtake_the_first_hops_ack_keep_the_path_they_came_back_along() -> None:
    iteration = started()
    came_back = (ME, "s1c", "s2a", ME)  # the planned first hop, s1a, was passed over (it refused or died)
    assert iteration.handle(returned(0, came_back)) == (ComputeLoss(0), Suspect("s1a"))
    assert iteration.handle(Sent(0, (ME, "s1c", "s2a-planned", ME))) == ()
    assert iteration.state(0) is State.RETURNED and iteration.path(0) == came_back
    assert iteration.handle(Unsent(0)) == ()  # a return proves it went out


def test_a_duplicate_return_and_messages_without_the_nonce_are_refused() -> None:
    iteration = started()
    with pytest.raises(ForgedReturn):
        iteration.handle(returned(0, nonce=99))
    with pytest.raises(ForgedReturn):
        iteration.handle(RouteNotice("s1a", ME, 7, 0, 99, (ME, "s1a", "x", ME), hop=1))
    assert iteration.state(0) is State.PLANNED and iteration.path(0) == PATHS[0]
    iteration.handle(returned(0))
    with pytest.raises(StaleMessage, match="came back already"):
        iteration.handle(returned(0))  # a hop that timed out but was delivered sent it twice


def test_messages_of_other_iterations_data_nodes_or_microbatches_are_stale() -> None:
    iteration = started()
    for message in (
        Returned(ME, 6, 0, NONCES[0], PATHS[0]),
        Returned("other", 7, 0, NONCES[0], PATHS[0]),
        Returned(ME, 7, 5, NONCES[0], PATHS[0]),
        GradientReturned("s1a", ME, 8, 0, NONCES[0]),
    ):
        with pytest.raises(StaleMessage) as refused:
            iteration.handle(message)
        assert not isinstance(refused.value, ForgedReturn)


def test_only_a_peer_tried_as_the_first_hop_may_return_the_gradient() -> None:
    iteration = started()
    iteration.tries(0).update({"s1-dead", "s1c"})  # the router tried a dead replica, then re-routed
    iteration.handle(Sent(0, (ME, "s1c", "s2a", ME)))
    iteration.handle(returned(0, (ME, "s1c", "s2a", ME)))
    with pytest.raises(StaleMessage, match="awaits no gradient"):
        iteration.handle(gradient(0, "s1c"))  # before the head computed the loss: no honest peer does this
    iteration.handle(LossComputed(0, 1.0))
    with pytest.raises(WrongSender):
        iteration.handle(gradient(0, "mallory"))  # whatever path mallory's message claims
    assert iteration.may_abort("s1-dead", ME, 7, 0)
    assert iteration.handle(gradient(0, "s1c")) == (ApplyGradient(0),)
    with pytest.raises(StaleMessage):
        iteration.handle(gradient(0, "s1c"))  # a second copy


def test_a_route_notice_must_come_from_the_hop_it_names() -> None:
    iteration = started()
    for hop, path in ((1, (ME, "s1a", "x", ME)), (0, (ME, "s1a", "x", ME)), (3, (ME, "s1a", "x", ME))):
        with pytest.raises(WrongSender):
            iteration.handle(RouteNotice("mallory", ME, 7, 0, NONCES[0], path, hop))
    assert iteration.path(0) == PATHS[0]


def test_late_messages_after_close_never_touch_the_gradients() -> None:
    iteration = started(timeout_s=10.0)
    sent_and_back(iteration, 0)
    iteration.handle(gradient(0, "s1a"))  # its backward pass through the embedding is queued
    iteration.handle(Sent(1, PATHS[1]))
    iteration.handle(returned(1))  # its loss is being computed
    assert iteration.handle(Tick(now=10.0)) == (Ping(("s1b", "s2b")),)  # at the deadline, not past it
    actions = iteration.handle(Tick(now=10.001))
    closed = Closed(IterationOutcome(losses=(), lost=2, timed_out=True, reroutes=0))
    assert actions == (*lost(0, "iteration timed out"), *lost(1, "iteration timed out"), closed)
    assert not iteration.may_apply(0) and not iteration.awaits_loss(1)  # the queued work does nothing
    assert iteration.handle(GradientApplied(0)) == () and iteration.handle(LossComputed(1, 1.0)) == ()
    assert iteration.outcome == closed.outcome
    for message in (returned(1), gradient(0, "s1a"), RouteNotice("s1b", ME, 7, 1, 12, PATHS[1], 1)):
        with pytest.raises(StaleMessage):
            iteration.handle(message)
    assert iteration.handle(AbortReceived(ME, 7, 0, "late")) == ()
    assert iteration.handle(Tick(now=99.0)) == ()
    assert iteration.handle(PeersChecked(now=99.0, silent=frozenset({"s1a"}))) == ()


def test_failures_on_the_way_back_lose_the_microbatch_along_its_path() -> None:
    iteration = started()
    came_back = (ME, "s1a", "s2c", ME)
    iteration.handle(Sent(0, PATHS[0]))
    iteration.handle(returned(0, came_back))
    assert iteration.handle(HeadFailed(0, "float16 overflow")) == lost(0, "float16 overflow", came_back)
    sent_and_back(iteration, 1)
    closed = Closed(IterationOutcome((), 2, False, 0))
    assert iteration.handle(BackwardFailed(1)) == (*lost(1, "backward hop unreachable"), closed)


def test_a_gradient_back_before_the_send_is_acknowledged_is_kept() -> None:
    # the backward hop timed out on this side, yet the gradient made it round: the microbatch is not lost
    iteration = started()
    sent_and_back(iteration, 0)
    iteration.handle(gradient(0, "s1a"))
    assert iteration.handle(BackwardFailed(0)) == ()
    assert iteration.state(0) is State.GRADIENT
    iteration.handle(PeersChecked(now=1.0, silent=frozenset({"s2a"})))
    assert iteration.handle(PeersChecked(now=4.0, silent=frozenset())) == ()  # nothing waits on s2a now


def test_a_microbatch_no_first_hop_took_is_lost_and_its_path_told() -> None:
    iteration = started()
    assert iteration.handle(Unsent(0)) == lost(0, "first hop unreachable")
    iteration.handle(Unsent(1))
    assert iteration.outcome == IterationOutcome((), 2, False, 0)


def test_bad_plans_and_events_this_side_should_not_produce_are_local_errors() -> None:
    def build(**overrides: object) -> DataIteration:
        arguments: dict = {"me": ME, "number": 7, "paths": PATHS, "nonces": NONCES, "timeout_s": 30.0}
        return DataIteration(**(arguments | overrides))

    for overrides in (
        {"paths": {}, "nonces": {}},
        {"nonces": {0: 11}},
        {"paths": {0: ("other", "s1", ME), 1: PATHS[1]}},
        {"paths": {0: (ME,), 1: PATHS[1]}},
        {"nonces": {0: 0, 1: 12}},
        {"nonces": {0: True, 1: 12}},
        {"timeout_s": 0.0},
        {"timeout_s": float("nan")},
        {"dead_grace_s": -1.0},
    ):
        with pytest.raises(LocalProtocolError):
            build(**overrides)
    iteration = build()
    with pytest.raises(LocalProtocolError):
        iteration.handle(Tick(now=1.0))  # before Start
    with pytest.raises(StaleMessage):
        iteration.handle(returned(0))  # nothing is out yet
    iteration.handle(Start(now=0.0))
    with pytest.raises(LocalProtocolError):
        iteration.handle(Start(now=1.0))
    with pytest.raises(LocalProtocolError):
        iteration.handle(Sent(5, PATHS[0]))
    with pytest.raises(LocalProtocolError):
        iteration.tries(5)
