"""Emulated links between real p2pd processes on loopback: latency and bandwidth, on both transport paths.

Sites A and B are 100 ms apart (one way) at 8 MiB/s. Every figure is compared with the same calls between
the same transports with emulation off (no known sites), measured in the same test; lower bounds are what
the emulation guarantees, upper bounds leave room for a loaded machine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import pytest
import torch
import uvloop
from hivemind.p2p import P2P, PeerID
from transport_harness import DIRECT, LIBP2P, echo, new_p2p, p2pd_children

from protocols.links import TRUSTED_SAMPLES, LinkEstimates, parse_network
from swarmnode.transport import LinkEmulator, Transport

T = TypeVar("T")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

LATENCY_S = 0.1
BANDWIDTH = 8 << 20  # bytes per second
NETWORK = parse_network(
    {
        "sites": ["A", "B"],
        "same_site": {"latency_ms": 0, "bandwidth_GBps": 2},
        "links": [{"a": "A", "b": "B", "latency_ms": LATENCY_S * 1000, "bandwidth_GBps": BANDWIDTH / 2**30}],
    }
)
PAYLOAD = torch.zeros(3 << 20 >> 2)  # 3 MiB: 0.375 s at the link's bandwidth
# (emulated - plain) / (what the link alone takes) must lie within these: the emulation's own bound is
# emulated >= link, and plain calls take 0.3 s where they should take 0.03 s at times on a loaded machine
MIN_RATIO, SLACK = 0.5, 2.0
# a link's wait ends at its deadline on the loop's clock, and a call timed by differences of clock readings
# near 6e4 s can come out a few 1e-12 s short of it (0.19999999999708962 for a 0.2 s round trip, CI)
CLOCK_ROUNDING_S = 1e-9


@dataclasses.dataclass
class Sites:
    loop: asyncio.AbstractEventLoop
    server: Transport  # at site A
    callers: dict[str, Transport]  # at site B: "libp2p" and "direct", on one p2pd

    def run(self, coro: Awaitable[T]) -> T:
        return self.loop.run_until_complete(coro)

    def emulate(self, on: bool) -> None:
        """Let every transport know the others' sites (on), or forget them (off: no emulation)."""
        assert self.server.links is not None
        self.server.links.set_sites({str(c.peer_id): "B" for c in self.callers.values()} if on else {})
        for caller in self.callers.values():
            assert caller.links is not None
            caller.links.set_sites({str(self.server.peer_id): "A"} if on else {})


async def _sink(
    peer_id: PeerID, meta: bytes, tensors: list[torch.Tensor]
) -> tuple[bytes, list[torch.Tensor]]:
    return b"", []


@pytest.fixture(scope="module")
def sites() -> Iterator[Sites]:
    loop = uvloop.new_event_loop()
    before = p2pd_children()
    p2ps: list[P2P] = []
    transports: list[Transport] = []

    async def setup() -> Sites:
        p2ps.append(await new_p2p())
        p2ps.append(await new_p2p(await p2ps[0].get_visible_maddrs()))
        server = Transport(p2ps[0], DIRECT, LinkEmulator(NETWORK, "A"))
        libp2p = Transport(p2ps[1], LIBP2P, LinkEmulator(NETWORK, "B"))
        direct = Transport(p2ps[1], DIRECT, LinkEmulator(NETWORK, "B"))  # callers: not started
        transports.extend((server, libp2p, direct))
        server.register("echo", echo)
        server.register("sink", _sink)
        await server.start()
        return Sites(loop, server, {"libp2p": libp2p, "direct": direct})

    async def teardown() -> None:
        for transport in transports:
            await transport.close()
        for p2p in p2ps:
            await p2p.shutdown()

    try:
        yield loop.run_until_complete(setup())
    finally:
        loop.run_until_complete(teardown())
        loop.close()
        assert p2pd_children() <= before, "a p2pd outlived its P2P"


def _fastest(sites: Sites, on: bool, calls: Callable[[], Awaitable[object]], repeats: int = 2) -> float:
    """The shortest of `repeats` runs of `calls`, with emulation on or off."""
    sites.emulate(on)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        sites.run(calls())
        times.append(time.perf_counter() - started)
    return min(times)


@pytest.mark.parametrize("path", ["libp2p", "direct"])
def test_latency_and_bandwidth_of_a_call(sites: Sites, path: str) -> None:
    caller, server = sites.callers[path], sites.server.peer_id

    async def small() -> None:
        await caller.call(server, "echo", b"ping", [], 10.0)

    async def large() -> None:
        await caller.call(server, "sink", b"", [PAYLOAD], 10.0)

    async def two_large() -> None:
        await asyncio.gather(large(), large())

    sites.run(caller.call(server, "echo", b"warm", [], 10.0))  # streams (and the direct path) opened
    link_s = PAYLOAD.numel() * 4 / BANDWIDTH
    for name, calls, alone in [
        ("round trip", small, 2 * LATENCY_S),
        ("payload", large, 2 * LATENCY_S + link_s),
        ("two payloads at once", two_large, 2 * LATENCY_S + 2 * link_s),  # one pacer for both streams
    ]:
        plain, emulated = _fastest(sites, False, calls, repeats=3), _fastest(sites, True, calls)
        ratio = (emulated - plain) / alone
        under = f"{name}: {emulated:.3f} s, under the link's {alone:.3f} s"
        assert emulated >= alone - CLOCK_ROUNDING_S, under
        assert MIN_RATIO <= ratio <= SLACK, (
            f"{name}: emulated {emulated:.3f} s, plain {plain:.3f} s, link {alone:.3f} s"
        )
    assert caller.stats.streams_opened[path] >= 1


def test_unknown_sites_are_not_emulated(sites: Sites) -> None:
    caller = sites.callers["libp2p"]
    assert caller.links is not None
    caller.links.set_sites({str(sites.server.peer_id): "Mars", "someone": None})
    assert caller.links.site_of(sites.server.peer_id) is None
    assert caller.links.delay(sites.server.peer_id, 1 << 20) == 0.0


def test_calls_measure_the_link(sites: Sites) -> None:
    caller, server = sites.callers["direct"], sites.server.peer_id
    caller.estimates = LinkEstimates()  # only this test's calls
    sites.emulate(True)

    async def calls() -> None:
        for _ in range(TRUSTED_SAMPLES):
            await caller.call(server, "echo", b"ping", [], 10.0)
            await caller.call(server, "sink", b"", [PAYLOAD], 10.0)

    sites.run(calls())
    rtt = caller.estimates.round_trip_s(server.to_base58())
    send = caller.estimates.send_s(server.to_base58(), PAYLOAD.numel() * 4)
    alone = LATENCY_S + PAYLOAD.numel() * 4 / BANDWIDTH
    assert rtt is not None and 2 * LATENCY_S - CLOCK_ROUNDING_S <= rtt <= 2 * LATENCY_S * SLACK, rtt
    assert send is not None and 0.9 * alone <= send <= SLACK * alone, (send, alone)
