"""Is a peer alive, and serving which stage? Ask it: a DHT record outlives its node by up to its TTL, but a
ping to a dead peer fails in milliseconds (a frozen one within `PING_TIMEOUT_S`)."""

from __future__ import annotations

import asyncio

from hivemind.p2p import PeerID

from protocols.errors import ProtocolError
from protocols.messages import Pong, Rpc, decode
from swarmnode.node.planning import SwarmRead
from swarmnode.transport import PeerUnreachable, Transport, TransportError

PING_TIMEOUT_S = 1.0  # over libp2p's connection (`direct=False`): a NAT'ed peer's first direct dial takes 3 s
# Who answers when a NoLoCo matching is drawn: on a loaded machine (three local swarms on two cores) a replica
# busy with its own round can take over 1 s to answer; left out of its partner's matching, the pair splits.
MATCHING_PING_TIMEOUT_S = 4.0


async def ping(
    transport: Transport, peer: str, stage: int | None = None, timeout_s: float = PING_TIMEOUT_S
) -> bool:
    """Whether `peer` answers within `timeout_s` (and, if `stage` is given, serves that stage)."""
    try:
        reply, _ = await transport.call(
            PeerID.from_base58(peer), Rpc.PING, b"", [], timeout=timeout_s, direct=False
        )
        answer = decode(reply, Pong)
    except (TransportError, ProtocolError, ValueError):
        return False
    return stage is None or answer.stage == stage


async def unanswered(transport: Transport, peers: list[str]) -> tuple[frozenset[str], frozenset[str]]:
    """The peers among `peers` that do not answer a ping now, and those of them that cannot be reached at all
    (refused, no route: gone rather than slow)."""
    outcomes = await asyncio.gather(*(_ping_outcome(transport, p) for p in peers))
    silent = frozenset(p for p, outcome in zip(peers, outcomes, strict=True) if outcome != "answered")
    unreachable = frozenset(p for p, outcome in zip(peers, outcomes, strict=True) if outcome == "unreachable")
    return silent, unreachable


async def _ping_outcome(transport: Transport, peer: str) -> str:
    try:
        reply, _ = await transport.call(
            PeerID.from_base58(peer), Rpc.PING, b"", [], timeout=PING_TIMEOUT_S, direct=False
        )
        decode(reply, Pong)
    except (PeerUnreachable, ValueError):
        return "unreachable"
    except (TransportError, ProtocolError):
        return "silent"
    return "answered"


async def answering(
    transport: Transport, peers: list[str], stage: int | None = None, timeout_s: float = PING_TIMEOUT_S
) -> list[str]:
    """The peers among `peers` that answer a ping within `timeout_s` (serving `stage`, if given)."""
    answers = await asyncio.gather(*(ping(transport, p, stage, timeout_s) for p in peers))
    return [p for p, alive in zip(peers, answers, strict=True) if alive]


async def live_peers(transport: Transport, view: SwarmRead, me: str, stage: int) -> list[str]:
    """Online peers of `stage` in `view` (other than `me`) that answer a ping now and still serve it."""
    return await answering(transport, [p for p in view.online(stage) if p != me], stage)


async def trained_peers(transport: Transport, view: SwarmRead, me: str, stage: int) -> list[str]:
    """Live peers of `stage` that may serve as a rebuild source: not freshly re-initialised (a stage served
    only by a `reinit` node holds random weights, which an average must not take in)."""
    fresh = {p.peer_id for p in view.stages.get(stage, ()) if p.record.recovery == "reinit"}
    return [p for p in await live_peers(transport, view, me, stage) if p not in fresh]
