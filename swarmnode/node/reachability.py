"""The reachability check at join: a peer dials this node back, and the volunteer reads one line.

Every daemon (bootstrap and nodes) serves `PROTOCOL` on its p2pd: a `ReachRequest` names TCP ports, and the
server dials each of them at the IP the request's own connection comes from, never at an address the asker
names, so the check cannot be aimed at a third party. A port counts as reachable when a libp2p listener
answers there (the multistream-select greeting); the peer's identity is not checked again, as the asker's
connection already proved it. A request that arrives through a relay has no IP to dial: not reachable
directly. At most `MAX_CONCURRENT_CHECKS` dial-backs run at once; every step is bounded in time.

A joining node asks its initial peers in turn (`check_reachability`), then prints `describe`'s line to stderr
and emits it as a `reachability` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.utils.multiaddr import Multiaddr

from protocols.errors import RemoteProtocolError
from protocols.messages import decode, encode
from protocols.reach import MAX_REACH_BYTES, MAX_REACH_PORTS, ReachReply, ReachRequest
from swarmnode.dht import Reach, SwarmDHT
from swarmnode.node.events import emit

logger = logging.getLogger(__name__)

PROTOCOL = "swarmnode.reach.v1"
DIAL_TIMEOUT_S = 3.0  # one dial-back: a TCP connect and the greeting
ASK_TIMEOUT_S = 15.0  # one whole check as the asker waits for it (the server may queue it behind others)
MAX_CONCURRENT_CHECKS = 2
_LENGTH = struct.Struct(">H")
_GREETING = b"\x13/multistream/1.0.0\n"  # what a libp2p listener says first (length-prefixed)


async def _read_message(reader: asyncio.StreamReader) -> bytes:
    (size,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if size > MAX_REACH_BYTES:
        raise RemoteProtocolError(f"message of {size} bytes exceeds the limit of {MAX_REACH_BYTES}")
    return await reader.readexactly(size)


def _frame(data: bytes) -> bytes:
    return _LENGTH.pack(len(data)) + data


def _ip_of(addr: Multiaddr) -> str | None:
    """The IP a connection comes from, or None through a relay (or for an address without one)."""
    names = {protocol.name for protocol in addr.protocols()}
    if "p2p-circuit" in names:
        return None
    for name in ("ip4", "ip6"):
        if name in names:
            return str(addr.value_for_protocol(name))
    return None


async def libp2p_answers(host: str, port: int, timeout: float = DIAL_TIMEOUT_S) -> bool:
    """Whether a libp2p listener answers at host:port within `timeout` (connect, greet, read its greeting)."""
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(_GREETING)
            return await reader.readexactly(len(_GREETING)) == _GREETING
    except (TimeoutError, OSError, asyncio.IncompleteReadError):
        return False
    finally:
        if writer is not None:
            writer.close()


class ReachServer:
    """Serves dial-back checks on a p2pd (one per daemon)."""

    def __init__(self) -> None:
        self._slots = asyncio.Semaphore(MAX_CONCURRENT_CHECKS)
        self.checks = 0  # requests answered

    async def start(self, p2p: P2P) -> None:
        await p2p.add_binary_stream_handler(PROTOCOL, self._handle)

    async def _handle(
        self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            async with asyncio.timeout(ASK_TIMEOUT_S):
                request = decode(await _read_message(reader), ReachRequest, MAX_REACH_BYTES)
                observed = _ip_of(info.addr)
                reachable: tuple[int, ...] = ()
                if observed is not None:
                    async with self._slots:
                        answers = await asyncio.gather(*(libp2p_answers(observed, p) for p in request.ports))
                    reachable = tuple(port for port, ok in zip(request.ports, answers, strict=True) if ok)
                writer.write(_frame(encode(ReachReply(observed or "", reachable))))
                await writer.drain()
                self.checks += 1
        except RemoteProtocolError as error:
            logger.info("refused a reachability check from %s: %s", info.peer_id, error)
        except (TimeoutError, OSError, asyncio.IncompleteReadError):
            pass  # the asker left or stalled: nothing to answer
        finally:
            writer.close()


@dataclass(frozen=True)
class ReachResult:
    """What a peer answered: `checked_by` (None: no peer answered), the IP it sees this node at ("" through
    a relay), the ports asked about and those at which it could connect."""

    asked: tuple[int, ...]
    checked_by: str | None = None
    observed: str = ""
    open_ports: tuple[int, ...] = ()

    @property
    def reachable(self) -> bool | None:
        return None if self.checked_by is None else bool(self.open_ports)


async def ask(p2p: P2P, peer: PeerID, ports: Sequence[int]) -> ReachReply:
    """One check by `peer`. Raises P2PDaemonError (cannot reach it), RemoteProtocolError, TimeoutError,
    OSError or IncompleteReadError."""
    async with asyncio.timeout(ASK_TIMEOUT_S):
        _, reader, writer = await p2p.call_binary_stream_handler(peer, PROTOCOL)
        try:
            writer.write(_frame(encode(ReachRequest(tuple(ports)))))
            await writer.drain()
            return decode(await _read_message(reader), ReachReply, MAX_REACH_BYTES)
        finally:
            writer.close()


async def check_reachability(p2p: P2P, peers: Sequence[PeerID], ports: Sequence[int]) -> ReachResult:
    """Ask `peers` in turn until one answers."""
    asked = tuple(dict.fromkeys(ports))[:MAX_REACH_PORTS]
    for peer in peers:
        try:
            reply = await ask(p2p, peer, asked)
        except (P2PDaemonError, RemoteProtocolError, TimeoutError, OSError, asyncio.IncompleteReadError) as e:
            logger.info("peer %s did not answer the reachability check: %s", peer, e)
            continue
        return ReachResult(asked, str(peer), reply.observed, tuple(p for p in asked if p in reply.reachable))
    return ReachResult(asked)


def _maddr(ip: str, port: int) -> str:
    return f"/{'ip6' if ':' in ip else 'ip4'}/{ip}/tcp/{port}"


def describe(result: ReachResult, reach: Reach) -> str:
    """The volunteer's one line: whether peers can reach this node, and what to do if not."""
    port = (result.open_ports or result.asked or (0,))[0]
    if result.reachable:
        return f"reachable at {_maddr(result.observed, port)} (checked by peer {result.checked_by})"
    if result.checked_by is None:
        return "reachability unknown: no initial peer answered the check"
    relay = (
        "peers reach it over the connections it opens, and the others through its relays (--use-auto-relay)"
        if reach.use_auto_relay
        else "peers reach it only over connections it opens (pass --use-auto-relay to be reached through "
        "a relay)"
    )
    seen = (
        f"could not connect to {result.observed}:{port}"
        if result.observed
        else "sees it only through a relay"
    )
    return (
        f"not reachable from the swarm: peer {result.checked_by} {seen}; {relay}; to accept direct "
        f"connections open TCP port {port} (forwarded to this machine) or pass --announce-maddrs "
        f"/ip4/<public IP>/tcp/<forwarded port>"
    )


def ports_to_check(dht: SwarmDHT) -> tuple[int, ...]:
    """The announced TCP ports, else those p2pd listens on."""
    if dht.reach.announce_maddrs:
        return dht.reach.announced_ports()
    ports = []
    for addr in dht.visible_maddrs():
        with contextlib.suppress(Exception):  # an address without a TCP port
            ports.append(int(Multiaddr(addr).value_for_protocol("tcp")))
    return tuple(dict.fromkeys(ports))


async def report_reachability(dht: SwarmDHT, initial_peers: Sequence[PeerID]) -> ReachResult:
    """Run the check against the initial peers; print the line to stderr and emit it as an event."""
    result = await check_reachability(await dht.replicate_p2p(), initial_peers, ports_to_check(dht))
    line = describe(result, dht.reach)
    sys.stderr.write(f"swarmnode: {line}\n")
    sys.stderr.flush()
    address = _maddr(result.observed, result.open_ports[0]) if result.reachable else None
    emit(
        "reachability",
        reachable=result.reachable,
        address=address,
        checked_by=result.checked_by,
        message=line,
    )
    return result
