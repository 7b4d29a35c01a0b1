"""Stage 0: a data node owns a shard of the data and drives iterations through the swarm.

Each iteration it plans paths (SkipPipe, `node.planning`), embeds its microbatches and sends them on their
way, computes the loss when the activations come back, sends the gradients back along the same path, and
steps `E` and `E'` once every microbatch has finished or is counted lost. A microbatch that does not return
within the iteration timeout is aborted everywhere and counted; nothing waits longer than that.

What happens to each microbatch is decided by `protocols.iteration.DataIteration`; this driver feeds it
events (its own progress, peers' messages, the clock, ping answers) and carries out the actions it returns.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Iterator
from functools import partial

from torch import Tensor

from protocols.errors import LocalProtocolError
from protocols.hops import MAX_NONCE, Backward, Forward, Route
from protocols.iteration import DataIteration
from protocols.iteration_events import (
    AbortPath,
    AbortReceived,
    Action,
    ApplyGradient,
    BackwardFailed,
    Closed,
    ComputeLoss,
    Drop,
    GradientApplied,
    GradientReturned,
    HeadFailed,
    LossComputed,
    PeersChecked,
    Ping,
    Returned,
    RouteNotice,
    Send,
    SendGradient,
    Sent,
    Start,
    Suspect,
    Tick,
    Unsent,
)
from protocols.membership import RebuildWait
from protocols.messages import Ack, ErrorCode, encode
from protocols.stepbook import MicrobatchKey
from swarmnode.data import Corpus, batches, data_node_tokens, validation_set
from swarmnode.node.checks import Rejected
from swarmnode.node.compute import Priority
from swarmnode.node.context import NodeContext
from swarmnode.node.daemon import Node
from swarmnode.node.events import emit
from swarmnode.node.iteration import Running, running
from swarmnode.node.liveness import unanswered
from swarmnode.node.planning import (
    REBUILD_WAIT_S,
    PlannedMicrobatch,
    lost_stages,
    not_ready_to_start,
    plan_iteration,
    rebuild_waits,
)
from swarmnode.node.worker import DataWorker
from swarmnode.precision import Overflow

logger = logging.getLogger(__name__)

WATCH_S = 1.0  # how often a waiting data node pings the peers on pending paths (`protocols.iteration`)
EVALUATION_BASE = 2**62  # iteration numbers of validation passes, apart from training iterations
CATCH_UP_TICKS = 8  # a data node further behind the swarm clock than this jumps to it (joined late, was away)


class DataNode(Node):
    """A node of stage 0: embedding, head, loss and a shard of the data."""

    def __init__(
        self,
        context: NodeContext,
        corpus: Corpus,
        data_shard: tuple[int, int] | None = None,
        eval_every: int = 25,
    ) -> None:
        super().__init__(context, 0)
        spec = context.spec
        self.worker = DataWorker(self.piece, self.optimizer, self.precision, self.wire)
        tokens, seed = data_node_tokens(corpus.train_tokens, data_shard, spec.seed, self.me)
        self._batches: Iterator[tuple[Tensor, Tensor]] = batches(tokens, spec.batch_size, spec.seq_len, seed)
        self._validation = validation_set(corpus.val_tokens, spec.batch_size, spec.seq_len)
        self.eval_every = eval_every
        self.iteration = 0
        self._evaluations = 0
        self._current: Running | None = None  # the latest iteration (closed ones refuse everything)
        self._rebuild = RebuildWait(REBUILD_WAIT_S)
        self.val_loss: float | None = None
        self.routes_reported = 0  # re-routes that stage nodes reported (`Route`)

    async def train(self) -> None:
        """Run iterations until the run's total steps; returns early if stopped.

        The iteration number is the swarm clock: one tick per iteration, successful or not. A data node
        that finds the swarm more than `CATCH_UP_TICKS` ahead of it (in the DHT records: it joined late, or
        was away) jumps to the swarm's tick, so the data nodes' clocks agree and the stage replicas, which
        follow the clock in the forwards they see, share one schedule. A data node only a few ticks behind
        (a little slower than another) runs every tick: skipping ticks whenever the timing put it behind
        made how much it trained depend on the timing."""
        if self.optimizer.step_count == 0 and self.swarm_read.clock() == 0:
            await self._await_pipeline()
        if self.optimizer.step_count == 0:
            await self.evaluate()  # the initial validation loss, once every stage is online
        while not self._stopping.is_set():
            clock = self.swarm_read.clock()
            if clock - self.iteration > CATCH_UP_TICKS:
                self.iteration = clock
            self.iteration = max(self.iteration, self.optimizer.step_count)
            if self.iteration >= self.spec.total_steps:
                break
            self.optimizer.advance(self.iteration)
            view = self.view().without(self.router.suspects())
            if rebuild_waits(self._rebuild, lost_stages(view, self.spec), time.monotonic()):
                await self._await_swarm_news()
                continue
            planned = plan_iteration(view, self.me, self.spec, self.iteration, self._tokens_per_mb)
            if not planned:
                await self._await_swarm_news()
                continue
            started = time.monotonic()
            losses, lost = await self._run_iteration(planned, [next(self._batches) for _ in planned])
            tick, self.iteration = self.iteration, self.iteration + 1
            evaluations = self.optimizer.step_count // self.eval_every
            if losses:
                mean = sum(losses) / len(losses)
                norm = await self.compute.submit(Priority.STEP, partial(self._step, len(losses), tick))
                self.last_loss = mean
                emit(
                    "step",
                    step=self.optimizer.step_count,
                    loss=round(mean, 5),
                    lost=lost,
                    tokens=len(losses) * self._tokens_per_mb,
                    seconds=round(time.monotonic() - started, 4),
                    grad_norm=norm,
                    paths=[list(p.stages) for p in planned],
                )
                await self.outer_step_if_due()
                if self.optimizer.step_count // self.eval_every > evaluations:
                    await self.evaluate()
            else:
                await self.compute.submit(Priority.STEP, self.worker.discard_gradients)
                await self.tick(self.iteration)
                emit(
                    "iteration_failed",
                    iteration=self.iteration - 1,
                    lost=lost,
                    seconds=round(time.monotonic() - started, 4),
                )
        await self.evaluate()

    async def _await_pipeline(self) -> None:
        """A fresh swarm trains once every transformer stage has the run's `min_replicas` online nodes in this
        node's view (at least one), and its `min_data_nodes` data nodes are online. Paths planned while some
        stage was still starting skip it, and a few such first steps (stage 2 fed raw embeddings, the head
        fed stage 2's output) left a 2x1 swarm stalled near 6.2 where runs without them reach 5.4. A data
        node that starts a few seconds before another trains its first iterations alone, and how many
        depends on the timing: two runs of one seed of a 2x1 swarm, the second data node 3 s late in both,
        went apart within six steps (5.209 and 5.013 at step 100); so did two runs of a 1x2 swarm whose
        first step found one replica of a stage online in one and two in the other (2 microbatches in its
        first step, or 4). A stage lost later is waited for or skipped while rebuilt (`RebuildWait`)."""

        waiting = not_ready_to_start(self.swarm_read, self.me, self.spec)
        if waiting:
            logger.info("waiting for %s to be online before training", ", ".join(waiting))
        while waiting and not self._stopping.is_set():
            await self._await_swarm_news()
            waiting = not_ready_to_start(self.swarm_read, self.me, self.spec)

    async def _await_swarm_news(self) -> None:
        """Wait for a change in the swarm: a node that came online greets the data nodes, which read the DHT
        at once (`Greetings`); without one, read it again after a record period."""
        if not await self.greetings.news(self.spec.record_period_s):
            await self.refresh_swarm_read()

    @property
    def _tokens_per_mb(self) -> int:
        return self.spec.batch_size * self.spec.seq_len

    def _step(self, completed: int, tick: int) -> float:
        # losses were weighted 1 / the run's microbatches (a replica's share): stage 0's update is the mean
        norm = self.worker.step(self.spec.microbatches / completed, tick)
        self.outer.settle(self.optimizer.step_count)
        return norm

    async def evaluate(self) -> float | None:
        """Validation loss over fixed batches, through one online replica of every stage in order."""
        stages = [sorted(self.router.online(k)) for k in range(1, self.spec.stages + 1)]
        if not all(stages):
            return None
        path = (self.me, *(self.rng.choice(peers) for peers in stages), self.me)
        planned = [
            PlannedMicrobatch(i, path, (*range(self.spec.stages + 1), 0), (0,) * len(path))
            for i in range(len(self._validation))
        ]
        losses, _ = await self._run_iteration(planned, self._validation, evaluation=True)
        if len(losses) == len(planned):
            self.val_loss = sum(losses) / len(losses)
            emit("validation", step=self.optimizer.step_count, val_loss=round(self.val_loss, 5))
        return self.val_loss

    async def _run_iteration(
        self, planned: list[PlannedMicrobatch], data: list[tuple[Tensor, Tensor]], evaluation: bool = False
    ) -> tuple[list[float], int]:
        """Run one iteration (`protocols.iteration.DataIteration` decides; this carries out its actions):
        the losses of the microbatches done, and how many were lost."""
        if evaluation:
            self._evaluations += 1
        machine = DataIteration(
            me=self.me,
            number=EVALUATION_BASE + self._evaluations if evaluation else self.iteration,
            paths={plan.microbatch: plan.path for plan in planned},
            nonces={plan.microbatch: 1 + secrets.randbelow(MAX_NONCE) for plan in planned},  # unguessable
            timeout_s=self.spec.iteration_timeout_s,
            evaluation=evaluation,
        )
        run = Running(
            machine, {plan.microbatch: targets for plan, (_, targets) in zip(planned, data, strict=True)}
        )
        self._current = run
        plans = {plan.microbatch: (plan, inputs) for plan, (inputs, _) in zip(planned, data, strict=True)}
        sends = [action for action in machine.handle(Start(time.monotonic())) if isinstance(action, Send)]
        await asyncio.gather(*(self._launch(run, send, *plans[send.microbatch]) for send in sends))
        while not run.closed.is_set():
            try:
                await asyncio.wait_for(run.closed.wait(), WATCH_S)
            except TimeoutError:
                await self._carry_out(run, machine.handle(Tick(time.monotonic())))
        outcome = machine.outcome
        if outcome is None:  # `closed` is set only by the machine's `Closed`
            raise LocalProtocolError(f"iteration {machine.number} ended without an outcome")
        if outcome.timed_out:
            logger.warning("iteration %d timed out", machine.number)
        self.routes_reported += outcome.reroutes
        if outcome.lost and not evaluation:
            self.microbatches_lost += outcome.lost
            emit("microbatch_lost", step=self.optimizer.step_count, count=outcome.lost)
        return list(outcome.losses), outcome.lost

    async def _launch(self, run: Running, send: Send, plan: PlannedMicrobatch, inputs: Tensor) -> None:
        machine = run.machine
        key = MicrobatchKey(self.me, machine.number, send.microbatch)
        now = time.monotonic()
        if machine.evaluation:
            hidden = await self.compute.submit(
                Priority.FORWARD, lambda: self.worker.embed_eval(inputs), measured=False
            )
        else:
            hidden = await self.compute.submit(Priority.FORWARD, lambda: self.worker.embed(key, inputs, now))
            self.tokens_processed += inputs.numel()
        first = Forward(
            self.spec.run_id,
            machine.number,
            send.microbatch,
            send.path,
            0,
            plan.stages,
            plan.visits,
            evaluate=machine.evaluation,
            nonce=send.nonce,
            cohort=plan.cohort,
            senders=plan.senders,
            weights_of=self.iteration if machine.evaluation else 0,  # after its step: its next tick
        )
        delivered = await self.router.forward(first, hidden, machine.tries(send.microbatch))
        event = Unsent(send.microbatch) if delivered is None else Sent(send.microbatch, delivered.path)
        await self._carry_out(run, machine.handle(event))

    async def _carry_out(
        self,
        run: Running,
        actions: tuple[Action, ...],
        hop: Forward | None = None,
        tensor: Tensor | None = None,
    ) -> None:
        """Carry out the machine's actions in order. `hop` and `tensor` are the message and tensor of the
        event that produced them (returned activations, the head's gradient, a gradient back)."""
        machine = run.machine
        for action in actions:
            if isinstance(action, Drop):
                key = MicrobatchKey(self.me, machine.number, action.microbatch)
                logger.info("microbatch %s lost: %s", key, action.reason)
                await self.compute.submit(Priority.BACKWARD, partial(self.worker.drop, key))
            elif isinstance(action, AbortPath):  # best effort, bounded: nothing waits for it
                abort = self.router.abort(
                    self.spec.run_id, self.me, machine.number, action.microbatch, action.path, action.reason
                )
                self.spawn(abort, "abort")
            elif isinstance(action, Suspect):
                logger.info("planning around %s a while: found dead, or routed around", action.peer[-8:])
                self.router.suspect(action.peer)
            elif isinstance(action, Ping):
                now = time.monotonic()
                silent, unreachable = await unanswered(self.transport, list(action.peers))
                await self._carry_out(run, machine.handle(PeersChecked(now, silent, unreachable)))
            elif isinstance(action, Closed):
                run.closed.set()
            elif isinstance(action, ComputeLoss) and hop is not None and tensor is not None:
                await self._head(run, action.microbatch, hop, tensor)
            elif isinstance(action, SendGradient) and hop is not None and tensor is not None:
                if not await self.router.backward(hop, tensor):
                    await self._carry_out(run, machine.handle(BackwardFailed(action.microbatch)))
            elif isinstance(action, ApplyGradient) and tensor is not None:
                await self._finish(run, action.microbatch, tensor)
            else:
                raise LocalProtocolError(f"{action!r} cannot be carried out here")

    async def _head(self, run: Running, microbatch: int, message: Forward, hidden: Tensor) -> None:
        """The loss of returned activations; in training, also the gradient to send back."""
        machine, targets = run.machine, run.targets[microbatch]
        if machine.evaluation:
            loss = await self.compute.submit(
                Priority.FORWARD, partial(self.worker.eval_loss, hidden, targets), measured=False
            )
            await self._carry_out(run, machine.handle(LossComputed(microbatch, loss)))
            return
        scale = 1.0 / self.spec.microbatches  # a replica's share of a data node's iteration is its mean

        def head() -> tuple[float, Tensor] | None:
            if not machine.awaits_loss(microbatch):  # closed or lost meanwhile: this belongs to no step
                return None
            return self.worker.loss_and_grad(hidden, targets, scale)

        try:
            result = await self.compute.submit(Priority.BACKWARD, head)
        except Overflow as error:  # this iteration's update is skipped; the loss scale backs off
            await self._carry_out(run, machine.handle(HeadFailed(microbatch, str(error))))
            return
        if result is not None:
            loss, grad = result
            await self._carry_out(run, machine.handle(LossComputed(microbatch, loss)), message, grad)

    async def _finish(self, run: Running, microbatch: int, grad: Tensor) -> None:
        """The backward pass through the embedding, unless the microbatch was lost or the iteration closed."""
        machine = run.machine
        key = MicrobatchKey(self.me, machine.number, microbatch)

        def finish() -> bool:
            if not machine.may_apply(microbatch):
                return False
            self.worker.finish(key, grad)
            return True

        if await self.compute.submit(Priority.BACKWARD, finish):
            self.microbatches_served += 1
            await self._carry_out(run, machine.handle(GradientApplied(microbatch)))

    async def _on_forward(
        self, peer: str, message: Forward, tensors: list[Tensor]
    ) -> tuple[bytes, list[Tensor]]:
        if message.hop != len(message.path) - 1:
            raise Rejected(
                ErrorCode.WRONG_STAGE, f"forward hop {message.hop} of {len(message.path)} at a data node"
            )
        hidden = self._hop_tensor(peer, message, tensors)
        run = running(self._current, message)
        targets = run.targets.get(message.microbatch)
        if targets is not None and tuple(hidden.shape[:2]) != tuple(targets.shape):  # may be relayed: no ban
            raise Rejected(
                ErrorCode.STALE, f"activations of shape {tuple(hidden.shape)} for {tuple(targets.shape)}"
            )
        origin = message.path[0]
        event = Returned(origin, message.iteration, message.microbatch, message.nonce, message.path)
        self.spawn(self._carry_out(run, run.take(event, message), message, hidden), "head")
        return encode(Ack()), []

    async def _on_route(self, peer: str, route: Route, tensors: list[Tensor]) -> tuple[bytes, list[Tensor]]:
        run = running(self._current, route)
        notice = RouteNotice(
            peer, route.path[0], route.iteration, route.microbatch, route.nonce, route.path, route.hop
        )
        await self._carry_out(run, run.take(notice, route))  # the path it watches; suspect the peers left out
        return encode(Ack()), []

    async def _on_backward(
        self, peer: str, message: Backward, tensors: list[Tensor]
    ) -> tuple[bytes, list[Tensor]]:
        grad = self._hop_tensor(peer, message, tensors)
        run = running(self._current, message)
        key = MicrobatchKey(self.me, message.iteration, message.microbatch)
        shape = self.worker.output_shape(key)
        if shape is not None and shape != tuple(grad.shape):
            raise Rejected(
                ErrorCode.MALFORMED, f"gradient of shape {tuple(grad.shape)} does not fit microbatch {key}"
            )
        event = GradientReturned(peer, message.path[0], message.iteration, message.microbatch, message.nonce)
        self.spawn(self._carry_out(run, run.take(event, message), tensor=grad), "finish")
        return encode(Ack()), []

    async def on_abort(self, key: MicrobatchKey, reason: str) -> None:
        run = self._current
        if run is not None:
            event = AbortReceived(key.origin, key.iteration, key.microbatch, reason)
            await self._carry_out(run, run.machine.handle(event))

    def abort_allowed(self, peer: str, key: MicrobatchKey) -> bool:
        run = self._current
        return run is None or run.machine.may_abort(peer, *key)

    async def maybe_step(self) -> None:
        """Data nodes step at the end of each iteration (see `train`)."""
