"""The simulator's event loop in C (`_ceventloop`) against the one in Python (`_eventloop`): the same
results to the last bit, the same plans, and malformed input refused without a crash.

Every data node plans every iteration and all must plan alike, whether their install compiled the loop or
not; so equal here means `==` on floats, never approximately.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from test_skippipe_rerun import changed, random_case

from protocols.skippipe import PathRules, SwarmView, _eventloop, scenario_from_dict, schedule, simulator
from protocols.skippipe.simulator import SimResult, Simulator

REFERENCE = Path(__file__).parents[2] / "benchmarks" / "data" / "gcp12_links.json"


def compiled() -> ModuleType | None:
    try:
        from protocols.skippipe import _ceventloop
    except ImportError:
        return None
    return _ceventloop


@pytest.fixture
def loops() -> Iterator[dict[str, ModuleType]]:
    """Both loops, by name; the simulator runs the one `use` names."""
    c = compiled()
    if c is None:
        pytest.skip("the C event loop is not built here (no C compiler at install)")
    yield {"python": _eventloop, "c": c}


def use(monkeypatch: pytest.MonkeyPatch, loop: ModuleType) -> None:
    monkeypatch.setattr(simulator, "_loop", loop)


def fields(result: SimResult | None) -> tuple | None:
    if result is None:
        return None
    finish = dict(result.finish_s)
    return (result.iteration_time_s, finish, result.collisions, result.queueing_s, result.stuck)


def test_the_c_loop_is_built_where_a_c_compiler_is() -> None:
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if sys.platform == "win32" or not (shutil.which("cc") or shutil.which("gcc")) or not headers.exists():
        pytest.skip("no C compiler or no Python headers here: the planner runs the Python loop")
    assert simulator.EVENT_LOOP == "c", "pip install -e . could compile _ceventloop here but did not"


def played(
    monkeypatch: pytest.MonkeyPatch, loop: ModuleType, seed: int, fifo: bool
) -> list[tuple | list | None]:
    """Everything a planner reads from the simulator for one random case: runs, traces with their ends and
    snapshot instants, reruns under tight and loose bounds, retraces."""
    use(monkeypatch, loop)
    view, rules, paths = random_case(seed)
    rng = random.Random(seed)
    sim = Simulator(view, rules.memory, fifo=fifo, stride=rng.choice([None, 1, 4]))
    trace = sim.trace(paths)
    out: list[tuple | list | None] = [fields(sim.run(paths)), fields(trace.result), list(trace.ends)]
    out.append([snapshot.now for snapshot in trace.snapshots])
    for _ in range(5):
        trial = changed(trace.paths, view, rng)
        out.append(fields(sim.rerun(trace, trial)))
        for bound in (trace.result.iteration_time_s, 0.97 * trace.result.iteration_time_s):
            out.append(fields(sim.rerun(trace, trial, bound=bound)))
        if rng.random() < 0.5:
            trace = sim.retrace(trace, trial)
            out += [fields(trace.result), list(trace.ends)]
    return out


@pytest.mark.parametrize("fifo", [False, True])
@pytest.mark.parametrize("seed", range(40))
def test_both_loops_time_every_plan_alike(
    loops: dict[str, ModuleType], monkeypatch: pytest.MonkeyPatch, seed: int, fifo: bool
) -> None:
    assert played(monkeypatch, loops["c"], seed, fifo) == played(monkeypatch, loops["python"], seed, fifo)


def reference_cases() -> list[tuple[SwarmView, PathRules]]:
    scenario = scenario_from_dict(json.loads(REFERENCE.read_text()))
    fast = dataclasses.replace(scenario.view, forward_s=tuple(0.44 for _ in scenario.view.forward_s))
    swap = dataclasses.replace(scenario.rules, checkfree_plus_share=0.5)
    return [(scenario.view, scenario.rules), (fast, scenario.rules), (scenario.view, swap)]


@pytest.mark.parametrize("case", range(3))
@pytest.mark.parametrize("seed", range(2))
def test_both_loops_plan_the_same_paths(
    loops: dict[str, ModuleType], monkeypatch: pytest.MonkeyPatch, case: int, seed: int
) -> None:
    view, rules = reference_cases()[case]
    plans = {}
    for name, loop in loops.items():
        use(monkeypatch, loop)
        plan = schedule(view, rules, seed)
        plans[name] = (plan.as_dict(), plan.iteration_time_s, plan.collisions)
    assert plans["c"] == plans["python"]


def test_the_c_loop_refuses_malformed_input(loops: dict[str, ModuleType]) -> None:
    c = loops["c"]
    good = [[(0, True, 1.0, False), (1, True, 1.0, False), (0, False, 1.5, True)]]
    links = ((0.0, 0.1), (0.1, 0.0))
    bad_chains = [
        [[(2, True, 1.0, False)]],  # a node outside the state
        [[(-1, True, 1.0, False)]],
        [[(0, 1, 1.0, False)]],  # a flag that is not a bool
        [[(0, True, "1", False)]],  # a time that is not a number
        [[(0, True, 1.0)]],  # a short task
        [[]],  # an empty chain
        [(0, True, 1.0, False)],  # a task where a chain belongs
    ]
    for chains in bad_chains:
        with pytest.raises((TypeError, ValueError)):
            c.State(chains, 2, False)
    state = c.State(good, 2, False)
    with pytest.raises((TypeError, ValueError)):
        c.play(state, good + good, links, 3, math.inf, None, 0, None)  # more chains than the state's
    with pytest.raises((TypeError, ValueError)):
        c.play(state.copy(), good, ((0.0,),), 3, math.inf, None, 0, None)  # too few links
    with pytest.raises((TypeError, ValueError)):
        c.play(state.copy(), good, links, 3, 1.0, None, 0, [[]])  # rests without a time per task
    longer = [[*good[0], (1, False, 1.5, True), (0, False, 1.0, False)]]
    with pytest.raises(ValueError):
        c.play(state.copy(), longer, links, 3, math.inf, None, 0, None)  # a chain longer than the state's
    assert c.play(state, good, links, 3, math.inf, None, 0, None) is True
    assert state.ends == [[1.0, 2.1, 3.7]]
