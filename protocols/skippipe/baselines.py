"""The methods SkipPipe is measured against, and a table of every method by name."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import replace
from types import MappingProxyType

from protocols.errors import LocalProtocolError
from protocols.skippipe.greedy import greedy_paths
from protocols.skippipe.plan import Paths, Plan
from protocols.skippipe.rules import PathRules
from protocols.skippipe.scheduler import schedule
from protocols.skippipe.sequences import SequenceSpace
from protocols.skippipe.simulator import simulate
from protocols.skippipe.swarm import SwarmView

_TRIES = 8


def full_pipeline_plan(view: SwarmView, rules: PathRules) -> Plan:
    """Every microbatch visits every stage in order over a fixed pipeline per data node (DT-FM-like).

    Data nodes in order each pick one replica per stage by dynamic programming over the round-trip link
    cost plus the work already given to each replica, so pipelines stay short and spread over the
    replicas; all microbatches of a data node follow its pipeline. Skips, swaps and CheckFree+ are off.
    """
    m = rules.microbatches_per_data_node
    pipelines = _pipelines(view, rules)
    paths = {i * m + j: (d, *pipelines[d], d) for i, d in enumerate(view.data_nodes) for j in range(m)}
    return Plan.simulated(paths, view, rules.memory)


def _pipelines(view: SwarmView, rules: PathRules) -> dict[int, tuple[int, ...]]:
    """The replica of every stage, in stage order, that each data node's pipeline runs through."""
    m = rules.microbatches_per_data_node
    links, fwd = view.link_s, view.forward_s
    load = [0.0] * view.n_nodes
    pipelines = {}
    for d in view.data_nodes:
        layer: dict[int, tuple[float, tuple[int, ...]]] = {d: (0.0, ())}
        for stage in view.stages[1:]:
            nxt = {}
            for y in stage:
                x = min(layer, key=lambda x: layer[x][0] + links[x][y] + links[y][x])
                nxt[y] = (layer[x][0] + links[x][y] + links[y][x] + load[y], (*layer[x][1], y))
            layer = nxt
        _, chain = min(layer.values(), key=lambda c: c[0] + links[c[1][-1]][d] + links[d][c[1][-1]])
        for y in chain:
            load[y] += m * (1.0 + view.backward_factor) * fwd[y]
        pipelines[d] = chain
    return pipelines


def skips_without_collision_awareness(view: SwarmView, rules: PathRules, seed: int) -> Plan:
    """DT-FM with skips: each data node keeps its full pipeline's replicas (`full_pipeline_plan`) and each
    microbatch leaves out a random share of the stages (a balanced draw of stage sets, visited in stage
    order, CheckFree+ paths in their swapped order), whatever the collisions."""
    return _swaps_if_they_finish(_random_skips, view, rules, seed)


def skippipe_without_collision_avoidance(view: SwarmView, rules: PathRules, seed: int) -> Plan:
    """The same balanced sequences, each microbatch on the path that would be fastest if it were alone in
    the swarm (ties broken by the seed): SkipPipe with collision avoidance switched off."""
    return _swaps_if_they_finish(_fastest_alone, view, rules, seed)


def _swaps_if_they_finish(
    method: Callable[[SwarmView, PathRules, int], Plan], view: SwarmView, rules: PathRules, seed: int
) -> Plan:
    """`method`'s plan; if every plan it draws deadlocks, its plan without CheckFree+ swaps (with few memory
    slots, paths that run against the others' order can wait for each other forever; the scheduler drops
    them the same way)."""
    try:
        return method(view, rules, seed)
    except LocalProtocolError:
        if rules.checkfree_plus_share == 0:
            raise
        return method(view, replace(rules, checkfree_plus_share=0.0), seed)


def _random_skips(view: SwarmView, rules: PathRules, seed: int) -> Plan:
    rng = random.Random(seed)
    m = rules.microbatches_per_data_node
    space = SequenceSpace.of(view.n_stages, rules)
    pipelines = _pipelines(view, rules)

    def draw() -> Paths:
        chosen = space.balanced(len(view.data_nodes) * m, rng)
        rng.shuffle(chosen)
        paths = {}
        for i, d in enumerate(view.data_nodes):
            replica = {view.stage_of[y]: y for y in pipelines[d]}
            for mb in range(i * m, (i + 1) * m):
                kind, stages = chosen[mb]
                orders = space.by_set[kind][stages]
                order = tuple(sorted(stages)) if tuple(sorted(stages)) in orders else orders[0]
                paths[mb] = (d, *(replica[stage] for stage in order), d)
        return paths

    return _first_completing(draw, view, rules)


def _fastest_alone(view: SwarmView, rules: PathRules, seed: int) -> Plan:
    rng = random.Random(seed)
    space = SequenceSpace.of(view.n_stages, rules)
    return _first_completing(lambda: greedy_paths(view, rules, space, rng, 0.0, aware=False), view, rules)


def _first_completing(draw: Callable[[], Paths], view: SwarmView, rules: PathRules) -> Plan:
    for _ in range(_TRIES):
        paths = draw()
        result = simulate(paths, view, rules.memory)
        if not result.stuck:
            return Plan(paths, result.iteration_time_s, result.collisions)
    raise LocalProtocolError(f"every drawn plan deadlocks with {rules.memory} memory slots per node")


METHODS: Mapping[str, Callable[[SwarmView, PathRules, int], Plan]] = MappingProxyType(
    {
        "full_pipeline": lambda view, rules, seed: full_pipeline_plan(view, rules),
        "skips_without_collision_awareness": skips_without_collision_awareness,
        "skippipe_without_collision_avoidance": skippipe_without_collision_avoidance,
        "skippipe": schedule,
    }
)
"""Every method by name, each called as `method(view, rules, seed)`; `full_pipeline` ignores the seed."""
