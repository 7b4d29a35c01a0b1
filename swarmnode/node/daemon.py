"""A swarmnode daemon: one node serving one stage of a run.

It announces itself on the DHT, serves its state to joiners, averages with a replica every H steps
(NoLoCo), and rejects bad input from peers with a logged reason and a ban. What a stage does with the
microbatches routed to it is added by `node.stage.StageNode` (transformer stages) and `node.driver.DataNode`
(stage 0, which drives whole iterations).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from abc import ABC, abstractmethod
from dataclasses import replace
from functools import partial

import torch
from hivemind.p2p import PeerID
from torch import Tensor

from protocols.bounds import CLOCK_MARGIN
from protocols.checkfree import Recovery, copies_kept, copy_source, replica_lr_factor
from protocols.hops import Abort, Backward, Forward, Route
from protocols.links import LinkCost
from protocols.messages import Ack, AveragingRequest, ErrorCode, NodeRecord, NodeState, Pong, Rpc, encode
from protocols.noloco import OuterConfig
from protocols.stepbook import MicrobatchKey
from protocols.transfers import StatePart, StateRequest, StateTransfer
from swarmnode.malloc_tuning import keep_freed
from swarmnode.node import recovery, seed, state
from swarmnode.node.averaging import OuterLoop
from swarmnode.node.checks import Rejected, guarded, hop_tensor
from swarmnode.node.compute import ComputeQueue, ThroughputMeter, compute_clock
from swarmnode.node.context import BAN_SECONDS, NodeContext
from swarmnode.node.events import emit
from swarmnode.node.greetings import Greetings
from swarmnode.node.liveness import MATCHING_PING_TIMEOUT_S, answering
from swarmnode.node.planning import RememberedView, SwarmRead
from swarmnode.node.router import Router
from swarmnode.node.serving import StateServer
from swarmnode.node.worker import Wire
from swarmnode.optim import Schedule, StageOptimizer
from swarmnode.pieces import build_piece, copy_layout
from swarmnode.precision import wire_dtypes
from swarmnode.presets import get_preset
from swarmnode.relays import relays_of
from swarmnode.transport import Compression, Reply

logger = logging.getLogger(__name__)

LINK_PROBE_S = 1.0  # how often a node pings the peers it sent hops to without a round trip known
MAX_LINK_PROBES = 16  # pings per probe

# a peer missing from the latest reads is still planned with for this many record TTLs: with 2 (8 s), three
# local swarms on two cores lost a live replica from a data node's view for a step, which then fed one
# pipeline instead of two. A peer really gone is dropped sooner, by the calls and pings that fail to reach it.
VIEW_GRACE_TTLS = 4
MEASURED_AFTER = 8  # microbatches a node serves before it measures its throughput
MEASURED_OVER = 16  # microbatches it measures over before it tells (then over all since)
# heap memory a daemon keeps once freed, in multiples of its weights' bytes: a llama-124m stage frees and
# takes again three to four times its weights in an iteration (sums, weight products, a snapshot)
FREED_PER_WEIGHTS = 4


class Node(ABC):
    """State and handlers shared by every node; `StageNode` and `DataNode` add their stage's work.

    Complete once built (its transport, router and NoLoCo loop included); `start` serves and announces it,
    recovers its stage's state and starts its periodic tasks; `close` ends them."""

    def __init__(self, context: NodeContext, stage: int) -> None:
        spec = context.spec
        self.spec = spec
        self.stage = stage
        self.dht = context.dht
        self.me = context.dht.peer_id
        self.transport = context.transport
        self.links = context.links
        self.metrics = context.metrics
        self.dump_dir = context.dump_dir
        self.precision = context.precision
        self.wire = Wire(*wire_dtypes(spec.dtype))
        self.model_config = replace(get_preset(spec.preset).model, vocab_size=spec.vocab_size)
        self.piece = build_piece(self.model_config, stage, spec.stages, spec.seed).to(self.precision.device)
        # what an iteration frees and takes again: gradient sums, weight products, snapshots (malloc_tuning)
        keep_freed(FREED_PER_WEIGHTS * sum(p.numel() * p.element_size() for p in self.piece.parameters()))
        schedule = Schedule(spec.lr, spec.warmup_steps, spec.total_steps)
        self.optimizer = StageOptimizer(self.piece, schedule, spec.max_grad_norm)
        self.compute = ComputeQueue(
            compute_clock(self.precision.device.type, torch.get_num_threads()), self.precision.synchronize
        )
        self.state = NodeState.JOINING
        self.swarm_read = SwarmRead({})  # the latest read of the DHT
        self._remembered = RememberedView(VIEW_GRACE_TTLS * spec.record_ttl_s)
        self.microbatches_lost = 0
        self.microbatches_served = 0  # backward passes completed here
        self.tokens_processed = 0
        self._throughput = ThroughputMeter(MEASURED_AFTER, MEASURED_OVER)
        self.last_loss: float | None = None
        self.recovery: tuple[str, float] | None = None
        self.rng = random.Random(f"{spec.seed}/{self.me}")
        self.compression = Compression.FLOAT16 if spec.compression == "float16" else Compression.NONE
        self.router = Router(
            self.transport, self.me, self.view_online, spec.hop_timeout_s, self.compression, self.rng
        )
        if self.metrics is not None:
            self.router.on_hop = self.metrics.observe_hop
        outer_config = OuterConfig(
            alpha=spec.noloco_alpha,
            beta=spec.noloco_beta,
            gamma=spec.noloco_gamma,
            inner_steps=spec.noloco_inner_steps,
        )
        self.outer = OuterLoop(
            self.piece,
            outer_config,
            spec.run_id,
            stage,
            self.me,
            self.transport,
            self.compute,
            timeout_s=2 * spec.hop_timeout_s,
        )
        self.state_server = StateServer(self)
        self.greetings = Greetings(self.router, self.refresh_swarm_read, self.spawn)
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()
        self._stepping = False
        self._started = False
        self.move_to: int | None = None  # set when this node decides to leave for a lost stage
        self.copies: dict[StatePart, state.TensorMap] = {}
        self.copy_parts: tuple[StatePart, ...] = ()
        if spec.checkfree_plus:
            self.copy_parts = copies_kept(stage, spec.stages, spec.edge_copies)

    # ---- lifecycle --------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Serve, read the swarm, recover this stage's state (or start from the seed), announce the node
        online and start its periodic tasks."""
        # what one request may carry (float32 at most): a hop's activations, or a replica's phi and theta
        hop_bytes = 4 * self.spec.batch_size * self.spec.seq_len * self.model_config.dim
        average_bytes = 8 * sum(p.numel() for p in self.piece.parameters())
        for rpc, handler, max_body_bytes in (
            (Rpc.FORWARD, self._on_forward, hop_bytes),
            (Rpc.BACKWARD, self._on_backward, hop_bytes),
            (Rpc.ABORT, self._on_abort, 0),
            (Rpc.ROUTE, self._on_route, 0),
            (Rpc.AVERAGE, self._on_average, average_bytes),
            (Rpc.STATE, self._on_state, 0),
            (Rpc.PING, self._on_ping, 0),
            (Rpc.HELLO, self.greetings.on_hello, 0),
        ):
            served = guarded(rpc, handler, self.spec.run_id, self.transport, BAN_SECONDS, self.metrics)
            self.transport.register(rpc, served, max_body_bytes)
        self.compute.start()
        self._started = True
        await self.transport.start()
        await self.refresh_swarm_read()
        self.state = NodeState.RECOVERING
        await self.publish()
        self.recovery = await recovery.recover(self)
        if self.recovery is None and self.spec.init_digests is not None:
            await seed.start_from_seed(self)
        self.state = NodeState.ONLINE
        await self.publish()
        await self.greetings.greet(self.swarm_read, self.me, self.stage, self.spec.stages)
        if self.copy_parts:
            self.spawn(self.refresh_copies(), "copies")
        self._tasks += [
            asyncio.create_task(self._every(self.spec.record_period_s, self.publish), name="publish"),
            asyncio.create_task(self._every(self.spec.record_period_s, self.refresh_swarm_read), name="view"),
            asyncio.create_task(self._every(1.0, self.maybe_step), name="expiry"),
            asyncio.create_task(self._every(LINK_PROBE_S, self.probe_links), name="links"),
        ]
        device, dtype = str(self.precision.device), str(self.precision.dtype).removeprefix("torch.")
        maddrs = self.dht.visible_maddrs()  # where peers dial it: for `--initial-peers`
        emit("online", stage=self.stage, peer_id=self.me, device=device, dtype=dtype, maddrs=maddrs)

    async def wait(self) -> None:
        await self._stopping.wait()

    def stop(self) -> None:
        self._stopping.set()

    async def close(self) -> None:
        if not self._started:
            return
        self.state = NodeState.LEAVING
        try:
            await asyncio.wait_for(self.publish(), 1.0)
        except Exception as error:  # leaving anyway
            logger.info("could not announce leaving: %s", error)
        await self.transport.close()  # no new requests (and no new tasks) from here on
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.compute.close()

    async def _every(self, period: float, action) -> None:  # type: ignore[no-untyped-def]
        while True:
            try:
                await action()
            except asyncio.CancelledError:
                raise
            except Exception as error:
                logger.warning("%s failed: %s", getattr(action, "__name__", action), error)
            await asyncio.sleep(period)

    # ---- the swarm ----------------------------------------------------------------------------------------

    def view(self) -> SwarmRead:
        """The swarm to route with: the latest read, plus peers a recent read showed online (a live node's
        record can be missing from one read on a loaded machine: `protocols.sightings`), less those that calls
        failed to reach and the latest read lacks. Decisions that a stage is lost read `swarm_read`, the
        latest read alone."""
        return self._remembered.update(self.swarm_read, time.monotonic(), self.router.suspects())

    def view_online(self, stage: int) -> list[str]:
        return self.view().online(stage)

    async def refresh_swarm_read(self) -> None:
        self.swarm_read = SwarmRead(await self.dht.read_swarm(self.spec.stages))
        self._remembered.observe(self.swarm_read, time.monotonic())
        peers = [peer for peers in self.swarm_read.stages.values() for peer in peers]
        listed = {peer.peer_id: relays_of(peer.record.addrs) for peer in peers if peer.record.addrs}
        self.transport.set_relays({PeerID.from_base58(peer): relays for peer, relays in listed.items()})
        if self.links is not None:
            self.links.set_sites({peer.peer_id: peer.record.site for peer in peers})

    async def probe_links(self) -> None:
        """Ping the peers this node sent hops to but never timed a small call with (at most
        `MAX_LINK_PROBES`): a hop alone gives no round trip, and a link without one is left out of this
        node's record, so the planners would cost it as loopback however far the peer is."""
        await answering(self.transport, self.transport.estimates.without_round_trip()[:MAX_LINK_PROBES])

    def measured_throughput(self) -> float:
        """Tokens a second of compute, as the planners cost this node by (`ThroughputMeter`); 0 until
        measured."""
        busy = self.compute.busy_seconds
        return self._throughput.rate(self.microbatches_served, self.tokens_processed, busy)

    def record(self) -> NodeRecord:
        return NodeRecord(
            state=self.state,
            stage=self.stage,
            step=self.optimizer.step_count,
            outer_step=self.outer.outer_step,
            loss=self.last_loss,
            grad_norm=self.optimizer.last_grad_norm,
            throughput=self.measured_throughput(),
            queue_depth=self.compute.depth,
            copies=tuple(self.copies),
            addrs=self.dht.circuit_addrs,
            microbatches_lost=self.microbatches_lost,
            recovery=self.recovery[0] if self.recovery else None,
            recovery_seconds=self.recovery[1] if self.recovery else None,
            site=self.links.site if self.links else None,
            links=self._link_costs(),
            stood_in=self.stood_in(),
        )

    def stood_in(self) -> tuple[int, int] | None:
        """What this node served in the edge stages' places recently (`NodeRecord.stood_in`); None: it does
        not count (a data node)."""
        return None

    def _link_costs(self) -> tuple[LinkCost, ...]:
        """What this node measured of its links to the peers it talked to last (`LinkEstimates.link_costs`),
        for one hop's activations."""
        element = 2 if self.compression is Compression.FLOAT16 or self.spec.dtype != "float32" else 4
        hop_bytes = element * self.spec.batch_size * self.spec.seq_len * self.model_config.dim
        return self.transport.estimates.link_costs(hop_bytes)

    async def publish(self) -> None:
        await self.dht.publish(self.record(), self.spec.record_ttl_s)

    # ---- requests -------------------------------------------------------------------------------------

    def _hop_tensor(self, peer: str, message: Forward | Backward, tensors: list[Tensor]) -> Tensor:
        shape = (self.spec.batch_size, self.spec.seq_len, self.model_config.dim)
        return hop_tensor(self.me, self.stage, peer, message, tensors, shape)

    async def _on_abort(self, peer: str, abort: Abort, tensors: list[Tensor]) -> tuple[bytes, list[Tensor]]:
        key = MicrobatchKey(abort.origin, abort.iteration, abort.microbatch)
        if not self.abort_allowed(peer, key):
            raise Rejected(ErrorCode.STALE, f"{peer[-8:]} is not on the path of microbatch {key}")
        self.spawn(self.on_abort(key, abort.reason), "abort")
        return encode(Ack()), []

    async def _on_ping(self, peer: str, _: None, tensors: list[Tensor]) -> tuple[bytes, list[Tensor]]:
        """Alive, and serving which stage (a node that moved keeps its peer id but not its stage)."""
        return encode(Pong(self.stage)), []

    async def _on_state(self, peer: str, request: StateRequest, tensors: list[Tensor]) -> Reply:
        return await self.state_server.serve(peer, request)

    def check_replica(self, header: StateTransfer, received: state.TensorMap) -> state.ReplicaState:
        """A live replica's state, checked against this stage and the bounds of `protocols.bounds`, before
        anything of it is loaded; its lr factor must be one the recovery rules set."""
        replica_lr_factor(header.lr_factor)
        return state.check_replica_state(
            self.piece, received, max_grad_norm=self.spec.max_grad_norm, max_step=header.step + CLOCK_MARGIN
        )

    def load_replica(self, header: StateTransfer, received: state.TensorMap) -> None:
        """On the compute thread: become a copy of a live replica (weights, Adam moments, NoLoCo state, lr
        factor), checked again here (a refused state changes nothing)."""
        checked = self.check_replica(header, received)
        state.load_replica_state(self.piece, self.optimizer, checked)
        self.outer.phi, self.outer.delta = checked.phi, checked.delta
        self.outer.resume_at(header.outer_step, header.step)
        self.optimizer.step_count = header.step
        self.optimizer.last_grad_norm = header.grad_norm
        self.optimizer.lr_factor = replica_lr_factor(header.lr_factor)

    def load_rebuilt(self, rebuilt: state.TensorMap, plan: Recovery, step: int) -> None:
        """On the compute thread: load rebuilt (or, for `reinit`, freshly drawn) weights; fresh optimizer
        with the plan's lr factor; the schedule at the swarm's `step`, so no warm-up again."""
        state.load_weights(self.piece, rebuilt)
        if plan.reset_optimizer:
            self.optimizer.reset(plan.lr_factor)
        self.optimizer.step_count = step
        self.outer.phi, self.outer.delta = state.weights(self.piece), None
        self.outer.resume_at(0, step)

    async def refresh_copies(self) -> None:
        """CheckFree+: refresh this node's copies of E / E' from a live data node, of an edge stage's
        weights from a live node of that stage."""
        for part in self.copy_parts:
            # a copy of another layout, or not finite, is refused (the next donor is asked; the old copy kept)
            check = state.layout_check(copy_layout(self.model_config, part, self.spec.stages), str(part))
            try:
                donor, header, self.copies[part] = await recovery.fetch_from_any(
                    self, copy_source(part, self.spec.stages), (part,), check
                )
            except recovery.RecoveryFailed as error:
                logger.info("copy refresh failed: %s", error)
            else:
                emit("copy_refreshed", stage=self.stage, part=str(part), donor=donor, step=header.step)

    async def _on_average(
        self, peer: str, request: AveragingRequest, tensors: list[Tensor]
    ) -> tuple[bytes, list[Tensor]]:
        reply, out = await self.outer.serve(peer, request, tensors)
        return encode(reply), out

    # ---- stage work, implemented by StageNode and DataNode ---------------------------------------------

    @abstractmethod
    async def _on_forward(
        self, peer: str, message: Forward, tensors: list[Tensor]
    ) -> tuple[bytes, list[Tensor]]: ...

    @abstractmethod
    async def _on_backward(
        self, peer: str, message: Backward, tensors: list[Tensor]
    ) -> tuple[bytes, list[Tensor]]: ...

    @abstractmethod
    async def on_abort(self, key: MicrobatchKey, reason: str) -> None: ...

    @abstractmethod
    def abort_allowed(self, peer: str, key: MicrobatchKey) -> bool:
        """Whether `peer` may abort microbatch `key` here (a peer off its path may not)."""

    async def _on_route(self, peer: str, route: Route, tensors: list[Tensor]) -> tuple[bytes, list[Tensor]]:
        raise Rejected(ErrorCode.WRONG_STAGE, f"route notices go to data nodes, not to stage {self.stage}")

    @abstractmethod
    async def maybe_step(self) -> None: ...

    def spawn(self, coro, name: str) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.create_task(coro, name=name)
        self._tasks.append(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        if task in self._tasks:
            self._tasks.remove(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("task %s failed", task.get_name(), exc_info=task.exception())

    async def outer_step_if_due(self) -> None:
        """Start the NoLoCo outer step that the swarm clock has reached, if one is due."""
        outer = self.outer.take_due(self.optimizer.step_count)
        if outer is not None:
            replicas = [p for p in self.router.online(self.stage) if p != self.me]
            live = partial(answering, self.transport, stage=self.stage, timeout_s=MATCHING_PING_TIMEOUT_S)
            self.spawn(self.outer.run(outer, [*replicas, self.me], time.monotonic, live), "noloco")

    async def tick(self, clock: int) -> None:
        """The swarm clock reached `clock` (seen in a forward or a data node's record): the schedule moves
        there even if this node took no step, and a NoLoCo outer step that falls due starts."""
        self.optimizer.advance(clock)
        await self.outer_step_if_due()
