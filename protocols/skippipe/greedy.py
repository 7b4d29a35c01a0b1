"""Time-aware list scheduling: one construction pass of the planner.

Microbatches are planned one at a time, in order of their release at the data nodes (a data node
launches its next microbatch when its embedding is done and it holds fewer than `memory` microbatches),
or data node after data node, the one with the slowest unloaded round trip first. Each microbatch takes,
among the stage orders still open to it that are fastest in an idle swarm (`Shortlist`), the order and
the replica per stage whose round trip ends earliest given the busy intervals already reserved on the
nodes; a forward dynamic programme over the replicas keeps this to a few interval look-ups per order.
Paths that would overflow a node's memory are avoided unless they finish much earlier. Near-ties (within
`slack`) are broken by the seeded generator.

Balanced coverage (rule 5) is kept by always holding a completion: stage sets for the microbatches still
to plan that balance the stage visits. A candidate from that completion is always acceptable; any other
is taken only if a new completion is found with it.

In large swarms a forward chain is extended to the `_WIDTH` replicas per stage that look soonest done,
and where ranking every order would take too long the completion's stage sets are the only options.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from protocols.errors import LocalProtocolError
from protocols.skippipe.plan import Paths
from protocols.skippipe.ranking import Ranking
from protocols.skippipe.rules import PathRules
from protocols.skippipe.sequences import Order, SequenceSpace
from protocols.skippipe.swarm import SwarmView
from protocols.skippipe.timeline import Timeline

Completion = list[tuple[int, frozenset[int]]]  # (kind, stage set) per microbatch still to plan
_Layer = dict[int, tuple[float, tuple[tuple[int, float], ...]]]  # replica -> forward end, (node, start)s
_FIT_MARGIN = 1.25  # a path that fits in memory is preferred unless it finishes this much later
_MAX_MISSES = 3  # candidates outside the completion tried per microbatch before keeping to it
_MAX_RANKING = 2_000_000  # replica pairs looked at to rank every order for every data node, at most
_WIDTH = 8  # replicas per stage a forward chain is extended to, at most


@dataclass
class _Candidate:
    finish: float
    kind: int
    stages: frozenset[int]
    nodes: tuple[int, ...]
    tasks: list[tuple[int, float, float]]  # node, start, end
    holds: list[tuple[int, float, float]]  # node, forward start, backward end


@dataclass(frozen=True)
class Shortlist:
    """Per data node and path kind, the allowed orders by unloaded round trip, fastest first.

    A microbatch is routed along the `size` fastest orders of each kind still open to it, plus the
    fastest order of each stage set of the current completion, instead of along every order. Where
    ranking every order would take too long (`_MAX_RANKING` steps: large swarms, many stages), nothing is
    ranked and a microbatch is routed along the first `size` stage sets of the completion only.
    """

    ranked: Mapping[tuple[int, int], tuple[Order, ...]]
    round_trip: Mapping[int, float]
    space: SequenceSpace
    size: int = 16

    @classmethod
    def of(cls, view: SwarmView, space: SequenceSpace) -> Shortlist:
        """Rank by exact unloaded round trip: links both ways plus forward and backward compute."""
        links, fwd, work = view.link_s, view.forward_s, 1.0 + view.backward_factor
        replicas = (view.n_nodes - len(view.data_nodes)) / view.n_stages
        steps = len(view.data_nodes) * sum(map(len, space.kinds)) * space.k * replicas**2
        if steps > _MAX_RANKING:
            return cls(MappingProxyType({}), MappingProxyType(_round_trip_estimates(view, space.k)), space)
        ranked, best = {}, {}
        for d in view.data_nodes:
            layers: dict[Order, dict[int, float]] = {(): {d: 0.0}}  # by stage prefix, shared by the orders
            for kind, orders in enumerate(space.kinds):
                costs = []
                for order in sorted(orders):
                    for j in range(1, len(order) + 1):
                        if order[:j] not in layers:
                            before = layers[order[: j - 1]].items()
                            layers[order[:j]] = {
                                y: min(t + links[x][y] + links[y][x] for x, t in before) + work * fwd[y]
                                for y in view.stages[order[j - 1]]
                            }
                    layer = layers[order]
                    costs.append((min(t + links[y][d] + links[d][y] for y, t in layer.items()), order))
                costs.sort()
                ranked[(d, kind)] = tuple(order for _, order in costs)
                if kind == 0:
                    best[d] = costs[0][0] + (work + view.head_factor) * fwd[d]
        return cls(MappingProxyType(ranked), MappingProxyType(best), space)

    def options(self, d: int, completion: Completion) -> list[tuple[int, Order]]:
        """(kind, order) pairs to route a microbatch of data node d along."""
        if not self.ranked:
            firsts = list(dict.fromkeys(completion))[: self.size]
            return sorted({(kind, self.space.by_set[kind][stages][0]) for kind, stages in firsts})
        chosen = []
        for kind in sorted({kind for kind, _ in completion}):
            ranked = self.ranked[(d, kind)]
            chosen += [(kind, order) for order in ranked[: self.size]]
            for stages in {s for k, s in completion if k == kind}:
                chosen.append((kind, next(order for order in ranked if frozenset(order) == stages)))
        return sorted(set(chosen))


def _round_trip_estimates(view: SwarmView, k: int) -> dict[int, float]:
    """Per data node, k times its mean over the stages of the cheapest round trip to a replica and back,
    plus its own compute: a cheap stand-in for the fastest unloaded round trip."""
    links, fwd, work = view.link_s, view.forward_s, 1.0 + view.backward_factor
    out = {}
    for d in view.data_nodes:
        hops = [
            min(links[d][y] + links[y][d] + work * fwd[y] for y in view.stages[stage])
            for stage in range(1, view.n_stages + 1)
        ]
        out[d] = k * sum(hops) / len(hops) + (work + view.head_factor) * fwd[d]
    return out


def greedy_paths(
    view: SwarmView,
    rules: PathRules,
    space: SequenceSpace,
    rng: random.Random,
    slack: float,
    *,
    aware: bool,
    critical_first: bool = False,
    shortlist: Shortlist | None = None,
) -> Paths:
    """One construction pass. With `aware` False every node looks idle when timing a path (no collision
    avoidance) and, as in the reference planner without its collision constraint, no replica takes more
    than an even share of its stage's visits; memory is still minded, each path's holds timed as if it
    were alone."""
    shortlist = shortlist or Shortlist.of(view, space)
    planner = _Planner(view, rules, space, rng, slack, aware, shortlist)
    m = rules.microbatches_per_data_node
    data_nodes = view.data_nodes
    rank = [0.0] * len(data_nodes)
    if critical_first:
        rank = [-shortlist.round_trip[d] * (1.0 + 0.2 * rng.random()) for d in data_nodes]
    finishes: list[list[float]] = [[] for _ in data_nodes]
    pending = [(0.0, i) for i in range(len(data_nodes))]
    paths: Paths = {}
    while pending:
        pending.sort(
            key=(lambda p: (rank[p[1]], p[0])) if critical_first else (lambda p: (p[0], rank[p[1]], p[1]))
        )
        release, i = pending.pop(0)
        d = data_nodes[i]
        chosen = planner.plan(d, release)
        paths[i * m + len(finishes[i])] = (d, *chosen.nodes, d)
        finishes[i].append(chosen.finish)
        if len(finishes[i]) < m:
            ends = sorted(finishes[i])
            slot_free = ends[len(ends) - rules.memory] if len(ends) >= rules.memory else 0.0
            pending.append((max(chosen.tasks[0][2], slot_free), i))
    return paths


class _Planner:
    """Reservation tables, stage visit counts and the balanced completion, updated per microbatch."""

    def __init__(
        self,
        view: SwarmView,
        rules: PathRules,
        space: SequenceSpace,
        rng: random.Random,
        slack: float,
        aware: bool,
        shortlist: Shortlist,
    ) -> None:
        self.view = view
        self.shortlist = shortlist
        self.memory = rules.memory
        self.space = space
        self.rng = rng
        self.slack = slack
        self.aware = aware
        self.n_mb = len(view.data_nodes) * rules.microbatches_per_data_node
        self.completion: Completion = space.balanced(self.n_mb, rng)
        self.counts = [0] * (view.n_stages + 1)
        self.timelines = [Timeline() for _ in range(view.n_nodes)]
        self.idle = Timeline()
        self.look = self.timelines if aware else [self.idle] * view.n_nodes  # what a path is timed against
        self._load = list(view.forward_s)  # per node, forward time x (1 + microbatches held), as looked at
        self.visits = [0] * view.n_nodes
        share = math.ceil(self.n_mb * space.k / view.n_stages)  # visits per stage, at most
        self.caps = (
            None
            if aware
            else [math.ceil(share / len(view.stages[view.stage_of[v]])) for v in range(view.n_nodes)]
        )

    def plan(self, d: int, release: float) -> _Candidate:
        """Choose and reserve the path of data node d's microbatch released at `release`."""
        layers: dict[Order, _Layer] = {}  # forward chains by stage prefix, shared by the orders routed
        stubs = [
            (kind, order, last, t, chain)
            for kind, order in self.shortlist.options(d, self.completion)
            for last, (t, chain) in self._forward(d, release, order, layers).items()
        ]
        ranking = Ranking(
            [self._bound(d, *stub[2:]) for stub in stubs],
            lambda i: self._route(d, *stubs[i]),
            self._fits,
            _FIT_MARGIN,
            self.slack,
        )
        chosen = self._choose(ranking)
        for stage in chosen.stages:
            self.counts[stage] += 1
        for node in chosen.nodes:
            self.visits[node] += 1
        for node, start, end in chosen.tasks:
            self.timelines[node].reserve(start, end)
        for node, start, end in chosen.holds:
            self.timelines[node].holds.append((start, end))
            self._load[node] = self.view.forward_s[node] * (1 + len(self.look[node].holds))
        return chosen

    def _forward(self, d: int, release: float, prefix: Order, layers: dict[Order, _Layer]) -> _Layer:
        """Per replica of the prefix's last stage, the earliest-ending forward chain along `prefix`."""
        layer = layers.get(prefix)
        if layer is not None:
            return layer
        fwd, links, memory = self.view.forward_s, self.view.link_s, self.memory
        if not prefix:
            start = self.look[d].earliest_start(release, fwd[d])
            layer = {d: (start + fwd[d], ((d, start),))}
        else:
            before = list(self._forward(d, release, prefix[:-1], layers).items())
            replicas = self.view.stages[prefix[-1]]
            if self.caps is not None:
                replicas = [y for y in replicas if self.visits[y] < self.caps[y]]
            layer = {}
            if not before or not replicas:
                layers[prefix] = layer
                return layer
            rows = [[t + links[v][y] for y in replicas] for v, (t, _) in before]  # arrival from each source
            arrivals = rows[0] if len(rows) == 1 else list(map(min, *rows))
            if len(replicas) > _WIDTH:  # keep the replicas that look soonest done, counting their load
                load = self._load
                keys = [a + load[y] for a, y in zip(arrivals, replicas, strict=True)]
                kept = [
                    (j, y)
                    for _, y, j in sorted(zip(keys, replicas, range(len(replicas)), strict=True))[:_WIDTH]
                ]
            else:
                kept = list(enumerate(replicas))
            for j, y in kept:
                arrive = arrivals[j]
                source = 0 if len(rows) == 1 else next(r for r, row in enumerate(rows) if row[j] == arrive)
                timeline = self.look[y]
                begin = timeline.earliest_start(timeline.slot_free(arrive, memory), fwd[y])
                layer[y] = (begin + fwd[y], (*before[source][1][1], (y, begin)))
        layers[prefix] = layer
        return layer

    def _bound(self, d: int, last: int, t: float, forward: tuple[tuple[int, float], ...]) -> float:
        """A lower bound on the finish of the round trip after this forward chain: its head and backward
        passes timed as if no node were busy (as `_route` times them, with every wait left out)."""
        view = self.view
        fwd, links, back = view.forward_s, view.link_s, view.backward_factor
        t = t + links[last][d] + view.head_factor * fwd[d]
        here = d
        for y, _ in reversed(forward[1:]):
            t = t + links[here][y] + back * fwd[y]
            here = y
        return t + links[here][d] + back * fwd[d]

    def _route(
        self, d: int, kind: int, order: Order, last: int, t: float, forward: tuple[tuple[int, float], ...]
    ) -> tuple[_Candidate, float]:
        """The round trip after a forward chain ending at replica `last` at `t`, and its finish."""
        view = self.view
        fwd, links = view.forward_s, view.link_s
        (_, start), *chain = forward
        tasks = [(d, start, start + fwd[d])] + [(y, s, s + fwd[y]) for y, s in chain]
        head = view.head_factor * fwd[d]
        begin = self.look[d].earliest_start(t + links[last][d], head)
        t, here = begin + head, d
        tasks.append((d, begin, t))
        holds = []
        for y, forward_start in reversed(chain):
            duration = view.backward_factor * fwd[y]
            begin = self.look[y].earliest_start(t + links[here][y], duration)
            t, here = begin + duration, y
            tasks.append((y, begin, t))
            holds.append((y, forward_start, t))
        duration = view.backward_factor * fwd[d]
        begin = self.look[d].earliest_start(t + links[here][d], duration)
        tasks.append((d, begin, begin + duration))
        nodes = tuple(y for y, _ in chain)
        return _Candidate(begin + duration, kind, frozenset(order), nodes, tasks, holds), begin + duration

    def _fits(self, c: _Candidate) -> bool:
        return all(self.timelines[y].holders(a, b) < self.memory for y, a, b in c.holds)

    def _choose(self, ranking: Ranking[_Candidate]) -> _Candidate:
        """The earliest finisher (a random one within `slack`), preferring paths that fit in memory, whose
        stage set keeps a balanced completion; one from the current completion always qualifies."""
        misses = 0
        while near := ranking.near():
            entry = near[self.rng.randrange(len(near))]
            pick = ranking.candidate(entry)
            if (pick.kind, pick.stages) in self.completion:
                self.completion.remove((pick.kind, pick.stages))
                return pick
            if misses < _MAX_MISSES and self._rebalanced(pick):
                return pick
            misses += 1
            ranking.remove(entry)
        raise LocalProtocolError("no path keeps stage coverage balanced")  # unreachable: see module docstring

    def _rebalanced(self, pick: _Candidate) -> bool:
        """Whether a new balanced completion exists with `pick`'s stage set (then it replaces the old)."""
        kinds = [kind for kind, _ in self.completion]
        kinds.remove(pick.kind)
        counts = list(self.counts)
        for stage in pick.stages:
            counts[stage] += 1
        sets = self.space.fill(kinds, counts, self.n_mb, self.rng)
        if sets is None:
            return False
        self.completion = list(zip(kinds, sets, strict=True))
        return True
