"""SkipPipe simulator: re-timing a changed plan from snapshots equals a fresh run; the FIFO cost model."""

from __future__ import annotations

import math
import random

import pytest

from protocols.errors import LocalProtocolError
from protocols.skippipe import PathRules, SwarmView, simulate, skips_without_collision_awareness
from protocols.skippipe.simulator import SimResult, Simulator


def random_case(seed: int) -> tuple[SwarmView, PathRules, dict[int, tuple[int, ...]]]:
    rng = random.Random(seed)
    sizes = [rng.randint(1, 3) for _ in range(rng.randint(2, 5))]
    n = rng.randint(1, 3) + sum(sizes)
    ids = list(range(n))
    rng.shuffle(ids)
    stages, start = [], 0
    for size in (n - sum(sizes), *sizes):
        stages.append(ids[start : start + size])
        start += size
    place = [rng.random() for _ in ids]
    forward = [rng.choice([0.0, rng.uniform(0.05, 2.0)]) for _ in ids]  # zero durations are edge cases
    view = SwarmView.build(stages, forward, lambda a, b: rng.choice([0.0, abs(place[a] - place[b])]))
    rules = PathRules(
        microbatches_per_data_node=rng.randint(1, 5),
        skip_ratio=rng.choice([0.0, 0.34, 0.5]),
        memory=rng.randint(1, 3),
        checkfree_plus_share=rng.choice([0.0, 0.5]),
    )
    plan = skips_without_collision_awareness(view, rules, seed)
    return view, rules, dict(plan.paths)


def fields(result: SimResult) -> tuple:
    finish = dict(result.finish_s)
    return (result.iteration_time_s, finish, result.collisions, result.queueing_s, result.stuck)


def changed(paths: dict[int, tuple[int, ...]], view: SwarmView, rng: random.Random) -> dict:
    """`paths` with one microbatch moved to another replica or two of its stages swapped."""
    trial = dict(paths)
    mb = rng.choice(sorted(trial))
    path = list(trial[mb])
    if len(path) > 3 and rng.random() < 0.5:
        i, j = sorted(rng.sample(range(1, len(path) - 1), 2))
        path[i], path[j] = path[j], path[i]
    else:
        p = rng.randrange(1, len(path) - 1)
        path[p] = rng.choice(view.stages[view.stage_of[path[p]]])
    trial[mb] = tuple(path)
    return trial


@pytest.mark.parametrize("seed", range(40))
def test_a_rerun_from_snapshots_equals_a_fresh_run(seed: int) -> None:
    view, rules, paths = random_case(seed)
    rng = random.Random(seed)
    simulator = Simulator(view, rules.memory, stride=rng.choice([None, 1, 5]))
    trace = simulator.trace(paths)
    assert fields(trace.result) == fields(simulate(paths, view, rules.memory))
    for _ in range(6):
        trial = changed(paths, view, rng)
        fresh = simulate(trial, view, rules.memory)
        assert fields(simulator.rerun(trace, trial)) == fields(fresh)
        if math.isfinite(fresh.iteration_time_s):
            assert simulator.rerun(trace, trial, bound=fresh.iteration_time_s) is not None
            assert simulator.rerun(trace, trial, bound=0.999 * fresh.iteration_time_s - 1e-6) is None


def test_a_rerun_keeps_the_traced_microbatches() -> None:
    view, rules, paths = random_case(1)
    simulator = Simulator(view, rules.memory)
    trace = simulator.trace(paths)
    with pytest.raises(LocalProtocolError):
        simulator.rerun(trace, {mb: path for mb, path in paths.items() if mb != min(paths)})


def test_fifo_ignores_memory_and_serves_in_arrival_order() -> None:
    v = SwarmView.build([[0], [1]], [1.0, 1.0], lambda a, b: 0.5)
    paths = {0: (0, 1, 0), 1: (0, 1, 0)}
    alone = simulate({0: paths[0]}, v, memory=1).iteration_time_s
    assert simulate(paths, v, memory=1).iteration_time_s == pytest.approx(2 * alone)
    # mb 1 starts its embedding at 1 s; node 1 runs mb 0 1.5-2.5 and mb 1 2.5-3.5 forward, mb 0 backward
    # 3.75-5.25 and mb 1's 5.25-6.75; node 0 then runs mb 0's embedding backward 5.75-7.25 and mb 1's after
    fifo = simulate(paths, v, memory=1, fifo=True)
    assert fifo.finish_s == {0: pytest.approx(7.25), 1: pytest.approx(8.75)}
    # at node 2, mb 2's forward (arrived 1.3 s) and mb 0's backward (1.425 s) both wait for mb 1's forward
    # to end at 2.2 s: backward first ends mb 0's backward at 3.7 s, FIFO at 4.7 s (then 0.1 s hop and
    # 0.15 s embedding backward)
    w = SwarmView.build([[0, 1, 3], [2]], [0.1, 0.5, 1.0, 1.2], lambda a, b: 0.1)
    three = {0: (0, 2, 0), 1: (1, 2, 1), 2: (3, 2, 3)}
    assert simulate(three, w, memory=3).finish_s[0] == pytest.approx(3.95)
    assert simulate(three, w, memory=3, fifo=True).finish_s[0] == pytest.approx(4.95)


@pytest.mark.parametrize("seed", range(30))
def test_a_retrace_equals_a_fresh_trace(seed: int) -> None:
    """A trace continued from a kept rerun's divergence times the plan as a fresh trace does, and reruns
    from it equal fresh runs (the planner retraces each plan it keeps)."""
    view, rules, paths = random_case(seed)
    rng = random.Random(1000 + seed)
    simulator = Simulator(view, rules.memory, stride=rng.choice([None, 1, 3]))
    trace = simulator.trace(paths)
    for _ in range(4):
        trial = changed(trace.paths, view, rng)
        kept = simulator.retrace(trace, trial)
        fresh = Simulator(view, rules.memory).trace(trial)
        assert fields(kept.result) == fields(fresh.result)
        assert kept.ends == fresh.ends
        for _ in range(3):
            other = changed(trial, view, rng)
            assert fields(simulator.rerun(kept, other)) == fields(simulate(other, view, rules.memory))
        trace = kept
