"""Shared by tests/test_transport_*.py: a swarm of real p2pd processes on loopback, each with a transport.

`running_swarm()` starts a serving node (plus a second one that bans nobody) and two callers (libp2p only, and
with the direct TCP path) on one event loop, and on exit checks that no p2pd outlived its P2P. `guarded()`
adds a server with small bounds and an honest client of it, for attackers to push against.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import uvloop
from hivemind.p2p import P2P, PeerID

from swarmnode.identity import Identity
from swarmnode.procstat import processes
from swarmnode.transport import Limits, Transport, TransportConfig

T = TypeVar("T")
HOST = ["/ip4/127.0.0.1/tcp/0"]
SMALL_BODY_BYTES = 16  # the lenient server's "small" method takes at most this many tensor bytes
LIMITS = Limits(max_message_bytes=64 << 20)
SERVER_CONFIG = TransportConfig(limits=LIMITS, header_timeout=0.5, ban_seconds=30.0, direct_host="127.0.0.1")
LIBP2P = TransportConfig(limits=LIMITS)
DIRECT = TransportConfig(limits=LIMITS, direct_host="127.0.0.1")
GUARDED = dataclasses.replace(  # small bounds, to reach them with a few streams
    SERVER_CONFIG,
    idle_timeout=1.0,
    max_inbound_streams=8,
    max_inbound_per_peer=4,
    max_calls_per_peer=4,
    ban_seconds=0.0,
)


def p2pd_children() -> set[int]:
    """Pids of p2pd processes whose parent is this process (from /proc, zombies included)."""
    return {proc.pid for proc in processes() if proc.comm == "p2pd" and proc.ppid == os.getpid()}


async def new_p2p(initial_peers: list[Any] | None = None, identity: Identity | None = None) -> P2P:
    """A P2P on loopback; with `identity`, its p2pd runs with that key (as a daemon's does)."""
    if identity is None:
        return await P2P.create(initial_peers=initial_peers, host_maddrs=HOST, nat_port_map=False)
    with tempfile.TemporaryDirectory() as folder:
        key_file = Path(folder) / "identity.key"
        identity.save(key_file)
        return await P2P.create(
            initial_peers=initial_peers,
            host_maddrs=HOST,
            nat_port_map=False,
            identity_path=str(key_file),
            check_if_identity_free=False,
        )


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
        """One more P2P, connected to all the others (shut down with the swarm unless the test does)."""
        p2p = await new_p2p([maddr for other in self.p2ps for maddr in await other.get_visible_maddrs()])
        self.p2ps.append(p2p)
        async with asyncio.timeout(10):  # until every p2pd knows the newcomer, so calls to it can dial
            for other in self.p2ps[:-1]:
                while p2p.peer_id not in {info.peer_id for info in await other.list_peers()}:
                    await asyncio.sleep(0.02)
        return p2p


async def echo(peer_id: PeerID, meta: bytes, tensors: list[torch.Tensor]) -> tuple[bytes, list[torch.Tensor]]:
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


@contextmanager
def running_swarm() -> Iterator[Swarm]:
    """The swarm, its server serving "echo", "add", "mul", "fail" and "bad"; the lenient one "echo"."""
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
            ("echo", echo),
            ("add", _add),
            ("mul", _mul),
            ("fail", _fail),
            ("bad", _bad_reply),
        ]:
            server.register(name, handler)
        await server.start()
        lenient = Transport(lenient_p2p, dataclasses.replace(SERVER_CONFIG, ban_seconds=0.0))
        lenient.register("echo", echo)
        lenient.register("small", echo, max_body_bytes=SMALL_BODY_BYTES)
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


def call(
    swarm: Swarm, caller: Transport, method: str, meta: bytes, tensors: list[torch.Tensor], **kwargs: Any
) -> tuple[bytes, list[torch.Tensor]]:
    """`caller` calls `method` on the swarm's server (timeout 10 s unless given)."""
    return swarm.run(
        caller.call(swarm.server.peer_id, method, meta, tensors, kwargs.pop("timeout", 10.0), **kwargs)
    )


@asynccontextmanager
async def guarded(swarm: Swarm, name: str, **changes: Any) -> AsyncIterator[tuple[Transport, Transport]]:
    """A server on the lenient node's p2pd serving "echo" under `GUARDED` with `changes`, and an honest client
    of it on the direct caller's p2pd; the other p2pds may play attackers."""
    config = dataclasses.replace(GUARDED, protocol=f"swarmnode.test.{name}", **changes)
    server = Transport(swarm.p2ps[3], config)
    client = Transport(swarm.p2ps[2], dataclasses.replace(config, direct_host=None))
    server.register("echo", echo)
    await server.start()
    try:
        yield server, client
    finally:
        await client.close()
        await server.close()


async def open_raw(p2p: P2P, server: Transport) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    _, reader, writer = await p2p.call_binary_stream_handler(server.peer_id, server._config.protocol)
    return reader, writer


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait for a server-side effect (a counter) that the test cannot await directly."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


async def closed_by_server(reader: asyncio.StreamReader) -> None:
    async with asyncio.timeout(5):
        assert await reader.read() == b""


async def honest_call(server: Transport, client: Transport, meta: bytes = b"honest") -> None:
    assert (await client.call(server.peer_id, "echo", meta, [torch.ones(3)], 5.0))[0] == meta
