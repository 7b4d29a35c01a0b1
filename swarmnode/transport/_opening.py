"""Opening a libp2p stream so that a timeout or cancellation never strands a half-open one."""

from __future__ import annotations

import asyncio

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

Opened = tuple[StreamInfo, asyncio.StreamReader, asyncio.StreamWriter]


async def open_stream(p2p: P2P, peer_id: PeerID, protocol: str) -> Opened:
    """`p2p.call_binary_stream_handler`, shielded: if the caller gives up, the opening finishes on its own
    and the stream is closed. Raises what it raises (P2PDaemonError, OSError)."""
    opening = asyncio.ensure_future(p2p.call_binary_stream_handler(peer_id, protocol))
    try:
        return await asyncio.shield(opening)
    except asyncio.CancelledError:
        opening.add_done_callback(_close_opened)
        raise


def _close_opened(opening: asyncio.Future[Opened]) -> None:
    if not opening.cancelled() and opening.exception() is None:
        opening.result()[2].close()
