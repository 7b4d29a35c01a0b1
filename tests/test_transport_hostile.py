"""The tensor transport between real p2pd processes on loopback, under hostile input.

Malformed, stalled and truncated frames, bans, garbage replies and forged direct connections; through all of
it the server keeps serving everyone else.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import torch
from hivemind.p2p import P2P, PeerID
from transport_harness import LIBP2P, LIMITS, SERVER_CONFIG, SMALL_BODY_BYTES, Swarm, running_swarm

from swarmnode.transport import ProtocolError, RemoteError, Transport
from swarmnode.transport._framing import MAGIC, PREFIX, VERSION, Kind, encode_request, read_frame

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def swarm() -> Iterator[Swarm]:
    with running_swarm() as swarm:
        yield swarm


def _prefix(kind: int, head_len: int, body_len: int, magic: bytes = MAGIC, version: int = VERSION) -> bytes:
    return PREFIX.pack(magic, version, kind, 0, head_len, body_len)


def _raw_frame(fields: list[Any], body: bytes = b"", kind: int = Kind.REQUEST) -> bytes:
    head = msgpack.packb(fields, use_bin_type=True)
    return _prefix(kind, len(head), len(body)) + head + body


def _request(specs: list[Any], body: bytes, timeout: float = 5.0) -> bytes:
    return _raw_frame(["echo", timeout, 0, b"", specs], body)


GARBAGE = {
    "random bytes": os.urandom(64),
    "bad magic": _prefix(Kind.REQUEST, 0, 0, magic=b"HTTP"),
    "newer version": _prefix(Kind.REQUEST, 0, 0, version=VERSION + 1),
    "a response instead of a request": _raw_frame([b"", []], kind=Kind.RESPONSE),
    "oversized message": _prefix(Kind.REQUEST, 10, 1 << 40),
    "oversized head": _prefix(Kind.REQUEST, 1 << 30, 0),
    "head not msgpack": _prefix(Kind.REQUEST, 4, 0) + b"\xc1\xc1\xc1\xc1",
    "head of wrong shape": _raw_frame([1, 2]),
    "meta not bytes": _raw_frame(["echo", 5.0, 0, "text", []]),
    "dtype not allowed": _request([["float64", 0, [2]]], bytes(16)),
    "object dtype": _request([["object", 0, [2]]], bytes(16)),
    "bytes do not match the shape": _request([["float32", 0, [3]]], bytes(16)),
    "negative dimension": _request([["float32", 0, [-4]]], bytes(16)),
    "huge shape": _request([["float32", 0, [1 << 40, 1 << 40]]], bytes(16)),
    "too many dimensions": _request([["float32", 0, [1] * 9]], bytes(4)),
    "8-bit codec": _request([["float32", 4, [4]]], bytes(4)),
    "fp16 codec on ints": _request([["int64", 2, [2]]], bytes(4)),
    "non-positive timeout": _request([], b"", timeout=-1.0),
}


async def _send_raw(p2p: P2P, server: PeerID, payload: bytes) -> Any:
    """Write bytes on a raw stream to the server; return the (error) frame head it answers."""
    _, reader, writer = await p2p.call_binary_stream_handler(server, SERVER_CONFIG.protocol)
    try:
        writer.write(payload)
        await writer.drain()
        async with asyncio.timeout(5):
            head, _ = await read_frame(reader, LIMITS)
        return head
    finally:
        writer.close()


def test_garbage_is_rejected_and_the_server_keeps_serving(swarm: Swarm) -> None:
    lenient, raw_client = swarm.lenient, swarm.p2ps[1]  # lenient: bans nobody

    async def scenario() -> None:
        for reason, payload in GARBAGE.items():
            head = await _send_raw(raw_client, lenient.peer_id, payload)
            assert getattr(head, "code", None) == "bad_request", reason
            meta, _ = await swarm.libp2p.call(lenient.peer_id, "echo", reason.encode(), [], 5.0)
            assert meta == reason.encode()

    swarm.run(scenario())
    assert lenient.stats.errors_returned["bad_request"] == len(GARBAGE)


def test_a_body_over_its_method_limit_is_refused_before_it_is_read(swarm: Swarm) -> None:
    lenient, raw_client = swarm.lenient, swarm.p2ps[1]
    fits = [torch.arange(SMALL_BODY_BYTES // 4, dtype=torch.float32)]

    async def scenario() -> None:
        # only the prefix and head are sent: a refusal must not wait for (or allocate) the announced body
        for method, body_len in (("small", SMALL_BODY_BYTES + 4), ("no-such-method", 32 << 20)):
            head_bytes = msgpack.packb([method, 5.0, 0, b"", [["float32", 0, [body_len // 4]]]])
            head = await _send_raw(
                raw_client, lenient.peer_id, _prefix(Kind.REQUEST, len(head_bytes), body_len) + head_bytes
            )
            assert head.code == "bad_request" and "at most" in head.message, (method, head)
        _, out = await swarm.libp2p.call(lenient.peer_id, "small", b"", fits, 5.0)
        assert torch.equal(out[0], fits[0])
        with pytest.raises(RemoteError) as info:  # an unknown method with a small body: just unknown
            await swarm.libp2p.call(lenient.peer_id, "no-such-method", b"", fits, 5.0)
        assert info.value.kind == "unknown_method"

    swarm.run(scenario())


def test_malformed_frame_bans_the_sender(swarm: Swarm) -> None:
    async def scenario() -> None:
        mallory = await swarm.spawn()
        head = await _send_raw(mallory, swarm.server.peer_id, GARBAGE["dtype not allowed"])
        assert head.code == "bad_request"
        with pytest.raises(RemoteError) as info:
            await Transport(mallory, LIBP2P).call(swarm.server.peer_id, "echo", b"", [], 5.0)
        assert info.value.kind == "banned"
        assert swarm.server.is_banned(mallory.peer_id)
        meta, _ = await swarm.libp2p.call(swarm.server.peer_id, "echo", b"others are served", [], 5.0)
        assert meta == b"others are served"

    swarm.run(scenario())


def test_stalled_and_truncated_frames_are_dropped(swarm: Swarm) -> None:
    lenient, raw_client = swarm.lenient, swarm.p2ps[1]
    valid = b"".join(bytes(part) for part in encode_request("echo", 5.0, 0, b"", [torch.zeros(4)], 0))

    async def scenario() -> None:
        # A frame cut short, then the stream closed: dropped.
        _, _, writer = await raw_client.call_binary_stream_handler(lenient.peer_id, SERVER_CONFIG.protocol)
        writer.write(valid[:-3])
        writer.close()
        # A head that never comes: dropped after header_timeout (0.5 s here).
        _, reader, writer = await raw_client.call_binary_stream_handler(
            lenient.peer_id, SERVER_CONFIG.protocol
        )
        writer.write(valid[: PREFIX.size + 2])
        await writer.drain()
        start = time.monotonic()
        async with asyncio.timeout(5):
            assert await reader.read() == b""
        assert 0.3 < time.monotonic() - start < 3.0
        writer.close()
        meta, _ = await swarm.libp2p.call(lenient.peer_id, "echo", b"ok", [], 5.0)
        assert meta == b"ok"

    swarm.run(scenario())


def test_garbage_reply_is_a_protocol_error(swarm: Swarm) -> None:
    async def liar(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)
        writer.write(_raw_frame([b"", [["float32", 0, [1000]]]], bytes(8), kind=Kind.RESPONSE))
        await writer.drain()
        writer.close()

    async def scenario() -> None:
        mallory = await swarm.spawn()
        await mallory.add_binary_stream_handler(SERVER_CONFIG.protocol, liar)
        with pytest.raises(ProtocolError, match="bytes"):
            await swarm.libp2p.call(mallory.peer_id, "echo", b"", [], 5.0)

    swarm.run(scenario())


def test_forged_direct_connections_are_refused(swarm: Swarm) -> None:
    port = swarm.server._listener.port
    request = b"".join(bytes(part) for part in encode_request("echo", 5.0, 0, b"", [], 0))

    async def scenario() -> None:
        for hello in (b"SWND" + bytes(16), b"GET / HTTP/1.1\r\n\r\n"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(hello + request)
            async with asyncio.timeout(5):
                assert await reader.read() == b""  # closed without an answer
            writer.close()
        meta, _ = await swarm.direct.call(swarm.server.peer_id, "echo", b"ok", [], 5.0)
        assert meta == b"ok"

    swarm.run(scenario())
