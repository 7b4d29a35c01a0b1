"""The direct TCP path, negotiated over libp2p: encrypted and bound to both libp2p identities.

With `TransportConfig.direct_host` set, a node also listens for TCP there, and a caller asks the callee over
libp2p for a one-time token and the port, then connects to the IP of that same libp2p connection (never to
an address the callee names). On it, both sides prove their libp2p identities by signing an ephemeral key
exchange (`_handshake`: the caller must be the peer the token was granted to, the callee the peer dialled),
and every byte after it travels in AES-GCM records (`_channel`). That is the path two daemons on different
hosts use by default; a callee without one, or one that cannot be reached over TCP, is called over libp2p.

Plaintext remains only where it never leaves the machine: a callee whose `direct_host` is a loopback address
(with `plaintext_loopback`) also accepts the old plaintext hello (token only), and a caller uses it only to a
loopback IP. There it costs several times less CPU than sealing (see benchmarks/transport_bench.py).

Anyone may connect to the listener: a connection must finish its handshake within `header_timeout`, at most
`max_pending_hellos` wait for theirs at once (a newer one closes the oldest), and a peer holds at most
`max_inbound_per_peer` unused tokens (a newer grant voids its oldest).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import msgpack
import torch
from hivemind.p2p import PeerID

from swarmnode.identity import Identity
from swarmnode.transport._channel import Channel
from swarmnode.transport._config import TransportConfig, TransportStats
from swarmnode.transport._errors import RemoteError, WireError
from swarmnode.transport._framing import Compression, encode_request, prepare_writer
from swarmnode.transport._handshake import PLAIN_MAGIC, TOKEN_BYTES, IdentityRefused, accept, dial, read_hello
from swarmnode.transport._pool import Stream, StreamPool

logger = logging.getLogger(__name__)

# Built-in method that grants a direct TCP connection: replies msgpack [port, token, plaintext accepted].
GRANT_METHOD = "_direct"
CONNECT_TIMEOUT_S = 3.0  # a TCP connect to a peer's direct port; one without answer means no direct path

ServeStream = Callable[[PeerID, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
"""Serves one inbound stream from an authenticated peer: (caller, reader, writer)."""


def is_loopback(host: str) -> bool:
    return ipaddress.ip_address(host).is_loopback


class _NoDirectPath(Exception):
    """This peer cannot be reached by direct TCP (the libp2p route may still work)."""


class DirectListener:
    """The serving side: a TCP listener that admits a connection only with a fresh token it granted, and
    (unless plaintext on loopback) only from the peer it granted it to, proven by the handshake."""

    def __init__(
        self,
        config: TransportConfig,
        stats: TransportStats,
        serve: ServeStream,
        identity: Identity | None,
        peer_id: PeerID,
    ) -> None:
        self._config = config
        self._stats = stats
        self._serve = serve
        self._identity = identity
        self._peer_id = peer_id
        host = cast(str, config.direct_host)
        self._plaintext = config.plaintext_loopback and is_loopback(host)
        self._tokens: dict[bytes, tuple[PeerID, float]] = {}  # token -> (peer, expiry), oldest first
        self._pending: dict[Channel, None] = {}  # connections in their handshake, oldest first
        self._tasks: set[asyncio.Task[None]] = set()  # one per connection being served
        self._server: asyncio.Server | None = None
        self._port = 0  # the TCP port listened on, once started

    @property
    def port(self) -> int:
        """The TCP port listened on (once started)."""
        return self._port

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: Channel(self._accepted), self._config.direct_host, 0)
        self._port = int(self._server.sockets[0].getsockname()[1])

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
        token = secrets.token_bytes(TOKEN_BYTES)
        self._tokens[token] = (peer_id, now + self._config.header_timeout)
        return msgpack.packb([self._port, token, self._plaintext]), []

    def _accepted(self, channel: Channel) -> None:
        task = asyncio.get_running_loop().create_task(self._on_connection(channel))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _on_connection(self, channel: Channel) -> None:
        if len(self._pending) >= self._config.max_pending_hellos:
            oldest = next(iter(self._pending))
            del self._pending[oldest]
            oldest.close()  # its handshake's read ends at once
            self._stats.refused["hello"] += 1
        self._pending[channel] = None
        try:
            async with asyncio.timeout(self._config.header_timeout):
                opened = await self._handshake(channel)
        except IdentityRefused as e:
            logger.warning("refused a direct connection from %s: %s", channel.peername, e)
            self._stats.refused["identity"] += 1
            opened = None
        except WireError as e:
            logger.warning("refused a direct connection from %s: %s", channel.peername, e)
            self._stats.refused["direct_hello"] += 1
            opened = None
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            opened = None
        finally:
            self._pending.pop(channel, None)
        if opened is None:
            channel.close()
            return
        await self._serve(*opened)

    async def _handshake(
        self, channel: Channel
    ) -> tuple[PeerID, asyncio.StreamReader, asyncio.StreamWriter] | None:
        """The caller and its streams, or None (logged) for a connection without a good token."""
        sealed, token, key = await read_hello(channel)
        if not sealed and not self._plaintext:
            raise WireError("a plaintext hello, accepted on loopback only")
        if sealed and self._identity is None:
            raise WireError("an encrypted hello, but this listener has no identity")
        grant = self._tokens.pop(token, None)
        if grant is None or grant[1] < time.monotonic():
            raise WireError("bad or expired token")
        caller = grant[0]
        if not sealed:
            return (caller, *channel.open_streams(None, None))
        keys = await accept(channel, cast(Identity, self._identity), self._peer_id, caller, token, key)
        return (caller, *channel.open_streams(keys.seal, keys.unseal))


class DirectDialer:
    """The calling side: pooled or newly granted direct streams; after a failure, libp2p for a while."""

    def __init__(
        self,
        pool: StreamPool,
        config: TransportConfig,
        stats: TransportStats,
        identity: Identity | None,
        peer_id: PeerID,
    ) -> None:
        self._pool = pool
        self._config = config
        self._stats = stats
        self._identity = identity
        self._peer_id = peer_id
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
        except (_NoDirectPath, RemoteError, WireError, OSError, asyncio.IncompleteReadError) as e:
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
        port, token, plaintext = _parse_grant(meta)
        sealed = not (
            plaintext and is_loopback(host) and (self._config.plaintext_loopback or self._identity is None)
        )
        if sealed and self._identity is None:
            raise _NoDirectPath("its direct path is encrypted, and this transport has no identity to prove")
        self._pool.make_room(peer_id)
        loop = asyncio.get_running_loop()
        try:  # behind a NAT that drops unsolicited packets a connect hangs: fall back to libp2p in time
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                _, channel = await loop.create_connection(Channel, host, port)
        except TimeoutError:
            raise _NoDirectPath(f"no TCP answer from {host}:{port}") from None
        try:
            if sealed:
                async with asyncio.timeout(self._config.header_timeout):
                    keys = await dial(channel, cast(Identity, self._identity), self._peer_id, peer_id, token)
                reader, writer = channel.open_streams(keys.seal, keys.unseal)
            else:
                channel.write_raw(PLAIN_MAGIC + token)
                reader, writer = channel.open_streams(None, None)
        except TimeoutError:
            channel.close()
            raise _NoDirectPath(f"no handshake from {host}:{port}") from None
        except BaseException:
            channel.close()
            raise
        prepare_writer(writer)
        self._stats.streams_opened["encrypted" if sealed else "direct"] += 1
        return Stream(peer_id, reader, writer, direct=True, host=host)


def _parse_grant(meta: bytes) -> tuple[int, bytes, bool]:
    try:
        port, token, plaintext = cast(Any, msgpack.unpackb(meta))
    except Exception as e:  # any garbage: no direct path to this peer
        raise WireError(f"bad direct-path grant: {e}") from None
    valid = isinstance(port, int) and 0 < port < 65536 and isinstance(plaintext, bool)
    if not (valid and isinstance(token, bytes) and len(token) == TOKEN_BYTES):
        raise WireError("bad direct-path grant")
    return port, token, plaintext
