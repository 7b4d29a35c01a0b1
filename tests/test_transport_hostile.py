"""The tensor transport between real p2pd processes on loopback, under hostile input.

Malformed, stalled and truncated frames, bans, garbage replies and forged direct connections; silent streams
past a peer's cap, slow bodies, announced bodies never sent, zero-sized tensors of absurd shapes, oversized
meta and error texts, floods of direct hellos; through all of it the server keeps serving everyone else.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from typing import Any

import msgpack
import pytest
import torch
from hivemind.p2p import P2P, PeerID
from transport_harness import (
    LIBP2P,
    LIMITS,
    SERVER_CONFIG,
    SMALL_BODY_BYTES,
    Swarm,
    closed_by_server,
    echo,
    guarded,
    honest_call,
    open_raw,
    until,
)

from swarmnode.transport import RemoteError, Transport, TransportConfig, WireError
from swarmnode.transport._framing import (
    MAGIC,
    MAX_ERROR_CHARS,
    PREFIX,
    VERSION,
    Kind,
    encode_request,
    read_frame,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


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
    "zero-sized, one 2**64-1 dimension": _request([["float32", 0, [0, 2**64 - 1]]], b""),
    "zero-sized, two 2**62 dimensions": _request([["float32", 0, [0, 2**62, 2**62]]], b""),
    "huge dtype name": _request([["x" * 100_000, 0, [1]]], bytes(4)),
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


def test_garbage_is_rejected_and_the_server_keeps_serving(transports: Swarm) -> None:
    lenient, raw_client = transports.lenient, transports.p2ps[1]  # lenient: bans nobody

    async def scenario() -> None:
        for reason, payload in GARBAGE.items():
            head = await _send_raw(raw_client, lenient.peer_id, payload)
            assert getattr(head, "code", None) == "bad_request", reason
            assert len(head.message) < 300, reason  # what a peer sent is quoted short
            meta, _ = await transports.libp2p.call(lenient.peer_id, "echo", reason.encode(), [], 5.0)
            assert meta == reason.encode()

    transports.run(scenario())
    assert lenient.stats.errors_returned["bad_request"] == len(GARBAGE)


def test_a_body_over_its_method_limit_is_refused_before_it_is_read(transports: Swarm) -> None:
    lenient, raw_client = transports.lenient, transports.p2ps[1]
    fits = [torch.arange(SMALL_BODY_BYTES // 4, dtype=torch.float32)]

    async def scenario() -> None:
        # only the prefix and head are sent: a refusal must not wait for (or allocate) the announced body
        for method, body_len in (("small", SMALL_BODY_BYTES + 4), ("no-such-method", 32 << 20)):
            head_bytes = msgpack.packb([method, 5.0, 0, b"", [["float32", 0, [body_len // 4]]]])
            head = await _send_raw(
                raw_client, lenient.peer_id, _prefix(Kind.REQUEST, len(head_bytes), body_len) + head_bytes
            )
            assert head.code == "bad_request" and "at most" in head.message, (method, head)
        _, out = await transports.libp2p.call(lenient.peer_id, "small", b"", fits, 5.0)
        assert torch.equal(out[0], fits[0])
        with pytest.raises(RemoteError) as info:  # an unknown method with a small body: just unknown
            await transports.libp2p.call(lenient.peer_id, "no-such-method", b"", fits, 5.0)
        assert info.value.kind == "unknown_method"

    transports.run(scenario())


def test_malformed_frame_bans_the_sender(transports: Swarm) -> None:
    async def scenario() -> None:
        mallory = await transports.spawn()
        head = await _send_raw(mallory, transports.server.peer_id, GARBAGE["dtype not allowed"])
        assert head.code == "bad_request"
        with pytest.raises(RemoteError) as info:
            await Transport(mallory, LIBP2P).call(transports.server.peer_id, "echo", b"", [], 5.0)
        assert info.value.kind == "banned"
        assert transports.server.is_banned(mallory.peer_id)
        meta, _ = await transports.libp2p.call(
            transports.server.peer_id, "echo", b"others are served", [], 5.0
        )
        assert meta == b"others are served"

    transports.run(scenario())


def test_stalled_and_truncated_frames_are_dropped(transports: Swarm) -> None:
    lenient, raw_client = transports.lenient, transports.p2ps[1]
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
        meta, _ = await transports.libp2p.call(lenient.peer_id, "echo", b"ok", [], 5.0)
        assert meta == b"ok"

    transports.run(scenario())


def test_garbage_reply_is_a_protocol_error(transports: Swarm) -> None:
    async def liar(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)
        writer.write(_raw_frame([b"", [["float32", 0, [1000]]]], bytes(8), kind=Kind.RESPONSE))
        await writer.drain()
        writer.close()

    async def scenario() -> None:
        mallory = await transports.spawn()
        await mallory.add_binary_stream_handler(SERVER_CONFIG.protocol, liar)
        with pytest.raises(WireError, match="bytes"):
            await transports.libp2p.call(mallory.peer_id, "echo", b"", [], 5.0)

    transports.run(scenario())


def test_forged_direct_connections_are_refused(transports: Swarm) -> None:
    port = transports.server._listener.port
    request = b"".join(bytes(part) for part in encode_request("echo", 5.0, 0, b"", [], 0))

    async def scenario() -> None:
        for hello in (b"SWND" + bytes(16), b"GET / HTTP/1.1\r\n\r\n"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(hello + request)
            async with asyncio.timeout(5):
                assert await reader.read() == b""  # closed without an answer
            writer.close()
        meta, _ = await transports.direct.call(transports.server.peer_id, "echo", b"ok", [], 5.0)
        assert meta == b"ok"

    transports.run(scenario())


def test_a_garbage_reply_of_an_absurd_empty_shape_is_a_protocol_error(transports: Swarm) -> None:
    # e.g. a hostile answer to a joiner's ping: it must fail that call, not the joiner
    async def liar(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)
        writer.write(_raw_frame([b"", [["float32", 0, [0, 2**62, 2**62]]]], kind=Kind.RESPONSE))
        await writer.drain()
        writer.close()

    async def scenario() -> None:
        mallory = await transports.spawn()
        await mallory.add_binary_stream_handler(SERVER_CONFIG.protocol, liar)
        with pytest.raises(WireError, match="elements"):
            await transports.libp2p.call(mallory.peer_id, "ping", b"", [], 5.0)

    transports.run(scenario())


def _head_only(method: str, body_len: int) -> bytes:
    """A request's prefix and head announcing `body_len` tensor bytes, without the body."""
    head = msgpack.packb([method, 30.0, 0, b"", [["float32", 0, [body_len // 4]]]])
    return _prefix(Kind.REQUEST, len(head), body_len) + head


def test_silent_streams_past_the_cap_leave_others_served(transports: Swarm) -> None:
    mallory, trudy = transports.p2ps[1], transports.p2ps[0]  # two attacking identities

    async def scenario() -> None:
        async with guarded(transports, "silent") as (server, client):
            stats = server.stats
            # Mallory opens twice her 4 streams and sends nothing: each newer one closes her oldest.
            streams = [await open_raw(mallory, server) for _ in range(4)]
            await until(lambda: stats.inbound_streams == 4)
            for evicted in range(1, 5):
                streams.append(await open_raw(mallory, server))
                await until(lambda n=evicted: stats.dropped["evicted"] == n and stats.inbound_streams == 4)
            for reader, _ in streams[:4]:
                await closed_by_server(reader)
            # With Trudy's 4 silent streams every slot is taken: an honest stream closes the oldest waiting.
            opened = time.monotonic()
            streams += [await open_raw(trudy, server) for _ in range(4)]
            await until(lambda: stats.inbound_streams == 8)
            await honest_call(server, client)
            await until(lambda: stats.dropped["evicted"] == 5)
            assert not stats.refused
            # Streams busy mid-request are not closed for newcomers: past her cap, Mallory is refused.
            busy = [writer for _, writer in streams[5:8]]
            for writer in busy:
                writer.write(_head_only("echo", 1 << 20) + b"\0")
            await until(lambda: stats.inbound_bytes == 3)
            busy.append((await open_raw(mallory, server))[1])  # closes the oldest waiting: Trudy's
            busy[-1].write(_head_only("echo", 1 << 20) + b"\0")
            await until(lambda: stats.inbound_bytes == 4 and stats.dropped["evicted"] == 6)
            reader, writer = await open_raw(mallory, server)
            busy.append(writer)
            writer.write(_head_only("echo", 1 << 20))
            async with asyncio.timeout(5):
                head, _ = await read_frame(reader, LIMITS)
            assert head.code == "overloaded" and stats.refused["peer_streams"] == 1
            await honest_call(server, client)
            # Trudy's other silent streams are dropped after idle_timeout (1 s).
            for reader, _ in streams[9:]:
                await closed_by_server(reader)
            assert time.monotonic() - opened < 3.0 and stats.dropped["idle"] >= 3
            for writer in busy + [writer for _, writer in streams]:
                writer.close()

    transports.run(scenario())


def test_a_body_under_the_rate_floor_is_dropped(transports: Swarm) -> None:
    mallory = transports.p2ps[1]

    async def trickle(writer: asyncio.StreamWriter) -> None:
        while True:  # 2 KB/s: the attacker's pace, a fifth of the floor
            writer.write(bytes(100))
            await writer.drain()
            await asyncio.sleep(0.05)

    async def scenario() -> None:
        async with guarded(transports, "slow", min_body_rate=10_000.0, body_grace=0.5) as (server, client):
            reader, writer = await open_raw(mallory, server)
            writer.write(_head_only("echo", 1 << 20))  # the request allows 30 s; the floor, far less
            start = time.monotonic()
            pacing = asyncio.ensure_future(trickle(writer))
            try:
                await closed_by_server(reader)
            finally:
                pacing.cancel()
                writer.close()
            assert time.monotonic() - start < 3.0
            assert server.stats.dropped["slow_body"] == 1 and server.stats.inbound_bytes == 0
            await honest_call(server, client)

    transports.run(scenario())


def test_an_announced_body_costs_only_the_bytes_that_arrive(transports: Swarm) -> None:
    mallory = transports.p2ps[1]
    announced, sent = 32 << 20, 4096  # an `average`-sized head, then a few bytes

    async def scenario() -> None:
        async with guarded(transports, "budget", max_inbound_bytes_per_peer=48 << 20) as (server, client):
            stats = server.stats
            reader, writer = await open_raw(mallory, server)
            writer.write(_head_only("echo", announced) + bytes(sent))
            await until(lambda: stats.inbound_bytes == sent)
            await honest_call(server, client)
            assert stats.inbound_bytes_peak < announced // 2
            writer.close()
            await until(lambda: stats.inbound_bytes == 0)
            # A body past the peer's share is refused before a byte of it is read.
            reader, writer = await open_raw(mallory, server)
            writer.write(_head_only("echo", 56 << 20))
            async with asyncio.timeout(5):
                head, _ = await read_frame(reader, LIMITS)
            writer.close()
            assert head.code == "overloaded" and stats.refused["bytes"] == 1
            await honest_call(server, client)

    transports.run(scenario())


def test_oversized_meta_is_refused_per_method(transports: Swarm) -> None:
    async def scenario() -> None:
        async with guarded(transports, "meta", max_meta_bytes=1024) as (server, client):
            server.register("roomy", echo, max_meta_bytes=4096)
            for method, size in (("echo", 1025), ("roomy", 4097)):
                with pytest.raises(RemoteError) as info:
                    await client.call(server.peer_id, method, bytes(size), [], 5.0)
                assert info.value.kind == "bad_request" and "meta" in info.value.message
            assert (await client.call(server.peer_id, "roomy", bytes(4096), [], 5.0))[0] == bytes(4096)
            await honest_call(server, client, bytes(1024))
            assert server.stats.refused["malformed"] == 2

    transports.run(scenario())


def test_error_texts_are_cut_both_ways(transports: Swarm) -> None:
    async def verbose(peer_id: PeerID, meta: bytes, tensors: list[torch.Tensor]) -> Any:
        raise ValueError("x" * (1 << 20))

    async def liar(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)
        writer.write(_raw_frame(["handler_error", "y" * (1 << 19)], kind=Kind.ERROR))
        await writer.drain()
        writer.close()

    async def scenario() -> None:
        async with guarded(transports, "verbose") as (server, client):
            server.register("verbose", verbose)
            with pytest.raises(RemoteError) as info:  # cut by the server before it is sent
                await client.call(server.peer_id, "verbose", b"", [], 5.0)
            assert info.value.kind == "handler_error" and len(info.value.message) <= MAX_ERROR_CHARS
        mallory = await transports.spawn()
        await mallory.add_binary_stream_handler(SERVER_CONFIG.protocol, liar)
        with pytest.raises(RemoteError) as info:  # cut by the caller when it is received
            await transports.libp2p.call(mallory.peer_id, "echo", b"", [], 5.0)
        assert len(info.value.message) <= MAX_ERROR_CHARS

    transports.run(scenario())


def test_a_flood_of_direct_hellos_is_capped(transports: Swarm) -> None:
    async def scenario() -> None:
        async with guarded(transports, "hellos", max_pending_hellos=4) as (server, _):
            port = server._listener.port
            honest = Transport(
                transports.p2ps[2], dataclasses.replace(server._config, direct_host="127.0.0.1")
            )
            connections = [await asyncio.open_connection("127.0.0.1", port) for _ in range(6)]
            for reader, _ in connections[:2]:  # the oldest two were closed for newer ones
                await closed_by_server(reader)
            assert server.stats.refused["hello"] == 2
            try:
                await honest_call(server, honest)
                assert honest.stats.streams_opened["direct"] == 1
            finally:
                await honest.close()
                for _, writer in connections:
                    writer.close()

    transports.run(scenario())


def test_config_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        TransportConfig(max_inbound_per_peer=300)  # over max_inbound_streams
    with pytest.raises(ValueError):
        TransportConfig(min_body_rate=-1.0)
    with pytest.raises(ValueError):
        dataclasses.replace(LIMITS, max_elements=1 << 63)
