"""Streams through a relay (`transport._relay`) between real p2pd processes on loopback.

The target's p2pd listens on no address, so that no peer can dial it, as a node behind a NAT (the relay
reaches it over the connection it opened). tests/test_netns.py has real NATs, where a caller's dial fails
and it turns to the relay by itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import torch
from hivemind.p2p import P2P, PeerID
from transport_harness import LIBP2P, Swarm

from swarmnode.transport import PeerUnreachable, Transport
from swarmnode.transport._relay import REFUSED, open_relayed, relay_protocol

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

CONFIG = dataclasses.replace(LIBP2P, protocol="swarmnode.test.relay")


@dataclasses.dataclass
class Trio:
    relay: Transport
    target: Transport
    caller: Transport
    callers_seen: list[PeerID]


@asynccontextmanager
async def trio(swarm: Swarm, trusted: bool = True) -> AsyncIterator[Trio]:
    """A relay (the lenient node's p2pd), a target that cannot be dialled and accepts relayed streams from
    the relay if `trusted`, and a caller told that the target lists the relay."""
    relay_p2p = swarm.p2ps[3]
    hidden = await P2P.create(initial_peers=await relay_p2p.get_visible_maddrs(), no_listen=True)
    relay, target, caller = (
        Transport(relay_p2p, CONFIG),
        Transport(hidden, CONFIG),
        Transport(swarm.p2ps[1], CONFIG),
    )
    seen: list[PeerID] = []

    async def who(
        peer_id: PeerID, meta: bytes, tensors: list[torch.Tensor]
    ) -> tuple[bytes, list[torch.Tensor]]:
        seen.append(peer_id)
        return meta, tensors

    target.register("who", who)
    target.accept_relayed_from([relay.peer_id] if trusted else [])
    caller.set_relays({target.peer_id: [relay.peer_id]})
    # On loopback the target's own DHT soon opens a connection to the caller, which the caller could then use
    # (as peers use a NATed node's outbound connections): start where a failed dial leaves the pool instead.
    caller._pool._relayed_until[target.peer_id] = math.inf
    try:
        await relay.start()
        await target.start()
        yield Trio(relay, target, caller, seen)
    finally:
        for transport in (caller, target, relay):
            await transport.close()
        await hidden.shutdown()


def test_a_peer_that_cannot_be_dialled_is_reached_through_its_relay(transports: Swarm) -> None:
    async def main() -> None:
        async with trio(transports) as t:
            big = torch.randn(1 << 18)  # 1 MiB: past a libp2p relay's default 128 KiB per connection
            for n in range(3):
                meta, (back,) = await t.caller.call(t.target.peer_id, "who", b"hi%d" % n, [big], 10.0)
                assert meta == b"hi%d" % n and torch.equal(back, big)
            assert t.callers_seen == [t.caller.peer_id] * 3  # the caller, as the relay vouched, not the relay
            assert t.caller.stats.streams_opened["relayed"] == 1  # one relayed stream, reused
            assert t.relay.stats.relayed == 1

    transports.run(main())


def test_a_relayed_stream_from_a_peer_that_is_not_a_relay_is_refused(transports: Swarm) -> None:
    async def main() -> None:
        async with trio(transports, trusted=False) as t:
            with pytest.raises(PeerUnreachable):
                await t.caller.call(t.target.peer_id, "who", b"", [], 10.0)
            assert t.callers_seen == []
            assert t.target.stats.refused["relayed"] == 1

    transports.run(main())


def test_a_relay_refuses_bad_headers_and_says_when_it_cannot_reach_the_target(transports: Swarm) -> None:
    async def main() -> None:
        async with trio(transports) as t:
            p2p = transports.p2ps[1]
            for header in (b"\x00", b"\x41" + b"x" * 65, b"\x05abcde"):
                _, reader, writer = await p2p.call_binary_stream_handler(
                    t.relay.peer_id, relay_protocol(CONFIG)
                )
                writer.write(header)
                assert await asyncio.wait_for(reader.read(), 5.0) == bytes([REFUSED])
                writer.close()
            assert t.relay.stats.refused["relay_header"] == 3
            nobody = PeerID.from_base58("12D3KooWLB7GnWgJsFc3uksAJCBTJxDhqtsokMd6zCUZ4NFCHqE2")
            with pytest.raises(PeerUnreachable, match="cannot reach the target"):
                await open_relayed(p2p, t.relay.peer_id, nobody, CONFIG)
            assert t.relay.stats.relayed == 0

    transports.run(main())
