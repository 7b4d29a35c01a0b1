"""The simulator's event loop in Python: one iteration's tasks played from a state to the end, or until the
iteration is sure to end after a bound (the model: `simulator`'s docstring).

`_ceventloop` is the same loop in C, built at install where a C compiler is found; `simulator` uses it when
it is there. Both give the same results to the last bit (`tests/protocols/test_skippipe_eventloop.py`): every
data node must plan the same paths, compiled or not.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

Chain = list[tuple[int, bool, float, bool]]  # (node, is_forward, seconds, releases_memory) per task


class State:
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

    def copy(self) -> State:
        other = object.__new__(State)
        other.busy, other.held, other.until = self.busy[:], self.held[:], self.until[:]
        other.back = [q[:] for q in self.back]
        other.fwd = other.back if self.fwd is self.back else [q[:] for q in self.fwd]
        other.events, other.seq = self.events[:], self.seq
        other.ends = [e[:] for e in self.ends]
        other.collisions, other.queueing, other.now = self.collisions, self.queueing, self.now
        return other


def play(
    state: State,
    chains: list[Chain],
    links: Sequence[Sequence[float]],
    memory: int,
    bound: float,
    snapshots: list[State] | None,
    stride: int,
    rests: list[list[float]] | None,
) -> bool:
    """Run the event loop from `state` to the end (True), or stop (False) once the iteration is sure to
    end after `bound`: an event falls after it, or a task arrives at a node busy too long or starts too
    late for the rest of its chain (`rests`) to end by then. A node holds at most `memory` microbatches;
    `links[a][b]` is the hop from node a to b. With `snapshots`, append a copy of the state at an
    instant's start every `stride` events.

    A node to serve goes to `dispatch` while other events are due at the same instant (all of an
    instant's arrivals compete); one with nothing else due is served at once."""
    limit = bound + 1e-9 * max(1.0, abs(bound))  # the rests are sums in another order: keep a margin
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
