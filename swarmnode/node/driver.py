"""Stage 0: a data node owns a shard of the data and drives iterations through the swarm.

Each iteration it plans paths (SkipPipe, `node.planning`), embeds its microbatches and sends them on their
way, computes the loss when the activations come back, sends the gradients back along the same path, and
steps `E` and `E'` once every microbatch has finished or is counted lost. A microbatch that does not return
within the iteration timeout is aborted everywhere and counted; nothing waits longer than that.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from functools import partial

from torch import Tensor

from protocols.messages import Ack, Backward, ErrorCode, Forward, Route, encode
from protocols.stepbook import MicrobatchKey
from swarmnode.data import Corpus, batches, data_node_tokens, validation_set
from swarmnode.dht import SwarmDHT
from swarmnode.node.checks import Rejected
from swarmnode.node.compute import Priority
from swarmnode.node.daemon import Node
from swarmnode.node.events import emit
from swarmnode.node.iteration import Iteration, Microbatch, stale
from swarmnode.node.liveness import answering
from swarmnode.node.planning import PlannedMicrobatch, plan_iteration
from swarmnode.node.worker import DataWorker
from swarmnode.precision import Overflow, Precision
from swarmnode.runspec import RunSpec

logger = logging.getLogger(__name__)

WATCH_S = 1.0  # how often a waiting data node checks that the peers on pending paths are alive
DEAD_GRACE_S = 2.0  # how long a microbatch may stay pending after a peer on its path was found dead
EVALUATION_BASE = 2**62  # iteration numbers of validation passes, apart from training iterations
CATCH_UP_TICKS = 8  # a data node further behind the swarm clock than this jumps to it (joined late, was away)


class DataNode(Node):
    """A node of stage 0: embedding, head, loss and a shard of the data."""

    def __init__(
        self,
        spec: RunSpec,
        dht: SwarmDHT,
        direct_host: str | None,
        corpus: Corpus,
        data_shard: tuple[int, int] | None = None,
        eval_every: int = 25,
        precision: Precision | None = None,
    ) -> None:
        super().__init__(spec, 0, dht, direct_host, precision)
        self.worker = DataWorker(self.piece, self.optimizer, self.precision, self.wire)
        tokens, seed = data_node_tokens(corpus.train_tokens, data_shard, spec.seed, self.me)
        self._batches: Iterator[tuple[Tensor, Tensor]] = batches(tokens, spec.batch_size, spec.seq_len, seed)
        self._validation = validation_set(corpus.val_tokens, spec.batch_size, spec.seq_len)
        self.eval_every = eval_every
        self.iteration = 0
        self._evaluations = 0
        self._current: Iteration | None = None
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
        if self.optimizer.step_count == 0 and self.snapshot.clock() == 0:
            await self._await_pipeline()
        if self.optimizer.step_count == 0:
            await self.evaluate()  # the initial validation loss, once every stage is online
        while not self._stopping.is_set():
            clock = self.snapshot.clock()
            if clock - self.iteration > CATCH_UP_TICKS:
                self.iteration = clock
            self.iteration = max(self.iteration, self.optimizer.step_count)
            if self.iteration >= self.spec.total_steps:
                break
            self.optimizer.advance(self.iteration)
            view = self.snapshot.without(self.router.suspects())
            planned = plan_iteration(view, self.me, self.spec, self.iteration, self._tokens_per_mb)
            if not planned:
                await asyncio.sleep(self.spec.record_period_s)
                await self.refresh_snapshot()
                continue
            started = time.monotonic()
            losses, lost = await self._run_iteration(planned, [next(self._batches) for _ in planned])
            tick, self.iteration = self.iteration, self.iteration + 1
            evaluations = self.optimizer.step_count // self.eval_every
            if losses:
                mean = sum(losses) / len(losses)
                completed, total = len(losses), len(planned)
                norm = await self.compute.submit(Priority.STEP, partial(self._step, completed, total, tick))
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
        """A fresh swarm trains once every transformer stage has an online node in this node's view. Paths
        planned while some stage was still starting skip it, and a few such first steps (stage 2 fed raw
        embeddings, the head fed stage 2's output) left a 2x1 swarm stalled near 6.2 where runs without
        them reach 5.4. Skipping is for stages lost later, while they are rebuilt."""
        stages = range(1, self.spec.stages + 1)
        missing = [k for k in stages if not self.snapshot.online(k)]
        if missing:
            logger.info("waiting for stages %s to have an online node before training", missing)
        while missing and not self._stopping.is_set():
            await asyncio.sleep(self.spec.record_period_s)
            await self.refresh_snapshot()
            missing = [k for k in stages if not self.snapshot.online(k)]

    @property
    def _tokens_per_mb(self) -> int:
        return self.spec.batch_size * self.spec.seq_len

    def _step(self, completed: int, planned: int, tick: int) -> float:
        norm = self.worker.step(planned / completed, tick)  # losses were weighted 1/planned: rescale
        self.outer.apply_pending()
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
        if evaluation:
            self._evaluations += 1
        number = EVALUATION_BASE + self._evaluations if evaluation else self.iteration
        iteration = Iteration(number, evaluation=evaluation)
        self._current = iteration
        for plan, (_, targets) in zip(planned, data, strict=True):
            iteration.microbatches[plan.microbatch] = Microbatch(plan, targets, plan.path)
        launches = zip(iteration.microbatches.values(), data, strict=True)
        await asyncio.gather(*(self._launch(iteration, mb, inputs) for mb, (inputs, _) in launches))
        await self._await(iteration)
        iteration.closed = True
        self._current = None  # from here on, late work of this iteration is refused as stale
        lost = [mb for mb in iteration.microbatches.values() if mb.loss is None or not mb.done]
        losses = [mb.loss for mb in iteration.microbatches.values() if mb.done and mb.loss is not None]
        for mb in lost:
            key = MicrobatchKey(self.me, iteration.number, mb.planned.microbatch)
            await self.compute.submit(Priority.BACKWARD, lambda key=key: self.worker.drop(key))
            await self._abort_path(iteration, mb, "iteration timed out")
        if lost and not evaluation:
            self.microbatches_lost += len(lost)
            emit("microbatch_lost", step=self.optimizer.step_count, count=len(lost))
        return losses, len(lost)

    async def _await(self, iteration: Iteration) -> None:
        """Wait for every microbatch, at most `iteration_timeout_s`. Every `WATCH_S` the peers on the paths of
        pending microbatches are pinged: a microbatch still pending `DEAD_GRACE_S` after a peer on its path
        was found dead is lost, so a node that dies holding a microbatch stalls the iteration for seconds,
        not for the whole timeout; microbatches re-routed around it (`_on_route`) come back."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.spec.iteration_timeout_s
        dead_since: dict[str, float] = {}
        while not iteration.finished.is_set():
            try:
                await asyncio.wait_for(iteration.finished.wait(), WATCH_S)
                return
            except TimeoutError:
                pass
            if loop.time() > deadline:
                logger.warning("iteration %d timed out", iteration.number)
                return
            pending = [mb for mb in iteration.microbatches.values() if not mb.done]
            peers = sorted({peer for mb in pending for peer in mb.path if peer != self.me})
            now = loop.time()
            for peer in set(peers) - set(await answering(self.transport, peers)):
                if peer not in dead_since:
                    dead_since[peer] = now
                    self.router.suspect(peer)
            # a microbatch upstream of a dead peer is re-routed around it within milliseconds, and the
            # `route` notice takes the peer off its path; one whose path still has the peer DEAD_GRACE_S
            # after it was found dead was held by that peer: it is lost
            dead = {peer for peer, since in dead_since.items() if now - since >= DEAD_GRACE_S}
            for mb in pending:
                if dead & set(mb.path) and not mb.done:
                    mb.loss = None
                    key = MicrobatchKey(self.me, iteration.number, mb.planned.microbatch)
                    await self._lose(
                        iteration, mb, key, f"peer {sorted(dead & set(mb.path))[0][-8:]} is dead"
                    )

    async def _launch(self, iteration: Iteration, mb: Microbatch, inputs: Tensor) -> None:
        plan = mb.planned
        key = MicrobatchKey(self.me, iteration.number, plan.microbatch)
        now = time.monotonic()
        if iteration.evaluation:
            hidden = await self.compute.submit(Priority.FORWARD, lambda: self.piece.embed(inputs).detach())
        else:
            hidden = await self.compute.submit(Priority.FORWARD, lambda: self.worker.embed(key, inputs, now))
        self.tokens_processed += inputs.numel()
        first = Forward(
            self.spec.run_id,
            iteration.number,
            plan.microbatch,
            plan.path,
            0,
            plan.stages,
            plan.visits,
            evaluate=iteration.evaluation,
            nonce=mb.nonce,
        )
        sent = await self.router.forward(first, hidden, mb.first_hops)
        if sent is None:
            await self._lose(iteration, mb, key, "first hop unreachable")
        elif not mb.done:
            mb.path = sent.path  # the first hop may have been re-routed

    async def _abort_path(self, iteration: Iteration, mb: Microbatch, reason: str) -> None:
        """Tell every node on the microbatch's path to drop it."""
        await self.router.abort(
            self.spec.run_id, self.me, iteration.number, mb.planned.microbatch, mb.path, reason
        )

    async def _lose(self, iteration: Iteration, mb: Microbatch, key: MicrobatchKey, reason: str) -> None:
        logger.info("microbatch %s lost: %s", key, reason)
        await self.compute.submit(Priority.BACKWARD, lambda: self.worker.drop(key))
        mb.done = True
        iteration.check()

    def _microbatch(self, message: Forward | Backward | Route) -> tuple[Iteration, Microbatch]:
        iteration = self._current
        if message.path[0] != self.me or iteration is None or message.iteration != iteration.number:
            raise stale(message)
        mb = iteration.microbatches.get(message.microbatch)
        if mb is None or mb.done:
            raise stale(message)
        if message.nonce != mb.nonce:  # not from its path: answered as stale, so the sender learns nothing
            logger.warning(
                "a %s for microbatch %d without its nonce: refused", message.KIND, message.microbatch
            )
            raise stale(message)
        return iteration, mb

    async def _on_forward(
        self, peer: str, message: Forward, tensors: list[Tensor]
    ) -> tuple[bytes, list[Tensor]]:
        if message.hop != len(message.path) - 1:
            raise Rejected(
                ErrorCode.WRONG_STAGE, f"forward hop {message.hop} of {len(message.path)} at a data node"
            )
        hidden = self._hop_tensor(peer, message, tensors)
        iteration, mb = self._microbatch(message)
        if mb.returned:
            raise stale(message)
        if tuple(hidden.shape[:2]) != tuple(mb.targets.shape):  # the sender may relay what it got: no ban
            raise Rejected(
                ErrorCode.STALE, f"activations of shape {tuple(hidden.shape)} for {tuple(mb.targets.shape)}"
            )
        mb.returned = True
        mb.path = message.path
        self.spawn(self._head(iteration, mb, message, hidden), "head")
        return encode(Ack()), []

    async def _on_route(self, peer: str, route: Route, tensors: list[Tensor]) -> tuple[bytes, list[Tensor]]:
        if route.path[route.hop] != peer:
            raise Rejected(ErrorCode.MALFORMED, f"{peer[-8:]} is not hop {route.hop} of the path it reports")
        _, mb = self._microbatch(route)
        if route.hop > mb.routed_at and not mb.returned:
            mb.path, mb.routed_at = route.path, route.hop
            self.routes_reported += 1
        return encode(Ack()), []

    async def _head(self, iteration: Iteration, mb: Microbatch, message: Forward, hidden: Tensor) -> None:
        key = MicrobatchKey(self.me, iteration.number, mb.planned.microbatch)
        if iteration.evaluation:
            evaluate = partial(self.worker.eval_loss, hidden, mb.targets)
            mb.loss = await self.compute.submit(Priority.FORWARD, evaluate)
            mb.done = True
            iteration.check()
            return
        scale = 1.0 / len(iteration.microbatches)

        def head() -> tuple[float, Tensor] | None:
            if iteration.closed:  # the iteration has been stepped: this gradient belongs to no step
                return None
            return self.worker.loss_and_grad(hidden, mb.targets, scale)

        try:
            result = await self.compute.submit(Priority.BACKWARD, head)
        except Overflow as error:  # this iteration's update is skipped; the loss scale backs off
            await self._abort_path(iteration, mb, str(error))
            await self._lose(iteration, mb, key, str(error))
            return
        if result is None:
            return
        mb.loss, grad = result
        if not await self.router.backward(message, grad):
            mb.loss = None
            await self._abort_path(iteration, mb, "backward hop unreachable")
            await self._lose(iteration, mb, key, "backward hop unreachable")

    async def _on_backward(
        self, peer: str, message: Backward, tensors: list[Tensor]
    ) -> tuple[bytes, list[Tensor]]:
        grad = self._hop_tensor(peer, message, tensors)
        iteration, mb = self._microbatch(message)
        if peer not in mb.first_hops:
            raise Rejected(ErrorCode.MALFORMED, f"{peer[-8:]} was not sent microbatch {message.microbatch}")
        key = MicrobatchKey(self.me, iteration.number, mb.planned.microbatch)
        shape = self.worker.output_shape(key)
        if shape is None:  # dropped meanwhile (lost, or the iteration closed)
            raise stale(message)
        if shape != tuple(grad.shape):
            raise Rejected(
                ErrorCode.MALFORMED, f"gradient of shape {tuple(grad.shape)} does not fit microbatch {key}"
            )
        self.spawn(self._finish(iteration, mb, key, grad), "finish")
        return encode(Ack()), []

    async def _finish(self, iteration: Iteration, mb: Microbatch, key: MicrobatchKey, grad: Tensor) -> None:
        def finish() -> bool:
            if iteration.closed or self.worker.output_shape(key) is None:  # lost meanwhile: no step's
                return False
            self.worker.finish(key, grad)
            return True

        if await self.compute.submit(Priority.BACKWARD, finish):
            self.microbatches_served += 1
            mb.done = True
            iteration.check()

    async def on_abort(self, key: MicrobatchKey, reason: str) -> None:
        iteration = self._current
        if key[0] != self.me or iteration is None or key[1] != iteration.number:
            return
        mb = iteration.microbatches.get(key[2])
        if mb is not None and not mb.done:
            mb.loss = None
            await self._lose(iteration, mb, key, reason)
            # its sender may be further along the path than nodes that hold it and take aborts only from
            # peers they know: tell the whole path, as the data node
            await self._abort_path(iteration, mb, reason)

    def abort_allowed(self, peer: str, key: MicrobatchKey) -> bool:
        iteration = self._current
        mb = iteration.microbatches.get(key[2]) if iteration is not None else None
        return mb is None or peer in mb.path or peer in mb.first_hops

    async def maybe_step(self) -> None:
        """Data nodes step at the end of each iteration (see `train`)."""
