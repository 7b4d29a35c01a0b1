"""NoLoCo in the daemon: every H inner steps, average with one random replica of the same stage.

The pairing and the math are `protocols.noloco`; this module moves the tensors. At the boundary of outer
step k (the swarm clock at kH) the node copies its weights (theta) and keeps training while it exchanges;
the result is applied right after the step that moves the clock `APPLY_LAG` ticks past the copy, as
`theta = phi_new + (theta_now - theta_copy)`, so the inner step taken during the exchange is kept. That step
waits for the exchange (at most `SETTLE_WAIT_S`): applied whenever the exchange happened to end, the update
landed before one tick's step or another's as the timing fell, and runs of one seed parted there. A
declined, failed, partial or timed-out exchange ends in the lone-replica step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch
from hivemind.p2p import PeerID
from torch import Tensor, nn

from protocols.bounds import drift_problem
from protocols.errors import ProtocolError
from protocols.manifest import TensorSpec
from protocols.messages import (
    AveragingReply,
    AveragingRequest,
    Decline,
    ErrorCode,
    Rpc,
    bounded,
    decode,
    encode,
)
from protocols.noloco import (
    OuterConfig,
    OuterResult,
    PairingRound,
    Phase,
    exchange_problem,
    noloco_outer_step,
    pairing_seed,
)
from swarmnode.node.checks import Rejected
from swarmnode.node.compute import ComputeQueue, Priority
from swarmnode.node.events import emit
from swarmnode.node.state import TensorMap, manifest, weights
from swarmnode.precision import all_finite
from swarmnode.transport import Transport, TransportError

logger = logging.getLogger(__name__)

APPLY_LAG = 1  # an outer step copied at clock c is applied after the step that takes the clock to c + 1
SETTLE_WAIT_S = 5.0  # how long that step waits for a late exchange before going on without it


@dataclass
class _Pending:
    outer_step: int
    result: OuterResult
    theta_copy: TensorMap
    apply_at: int | None  # the clock whose step applies it; None: the first step or idle moment


class OuterLoop:
    """One node's NoLoCo state (slow weights phi, momentum delta) and its exchanges.

    Outer steps are numbered by the swarm clock (`OuterConfig.due`), so the replicas of a stage reach outer
    step k within about one iteration of each other whatever share of the microbatches each one gets;
    `outer_step` is the number of the last one applied.
    """

    def __init__(
        self,
        module: nn.Module,
        config: OuterConfig,
        run_id: str,
        stage: int,
        me: str,
        transport: Transport,
        compute: ComputeQueue,
        timeout_s: float,
    ) -> None:
        self.module = module
        self.config = config
        self.run_id = run_id
        self.stage = stage
        self.me = me
        self.transport = transport
        self.compute = compute
        self.timeout_s = timeout_s
        self.outer_step = 0
        self.phi: TensorMap = weights(module)  # phi, theta and delta live on the host (`state.weights`)
        self.delta: TensorMap | None = None
        self._round: PairingRound | None = None
        self._theta_copy: TensorMap = {}
        self._delivered = asyncio.Event()
        self._pending: _Pending | None = None
        self._running = False
        self._last_round = 0
        self._apply_at: int | None = None  # the clock whose step applies the running round's result
        self._ended = threading.Condition()  # notified when a round ends (the compute thread may wait)
        self._last_ended = 0
        self._copied = 0  # the last round whose theta copy is taken (before that, no step may wait for it)

    def take_due(self, step: int) -> int | None:
        """The outer step due at clock `step`, or None (none due, or one still runs). A step returned is
        taken at once, before its `run` starts, so that concurrent callers never start it twice; its
        result is applied by the step that reaches clock `step + APPLY_LAG` (`settle`)."""
        with self._ended:
            outer = None if self._running else self.config.due(step, self._last_round)
            if outer is not None:
                self._running, self._last_round = True, outer
                self._apply_at = step + APPLY_LAG
        return outer

    def resume_at(self, outer_step: int, clock: int) -> None:
        """This node took over a state (a replica's, whose last outer step is `outer_step`, or a rebuilt
        one) at swarm clock `clock`: the outer steps up to it, and every one whose boundary the clock has
        passed, count as done. Those rounds were matched among the replicas online before this node, so a
        round run now waits in vain for a partner that has moved on (a replacement that ran one stalled the
        swarm's steps twice by `SETTLE_WAIT_S`, and itself for a round's timeout)."""
        self.outer_step = self._last_round = max(outer_step, self.config.outer_step_of(clock))

    async def run(
        self,
        outer: int,
        replicas: list[str],
        clock: Callable[[], float],
        answering: Callable[[list[str]], Awaitable[list[str]]] | None = None,
    ) -> None:
        """Outer step `outer` (from `take_due`): pair, exchange, compute the update (applied by `settle`).
        `answering`, if given, keeps the other replicas that answer now: the matching is drawn among them
        once theta is copied, so that a replica whose record outlives it (a view remembers a peer for a
        while) is no one's partner, and the replicas that answer draw one matching."""
        try:
            self._theta_copy = await self.compute.submit(Priority.STEP, lambda: self._copy_theta(outer))
            if answering is not None:
                replicas = [*await answering([p for p in replicas if p != self.me]), self.me]
            self._delivered.clear()
            rnd = PairingRound(
                outer_step=outer,
                me=self.me,
                replicas=replicas,
                seed=pairing_seed(self.run_id, self.stage, outer),
                now=clock(),
                timeout_s=self.timeout_s,
            )
            self._round = rnd
            if rnd.outcome is None and rnd.initiator:
                await self._initiate(rnd, clock)
            elif rnd.outcome is None:
                remaining = max(0.0, rnd.deadline - clock())
                try:
                    await asyncio.wait_for(self._delivered.wait(), remaining)
                except TimeoutError:
                    rnd.tick(clock())
            outcome = rnd.tick(clock()) or rnd.fail("no outcome")
            theta_copy = self._theta_copy
            result = await asyncio.get_running_loop().run_in_executor(
                None,
                lambda: noloco_outer_step(
                    self.config,
                    self.phi,
                    theta_copy,
                    self.delta,
                    outcome.partner_phis,
                    outcome.partner_thetas,
                ),
            )
            with self._ended:
                self._pending = _Pending(outer, result, theta_copy, self._apply_at)
            emit(
                "outer_step",
                stage=self.stage,
                outer_step=outer,
                paired=outcome.phase == Phase.PAIRED,
                matched=rnd.partner is not None,  # else alone by design: no replica to pair with
                partner=outcome.partner,
                reason=outcome.reason,
            )
        finally:
            self._round = None
            self._running = False
            with self._ended:
                self._last_ended = outer
                self._ended.notify_all()

    async def _initiate(self, rnd: PairingRound, clock: Callable[[], float]) -> None:
        names = list(self.phi)
        request = AveragingRequest(
            self.run_id,
            self.stage,
            rnd.outer_step,
            manifest(self.phi),
            manifest({n: self._theta_copy[n] for n in names}),
        )
        tensors = [self.phi[n] for n in names] + [self._theta_copy[n] for n in names]
        while rnd.outcome is None:
            remaining = rnd.deadline - clock()
            if remaining <= 0:
                rnd.tick(clock())
                return
            try:
                meta, received = await self.transport.call(
                    PeerID.from_base58(rnd.partner), Rpc.AVERAGE, encode(request), tensors, timeout=remaining
                )
                reply = decode(meta, AveragingReply)
            except (TransportError, ProtocolError) as error:
                rnd.fail(str(error))
                return
            if reply.accept:
                phi, theta = _split(reply.phi, received)
                # twice a stage's parameters, read off the event loop
                args = (rnd.partner, phi, theta, self.phi)
                problem = await asyncio.get_running_loop().run_in_executor(None, exchange_problem, *args)
                rnd.deliver_checked(rnd.partner, phi, theta, problem)
            elif reply.decline is Decline.NOT_REACHED:
                await asyncio.sleep(min(0.25, max(0.0, rnd.deadline - clock())))
            else:
                rnd.fail(reply.reason)

    async def serve(
        self, peer: str, request: AveragingRequest, tensors: list[Tensor]
    ) -> tuple[AveragingReply, list[Tensor]]:
        """A partner's request, checked, then `on_request`. Tensors that are not this stage's parameters or
        not finite are refused (`Rejected`: the sender is banned); tensors further than `bounds.MAX_DRIFT`
        from our phi are declined with the reason and a `rejected` event, unbanned (a replica rebuilt apart
        may differ that much in good faith), and never applied."""
        if request.stage != self.stage:
            why = f"averaging for stage {request.stage} sent to stage {self.stage}"
            raise Rejected(ErrorCode.WRONG_STAGE, why)
        expected = [(name, tuple(p.shape)) for name, p in self.module.named_parameters()]
        shapes = [shape for _, shape in expected] * 2  # phi, then theta
        if (
            [(s.name, s.shape) for s in request.phi] != expected
            or [tuple(t.shape) for t in tensors] != shapes
            or any(t.dtype != torch.float32 for t in tensors)
        ):
            raise Rejected(ErrorCode.MALFORMED, "averaging tensors do not match this stage's parameters")
        loop = asyncio.get_running_loop()  # twice a stage's parameters: read off the event loop
        if not await loop.run_in_executor(None, lambda: all(all_finite(t) for t in tensors)):
            raise Rejected(ErrorCode.MALFORMED, "averaging tensors are not all finite")
        phi, theta = _split(request.phi, tensors)
        own = self.phi
        far = await loop.run_in_executor(None, lambda: drift_problem(own, (("phi", phi), ("theta", theta))))
        if far is not None:
            logger.warning("declined averaging tensors from %s: %s", peer[-8:], far)
            emit("rejected", peer_id=peer, code="out_of_bounds", reason=far)
            reply = AveragingReply(
                self.run_id, self.stage, request.outer_step, False, bounded(far), decline=Decline.MALFORMED
            )
            return reply, []
        return self.on_request(peer, request, tensors)

    def on_request(
        self, peer: str, request: AveragingRequest, tensors: list[Tensor]
    ) -> tuple[AveragingReply, list[Tensor]]:
        """The responder's side: accept the partner's request for the current outer step, if it is ours
        (its tensors checked by `serve`: this stage's names and shapes, finite, within the drift bound)."""
        rnd = self._round
        if rnd is None:
            declined: tuple[Decline, str] | None = (Decline.NOT_REACHED, "no outer step running")
        else:
            declined = rnd.decline(peer, request.outer_step)
        if declined is None and len(tensors) != 2 * len(request.phi):
            declined = (Decline.MALFORMED, "tensor count does not match the manifests")
        if declined is not None or rnd is None:
            decline, reason = declined or (Decline.NOT_REACHED, "")
            return AveragingReply(
                self.run_id, self.stage, request.outer_step, False, bounded(reason), decline=decline
            ), []
        phi, theta = _split(request.phi, tensors)
        rnd.deliver_checked(peer, phi, theta, None)
        self._delivered.set()
        names = list(self.phi)
        return AveragingReply(
            self.run_id,
            self.stage,
            request.outer_step,
            True,
            "",
            manifest(self.phi),
            manifest({n: self._theta_copy[n] for n in names}),
        ), [self.phi[n] for n in names] + [self._theta_copy[n] for n in names]

    def settle(self, clock: int) -> bool:
        """On the compute thread, right after a step that took the clock to `clock`: once the clock has
        reached the round's `APPLY_LAG`, wait for its exchange (at most `SETTLE_WAIT_S`) and apply it, so
        the update lands after the same step in every run. An exchange later than that is applied by the
        first step (or idle moment) after it ends. True if an update was applied."""
        with self._ended:
            pending = self._pending
            if pending is not None:
                if pending.apply_at is not None and clock < pending.apply_at:
                    return False
            else:
                if not self._running or self._apply_at is None or clock < self._apply_at:
                    return False
                outer = self._last_round
                if self._copied < outer:  # its copy waits for this thread: the round cannot end meanwhile
                    self._apply_at = None
                    return False
                if not self._ended.wait_for(lambda: self._last_ended >= outer, SETTLE_WAIT_S):
                    logger.warning("outer step %d late (%.0f s): applied later", outer, SETTLE_WAIT_S)
                    self._apply_at = None
                    return False
        return self.apply_pending(clock)

    def idle_apply_due(self, clock: int) -> bool:
        """Whether a replica that is not stepping should apply the computed update now: the clock has
        passed the step that would have applied it (a replica with work applies it in `settle`)."""
        with self._ended:
            pending = self._pending
            return pending is not None and (pending.apply_at is None or clock > pending.apply_at)

    def apply_pending(self, clock: int) -> bool:
        """On the compute thread, nothing held, the clock at `clock`: load the computed outer update. True if
        one was applied."""
        with self._ended:
            pending, self._pending = self._pending, None
        if pending is None:
            return False
        with torch.no_grad():
            for name, param in self.module.named_parameters():
                phi, copy = pending.result.phi[name], pending.theta_copy[name]
                param.copy_(phi.to(param.device) + (param - copy.to(param.device)))
        self.phi = {name: t.clone() for name, t in pending.result.phi.items()}
        self.delta = dict(pending.result.delta)
        self.outer_step = pending.outer_step
        outer, due = pending.outer_step, pending.apply_at
        emit("outer_applied", stage=self.stage, outer_step=outer, clock=clock, due=due)
        return True

    def _copy_theta(self, outer: int) -> TensorMap:
        """On the compute thread: theta for outer step `outer` (a step that waits for it may come next)."""
        copy = weights(self.module)
        with self._ended:
            self._copied = outer
        return copy


def _split(manifest: tuple[TensorSpec, ...], tensors: list[Tensor]) -> tuple[TensorMap, TensorMap]:
    """phi and theta maps from tensors sent in manifest order (phi first); shapes checked by the caller."""
    names = [spec.name for spec in manifest]
    if len(tensors) != 2 * len(names):
        return {}, {}
    return dict(zip(names, tensors[: len(names)], strict=True)), dict(
        zip(names, tensors[len(names) :], strict=True)
    )
