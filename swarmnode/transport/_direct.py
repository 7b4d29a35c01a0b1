"""The direct TCP path, negotiated over libp2p.

With `TransportConfig.direct_host` set, a node also listens for plain TCP there, and a caller with it set asks
the callee over libp2p for a one-time token and the port, then connects to the IP of that same libp2p
connection (never to an address the callee names) and presents the token: the TCP stream is thus bound to the
authenticated peer id. A callee without a direct path, or one that cannot be reached over TCP, is called over
libp2p. Direct TCP is plaintext: meant for loopback and trusted LANs, where it takes several times less CPU
and latency than the p2pd route (see benchmarks/transport_bench.py).

Anyone may connect to the listener: a connection must present its token within `header_timeout`, at most
`max_pending_hellos` wait for theirs at once (a newer one closes the oldest), and a peer holds at most
`max_inbound_per_peer` unused tokens (a newer grant voids its oldest).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import struct
import time
from collections.abc import Awaitable, Callable
from typing import cast

import msgpack
import torch
from hivemind.p2p import PeerID

from swarmnode.transport._config import TransportConfig, TransportStats
from swarmnode.transport._errors import RemoteError, WireError
from swarmnode.transport._framing import Compression, encode_request, prepare_writer
from swarmnode.transport._pool import Stream, StreamPool

logger = logging.getLogger(__name__)

# Built-in method that grants a direct TCP connection: replies msgpack [port, token].
GRANT_METHOD = "_direct"
# First bytes on a direct TCP connection: magic and the one-time token.
_HELLO = struct.Struct("<4s16s")
_HELLO_MAGIC = b"SWND"
CONNECT_TIMEOUT_S = 3.0  # a TCP connect to a peer's direct port; one without answer means no direct path

ServeStream = Callable[[PeerID, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
"""Serves one inbound stream from an authenticated peer: (caller, reader, writer)."""


class _NoDirectPath(Exception):
    """This peer cannot be reached by direct TCP (the libp2p route may still work)."""


class DirectListener:
    """The serving side: a TCP listener that admits a connection only with a fresh token it granted."""

    def __init__(self, config: TransportConfig, stats: TransportStats, serve: ServeStream) -> None:
        self._config = config
        self._stats = stats
        self._serve = serve
        self._tokens: dict[bytes, tuple[PeerID, float]] = {}  # token -> (peer, expiry), oldest first
        self._pending: dict[asyncio.StreamWriter, None] = {}  # connections awaiting their hello, oldest first
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        """The TCP port listened on (once started)."""
        port: int = cast(asyncio.Server, self._server).sockets[0].getsockname()[1]
        return port

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._on_connection, self._config.direct_host, 0)

    def close(self) -> None:
        """Stop listening; connections already accepted are served on."""
        if self._server is not None:
            self._server.close()

    async def grant(
        self, peer_id: PeerID, meta: bytes, tensors: list[torch.Tensor]
    ) -> tuple[bytes, list[torch.Tensor]]:
        """The handler of GRANT_METHOD: a one-time token for `peer_id`, valid for `header_timeout`."""
        now = time.monotonic()
        self._tokens = {token: grant for token, grant in self._tokens.items() if grant[1] > now}
        held = [token for token, grant in self._tokens.items() if grant[0] == peer_id]
        for token in held[: max(0, len(held) - self._config.max_inbound_per_peer + 1)]:
            del self._tokens[token]
        token = secrets.token_bytes(16)
        self._tokens[token] = (peer_id, now + self._config.header_timeout)
        return msgpack.packb([self.port, token]), []

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._pending) >= self._config.max_pending_hellos:
            oldest = next(iter(self._pending))
            del self._pending[oldest]
            oldest.close()  # its read of the hello ends at once
            self._stats.refused["hello"] += 1
        self._pending[writer] = None
        try:
            async with asyncio.timeout(self._config.header_timeout):
                magic, token = _HELLO.unpack(await reader.readexactly(_HELLO.size))
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        finally:
            self._pending.pop(writer, None)
        grant = self._tokens.pop(token, None) if magic == _HELLO_MAGIC else None
        if grant is None or grant[1] < time.monotonic():
            logger.warning(
                "refused a direct connection from %s: bad or expired token", writer.get_extra_info("peername")
            )
            writer.close()
            return
        await self._serve(grant[0], reader, writer)


class DirectDialer:
    """The calling side: pooled or newly granted direct streams; after a failure, libp2p for a while."""

    def __init__(self, pool: StreamPool, config: TransportConfig, stats: TransportStats) -> None:
        self._pool = pool
        self._config = config
        self._stats = stats
        self._no_direct: dict[PeerID, float] = {}  # peer -> monotonic time to try its direct path again

    async def stream_to(self, peer_id: PeerID) -> Stream | None:
        """A direct stream to `peer_id`, or None when the caller should use libp2p.

        Raises RemoteError when the peer refuses the grant (banned, overloaded) and whatever reaching it
        over libp2p raises (PeerUnreachable, TransportError)."""
        stream = self._pool.take(peer_id, direct=True)
        if stream is not None:
            return stream
        if self._no_direct.get(peer_id, 0.0) > time.monotonic():
            return None
        self._no_direct.pop(peer_id, None)
        try:
            return await self._open(peer_id)
        except (_NoDirectPath, RemoteError, WireError, OSError) as e:  # libp2p may still work
            if isinstance(e, RemoteError) and e.kind != "unknown_method":
                raise  # refused (banned, overloaded): not a question of paths
            logger.info("no direct path to %s (%s); using libp2p", peer_id, e)
            now = time.monotonic()
            self._no_direct = {peer: until for peer, until in self._no_direct.items() if until > now}
            self._no_direct[peer_id] = now + self._config.direct_retry_seconds
        return None

    async def _open(self, peer_id: PeerID) -> Stream:
        """Ask the peer over libp2p for a token, then connect over TCP to the IP of that libp2p stream."""
        via = self._pool.take(peer_id, direct=False) or await self._pool.open(peer_id)
        host = via.host
        if host is None:
            self._pool.release(via)
            raise _NoDirectPath("the peer is reached through a relay")
        grant = encode_request(
            GRANT_METHOD, self._config.header_timeout, Compression.NONE, b"", [], Compression.NONE
        )
        meta, _ = await self._pool.exchange(via, GRANT_METHOD, grant)
        try:
            port, token = msgpack.unpackb(meta)
        except Exception as e:  # any garbage: no direct path to this peer
            raise WireError(f"bad direct-path grant: {e}") from None
        if not (isinstance(port, int) and 0 < port < 65536 and isinstance(token, bytes) and len(token) == 16):
            raise WireError("bad direct-path grant")
        self._pool.make_room(peer_id)
        try:  # behind a NAT that drops unsolicited packets a connect hangs: fall back to libp2p in time
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                reader, writer = await asyncio.open_connection(host, port)
        except TimeoutError:
            raise _NoDirectPath(f"no TCP answer from {host}:{port}") from None
        prepare_writer(writer)
        writer.write(_HELLO.pack(_HELLO_MAGIC, token))
        self._stats.streams_opened["direct"] += 1
        return Stream(peer_id, reader, writer, direct=True, host=host)
