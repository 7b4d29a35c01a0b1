"""Magnitude bounds on peers' tensors, clocks and optimizer state (protocols.bounds)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from protocols.bounds import (
    CLOCK_MARGIN,
    MAX_DRIFT,
    clock_problem,
    drift_problem,
    moments_problem,
    norm,
    relative_distance,
    size_problem,
)
from protocols.checkfree import DEFAULT_LR_FACTOR, replica_lr_factor
from protocols.errors import LocalProtocolError, RemoteProtocolError


def stage(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((3, 4), value), "b": torch.full((4,), value)}


def test_norm_and_relative_distance_over_the_whole_stage() -> None:
    assert norm(stage(2.0)) == pytest.approx(2.0 * 4.0)  # 16 elements of 2
    assert relative_distance(stage(3.0), stage(2.0)) == pytest.approx(0.5)
    arrays = {"w": np.ones((2, 2)), "b": np.zeros(3)}  # any array-like
    assert relative_distance({"w": np.full((2, 2), 3.0), "b": np.zeros(3)}, arrays) == pytest.approx(2.0)


def test_drift_within_the_bound_passes_and_beyond_it_is_named() -> None:
    ours = stage(1.0)
    assert drift_problem(ours, [("phi", stage(1.5)), ("theta", stage(1.0 + MAX_DRIFT))]) is None
    problem = drift_problem(ours, [("phi", stage(1.0)), ("theta", stage(1e30))])
    assert problem is not None and problem.startswith("theta") and "at most 4" in problem
    one_tensor = {"w": torch.full((3, 4), 1e30), "b": torch.ones(4)}  # a single poisoned tensor counts
    assert drift_problem(ours, [("phi", one_tensor)]) is not None
    nan = {"w": torch.full((3, 4), math.nan), "b": torch.ones(4)}
    assert drift_problem(ours, [("phi", nan)]) is not None  # NaN never passes a comparison
    assert drift_problem({"w": torch.zeros(2)}, [("phi", {"w": torch.ones(2)})]) is not None
    with pytest.raises(LocalProtocolError):
        drift_problem(ours, [], bound=0.0)


def test_size_of_an_update_against_the_weights() -> None:
    assert size_problem("delta", stage(0.5), stage(1.0)) is None
    assert "delta has inf x" in (size_problem("delta", stage(1e30), stage(1.0)) or "")  # overflows
    assert "delta has 5 x" in (size_problem("delta", stage(5.0), stage(1.0)) or "")


def test_clock_and_outer_step_within_the_swarm_range() -> None:
    assert clock_problem(100, 10, clock=100, inner_steps=10) is None
    assert clock_problem(100 + CLOCK_MARGIN, 10, clock=100, inner_steps=10) is None
    assert clock_problem(0, 0, clock=100, inner_steps=10) is None  # behind: the joiner catches up
    assert "ahead of the swarm clock" in (clock_problem(2**63 - 1, 0, clock=100, inner_steps=10) or "")
    assert "outer step 11" in (clock_problem(100, 11, clock=100, inner_steps=10) or "")
    with pytest.raises(LocalProtocolError):
        clock_problem(1, 0, clock=-1, inner_steps=10)
    with pytest.raises(LocalProtocolError):
        clock_problem(1, 0, clock=1, inner_steps=0)


def moments(step: float, exp_avg: float, exp_avg_sq: float) -> tuple[torch.Tensor, ...]:
    return torch.tensor(step), torch.full((2, 3), exp_avg), torch.full((2, 3), exp_avg_sq)


def test_adam_moments_within_what_clipped_gradients_produce() -> None:
    assert moments_problem("w", *moments(5, -1.0, 1.0), max_grad_norm=1.0, max_step=5) is None
    for bad, what in (
        (moments(6, 0.1, 0.1), "adam step 6"),
        (moments(2.0**63 - 1, 0.1, 0.1), "adam step"),
        (moments(-1, 0.1, 0.1), "adam step -1"),
        (moments(1, 1e30, 0.1), "exp_avg of w"),
        (moments(1, -2.0, 0.1), "exp_avg of w"),
        (moments(1, 0.1, 1.5), "exp_avg_sq of w"),
        (moments(1, 0.1, -1e-3), "exp_avg_sq of w"),
    ):
        problem = moments_problem("w", *bad, max_grad_norm=1.0, max_step=5)
        assert problem is not None and what in problem, (bad, problem)
    assert moments_problem("w", *moments(1, 2.0, 4.0), max_grad_norm=2.0, max_step=5) is None


def test_replica_lr_factor_only_as_the_recovery_rules_set_it() -> None:
    assert replica_lr_factor(1.0) == 1.0
    assert replica_lr_factor(DEFAULT_LR_FACTOR) == DEFAULT_LR_FACTOR
    assert replica_lr_factor(1.0 + 1e-12) == 1.0  # the rule's value, not the donor's
    for lie in (10.0, 0.5, math.nan, 1.21):
        with pytest.raises(RemoteProtocolError):
            replica_lr_factor(lie)
