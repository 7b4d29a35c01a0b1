"""The calling side's streams: opening libp2p streams, one request and reply per use, and an idle pool.

A stream serves one call at a time; after a clean reply (or an error answer that leaves it open) it goes back
to a small pool of idle streams, newest reused first, oldest closed first beyond `max_idle_streams`, and none
kept for more than half of `idle_timeout` (the peer closes streams idle for longer). At most
`max_calls_per_peer` calls to one peer are in flight at once (more wait), and its idle streams are closed as
needed so that it never has more of ours open: a peer whose `max_inbound_per_peer` is at least that never
refuses us for having too many streams.

A stream to a peer that cannot be dialled but lists relays (`set_relays`: a node behind a NAT) is opened
through one of them (`_relay`); the peer is then reached that way first for `RELAY_STICKY_S`.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.utils.multiaddr import Multiaddr

from swarmnode.transport._config import TransportConfig, TransportStats
from swarmnode.transport._errors import PeerUnreachable, RemoteError, TransportError, WireError
from swarmnode.transport._framing import Buffer, ErrorFrame, Response, prepare_writer, read_frame, write_frame
from swarmnode.transport._opening import open_stream
from swarmnode.transport._relay import open_relayed

# Error codes after which the server closes the stream: such a stream is not reused.
_CLOSING_CODES = frozenset({"bad_request", "banned", "overloaded"})
RELAY_STICKY_S = 60.0  # after a peer was reached only through a relay, streams to it go that way first
DIAL_FIRST_S = 3.0  # how long a stream to a peer that lists relays is tried directly before a relay


@dataclass(eq=False)
class Stream:
    """One outbound stream to a peer, over libp2p or direct TCP."""

    peer_id: PeerID
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    direct: bool
    host: str | None  # the peer's IP as this stream reaches it (None through a relay)
    idle_since: float = 0.0  # monotonic time it went back to the pool

    def usable(self) -> bool:
        return not (self.reader.at_eof() or self.reader.exception() or self.writer.is_closing())


class StreamPool:
    """Outbound streams of one transport: opens libp2p streams and keeps idle ones (any path) for reuse."""

    def __init__(self, p2p: P2P, config: TransportConfig, stats: TransportStats) -> None:
        self._p2p = p2p
        self._config = config
        self._stats = stats
        self._idle: list[Stream] = []  # oldest first
        self._gates: dict[PeerID, asyncio.Semaphore] = {}  # per peer with calls in flight or waiting
        self._callers: Counter[PeerID] = Counter()  # calls in flight or waiting, per peer
        self._in_flight: Counter[PeerID] = Counter()
        self._relays: dict[PeerID, tuple[PeerID, ...]] = {}  # peer -> the relays it lists
        self._relayed_until: dict[PeerID, float] = {}  # peer -> until when to open through a relay first

    def set_relays(self, relays: Mapping[PeerID, Sequence[PeerID]]) -> None:
        """Replace the peers that list relays: peer -> its relays, in its order."""
        self._relays = {peer: tuple(listed) for peer, listed in relays.items() if listed}
        self._relayed_until = {peer: t for peer, t in self._relayed_until.items() if peer in self._relays}

    @asynccontextmanager
    async def slot(self, peer_id: PeerID) -> AsyncIterator[None]:
        """Hold one of the `max_calls_per_peer` calls to `peer_id` that may be in flight at once."""
        gate = self._gates.get(peer_id)
        if gate is None:
            gate = self._gates[peer_id] = asyncio.Semaphore(self._config.max_calls_per_peer)
        self._callers[peer_id] += 1
        try:
            async with gate:
                self._in_flight[peer_id] += 1
                try:
                    yield
                finally:
                    self._in_flight[peer_id] -= 1
        finally:
            self._callers[peer_id] -= 1
            if not self._callers[peer_id]:
                del self._callers[peer_id], self._in_flight[peer_id], self._gates[peer_id]

    def make_room(self, peer_id: PeerID) -> None:
        """Before a call in flight opens a stream to `peer_id`: close its oldest idle streams as needed
        to keep them and the calls in flight within `max_calls_per_peer`."""
        idle = [stream for stream in self._idle if stream.peer_id == peer_id]
        for stream in idle[: max(0, len(idle) + self._in_flight[peer_id] - self._config.max_calls_per_peer)]:
            self._idle.remove(stream)
            stream.writer.close()

    def take(self, peer_id: PeerID, direct: bool) -> Stream | None:
        """An idle usable stream to `peer_id` on the given path, or None; unusable ones met are closed."""
        fresh = time.monotonic() - self._config.idle_timeout / 2
        for i in range(len(self._idle) - 1, -1, -1):
            stream = self._idle[i]
            if stream.peer_id == peer_id and stream.direct == direct:
                del self._idle[i]
                if stream.usable() and stream.idle_since > fresh:
                    return stream
                stream.writer.close()
        return None

    def release(self, stream: Stream) -> None:
        """Keep `stream` for reuse if it is still usable, else close it."""
        if not stream.usable():
            stream.writer.close()
            return
        stream.idle_since = time.monotonic()
        self._idle.append(stream)
        while len(self._idle) > self._config.max_idle_streams:
            self._idle.pop(0).writer.close()

    def close(self) -> None:
        """Close every idle stream."""
        for stream in self._idle:
            stream.writer.close()
        self._idle.clear()

    async def open(self, peer_id: PeerID) -> Stream:
        """Open a libp2p stream; to a peer that lists relays, through one of them if it cannot be dialled
        (or could not be lately)."""
        self.make_room(peer_id)
        relays = self._relays.get(peer_id, ())
        if not relays:
            return await self._open_direct(peer_id)
        if time.monotonic() >= self._relayed_until.get(peer_id, 0.0):
            try:
                async with asyncio.timeout(DIAL_FIRST_S):  # a NAT may drop the dial unanswered
                    return await self._open_direct(peer_id)
            except (PeerUnreachable, TimeoutError):
                self._relayed_until[peer_id] = time.monotonic() + RELAY_STICKY_S
        for relay in relays:
            try:
                reader, writer = await open_relayed(self._p2p, relay, peer_id, self._config)
            except PeerUnreachable:
                continue
            prepare_writer(writer)
            self._stats.streams_opened["relayed"] += 1
            return Stream(peer_id, reader, writer, direct=False, host=None)
        return await self._open_direct(peer_id)  # no relay could: its error says why the peer could not

    async def _open_direct(self, peer_id: PeerID) -> Stream:
        try:
            info, reader, writer = await open_stream(self._p2p, peer_id, self._config.protocol)
        except P2PDaemonError as e:
            raise PeerUnreachable(f"cannot open a stream to {peer_id}: {e}") from None
        except OSError as e:
            raise TransportError(f"local p2p daemon unavailable: {e}") from None
        prepare_writer(writer)
        self._stats.streams_opened["libp2p"] += 1
        return Stream(peer_id, reader, writer, direct=False, host=_ip_of(info.addr))

    async def exchange(
        self, stream: Stream, method: str, frame: list[Buffer]
    ) -> tuple[bytes, list[torch.Tensor]]:
        """One request and its reply on `stream`, which then goes back to the pool or is closed."""
        reusable = False
        try:
            with suppress(ConnectionError):  # the peer may have refused early: its answer says why
                await write_frame(stream.writer, frame)
            head, tensors = await read_frame(stream.reader, self._config.limits)
            if isinstance(head, ErrorFrame):
                reusable = head.code not in _CLOSING_CODES
                raise RemoteError(head.code, head.message)
            if not isinstance(head, Response):
                raise WireError(f"expected a response, got {type(head).__name__}")
            reusable = True
            return head.meta, tensors
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            raise PeerUnreachable(
                f"stream to {stream.peer_id} broke during {method}: {type(e).__name__}"
            ) from None
        finally:
            if reusable:
                self.release(stream)
            else:
                stream.writer.close()


def _ip_of(addr: Multiaddr) -> str | None:
    names = {protocol.name for protocol in addr.protocols()}
    if "p2p-circuit" in names:
        return None
    for name in ("ip4", "ip6"):
        if name in names:
            return addr.value_for_protocol(name)
    return None
