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

The event loop itself is `_eventloop.play`, or its C twin `_ceventloop` where the install compiled it
(the same results to the last bit; `EVENT_LOOP` says which runs). Their states are opaque here: only
`copy()`, `now`, `ends`, `collisions` and `queueing` are read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import protocols.skippipe._eventloop as _eventloop
from protocols.errors import LocalProtocolError
from protocols.skippipe._eventloop import Chain, State
from protocols.skippipe.swarm import SwarmView

try:
    import protocols.skippipe._ceventloop as _loop
except ImportError:  # built without a C compiler: the same loop in Python
    _loop = _eventloop

EVENT_LOOP = "c" if _loop is not _eventloop else "python"


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


@dataclass(frozen=True)
class Trace:
    """A timed plan and snapshots of the simulation, from which `Simulator.rerun` times a changed plan
    without replaying the part of the iteration that the change cannot affect."""

    paths: Mapping[int, tuple[int, ...]]
    result: SimResult
    ends: tuple[list[float], ...]
    snapshots: tuple[State, ...]
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
        state = _loop.State(chains, self.view.n_nodes, self.fifo)
        self._play(state, chains, math.inf, None, 0)
        return _result(ids, state)

    def trace(self, paths: Mapping[int, Sequence[int]]) -> Trace:
        """`run`, keeping a snapshot of the state every `stride` events (by default about 32 per run) for
        `rerun`."""
        ids = sorted(paths)
        chains = [self._chain(mb, paths[mb]) for mb in ids]
        state = _loop.State(chains, self.view.n_nodes, self.fifo)
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

    def _play(
        self,
        state: State,
        chains: list[Chain],
        bound: float,
        snapshots: list[State] | None,
        stride: int,
        rests: list[list[float]] | None = None,
    ) -> bool:
        memory = len(chains) + 1 if self.fifo else self.memory
        return _loop.play(state, chains, self.view.link_s, memory, bound, snapshots, stride, rests)

    def _stride(self, chains: list[Chain]) -> int:
        return self.stride or max(16, 3 * sum(map(len, chains)) // 32)  # 3 events per task

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


def _result(ids: list[int], state: State) -> SimResult:
    finish = {mb: ends[-1] for mb, ends in zip(ids, state.ends, strict=True) if ends[-1] != math.inf}
    stuck = tuple(mb for mb in ids if mb not in finish)
    iteration = math.inf if stuck else max(finish.values(), default=0.0)
    return SimResult(iteration, MappingProxyType(finish), state.collisions, state.queueing, stuck)


def _last_before(snapshots: tuple[State, ...], moment: float) -> int:
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
