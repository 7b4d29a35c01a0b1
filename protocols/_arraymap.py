"""Checks and arithmetic over array maps: mappings name -> array-like.

An array-like is anything with `.shape`, `.sum()`, `.min()`, `.max()` and `+ - *` with scalars and with its
own kind: torch tensors and numpy arrays both qualify, so this module needs neither. Results are new objects;
inputs are never modified in place.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from protocols.errors import LocalProtocolError

ArrayMap = Mapping[str, Any]


def shape_of(value: Any) -> tuple[int, ...]:
    """The shape of an array-like as a tuple of ints."""
    shape = getattr(value, "shape", None)
    if shape is None:
        raise LocalProtocolError(f"expected an array-like with a shape, got {type(value).__name__}")
    return tuple(int(d) for d in shape)


def layout_mismatch(reference: ArrayMap, other: ArrayMap) -> str | None:
    """Why `other` does not have the names and shapes of `reference`, or None if it does."""
    missing = sorted(set(reference) - set(other))
    extra = sorted(set(other) - set(reference))
    if missing or extra:
        return f"missing {_names(missing)}, unexpected {_names(extra)}"
    for name, value in reference.items():
        want, got = shape_of(value), shape_of(other[name])
        if want != got:
            return f"{name!r} has shape {list(got)}, expected {list(want)}"
    return None


def check_same_layout(reference: ArrayMap, others: Sequence[tuple[str, ArrayMap]]) -> None:
    """Raise LocalProtocolError unless every labelled map in `others` has `reference`'s names and shapes."""
    for label, other in others:
        problem = layout_mismatch(reference, other)
        if problem is not None:
            raise LocalProtocolError(f"{label}: {problem}")


def first_non_finite(tensors: ArrayMap) -> str | None:
    """The name of the first array holding a NaN or an infinity, or None if all are finite: by its least and
    greatest values (a NaN makes both NaN), passes that allocate nothing the array's size."""
    for name, value in tensors.items():
        ends = (value.min(), value.max()) if math.prod(shape_of(value)) else ()
        if not all(math.isfinite(float(end)) for end in ends):
            return name
    return None


def weighted_sum(maps: Sequence[ArrayMap], weights: Sequence[float]) -> dict[str, Any]:
    """sum_k weights[k] * maps[k], name by name (maps must share one layout)."""
    result = {}
    for name in maps[0]:
        total = maps[0][name] * weights[0]
        for tensors, weight in zip(maps[1:], weights[1:], strict=True):
            total = total + tensors[name] * weight
        result[name] = total
    return result


def _names(names: list[str]) -> str:
    if not names:
        return "none"
    shown = ", ".join(repr(n) for n in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")
