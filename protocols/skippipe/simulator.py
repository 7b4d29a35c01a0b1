"""Deterministic discrete-event simulator of one training iteration over given paths.

Model (the reference code's cost model, made precise):

- A microbatch on path `(d, n1, .., nk, d)` runs, in order: forward (embedding) at d, forward at n1..nk,
  head and loss at d (`head_factor` x d's forward), backward at nk..n1 (`backward_factor` x forward) and
  finally the embedding backward at d. Every change of node costs `link_s[a][b]`.
- A node runs one task at a time, without preemption. When it is free it takes, among the tasks waiting
  there, backward and head tasks first (they free memory and finish microbatches), then forward tasks;
  within a class the earliest arrival, then the lowest microbatch id.
- Memory: a microbatch holds one slot of a node from the start of its forward there until the end of its
  backward there (at its data node: from the embedding to the embedding backward). A forward task waits
  while its node holds `memory` microbatches. A set of paths can deadlock on memory (swapped stages
  waiting on each other); those microbatches are reported as stuck.
- Iteration time: the moment the last embedding backward ends at its data node.

A collision is a task arriving at a node that is busy or already has tasks waiting.

With `fifo` a plainer model times the same paths: every node serves its tasks in arrival order (no
priority for backward passes) and holds any number of microbatches. A plan's advantage should hold in
both models, not only in the one it was optimised in.

`Simulator` keeps task chains between runs and re-times a changed plan from snapshots of a traced one
(`trace`, `rerun`): the state before the first changed task is the traced plan's, so only the rest of
the iteration is replayed, with the same result as a fresh run.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from protocols.errors import LocalProtocolError
from protocols.skippipe.swarm import SwarmView


@dataclass(frozen=True)
class SimResult:
    """Outcome of one simulated iteration."""

    iteration_time_s: float
    finish_s: Mapping[int, float]
    collisions: int
    queueing_s: float
    stuck: tuple[int, ...] = ()

    @property
    def total_finish_s(self) -> float:
        """Sum of the microbatches' finish times: a tie-breaker that rewards finishing early."""
        return sum(self.finish_s.values())


def simulate(
    paths: Mapping[int, Sequence[int]], view: SwarmView, memory: int, *, fifo: bool = False
) -> SimResult:
    """Run every microbatch along its path; see the module docstring for the model."""
    return Simulator(view, memory, fifo=fifo).run(paths)


Chain = list[tuple[int, bool, float, bool]]  # (node, is_forward, seconds, releases_memory) per task


class _State:
    """What the event loop carries from one instant to the next (at an instant's start nothing waits to
    be dispatched)."""

    __slots__ = (
        "back",
        "busy",
        "collisions",
        "ends",
        "events",
        "fwd",
        "held",
        "now",
        "queueing",
        "seq",
        "until",
    )

    def __init__(self, chains: list[Chain], n_nodes: int, fifo: bool) -> None:
        self.busy = [False] * n_nodes
        self.until = [0.0] * n_nodes  # when a busy node's task ends
        self.held = [0] * n_nodes
        self.back: list[list[tuple[float, int, int]]] = [[] for _ in range(n_nodes)]
        self.fwd = self.back if fifo else [[] for _ in range(n_nodes)]
        # (time, seq, node, microbatch index, step): step >= 0 arrives, -1 - step finishes
        self.events = [(0.0, i, chain[0][0], i, 0) for i, chain in enumerate(chains)]
        self.seq = len(chains)
        self.ends = [[math.inf] * len(chain) for chain in chains]  # when each task finished
        self.collisions, self.queueing, self.now = 0, 0.0, 0.0

    def copy(self) -> _State:
        other = object.__new__(_State)
        other.busy, other.held, other.until = self.busy[:], self.held[:], self.until[:]
        other.back = [q[:] for q in self.back]
        other.fwd = other.back if self.fwd is self.back else [q[:] for q in self.fwd]
        other.events, other.seq = self.events[:], self.seq
        other.ends = [e[:] for e in self.ends]
        other.collisions, other.queueing, other.now = self.collisions, self.queueing, self.now
        return other


@dataclass(frozen=True)
class Trace:
    """A timed plan and snapshots of the simulation, from which `Simulator.rerun` times a changed plan
    without replaying the part of the iteration that the change cannot affect."""

    paths: Mapping[int, tuple[int, ...]]
    result: SimResult
    ends: tuple[list[float], ...]
    snapshots: tuple[_State, ...]
    chains: tuple[Chain, ...]
    rests: tuple[list[float], ...]


class Simulator:
    """`simulate` for one view and memory that keeps each path's task chain for its next runs and re-times
    a plan after a change to a few paths (a planner times many plans that differ in a path or two)."""

    def __init__(
        self, view: SwarmView, memory: int, *, fifo: bool = False, stride: int | None = None
    ) -> None:
        if memory < 1:
            raise LocalProtocolError(f"memory must be at least 1 microbatch, got {memory}")
        if stride is not None and stride < 1:
            raise LocalProtocolError(f"stride must be at least 1 event, got {stride}")
        self.view = view
        self.memory = memory
        self.fifo = fifo
        self.stride = stride
        self._chains: dict[tuple[int, tuple[int, ...]], Chain] = {}
        self._rests: dict[int, list[float]] = {}  # by id of a chain kept in _chains

    def run(self, paths: Mapping[int, Sequence[int]]) -> SimResult:
        """Simulate one iteration over `paths`."""
        ids = sorted(paths)
        chains = [self._chain(mb, paths[mb]) for mb in ids]
        state = _State(chains, self.view.n_nodes, self.fifo)
        self._play(state, chains, math.inf, None, 0)
        return _result(ids, state)

    def trace(self, paths: Mapping[int, Sequence[int]]) -> Trace:
        """`run`, keeping a snapshot of the state every `stride` events (by default about 32 per run) for
        `rerun`."""
        ids = sorted(paths)
        chains = [self._chain(mb, paths[mb]) for mb in ids]
        state = _State(chains, self.view.n_nodes, self.fifo)
        snapshots = [state.copy()]
        self._play(state, chains, math.inf, snapshots, self._stride(chains))
        frozen = MappingProxyType({mb: tuple(paths[mb]) for mb in ids})
        rests = tuple(self._rest(chain) for chain in chains)
        return Trace(frozen, _result(ids, state), tuple(state.ends), tuple(snapshots), tuple(chains), rests)

    def rerun(
        self, trace: Trace, paths: Mapping[int, Sequence[int]], bound: float = math.inf
    ) -> SimResult | None:
        """`run(paths)` for a plan of the same microbatches as `trace`'s, replayed from the last snapshot
        before its first task that differs; None once its iteration is sure to end after `bound`."""
        ids, chains, rests, diverge, first = self._changed(trace, paths)
        if first > bound + 1e-9 * max(1.0, abs(bound)):
            return None  # the changed task of the earliest change arrives too late (as `_play` would find)
        state = trace.snapshots[_last_before(trace.snapshots, diverge)].copy()
        if not self._play(state, chains, bound, None, 0, rests):
            return None
        return _result(ids, state)

    def retrace(self, trace: Trace, paths: Mapping[int, Sequence[int]]) -> Trace:
        """`trace(paths)` for a plan of the same microbatches as `trace`'s (a rerun that was kept): the
        snapshots before its first changed task are `trace`'s, the rest of the iteration is replayed."""
        ids, chains, rests, diverge, _ = self._changed(trace, paths)
        start = _last_before(trace.snapshots, diverge)
        snapshots = list(trace.snapshots[: start + 1])
        state = snapshots[start].copy()
        self._play(state, chains, math.inf, snapshots, self._stride(chains))
        frozen = MappingProxyType({mb: tuple(paths[mb]) for mb in ids})
        return Trace(
            frozen, _result(ids, state), tuple(state.ends), tuple(snapshots), tuple(chains), tuple(rests)
        )

    def _changed(
        self, trace: Trace, paths: Mapping[int, Sequence[int]]
    ) -> tuple[list[int], list[Chain], list[list[float]], float, float]:
        """The microbatch ids, task chains and rests of `paths`, the earliest moment one of its tasks can
        differ from `trace`'s, and when the changed task of that change arrives at best."""
        ids = sorted(paths)
        if ids != list(trace.paths):
            raise LocalProtocolError("a rerun must keep the traced plan's microbatches")
        chains, rests = list(trace.chains), list(trace.rests)
        diverge, first = math.inf, 0.0  # the earliest divergence, and when its changed task arrives at best
        for i, (mb, old) in enumerate(trace.paths.items()):
            path = paths[mb]
            if path != old and tuple(path) != old:
                chains[i] = chain = self._chain(mb, path)
                rests[i] = self._rest(chain)
                step = _first_difference(trace.chains[i], chain)
                when = trace.ends[i][step - 1] if step > 0 else 0.0
                if when < diverge:
                    diverge, first = when, when
                    if step < len(chain):
                        hop = self.view.link_s[chain[step - 1][0]][chain[step][0]] if step > 0 else 0.0
                        first = when + hop + rests[i][step]
        return ids, chains, rests, diverge, first

    def _stride(self, chains: list[Chain]) -> int:
        return self.stride or max(16, 3 * sum(map(len, chains)) // 32)  # 3 events per task

    def _play(
        self,
        state: _State,
        chains: list[Chain],
        bound: float,
        snapshots: list[_State] | None,
        stride: int,
        rests: list[list[float]] | None = None,
    ) -> bool:
        """Run the event loop from `state` to the end (True), or stop (False) once the iteration is sure to
        end after `bound`: an event falls after it, or a task arrives at a node busy too long or starts too
        late for the rest of its chain (`rests`) to end by then. With `snapshots`, append a copy of the
        state at an instant's start every `stride` events.

        A node to serve goes to `dispatch` while other events are due at the same instant (all of an
        instant's arrivals compete); one with nothing else due is served at once."""
        limit = bound + 1e-9 * max(1.0, abs(bound))  # the rests are sums in another order: keep a margin
        links = self.view.link_s
        memory = len(chains) + 1 if self.fifo else self.memory
        busy, held, until, waiting_back, waiting_fwd = (
            state.busy,
            state.held,
            state.until,
            state.back,
            state.fwd,
        )
        fifo = waiting_back is waiting_fwd
        events, ends = state.events, state.ends
        seq, collisions, queueing, now = state.seq, state.collisions, state.queueing, state.now
        pending = [False] * len(busy)
        dispatch: list[int] = []  # nodes to serve at `now` in request order, once no event is left at `now`
        push, pop = heapq.heappush, heapq.heappop
        since = 0
        if events and events[0][0] > bound:
            return False
        while True:
            if events and (not dispatch or events[0][0] == now):
                if events[0][0] != now:  # a new instant
                    if events[0][0] > bound:
                        return False
                    if snapshots is not None and since >= stride:
                        state.seq, state.collisions, state.queueing = seq, collisions, queueing
                        state.now = events[0][0]
                        snapshots.append(state.copy())
                        since = 0
                now, _, node, i, step = pop(events)
                since += 1
                if step >= 0:  # a task arrives; it starts no sooner than its node is free
                    if rests is not None and (until[node] if busy[node] else now) + rests[i][step] > limit:
                        return False
                    task = chains[i][step]
                    if busy[node]:
                        collisions += 1
                        push(waiting_fwd[node] if task[1] else waiting_back[node], (now, i, step))
                        continue
                    if waiting_back[node] or waiting_fwd[node]:
                        collisions += 1
                    elif (
                        not dispatch
                        and (not events or events[0][0] != now)
                        and (not task[1] or held[node] < memory)
                    ):
                        # alone at an idle node, nothing else due at this instant: it starts at once
                        held[node] += task[1]
                        busy[node] = True
                        until[node] = end = now + task[2]
                        push(events, (end, seq, node, i, -1 - step))
                        seq += 1
                        continue
                    push(waiting_fwd[node] if task[1] else waiting_back[node], (now, i, step))
                else:  # a task finishes
                    step = -1 - step
                    busy[node] = False
                    ends[i][step] = now
                    chain = chains[i]
                    if chain[step][3]:  # a backward pass frees its memory slot
                        held[node] -= 1
                    if step + 1 < len(chain):
                        task = chain[step + 1]
                        nxt = task[0]
                        arrive = now + links[node][nxt]
                        if busy[nxt] and until[nxt] > arrive:
                            # it will find nxt busy, and nothing is served there before then: queue it now
                            if rests is not None and until[nxt] + rests[i][step + 1] > limit:
                                return False
                            collisions += 1
                            push(waiting_fwd[nxt] if task[1] else waiting_back[nxt], (arrive, i, step + 1))
                        else:
                            push(events, (arrive, seq, nxt, i, step + 1))
                            seq += 1
                    if not waiting_back[node] and not waiting_fwd[node]:
                        continue  # nothing to serve
                if dispatch or (events and events[0][0] == now):
                    if not pending[node]:
                        pending[node] = True
                        dispatch.append(node)
                    continue
                # nothing else is due at this instant: serve `node` now
            elif dispatch:
                node = dispatch.pop(0)
                pending[node] = False
                if busy[node]:
                    continue
            else:
                break
            back = waiting_back[node]
            if back and not fifo:
                ready, i, step = pop(back)
            else:
                fwd = waiting_fwd[node]
                if fwd and held[node] < memory:
                    ready, i, step = pop(fwd)
                    if chains[i][step][1]:
                        held[node] += 1
                else:
                    continue
            if rests is not None and now + rests[i][step] > limit:
                return False
            queueing += now - ready
            busy[node] = True
            until[node] = end = now + chains[i][step][2]
            push(events, (end, seq, node, i, -1 - step))
            seq += 1
        state.seq, state.collisions, state.queueing, state.now = seq, collisions, queueing, now
        return True

    def _rest(self, chain: Chain) -> list[float]:
        """Per task of `chain`, the least time from its arrival to the chain's end (no waiting)."""
        key = id(chain)
        rest = self._rests.get(key)
        if rest is None:
            links = self.view.link_s
            rest = [0.0] * len(chain)
            after = 0.0
            for j in range(len(chain) - 1, -1, -1):
                hop = links[chain[j][0]][chain[j + 1][0]] if j + 1 < len(chain) else 0.0
                after = rest[j] = chain[j][2] + hop + after
            self._rests[key] = rest
        return rest

    def _chain(self, mb: int, path: Sequence[int]) -> Chain:
        key = (mb, tuple(path))
        chain = self._chains.get(key)
        if chain is None:
            chain = self._chains[key] = _tasks(mb, path, self.view)
        return chain


def _result(ids: list[int], state: _State) -> SimResult:
    finish = {mb: ends[-1] for mb, ends in zip(ids, state.ends, strict=True) if ends[-1] != math.inf}
    stuck = tuple(mb for mb in ids if mb not in finish)
    iteration = math.inf if stuck else max(finish.values(), default=0.0)
    return SimResult(iteration, MappingProxyType(finish), state.collisions, state.queueing, stuck)


def _last_before(snapshots: tuple[_State, ...], moment: float) -> int:
    """The index of the last snapshot taken at or before `moment` (the first if none is)."""
    start = 0
    for k, snapshot in enumerate(snapshots):
        if snapshot.now > moment:
            break
        start = k
    return start


def _first_difference(old: Chain, new: Chain) -> int:
    return next(
        (j for j, (a, b) in enumerate(zip(old, new, strict=False)) if a != b), min(len(old), len(new))
    )


def _tasks(mb: int, path: Sequence[int], view: SwarmView) -> list[tuple[int, bool, float, bool]]:
    """(node, is_forward, seconds, releases_memory) for each task of the microbatch, in order."""
    if len(path) < 3 or path[0] != path[-1]:
        raise LocalProtocolError(f"microbatch {mb}: a path must leave from and return to one data node")
    if any(not isinstance(v, int) or not 0 <= v < view.n_nodes for v in path):
        raise LocalProtocolError(f"microbatch {mb}: path {tuple(path)} names unknown nodes")
    fwd = view.forward_s
    back = view.backward_factor
    data, interior = path[0], path[1:-1]
    chain = [(data, True, fwd[data], False)]
    chain += [(v, True, fwd[v], False) for v in interior]
    chain.append((data, False, view.head_factor * fwd[data], False))
    chain += [(v, False, back * fwd[v], True) for v in reversed(interior)]
    chain.append((data, False, back * fwd[data], True))
    return chain
