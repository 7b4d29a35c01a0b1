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
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from protocols.errors import LocalProtocolError
from protocols.skippipe.swarm import SwarmView

_ARRIVE, _FINISH, _DISPATCH = 0, 0, 1  # event priorities at equal times: arrivals/finishes, then dispatch


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


@dataclass
class _Node:
    held: int = 0
    busy: bool = False
    dispatch_pending: bool = False


def simulate(paths: Mapping[int, Sequence[int]], view: SwarmView, memory: int) -> SimResult:
    """Run every microbatch along its path; see the module docstring for the model."""
    if memory < 1:
        raise LocalProtocolError(f"memory must be at least 1 microbatch, got {memory}")
    tasks = {mb: _tasks(mb, path, view) for mb, path in paths.items()}
    nodes = [_Node() for _ in range(view.n_nodes)]
    waiting_back: list[list[tuple[float, int, int]]] = [[] for _ in nodes]
    waiting_fwd: list[list[tuple[float, int, int]]] = [[] for _ in nodes]
    events: list[tuple[float, int, int, int, int, int]] = []  # time, priority, seq, node, mb, step
    seq = 0
    for mb in sorted(tasks):
        heapq.heappush(events, (0.0, _ARRIVE, seq, tasks[mb][0][0], mb, 0))
        seq += 1
    finish: dict[int, float] = {}
    collisions = 0
    queueing = 0.0
    links = view.link_s
    while events:
        now, priority, _, node_id, mb, step = heapq.heappop(events)
        node = nodes[node_id]
        if priority == _DISPATCH:
            node.dispatch_pending = False
            if node.busy:
                continue
            if waiting_back[node_id]:
                ready, mb, step = heapq.heappop(waiting_back[node_id])
            elif waiting_fwd[node_id] and node.held < memory:
                ready, mb, step = heapq.heappop(waiting_fwd[node_id])
                node.held += 1
            else:
                continue
            queueing += now - ready
            node.busy = True
            heapq.heappush(events, (now + tasks[mb][step][2], _FINISH, seq, node_id, mb, -1 - step))
            seq += 1
        elif step >= 0:  # a task arrives
            if node.busy or waiting_back[node_id] or waiting_fwd[node_id]:
                collisions += 1
            queue = waiting_fwd[node_id] if tasks[mb][step][1] else waiting_back[node_id]
            heapq.heappush(queue, (now, mb, step))
            seq = _request_dispatch(events, nodes, node_id, now, seq)
        else:  # a task finishes
            step = -1 - step
            node.busy = False
            chain = tasks[mb]
            if chain[step][3]:  # a backward pass frees its memory slot
                node.held -= 1
            if step + 1 == len(chain):
                finish[mb] = now
            else:
                nxt = chain[step + 1][0]
                heapq.heappush(events, (now + links[node_id][nxt], _ARRIVE, seq, nxt, mb, step + 1))
                seq += 1
            seq = _request_dispatch(events, nodes, node_id, now, seq)
    stuck = tuple(sorted(set(tasks) - set(finish)))
    iteration = math.inf if stuck else max(finish.values(), default=0.0)
    return SimResult(iteration, MappingProxyType(finish), collisions, queueing, stuck)


def _request_dispatch(events: list, nodes: list[_Node], node_id: int, now: float, seq: int) -> int:
    node = nodes[node_id]
    if not node.busy and not node.dispatch_pending:
        node.dispatch_pending = True
        heapq.heappush(events, (now, _DISPATCH, seq, node_id, -1, 0))
        return seq + 1
    return seq


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
