"""Frozen dataclasses whose fields convert and check themselves on construction.

A field declares its converter with `field(metadata=checked(conv))`; a converter takes `(value, field
name)`, returns the normalised value (tuples for lists, enums for strings, floats for numbers) and raises
LocalProtocolError with a readable reason otherwise. The same rules so serve values built here and
values decoded from a peer (the decoder turns the error into a RemoteProtocolError).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any, TypeVar

from protocols.errors import LocalProtocolError

Convert = Callable[[Any, str], Any]
E = TypeVar("E", bound=StrEnum)
S = TypeVar("S", bound="Schema")


def show(value: Any) -> str:
    """A repr short enough for an error message."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _fail(name: str, wanted: str, value: Any) -> LocalProtocolError:
    return LocalProtocolError(f"{name}: expected {wanted}, got {show(value)}")


def checked(convert: Convert) -> dict[str, Convert]:
    """Field metadata: how `Schema` converts and checks the field."""
    return {"convert": convert}


def count(limit: int = 2**63 - 1, minimum: int = 0) -> Convert:
    def convert(value: Any, name: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= limit:
            raise _fail(name, f"an int in {minimum}..{limit}", value)
        return value

    return convert


def text(limit: int, minimum: int = 0) -> Convert:
    def convert(value: Any, name: str) -> str:
        if not isinstance(value, str) or not minimum <= len(value) <= limit or not value.isprintable():
            raise _fail(name, f"printable text of {minimum}..{limit} characters", value)
        return value

    return convert


def number(minimum: float = -math.inf, maximum: float = math.inf) -> Convert:
    def convert(value: Any, name: str) -> float:
        if not isinstance(value, bool) and isinstance(value, int | float):
            try:
                result = float(value)
            except OverflowError:
                result = math.inf
            if math.isfinite(result) and minimum <= result <= maximum:
                return result
        bounds = f">= {minimum}" if maximum == math.inf else f"in {minimum}..{maximum}"
        raise _fail(name, f"a finite number {bounds}", value)

    return convert


def optional(convert: Convert) -> Convert:
    return lambda value, name: None if value is None else convert(value, name)


def flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(name, "true or false", value)
    return value


def one_of(allowed: frozenset[str]) -> Convert:
    def convert(value: Any, name: str) -> str:
        if not isinstance(value, str) or value not in allowed:
            raise _fail(name, "one of " + ", ".join(sorted(allowed)), value)
        return value

    return convert


def choice(enum: type[E], only: frozenset[E] | None = None) -> Convert:
    """A member of `enum` (or of its subset `only`), given as the member or its value."""
    check = one_of(frozenset(member.value for member in only or enum))
    return lambda value, name: enum(check(value, name))


def items(convert: Convert, limit: int, minimum: int = 0, unique: bool = False) -> Convert:
    def convert_all(value: Any, name: str) -> tuple[Any, ...]:
        if not isinstance(value, tuple | list) or not minimum <= len(value) <= limit:
            raise _fail(name, f"a list of {minimum}..{limit} items", value)
        result = tuple(convert(item, f"{name}[{i}]") for i, item in enumerate(value))
        if unique and len(set(result)) != len(result):
            raise LocalProtocolError(f"{name}: repeated items")
        return result

    return convert_all


def nested(cls: type[S]) -> Convert:
    """A `cls` instance, or a map with exactly its fields (as decoded from the wire); fields named in the
    class's `WIRE_OPTIONAL` (added after peers that omit them) may be missing and take their defaults."""
    names = {f.name for f in fields(cls)}
    may_miss = frozenset(getattr(cls, "WIRE_OPTIONAL", ()))

    def convert(value: Any, name: str) -> S:
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise _fail(name, "a map", value)
        unexpected = [show(key) for key in value if key not in names]
        if unexpected:
            raise LocalProtocolError(f"{name}: unexpected fields {', '.join(unexpected[:5])}")
        missing = sorted(names - set(value) - may_miss)
        if missing:
            raise LocalProtocolError(f"{name}: missing fields {', '.join(missing)}")
        try:
            return cls(**value)
        except LocalProtocolError as exc:
            raise LocalProtocolError(f"{name}.{exc.reason}") from None

    return convert


@dataclass(frozen=True)
class Schema:
    """Converts and checks every field on construction; `_check` adds rules across fields."""

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, f.metadata["convert"](getattr(self, f.name), f.name))
        self._check()

    def _check(self) -> None:
        """Rules that involve several fields; none by default."""


def to_wire(value: Any) -> Any:
    """Plain msgpack-ready data: schemas as maps, tuples as lists, enums as their values."""
    if isinstance(value, Schema):
        return {f.name: to_wire(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, tuple):
        return [to_wire(item) for item in value]
    if isinstance(value, StrEnum):
        return value.value
    return value
