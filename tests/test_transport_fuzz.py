"""The frame parser under arbitrary input, without daemons.

Whatever arrives, `read_frame` returns a frame that matches its head or raises WireError; it raises
IncompleteReadError only when the bytes end before the frame they announce does."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from swarmnode.transport import Limits, WireError
from swarmnode.transport._framing import (
    MAGIC,
    MAX_CODE_CHARS,
    MAX_ERROR_CHARS,
    PREFIX,
    VERSION,
    WIRE_DTYPES,
    ErrorFrame,
    Kind,
    read_frame,
)

LIMITS = Limits(max_message_bytes=1 << 16, max_head_bytes=1 << 12, max_tensors=8)
FUZZ = settings(max_examples=100, deadline=None)
INTS = st.integers(-(2**63), 2**64 - 1)  # what msgpack can carry


def _mostly(valid: st.SearchStrategy[Any], other: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Nine times in ten a valid field: a head is checked field by field, so most must be valid."""
    return st.integers(0, 9).flatmap(lambda i: valid if i else other)


ANY = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        INTS,
        st.floats(allow_nan=True),
        st.text(max_size=16),
        st.binary(max_size=16),
    ),
    lambda inner: _mostly(
        st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=40,
)
DIMS = _mostly(
    st.one_of(st.integers(0, 4), st.sampled_from([2**31, 2**31 + 1, 2**62, 2**63 - 1, 2**64 - 1])),
    st.sampled_from([-1, -(2**63)]),
)
SPECS = st.lists(
    _mostly(
        st.tuples(
            _mostly(
                st.sampled_from(list(WIRE_DTYPES)), st.one_of(st.sampled_from(["float64", "object"]), ANY)
            ),
            _mostly(st.just(0), st.one_of(st.sampled_from([1, 2, 4]), ANY)),  # 2: FLOAT16
            _mostly(st.lists(DIMS, max_size=10), ANY),
        ).map(list),
        ANY,
    ),
    max_size=10,
)
REQUESTS = st.tuples(
    _mostly(st.text(max_size=8), ANY),
    _mostly(st.floats(0.001, 100), st.one_of(st.floats(), ANY)),
    _mostly(st.sampled_from([0, 2]), ANY),
    _mostly(st.binary(max_size=32), ANY),
    _mostly(SPECS, ANY),
).map(list)
RESPONSES = st.tuples(_mostly(st.binary(max_size=32), ANY), _mostly(SPECS, ANY)).map(list)
ERRORS = st.tuples(
    _mostly(st.text(max_size=2 * MAX_CODE_CHARS), ANY),
    _mostly(st.text(min_size=MAX_ERROR_CHARS - 2, max_size=MAX_ERROR_CHARS + 2), ANY),
).map(list)
HUGE_EMPTY = [["float32", 0, [0, 2**64 - 1]]], [["bfloat16", 0, [0, 2**62, 2**62]]]


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _read(loop: asyncio.AbstractEventLoop, data: bytes) -> tuple[Any, list[Any]]:
    async def read() -> tuple[Any, list[Any]]:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await read_frame(reader, LIMITS)

    return loop.run_until_complete(read())


def _check(loop: asyncio.AbstractEventLoop, data: bytes) -> None:
    """Only a consistent frame, WireError, or IncompleteReadError for bytes shorter than announced."""
    try:
        head, tensors = _read(loop, data)
    except WireError:
        return
    except asyncio.IncompleteReadError:
        if len(data) >= PREFIX.size:
            _, _, _, _, head_len, body_len = PREFIX.unpack(data[: PREFIX.size])
            assert len(data) < PREFIX.size + head_len + body_len
        return
    if isinstance(head, ErrorFrame):
        assert len(head.code) <= MAX_CODE_CHARS and len(head.message) <= MAX_ERROR_CHARS and not tensors
        return
    assert len(tensors) == len(head.specs)
    for spec, tensor in zip(head.specs, tensors, strict=True):
        assert tuple(tensor.shape) == spec.shape


def _frame(kind: int, head: bytes, body: bytes) -> bytes:
    return PREFIX.pack(MAGIC, VERSION, kind, 0, len(head), len(body)) + head + body


@FUZZ
@given(st.binary(max_size=200))
def test_arbitrary_bytes(loop: asyncio.AbstractEventLoop, data: bytes) -> None:
    _check(loop, data)


@FUZZ
@given(st.sampled_from(list(Kind)), st.binary(max_size=200), st.binary(max_size=64))
def test_a_valid_prefix_then_arbitrary_bytes(
    loop: asyncio.AbstractEventLoop, kind: Kind, head: bytes, body: bytes
) -> None:
    _check(loop, _frame(kind, head, body))


@FUZZ
@given(
    st.one_of(
        st.tuples(st.just(Kind.REQUEST), REQUESTS),
        st.tuples(st.just(Kind.RESPONSE), RESPONSES),
        st.tuples(st.just(Kind.ERROR), ERRORS),
        st.tuples(st.sampled_from(list(Kind)), ANY),
    ),
    _mostly(st.none(), st.binary(max_size=64)),
)
@example((Kind.RESPONSE, [b"", HUGE_EMPTY[0]]), None)
@example((Kind.RESPONSE, [b"", HUGE_EMPTY[1]]), None)
@example((Kind.REQUEST, ["ping", 1.0, 0, b"", HUGE_EMPTY[1]]), None)
@example((Kind.ERROR, ["handler_error", "x" * 3000]), None)
def test_msgpack_heads(
    loop: asyncio.AbstractEventLoop, kind_and_fields: tuple[Kind, Any], body: bytes | None
) -> None:
    """`body` None: as long as the specs say, when that can be said and is small."""
    kind, fields = kind_and_fields
    head = msgpack.packb(fields, use_bin_type=True)
    _check(loop, _frame(kind, head, _exact_body(fields) if body is None else body))


def _exact_body(fields: Any) -> bytes:
    try:
        nbytes = sum(WIRE_DTYPES[dtype].itemsize * math.prod(shape) for dtype, _, shape in fields[-1])
    except Exception:  # fields not shaped like a head: no body
        return b""
    return bytes(nbytes) if isinstance(nbytes, int) and 0 <= nbytes <= 4096 else b""  # a float shape: none
