"""CheckFree / CheckFree+: the rebuild math and the decision table."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from protocols.checkfree import (
    DEFAULT_LR_FACTOR,
    SWAP_MIN_STAGES,
    Method,
    Recovery,
    average_neighbours,
    copies_kept,
    copy_partner,
    copy_places,
    copy_source,
    edge_copy_part,
    plan_recoveries,
    plan_recovery,
    reinit_seed,
    restore_embeddings,
    swap_edge_pairs,
    swap_partner,
    swaps_edge_pairs,
)
from protocols.errors import LocalProtocolError
from protocols.standins import MIN_STAND_INS, STAND_IN_WINDOW_STEPS, StandIns
from protocols.transfers import StatePart


def stage(value: float) -> dict[str, torch.Tensor]:
    return {
        "layers.0.attn.q.weight": torch.full((2, 3), value),
        "layers.0.norm.weight": torch.full((3,), value),
    }


# ---- rebuild math -------------------------------------------------------------------------------------


def test_weighted_average_matches_formula() -> None:
    prev = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "b": torch.tensor([0.0, -2.0])}
    nxt = {"w": torch.tensor([[5.0, 6.0], [7.0, 8.0]]), "b": torch.tensor([4.0, 2.0])}
    rebuilt = average_neighbours(prev, nxt, 3.0, 1.0)
    for name in prev:
        torch.testing.assert_close(rebuilt[name], (3.0 * prev[name] + 1.0 * nxt[name]) / 4.0)
    torch.testing.assert_close(rebuilt["w"], torch.tensor([[2.0, 3.0], [4.0, 5.0]]))


def test_weighted_average_on_numpy() -> None:
    rebuilt = average_neighbours({"x": np.array([0.0, 10.0])}, {"x": np.array([10.0, 0.0])}, 1.0, 4.0)
    np.testing.assert_allclose(rebuilt["x"], [8.0, 2.0])


def test_larger_gradient_norm_gets_more_weight() -> None:
    rebuilt = average_neighbours(stage(0.0), stage(1.0), 0.5, 2.5)
    assert rebuilt["layers.0.norm.weight"][0].item() == pytest.approx(2.5 / 3.0)


@pytest.mark.parametrize(("left", "right"), [(0.0, 0.0), (None, 2.0), (1.0, None), (None, None)])
def test_unknown_or_zero_norms_give_plain_average(left: float | None, right: float | None) -> None:
    rebuilt = average_neighbours(stage(1.0), stage(3.0), left, right)
    assert all(torch.all(v == 2.0) for v in rebuilt.values())


def test_one_zero_norm_copies_the_other() -> None:
    rebuilt = average_neighbours(stage(1.0), stage(3.0), 0.0, 2.0)
    assert all(torch.all(v == 3.0) for v in rebuilt.values())


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, True, "1"])
def test_bad_norms_are_rejected(bad: object) -> None:
    with pytest.raises(LocalProtocolError, match="gradient norm"):
        average_neighbours(stage(1.0), stage(3.0), bad, 1.0)


def test_mismatched_keys_and_shapes_are_rejected() -> None:
    other = {"layers.0.attn.q.weight": torch.zeros(2, 3), "layers.1.norm.weight": torch.zeros(3)}
    with pytest.raises(LocalProtocolError, match=r"missing 'layers\.0\.norm\.weight'"):
        average_neighbours(stage(1.0), other, 1.0, 1.0)
    wrong_shape = {**stage(1.0), "layers.0.norm.weight": torch.zeros(4)}
    with pytest.raises(LocalProtocolError, match="shape"):
        average_neighbours(stage(1.0), wrong_shape, 1.0, 1.0)


def test_non_finite_sources_are_rejected() -> None:
    poisoned = {**stage(1.0), "layers.0.norm.weight": torch.tensor([1.0, math.nan, 1.0])}
    with pytest.raises(LocalProtocolError, match="NaN"):
        average_neighbours(stage(1.0), poisoned, 1.0, 1.0)
    with pytest.raises(LocalProtocolError, match="NaN"):
        copy_partner(poisoned)


def test_copy_partner_is_an_exact_copy() -> None:
    source = stage(7.0)
    copied = copy_partner(source)
    assert copied == source and copied is not source


def test_restore_embeddings_merges_exact_copies() -> None:
    e = {"model.embed_tokens.weight": torch.randn(10, 4)}
    e_prime = {"model.norm.weight": torch.ones(4), "lm_head.weight": torch.randn(10, 4)}
    restored = restore_embeddings(e, e_prime)
    assert set(restored) == {*e, *e_prime}
    assert restored["model.embed_tokens.weight"] is e["model.embed_tokens.weight"]
    with pytest.raises(LocalProtocolError, match="both hold"):
        restore_embeddings(e, {**e_prime, **e})


# ---- decision table -----------------------------------------------------------------------------------

CF, CFP, EMB, RE, REP = (
    Method.CHECKFREE,
    Method.CHECKFREE_PLUS_COPY,
    Method.EMBEDDING_COPY,
    Method.REINIT,
    Method.REPLICA,
)


def decide(
    s: int,
    lost: set[int],
    plus: bool = True,
    e_copy: bool = True,
    head_copy: bool = True,
    stood: int | None = None,
) -> dict:
    """The plans' (method, sources), the swap partners having served `stood` microbatches in each edge
    stage's place; by default what a run that skips nothing gives (enough with 4 stages or more, none
    below: the schedule swaps only there)."""
    alive = set(range(s + 1)) - lost
    if stood is None:
        stood = MIN_STAND_INS if s >= SWAP_MIN_STAGES else 0
    plans = plan_recoveries(
        num_stages=s,
        alive=alive,
        checkfree_plus=plus,
        stood_in={1: stood, s: stood} if s >= 2 else {},
        embedding_copy_held=e_copy,
        head_copy_held=head_copy,
    )
    assert set(plans) == lost
    return {k: (p.method, p.sources) for k, p in plans.items()}


@pytest.mark.parametrize(
    ("s", "lost", "plus", "expected"),
    [
        # one middle stage: CheckFree from both neighbours, with or without CheckFree+
        (4, {2}, True, {2: (CF, (1, 3))}),
        (4, {3}, False, {3: (CF, (2, 4))}),
        (3, {2}, False, {2: (CF, (1, 3))}),
        # edge stages: a copy of the swap partner where it stood in (CheckFree+, 4 stages or more)...
        (4, {1}, True, {1: (CFP, (2,))}),
        (4, {4}, True, {4: (CFP, (3,))}),
        # ...else CheckFree over the one transformer neighbour (a copy of it, but not a swap partner's)
        (4, {1}, False, {1: (CF, (2,))}),
        (4, {4}, False, {4: (CF, (3,))}),
        (3, {1, 3}, True, {1: (CF, (2,)), 3: (CF, (2,))}),
        (3, {3}, False, {3: (CF, (2,))}),
        # two adjacent stages lost: neither can be rebuilt
        (4, {2, 3}, True, {2: (RE, ()), 3: (RE, ())}),
        (4, {1, 2}, True, {1: (RE, ()), 2: (RE, ())}),
        (4, {3, 4}, True, {3: (RE, ()), 4: (RE, ())}),
        # non-adjacent losses are independent
        (5, {2, 4}, True, {2: (CF, (1, 3)), 4: (CF, (3, 5))}),
        # s = 2: stages 1 and 2 are each other's only neighbour, and never swap
        (2, {1}, True, {1: (CF, (2,))}),
        (2, {2}, True, {2: (CF, (1,))}),
        (2, {1}, False, {1: (CF, (2,))}),
        (2, {1, 2}, True, {1: (RE, ()), 2: (RE, ())}),
        # s = 1: the only transformer stage has no neighbour
        (1, {1}, True, {1: (RE, ())}),
        # the data stage: from the copies of E on stage 1 and E' on stage s
        (4, {0}, True, {0: (EMB, (1, 4))}),
        (1, {0}, True, {0: (EMB, (1, 1))}),
        (4, {0, 2}, True, {0: (EMB, (1, 4)), 2: (CF, (1, 3))}),
        (4, {0, 1}, True, {0: (RE, ()), 1: (CFP, (2,))}),  # the copy of E died with stage 1
        (4, {0, 4}, True, {0: (RE, ()), 4: (CFP, (3,))}),
        (3, {0, 3}, True, {0: (RE, ()), 3: (CF, (2,))}),
        (1, {0, 1}, True, {0: (RE, ()), 1: (RE, ())}),
        # nothing lost, nothing to do
        (3, set(), True, {}),
    ],
)
def test_decision_table(s: int, lost: set[int], plus: bool, expected: dict) -> None:
    assert decide(s, lost, plus) == expected


def test_missing_copies_mean_reinit_of_the_data_stage() -> None:
    assert decide(3, {0}, e_copy=False) == {0: (RE, ())}
    assert decide(3, {0}, head_copy=False) == {0: (RE, ())}
    reason = plan_recoveries(
        num_stages=3,
        alive={2, 3},
        checkfree_plus=True,
        stood_in={},
        embedding_copy_held=True,
        head_copy_held=False,
    )[0].reason
    assert "stage 1, which holds the copy of E, is lost too" in reason
    assert "no live node of stage 3 holds a copy of E'" in reason


def test_plans_carry_the_optimizer_rule() -> None:
    plans = plan_recoveries(
        num_stages=5,
        alive={0, 2, 3, 5},
        checkfree_plus=True,
        stood_in={1: MIN_STAND_INS, 5: MIN_STAND_INS},
        embedding_copy_held=True,
        head_copy_held=True,
    )
    assert plans[1] == Recovery(1, CFP, (2,), True, DEFAULT_LR_FACTOR, plans[1].reason)
    assert plans[4].method is CF and plans[4].reset_optimizer and plans[4].lr_factor == 1.1
    # an edge stage copied from its only neighbour is a CheckFree rebuild: fresh optimizer, lr x 1.1
    neighbour = plan_recovery(
        3,
        num_stages=3,
        alive={0, 1, 2},
        checkfree_plus=True,
        stood_in={},
        embedding_copy_held=True,
        head_copy_held=True,
    )
    assert neighbour == Recovery(3, CF, (2,), True, DEFAULT_LR_FACTOR, neighbour.reason)
    restored = plan_recovery(
        0,
        num_stages=2,
        alive={1, 2},
        checkfree_plus=True,
        stood_in={},
        embedding_copy_held=True,
        head_copy_held=True,
    )
    assert restored.reset_optimizer and restored.lr_factor == 1.0
    custom = plan_recovery(
        2,
        num_stages=3,
        alive={1, 3},
        checkfree_plus=False,
        stood_in={},
        embedding_copy_held=False,
        head_copy_held=False,
        lr_factor=1.2,
    )
    assert custom.lr_factor == 1.2


def test_joining_a_live_stage_is_a_replica_transfer() -> None:
    plan = plan_recovery(
        2,
        num_stages=3,
        alive={0, 1, 2, 3},
        checkfree_plus=False,
        stood_in={},
        embedding_copy_held=False,
        head_copy_held=False,
    )
    assert (plan.method, plan.sources, plan.reset_optimizer, plan.lr_factor) == (REP, (2,), False, 1.0)


def test_reasons_are_plain() -> None:
    plans = plan_recoveries(
        num_stages=4,
        alive={0, 1, 4},
        checkfree_plus=True,
        stood_in={1: MIN_STAND_INS, 4: MIN_STAND_INS},
        embedding_copy_held=True,
        head_copy_held=True,
    )
    assert plans[2].reason == (
        "stage 2 cannot be rebuilt: its neighbour stage 3 is lost too (adjacent stages lost); "
        "re-initialising it"
    )


def edge_plan(
    stage: int, s: int, alive: set[int], plus: bool, stood: int, swaps: bool = True, held: tuple = ()
) -> Recovery:
    return plan_recovery(
        stage,
        num_stages=s,
        alive=alive,
        checkfree_plus=plus,
        stood_in={stage: stood},
        embedding_copy_held=True,
        head_copy_held=True,
        edge_swaps=swaps,
        edge_copies_held=held,
    )


def test_a_lost_edge_stage_is_the_copy_its_partner_keeps_before_any_swap_partner_copy() -> None:
    for lost, s, partner in ((1, 6, 2), (6, 6, 5), (1, 3, 2), (3, 3, 2), (1, 2, 2), (2, 2, 1)):
        alive = set(range(s + 1)) - {lost}
        held = plan_recovery(
            lost, num_stages=s, alive=alive, checkfree_plus=True, stood_in={lost: STAND_IN_WINDOW_STEPS},
            embedding_copy_held=True, head_copy_held=True, edge_copies_held={lost},
        )  # fmt: skip
        assert (held.method, held.sources, held.reset_optimizer) == (Method.EDGE_COPY, (partner,), True)
        assert held.lr_factor == 1.0  # its own weights, not a neighbour's: no x1.1
        assert held.reason == f"stage {lost} restored from the copy of its weights kept by stage {partner}"
    # the copy of the other edge stage does not help; a lost partner took the copy with it
    other = edge_plan(1, 6, {0, 2, 3, 4, 5, 6}, plus=True, stood=MIN_STAND_INS, held=(6,))
    assert other.method is CFP and "keeps a copy" not in other.reason
    both = edge_plan(1, 6, {0, 3, 4, 5, 6}, plus=True, stood=0, held=(1,))
    assert both.method is Method.REINIT and "stage 2, is lost too" in both.reason
    assert edge_plan(1, 6, {0, 2, 3, 4, 5, 6}, plus=False, stood=0, held=(1,)).method is CF  # CheckFree+ off
    # a middle stage has no edge copy; neither has a model of one transformer stage
    for bad in (3, 0, True):
        with pytest.raises(LocalProtocolError, match="is no edge stage"):
            edge_plan(1, 6, {0, 2, 3, 4, 5, 6}, plus=True, stood=0, held=(bad,))
    with pytest.raises(LocalProtocolError, match="is no edge stage of 1 stages"):
        plan_recoveries(
            num_stages=1, alive={0}, checkfree_plus=True, stood_in={}, embedding_copy_held=True,
            head_copy_held=True, edge_copies_held={1},
        )  # fmt: skip
    plans = plan_recoveries(
        num_stages=4, alive={0, 2, 3}, checkfree_plus=True, stood_in={}, embedding_copy_held=True,
        head_copy_held=True, edge_copies_held={1, 4},
    )  # fmt: skip
    assert {k: p.method for k, p in plans.items()} == {1: Method.EDGE_COPY, 4: Method.EDGE_COPY}


def test_who_keeps_which_copy() -> None:
    first, last = StatePart.FIRST_STAGE_COPY, StatePart.LAST_STAGE_COPY
    assert copy_places(StatePart.EMBEDDING_COPY, 4) == (0, 1) and copy_places(StatePart.HEAD_COPY, 4) == (
        0,
        4,
    )
    assert copy_places(first, 4) == (1, 2) and copy_places(last, 4) == (4, 3)
    assert copy_places(first, 1) is None and copy_places(StatePart.WEIGHTS, 4) is None
    assert copy_source(last, 4) == 4 and copy_source(StatePart.HEAD_COPY, 4) == 0
    with pytest.raises(LocalProtocolError, match="is no copy"):
        copy_source(first, 1)
    kept = [copies_kept(k, 4, True) for k in range(5)]
    assert kept == [(), (StatePart.EMBEDDING_COPY,), (first,), (last,), (StatePart.HEAD_COPY,)]
    assert copies_kept(2, 3, True) == (first, last) and copies_kept(2, 3, False) == ()
    assert copies_kept(1, 2, True) == (StatePart.EMBEDDING_COPY, last)
    assert copies_kept(1, 1, True) == (StatePart.EMBEDDING_COPY, StatePart.HEAD_COPY)
    assert [edge_copy_part(k, 4) for k in range(6)] == [None, first, None, None, last, None]
    assert edge_copy_part(1, 1) is None


def test_without_edge_swaps_an_edge_stage_is_a_partner_copy_only_where_skipping_paths_put_it_there() -> None:
    unswapped = edge_plan(1, 6, {0, 2, 3, 4, 5, 6}, plus=True, stood=0, swaps=False)
    assert (unswapped.method, unswapped.sources) == (CF, (2,))
    assert "; this run does not swap edge stages (edge swaps off)" in unswapped.reason
    skipped = edge_plan(6, 6, {0, 1, 2, 3, 4, 5}, plus=True, stood=MIN_STAND_INS, swaps=False)
    assert (skipped.method, skipped.sources) == (CFP, (5,))
    three = edge_plan(3, 3, {0, 1, 2}, plus=True, stood=0, swaps=False).reason
    assert "never swaps" in three and "edge swaps off" not in three  # the stage count says it first
    with pytest.raises(LocalProtocolError, match="edge_swaps must be a bool"):
        edge_plan(1, 6, {0, 2, 3, 4, 5, 6}, plus=True, stood=0, swaps=1)  # type: ignore[arg-type]


def test_an_edge_stage_is_a_swap_partner_copy_only_where_a_partner_stood_in_recently() -> None:
    swapped = edge_plan(4, 4, {0, 1, 2, 3}, plus=True, stood=MIN_STAND_INS)
    assert (swapped.method, swapped.sources) == (CFP, (3,))
    assert swapped.reason == (
        "stage 4 rebuilt as a copy of stage 3, its CheckFree+ swap partner: a node of stage 3 served "
        f"microbatches in stage 4's place in {MIN_STAND_INS} of the last {STAND_IN_WINDOW_STEPS} steps"
    )
    first = edge_plan(1, 6, {0, 2, 3, 4, 5, 6}, plus=True, stood=40)
    assert (first.method, first.sources, first.lr_factor) == (CFP, (2,), DEFAULT_LR_FACTOR)
    # CheckFree+ on and 4 stages, but no partner node served in its place lately: no swap partner's copy
    for stood in (0, MIN_STAND_INS - 1):
        unswapped = edge_plan(4, 4, {0, 1, 2, 3}, plus=True, stood=stood)
        assert (unswapped.method, unswapped.sources) == (CF, (3,))
        assert "its only transformer neighbour" in unswapped.reason
        assert "CheckFree+ swap partner" not in unswapped.reason


def test_no_recent_stand_in_means_the_fallback_with_the_reason() -> None:
    none = edge_plan(1, 4, {0, 2, 3, 4}, plus=True, stood=0).reason
    assert none == (
        "stage 1 rebuilt as a copy of stage 2, its only transformer neighbour (no swap partner's copy: no "
        "live node of stage 2 keeps a copy of it; no "
        f"live node of stage 2 served a microbatch in stage 1's place in the last {STAND_IN_WINDOW_STEPS} "
        "steps; a neighbour's copy recovers at least as well as fresh weights)"
    )
    few = edge_plan(1, 4, {0, 2, 3, 4}, plus=True, stood=MIN_STAND_INS - 1).reason
    assert (
        f"live nodes of stage 2 served microbatches in stage 1's place in at most {MIN_STAND_INS - 1} of "
        f"the last {STAND_IN_WINDOW_STEPS} steps, fewer than {MIN_STAND_INS}"
    ) in few
    # stale: a partner whose stand-ins all lie more than the window behind the clock reports none
    stale = StandIns()
    for iteration in range(10, 10 + MIN_STAND_INS):
        stale = stale.add(iteration, (True, False), iteration)
    assert stale.recent(20) == (MIN_STAND_INS, 0)
    counted = stale.recent(20 + STAND_IN_WINDOW_STEPS)[0]
    assert counted == 0 and edge_plan(1, 4, {0, 2, 3, 4}, True, counted).method is CF
    # a partner rebuilt since (a new node) has served nothing in the place yet: its tally starts empty
    fresh = StandIns().recent(500)[0]
    assert edge_plan(1, 4, {0, 2, 3, 4}, True, fresh).reason == none


def test_edge_reasons_say_what_was_chosen_and_why() -> None:
    three = edge_plan(3, 3, {0, 1, 2}, plus=True, stood=0).reason
    assert three.startswith("stage 3 rebuilt as a copy of stage 2, its only transformer neighbour")
    assert "no live node of stage 2 served a microbatch in stage 3's place" in three
    assert "a model of 3 transformer stages never swaps" in three
    assert three.endswith("a neighbour's copy recovers at least as well as fresh weights)")
    # a 3-stage run that skips stage 3 on some paths: stage 2 did serve in its place, and says so
    skipped = edge_plan(3, 3, {0, 1, 2}, plus=True, stood=MIN_STAND_INS)
    assert (skipped.method, skipped.sources) == (CFP, (2,))
    off = edge_plan(1, 4, {0, 2, 3, 4}, plus=False, stood=MIN_STAND_INS).reason
    assert off.startswith("stage 1 rebuilt as a copy of stage 2, its only transformer neighbour")
    assert "no swap partner's copy: CheckFree+ is off" in off
    lost = edge_plan(1, 3, {0, 3}, plus=True, stood=0)
    assert (lost.method, lost.reason) == (
        RE,
        "stage 1 cannot be rebuilt: its only transformer neighbour, stage 2, is lost too (two adjacent "
        "stages lost); re-initialising it",
    )
    partner_lost = edge_plan(1, 4, {0, 3, 4}, plus=True, stood=MIN_STAND_INS)
    assert (partner_lost.method, partner_lost.sources) == (RE, ())
    assert "stage 2, is lost too" in partner_lost.reason


@pytest.mark.parametrize(
    "stood_in",
    [{2: 5}, {0: 5}, {1: -1}, {1: True}, {1: 2.0}, {5: 3}],
)
def test_stand_in_counts_of_no_edge_stage_or_no_count_are_rejected(stood_in: dict) -> None:
    with pytest.raises(LocalProtocolError, match="stood_in"):
        plan_recovery(
            1,
            num_stages=4,
            alive={0, 2, 3, 4},
            checkfree_plus=True,
            stood_in=stood_in,
            embedding_copy_held=True,
            head_copy_held=True,
        )
    with pytest.raises(LocalProtocolError):
        edge_plan(1, 4, {2, 3, 4}, plus=1, stood=5)  # type: ignore[arg-type]


def test_swap_partners() -> None:
    assert [swap_partner(k, 5) for k in range(6)] == [None, 2, None, None, None, 4]
    assert [swap_partner(k, 3) for k in range(4)] == [None, 2, None, 2]
    assert [swap_partner(k, 2) for k in range(3)] == [None, 2, 1]
    assert [swap_partner(k, 1) for k in range(2)] == [None, None]


# ---- re-initialisation ----------------------------------------------------------------------------------


def test_reinit_seed_is_fresh_for_each_stage_and_step_and_not_the_runs() -> None:
    seeds = {reinit_seed(run, k, t) for run in (0, 1, 7) for k in range(4) for t in (0, 5, 120)}
    assert len(seeds) == 3 * 4 * 3  # one seed per (run, stage, step)
    assert not seeds & {0, 1, 7}
    assert all(isinstance(x, int) and 0 <= x < 2**63 for x in seeds)
    assert reinit_seed(3, 2, 40) == reinit_seed(3, 2, 40)  # replicas re-initialised together agree


@pytest.mark.parametrize("args", [(0, -1, 3), (0, 1, -3), (0, True, 3), (0.5, 1, 3), ("0", 1, 3)])
def test_reinit_seed_rejects_bad_input(args: tuple) -> None:
    with pytest.raises(LocalProtocolError):
        reinit_seed(*args)


@pytest.mark.parametrize(
    "kwargs",
    [{"num_stages": 0}, {"alive": {5}}, {"alive": {-1}}, {"lr_factor": 0.0}, {"lr_factor": math.nan}],
)
def test_bad_arguments_are_rejected(kwargs: dict) -> None:
    args = {
        "num_stages": 3,
        "alive": {0, 1},
        "checkfree_plus": True,
        "stood_in": {},
        "embedding_copy_held": True,
        "head_copy_held": True,
    }
    with pytest.raises(LocalProtocolError):
        plan_recoveries(**{**args, **kwargs})
    with pytest.raises(LocalProtocolError):
        plan_recovery(2, **{**args, **kwargs})


def test_stage_out_of_range_is_rejected() -> None:
    with pytest.raises(LocalProtocolError):
        plan_recovery(
            4,
            num_stages=3,
            alive={0},
            checkfree_plus=True,
            stood_in={},
            embedding_copy_held=True,
            head_copy_held=True,
        )


# ---- CheckFree+ swaps ----------------------------------------------------------------------------------


def test_every_other_microbatch_swaps_alternating_between_iterations() -> None:
    # one microbatch per iteration: it swaps every other iteration; two: one of them in every iteration
    assert [swaps_edge_pairs(6, t, 0) for t in range(4)] == [False, True, False, True]
    for t in range(4):
        assert sum(swaps_edge_pairs(6, t, m) for m in range(2)) == 1
    # over any two iterations every microbatch slot (so every data node) swaps exactly once
    for m in range(5):
        assert sum(swaps_edge_pairs(4, t, m) for t in (7, 8)) == 1


def test_a_quarter_of_the_microbatches_swap_evenly_when_asked() -> None:
    # one in four, still even: every slot swaps once in any four iterations, one slot of four per iteration
    for m in range(5):
        assert sum(swaps_edge_pairs(6, t, m, every=4) for t in range(3, 7)) == 1
    for t in range(4):
        assert sum(swaps_edge_pairs(6, t, m, every=4) for m in range(4)) == 1
    with pytest.raises(LocalProtocolError, match="every 1"):
        swaps_edge_pairs(6, 0, 0, every=1)


def test_models_of_fewer_than_four_stages_never_swap() -> None:
    assert not any(swaps_edge_pairs(s, t, m) for s in (1, 2, 3) for t in range(4) for m in range(4))
    with pytest.raises(LocalProtocolError):
        swaps_edge_pairs(6, -1, 0)


@pytest.mark.parametrize(
    ("stages", "expected"),
    [
        ((1, 2, 3, 4, 5, 6), (2, 1, 3, 4, 6, 5)),
        ((1, 2, 4, 6), (2, 1, 4, 6)),  # a path that skips stage 5: only the first pair
        ((1, 3, 5, 6), (1, 3, 6, 5)),  # a path that skips stage 2: only the last pair
        ((2, 3, 4), (2, 3, 4)),
    ],
)
def test_swap_edge_pairs_reorders_the_pairs_a_path_visits_in_a_row(
    stages: tuple[int, ...], expected: tuple[int, ...]
) -> None:
    order = swap_edge_pairs(stages, 6)
    assert tuple(stages[i] for i in order) == expected
