"""SkipPipe scheduler and baselines: valid on random swarms, deterministic, CheckFree+, spread, speed-up."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocols.errors import LocalProtocolError
from protocols.skippipe import (
    METHODS,
    PathRules,
    SwarmView,
    full_pipeline_plan,
    is_checkfree_plus,
    mix_replicas,
    scenario_from_dict,
    schedule,
    skippipe_without_collision_avoidance,
    skips_without_collision_awareness,
    validate_plan,
)
from protocols.skippipe import scheduler as scheduler_module

SCENARIO = Path(__file__).parents[2] / "benchmarks" / "data" / "gcp12_links.json"
QUICK = {"restarts": 2, "rounds": 30}


def random_view(rng: random.Random, data_nodes: int, sizes: list[int]) -> SwarmView:
    ids = list(range(data_nodes + sum(sizes)))
    rng.shuffle(ids)
    stages, start = [], 0
    for size in (data_nodes, *sizes):
        stages.append(ids[start : start + size])
        start += size
    place = [(rng.random(), rng.random()) for _ in ids]
    forward = [rng.uniform(0.05, 2.0) for _ in ids]
    return SwarmView.build(
        stages, forward, lambda a, b: 0.05 + 2 * abs(place[a][0] - place[b][0]) + place[b][1]
    )


@st.composite
def swarms(draw: st.DrawFn) -> tuple[SwarmView, PathRules, int]:
    seed = draw(st.integers(0, 2**16))
    sizes = draw(st.lists(st.integers(1, 3), min_size=2, max_size=6))
    view = random_view(random.Random(seed), draw(st.integers(1, 2)), sizes)
    rules = PathRules(
        microbatches_per_data_node=draw(st.integers(1, 6)),
        skip_ratio=draw(st.sampled_from([0.0, 0.2, 0.34, 0.5])),
        memory=draw(st.integers(1, 3)),
        checkfree_plus_share=draw(st.sampled_from([0.0, 0.5])),
    )
    return view, rules, seed


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(swarms())
def test_plans_on_random_swarms_pass_the_validator(case: tuple[SwarmView, PathRules, int]) -> None:
    view, rules, seed = case
    plan = schedule(view, rules, seed, **QUICK)
    assert validate_plan(plan, view, rules) == []
    assert len(plan.paths) == len(view.data_nodes) * rules.microbatches_per_data_node
    assert validate_plan(skips_without_collision_awareness(view, rules, seed), view, rules) == []
    full_rules = dataclasses.replace(rules, skip_ratio=0.0, checkfree_plus_share=0.0)
    assert validate_plan(full_pipeline_plan(view, rules), view, full_rules) == []


def test_checkfree_plus_swaps_give_way_when_one_memory_slot_would_deadlock_them() -> None:
    """Two data nodes, one microbatch each, every node one memory slot: a swapped path and a plain one hold
    stages 1 and 2 in opposite orders and wait for each other forever, so the plan drops the swap."""
    link = (
        (0.0, 1.1258333633496744, 0.6153889057242841, 1.6070434635194708),
        (0.8533094956835103, 0.0, 0.7298397768953295, 1.315008689204569),
        (0.6500666729405367, 1.0370414117777462, 0.0, 1.5182515119475428),
        (1.2102052996927442, 1.1906943930440064, 1.0867355809045633, 0.0),
    )
    forward = [1.0341393688439109, 0.5995837965794225, 1.5238181981065866, 1.2558195435168966]
    view = SwarmView.build([[2, 0], [1], [3]], forward, lambda a, b: link[a][b])
    rules = PathRules(microbatches_per_data_node=1, memory=1, checkfree_plus_share=0.5)
    plan = schedule(view, rules, 0, **QUICK)
    assert validate_plan(plan, view, rules) == []  # rule 6: it finishes
    for baseline in (skips_without_collision_awareness, skippipe_without_collision_avoidance):
        assert validate_plan(baseline(view, rules, 0), view, rules) == [], baseline.__name__


def small_swarm() -> tuple[SwarmView, PathRules]:
    view = random_view(random.Random(7), 2, [3, 2, 3, 2])
    return view, PathRules(microbatches_per_data_node=4, skip_ratio=0.5, memory=2)


def test_deterministic_for_a_seed() -> None:
    view, rules = small_swarm()
    assert schedule(view, rules, 3, **QUICK) == schedule(view, rules, 3, **QUICK)
    assert len({tuple(schedule(view, rules, seed, **QUICK).paths.items()) for seed in range(4)}) > 1


@pytest.mark.parametrize(("mixing", "iterations"), [(1.0, 6), (PathRules(1).replica_mixing, 20)])
def test_data_nodes_reach_several_replicas_over_iterations(mixing: float, iterations: int) -> None:
    view, rules = small_swarm()
    rules = dataclasses.replace(rules, skip_ratio=0.25, replica_mixing=mixing)  # 3 of 4 stages per path
    reached: dict[tuple[int, int], set[int]] = {}
    for seed in range(iterations):
        for path in schedule(view, rules, seed, **QUICK).paths.values():
            for node in path[1:-1]:
                reached.setdefault((path[0], view.stage_of[node]), set()).add(node)
    assert len(reached) == 2 * 4
    for (data, stage), nodes in reached.items():
        assert len(nodes) > 1, f"data node {data} always used the same replica of stage {stage}"


def stage_orders(view: SwarmView, plan_paths: dict[int, tuple[int, ...]]) -> list[tuple[int, ...]]:
    return [tuple(view.stage_of[v] for v in path[1:-1]) for path in plan_paths.values()]


def test_checkfree_plus_swaps_both_edge_pairs_for_its_share() -> None:
    view = random_view(random.Random(1), 2, [2, 1, 2, 1, 2])
    rules = PathRules(microbatches_per_data_node=6, checkfree_plus_share=0.5)
    plan = schedule(view, rules, 0, **QUICK)
    assert validate_plan(plan, view, rules) == []
    orders = stage_orders(view, dict(plan.paths))
    assert orders.count((2, 1, 3, 5, 4)) == 6
    assert sum(is_checkfree_plus(order, 5) for order in orders) == 6


def test_checkfree_plus_with_skips_keeps_coverage_balanced() -> None:
    view = random_view(random.Random(2), 2, [2, 2, 2, 2, 2, 2])
    rules = PathRules(microbatches_per_data_node=6, skip_ratio=0.34, checkfree_plus_share=0.5)  # 4 of 6
    plan = schedule(view, rules, 0, **QUICK)
    assert validate_plan(plan, view, rules) == []
    swapped = [order for order in stage_orders(view, dict(plan.paths)) if is_checkfree_plus(order, 6)]
    assert 0 < len(swapped) <= 4  # (2, 1, 6, 5) leaves stages 3 and 4 to the others: at most 4 of 12
    assert all(order == (2, 1, 6, 5) for order in swapped)


def test_checkfree_plus_on_three_stages_alternates_front_and_back_swaps() -> None:
    view = random_view(random.Random(3), 1, [1, 1, 1])
    rules = PathRules(microbatches_per_data_node=4, checkfree_plus_share=0.5)
    plan = schedule(view, rules, 0, **QUICK)
    assert validate_plan(plan, view, rules) == []
    assert sorted(stage_orders(view, dict(plan.paths))) == [(1, 2, 3), (1, 2, 3), (1, 3, 2), (2, 1, 3)]


def test_single_replica_stages_without_skips() -> None:
    view = random_view(random.Random(4), 2, [1, 1, 1, 1])
    rules = PathRules(microbatches_per_data_node=3, memory=1, checkfree_plus_share=0.5)
    plan = schedule(view, rules, 5, **QUICK)
    assert validate_plan(plan, view, rules) == []
    assert all(sorted(order) == [1, 2, 3, 4] for order in stage_orders(view, dict(plan.paths)))


def test_full_pipeline_gives_each_data_node_one_ordered_pipeline() -> None:
    view, rules = small_swarm()
    plan = full_pipeline_plan(view, rules)
    for data, group in itertools.groupby(sorted(plan.paths.values()), key=lambda path: path[0]):
        assert len(set(group)) == 1, f"data node {data} uses more than one pipeline"
    assert set(stage_orders(view, dict(plan.paths))) == {(1, 2, 3, 4)}


def test_reference_scenario_beats_the_full_pipeline() -> None:
    scenario = scenario_from_dict(json.loads(SCENARIO.read_text()))
    view, rules = scenario.view, scenario.rules
    plan = schedule(view, rules, 0, **QUICK)
    assert validate_plan(plan, view, rules) == []
    assert plan.iteration_time_s < 0.5 * full_pipeline_plan(view, rules).iteration_time_s
    assert plan.iteration_time_s < skips_without_collision_awareness(view, rules, 0).iteration_time_s


def test_a_clock_budget_cuts_the_search_short() -> None:
    view, rules = small_swarm()
    ticks = itertools.count()
    plan = schedule(view, rules, 0, restarts=50, rounds=10_000, clock=lambda: float(next(ticks)), budget_s=3)
    assert validate_plan(plan, view, rules) == []
    assert next(ticks) < 10


def test_methods_by_name() -> None:
    view, rules = small_swarm()
    assert list(METHODS) == [
        "full_pipeline",
        "skips_without_collision_awareness",
        "skippipe_without_collision_avoidance",
        "skippipe",
    ]
    plans = {name: method(view, rules, 0) for name, method in METHODS.items()}
    assert (
        plans["skippipe"].iteration_time_s <= plans["skippipe_without_collision_avoidance"].iteration_time_s
    )


@pytest.mark.parametrize(
    ("rules", "kwargs"),
    [
        (PathRules(microbatches_per_data_node=1, skip_ratio=0.8), {}),  # 1 of 5 stages: stage 5 unreachable
        (PathRules(microbatches_per_data_node=1), {"restarts": 0}),
    ],
)
def test_impossible_requests_raise(rules: PathRules, kwargs: dict) -> None:
    view = random_view(random.Random(5), 1, [1, 1, 1, 1, 1])
    with pytest.raises(LocalProtocolError):
        schedule(view, rules, 0, **kwargs)


def test_mixing_replicas_keeps_every_load_and_spreads_each_data_node_over_the_replicas() -> None:
    # two data nodes of two microbatches, two replicas per stage: a lane per data node is collision-free
    view = SwarmView.build([[0, 1], [2, 3], [4, 5]], [0.1] * 6, lambda a, b: 0.01)
    lanes = {0: (0, 2, 4, 0), 1: (0, 2, 4, 0), 2: (1, 3, 5, 1), 3: (1, 3, 5, 1)}
    seen: set[tuple[int, int]] = set()  # (data node, replica of stage 1) pairs over iterations
    for seed in range(8):
        mixed = mix_replicas(lanes, view, random.Random(seed))
        assert sorted(node for path in mixed.values() for node in path[1:-1]) == [2, 2, 3, 3, 4, 4, 5, 5]
        assert all(path[0] == lanes[mb][0] and path[-1] == lanes[mb][-1] for mb, path in mixed.items())
        assert all(view.stage_of[path[1]] == 1 and view.stage_of[path[2]] == 2 for path in mixed.values())
        seen |= {(path[0], path[1]) for path in mixed.values()}
        for data in (0, 1):  # each data node's two microbatches reach both replicas of every stage
            for hop in (1, 2):
                assert len({path[hop] for path in mixed.values() if path[0] == data}) == 2
    assert seen == {(0, 2), (0, 3), (1, 2), (1, 3)}  # every data node reached every replica
    assert mix_replicas(lanes, view, random.Random(3)) == mix_replicas(lanes, view, random.Random(3))


def test_dtfm_with_skips_keeps_each_data_nodes_pipeline_in_stage_order() -> None:
    view, rules = small_swarm()
    rules = dataclasses.replace(rules, skip_ratio=0.25)  # 3 of 4 stages per path
    pipelines = {path[0]: set(path[1:-1]) for path in full_pipeline_plan(view, rules).paths.values()}
    plan = skips_without_collision_awareness(view, rules, 0)
    assert validate_plan(plan, view, rules) == []
    for path in plan.paths.values():
        assert set(path[1:-1]) <= pipelines[path[0]]
        stages = [view.stage_of[node] for node in path[1:-1]]
        assert stages == sorted(stages)
    assert len(set(stage_orders(view, dict(plan.paths)))) > 1  # microbatches skip different stages


def test_without_collision_avoidance_no_replica_takes_more_than_its_share() -> None:
    view = random_view(random.Random(6), 3, [4, 2, 3, 4])
    rules = PathRules(microbatches_per_data_node=6, skip_ratio=0.25)  # 3 of 4 stages, 54 visits
    plan = skippipe_without_collision_avoidance(view, rules, 0)
    assert validate_plan(plan, view, rules) == []
    visits = collections.Counter(node for path in plan.paths.values() for node in path[1:-1])
    for stage in view.stages[1:]:
        share = math.ceil(math.ceil(18 * 3 / 4) / len(stage))  # ceil(stage visits / replicas)
        assert all(visits[node] <= share for node in stage), (stage, visits)


def test_a_large_swarm_of_sixteen_stages_gets_a_valid_plan() -> None:
    """16 stages of 10 replicas, 12 stages per path: 60,276 allowed orders and a replica choice too large
    to search whole; the planner keeps to edge swaps, samples the balance fill and prunes replicas."""
    view = random_view(random.Random(8), 3, [10] * 16)
    rules = PathRules(microbatches_per_data_node=4, skip_ratio=0.25, checkfree_plus_share=0.5)
    plan = schedule(view, rules, 0, **QUICK)
    assert validate_plan(plan, view, rules) == []
    assert plan.iteration_time_s < full_pipeline_plan(view, rules).iteration_time_s
    assert any(is_checkfree_plus(order, 16) for order in stage_orders(view, dict(plan.paths)))


def test_mixing_replicas_evens_the_loads_of_replicas_that_cost_alike() -> None:
    # three data nodes of two microbatches; the plan sent 3, 2 and 1 visits to three equal replicas
    view = SwarmView.build([[0, 1, 2], [3, 4, 5]], [0.1] * 6, lambda a, b: 0.01)
    lanes = {0: (0, 3, 0), 1: (0, 3, 0), 2: (1, 3, 1), 3: (1, 4, 1), 4: (2, 4, 2), 5: (2, 5, 2)}
    for seed in range(20):
        mixed = mix_replicas(lanes, view, random.Random(seed))
        assert sorted(path[1] for path in mixed.values()) == [3, 3, 4, 4, 5, 5]
        for data in (0, 1, 2):  # each data node's pair reaches two replicas
            assert len({path[1] for path in mixed.values() if path[0] == data}) == 2


def test_mixing_replicas_keeps_the_load_of_a_replica_that_costs_more() -> None:
    # one data node of four microbatches; replica 3 is three times slower and got one visit of four
    view = SwarmView.build([[0], [1, 2, 3]], [0.1, 0.1, 0.1, 0.3], lambda a, b: 0.01)
    lanes = {0: (0, 1, 0), 1: (0, 1, 0), 2: (0, 1, 0), 3: (0, 3, 0)}
    for seed in range(10):
        mixed = mix_replicas(lanes, view, random.Random(seed))
        assert sorted(path[1] for path in mixed.values()) in ([1, 1, 2, 3], [1, 2, 2, 3])
    with pytest.raises(LocalProtocolError):
        mix_replicas(lanes, view, random.Random(0), even_within=0.5)


def test_mixing_replicas_evens_links_timed_apart_by_load_but_not_a_far_replica() -> None:
    # a fresh 2x2 swarm on a loaded machine: equal compute (50 ms, not yet measured), and stage 2's replica
    # 5 timed 90 ms a visit dearer on its links than replica 4 (1.67x its whole hop cost; 1.54x was
    # measured): past 1.5x judged together, the plan's uneven load stayed and the deal followed the timing
    stages = [[0, 1], [2, 3], [4, 5]]
    for extra, even in ((0.045, True), (0.25, False)):  # each way: 90 ms, 500 ms a visit
        view = SwarmView.build(stages, [0.05] * 6, lambda a, b, x=extra: 0.005 + (x if 5 in (a, b) else 0.0))
        lanes = {0: (0, 2, 4, 0), 1: (0, 3, 4, 0), 2: (1, 2, 4, 1), 3: (1, 3, 5, 1)}
        for seed in range(6):
            stage_two = sorted(path[2] for path in mix_replicas(lanes, view, random.Random(seed)).values())
            assert stage_two == ([4, 4, 5, 5] if even else [4, 4, 4, 5])
        with_no_slack = mix_replicas(lanes, view, random.Random(0), link_slack_s=0.0)
        assert sorted(path[2] for path in with_no_slack.values()) == [4, 4, 4, 5]
    # a replica slow in compute keeps its load however near it is; one far and one slow: none alike
    slow = SwarmView.build([[0], [1, 2]], [0.05, 0.05, 0.2], lambda a, b: 0.005)
    lanes = {0: (0, 1, 0), 1: (0, 1, 0), 2: (0, 1, 0), 3: (0, 2, 0)}
    assert sorted(p[1] for p in mix_replicas(lanes, slow, random.Random(0)).values()) == [1, 1, 1, 2]

    def far_one(a: int, b: int) -> float:  # node 1 computes fastest but is far; node 2 is near but slow
        return 0.005 + (0.5 if 1 in (a, b) else 0.0)

    apart = SwarmView.build([[0], [1, 2]], [0.05, 0.01, 0.2], far_one)
    assert sorted(p[1] for p in mix_replicas(lanes, apart, random.Random(0)).values()) == [1, 1, 1, 2]
    with pytest.raises(LocalProtocolError):
        mix_replicas(lanes, slow, random.Random(0), link_slack_s=-1.0)


def test_planning_from_the_previous_plan_skips_the_constructions(monkeypatch: pytest.MonkeyPatch) -> None:
    view, rules = small_swarm()
    first = schedule(view, rules, 0, **QUICK)
    built: list[int] = []
    original = scheduler_module.greedy_paths

    def counted(*args: Any, **kwargs: Any) -> dict[int, tuple[int, ...]]:
        built.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(scheduler_module, "greedy_paths", counted)
    second = schedule(view, rules, 1, previous=first.paths, **QUICK)
    assert built == []
    assert validate_plan(second, view, rules) == []
    assert schedule(view, rules, 1, previous=first.paths, **QUICK) == second  # deterministic
    # a previous plan that does not fit the view (a node gone) is ignored: the planner constructs
    stale = {mb: (*path[:-2], view.n_nodes, path[-1]) for mb, path in first.paths.items()}
    assert validate_plan(schedule(view, rules, 1, previous=stale, **QUICK), view, rules) == []
    assert built == [1] * QUICK["restarts"]
