"""The serving side: admission (bans, stream limits), the request loop of each inbound stream, dispatch.

Streams arrive by either path (libp2p or direct TCP) already bound to the peer id of their caller. A stream
carries requests one after another; a malformed frame gets a "bad_request" answer, a ban and the end of the
stream, and every step is bounded: the wait for a request (`idle_timeout`), its head (`header_timeout`), its
body (the rate floor and byte budget of `_intake`), the whole request (its timeout, capped by
`max_request_seconds`), the answer to a refusal (1 s). Refusals and drops are counted in `TransportStats`.

A handler that must know when its reply has left (to hold a resource until then, such as a slot of a large
transfer) returns a `Reply` whose `written` callback the server calls once, after the reply frame's last
byte left the process or once it could not (the stream failed or stalled past the request's deadline, the
reply could not be encoded, the transport closed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, cast

import torch
from hivemind.p2p import PeerID

from swarmnode.transport._config import TransportConfig, TransportStats
from swarmnode.transport._errors import WireError
from swarmnode.transport._framing import (
    IO_CHUNK,
    PREFIX,
    Buffer,
    Kind,
    Request,
    encode_error,
    encode_response,
    frame_size,
    parse_head,
    parse_prefix,
    prepare_writer,
    read_tensors,
    show,
    write_frame,
)
from swarmnode.transport._intake import BodyReader, Dropped, InboundBudget, Refusal
from swarmnode.transport._links import LinkEmulator

logger = logging.getLogger(__name__)

UNKNOWN_METHOD_BODY_BYTES = 1 << 20  # what a request for a method not served may carry before it is refused
REFUSAL_LINGER_SECONDS = 1.0  # how long a refused stream is kept so that its caller can read why


@dataclass(frozen=True)
class Reply:
    """A reply and what to do once it is written: `written(True)` after its last byte left the process,
    `written(False)` if it never will. Called exactly once, on the event loop; it must not raise."""

    meta: bytes
    tensors: list[torch.Tensor]
    written: Callable[[bool], None]


Handler = Callable[[PeerID, bytes, list[torch.Tensor]], Awaitable[tuple[bytes, list[torch.Tensor]] | Reply]]
"""Serves one method: (caller, meta, tensors) -> (meta, tensors) of the reply, or a `Reply`."""


class Server:
    """Serves inbound streams with the handlers of `handlers` (looked up per request, so it may grow)."""

    def __init__(
        self,
        config: TransportConfig,
        stats: TransportStats,
        handlers: Mapping[str, Handler],
        body_limits: Mapping[str, int],
        meta_limits: Mapping[str, int],
        links: LinkEmulator | None = None,
    ) -> None:
        self._config = config
        self._links = links  # replies to peers at emulated sites wait for their link
        self._stats = stats
        self._handlers = handlers
        self._body_limits = body_limits  # per method; others: the limits' max_message_bytes
        self._meta_limits = meta_limits  # per method; others: the config's max_meta_bytes
        self._budget = InboundBudget(config, stats)
        self._inbound: set[asyncio.Task[Any]] = set()  # tasks serving a stream
        self._inbound_per_peer: Counter[PeerID] = Counter()
        self._waiting: dict[asyncio.StreamWriter, PeerID] = {}  # streams waiting for a request, oldest first
        self._lingering = 0  # refusals being answered
        self._banned: dict[PeerID, float] = {}  # peer -> monotonic time the ban ends
        self._closing = False

    def ban(self, peer_id: PeerID, seconds: float) -> None:
        """Refuse requests from `peer_id` for `seconds`."""
        now = time.monotonic()
        self._banned = {peer: until for peer, until in self._banned.items() if until > now}
        self._banned[peer_id] = max(self._banned.get(peer_id, 0.0), now + seconds)

    def is_banned(self, peer_id: PeerID) -> bool:
        until = self._banned.get(peer_id)
        if until is not None and until <= time.monotonic():
            del self._banned[peer_id]
            return False
        return until is not None

    def stop(self) -> None:
        """From now on, close every stream as soon as it is accepted."""
        self._closing = True

    async def cancel(self) -> None:
        """Cancel the requests in progress and wait until their streams are closed."""
        tasks = list(self._inbound)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def serve_stream(
        self, peer_id: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Serve requests on one stream until it ends; raises nothing but a foreign cancellation."""
        if self._closing:  # accepted just as the transport closed
            writer.close()
            return
        prepare_writer(writer)
        refusal = self._refusal(peer_id)
        if refusal is not None:
            await self._refuse(reader, writer, refusal)
            writer.close()
            return
        task = cast(asyncio.Task[Any], asyncio.current_task())
        self._inbound.add(task)
        self._inbound_per_peer[peer_id] += 1
        self._stats.inbound_streams = len(self._inbound)
        try:
            await self._serve_requests(peer_id, reader, writer)
        except asyncio.CancelledError:
            if not self._closing:
                raise  # cancelled by someone else; a cancellation from close() ends the stream quietly
        finally:
            self._inbound.discard(task)
            self._stats.inbound_streams = len(self._inbound)
            self._inbound_per_peer[peer_id] -= 1
            if not self._inbound_per_peer[peer_id]:
                del self._inbound_per_peer[peer_id]
            writer.close()

    async def _serve_requests(
        self, peer_id: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Serve requests one after another; a bad frame gets an answer, a ban and the end of the stream."""
        try:
            while True:
                await self._serve_one(peer_id, reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the caller closed the stream (or its peer died)
        except WireError as e:
            logger.warning("rejected a frame from %s: %s", peer_id, e)
            if self._config.ban_seconds > 0:
                self.ban(peer_id, self._config.ban_seconds)
            await self._refuse(reader, writer, Refusal("malformed", "bad_request", str(e)))
        except Refusal as e:
            await self._refuse(reader, writer, e)
        except Dropped as e:
            self._stats.dropped[e.reason] += 1
            log = logger.debug if e.reason == "idle" else logger.warning
            log("dropped a stream from %s: %s", peer_id, e)
        except TimeoutError:
            self._stats.dropped["stalled"] += 1
            logger.warning("dropped a stream from %s: a request stalled past its deadline", peer_id)
        except Exception:
            logger.exception("serving a stream from %s failed", peer_id)

    def _refusal(self, peer_id: PeerID) -> Refusal | None:
        """Why a new stream from `peer_id` is refused, if it is; past a stream bound, make room if it can."""
        if self.is_banned(peer_id):
            return Refusal("banned", "banned", f"not serving {peer_id} now")
        if self._inbound_per_peer[peer_id] >= self._config.max_inbound_per_peer and not self._evict(peer_id):
            return Refusal("peer_streams", "overloaded", f"serving {peer_id} too many streams")
        if len(self._inbound) >= self._config.max_inbound_streams and not self._evict(None):
            return Refusal("streams", "overloaded", "serving too many streams")
        return None

    def _evict(self, peer_id: PeerID | None) -> bool:
        """Close the oldest stream waiting for a request (one of `peer_id`'s, unless None); False if none is.

        Its slot frees once its task sees the stream closed: until then it is counted still."""
        for writer, peer in self._waiting.items():
            if peer_id is None or peer == peer_id:
                del self._waiting[writer]
                writer.close()
                self._stats.dropped["evicted"] += 1
                return True
        return False

    async def _serve_one(
        self, peer_id: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Serve one request; raises what ends the stream."""
        config = self._config
        self._waiting[writer] = peer_id
        try:
            async with asyncio.timeout(config.idle_timeout):
                prefix = await reader.readexactly(PREFIX.size)
        except TimeoutError:
            raise Dropped("idle", f"no request in {config.idle_timeout:g} s") from None
        finally:
            self._waiting.pop(writer, None)
        loop = asyncio.get_running_loop()
        started = loop.time()
        kind, head_len, body_len = parse_prefix(prefix, config.limits)
        if kind is not Kind.REQUEST:
            raise WireError(f"expected a request, got a {kind.name} frame")
        if self.is_banned(peer_id):
            raise Refusal("banned", "banned", f"not serving {peer_id} now")
        try:
            async with asyncio.timeout(config.header_timeout):
                head = await reader.readexactly(head_len)
        except TimeoutError:
            raise Dropped(
                "head", f"a head of {head_len} bytes took over {config.header_timeout:g} s"
            ) from None
        request = cast(Request, parse_head(kind, head, body_len, config.limits))
        self._check(peer_id, request, body_len)
        deadline = started + min(request.timeout, config.max_request_seconds)
        body = BodyReader(self._budget, peer_id, reader, config)
        try:
            async with asyncio.timeout_at(deadline):
                tensors = await read_tensors(body.readinto, request.specs)
            reply, written = await self._dispatch(peer_id, request, tensors, deadline)
        finally:
            body.close()
        ok = False
        try:
            async with asyncio.timeout_at(max(deadline, loop.time() + config.header_timeout)):
                if self._links is not None:
                    await self._links.hold(peer_id, frame_size(reply))
                await write_frame(writer, reply)
            ok = True
        finally:
            if written is not None:
                written(ok)

    def _check(self, peer_id: PeerID, request: Request, body_len: int) -> None:
        """Refuse a request over its method's bounds, or whose body cannot fit, before its body is read."""
        method, config = request.method, self._config
        if method in self._handlers:
            body_limit = self._body_limits.get(method, config.limits.max_message_bytes)
        else:  # answered "unknown_method" once read: read only a little of it
            body_limit = min(UNKNOWN_METHOD_BODY_BYTES, config.limits.max_message_bytes)
        if body_len > body_limit:
            raise WireError(f"{show(method)} request of {body_len} tensor bytes; at most {body_limit}")
        meta_limit = self._meta_limits.get(method, config.max_meta_bytes)
        if len(request.meta) > meta_limit:
            raise WireError(f"{show(method)} request meta of {len(request.meta)} bytes; at most {meta_limit}")
        self._budget.admit(peer_id, body_len)

    async def _dispatch(
        self, peer_id: PeerID, request: Request, tensors: list[torch.Tensor], deadline: float
    ) -> tuple[list[Buffer], Callable[[bool], None] | None]:
        """The reply frame to write, and the handler's `Reply.written` (None if it gave none, or was told)."""
        handler = self._handlers.get(request.method)
        if handler is None:
            self._stats.errors_returned["unknown_method"] += 1
            return encode_error("unknown_method", f"no method {show(request.method)}"), None
        bound = asyncio.timeout_at(deadline)
        written = None
        try:
            async with bound:
                answer = await handler(peer_id, request.meta, tensors)
            if isinstance(answer, Reply):
                meta, out, written = answer.meta, answer.tensors, answer.written
            else:
                meta, out = answer
            reply = encode_response(meta, out, request.reply_compression)
        except Exception as e:
            if written is not None:
                written(False)
            if bound.expired():
                self._stats.errors_returned["timeout"] += 1
                error = encode_error("timeout", f"{request.method} did not finish in {request.timeout:g} s")
                return error, None
            logger.warning("handler %s failed for %s", request.method, peer_id, exc_info=True)
            self._stats.errors_returned["handler_error"] += 1
            return encode_error("handler_error", f"{type(e).__name__}: {e}"), None
        self._stats.served += 1
        return reply, written

    async def _refuse(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, refusal: Refusal
    ) -> None:
        """Count a refusal and answer it, then discard what the caller still sends until it hangs up, for at
        most REFUSAL_LINGER_SECONDS (and header_timeout); while as many refusals linger as streams may be
        served, close unanswered instead.

        Closing at once, with its request unread, could reset the stream before the caller reads why.
        Best effort: the stream may already be gone."""
        self._stats.refused[refusal.reason] += 1
        if self._lingering >= self._config.max_inbound_streams:
            self._stats.dropped["unanswered"] += 1
            return
        self._stats.errors_returned[refusal.code] += 1
        self._lingering += 1
        try:
            with suppress(ConnectionError, TimeoutError, OSError):
                async with asyncio.timeout(min(REFUSAL_LINGER_SECONDS, self._config.header_timeout)):
                    await write_frame(writer, encode_error(refusal.code, refusal.message))
                    while await reader.read(IO_CHUNK):
                        pass
        finally:
            self._lingering -= 1
