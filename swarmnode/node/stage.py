"""A node of a transformer stage: forward and backward passes of the microbatches routed to it, a step when
the work planned through it is done, and (with `--rebalance`) a move to a stage that lost all its nodes."""

from __future__ import annotations

import asyncio
import logging
import math
import time

from torch import Tensor

from protocols.errors import LocalProtocolError
from protocols.hops import Backward, Forward
from protocols.membership import Probe, Probed, Rebalance, RebalanceAction, Viewed, Wait
from protocols.messages import Ack, ErrorCode, NodeState, encode
from protocols.standins import StandIns, edge_places
from protocols.stepbook import Group, MicrobatchKey, StepBook, StepDecision
from swarmnode.node.checks import Rejected
from swarmnode.node.compute import Priority
from swarmnode.node.context import NodeContext
from swarmnode.node.daemon import Node
from swarmnode.node.liveness import live_peers
from swarmnode.node.worker import MissingActivations, StageWorker
from swarmnode.precision import Overflow

logger = logging.getLogger(__name__)

REBALANCE_S = 5.0


ORIGIN_REFRESH_S = 1.0  # at most one DHT read a second for forwards from a data node not in the view
BACKLOG_ITERATIONS = 4  # microbatches held or queued beyond this many iterations' worth are refused (BUSY)


class StageNode(Node):
    """A node of transformer stage k >= 1: forward and backward passes for the microbatches routed here."""

    def __init__(self, context: NodeContext, stage: int, rebalance: bool = False) -> None:
        super().__init__(context, stage)
        spec = context.spec
        self.worker = StageWorker(self.piece, self.optimizer, self.precision, self.wire)
        self.book = StepBook(spec.iteration_timeout_s, first_tick_senders=spec.min_data_nodes)
        self.rebalance = rebalance
        self.membership = Rebalance(
            me=self.me, stage=stage, stages=spec.stages, max_delay_s=REBALANCE_S / 2, rng=self.rng
        )
        self._origins_read_at = -math.inf
        self._origins_read: asyncio.Future[None] | None = None  # the DHT read forwards from new origins await
        self._copies_at = 0  # the clock at the last refresh of the CheckFree+ copies
        self._stepped = asyncio.Condition()  # notified whenever a step closes groups (`StepBook.waits`)
        self.stand_ins = StandIns()  # iterations with microbatches trained in an edge stage's place

    async def start(self) -> None:
        await super().start()
        if self.rebalance:
            self._tasks.append(
                asyncio.create_task(self._every(REBALANCE_S, self.consider_moving), name="rebalance")
            )

    async def consider_moving(self) -> None:
        """One look of `protocols.membership.Rebalance` (move to a transformer stage that lost all its nodes
        if this stage keeps another live replica), carrying out its actions: ping the stages it names, wait
        and look again, move."""
        actions = self.membership.handle(Viewed(self._online()))
        while actions:
            following: tuple[RebalanceAction, ...] = ()
            for action in actions:
                if isinstance(action, Probe):
                    live = {
                        k: frozenset(await live_peers(self.transport, self.swarm_read, self.me, k))
                        for k in action.stages
                    }
                    following = self.membership.handle(Probed(live))
                elif isinstance(action, Wait):
                    await asyncio.sleep(action.seconds)
                    following = self.membership.handle(Viewed(self._online()))
                else:
                    self.move_to = action.stage
                    logger.warning(
                        "stage %d lost; moving there from over-replicated stage %d", action.stage, self.stage
                    )
                    self.stop()
            actions = following

    def _online(self) -> dict[int, frozenset[str]]:
        """The view's online nodes of every transformer stage (`Viewed`)."""
        return {k: frozenset(self.swarm_read.online(k)) for k in range(1, self.spec.stages + 1)}

    async def _on_forward(
        self, peer: str, message: Forward, tensors: list[Tensor]
    ) -> tuple[bytes, list[Tensor]]:
        hidden = self._hop_tensor(peer, message, tensors)
        if message.hop == len(message.path) - 1:
            raise Rejected(ErrorCode.WRONG_STAGE, "the last hop of a path is its data node, not a stage")
        if self.state != NodeState.ONLINE:
            raise Rejected(ErrorCode.BUSY, f"this node is {self.state}, not online")
        key = MicrobatchKey(message.path[0], message.iteration, message.microbatch)
        if not await self._is_data_node(key[0]):  # a validation pass too: it may wait for a step here
            raise Rejected(ErrorCode.STALE, f"{key[0][-8:]} is no online data node of this run")
        if message.evaluate:
            self.spawn(self._evaluate(message, hidden), "evaluate")
            return encode(Ack()), []
        if len(self.book) >= self._backlog_limit():  # accepted and not finished: queued or held
            raise Rejected(ErrorCode.BUSY, f"{len(self.book)} microbatches held or queued here")
        # a node is visited at most once per microbatch: a larger count is forged, and would stall steps
        expected = min(message.visits[message.hop], self._most_per_data_node()) if message.visits else 0
        # whose work the plan sends here this tick: the step waits for them (until their records show the
        # tick done, at most `await_s`); names of data nodes not online in this node's view are dropped
        senders = message.senders_here()
        if senders is not None:
            senders &= {*self.view().online(0), key.origin}
        if not self.book.take(key, message.path[: message.hop], expected, time.monotonic(), senders):
            raise Rejected(ErrorCode.STALE, f"microbatch {key} is stale or a duplicate")
        self.spawn(self._forward(message, key, hidden), "forward")
        return encode(Ack()), []

    async def _is_data_node(self, peer: str) -> bool:
        """Whether `peer` is an online data node, reading the DHT again (at most once a second) if the view
        does not have it (a data node that just started). Forwards that arrive during a read wait for it."""
        if peer in self.view().online(0):
            return True
        reading = self._origins_read
        if reading is None and time.monotonic() - self._origins_read_at >= ORIGIN_REFRESH_S:
            self._origins_read_at = time.monotonic()
            reading = self._origins_read = asyncio.ensure_future(self._read_origins())
        if reading is not None:
            await asyncio.shield(reading)
        return peer in self.view().online(0)

    async def _read_origins(self) -> None:
        try:
            await self.refresh_swarm_read()
        except Exception as error:  # a slow DHT: the forwards that waited are refused, not crashed
            logger.warning("reading the swarm for a new data node failed: %s", error)
        finally:
            self._origins_read = None

    def _backlog_limit(self) -> int:
        """How many microbatches this node takes at once: a few iterations of every data node's plan, so the
        activations a flood of forwards could pin in memory stay bounded (the router sends a refused
        forward to another replica, or skips the stage)."""
        return BACKLOG_ITERATIONS * self._most_per_data_node() * max(1, len(self.view().online(0)))

    def _most_per_data_node(self) -> int:
        """The most microbatches one data node's plan may send this node in an iteration: the data node sends
        `microbatches` per pipeline (`planning.pipeline_width`), no more pipelines than this stage has
        replicas nor than the run's `max_pipelines`, and a replica with slow links can leave its share to this
        one. One replica more than this node sees: a data node's read may have one this node's lacks, and a
        count below the plan's would close the group early and refuse the rest of it (a count above it only
        holds the step, until the group's expiry)."""
        replicas = len({*self.view().online(self.stage), self.me})
        return self.spec.microbatches * min(replicas + 1, self.spec.max_pipelines)

    def abort_allowed(self, peer: str, key: MicrobatchKey) -> bool:
        return self.book.may_abort(key, peer)

    async def _after_older_steps(self, iteration: int) -> bool:
        """Wait until every tick older than `iteration` is stepped here, as long as a step may wait for an
        awaited data node (`StepBook.await_s`); whether they were."""
        if not self.book.waits(iteration):
            return True
        async with self._stepped:
            try:
                await asyncio.wait_for(
                    self._stepped.wait_for(lambda: not self.book.waits(iteration)), self.book.await_s
                )
            except TimeoutError:
                return False
        return True

    async def _forward(self, message: Forward, key: MicrobatchKey, hidden: Tensor) -> None:
        # one step per tick: the older iterations' step comes first
        if not await self._after_older_steps(key.iteration):
            logger.warning("microbatch %s ran before the step of an older iteration", key)
        await self.tick(key.iteration)  # after the older step: an outer step it starts includes that step
        now = time.monotonic()
        try:
            output = await self.compute.submit(
                Priority.FORWARD, lambda: self.worker.forward(key, hidden, now)
            )
        except Overflow as error:  # a float16 wire: the microbatch is lost, the peers downstream never see it
            await self._abort_everywhere(message, key, str(error))
            return
        self.tokens_processed += hidden.shape[0] * hidden.shape[1]
        tries = self.book.tries(key)
        if tries is None:  # aborted while it waited for the compute thread: hold nothing, send nothing
            await self.compute.submit(Priority.BACKWARD, lambda: self.worker.drop(key))
            return
        delivered = await self.router.forward(message, output, tries)
        if delivered is None:
            await self._abort_everywhere(message, key, "next hop unreachable")
        elif delivered.path != message.path:
            await self.router.report_route(delivered)

    async def _evaluate(self, message: Forward, hidden: Tensor) -> None:
        """A validation microbatch: forward only, nothing held, no gradient, not tracked. It measures the
        weights after the data node's last step (`Forward.weights_of`): it runs once the ticks before are
        stepped here, which another data node's work of the last tick may still hold up."""
        if not await self._after_older_steps(message.weights_of):
            logger.info("validation microbatch ran before this node stepped tick %d", message.weights_of - 1)
        try:
            output = await self.compute.submit(
                Priority.FORWARD, lambda: self.worker.evaluate(hidden), measured=False
            )
        except Overflow as error:  # the data node's evaluation goes on without this microbatch
            logger.warning("validation microbatch not sent on: %s", error)
            origin = message.path[0]  # only the data node waits for it: the stages hold nothing of it
            await self.router.abort(
                self.spec.run_id, origin, message.iteration, message.microbatch, (origin,), str(error)
            )
            return
        await self.router.forward(message, output)

    async def _on_backward(
        self, peer: str, message: Backward, tensors: list[Tensor]
    ) -> tuple[bytes, list[Tensor]]:
        grad = self._hop_tensor(peer, message, tensors)
        key = MicrobatchKey(message.path[0], message.iteration, message.microbatch)
        shape = self.worker.output_shape(key)
        if shape is None or key not in self.book:
            raise Rejected(ErrorCode.STALE, f"no activations held for microbatch {key}")
        if not self.book.may_send_gradient(key, peer):
            raise Rejected(ErrorCode.MALFORMED, f"{peer[-8:]} was not sent microbatch {key}")
        if tuple(grad.shape) != shape:
            raise Rejected(
                ErrorCode.MALFORMED, f"gradient of shape {tuple(grad.shape)} for outputs of {shape}"
            )
        try:
            places = edge_places(message.stages, message.hop, self.spec.stages)
        except LocalProtocolError as error:
            raise Rejected(ErrorCode.MALFORMED, error.reason) from None
        self.spawn(self._backward(message, key, grad, places), "backward")
        return encode(Ack()), []

    def stood_in(self) -> tuple[int, int]:
        """In how many iterations of the recent window of the swarm clock microbatches were trained here in
        stage 1's and in stage s's place (`protocols.standins`), for the record."""
        return self.stand_ins.recent(max(self.swarm_read.clock(), self.optimizer.step_count))

    async def _backward(
        self, message: Backward, key: MicrobatchKey, grad: Tensor, places: tuple[bool, bool]
    ) -> None:
        try:
            grad_in = await self.compute.submit(Priority.BACKWARD, lambda: self.worker.backward(key, grad))
        except MissingActivations:
            return  # aborted meanwhile
        except Overflow as error:  # its group's update is skipped; the loss scale backs off at the step
            self.book.finish(key, applied=True, now=time.monotonic())
            await self._abort_everywhere(message, key, str(error))
            await self.maybe_step()
            return
        self.book.finish(key, applied=True, now=time.monotonic())
        self.compute.post(Priority.WEIGHTS, lambda: self.worker.weights(key))
        self.microbatches_served += 1
        if any(places):
            clock = max(self.swarm_read.clock(), self.optimizer.step_count)
            self.stand_ins = self.stand_ins.add(key.iteration, places, clock)
        delivered = await self.router.backward(message, grad_in)
        if not delivered:
            await self._abort_everywhere(message, key, "previous hop unreachable")
        await self.maybe_step()

    async def _abort_everywhere(self, message: Forward | Backward, key: MicrobatchKey, reason: str) -> None:
        await self.on_abort(key, reason)
        await self.router.abort(self.spec.run_id, key[0], key[1], key[2], message.path, reason)

    async def on_abort(self, key: MicrobatchKey, reason: str) -> None:
        dropped = await self.compute.submit(Priority.BACKWARD, lambda: self.worker.drop(key))
        self.book.finish(key, applied=False, now=time.monotonic())
        if dropped:
            logger.info("dropped microbatch %s: %s", key, reason)
        await self.maybe_step()

    async def maybe_step(self) -> None:
        """Step for every tick whose groups are done (`StepBook.ready`), then let the forwards of the next
        tick run; also drop what expired groups left held, and take a pending outer update when idle."""
        if self._stepping:
            return
        self._stepping = True
        try:
            for data_node in self.swarm_read.stages.get(
                0, ()
            ):  # at step s it sends nothing more for tick s-1
                self.book.passed(data_node.peer_id, data_node.record.step - 1)
            clock = self.swarm_read.clock()
            if not self.book.waits(clock):  # else the step of the older iterations moves the clock first
                await self.tick(clock)
            while await self._step_due():
                async with self._stepped:
                    self._stepped.notify_all()
        finally:
            self._stepping = False

    async def _step_due(self) -> bool:
        """One step if one is due; whether one was (the book closed groups)."""
        now = time.monotonic()
        # before any await: a microbatch taken meanwhile belongs to a group that is open, and its forward job,
        # submitted after the drop job below, runs after it (the drop's priority is higher)
        live = self.book.expire(now)
        if self.worker.in_flight:  # drop, in one job, what expired groups (or interrupted drops) left held
            dropped = await self.compute.submit(Priority.BACKWARD, lambda: self.worker.drop_all_except(live))
            self.microbatches_lost += dropped
        decision = self.book.ready(self.worker.in_flight, now)
        if decision is None:
            idle, clock = not self.worker.in_flight and not self.book.open_groups, self.optimizer.step_count
            if idle and self.outer.idle_apply_due(clock):
                # a replica that gets no microbatch for a while still takes its outer steps
                await self.compute.submit(Priority.STEP, lambda: self.outer.apply_pending(clock))
            return False
        for origin, tick in decision.waited_out:
            logger.info(
                "tick %d steps without %s's work: awaited %.0f s in vain",
                tick,
                origin[-8:],
                self.book.await_s,
            )
        keep = self.book.groups
        norms = await self.compute.submit(Priority.STEP, lambda: self._step(decision, keep))
        if any(not math.isfinite(norm) for norm in norms):
            logger.warning("non-finite gradient norm: update skipped")
        if decision.updates:
            await self.outer_step_if_due()
            clock = self.optimizer.step_count
            if self.copy_parts and clock >= self._copies_at + self.spec.copy_refresh_steps:
                self._copies_at = clock
                self.spawn(self.refresh_copies(), "copies")
        return True

    def _step(self, decision: StepDecision, keep: set[Group]) -> list[float]:
        """On the compute thread, in one job (no forward may run between the updates): one update per group,
        then drop the gradients of groups closed without one, then the outer update this tick brings.
        Each group's gradient is the mean over the microbatches it applied here: the data node weighted each
        loss 1 / `microbatches` (a pipeline's batch), and a replica may get more or fewer (an uneven deal, a
        wider stage, a lost microbatch)."""
        norms = [
            norm
            for group, share in zip(decision.updates, decision.shares, strict=True)
            if (norm := self.worker.step_group(group, self.spec.microbatches / share)) is not None
        ]
        self.worker.discard_gradients_except(keep)
        self.outer.settle(self.optimizer.step_count)
        return norms
