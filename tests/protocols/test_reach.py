"""The reachability check's messages: round trips, and hostile bytes refused with RemoteProtocolError only."""

from __future__ import annotations

import msgpack
import pytest

from protocols.errors import LocalProtocolError, RemoteProtocolError
from protocols.messages import PROTOCOL_VERSION, decode, encode
from protocols.reach import MAX_HOST, MAX_REACH_BYTES, MAX_REACH_PORTS, ReachReply, ReachRequest


def wire(kind: str, **fields: object) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "kind": kind, **fields}, use_bin_type=True)


def test_round_trips_within_the_size_limit() -> None:
    request = ReachRequest(tuple(range(65532, 65536)))
    reply = ReachReply("f" * MAX_HOST, tuple(range(65532, 65536)))
    for message in (request, reply, ReachReply("")):
        data = encode(message)
        assert len(data) <= MAX_REACH_BYTES
        assert decode(data, type(message), MAX_REACH_BYTES) == message


@pytest.mark.parametrize(
    "data",
    [
        wire("reach_request", ports=[]),
        wire("reach_request", ports=list(range(1, MAX_REACH_PORTS + 2))),
        wire("reach_request", ports=[0]),
        wire("reach_request", ports=[65536]),
        wire("reach_request", ports=[True]),
        wire("reach_request", ports=[80, 80]),
        wire("reach_request", ports=["80"]),
        wire("reach_request", ports=80),
        wire("reach_request"),
        wire("reach_request", ports=[80], extra=1),
        wire("reach_reply", observed="10.0.0.1", reachable=[80]),  # a reply where a request is expected
        wire("reach_request", ports=[80])[:-1],
        wire("reach_request", ports=[80]) + b"\x00",
        b"\xc1",
        b"",
        wire("reach_request", ports=[80] * 300),  # over the byte limit
    ],
)
def test_hostile_requests_are_refused(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        decode(data, ReachRequest, MAX_REACH_BYTES)


@pytest.mark.parametrize(
    "fields",
    [
        {"observed": "x" * (MAX_HOST + 1)},
        {"observed": "10.0.0.1\n"},
        {"observed": 10},
        {"observed": "10.0.0.1", "reachable": [0]},
        {"observed": "10.0.0.1", "reachable": list(range(1, MAX_REACH_PORTS + 2))},
    ],
)
def test_hostile_replies_are_refused(fields: dict[str, object]) -> None:
    with pytest.raises(RemoteProtocolError):
        decode(wire("reach_reply", **fields), ReachReply, MAX_REACH_BYTES)


def test_bad_messages_cannot_be_built() -> None:
    for build in (lambda: ReachRequest(()), lambda: ReachRequest((0,)), lambda: ReachReply("a\x00")):
        with pytest.raises(LocalProtocolError):
            build()
