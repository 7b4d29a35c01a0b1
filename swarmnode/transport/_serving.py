"""The serving side: admission (bans, stream limits), the request loop of each inbound stream, dispatch.

Streams arrive by either path (libp2p or direct TCP) already bound to the peer id of their caller. A stream
carries requests one after another; a malformed frame gets a "bad_request" answer, a ban and the end of the
stream, and every step is bounded (`header_timeout`, the request's timeout capped by `max_request_seconds`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from contextlib import suppress
from typing import Any, cast

import torch
from hivemind.p2p import PeerID

from swarmnode.transport._config import TransportConfig, TransportStats
from swarmnode.transport._errors import ProtocolError
from swarmnode.transport._framing import (
    IO_CHUNK,
    PREFIX,
    Buffer,
    Kind,
    Request,
    encode_error,
    encode_response,
    parse_head,
    parse_prefix,
    prepare_writer,
    read_tensors,
    write_frame,
)

logger = logging.getLogger(__name__)

UNKNOWN_METHOD_BODY_BYTES = 1 << 20  # what a request for a method not served may carry before it is refused

Handler = Callable[[PeerID, bytes, list[torch.Tensor]], Awaitable[tuple[bytes, list[torch.Tensor]]]]
"""Serves one method: (caller, meta, tensors) -> (meta, tensors) of the reply."""


class Server:
    """Serves inbound streams with the handlers of `handlers` (looked up per request, so it may grow)."""

    def __init__(
        self,
        config: TransportConfig,
        stats: TransportStats,
        handlers: Mapping[str, Handler],
        body_limits: Mapping[str, int],
    ) -> None:
        self._config = config
        self._stats = stats
        self._handlers = handlers
        self._body_limits = body_limits  # per method; others: the limits' max_message_bytes
        self._inbound: set[asyncio.Task[Any]] = set()  # tasks serving a stream
        self._inbound_per_peer: Counter[PeerID] = Counter()
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
            self._stats.errors_returned[refusal] += 1
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
            self._stats.errors_returned["bad_request"] += 1
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
            self._stats.errors_returned["banned"] += 1
            await self._refuse(reader, writer, "banned", f"not serving {peer_id} now")
            return False
        async with asyncio.timeout(config.header_timeout):
            head = await reader.readexactly(head_len)
        request = cast(Request, parse_head(kind, head, body_len, config.limits))
        limit = self._body_limit(request.method)
        if body_len > limit:  # refused before a byte of it is allocated
            raise ProtocolError(f"{request.method!r} request of {body_len} tensor bytes; at most {limit}")
        deadline = started + min(request.timeout, config.max_request_seconds)
        async with asyncio.timeout_at(deadline):
            tensors = await read_tensors(reader, request.specs)
        reply = await self._dispatch(peer_id, request, tensors, deadline)
        async with asyncio.timeout_at(max(deadline, loop.time() + config.header_timeout)):
            await write_frame(writer, reply)
        return True

    def _body_limit(self, method: str) -> int:
        if method not in self._handlers:  # answered "unknown_method" once read: read only a little of it
            return min(UNKNOWN_METHOD_BODY_BYTES, self._config.limits.max_message_bytes)
        return self._body_limits.get(method, self._config.limits.max_message_bytes)

    async def _dispatch(
        self, peer_id: PeerID, request: Request, tensors: list[torch.Tensor], deadline: float
    ) -> list[Buffer]:
        handler = self._handlers.get(request.method)
        if handler is None:
            self._stats.errors_returned["unknown_method"] += 1
            return encode_error("unknown_method", f"no method {request.method!r}")
        bound = asyncio.timeout_at(deadline)
        try:
            async with bound:
                meta, out = await handler(peer_id, request.meta, tensors)
            reply = encode_response(meta, out, request.reply_compression)
        except Exception as e:
            if bound.expired():
                self._stats.errors_returned["timeout"] += 1
                return encode_error("timeout", f"{request.method} did not finish in {request.timeout:g} s")
            logger.warning("handler %s failed for %s", request.method, peer_id, exc_info=True)
            self._stats.errors_returned["handler_error"] += 1
            return encode_error("handler_error", f"{type(e).__name__}: {e}")
        self._stats.served += 1
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
