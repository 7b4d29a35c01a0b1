"""The SkipPipe planner: collision-aware paths for one iteration, fast enough to run every iteration.

1. Allowed stage orders by kind (ordinary, CheckFree+) and balanced stage sets (`sequences`).
2. A few seeded time-aware list-scheduling constructions (`greedy`), alternating between planning in
   release order and planning the data nodes with the slowest round trips first, each then made to
   reach the iteration's drawn replicas (`spread`); the simulator keeps the best.
3. Local improvement scored by the simulator: move a microbatch (often the last to finish, or another of
   its data node's) to another replica, swap the replicas two microbatches of a data node use for a
   stage, exchange the paths of two microbatches, hand a stage from one path to another (a stage for a
   stage, so the visit counts stay put), or swap two stages of a path where rule 4 and the path's kind
   allow. A change is kept only if it keeps every drawn replica reached and the iteration ends earlier,
   or as early with the microbatches finishing earlier in sum. A plan that deadlocks on memory never
   ends, so it never wins. A trial is timed from the last snapshot of the current plan's simulation
   before its first change, and dropped as soon as it must end later (`Simulator.rerun`).

Everything is deterministic for a seed; an optional clock and budget only cut the search short.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from protocols.errors import LocalProtocolError
from protocols.skippipe.greedy import Shortlist, greedy_paths
from protocols.skippipe.plan import Paths, Plan
from protocols.skippipe.rules import PathRules, validate_plan
from protocols.skippipe.sequences import Order, SequenceSpace
from protocols.skippipe.simulator import SimResult, Simulator
from protocols.skippipe.spread import Draws, draw_replicas, granted, missed
from protocols.skippipe.swarm import SwarmView


def schedule(
    view: SwarmView,
    rules: PathRules,
    seed: int,
    *,
    restarts: int = 2,
    rounds: int = 600,
    slack: float = 0.02,
    clock: Callable[[], float] | None = None,
    budget_s: float | None = None,
    previous: Mapping[int, Sequence[int]] | None = None,
) -> Plan:
    """Collision-aware paths honouring rules 1-6; see the module docstring.

    `restarts` greedy constructions and `rounds` improvement steps bound the work. Two constructions (one
    critical first, one in release order) plan as well as four once improved (docs/skippipe.md: 0.997 of
    four's iteration time over 80 plans) at 0.7 of the time. With `clock` (for
    example `time.perf_counter`) and `budget_s`, the search also stops once that much time has passed,
    after at least one construction; the result is then deterministic only if the budget was not hit.

    With `previous` (for example the last iteration's paths) that is a valid plan for this view and these
    rules, there is no construction: this iteration's draws are granted on it and the improvement starts
    there (planning incrementally; in large swarms the constructions are most of the cost). Otherwise
    `previous` is ignored.
    """
    if restarts < 1 or rounds < 0:
        raise LocalProtocolError("restarts must be at least 1 and rounds non-negative")
    rng = random.Random(seed)
    space = SequenceSpace.of(view.n_stages, rules)
    start = clock() if clock is not None else 0.0

    def out_of_time() -> bool:
        return clock is not None and budget_s is not None and clock() - start >= budget_s

    shortlist = Shortlist.of(view, space)
    simulator = Simulator(view, rules.memory)
    draws = draw_replicas(view, rules.replica_mixing, rng)

    def constructed(critical_first: bool) -> tuple[Paths, SimResult]:
        paths = greedy_paths(
            view, rules, space, rng, slack, aware=True, critical_first=critical_first, shortlist=shortlist
        )
        paths = granted(paths, view, draws)
        return paths, simulator.run(paths)

    reuse = previous is not None and _reusable(previous, view, rules, space)
    if previous is not None and reuse:
        paths = granted({mb: tuple(path) for mb, path in previous.items()}, view, draws)
        best = (paths, simulator.run(paths))
    else:
        best = constructed(critical_first=True)
    for attempt in range(1, 1 if reuse else restarts):
        if out_of_time():
            break
        other = constructed(critical_first=attempt % 2 == 0)
        if _key(other[1]) < _key(best[1]):
            best = other
    paths, result = _improve(*best, simulator, rules, space, draws, rng, rounds, out_of_time)
    if result.stuck and rules.checkfree_plus_share > 0:
        # CheckFree+ swaps run some paths against the others' order; with few memory slots that can leave
        # no plan that finishes. The share is a preference: plan without it.
        plain = replace(rules, checkfree_plus_share=0.0)
        return schedule(
            view, plain, seed, restarts=restarts, rounds=rounds, slack=slack, clock=clock, budget_s=budget_s
        )
    if result.stuck:
        raise LocalProtocolError(f"no plan found that completes with {rules.memory} memory slots per node")
    return Plan(paths, result.iteration_time_s, result.collisions)


def _reusable(
    paths: Mapping[int, Sequence[int]], view: SwarmView, rules: PathRules, space: SequenceSpace
) -> bool:
    """Whether `paths` is a valid plan for `view` and `rules` whose every order the moves know."""
    if validate_plan(paths, view, rules):
        return False
    return all(space.kind_of(_stages(view, tuple(path))) is not None for path in paths.values())


def _key(result: SimResult) -> tuple[float, float]:
    return (result.iteration_time_s, result.total_finish_s)


def _improve(
    paths: Paths,
    result: SimResult,
    simulator: Simulator,
    rules: PathRules,
    space: SequenceSpace,
    draws: Draws,
    rng: random.Random,
    rounds: int,
    out_of_time: Callable[[], bool],
) -> tuple[Paths, SimResult]:
    """Local search scored by the simulator; every move keeps each path's kind and the stage counts. A
    trial is replayed from the current plan's last snapshot before its first change and dropped as soon
    as it is sure to end later."""
    view = simulator.view
    ids = sorted(paths)
    m = rules.microbatches_per_data_node
    by_data = {d: [mb for mb in ids if paths[mb][0] == d] for d in view.data_nodes}
    moves = (_move_replica, _swap_replicas, _exchange_paths, _exchange_stages, _reorder)
    trace = simulator.trace(paths) if rounds else None
    tried: set[tuple[tuple[int, tuple[int, ...]], ...]] = set()  # changes already rejected from this plan
    last = _last(result)
    for _ in range(rounds):
        if out_of_time():
            break
        trial = dict(paths)
        mb = _pick(last, ids, rng, m)
        touched = moves[rng.randrange(len(moves))](trial, view, space, rng, mb, ids)
        change = tuple((x, trial[x]) for x in sorted(set(touched)) if trial[x] != paths[x])
        if not change or change in tried:
            continue
        sources = {path[0] for _, path in change}  # a draw is missed or not per data node
        if draws and missed({mb: trial[mb] for d in sources for mb in by_data[d]}, view, draws):
            continue
        tried.add(change)
        outcome = simulator.rerun(trace, trial, bound=result.iteration_time_s)
        if outcome is not None and _key(outcome) < _key(result):
            trace = simulator.retrace(trace, trial)
            paths, result = trial, outcome
            tried.clear()
            last = _last(result)
    return paths, result


def _last(result: SimResult) -> int | None:
    """The microbatch that finishes last (the highest id among ties), None if none finishes."""
    return max(result.finish_s, key=lambda mb: (result.finish_s[mb], mb)) if result.finish_s else None


def _pick(last: int | None, ids: list[int], rng: random.Random, m: int) -> int:
    """The microbatch that finishes last, another of its data node's, or any, a third of the time each."""
    draw = rng.random()
    if draw < 2 / 3 and last is not None:
        return last if draw < 1 / 3 else last - last % m + rng.randrange(m)
    return ids[rng.randrange(len(ids))]


def _stages(view: SwarmView, path: tuple[int, ...]) -> Order:
    return tuple(view.stage_of[v] for v in path[1:-1])


def _move_replica(
    paths: Paths, view: SwarmView, space: SequenceSpace, rng: random.Random, mb: int, ids: list[int]
) -> tuple[int, ...]:
    path = paths[mb]
    positions = [p for p in range(1, len(path) - 1) if len(view.stages[view.stage_of[path[p]]]) > 1]
    if positions:
        p = positions[rng.randrange(len(positions))]
        others = [v for v in view.stages[view.stage_of[path[p]]] if v != path[p]]
        paths[mb] = (*path[:p], others[rng.randrange(len(others))], *path[p + 1 :])
    return (mb,)


def _swap_replicas(
    paths: Paths, view: SwarmView, space: SequenceSpace, rng: random.Random, a: int, ids: list[int]
) -> tuple[int, ...]:
    """a and another microbatch of its data node exchange the replicas they use for one stage."""
    i = rng.randrange(1, len(paths[a]) - 1)
    stage = view.stage_of[paths[a][i]]
    options = [
        (b, j)
        for b in ids
        if paths[b][0] == paths[a][0]
        for j in range(1, len(paths[b]) - 1)
        if view.stage_of[paths[b][j]] == stage and paths[b][j] != paths[a][i]
    ]
    if options:
        b, j = options[rng.randrange(len(options))]
        x, y = paths[a][i], paths[b][j]
        paths[a] = (*paths[a][:i], y, *paths[a][i + 1 :])
        paths[b] = (*paths[b][:j], x, *paths[b][j + 1 :])
        return (a, b)
    return ()


def _exchange_paths(
    paths: Paths, view: SwarmView, space: SequenceSpace, rng: random.Random, a: int, ids: list[int]
) -> tuple[int, ...]:
    b = ids[rng.randrange(len(ids))]
    pa, pb = paths[a], paths[b]
    paths[a], paths[b] = (pa[0], *pb[1:-1], pa[0]), (pb[0], *pa[1:-1], pb[0])
    return (a, b)


def _exchange_stages(
    paths: Paths, view: SwarmView, space: SequenceSpace, rng: random.Random, a: int, ids: list[int]
) -> tuple[int, ...]:
    """a hands one of its hops to b and takes one of b's stages in its place: stage counts stay put."""
    b = ids[rng.randrange(len(ids))]
    pa, pb = paths[a], paths[b]
    sa, sb = _stages(view, pa), _stages(view, pb)
    pairs = [(i, j) for i, x in enumerate(sa) if x not in sb for j, y in enumerate(sb) if y not in sa]
    if not pairs:
        return ()
    i, j = pairs[rng.randrange(len(pairs))]
    new_a = (*pa[: i + 1], pb[j + 1], *pa[i + 2 :])
    new_b = (*pb[: j + 1], pa[i + 1], *pb[j + 2 :])
    if _same_kind(space, view, pa, new_a) and _same_kind(space, view, pb, new_b):
        paths[a], paths[b] = new_a, new_b
    return (a, b)


def _reorder(
    paths: Paths, view: SwarmView, space: SequenceSpace, rng: random.Random, mb: int, ids: list[int]
) -> tuple[int, ...]:
    path = paths[mb]
    if len(path) > 3:
        i, j = sorted(rng.sample(range(1, len(path) - 1), 2))
        new = (*path[:i], path[j], *path[i + 1 : j], path[i], *path[j + 1 :])
        if _same_kind(space, view, path, new):
            paths[mb] = new
    return (mb,)


def _same_kind(space: SequenceSpace, view: SwarmView, old: tuple[int, ...], new: tuple[int, ...]) -> bool:
    return space.kind_of(_stages(view, new)) == space.kind_of(_stages(view, old))
