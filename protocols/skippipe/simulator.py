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


class Simulator:
    """`simulate` for one view and memory that keeps each path's task chain for its next runs (a planner
    times many plans that differ in a path or two)."""

    def __init__(self, view: SwarmView, memory: int, *, fifo: bool = False) -> None:
        if memory < 1:
            raise LocalProtocolError(f"memory must be at least 1 microbatch, got {memory}")
        self.view = view
        self.memory = memory
        self.fifo = fifo
        self._chains: dict[tuple[int, tuple[int, ...]], list[tuple[int, bool, float, bool]]] = {}

    def run(self, paths: Mapping[int, Sequence[int]]) -> SimResult:
        """Simulate one iteration over `paths`."""
        ids = sorted(paths)
        chains = [self._chain(mb, paths[mb]) for mb in ids]
        n, links, fifo = self.view.n_nodes, self.view.link_s, self.fifo
        memory = len(ids) + 1 if fifo else self.memory
        busy, pending, held = [False] * n, [False] * n, [0] * n
        waiting_back: list[list[tuple[float, int, int]]] = [[] for _ in range(n)]
        waiting_fwd = waiting_back if fifo else [[] for _ in range(n)]
        # (time, seq, node, microbatch index, step): step >= 0 arrives, -1 - step finishes
        events = [(0.0, i, chains[i][0][0], i, 0) for i in range(len(ids))]
        seq = len(events)
        dispatch: list[int] = []  # nodes to serve at `now` in request order, once no event is left at `now`
        finish = [math.inf] * len(ids)
        collisions, queueing, now = 0, 0.0, 0.0
        push, pop = heapq.heappush, heapq.heappop
        while events or dispatch:
            if events and (not dispatch or events[0][0] == now):
                now, _, node, i, step = pop(events)
                if step >= 0:
                    if busy[node] or waiting_back[node] or waiting_fwd[node]:
                        collisions += 1
                    push(waiting_fwd[node] if chains[i][step][1] else waiting_back[node], (now, i, step))
                    if busy[node]:
                        continue
                else:
                    step = -1 - step
                    busy[node] = False
                    chain = chains[i]
                    if chain[step][3]:  # a backward pass frees its memory slot
                        held[node] -= 1
                    if step + 1 == len(chain):
                        finish[i] = now
                    else:
                        nxt = chain[step + 1][0]
                        push(events, (now + links[node][nxt], seq, nxt, i, step + 1))
                        seq += 1
                if not pending[node]:
                    pending[node] = True
                    dispatch.append(node)
                continue
            node = dispatch.pop(0)
            pending[node] = False
            if busy[node]:
                continue
            back, fwd = waiting_back[node], waiting_fwd[node]
            if back and not fifo:
                ready, i, step = pop(back)
            elif fwd and held[node] < memory:
                ready, i, step = pop(fwd)
                if chains[i][step][1]:
                    held[node] += 1
            else:
                continue
            queueing += now - ready
            busy[node] = True
            push(events, (now + chains[i][step][2], seq, node, i, -1 - step))
            seq += 1
        stuck = tuple(mb for mb, end in zip(ids, finish, strict=True) if end == math.inf)
        iteration = math.inf if stuck else max(finish, default=0.0)
        finish_s = {mb: end for mb, end in zip(ids, finish, strict=True) if end != math.inf}
        return SimResult(iteration, MappingProxyType(finish_s), collisions, queueing, stuck)

    def _chain(self, mb: int, path: Sequence[int]) -> list[tuple[int, bool, float, bool]]:
        key = (mb, tuple(path))
        chain = self._chains.get(key)
        if chain is None:
            chain = self._chains[key] = _tasks(mb, path, self.view)
        return chain


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
