"""Streams through a relay: how two nodes that cannot open a connection to each other talk.

A node behind a NAT lists its relays in its record (`swarmnode.relays`: by default its initial peers, to
which it opens connections as it joins). A caller that cannot open a stream to it opens one to a relay
instead (protocol `<transport protocol>.relay`) and names the target (`encode_peer`); the relay opens a
stream to the target over the connection the target opened to it (`<transport protocol>.relayed`), names
the caller, answers one status byte, and from then on copies bytes
both ways until either side ends. The target serves the stream as one from the caller, and only if it came
from one of its own relays. Frames pass through unread, so a relayed stream is pooled and reused like any.

p2pd's own circuit relay is not used for this: between two NATed nodes, hivemind 1.1.12's p2pd reset the
relayed connection during the tiny model's first 256 KiB forward in 3 of 4 runs (likely libp2p's default
limit of 128 KiB per relayed connection: docs/design.md, "Volunteers behind NAT").

Trust: a relay reads what it relays (each leg is encrypted by libp2p, not end to end) and vouches for the
caller's peer id; a node chooses its relays. A relay copies for any caller to any swarmnode peer that
accepts relayed streams, within `MAX_SPLICES` at once and `MAX_SPLICES_PER_CALLER` per caller.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from contextlib import suppress

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

from swarmnode.transport._config import TransportConfig, TransportStats
from swarmnode.transport._errors import PeerUnreachable, TransportError
from swarmnode.transport._opening import open_stream

logger = logging.getLogger(__name__)

MAX_SPLICES = 64  # relayed streams a relay copies at once
MAX_SPLICES_PER_CALLER = 16  # ... for one caller (its `max_calls_per_peer` streams to one target fit)
MAX_PEER_ID_BYTES = 64  # an Ed25519 or RSA peer id's multihash is 38-39 bytes
COPY_CHUNK = 1 << 16
SPLICED, REFUSED, UNREACHABLE = 0, 1, 2  # the relay's status byte
_STATUS_TEXT = {REFUSED: "refused (relay busy or a bad request)", UNREACHABLE: "cannot reach the target"}


def relay_protocol(config: TransportConfig) -> str:
    return f"{config.protocol}.relay"


def relayed_protocol(config: TransportConfig) -> str:
    return f"{config.protocol}.relayed"


def encode_peer(peer_id: PeerID) -> bytes:
    """A peer id as a relay header: its length in one byte, then its bytes."""
    raw = peer_id.to_bytes()
    if not 0 < len(raw) <= MAX_PEER_ID_BYTES:
        raise ValueError(f"a peer id of {len(raw)} bytes cannot be named in a relay header")
    return bytes([len(raw)]) + raw


async def read_peer(reader: asyncio.StreamReader) -> PeerID:
    """The peer a relay header names; ValueError for a malformed one."""
    (size,) = await reader.readexactly(1)
    if not 0 < size <= MAX_PEER_ID_BYTES:
        raise ValueError(f"a relay header names a peer id of {size} bytes")
    raw = await reader.readexactly(size)
    # a peer id is a multihash: identity (code 0, an inlined key) or sha2-256 (0x12), then the digest's length
    if size < 3 or raw[0] not in (0x00, 0x12) or raw[1] != size - 2:
        raise ValueError("a relay header names no valid peer id")
    return PeerID(raw)


async def open_relayed(
    p2p: P2P, relay: PeerID, target: PeerID, config: TransportConfig
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A stream to `target` through `relay`, spliced and ready for frames; PeerUnreachable if the relay
    cannot be reached or cannot reach the target (or refuses)."""
    try:
        _, reader, writer = await open_stream(p2p, relay, relay_protocol(config))
    except P2PDaemonError as e:
        raise PeerUnreachable(f"cannot open a stream to relay {relay}: {e}") from None
    except OSError as e:
        raise TransportError(f"local p2p daemon unavailable: {e}") from None
    try:
        writer.write(encode_peer(target))
        async with asyncio.timeout(config.header_timeout):
            await writer.drain()
            (status,) = await reader.readexactly(1)
    except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
        writer.close()
        raise PeerUnreachable(f"relay {relay} did not answer for {target}") from None
    if status != SPLICED:
        writer.close()
        why = _STATUS_TEXT.get(status, f"status {status}")
        raise PeerUnreachable(f"relay {relay} for {target}: {why}")
    return reader, writer


class RelayService:
    """The relay side: splices a caller's `.relay` stream to a stream to the target it names."""

    def __init__(self, p2p: P2P, config: TransportConfig, stats: TransportStats) -> None:
        self._p2p = p2p
        self._config = config
        self._stats = stats
        self._per_caller: Counter[PeerID] = Counter()
        self._tasks: set[asyncio.Task[None]] = set()

    async def handle(
        self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        caller = info.peer_id
        if len(self._tasks) >= MAX_SPLICES or self._per_caller[caller] >= MAX_SPLICES_PER_CALLER:
            self._stats.refused["relay_busy"] += 1
            await _answer(writer, REFUSED)
            writer.close()
            return
        task = asyncio.current_task()
        self._tasks.add(task)  # type: ignore[arg-type]
        self._per_caller[caller] += 1
        try:
            await self._splice(caller, reader, writer)
        finally:
            self._tasks.discard(task)  # type: ignore[arg-type]
            self._per_caller[caller] -= 1
            if not self._per_caller[caller]:
                del self._per_caller[caller]
            writer.close()

    async def _splice(
        self, caller: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            async with asyncio.timeout(self._config.header_timeout):
                target = await read_peer(reader)
                if target == caller or target == self._p2p.peer_id:
                    raise ValueError("a relay header names the caller or the relay itself")
                try:
                    _, far_reader, far_writer = await open_stream(
                        self._p2p, target, relayed_protocol(self._config)
                    )
                except P2PDaemonError as e:
                    logger.info("cannot relay %s to %s: %s", caller, target, e)
                    await _answer(writer, UNREACHABLE)
                    return
        except (ValueError, TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
            self._stats.refused["relay_header"] += 1
            logger.info("refused a relay request from %s: %s", caller, e or type(e).__name__)
            with suppress(ConnectionError):
                await _answer(writer, REFUSED)
            return
        try:
            far_writer.write(encode_peer(caller))
            writer.write(bytes([SPLICED]))
            self._stats.relayed += 1
            await _copy_both_ways(reader, writer, far_reader, far_writer)
        finally:
            far_writer.close()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()


async def _answer(writer: asyncio.StreamWriter, status: int) -> None:
    writer.write(bytes([status]))
    with suppress(ConnectionError, TimeoutError):
        async with asyncio.timeout(1.0):
            await writer.drain()


async def _copy_both_ways(
    a_reader: asyncio.StreamReader,
    a_writer: asyncio.StreamWriter,
    b_reader: asyncio.StreamReader,
    b_writer: asyncio.StreamWriter,
) -> None:
    """Copy a->b and b->a until either side ends or fails; then both are closed by the caller."""
    copies = [
        asyncio.ensure_future(_copy(a_reader, b_writer)),
        asyncio.ensure_future(_copy(b_reader, a_writer)),
    ]
    try:
        await asyncio.wait(copies, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for copy in copies:
            copy.cancel()
        await asyncio.gather(*copies, return_exceptions=True)


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with suppress(ConnectionError):
        while chunk := await reader.read(COPY_CHUNK):
            writer.write(chunk)
            await writer.drain()
