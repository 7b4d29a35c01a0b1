"""NoLoCo outer step and pairing: math against hand-computed numbers, pairing driven in memory."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from protocols._arraymap import first_non_finite
from protocols.errors import LocalProtocolError
from protocols.messages import Decline
from protocols.noloco import (
    OuterConfig,
    PairingRound,
    Phase,
    diloco_outer_step,
    exchange_problem,
    find_partner,
    match_replicas,
    noloco_outer_step,
    pairing_seed,
)

CFG = OuterConfig()  # alpha 0.5, beta 0.7, gamma tied to beta


def arr(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float64)


def test_defaults_follow_the_paper() -> None:
    assert (CFG.alpha, CFG.beta, CFG.outer_gamma, CFG.inner_steps, CFG.group_size) == (0.5, 0.7, 0.7, 50, 2)
    assert OuterConfig(beta=0.4).outer_gamma == 0.4
    assert OuterConfig(gamma=0.2).outer_gamma == 0.2


@pytest.mark.parametrize(
    "kwargs",
    [{"alpha": -0.1}, {"beta": float("nan")}, {"gamma": float("inf")}, {"inner_steps": 0}, {"group_size": 3}],
)
def test_config_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(LocalProtocolError):
        OuterConfig(**kwargs)


def test_due_every_h_steps() -> None:
    cfg = OuterConfig(inner_steps=3)
    last, due = 0, []
    for step in range(10):
        outer = cfg.due(step, last)
        if outer is not None:
            due.append((step, outer))
            last = outer
    assert due == [(3, 1), (6, 2), (9, 3)]
    assert cfg.outer_step_of(6) == 2


def test_due_when_the_clock_jumps_past_a_boundary() -> None:
    # a replica that saw no microbatch for a while: its clock goes from 2 to 7 and outer step 2 is due
    cfg = OuterConfig(inner_steps=3)
    assert cfg.due(2, 0) is None
    assert cfg.due(7, 0) == 2
    assert cfg.due(7, 2) is None
    assert cfg.due(9, 2) == 3


def test_hand_computed_pair() -> None:
    # i: phi 1, theta 2, delta 0.2; partner j: phi 3, theta 5, delta 0.  theta_bar 3.5, phi_bar 2.
    # delta_i = 0.5*0.2 + 0.7*(3.5-2) - 0.7*(1-2) = 0.1 + 1.05 + 0.7 = 1.85 -> phi_i = 2.85
    # delta_j = 0 + 1.05 - 0.7*(3-2) = 0.35 -> phi_j = 3.35
    mine = noloco_outer_step(
        CFG, {"w": arr(1.0)}, {"w": arr(2.0)}, {"w": arr(0.2)}, [{"w": arr(3.0)}], [{"w": arr(5.0)}]
    )
    theirs = noloco_outer_step(
        CFG, {"w": arr(3.0)}, {"w": arr(5.0)}, None, [{"w": arr(1.0)}], [{"w": arr(2.0)}]
    )
    np.testing.assert_allclose(mine.delta["w"], [1.85])
    np.testing.assert_allclose(mine.phi["w"], [2.85])
    np.testing.assert_allclose(theirs.delta["w"], [0.35])
    np.testing.assert_allclose(theirs.phi["w"], [3.35])


def test_sign_moves_phi_towards_theta() -> None:
    result = noloco_outer_step(CFG, {"w": arr(0.0)}, {"w": arr(1.0)}, None)
    assert result.phi["w"][0] == pytest.approx(0.7)


def test_lone_step_is_lookahead_with_momentum() -> None:
    phi, theta, delta = {"w": arr(1.0, -1.0)}, {"w": arr(3.0, 0.0)}, {"w": arr(0.4, 0.4)}
    result = noloco_outer_step(CFG, phi, theta, delta)
    expected = 0.5 * arr(0.4, 0.4) + 0.7 * arr(2.0, 1.0)
    np.testing.assert_allclose(result.delta["w"], expected)
    np.testing.assert_allclose(result.phi["w"], phi["w"] + expected)


def test_identical_replicas_stay_put() -> None:
    weights = {"a": torch.randn(3, 4), "b": torch.randn(5)}
    zero = {k: torch.zeros_like(v) for k, v in weights.items()}
    result = noloco_outer_step(CFG, weights, weights, zero, [weights], [weights])
    for name, value in weights.items():
        assert torch.equal(result.phi[name], value)
        assert torch.equal(result.delta[name], zero[name])


def test_inputs_are_not_modified() -> None:
    phi, theta = {"w": torch.ones(2)}, {"w": torch.full((2,), 3.0)}
    noloco_outer_step(CFG, phi, theta, {"w": torch.ones(2)}, [{"w": torch.zeros(2)}], [{"w": torch.zeros(2)}])
    assert torch.equal(phi["w"], torch.ones(2)) and torch.equal(theta["w"], torch.full((2,), 3.0))


def test_everyone_in_the_group_is_diloco() -> None:
    cfg = OuterConfig.diloco_baseline()
    phi, delta = {"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([0.1, -0.1])}
    thetas = [
        {"w": torch.tensor([2.0, 2.0])},
        {"w": torch.tensor([0.0, 4.0])},
        {"w": torch.tensor([1.0, 3.0])},
    ]
    diloco = diloco_outer_step(cfg, phi, delta, thetas)
    expected_delta = 0.3 * delta["w"] + 0.7 * (torch.tensor([1.0, 3.0]) - phi["w"])
    torch.testing.assert_close(diloco.delta["w"], expected_delta)
    torch.testing.assert_close(diloco.phi["w"], phi["w"] + expected_delta)
    # NoLoCo with G = all replicas (who share phi after every DiLoCo step) gives the same for each of them.
    for k in range(3):
        others = thetas[:k] + thetas[k + 1 :]
        noloco = noloco_outer_step(cfg, phi, thetas[k], delta, [phi, phi], others)
        torch.testing.assert_close(noloco.phi["w"], diloco.phi["w"])


def test_mismatched_layouts_are_rejected() -> None:
    phi = {"w": arr(1.0, 2.0)}
    with pytest.raises(LocalProtocolError, match="missing"):
        noloco_outer_step(CFG, phi, {"v": arr(1.0, 2.0)}, None)
    with pytest.raises(LocalProtocolError, match="shape"):
        noloco_outer_step(CFG, phi, phi, None, [{"w": arr(1.0)}], [phi])
    with pytest.raises(LocalProtocolError, match="partner"):
        noloco_outer_step(CFG, phi, phi, None, [phi], [])


# ---- pairing --------------------------------------------------------------------------------------------

PEERS = [f"peer{i}" for i in range(7)]


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 6, 7])
def test_matching_is_a_partition_with_at_most_one_single(count: int) -> None:
    groups = match_replicas(PEERS[:count], seed=42)
    members = [p for g in groups for p in g]
    assert sorted(members) == sorted(PEERS[:count])
    assert all(len(g) in (1, 2) for g in groups)
    assert sum(len(g) == 1 for g in groups) == count % 2


def test_everyone_agrees_whatever_order_they_list_peers_in() -> None:
    seed = pairing_seed("run", 3, 17)
    views = [list(p) for p in itertools.islice(itertools.permutations(PEERS[:6]), 0, 720, 97)]
    partners = {me: {find_partner(me, view, seed) for view in views} for me in PEERS[:6]}
    assert all(len(found) == 1 for found in partners.values())
    for me, (partner,) in partners.items():
        assert partner is not None and find_partner(partner, PEERS[:6], seed) == me


def test_odd_view_leaves_exactly_one_alone_and_adds_me() -> None:
    seed = pairing_seed("run", 1, 5)
    alone = [me for me in PEERS if find_partner(me, PEERS, seed) is None]
    assert len(alone) == 1
    assert find_partner("me", [], seed) is None
    assert find_partner("me", ["other"], seed) == "other"


def test_matching_changes_across_outer_steps() -> None:
    peers = PEERS[:4]
    seen = {match_replicas(peers, pairing_seed("run", 1, step)) for step in range(60)}
    assert len(seen) == 3  # all three perfect matchings of four peers occur
    assert pairing_seed("run", 1, 1) != pairing_seed("run", 2, 1) != pairing_seed("other", 2, 1)


def test_group_size_one_never_pairs() -> None:
    assert find_partner("a", ["a", "b"], seed=1, group_size=1) is None


# ---- one round on both sides, through an in-memory exchange ---------------------------------------------


def make_round(me: str, now: float = 0.0, replicas: tuple[str, ...] = ("a", "b")) -> PairingRound:
    return PairingRound(outer_step=4, me=me, replicas=replicas, seed=9, now=now, timeout_s=10.0)


def state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((2, 2), value), "b": torch.full((2,), value)}


def test_pair_exchanges_and_both_step() -> None:
    a, b = make_round("a"), make_round("b")
    assert a.partner == "b" and b.partner == "a" and a.initiator and not b.initiator
    phi_a, theta_a, phi_b, theta_b = state(1.0), state(2.0), state(3.0), state(5.0)
    # a sends its request; b checks and takes it, then replies with its own pre-step tensors.
    assert b.decline("a", 4) is None
    assert b.deliver("a", phi_a, theta_a, own_phi=phi_b).phase is Phase.PAIRED
    outcome_a = a.deliver("b", phi_b, theta_b, own_phi=phi_a)
    assert outcome_a.phase is Phase.PAIRED and outcome_a.partner == "b"
    new_a = noloco_outer_step(CFG, phi_a, theta_a, None, outcome_a.partner_phis, outcome_a.partner_thetas)
    new_b = noloco_outer_step(CFG, phi_b, theta_b, None, b.outcome.partner_phis, b.outcome.partner_thetas)
    torch.testing.assert_close(new_a.phi["w"], torch.full((2, 2), 1.0 + 0.7 * 1.5 + 0.7))
    torch.testing.assert_close(new_b.phi["w"], torch.full((2, 2), 3.0 + 0.7 * 1.5 - 0.7))
    # done: a second request, a late delivery, a failure and the clock change nothing.
    assert b.decline("a", 4)[0] is Decline.FINISHED
    assert a.deliver("b", state(0.0), state(0.0), own_phi=phi_a) is outcome_a
    assert a.fail("late") is outcome_a and a.tick(100.0) is outcome_a


def test_alone_without_partner() -> None:
    solo = make_round("a", replicas=("a",))
    assert solo.partner is None and not solo.initiator and solo.phase is Phase.ALONE
    assert solo.outcome.partner_phis == () and solo.outcome.partner_thetas == ()


def test_requests_are_checked() -> None:
    a, b = make_round("a"), make_round("b")
    assert b.decline("a", 5) == (Decline.NOT_REACHED, "outer step 5 not reached, at 4")
    assert b.decline("a", 3)[0] is Decline.OTHER_OUTER_STEP
    assert b.decline("c", 4)[0] is Decline.NOT_PARTNER and "not this node's partner" in b.decline("c", 4)[1]
    assert a.decline("b", 4)[0] is Decline.INITIATOR
    with pytest.raises(LocalProtocolError):
        b.deliver("c", state(1.0), state(1.0), own_phi=state(1.0))


def test_partner_vanished_falls_back_alone() -> None:
    a = make_round("a")
    outcome = a.fail("connection refused")
    assert outcome.phase is Phase.ALONE and "connection refused" in outcome.reason
    assert a.decline("b", 4)[0] is Decline.FINISHED


def test_timeout_falls_back_alone() -> None:
    b = make_round("b", now=100.0)
    assert b.tick(109.9) is None and b.phase is Phase.WAITING
    assert b.tick(110.0).phase is Phase.ALONE
    assert "timed out" in b.outcome.reason


@pytest.mark.parametrize(
    ("phi", "theta", "words"),
    [
        ({"w": torch.ones(2, 2)}, state(1.0), "partial"),  # a tensor never arrived
        (state(1.0), {"w": torch.ones(2, 2), "b": torch.ones(1)}, "partial"),  # truncated tensor
        (state(1.0), {"w": torch.ones(2, 2), "b": torch.tensor([1.0, float("nan")])}, "non-finite"),
        ({"w": torch.ones(2, 2), "b": torch.tensor([float("inf"), 0.0])}, state(1.0), "non-finite"),
    ],
)
def test_incomplete_or_bad_exchange_is_never_mixed(phi: dict, theta: dict, words: str) -> None:
    a = make_round("a")
    outcome = a.deliver("b", phi, theta, own_phi=state(0.0))
    assert outcome.phase is Phase.ALONE and words in outcome.reason
    assert outcome.partner_phis == ()


@pytest.mark.parametrize("array", [torch.tensor, np.array])
def test_a_non_finite_value_anywhere_is_found(array) -> None:  # type: ignore[no-untyped-def]
    for size in (1, 2, 17, 1000):
        for where in {0, size // 2, size - 1}:
            for bad in (float("nan"), float("inf"), float("-inf")):
                values = [0.5] * size
                values[where] = bad
                assert first_non_finite({"ok": array([1.0, 2.0]), "bad": array(values)}) == "bad"
    assert first_non_finite({"w": array([[1.0, -3.0]]), "empty": array([])}) is None


def test_a_checked_delivery_follows_the_verdict_it_is_given() -> None:
    phi, theta = state(1.0), state(1.0)
    verdict = exchange_problem("b", phi, {**theta, "b": torch.tensor([1.0, float("nan")])}, state(1.0))
    assert verdict is not None and "non-finite theta 'b'" in verdict
    alone = make_round("a").deliver_checked("b", phi, theta, verdict)
    assert alone.phase is Phase.ALONE and alone.reason == verdict and alone.partner_phis == ()
    assert exchange_problem("b", phi, theta, state(1.0)) is None
    paired = make_round("a").deliver_checked("b", phi, theta, None)
    assert paired.phase is Phase.PAIRED and paired.partner_phis == (phi,)
    with pytest.raises(LocalProtocolError):
        make_round("a").deliver_checked("c", phi, theta, None)  # not this round's partner


def test_round_rejects_bad_timeout() -> None:
    with pytest.raises(LocalProtocolError):
        PairingRound(outer_step=1, me="a", replicas=(), seed=0, now=0.0, timeout_s=0.0)


def test_out_of_bounds_exchange_falls_back_alone() -> None:
    for phi, theta in ((state(1e30), state(1.0)), (state(1.0), state(-1e30)), (state(1.0), state(9.0))):
        b = make_round("b")
        outcome = b.deliver("a", phi, theta, own_phi=state(1.0))
        assert outcome.phase is Phase.ALONE and "out-of-bounds" in outcome.reason, outcome
        assert outcome.partner_phis == () and outcome.partner_thetas == ()
