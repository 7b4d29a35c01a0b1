"""The tensor transport between real p2pd processes on loopback, when calls fail.

Handler errors and timeouts reach the caller as typed errors; dead, unknown and frozen peers fail fast; a
server refuses streams past its per-peer limit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from collections.abc import Iterator

import pytest
import torch
from hivemind.p2p import PeerID
from transport_harness import DIRECT, LIBP2P, Swarm, call, echo, p2pd_children, running_swarm

from swarmnode.transport import CallTimeout, PeerUnreachable, RemoteError, Transport

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def swarm() -> Iterator[Swarm]:
    with running_swarm() as swarm:
        yield swarm


@pytest.fixture(params=["libp2p", "direct"])
def caller(request: pytest.FixtureRequest, swarm: Swarm) -> Transport:
    return swarm.libp2p if request.param == "libp2p" else swarm.direct


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
        doomed.register("echo", echo)
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
        frozen.register("echo", echo)
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
