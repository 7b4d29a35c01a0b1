"""Replica draws: no data node stays pinned to the fastest replica of a stage (NoLoCo wants the data of
every data node mixed over all replicas).

For each iteration the seed draws, for a share (`PathRules.replica_mixing`) of the pairs of a data node
and a stage with several replicas, one replica that the data node's microbatches must pass through if
they visit that stage at all. The planner grants each draw after every construction (moving the visit
that costs the least extra link and compute time) and its improvement moves never revoke one. Over the
iterations every data node reaches every replica; within one, a draw costs at most one detour.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Mapping

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


def mix_replicas(paths: Paths, view: SwarmView, rng: random.Random) -> Paths:
    """`paths` with the replicas of every replicated stage dealt out again at random over the microbatches
    that visit that stage. Every replica keeps its number of visits (the plan's load and its memory use),
    but which microbatch, and so which data node, visits which replica is drawn anew each iteration: a
    collision-aware plan tends to give each data node a lane of its own through the replicas, and replicas
    that only ever see one data node's batches are separate models averaged now and then (NoLoCo wants the
    data of every data node mixed over all replicas)."""
    mixed = {mb: list(path) for mb, path in paths.items()}
    for stage in range(1, view.n_stages + 1):
        if len(view.stages[stage]) < 2:
            continue
        slots = [
            (mb, i)
            for mb, path in sorted(mixed.items())
            for i in range(1, len(path) - 1)
            if view.stage_of[path[i]] == stage
        ]
        nodes = [mixed[mb][i] for mb, i in slots]
        rng.shuffle(nodes)
        for (mb, i), node in zip(slots, nodes, strict=True):
            mixed[mb][i] = node
    return {mb: tuple(path) for mb, path in mixed.items()}
