"""The tensor transport between real p2pd processes on loopback: round trips, failures, hostile input."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack
import pytest
import torch
import uvloop
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2P, PeerID
from hivemind.proto.runtime_pb2 import CompressionType

from swarmnode.transport import (
    CallTimeout,
    Compression,
    Limits,
    PeerUnreachable,
    ProtocolError,
    RemoteError,
    Transport,
    TransportConfig,
)
from swarmnode.transport._framing import MAGIC, PREFIX, VERSION, Kind, encode_request, read_frame

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

T = TypeVar("T")
HOST = ["/ip4/127.0.0.1/tcp/0"]
LIMITS = Limits(max_message_bytes=64 << 20)
SERVER_CONFIG = TransportConfig(limits=LIMITS, header_timeout=0.5, ban_seconds=30.0, direct_host="127.0.0.1")
LIBP2P = TransportConfig(limits=LIMITS)
DIRECT = TransportConfig(limits=LIMITS, direct_host="127.0.0.1")


def p2pd_children() -> set[int]:
    """Pids of p2pd processes whose parent is this process (from /proc)."""
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        if name == "p2pd" and int(rest[1]) == os.getpid():
            pids.add(int(entry))
    return pids


async def new_p2p(initial_peers: list[Any] | None = None) -> P2P:
    return await P2P.create(initial_peers=initial_peers, host_maddrs=HOST, nat_port_map=False)


@dataclass
class Swarm:
    """A serving node and two callers (one over libp2p only, one with the direct TCP path), one event loop."""

    loop: asyncio.AbstractEventLoop
    server: Transport
    lenient: Transport  # a second server that bans nobody
    libp2p: Transport
    direct: Transport
    p2ps: list[P2P]

    def run(self, coro: Awaitable[T]) -> T:
        return self.loop.run_until_complete(coro)

    async def spawn(self) -> P2P:
        """One more P2P, connected to all the others (shut down by the fixture unless the test does)."""
        p2p = await new_p2p([maddr for other in self.p2ps for maddr in await other.get_visible_maddrs()])
        self.p2ps.append(p2p)
        async with asyncio.timeout(10):  # until every p2pd knows the newcomer, so calls to it can dial
            for other in self.p2ps[:-1]:
                while p2p.peer_id not in {info.peer_id for info in await other.list_peers()}:
                    await asyncio.sleep(0.02)
        return p2p


async def _echo(
    peer_id: PeerID, meta: bytes, tensors: list[torch.Tensor]
) -> tuple[bytes, list[torch.Tensor]]:
    return meta, tensors


async def _add(peer_id: PeerID, meta: bytes, tensors: list[torch.Tensor]) -> tuple[bytes, list[torch.Tensor]]:
    return b"sum", [tensors[0] + tensors[1]]


async def _mul(peer_id: PeerID, meta: bytes, tensors: list[torch.Tensor]) -> tuple[bytes, list[torch.Tensor]]:
    await asyncio.sleep(0.01)
    return b"product", [tensors[0] * tensors[1]]


async def _fail(
    peer_id: PeerID, meta: bytes, tensors: list[torch.Tensor]
) -> tuple[bytes, list[torch.Tensor]]:
    raise ValueError(f"cannot handle {meta.decode()}")


async def _bad_reply(
    peer_id: PeerID, meta: bytes, tensors: list[torch.Tensor]
) -> tuple[bytes, list[torch.Tensor]]:
    return b"", [torch.zeros(2, dtype=torch.float64)]


@pytest.fixture(scope="module")
def swarm() -> Iterator[Swarm]:
    loop = uvloop.new_event_loop()
    before = p2pd_children()
    p2ps: list[P2P] = []  # every P2P started, shut down at the end even if setup fails

    async def start_p2p(initial_peers: list[Any] | None = None) -> P2P:
        p2ps.append(await new_p2p(initial_peers))
        return p2ps[-1]

    async def setup() -> Swarm:
        server_p2p = await start_p2p()
        maddrs = await server_p2p.get_visible_maddrs()
        libp2p_p2p, direct_p2p, lenient_p2p = (
            await start_p2p(maddrs),
            await start_p2p(maddrs),
            await start_p2p(maddrs),
        )
        server = Transport(server_p2p, SERVER_CONFIG)
        for name, handler in [
            ("echo", _echo),
            ("add", _add),
            ("mul", _mul),
            ("fail", _fail),
            ("bad", _bad_reply),
        ]:
            server.register(name, handler)
        await server.start()
        lenient = Transport(lenient_p2p, dataclasses.replace(SERVER_CONFIG, ban_seconds=0.0))
        lenient.register("echo", _echo)
        await lenient.start()
        libp2p, direct = Transport(libp2p_p2p, LIBP2P), Transport(direct_p2p, DIRECT)
        await direct.start()
        return Swarm(loop, server, lenient, libp2p, direct, p2ps)

    async def teardown(swarm: Swarm | None) -> None:
        if swarm is not None:
            for transport in (swarm.server, swarm.lenient, swarm.libp2p, swarm.direct):
                await transport.close()
        for p2p in p2ps:
            await p2p.shutdown()

    swarm = None
    try:
        swarm = loop.run_until_complete(setup())
        yield swarm
    finally:
        loop.run_until_complete(teardown(swarm))
        loop.close()
        assert p2pd_children() <= before, "a p2pd outlived its P2P"


@pytest.fixture(params=["libp2p", "direct"])
def caller(request: pytest.FixtureRequest, swarm: Swarm) -> Transport:
    return swarm.libp2p if request.param == "libp2p" else swarm.direct


def call(
    swarm: Swarm, caller: Transport, method: str, meta: bytes, tensors: list[torch.Tensor], **kwargs: Any
) -> tuple[bytes, list[torch.Tensor]]:
    return swarm.run(
        caller.call(swarm.server.peer_id, method, meta, tensors, kwargs.pop("timeout", 10.0), **kwargs)
    )


def test_round_trip_small_and_large(swarm: Swarm, caller: Transport) -> None:
    tensors = [
        torch.randn(3, 5),
        torch.randn(6 << 20 >> 2),  # 6 MiB: over hivemind's 4 MiB unary cap
        torch.randn(2, 3).to(torch.bfloat16),
        torch.randn(7).half(),
        torch.arange(10),
        torch.arange(4, dtype=torch.int32).reshape(2, 2),
        torch.tensor(3.5),
        torch.zeros(0, 4),
        torch.randn(4, 6).t(),  # not contiguous
    ]
    meta, out = call(swarm, caller, "echo", b"\x00meta", tensors)
    assert meta == b"\x00meta"
    assert len(out) == len(tensors)
    for sent, got in zip(tensors, out, strict=True):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got, sent)
    out[1].add_(1.0)  # received tensors are writable and own their memory


def test_float16_on_the_wire_matches_hivemind(swarm: Swarm, caller: Transport) -> None:
    x = torch.randn(5 << 20 >> 2) * 1000
    x[:3] = torch.tensor([1e9, -1e9, float("inf")])
    ints = torch.arange(6)
    _, (got, got_ints) = call(swarm, caller, "echo", b"", [x, ints], compression=Compression.FLOAT16)
    hivemind = deserialize_torch_tensor(serialize_torch_tensor(x, CompressionType.FLOAT16))
    assert got.dtype == torch.float32 and torch.equal(got, hivemind)
    assert torch.equal(got_ints, ints)


def test_several_methods_and_concurrent_calls(swarm: Swarm, caller: Transport) -> None:
    pairs = [(torch.full((1000,), float(i)), torch.full((1000,), 2.0)) for i in range(24)]

    async def one(i: int) -> tuple[bytes, list[torch.Tensor]]:
        method = "add" if i % 2 else "mul"
        return await caller.call(swarm.server.peer_id, method, b"", list(pairs[i]), 10.0)

    async def all_of_them() -> list[tuple[bytes, list[torch.Tensor]]]:
        return await asyncio.gather(*(one(i) for i in range(len(pairs))))

    results = swarm.run(all_of_them())
    for i, (meta, (out,)) in enumerate(results):
        a, b = pairs[i]
        assert meta == (b"sum" if i % 2 else b"product")
        assert torch.equal(out, a + b if i % 2 else a * b)
    opened = sum(caller.stats.streams_opened.values())
    for i in range(5):  # one at a time: an idle stream is reused every time
        assert swarm.run(one(i))[0] in (b"sum", b"product")
    assert sum(caller.stats.streams_opened.values()) == opened


def test_direct_path_is_used_and_bound_to_the_caller(swarm: Swarm) -> None:
    seen = []

    async def whoami(
        peer_id: PeerID, meta: bytes, tensors: list[torch.Tensor]
    ) -> tuple[bytes, list[torch.Tensor]]:
        seen.append(peer_id)
        return b"", []

    swarm.server.register("whoami", whoami)
    call(swarm, swarm.direct, "whoami", b"", [])
    call(swarm, swarm.libp2p, "whoami", b"", [])
    assert seen == [swarm.direct.peer_id, swarm.libp2p.peer_id]
    assert swarm.direct.stats.streams_opened["direct"] >= 1
    assert swarm.libp2p.stats.streams_opened["direct"] == 0


def test_direct_caller_falls_back_to_libp2p(swarm: Swarm) -> None:
    async def scenario() -> None:
        plain_p2p = await swarm.spawn()
        plain = Transport(plain_p2p, LIBP2P)  # serves over libp2p only
        plain.register("echo", _echo)
        await plain.start()
        try:
            meta, _ = await swarm.direct.call(plain.peer_id, "echo", b"hello", [], 10.0)
            assert meta == b"hello"
            assert (
                plain.stats.errors_returned["unknown_method"] == 1
            )  # the direct-path grant it could not give
        finally:
            await plain.close()

    swarm.run(scenario())


def test_handler_exception_reaches_the_caller(swarm: Swarm, caller: Transport) -> None:
    with pytest.raises(RemoteError, match="ValueError: cannot handle this") as info:
        call(swarm, caller, "fail", b"this", [])
    assert info.value.kind == "handler_error"
    with pytest.raises(RemoteError) as info:
        call(swarm, caller, "bad", b"", [])  # a reply that cannot travel is the handler's error
    assert info.value.kind == "handler_error" and "float64" in info.value.message
    with pytest.raises(RemoteError) as info:
        call(swarm, caller, "no-such-method", b"", [])
    assert info.value.kind == "unknown_method"
    assert call(swarm, caller, "echo", b"still serving", [])[0] == b"still serving"


def test_slow_handler_times_out_on_both_sides(swarm: Swarm, caller: Transport) -> None:
    outcome: list[str] = []

    async def slow(
        peer_id: PeerID, meta: bytes, tensors: list[torch.Tensor]
    ) -> tuple[bytes, list[torch.Tensor]]:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            outcome.append("cancelled")
            raise
        return b"", []

    name = f"slow-{id(caller)}"
    swarm.server.register(name, slow)
    start = time.monotonic()
    with pytest.raises(CallTimeout):
        call(swarm, caller, name, b"", [], timeout=0.3)
    assert time.monotonic() - start < 2.0  # the call allows 0.3 s; the server would take 30
    swarm.run(asyncio.sleep(0.2))
    assert outcome == ["cancelled"]  # the server bounded the handler by the caller's timeout
    assert call(swarm, caller, "echo", b"after", [])[0] == b"after"


def test_dead_peer_fails_fast(swarm: Swarm, caller: Transport) -> None:
    async def scenario() -> float:
        doomed_p2p = await swarm.spawn()
        doomed = Transport(doomed_p2p, DIRECT)
        doomed.register("echo", _echo)
        await doomed.start()
        await caller.call(doomed.peer_id, "echo", b"", [], 10.0)  # pooled streams now exist
        await doomed.close()
        await doomed_p2p.shutdown()
        swarm.p2ps.remove(doomed_p2p)
        start = time.monotonic()
        with pytest.raises(PeerUnreachable):
            await caller.call(doomed.peer_id, "echo", b"", [], 10.0)
        return time.monotonic() - start

    assert swarm.run(scenario()) < 2.0  # typically about 10 ms, against a 10 s timeout


def test_unknown_peer_fails_fast(swarm: Swarm) -> None:
    stranger = PeerID.from_base58("QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN")
    start = time.monotonic()
    with pytest.raises(PeerUnreachable):
        swarm.run(swarm.libp2p.call(stranger, "echo", b"", [], 10.0))
    assert time.monotonic() - start < 2.0


def test_frozen_peer_times_out(swarm: Swarm) -> None:
    caller = swarm.libp2p  # the direct path needs a frozen process, not just a frozen p2pd

    async def scenario() -> None:
        before = p2pd_children()
        frozen_p2p = await swarm.spawn()
        (pid,) = p2pd_children() - before
        frozen = Transport(frozen_p2p, LIBP2P)
        frozen.register("echo", _echo)
        await frozen.start()
        await caller.call(frozen.peer_id, "echo", b"", [], 10.0)
        os.kill(pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(CallTimeout):
                await caller.call(frozen.peer_id, "echo", b"", [torch.randn(1 << 20)], 0.5)
            assert time.monotonic() - start < 2.5
        finally:
            os.kill(pid, signal.SIGCONT)
            await frozen.close()

    swarm.run(scenario())


def test_arguments_that_cannot_travel_fail_locally(swarm: Swarm) -> None:
    peer = swarm.server.peer_id
    with pytest.raises(TypeError, match="float64"):
        swarm.run(swarm.libp2p.call(peer, "echo", b"", [torch.zeros(2, dtype=torch.float64)], 1.0))
    with pytest.raises(TypeError, match="meta"):
        swarm.run(swarm.libp2p.call(peer, "echo", "text", [], 1.0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_message_bytes"):
        swarm.run(swarm.libp2p.call(peer, "echo", b"", [torch.zeros(17 << 20)], 1.0))
    with pytest.raises(ValueError, match="reserved"):
        swarm.server.register("_direct", _echo)


def test_too_many_streams_from_one_peer_are_refused(swarm: Swarm) -> None:
    # A second transport on an existing p2pd, under its own protocol id, serving one stream per peer.
    config = dataclasses.replace(LIBP2P, protocol="swarmnode.test.narrow", max_inbound_per_peer=1)
    narrow, client = Transport(swarm.p2ps[3], config), Transport(swarm.p2ps[1], config)
    release = asyncio.Event()

    async def hold(
        peer_id: PeerID, meta: bytes, tensors: list[torch.Tensor]
    ) -> tuple[bytes, list[torch.Tensor]]:
        await release.wait()
        return b"held", []

    narrow.register("hold", hold)

    async def scenario() -> None:
        await narrow.start()
        try:
            first = asyncio.ensure_future(client.call(narrow.peer_id, "hold", b"", [], 5.0))
            await asyncio.sleep(0.1)
            with pytest.raises(RemoteError) as info:
                await client.call(narrow.peer_id, "hold", b"", [], 5.0)
            assert info.value.kind == "overloaded"
            release.set()
            assert (await first)[0] == b"held"
        finally:
            await client.close()
            await narrow.close()

    swarm.run(scenario())


def test_config_is_checked() -> None:
    with pytest.raises(ValueError):
        TransportConfig(direct_host="localhost")  # a name may resolve to several addresses
    with pytest.raises(ValueError):
        TransportConfig(header_timeout=0)


# ---- hostile input ---------------------------------------------------------------------------------------


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
    port = swarm.server._tcp_server.sockets[0].getsockname()[1]
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
