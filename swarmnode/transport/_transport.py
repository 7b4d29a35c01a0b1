"""Named tensor RPCs between daemons over persistent libp2p streams, with an optional direct TCP path.

Paths. By default every stream is a libp2p stream through the daemons' p2pd (authenticated, encrypted, any
network hivemind reaches). With `TransportConfig.direct_host` set, a node also listens for plain TCP there,
and a caller with it set asks the callee over libp2p for a one-time token and the port, then connects to the
IP of that same libp2p connection (never to an address the callee names) and presents the token: the TCP
stream is thus bound to the authenticated peer id. Peers are still found by hivemind (DHT, libp2p); a callee
without a direct path, or one that cannot be reached over TCP, is called over libp2p. Direct TCP is
plaintext: meant for loopback and trusted LANs, where it takes several times less CPU and latency than the
p2pd route (see benchmarks/transport_bench.py).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import secrets
import struct
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, cast

import msgpack
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.utils.multiaddr import Multiaddr

from swarmnode.transport._errors import (
    CallTimeout,
    PeerUnreachable,
    ProtocolError,
    RemoteError,
    TransportError,
)
from swarmnode.transport._framing import (
    IO_CHUNK,
    PREFIX,
    Buffer,
    Compression,
    Error,
    Kind,
    Limits,
    Request,
    Response,
    encode_error,
    encode_request,
    encode_response,
    frame_size,
    parse_head,
    parse_prefix,
    prepare_writer,
    read_frame,
    read_tensors,
    write_frame,
)

logger = logging.getLogger(__name__)

Handler = Callable[[PeerID, bytes, list[torch.Tensor]], Awaitable[tuple[bytes, list[torch.Tensor]]]]
"""Serves one method: (caller, meta, tensors) -> (meta, tensors) of the reply."""

# Error codes after which the server closes the stream: such a stream is not reused.
_CLOSING_CODES = frozenset({"bad_request", "banned", "overloaded"})
# Built-in method that grants a direct TCP connection: replies msgpack [port, token].
_GRANT_METHOD = "_direct"
# First bytes on a direct TCP connection: magic and the one-time token.
_HELLO = struct.Struct("<4s16s")
_HELLO_MAGIC = b"SWND"


class _NoDirectPath(Exception):
    """This peer cannot be reached by direct TCP (the libp2p route may still work)."""


@dataclass(frozen=True)
class TransportConfig:
    """Settings of one transport; the defaults suit a loopback swarm.

    protocol: the libp2p protocol id of the stream handler.
    compression: how float32 tensors travel unless a call says otherwise (FLOAT16 halves the bytes).
    limits: the largest frame, head, tensor count and rank accepted from a peer.
    header_timeout: bound on each small step: a started frame's head, a direct-path hello (and its token's
        life), an error answer to a refused stream.
    max_request_seconds: the server's bound on one request (body, handler, reply), whatever the caller asks.
    max_inbound_streams: concurrent streams served; more are refused ("overloaded").
    max_inbound_per_peer: concurrent streams served to one peer; more are refused ("overloaded").
    max_idle_streams: outbound streams kept open for reuse, across all peers.
    ban_seconds: how long a peer that sent a malformed frame is refused (0: never ban).
    direct_host: listen for direct TCP on this IP address ("127.0.0.1", or "0.0.0.0" for a LAN) and use
        peers' direct paths; None (default): libp2p only. Plaintext: for loopback and trusted networks.
    direct_retry_seconds: after a peer's direct path failed, use libp2p to it for this long.
    """

    protocol: str = "swarmnode.transport.v1"
    compression: Compression = Compression.NONE
    limits: Limits = field(default_factory=Limits)
    header_timeout: float = 10.0
    max_request_seconds: float = 600.0
    max_inbound_streams: int = 256
    max_inbound_per_peer: int = 64
    max_idle_streams: int = 64
    ban_seconds: float = 60.0
    direct_host: str | None = None
    direct_retry_seconds: float = 60.0

    def __post_init__(self) -> None:
        if self.direct_host is not None:
            ipaddress.ip_address(self.direct_host)  # ValueError unless one IP: a name may bind several ports
        if not (self.header_timeout > 0 and self.max_request_seconds > 0):
            raise ValueError("header_timeout and max_request_seconds must be positive")


@dataclass
class TransportStats:
    """Counters since start: calls that succeeded and failed (by error type), requests served and answered
    with an error (by code), outbound streams opened (by path: "libp2p", "direct")."""

    calls_ok: int = 0
    calls_failed: Counter[str] = field(default_factory=Counter)
    served: int = 0
    errors_returned: Counter[str] = field(default_factory=Counter)
    streams_opened: Counter[str] = field(default_factory=Counter)


@dataclass(eq=False)
class _Stream:
    peer_id: PeerID
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    direct: bool
    host: str | None  # the peer's IP as this stream reaches it (None through a relay)

    def usable(self) -> bool:
        return not (self.reader.at_eof() or self.reader.exception() or self.writer.is_closing())


class Transport:
    """One per daemon: serves registered methods and calls them on peers, over the daemon's `P2P`.

    Each call takes an idle stream to the peer (or opens one), writes one request frame, reads one reply
    frame and returns the stream to a small pool, so concurrent calls use separate streams and a large
    transfer never blocks a small one. Every wait is bounded by the call's timeout.
    """

    def __init__(self, p2p: P2P, config: TransportConfig | None = None) -> None:
        self._p2p = p2p
        self._config = config or TransportConfig()
        self._handlers: dict[str, Handler] = {}
        self._idle: list[_Stream] = []  # oldest first
        self._inbound: set[asyncio.Task[Any]] = set()  # tasks serving a stream
        self._inbound_per_peer: Counter[PeerID] = Counter()
        self._banned: dict[PeerID, float] = {}  # peer -> monotonic time the ban ends
        self._tokens: dict[bytes, tuple[PeerID, float]] = {}  # direct-path token -> (peer, expiry)
        self._no_direct: dict[PeerID, float] = {}  # peer -> monotonic time to try its direct path again
        self._tcp_server: asyncio.Server | None = None
        self._started = False
        self._closing = False
        self.stats = TransportStats()

    @property
    def peer_id(self) -> PeerID:
        return self._p2p.peer_id

    def register(self, method: str, handler: Handler) -> None:
        """Serve `method` with `handler`; its reply tensors are sent from their memory, so it must not
        change them after returning (return clones of live weights). Names starting with "_" are reserved."""
        if method.startswith("_"):
            raise ValueError(f"method names starting with '_' are reserved, got {method!r}")
        if method in self._handlers:
            raise ValueError(f"method {method!r} is already registered")
        self._handlers[method] = handler

    def ban(self, peer_id: PeerID, seconds: float) -> None:
        """Refuse requests from `peer_id` for `seconds` (for example after it sent non-finite values)."""
        now = time.monotonic()
        self._banned = {peer: until for peer, until in self._banned.items() if until > now}
        self._banned[peer_id] = max(self._banned.get(peer_id, 0.0), now + seconds)

    def is_banned(self, peer_id: PeerID) -> bool:
        until = self._banned.get(peer_id)
        if until is not None and until <= time.monotonic():
            del self._banned[peer_id]
            return False
        return until is not None

    async def start(self) -> None:
        """Start serving: register the libp2p stream handler (and open the direct TCP listener if configured).

        A transport that only calls need not be started."""
        if self._started:
            return
        if self._config.direct_host is not None:
            self._tcp_server = await asyncio.start_server(
                self._on_direct_connection, self._config.direct_host, 0
            )
            self._handlers[_GRANT_METHOD] = self._grant_direct
        await self._p2p.add_binary_stream_handler(self._config.protocol, self._on_stream)
        self._started = True

    async def close(self) -> None:
        """Stop serving, cancel requests in progress and close every stream; the P2P stays up."""
        self._closing = True
        if self._started:
            self._started = False
            with suppress(P2PDaemonError, OSError, TimeoutError):
                async with asyncio.timeout(self._config.header_timeout):
                    await self._p2p.remove_binary_stream_handler(self._config.protocol)
        if self._tcp_server is not None:
            self._tcp_server.close()
        for stream in self._idle:
            stream.writer.close()
        self._idle.clear()
        tasks = list(self._inbound)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def __aenter__(self) -> Transport:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # ---- calling --------------------------------------------------------------------------------------

    async def call(
        self,
        peer_id: PeerID,
        method: str,
        meta: bytes,
        tensors: Sequence[torch.Tensor],
        timeout: float,
        *,
        compression: Compression | None = None,
    ) -> tuple[bytes, list[torch.Tensor]]:
        """Call `method` on `peer_id` and return its reply (meta, tensors), all within `timeout` seconds.

        `compression` (default: the transport's) applies to float32 tensors in both directions. The caller
        must not change `tensors` until the call returns. Raises PeerUnreachable, CallTimeout, RemoteError or
        ProtocolError (all TransportError); TypeError/ValueError for arguments that cannot be sent.
        """
        if not 0 < timeout < math.inf:
            raise ValueError(f"timeout must be positive and finite, got {timeout}")
        compression = self._config.compression if compression is None else compression
        frame = encode_request(method, timeout, compression, meta, tensors, compression)
        size = frame_size(frame)
        if size > self._config.limits.max_message_bytes:
            raise ValueError(f"request of {size} bytes exceeds max_message_bytes")
        try:
            async with asyncio.timeout(timeout):
                stream = await self._stream_to(peer_id)
                result = await self._exchange(stream, method, frame)
        except TimeoutError:
            self.stats.calls_failed["CallTimeout"] += 1
            raise CallTimeout(f"{method} on {peer_id} timed out after {timeout:g} s") from None
        except TransportError as e:
            self.stats.calls_failed[type(e).__name__] += 1
            raise
        self.stats.calls_ok += 1
        return result

    async def _exchange(
        self, stream: _Stream, method: str, frame: list[Buffer]
    ) -> tuple[bytes, list[torch.Tensor]]:
        """One request and its reply on `stream`, which then goes back to the pool or is closed."""
        reusable = False
        try:
            with suppress(ConnectionError):  # the peer may have refused early: its answer says why
                await write_frame(stream.writer, frame)
            head, tensors = await read_frame(stream.reader, self._config.limits)
            if isinstance(head, Error):
                reusable = head.code not in _CLOSING_CODES
                raise RemoteError(head.code, head.message)
            if not isinstance(head, Response):
                raise ProtocolError(f"expected a response, got {type(head).__name__}")
            reusable = True
            return head.meta, tensors
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            raise PeerUnreachable(
                f"stream to {stream.peer_id} broke during {method}: {type(e).__name__}"
            ) from None
        finally:
            if reusable:
                self._release(stream)
            else:
                stream.writer.close()

    async def _stream_to(self, peer_id: PeerID) -> _Stream:
        if self._config.direct_host is not None:
            stream = self._take_idle(peer_id, direct=True)
            if stream is not None:
                return stream
            if self._no_direct.get(peer_id, 0.0) <= time.monotonic():
                self._no_direct.pop(peer_id, None)
                try:
                    return await self._open_direct(peer_id)
                except (_NoDirectPath, RemoteError, ProtocolError, OSError) as e:  # libp2p may still work
                    if isinstance(e, RemoteError) and e.kind != "unknown_method":
                        raise  # refused (banned, overloaded): not a question of paths
                    logger.info("no direct path to %s (%s); using libp2p", peer_id, e)
                    now = time.monotonic()
                    self._no_direct = {peer: until for peer, until in self._no_direct.items() if until > now}
                    self._no_direct[peer_id] = now + self._config.direct_retry_seconds
        return self._take_idle(peer_id, direct=False) or await self._open(peer_id)

    def _take_idle(self, peer_id: PeerID, direct: bool) -> _Stream | None:
        for i in range(len(self._idle) - 1, -1, -1):
            stream = self._idle[i]
            if stream.peer_id == peer_id and stream.direct == direct:
                del self._idle[i]
                if stream.usable():
                    return stream
                stream.writer.close()
        return None

    def _release(self, stream: _Stream) -> None:
        if not stream.usable():
            stream.writer.close()
            return
        self._idle.append(stream)
        while len(self._idle) > self._config.max_idle_streams:
            self._idle.pop(0).writer.close()

    async def _open(self, peer_id: PeerID) -> _Stream:
        """Open a libp2p stream."""
        # Shielded so that a timeout cannot strand a half-open stream: if the caller gives up, the opening
        # finishes on its own and is closed.
        opening = asyncio.ensure_future(self._p2p.call_binary_stream_handler(peer_id, self._config.protocol))
        try:
            info, reader, writer = await asyncio.shield(opening)
        except asyncio.CancelledError:
            opening.add_done_callback(_close_opened)
            raise
        except P2PDaemonError as e:
            raise PeerUnreachable(f"cannot open a stream to {peer_id}: {e}") from None
        except OSError as e:
            raise TransportError(f"local p2p daemon unavailable: {e}") from None
        prepare_writer(writer)
        self.stats.streams_opened["libp2p"] += 1
        return _Stream(peer_id, reader, writer, direct=False, host=_ip_of(info.addr))

    async def _open_direct(self, peer_id: PeerID) -> _Stream:
        """Ask the peer over libp2p for a token, then connect over TCP to the IP of that libp2p stream."""
        via = self._take_idle(peer_id, direct=False) or await self._open(peer_id)
        host = via.host
        if host is None:
            self._release(via)
            raise _NoDirectPath("the peer is reached through a relay")
        grant = encode_request(
            _GRANT_METHOD, self._config.header_timeout, Compression.NONE, b"", [], Compression.NONE
        )
        meta, _ = await self._exchange(via, _GRANT_METHOD, grant)
        try:
            port, token = msgpack.unpackb(meta)
        except Exception as e:  # any garbage: no direct path to this peer
            raise ProtocolError(f"bad direct-path grant: {e}") from None
        if not (isinstance(port, int) and 0 < port < 65536 and isinstance(token, bytes) and len(token) == 16):
            raise ProtocolError("bad direct-path grant")
        reader, writer = await asyncio.open_connection(host, port)
        prepare_writer(writer)
        writer.write(_HELLO.pack(_HELLO_MAGIC, token))
        self.stats.streams_opened["direct"] += 1
        return _Stream(peer_id, reader, writer, direct=True, host=host)

    # ---- serving --------------------------------------------------------------------------------------

    async def _grant_direct(
        self, peer_id: PeerID, meta: bytes, tensors: list[torch.Tensor]
    ) -> tuple[bytes, list[torch.Tensor]]:
        now = time.monotonic()
        self._tokens = {token: grant for token, grant in self._tokens.items() if grant[1] > now}
        token = secrets.token_bytes(16)
        self._tokens[token] = (peer_id, now + self._config.header_timeout)
        port = cast(asyncio.Server, self._tcp_server).sockets[0].getsockname()[1]
        return msgpack.packb([port, token]), []

    async def _on_stream(
        self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await self._serve_stream(info.peer_id, reader, writer)

    async def _on_direct_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(self._config.header_timeout):
                magic, token = _HELLO.unpack(await reader.readexactly(_HELLO.size))
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        grant = self._tokens.pop(token, None) if magic == _HELLO_MAGIC else None
        if grant is None or grant[1] < time.monotonic():
            logger.warning(
                "refused a direct connection from %s: bad or expired token", writer.get_extra_info("peername")
            )
            writer.close()
            return
        await self._serve_stream(grant[0], reader, writer)

    async def _serve_stream(
        self, peer_id: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Serve requests on one stream until it ends; raises nothing but a foreign cancellation."""
        if self._closing:  # accepted just as the transport closed
            writer.close()
            return
        prepare_writer(writer)
        refusal = self._refusal(peer_id)
        if refusal is not None:
            self.stats.errors_returned[refusal] += 1
            await self._refuse(reader, writer, refusal, f"not serving {peer_id} now")
            writer.close()
            return
        task = cast(asyncio.Task[Any], asyncio.current_task())
        self._inbound.add(task)
        self._inbound_per_peer[peer_id] += 1
        try:
            await self._serve_requests(peer_id, reader, writer)
        except asyncio.CancelledError:
            if not self._closing:
                raise  # cancelled by someone else; a cancellation from close() ends the stream quietly
        finally:
            self._inbound.discard(task)
            self._inbound_per_peer[peer_id] -= 1
            if not self._inbound_per_peer[peer_id]:
                del self._inbound_per_peer[peer_id]
            writer.close()

    async def _serve_requests(
        self, peer_id: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Serve requests one after another; a bad frame gets an answer, a ban and the end of the stream."""
        try:
            while await self._serve_one(peer_id, reader, writer):
                pass
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the caller closed the stream (or its peer died)
        except ProtocolError as e:
            logger.warning("rejected a frame from %s: %s", peer_id, e)
            self.stats.errors_returned["bad_request"] += 1
            if self._config.ban_seconds > 0:
                self.ban(peer_id, self._config.ban_seconds)
            await self._refuse(reader, writer, "bad_request", str(e))
        except TimeoutError:
            logger.warning("dropped a stream from %s: a frame stalled mid-way", peer_id)
        except Exception:
            logger.exception("serving a stream from %s failed", peer_id)

    def _refusal(self, peer_id: PeerID) -> str | None:
        if self.is_banned(peer_id):
            return "banned"
        if len(self._inbound) >= self._config.max_inbound_streams:
            return "overloaded"
        if self._inbound_per_peer[peer_id] >= self._config.max_inbound_per_peer:
            return "overloaded"
        return None

    async def _serve_one(
        self, peer_id: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Serve one request; return False when the stream must close."""
        prefix = await reader.readexactly(PREFIX.size)  # an idle stream may wait: its caller owns it
        loop = asyncio.get_running_loop()
        started = loop.time()
        config = self._config
        kind, head_len, body_len = parse_prefix(prefix, config.limits)
        if kind is not Kind.REQUEST:
            raise ProtocolError(f"expected a request, got a {kind.name} frame")
        if self.is_banned(peer_id):
            self.stats.errors_returned["banned"] += 1
            await self._refuse(reader, writer, "banned", f"not serving {peer_id} now")
            return False
        async with asyncio.timeout(config.header_timeout):
            head = await reader.readexactly(head_len)
        request = cast(Request, parse_head(kind, head, body_len, config.limits))
        deadline = started + min(request.timeout, config.max_request_seconds)
        async with asyncio.timeout_at(deadline):
            tensors = await read_tensors(reader, request.specs)
        reply = await self._dispatch(peer_id, request, tensors, deadline)
        async with asyncio.timeout_at(max(deadline, loop.time() + config.header_timeout)):
            await write_frame(writer, reply)
        return True

    async def _dispatch(
        self, peer_id: PeerID, request: Request, tensors: list[torch.Tensor], deadline: float
    ) -> list[Buffer]:
        handler = self._handlers.get(request.method)
        if handler is None:
            self.stats.errors_returned["unknown_method"] += 1
            return encode_error("unknown_method", f"no method {request.method!r}")
        bound = asyncio.timeout_at(deadline)
        try:
            async with bound:
                meta, out = await handler(peer_id, request.meta, tensors)
            reply = encode_response(meta, out, request.reply_compression)
        except Exception as e:
            if bound.expired():
                self.stats.errors_returned["timeout"] += 1
                return encode_error("timeout", f"{request.method} did not finish in {request.timeout:g} s")
            logger.warning("handler %s failed for %s", request.method, peer_id, exc_info=True)
            self.stats.errors_returned["handler_error"] += 1
            return encode_error("handler_error", f"{type(e).__name__}: {e}")
        self.stats.served += 1
        return reply

    async def _refuse(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, code: str, message: str
    ) -> None:
        """Answer an error, then discard what the caller still sends until it hangs up, within header_timeout.

        Closing at once, with its request unread, could reset the stream before the caller reads why.
        Best effort: the stream may already be gone."""
        with suppress(ConnectionError, TimeoutError, OSError):
            async with asyncio.timeout(self._config.header_timeout):
                await write_frame(writer, encode_error(code, message))
                while await reader.read(IO_CHUNK):
                    pass


def _ip_of(addr: Multiaddr) -> str | None:
    names = {protocol.name for protocol in addr.protocols()}
    if "p2p-circuit" in names:
        return None
    for name in ("ip4", "ip6"):
        if name in names:
            return addr.value_for_protocol(name)
    return None


def _close_opened(
    opening: asyncio.Future[tuple[StreamInfo, asyncio.StreamReader, asyncio.StreamWriter]],
) -> None:
    if not opening.cancelled() and opening.exception() is None:
        opening.result()[2].close()
