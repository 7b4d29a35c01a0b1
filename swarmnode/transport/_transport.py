"""The `Transport` facade: named tensor RPCs between daemons, over pooled libp2p streams or direct TCP.

By default every stream is a libp2p stream through the daemons' p2pd (authenticated, encrypted, any network
hivemind reaches); with `TransportConfig.direct_host` set, calls prefer the direct TCP path (`_direct`:
encrypted and bound to both peers' libp2p identities, plaintext only on loopback) and fall back to libp2p.
Peers are found by hivemind (DHT, libp2p) either way. The calling side's streams are in `_pool`, the serving
side in `_serving`.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from contextlib import suppress
from types import TracebackType

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

from protocols.links import LinkEstimates
from swarmnode.identity import Identity
from swarmnode.transport._config import TransportConfig, TransportStats
from swarmnode.transport._direct import GRANT_METHOD, DirectDialer, DirectListener, is_loopback
from swarmnode.transport._errors import CallTimeout, TransportError
from swarmnode.transport._framing import MAX_METHOD_CHARS, Compression, encode_request, frame_size
from swarmnode.transport._links import LinkEmulator
from swarmnode.transport._pool import Stream, StreamPool
from swarmnode.transport._relay import RelayService, read_peer, relay_protocol, relayed_protocol
from swarmnode.transport._serving import Handler, Server

logger = logging.getLogger(__name__)


class Transport:
    """One per daemon: serves registered methods and calls them on peers, over the daemon's `P2P`.

    Each call takes an idle stream to the peer (or opens one), writes one request frame, reads one reply
    frame and returns the stream to a small pool, so concurrent calls use separate streams and a large
    transfer never blocks a small one. Every wait is bounded by the call's timeout.

    With `links`, requests and replies to peers at other sites of an emulated network are delayed and
    paced as over those links (`_links`). Every call that succeeds is timed into `estimates`
    (`protocols.links.LinkEstimates`: round trips and seconds per byte, per peer).
    """

    def __init__(
        self,
        p2p: P2P,
        config: TransportConfig | None = None,
        links: LinkEmulator | None = None,
        identity: Identity | None = None,
    ) -> None:
        """`identity`: the daemon's libp2p identity (the key of `p2p`'s peer id), with which the encrypted
        direct path proves who this side is; required for a `direct_host` that is not plaintext loopback."""
        self._p2p = p2p
        self._config = config or TransportConfig()
        self._links = links
        self.estimates = LinkEstimates()
        self.stats = TransportStats()
        self._handlers: dict[str, Handler] = {}
        self._body_limits: dict[str, int] = {}
        self._meta_limits: dict[str, int] = {}
        self._pool = StreamPool(p2p, self._config, self.stats)
        self._server = Server(
            self._config, self.stats, self._handlers, self._body_limits, self._meta_limits, links
        )
        self._dialer: DirectDialer | None = None
        self._listener: DirectListener | None = None
        if identity is not None and identity.peer_id != p2p.peer_id.to_base58():
            raise ValueError(f"the identity {identity.peer_id} is not that of the p2p daemon {p2p.peer_id}")
        host = self._config.direct_host
        if host is not None:
            if identity is None and not (self._config.plaintext_loopback and is_loopback(host)):
                raise ValueError(f"an encrypted direct path on {host} needs the daemon's identity")
            self._dialer = DirectDialer(self._pool, self._config, self.stats, identity, p2p.peer_id)
            self._listener = DirectListener(
                self._config, self.stats, self._server.serve_stream, identity, p2p.peer_id
            )
        self._relay = RelayService(p2p, self._config, self.stats)
        self._own_relays: frozenset[PeerID] = frozenset()
        self._started = False

    @property
    def peer_id(self) -> PeerID:
        return self._p2p.peer_id

    @property
    def links(self) -> LinkEmulator | None:
        """The emulated links this transport sends over (None: none)."""
        return self._links

    def register(
        self,
        method: str,
        handler: Handler,
        max_body_bytes: int | None = None,
        max_meta_bytes: int | None = None,
    ) -> None:
        """Serve `method` with `handler`; its reply tensors are sent from their memory, so it must not
        change them after returning (return clones of live weights). Names starting with "_" are reserved.

        `max_body_bytes` bounds the tensor bytes one request of `method` may carry (default: the limits'
        `max_message_bytes`); a request announcing more is refused as malformed before anything is read.
        `max_meta_bytes` bounds its meta likewise (default: the config's `max_meta_bytes`)."""
        if method.startswith("_"):
            raise ValueError(f"method names starting with '_' are reserved, got {method!r}")
        if len(method) > MAX_METHOD_CHARS:
            raise ValueError(f"method names are at most {MAX_METHOD_CHARS} characters, got {len(method)}")
        if method in self._handlers:
            raise ValueError(f"method {method!r} is already registered")
        for name, bound, bounds in (
            ("max_body_bytes", max_body_bytes, self._body_limits),
            ("max_meta_bytes", max_meta_bytes, self._meta_limits),
        ):
            if bound is not None:
                if bound < 0:
                    raise ValueError(f"{name} must be >= 0, got {bound}")
                bounds[method] = bound
        self._handlers[method] = handler

    def set_relays(self, relays: Mapping[PeerID, Sequence[PeerID]]) -> None:
        """The peers that list relays (peer -> its relays, `_relay`): a stream to one that cannot be dialled
        goes through one of them. Replaces the last such map."""
        self._pool.set_relays(relays)

    def accept_relayed_from(self, relays: Iterable[PeerID]) -> None:
        """This node's own relays: streams they relay are served as streams from the callers they name."""
        self._own_relays = frozenset(relays)

    def ban(self, peer_id: PeerID, seconds: float) -> None:
        """Refuse requests from `peer_id` for `seconds` (for example after it sent non-finite values)."""
        self._server.ban(peer_id, seconds)

    def is_banned(self, peer_id: PeerID) -> bool:
        return self._server.is_banned(peer_id)

    async def start(self) -> None:
        """Start serving: register the libp2p stream handler (and open the direct TCP listener if configured).

        A transport that only calls need not be started."""
        if self._started:
            return
        if self._listener is not None:
            await self._listener.start()
            self._handlers[GRANT_METHOD] = self._listener.grant
        await self._p2p.add_binary_stream_handler(self._config.protocol, self._on_stream)
        await self._p2p.add_binary_stream_handler(relay_protocol(self._config), self._relay.handle)
        await self._p2p.add_binary_stream_handler(relayed_protocol(self._config), self._on_relayed)
        self._started = True

    async def close(self) -> None:
        """Stop serving, cancel requests in progress and close every stream; the P2P stays up."""
        self._server.stop()
        if self._started:
            self._started = False
            protocols = (self._config.protocol, relay_protocol(self._config), relayed_protocol(self._config))
            with suppress(TimeoutError):
                async with asyncio.timeout(self._config.header_timeout):
                    for protocol in protocols:  # each on its own: one already gone leaves the others
                        with suppress(P2PDaemonError, OSError):
                            await self._p2p.remove_binary_stream_handler(protocol)
        if self._listener is not None:
            self._listener.close()
        self._pool.close()
        await self._relay.close()
        await self._server.cancel()

    async def __aenter__(self) -> Transport:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def call(
        self,
        peer_id: PeerID,
        method: str,
        meta: bytes,
        tensors: Sequence[torch.Tensor],
        timeout: float,
        *,
        compression: Compression | None = None,
        direct: bool = True,
    ) -> tuple[bytes, list[torch.Tensor]]:
        """Call `method` on `peer_id` and return its reply (meta, tensors), all within `timeout` seconds.

        `compression` (default: the transport's) applies to float32 tensors in both directions. With
        `direct=False` the call never waits for a direct path to open (a short call, such as a ping, whose
        timeout is below the direct connect's). The caller must not change `tensors` until the call returns.
        Raises PeerUnreachable, CallTimeout, RemoteError or WireError (all TransportError); TypeError or
        ValueError for arguments that cannot be sent.
        """
        if not 0 < timeout < math.inf:
            raise ValueError(f"timeout must be positive and finite, got {timeout}")
        compression = self._config.compression if compression is None else compression
        frame = encode_request(method, timeout, compression, meta, tensors, compression)
        size = frame_size(frame)
        if size > self._config.limits.max_message_bytes:
            raise ValueError(f"request of {size} bytes exceeds max_message_bytes")
        started = asyncio.get_running_loop().time()
        try:
            async with asyncio.timeout(timeout):
                if self._links is not None:
                    await self._links.hold(peer_id, size)  # before a stream is taken: it may wait long
                async with self._pool.slot(peer_id):
                    stream = await self._stream_to(peer_id, direct)
                    result = await self._pool.exchange(stream, method, frame)
        except TimeoutError:
            self.stats.calls_failed["CallTimeout"] += 1
            raise CallTimeout(f"{method} on {peer_id} timed out after {timeout:g} s") from None
        except TransportError as e:
            self.stats.calls_failed[type(e).__name__] += 1
            raise
        self.stats.calls_ok += 1
        received = len(result[0]) + sum(tensor.nbytes for tensor in result[1])
        seconds = asyncio.get_running_loop().time() - started
        self.estimates.observe(peer_id.to_base58(), size, received, seconds)
        return result

    async def _stream_to(self, peer_id: PeerID, direct: bool) -> Stream:
        if direct and self._dialer is not None:
            stream = await self._dialer.stream_to(peer_id)
            if stream is not None:
                return stream
        return self._pool.take(peer_id, direct=False) or await self._pool.open(peer_id)

    async def _on_stream(
        self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await self._server.serve_stream(info.peer_id, reader, writer)

    async def _on_relayed(
        self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """A stream one of this node's relays spliced from a caller it names (`_relay`)."""
        try:
            if info.peer_id not in self._own_relays:
                raise ValueError(f"{info.peer_id} is not one of this node's relays")
            async with asyncio.timeout(self._config.header_timeout):
                caller = await read_peer(reader)
            if caller == self.peer_id:
                raise ValueError("a relay names this node as the caller")
        except (ValueError, TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
            self.stats.refused["relayed"] += 1
            logger.info("refused a relayed stream from %s: %s", info.peer_id, e or type(e).__name__)
            writer.close()
            return
        await self._server.serve_stream(caller, reader, writer)
