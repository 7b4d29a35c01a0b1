"""Tensor manifests: what a message says of the tensors that travel beside it (name, shape, dtype).

A manifest is a tuple of `TensorSpec`s, checked like every message field; the tensors themselves are
serialised by the transport, in manifest order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from protocols._schema import Schema, checked, count, items, nested, one_of, text
from protocols.errors import LocalProtocolError

MAX_NAME = 256  # tensor names and addresses
MAX_TENSORS = 16384  # entries of one manifest
MAX_DIMS = 8
MAX_ELEMENTS = 2**31  # per tensor
MANIFEST_DTYPES = frozenset(
    {"float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"}
)


@dataclass(frozen=True)
class TensorSpec(Schema):
    """One tensor travelling beside a message: its name, shape and dtype (torch name without `torch.`)."""

    name: str = field(metadata=checked(text(MAX_NAME, 1)))
    shape: tuple[int, ...] = field(metadata=checked(items(count(MAX_ELEMENTS), MAX_DIMS)))
    dtype: str = field(metadata=checked(one_of(MANIFEST_DTYPES)))

    def _check(self) -> None:
        if self.numel > MAX_ELEMENTS:
            raise LocalProtocolError(f"shape: {list(self.shape)} has more than {MAX_ELEMENTS} elements")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def manifest_field(value: object, name: str) -> tuple[TensorSpec, ...]:
    """A checked manifest field: at most `MAX_TENSORS` specs with distinct names."""
    specs = items(nested(TensorSpec), MAX_TENSORS)(value, name)
    if len({spec.name for spec in specs}) != len(specs):
        raise LocalProtocolError(f"{name}: repeated tensor names")
    return specs


def same_layout(first: tuple[TensorSpec, ...], second: tuple[TensorSpec, ...]) -> bool:
    """Whether two manifests name the same tensors, in the same order, with the same shapes."""
    return [(s.name, s.shape) for s in first] == [(s.name, s.shape) for s in second]
