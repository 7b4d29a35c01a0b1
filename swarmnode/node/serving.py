"""Serving this node's state to the peers that recovery sends here: whom, how many at once, from what.

- Whom: the peers whose DHT record says they join or recover a stage this state serves (`protocols.access`);
  a peer missing from the node's view is looked up once more in a fresh read of the DHT (concurrent
  lookups share one read). Others are refused as WRONG_STAGE, not banned (a record may lag).
- How many: one transfer per peer and `MAX_TRANSFERS` in all; the rest are refused as BUSY, and the
  recovering side tries another donor, then waits and tries again (`recovery.fetch_any`). A transfer holds
  its slot from its request until its reply has been written, or could not be (the transport's
  `Reply.written`): a reader that stalls keeps its slot until its request's deadline.
- From what: one snapshot per optimizer state, cloned on the compute thread below all training work
  (`Priority.SERVE`) the first time a part is asked for, then shared by every request until the state
  changes. The transport sends reply tensors from their memory, so a snapshot is never changed, only
  replaced, and N requests in one step cost one clone.
- How long: `REQUEST_SECONDS` bounds every request this node serves, the reply's write included (the
  transport's own default is 600 s), so a reader that stalls holds its stream at most that long.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from torch import nn

from protocols.access import refusal
from protocols.checkfree import copy_places
from protocols.messages import ErrorCode, NodeState, encode
from protocols.transfers import StatePart, StateRequest, StateTransfer
from swarmnode.node import state
from swarmnode.node.checks import Rejected
from swarmnode.node.compute import ComputeQueue, Priority
from swarmnode.node.events import emit
from swarmnode.node.planning import SwarmRead
from swarmnode.optim import StageOptimizer
from swarmnode.runspec import RunSpec
from swarmnode.transport import Reply

MAX_TRANSFERS = 2
# A state transfer carries about five times the stage's parameters in float32 (weights, two Adam moments,
# NoLoCo's phi and delta): 10 MB for a stage of the tiny preset, 1.6 GB for one of the 500M preset, which
# 60 s moves at 27 MB/s. Ten times less than the transport's default, and what a joiner waits for a donor.
STATE_SECONDS = 60.0


def request_seconds(spec: RunSpec) -> float:
    """The bound on one request this node serves: a state transfer, or the longest other call a peer makes
    (a NoLoCo exchange waits up to two hop timeouts)."""
    return max(STATE_SECONDS, 2 * spec.hop_timeout_s)


class OuterState(Protocol):
    """NoLoCo's part of the state (`averaging.OuterLoop`): the outer step, slow weights and momentum."""

    outer_step: int
    phi: state.TensorMap
    delta: state.TensorMap | None


class Donor(Protocol):
    """What serving needs of the node: its run, stage and state, its view of the swarm, its model."""

    spec: RunSpec
    stage: int
    state: NodeState
    compute: ComputeQueue
    piece: nn.Module
    optimizer: StageOptimizer
    outer: OuterState
    copies: dict[StatePart, state.TensorMap]

    @property
    def swarm_read(self) -> SwarmRead: ...

    async def refresh_swarm_read(self) -> None: ...


@dataclass
class _Cached:
    """The state at one version (Adam updates, outer step, step count): the header and the parts cloned."""

    version: tuple[int, int, int]
    header: tuple[int, int, float | None, float]  # step, outer step, grad norm, lr factor
    parts: dict[StatePart, state.TensorMap] = field(default_factory=dict)


class StateServer:
    """The handler of state requests for one node."""

    def __init__(self, node: Donor) -> None:
        self.node = node
        self._serving: set[str] = set()
        self._cached: _Cached | None = None
        self._lookup = _SharedRead(node.refresh_swarm_read)

    @property
    def serving(self) -> frozenset[str]:
        """The peers whose transfers hold a slot now."""
        return frozenset(self._serving)

    async def serve(self, peer: str, request: StateRequest) -> Reply:
        """The reply to `peer`'s state request; its slot is released once the transport has written it."""
        node = self.node
        if request.stage != node.stage:
            why = f"state of stage {request.stage} asked from stage {node.stage}"
            raise Rejected(ErrorCode.WRONG_STAGE, why)
        if node.state != NodeState.ONLINE:
            raise Rejected(ErrorCode.BUSY, f"this node is {node.state}, not online")
        await self._authorise(peer, request.parts)
        if peer in self._serving:
            raise Rejected(ErrorCode.BUSY, "a state transfer to this peer is in progress")
        if len(self._serving) >= MAX_TRANSFERS:
            raise Rejected(ErrorCode.BUSY, f"{MAX_TRANSFERS} state transfers in progress: try another donor")
        self._serving.add(peer)
        try:
            cached = self._current(request.parts)
            if cached is None:
                cached = await node.compute.submit(Priority.SERVE, lambda: self._snapshot(request.parts))
        except BaseException:
            self._serving.discard(peer)
            raise
        out = {name: t for part in request.parts for name, t in cached.parts[part].items()}
        step, outer_step, grad_norm, lr_factor = cached.header
        header = StateTransfer(
            node.spec.run_id,
            node.stage,
            request.parts,
            step,
            outer_step,
            grad_norm,
            state.manifest(out),
            lr_factor,
        )
        return Reply(encode(header), list(out.values()), lambda _: self._serving.discard(peer))

    async def _authorise(self, peer: str, parts: tuple[StatePart, ...]) -> None:
        """Serve `parts` to `peer` if one of its records allows it; else read the DHT once more (its record
        may be newer than this node's view: a replica that just moved here from another stage) and decide
        on that."""
        why = self._refusal(peer, parts)
        if why is not None:
            await self._lookup.read()
            why = self._refusal(peer, parts)
        if why is not None:
            raise Rejected(ErrorCode.WRONG_STAGE, why)

    def _refusal(self, peer: str, parts: tuple[StatePart, ...]) -> str | None:
        found = self.node.swarm_read.records(peer)
        if not found:
            return f"{peer[-8:]} has no record in this run: no state for it"
        reasons = [
            refusal(
                parts,
                stage=self.node.stage,
                num_stages=self.node.spec.stages,
                checkfree_plus=self.node.spec.checkfree_plus,
                requester_stage=record.record.stage,
                requester_state=record.record.state,
            )
            for record in found
        ]
        return None if None in reasons else reasons[0]

    def _version(self) -> tuple[int, int, int]:
        optimizer = self.node.optimizer
        return optimizer.updates, self.node.outer.outer_step, optimizer.step_count

    def _current(self, parts: tuple[StatePart, ...]) -> _Cached | None:
        """The cached snapshot, if it is of the current state and holds `parts` (read on the event loop: a
        step in progress has not counted itself yet, so the snapshot from before it is still whole)."""
        cached = self._cached
        if cached is None or cached.version != self._version() or not set(parts) <= set(cached.parts):
            return None
        return cached

    def _snapshot(self, parts: tuple[StatePart, ...]) -> _Cached:
        """On the compute thread: the snapshot of the current state, with `parts` cloned if they were not."""
        node, version = self.node, self._version()
        cached = self._cached
        if cached is None or cached.version != version:
            header = (version[2], version[1], node.optimizer.last_grad_norm, node.optimizer.lr_factor)
            cached = _Cached(version, header)
        missing = [part for part in parts if part not in cached.parts]
        cloned = {part: self._clone(part) for part in missing}
        if cloned:
            cached = _Cached(version, cached.header, {**cached.parts, **cloned})
            emit("state_snapshot", stage=node.stage, step=version[2], parts=[str(p) for p in missing])
        self._cached = cached
        return cached

    def _clone(self, part: StatePart) -> state.TensorMap:
        node = self.node
        if part == StatePart.WEIGHTS:
            return state.weights(node.piece)
        if part == StatePart.OPTIMIZER:
            return state.optimizer_state(node.piece, node.optimizer, node.outer.phi, node.outer.delta)
        places = copy_places(part, node.spec.stages)
        if places is not None and places[0] == node.stage:  # this node's own E, E' or edge-stage weights
            return state.piece_copy(node.piece, part) if node.stage == 0 else state.weights(node.piece)
        if part in node.copies:
            return node.copies[part]  # replaced, never changed, by each refresh
        raise Rejected(ErrorCode.BUSY, f"this node holds no {part}")


class _SharedRead:
    """`read()` returns once a read that started after the call has ended; concurrent callers share it."""

    def __init__(self, read: Callable[[], Awaitable[None]]) -> None:
        self._read = read
        self._started = 0
        self._ended = 0
        self._task: asyncio.Future[None] | None = None

    async def read(self) -> None:
        wanted = self._started + 1
        while self._ended < wanted:
            if self._task is None:
                self._started += 1
                self._task = asyncio.ensure_future(self._run(self._started))
            await asyncio.shield(self._task)

    async def _run(self, number: int) -> None:
        try:
            await self._read()
        finally:
            self._ended, self._task = number, None
