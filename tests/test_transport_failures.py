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

import pytest
import torch
from hivemind.p2p import PeerID
from transport_harness import DIRECT, LIBP2P, Swarm, call, echo, p2pd_children

from swarmnode.transport import CallTimeout, PeerUnreachable, RemoteError, Transport

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def test_handler_exception_reaches_the_caller(transports: Swarm, caller: Transport) -> None:
    with pytest.raises(RemoteError, match="ValueError: cannot handle this") as info:
        call(transports, caller, "fail", b"this", [])
    assert info.value.kind == "handler_error"
    with pytest.raises(RemoteError) as info:
        call(transports, caller, "bad", b"", [])  # a reply that cannot travel is the handler's error
    assert info.value.kind == "handler_error" and "float64" in info.value.message
    with pytest.raises(RemoteError) as info:
        call(transports, caller, "no-such-method", b"", [])
    assert info.value.kind == "unknown_method"
    assert call(transports, caller, "echo", b"still serving", [])[0] == b"still serving"


def test_slow_handler_times_out_on_both_sides(transports: Swarm, caller: Transport) -> None:
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
    transports.server.register(name, slow)
    start = time.monotonic()
    with pytest.raises(CallTimeout):
        call(transports, caller, name, b"", [], timeout=0.3)
    assert time.monotonic() - start < 2.0  # the call allows 0.3 s; the server would take 30
    transports.run(asyncio.sleep(0.2))
    assert outcome == ["cancelled"]  # the server bounded the handler by the caller's timeout
    assert call(transports, caller, "echo", b"after", [])[0] == b"after"


def test_dead_peer_fails_fast(transports: Swarm, caller: Transport) -> None:
    async def scenario() -> float:
        doomed_p2p = await transports.spawn()
        doomed = Transport(doomed_p2p, DIRECT)
        doomed.register("echo", echo)
        await doomed.start()
        await caller.call(doomed.peer_id, "echo", b"", [], 10.0)  # pooled streams now exist
        await doomed.close()
        await doomed_p2p.shutdown()
        transports.p2ps.remove(doomed_p2p)
        start = time.monotonic()
        with pytest.raises(PeerUnreachable):
            await caller.call(doomed.peer_id, "echo", b"", [], 10.0)
        return time.monotonic() - start

    assert transports.run(scenario()) < 2.0  # typically about 10 ms, against a 10 s timeout


def test_unknown_peer_fails_fast(transports: Swarm) -> None:
    stranger = PeerID.from_base58("QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN")
    start = time.monotonic()
    with pytest.raises(PeerUnreachable):
        transports.run(transports.libp2p.call(stranger, "echo", b"", [], 10.0))
    assert time.monotonic() - start < 2.0


def test_frozen_peer_times_out(transports: Swarm) -> None:
    caller = transports.libp2p  # the direct path needs a frozen process, not just a frozen p2pd

    async def scenario() -> None:
        before = p2pd_children()
        frozen_p2p = await transports.spawn()
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

    transports.run(scenario())


def test_too_many_streams_from_one_peer_are_refused(transports: Swarm) -> None:
    # A second transport on an existing p2pd, under its own protocol id, serving one stream per peer.
    config = dataclasses.replace(LIBP2P, protocol="swarmnode.test.narrow", max_inbound_per_peer=1)
    narrow, client = Transport(transports.p2ps[3], config), Transport(transports.p2ps[1], config)
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

    transports.run(scenario())
