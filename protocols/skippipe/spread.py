"""Replica draws: no data node stays pinned to the fastest replica of a stage (NoLoCo wants the data of
every data node mixed over all replicas).

For each iteration the seed draws, for a share (`PathRules.replica_mixing`) of the pairs of a data node
and a stage with several replicas, one replica that the data node's microbatches must pass through if
they visit that stage at all. The planner grants each draw after every construction (moving the visit
that costs the least extra link and compute time) and its improvement moves never revoke one. Over the
iterations every data node reaches every replica; within one, a draw costs at most one detour.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Mapping

from protocols.errors import LocalProtocolError
from protocols.skippipe.plan import Paths
from protocols.skippipe.swarm import SwarmView

Draws = Mapping[tuple[int, int], int]  # (data node, stage) -> replica to reach


def draw_replicas(view: SwarmView, share: float, rng: random.Random) -> Draws:
    """A uniformly drawn replica for each pair of a data node and a replicated stage, kept with
    probability `share`."""
    draws = {}
    for d in view.data_nodes:
        for k in range(1, view.n_stages + 1):
            if len(view.stages[k]) > 1:
                replica = rng.choice(view.stages[k])
                if rng.random() < share:
                    draws[(d, k)] = replica
    return draws


def missed(paths: Mapping[int, tuple[int, ...]], view: SwarmView, draws: Draws) -> list[tuple[int, int]]:
    """(data node, stage) pairs that the paths visit without ever reaching the drawn replica."""
    reached: defaultdict[tuple[int, int], set[int]] = defaultdict(set)
    for path in paths.values():
        for node in path[1:-1]:
            reached[(path[0], view.stage_of[node])].add(node)
    return sorted(key for key, nodes in reached.items() if key in draws and draws[key] not in nodes)


def granted(paths: Paths, view: SwarmView, draws: Draws) -> Paths:
    """`paths` with every missed draw granted by the cheapest move of one visit to the drawn replica."""
    paths = dict(paths)
    links, fwd, work = view.link_s, view.forward_s, 1.0 + view.backward_factor
    for data, stage in missed(paths, view, draws):
        target = draws[(data, stage)]
        options = []
        for mb, path in sorted(paths.items()):
            for i in range(1, len(path) - 1):
                if path[0] == data and view.stage_of[path[i]] == stage:
                    before, here, after = path[i - 1], path[i], path[i + 1]
                    extra = sum(
                        links[a][b] + links[b][a] for a, b in ((before, target), (target, after))
                    ) - sum(links[a][b] + links[b][a] for a, b in ((before, here), (here, after)))
                    options.append((extra + work * (fwd[target] - fwd[here]), mb, i))
        _, mb, i = min(options)
        paths[mb] = (*paths[mb][:i], target, *paths[mb][i + 1 :])
    return paths


EVEN_WITHIN = 1.5  # replicas within this factor of their stage's cheapest are dealt an even share
LINK_SLACK_S = 0.25  # links this much dearer than the nearest replica's still count as alike (seconds)


def mix_replicas(
    paths: Paths,
    view: SwarmView,
    rng: random.Random,
    even_within: float = EVEN_WITHIN,
    link_slack_s: float = LINK_SLACK_S,
) -> Paths:
    """`paths` with the replicas of every replicated stage dealt out again over the microbatches that visit
    that stage: evenly over the replicas that cost alike, and evenly per data node.

    A plan is indifferent between replicas that cost alike (or prefers one by the noise in their measured
    speeds): with one data node of two microbatches it sent both through one replica of a stage, whose
    partner then never trained. The replicas that cost alike (`alike_replicas`: compute within
    `even_within` of the stage's cheapest, links within `even_within` or `link_slack_s` of its nearest)
    share the visits the plan gave them evenly; a replica that costs more (slow, or far away) keeps the
    plan's load. An even share never exceeds the largest load the plan gave, so no memory limit breaks.

    The deal is round robin: the replicas, in a random order, each take one visit in turn (while they have
    visits left), and the microbatches, grouped by data node in a random order, take the visits in that
    sequence. So a data node's microbatches through a stage reach as many different replicas as the loads
    allow, and every replica sees as many data nodes as it can. A stage node takes one update per data node
    it served in a tick (each data node's microbatches are one gradient group), so a random deal (where two
    of a replica's visits often came from one data node) cost it updates. Over the iterations every data
    node reaches every replica (NoLoCo wants the data of every data node mixed over all replicas)."""
    if not (math.isfinite(even_within) and even_within >= 1.0):
        raise LocalProtocolError(f"even_within must be a finite factor >= 1, got {even_within!r}")
    if not (math.isfinite(link_slack_s) and link_slack_s >= 0.0):
        raise LocalProtocolError(f"link_slack_s must be finite seconds >= 0, got {link_slack_s!r}")
    mixed = {mb: list(path) for mb, path in paths.items()}
    for stage in range(1, view.n_stages + 1):
        if len(view.stages[stage]) < 2:
            continue
        by_data: defaultdict[int, list[tuple[int, int]]] = defaultdict(list)
        loads = dict.fromkeys(view.stages[stage], 0)
        for mb, path in sorted(mixed.items()):
            for i in range(1, len(path) - 1):
                if view.stage_of[path[i]] == stage:
                    by_data[path[0]].append((mb, i))
                    loads[path[i]] += 1
        loads = _evened(loads, alike_replicas(view, stage, even_within, link_slack_s), rng)
        replicas = sorted(r for r, load in loads.items() if load)
        rng.shuffle(replicas)
        deal: list[int] = []
        while any(loads.values()):
            for replica in replicas:
                if loads[replica]:
                    deal.append(replica)
                    loads[replica] -= 1
        data_nodes = sorted(by_data)
        rng.shuffle(data_nodes)
        slots = []
        for data in data_nodes:
            rng.shuffle(by_data[data])
            slots += by_data[data]
        for (mb, i), replica in zip(slots, deal, strict=True):
            mixed[mb][i] = replica
    return {mb: tuple(path) for mb, path in mixed.items()}


def alike_replicas(view: SwarmView, stage: int, even_within: float, link_slack_s: float) -> list[int]:
    """The replicas of `stage` that cost alike: compute (forward and backward) within `even_within` of the
    stage's cheapest, and links (`link_cost`) within `even_within` or `link_slack_s` of its nearest.

    Compute and links are judged apart because they are measured apart: a node announces its compute by
    the CPU time of its compute thread, which a loaded machine moves little (equal replicas of two local
    swarms sharing 2 cores at most 1.33x apart), while links are timed by the wall clock (a loaded peer
    answers late). Judged together, a fresh 2x2 swarm beside another had a replica of stage 3 costed 1.54x
    its partner, by links timed 70 ms dearer; it kept the plan's uneven load, and which replica trained
    on which microbatch (with it the model) followed the timing. A link's cost enters an iteration about
    once per pass through it (the microbatches are in flight together), so the slack costs an iteration at
    most a few times itself where a replica really is that much farther."""
    replicas = view.stages[stage]
    compute = {r: view.forward_s[r] * (1.0 + view.backward_factor) for r in replicas}
    links = {r: link_cost(view, r) for r in replicas}
    cheapest, nearest = min(compute.values()), min(links.values())
    link_limit = max(nearest * even_within, nearest + link_slack_s)
    return sorted(r for r in replicas if compute[r] <= cheapest * even_within and links[r] <= link_limit)


def link_cost(view: SwarmView, node: int) -> float:
    """The mean link cost of one visit to `node`: to and from the nodes of the other stages."""
    others = [v for v in range(len(view.forward_s)) if view.stage_of[v] != view.stage_of[node]]
    return sum(view.link_s[v][node] + view.link_s[node][v] for v in others) / max(1, len(others))


def _evened(loads: dict[int, int], alike: list[int], rng: random.Random) -> dict[int, int]:
    """`loads` with the total of the `alike` replicas spread evenly over them (the remainder to replicas
    drawn at random); the others keep theirs (all of them, when none is alike: the cheapest in compute is
    far away and the nearest slow)."""
    if not alike:
        return loads
    alike = list(alike)
    total = sum(loads[r] for r in alike)
    share, extra = divmod(total, len(alike))
    rng.shuffle(alike)
    return {**loads, **{r: share + (1 if n < extra else 0) for n, r in enumerate(alike)}}
