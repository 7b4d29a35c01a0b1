"""Sending a microbatch to its next hop, with re-routing around dead nodes.

A forward hop that fails (the peer is dead, frozen past the timeout, or refuses) is re-sent to another
online replica of the same stage; if the stage has none, the hop skips past it (SkipPipe tolerates skipped
stages). The path in the message is rewritten, so the backward pass retraces the path actually taken, and
the data node is told the new path (`Route`), so it watches the peers the microbatch really visits.
A backward hop cannot be re-routed (the activations live on that node): the microbatch is aborted on every
node of its path, and counted lost by its data node.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import replace

from hivemind.p2p import PeerID
from torch import Tensor

from protocols.errors import ProtocolError
from protocols.hops import Abort, Backward, Forward, Route
from protocols.manifest import TensorSpec
from protocols.messages import Ack, Error, Rpc, bounded, decode, encode
from swarmnode.transport import Compression, PeerUnreachable, Transport, TransportError

logger = logging.getLogger(__name__)

HopObserver = Callable[[str, int, float, int], None]  # direction, peer stage, seconds, tensor bytes

SUSPECT_SECONDS = 10.0


class Refused(Exception):
    """The peer is alive but refused the request (stale, busy, wrong stage): no reason to suspect it."""


class Router:
    """Sends hops for one node; remembers peers that just failed so nobody routes to them for a while."""

    def __init__(
        self,
        transport: Transport,
        me: str,
        online: Callable[[int], list[str]],
        hop_timeout_s: float,
        compression: Compression,
        rng: random.Random,
    ) -> None:
        self.transport = transport
        self.me = me
        self._online = online
        self.hop_timeout_s = hop_timeout_s
        self.compression = compression
        self.rng = rng
        self._suspects: dict[str, float] = {}
        self.failures_seen = 0
        self.reroutes = 0
        self.skips = 0
        self.on_hop: HopObserver | None = None  # told of every hop delivered (metrics)

    def _observe(self, direction: str, peer_stage: int, started: float, tensor: Tensor) -> None:
        if self.on_hop is not None:
            size = tensor.numel() * tensor.element_size()
            self.on_hop(direction, peer_stage, time.monotonic() - started, size)

    def suspect(self, peer: str) -> None:
        self.failures_seen += 1
        self._suspects[peer] = time.monotonic() + SUSPECT_SECONDS

    def is_suspect(self, peer: str) -> bool:
        until = self._suspects.get(peer)
        if until is None:
            return False
        if until < time.monotonic():
            del self._suspects[peer]
            return False
        return True

    def suspects(self) -> set[str]:
        return {peer for peer in list(self._suspects) if self.is_suspect(peer)}

    def online(self, stage: int) -> list[str]:
        return [peer for peer in self._online(stage) if not self.is_suspect(peer)]

    async def call(self, peer: str, method: str, meta: bytes, tensors: list[Tensor], timeout: float) -> None:
        """One call that must be acknowledged. Raises Refused if the peer answered with an error (it is
        alive), TransportError if it could not be reached, ProtocolError for a malformed answer."""
        try:
            peer_id = PeerID.from_base58(peer)
        except ValueError as error:
            raise PeerUnreachable(f"invalid peer id {peer!r}") from error
        reply, _ = await self.transport.call(
            peer_id, method, meta, tensors, timeout=timeout, compression=self.compression
        )
        answer = decode(reply)
        if isinstance(answer, Error):
            raise Refused(f"{answer.code}: {answer.reason}")
        if not isinstance(answer, Ack):
            raise Refused(f"unexpected {type(answer).__name__} reply")

    async def forward(
        self, sent: Forward, hidden: Tensor, attempted: set[str] | None = None
    ) -> Forward | None:
        """Send `hidden` to the hop after `sent.hop`. Returns the message delivered, or None if it could not
        be (the caller aborts the microbatch). Every peer tried is added to `attempted` before it is called:
        only those may send this microbatch's gradient back."""
        path, stages = list(sent.path), list(sent.stages)
        visits, senders = list(sent.visits or [0] * len(path)), list(sent.senders or [0] * len(path))
        nxt = sent.hop + 1
        tried: set[str] = set()
        spec = (TensorSpec("hidden", tuple(hidden.shape), str(hidden.dtype).removeprefix("torch.")),)
        while True:
            message = replace(  # every other field (evaluate, nonce, cohort, weights_of) travels on as sent
                sent,
                path=tuple(path),
                hop=nxt,
                stages=tuple(stages),
                visits=tuple(visits),
                tensors=spec,
                senders=tuple(senders) if sent.senders else (),
            )
            target = path[nxt]
            if attempted is not None:
                attempted.add(target)
            try:
                started = time.monotonic()
                await self.call(target, Rpc.FORWARD, encode(message), [hidden], self.hop_timeout_s)
                self._observe("forward", stages[nxt], started, hidden)
                return message
            except Refused as error:
                logger.info("forward to %s (stage %d) refused: %s", target[-8:], stages[nxt], error)
                tried.add(target)
            except (TransportError, ProtocolError) as error:
                logger.warning("forward to %s (stage %d) failed: %s", target[-8:], stages[nxt], error)
                tried.add(target)
                self.suspect(target)
            if nxt == len(path) - 1:
                return None  # the data node itself is gone
            others = [p for p in self.online(stages[nxt]) if p not in tried and p not in path]
            if others:
                path[nxt] = self.rng.choice(sorted(others))
                visits[nxt] = senders[nxt] = 0  # the plan sent nothing there: counts and senders unknown
                self.reroutes += 1
            else:
                del path[nxt], stages[nxt], visits[nxt], senders[nxt]
                self.skips += 1

    async def backward(self, received: Backward | Forward, grad: Tensor) -> bool:
        """Send `grad` to the hop before `received.hop`; False if it could not be delivered."""
        target_hop = received.hop - 1
        spec = (TensorSpec("grad", tuple(grad.shape), str(grad.dtype).removeprefix("torch.")),)
        message = Backward(
            received.run_id,
            received.iteration,
            received.microbatch,
            received.path,
            target_hop,
            received.stages,
            received.visits,
            spec,
            nonce=received.nonce,
        )
        target = received.path[target_hop]
        try:
            started = time.monotonic()
            await self.call(target, Rpc.BACKWARD, encode(message), [grad], self.hop_timeout_s)
            self._observe("backward", received.stages[target_hop], started, grad)
            return True
        except Refused as error:
            logger.info("backward to %s refused: %s", target[-8:], error)
            return False
        except (TransportError, ProtocolError) as error:
            logger.warning("backward to %s failed: %s", target[-8:], error)
            self.suspect(target)
            return False

    async def report_route(self, delivered: Forward) -> None:
        """Tell the data node the path its microbatch really takes, after this node re-routed the next hop
        (best effort, bounded)."""
        sender = delivered.hop - 1
        if sender < 1:
            return  # the data node itself sent it: it knows the path
        route = Route(
            delivered.run_id,
            delivered.iteration,
            delivered.microbatch,
            delivered.path,
            sender,
            delivered.nonce,
        )
        await self._try(delivered.path[0], Rpc.ROUTE, encode(route))

    async def abort(
        self, run_id: str, origin: str, iteration: int, microbatch: int, path: tuple[str, ...], reason: str
    ) -> None:
        """Tell every other node of the path to drop the microbatch (best effort, bounded)."""
        message = encode(Abort(run_id, origin, iteration, microbatch, bounded(reason)))
        targets = sorted({p for p in path if p != self.me and not self.is_suspect(p)})
        await asyncio.gather(
            *(self._try(target, Rpc.ABORT, message) for target in targets), return_exceptions=True
        )

    async def _try(self, peer: str, method: str, meta: bytes) -> None:
        try:
            await self.call(peer, method, meta, [], min(2.0, self.hop_timeout_s))
        except (Refused, TransportError, ProtocolError) as error:
            logger.info("%s to %s failed: %s", method, peer[-8:], error)
