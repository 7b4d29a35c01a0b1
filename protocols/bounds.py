"""Magnitude bounds on what peers send: NoLoCo partners' weights, donors' clocks and optimizer state.

Names, shapes and finiteness are checked elsewhere; these checks catch finite values no honest peer sends
(`1e30` tensors, `step = 2**63 - 1`). Each returns why the input is out of bounds, or None. Array maps are
mappings name -> array-like, as in `protocols._arraymap`.

`MAX_DRIFT` bounds an averaging partner's phi and theta, and a donor's slow weights phi and outer momentum
delta, relative to the weights they are compared with: ||theirs - ours|| / ||ours|| over the whole stage.
Measured on two honest NoLoCo replicas of the tiny preset (lr 3e-3 with warm-up, the partner's theta against
our phi, paired every outer step): at most 0.53 per stage with H = 10 and 1.26 with H = 50, both in the first
outer step from the initial weights, where the weights are smallest; later outer steps measure less. Per
tensor the same runs reach 3.4 (a small projection at init), so the bound is per stage. 4.0 leaves three
times the worst honest value; a poisoned map of `1e30` is out by some thirty orders of magnitude.

A donor's step may lead the swarm clock (the furthest step of an online data node, as the records show it)
by at most `CLOCK_MARGIN` steps: records are up to one publishing period old, and a lead costs the joiner
its place in the NoLoCo schedule. Its outer step is at most the one its step has reached.

Adam's `exp_avg` is an average of gradients clipped to total norm `max_grad_norm`, so no element exceeds
`max_grad_norm`, and no element of `exp_avg_sq` exceeds its square (`MOMENT_SLACK` allows for rounding).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from protocols._arraymap import ArrayMap, shape_of
from protocols.errors import LocalProtocolError

MAX_DRIFT = 4.0
CLOCK_MARGIN = 32
MOMENT_SLACK = 1.01
_TINY = 1e-12  # the norm below which a map counts as zero


def norm(tensors: ArrayMap) -> float:
    """The L2 norm of all the tensors together (inf if it overflows)."""
    return math.sqrt(sum(_squares(value) for value in tensors.values()))


def relative_distance(theirs: ArrayMap, ours: ArrayMap) -> float:
    """||theirs - ours|| / ||ours|| over the names of `ours` (same layout assumed; inf if it overflows)."""
    squares = sum(_squares(theirs[name] - value) for name, value in ours.items())  # one tensor at a time
    return math.sqrt(squares) / max(norm(ours), _TINY)


def drift_problem(
    ours: ArrayMap, labelled: Sequence[tuple[str, ArrayMap]], bound: float = MAX_DRIFT
) -> str | None:
    """Why a labelled map lies too far from `ours` (relative distance above `bound`), or None."""
    _check_bound("bound", bound)
    for label, theirs in labelled:
        distance = relative_distance(theirs, ours)
        if not distance <= bound:  # NaN fails too
            return f"{label} is {distance:.3g} x our norm away from ours (at most {bound:g})"
    return None


def size_problem(label: str, tensors: ArrayMap, ours: ArrayMap, bound: float = MAX_DRIFT) -> str | None:
    """Why `tensors` (an update such as NoLoCo's delta) are too large against `ours`, or None."""
    _check_bound("bound", bound)
    ratio = norm(tensors) / max(norm(ours), _TINY)
    if not ratio <= bound:
        return f"{label} has {ratio:.3g} x the norm of the weights (at most {bound:g})"
    return None


def clock_problem(
    step: int, outer_step: int, *, clock: int, inner_steps: int, margin: int = CLOCK_MARGIN
) -> str | None:
    """Why a donor's `step` and `outer_step` lie outside the swarm's range at swarm clock `clock`, or None."""
    for name, value, least in (("clock", clock, 0), ("inner_steps", inner_steps, 1), ("margin", margin, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise LocalProtocolError(f"{name} must be an int >= {least}, got {value!r}")
    if step > clock + margin:
        return f"step {step} is ahead of the swarm clock {clock} by more than {margin}"
    if outer_step > step // inner_steps:
        return f"outer step {outer_step} is past the one step {step} reaches ({step // inner_steps})"
    return None


def moments_problem(
    name: str, step: Any, exp_avg: Any, exp_avg_sq: Any, *, max_grad_norm: float, max_step: int
) -> str | None:
    """Why one parameter's Adam state (step counter, first and second moments) is out of bounds, or None."""
    _check_bound("max_grad_norm", max_grad_norm)
    count = float(step)
    if not 0 <= count <= max_step:
        return f"adam step {count:g} of {name} is outside 0..{max_step}"
    largest = max_grad_norm * MOMENT_SLACK
    for label, value, limit, low in (
        ("exp_avg", exp_avg, largest, -largest),
        ("exp_avg_sq", exp_avg_sq, largest * largest, 0.0),
    ):
        if math.prod(shape_of(value)) == 0:
            continue
        top, bottom = float(value.max()), float(value.min())
        if not (low <= bottom and top <= limit):
            return f"{label} of {name} spans [{bottom:.3g}, {top:.3g}], outside [{low:.3g}, {limit:.3g}]"
    return None


def _squares(value: Any) -> float:
    return float((value * value).sum())


def _check_bound(name: str, bound: float) -> None:
    number = isinstance(bound, int | float) and not isinstance(bound, bool)
    if not number or not math.isfinite(bound) or bound <= 0:
        raise LocalProtocolError(f"{name} must be a finite number > 0, got {bound!r}")
