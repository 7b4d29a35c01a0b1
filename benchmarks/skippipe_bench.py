"""SkipPipe scheduling benchmark: expected iteration time of each method against the published figures.

Run from the repository root: `python benchmarks/skippipe_bench.py [--seeds N] [--old REV] [--only TABLE]
[--scaling-seeds N] [--json FILE]`.
Prints one table per setting; seeded methods show the mean over N seeds with the range. "skippipe" draws
replicas a data node must reach (PathRules.replica_mixing, default 0.25) so that no data node stays pinned
to one replica; the "mixing off" row switches that off, as in the reference schedule, which pins one loop
per data node. With `--old REV` the planner of that git revision runs on the same inputs in the same run
("old planner" rows and columns; `git` must be on the PATH).

Every plan is timed in two cost models: the planner's own (`ours s`: backward passes first, at most
`memory` microbatches per node) and plain FIFO per node without a memory limit (`fifo s`); `vs full` and
`fifo vs full` are ratios to the full pipeline timed in the same model.

Settings:
- the reference scenario of `data/gcp12_links.json` as written (forward 1.76 s per microbatch per node),
  with the NL-London bandwidth as published (0.00024 GiB/s, probably a typo) and corrected (x1000);
- the same with 0.44 s forward per microbatch: the compute that reproduces the published numbers with our
  simulator (the committed reference schedule simulates to 32.9 s against the published 33.3 s);
- a seeded random 40-node swarm: the 12 sites (NL-London corrected: a 132 s hop dominates any plan that
  has to use it), heterogeneous compute (0.5-2x), 8 stages, 6 data nodes;
- scaling: the reference scenario and seeded swarms of 20 to 1,000 nodes and 4 to 16 stages
  (`scaled_swarm`): planning time per iteration (CPU and wall) and plan quality against the full pipeline,
  with the old planner's (`--old`, up to `OLD_UP_TO` nodes) as ratios measured in the same run.

`--json FILE` writes every table's rows and the machine's load average.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import io
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from protocols.skippipe import METHODS, PathRules, Plan, SwarmView, scenario_from_dict, schedule, simulate
from protocols.skippipe.baselines import full_pipeline_plan
from protocols.skippipe.simulator import EVENT_LOOP

DATA = Path(__file__).parent / "data" / "gcp12_links.json"
PUBLISHED = {
    "full_pipeline": "full_pipeline_dtfm",
    "skips_without_collision_awareness": "dtfm_with_skips",
    "skippipe_without_collision_avoidance": "skippipe_without_collision_avoidance",
    "skippipe": "skippipe",
}
NL_LONDON_FIXED = {("NL", "London"): 0.00023681640625 * 1000}
# The paths of the committed schedule.json of gensyn-ai/skippipe ("ca-paths"): one loop per data node.
COMMITTED_LOOPS = {0: (6, 12, 5), 3: (14, 2, 18), 4: (1, 15, 19), 10: (13, 17, 7), 11: (8, 16, 9)}
SCALING = ((20, 5), (20, 4), (40, 8), (100, 8), (300, 8), (500, 16), (1000, 16))  # (20, 5): the reference
OLD_UP_TO = 300  # nodes: beyond, the old planner takes minutes per plan
TABLES = ("methods", "effort", "scaling")
DEFAULT_EFFORT = tuple(
    inspect.signature(schedule).parameters[name].default for name in ("restarts", "rounds")
)  # the planner's default (restarts, rounds)
Method = Callable[[SwarmView, PathRules, int], Plan]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="seeds per seeded method")
    parser.add_argument("--old", metavar="REV", help="git revision whose planner to compare with")
    parser.add_argument("--only", action="append", choices=TABLES, help="run only these tables (repeatable)")
    parser.add_argument("--scaling-seeds", type=int, default=1, help="seeds per row of the scaling table")
    parser.add_argument("--json", metavar="FILE", type=Path, help="also write every row as JSON to FILE")
    args = parser.parse_args()
    seeds = range(args.seeds)
    tables = args.only or TABLES
    old = _old_planner(args.old) if args.old else None
    data = json.loads(DATA.read_text())
    report: dict[str, Any] = {"old": args.old, "event_loop": EVENT_LOOP, "load_before": os.getloadavg()}
    print(
        f"planner event loop: {EVENT_LOOP}"
        + (" (the old planner's: python, never compiled here)" if old else "")
    )
    if "methods" in tables:
        report["methods"] = _methods(data, seeds, old)
    if "effort" in tables:
        report["effort"] = _effort(data, seeds, old)
    if "scaling" in tables:
        report["scaling"] = _scaling(data, old, range(args.scaling_seeds))
    report["load_after"] = os.getloadavg()
    print(f"\nload average (1, 5, 15 min): before {report['load_before']}, after {report['load_after']}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


def _methods(data: dict[str, Any], seeds: range, old: ModuleType | None) -> list[dict[str, Any]]:
    rows = []
    for forward, note in ((None, "as written: 1.76 s forward"), (0.44, "calibrated: 0.44 s forward")):
        for fix, link in ((None, "NL-London as published"), (NL_LONDON_FIXED, "NL-London x1000")):
            scenario = scenario_from_dict(data, bandwidth_overrides=fix)
            view = scenario.view
            if forward is not None:
                view = dataclasses.replace(view, forward_s=tuple(forward for _ in view.forward_s))
            committed = _committed_schedule_time(view, scenario.rules)
            title = f"reference scenario, {note}, {link}; committed reference schedule: {committed:.1f} s"
            rows += _table(title, view, scenario.rules, scenario.published_s, seeds, old)
    view, rules = random_swarm(data, seed=40)
    title = "random 40-node heterogeneous swarm (seed 40), 1.76 s forward x 0.5-2"
    return rows + _table(title, view, rules, {}, seeds, old)


def random_swarm(data: dict[str, Any], seed: int) -> tuple[SwarmView, PathRules]:
    """40 nodes at random sites (NL-London corrected) with heterogeneous compute: 6 data nodes and 8 stages
    of 4-5 replicas."""
    rng = random.Random(seed)
    sizes = [6, 5, 4, 4, 4, 4, 4, 4, 5]
    return _swarm(data, rng, sizes, 6, len(sizes), NL_LONDON_FIXED)


def scaled_swarm(data: dict[str, Any], n_nodes: int, n_stages: int, seed: int) -> tuple[SwarmView, PathRules]:
    """`n_nodes` at random sites (NL-London corrected), heterogeneous compute (0.5-2x), one data node per
    `n_stages + 1` nodes, the rest spread evenly over the stages; paths visit 60% of the stages."""
    rng = random.Random(seed)
    data_nodes = max(2, round(n_nodes / (n_stages + 1)))
    rest = n_nodes - data_nodes
    sizes = [data_nodes] + [rest // n_stages + (k < rest % n_stages) for k in range(n_stages)]
    return _swarm(data, rng, sizes, max(1, round(0.6 * n_stages)), n_stages + 1, NL_LONDON_FIXED)


def _swarm(
    data: dict[str, Any],
    rng: random.Random,
    sizes: list[int],
    visited: int,
    total: int,
    fix: Mapping[tuple[str, str], float] | None = None,
) -> tuple[SwarmView, PathRules]:
    nodes = list(range(sum(sizes)))
    rng.shuffle(nodes)
    stages = [nodes[sum(sizes[:k]) : sum(sizes[: k + 1])] for k in range(len(sizes))]
    reference = dict(data["skippipe_reference_scenario"])
    reference.update(
        nodes=len(nodes),
        node_sites=[rng.choice(data["sites"]) for _ in nodes],
        node_stages=stages,
        stages_visited_per_path_including_stage0=visited + 1,
    )
    scenario = scenario_from_dict({**data, "skippipe_reference_scenario": reference}, bandwidth_overrides=fix)
    view = dataclasses.replace(
        scenario.view, forward_s=tuple(f * rng.uniform(0.5, 2.0) for f in scenario.view.forward_s)
    )
    rules = PathRules.visiting(visited + 1, total, microbatches_per_data_node=6, memory=3)
    return view, rules


def _committed_schedule_time(view: SwarmView, rules: PathRules) -> float:
    m = rules.microbatches_per_data_node
    paths = {i * m + j: (d, *COMMITTED_LOOPS[d], d) for i, d in enumerate(view.data_nodes) for j in range(m)}
    return simulate(paths, view, rules.memory).iteration_time_s


def _timed(method: Method, view: SwarmView, rules: PathRules, seed: int) -> tuple[Plan, float, float]:
    """The plan, wall and CPU milliseconds."""
    wall, cpu = time.perf_counter(), time.process_time()
    plan = method(view, rules, seed)
    return plan, 1000 * (time.perf_counter() - wall), 1000 * (time.process_time() - cpu)


def _fifo(plan: Plan, view: SwarmView) -> float:
    return simulate(plan.paths, view, 1, fifo=True).iteration_time_s


def _table(
    title: str,
    view: SwarmView,
    rules: PathRules,
    published: Mapping[str, float],
    seeds: range,
    old: ModuleType | None,
) -> list[dict[str, Any]]:
    print(f"\n{title}")
    print(
        f"{'method':<40}{'ours s':>8}{'range':>13}{'vs full':>9}{'fifo s':>8}{'fifo vs full':>13}"
        f"{'published s':>13}{'collisions':>12}{'wall ms':>9}{'cpu ms':>8}"
    )
    unpinned = dataclasses.replace(rules, replica_mixing=0.0)
    rows = [(name.replace("_", " "), method, rules, PUBLISHED[name]) for name, method in METHODS.items()]
    rows.append(("skippipe, replica mixing off", METHODS["skippipe"], unpinned, "skippipe"))
    if old is not None:
        rows.append(("skippipe, old planner", _old_method(old), rules, "skippipe"))
    full = full_pipeline_plan(view, rules)
    full_s, full_fifo = full.iteration_time_s, _fifo(full, view)
    out = []
    for label, method, method_rules, published_name in rows:
        runs = [_timed(method, view, method_rules, seed) for seed in seeds]
        times = [plan.iteration_time_s for plan, _, _ in runs]
        fifo = statistics.fmean(_fifo(plan, view) for plan, _, _ in runs)
        mean = statistics.fmean(times)
        paper = published.get(published_name)
        out.append(
            {
                "setting": title,
                "method": label,
                "iteration_s": times,
                "vs_full": mean / full_s,
                "fifo_vs_full": fifo / full_fifo,
                "wall_ms": [w for _, w, _ in runs],
                "cpu_ms": [c for _, _, c in runs],
            }
        )
        print(
            f"{label:<40}{mean:>8.1f}{f'{min(times):.1f}-{max(times):.1f}':>13}{mean / full_s:>9.3f}"
            f"{fifo:>8.1f}{fifo / full_fifo:>13.3f}{'' if paper is None else f'{paper:.1f}':>13}"
            f"{statistics.fmean(plan.collisions for plan, _, _ in runs):>12.1f}"
            f"{statistics.fmean(w for _, w, _ in runs):>9.0f}{statistics.fmean(c for _, _, c in runs):>8.0f}"
        )
    return out


def _effort(data: dict[str, Any], seeds: range, old: ModuleType | None) -> list[dict[str, Any]]:
    """Planner effort (restarts, rounds) against plan quality on the reference scenario as written, at 1.76
    and 0.44 s forward; ratios to the default effort (and to the old planner's default) in this run."""
    print("\nplanner effort on the reference scenario (mean over seeds; cpu per plan)")
    print(
        f"{'restarts, rounds':<26}{'1.76 s fwd: s':>14}{'0.44 s fwd: s':>14}{'cpu ms':>8}{'wall ms':>9}"
        f"{'vs default':>12}",
        end="",
    )
    print(f"{'vs old: s':>10}{'cpu':>7}" if old is not None else "")
    scenario = scenario_from_dict(data)
    fast = dataclasses.replace(scenario.view, forward_s=tuple(0.44 for _ in scenario.view.forward_s))
    efforts: list[tuple[str, Method]] = [
        (f"{r}, {n}", lambda v, rules, seed, r=r, n=n: schedule(v, rules, seed, restarts=r, rounds=n))
        for r, n in dict.fromkeys((DEFAULT_EFFORT, (4, 600), (3, 300), (2, 250), (2, 60), (1, 0)))
    ]
    if old is not None:
        efforts.insert(0, ("old planner, its default", _old_method(old)))
    timed: dict[str, list[tuple[Plan, float, float]]] = {label: [] for label, _ in efforts}
    for v in (scenario.view, fast):  # the efforts take turns per plan, so that the load drifts alike
        for seed in seeds:
            for label, method in efforts:
                timed[label].append(_timed(method, v, scenario.rules, seed))
    rows = {}
    for label, runs in timed.items():
        slow_s = statistics.fmean(plan.iteration_time_s for plan, _, _ in runs[: len(seeds)])
        fast_s = statistics.fmean(plan.iteration_time_s for plan, _, _ in runs[len(seeds) :])
        rows[label] = (
            slow_s,
            fast_s,
            statistics.fmean(cpu for _, _, cpu in runs),
            statistics.fmean(wall for _, wall, _ in runs),
        )
    default = rows["{}, {}".format(*DEFAULT_EFFORT)]
    out = []
    for label, (slow_s, fast_s, cpu, wall) in rows.items():
        line = f"{label:<26}{slow_s:>14.2f}{fast_s:>14.2f}{cpu:>8.0f}{wall:>9.0f}{cpu / default[2]:>12.3f}"
        row = {
            "effort": label,
            "iteration_s_176": slow_s,
            "iteration_s_044": fast_s,
            "cpu_ms": cpu,
            "wall_ms": wall,
        }
        if old is not None:
            base = rows["old planner, its default"]
            row["quality_vs_old"] = (slow_s / base[0] + fast_s / base[1]) / 2
            row["cpu_vs_old"] = cpu / base[2]
            line += f"{row['quality_vs_old']:>10.3f}{row['cpu_vs_old']:>7.3f}"
        out.append(row)
        print(line, flush=True)
    return out


def _scaling(data: dict[str, Any], old: ModuleType | None, seeds: range) -> list[dict[str, Any]]:
    """Per swarm size, the planner's CPU and wall seconds per iteration (default effort) and its plans'
    iteration time against the full pipeline's, in its own model and FIFO; the old planner's beside it."""
    print(
        f"\nscaling (mean over {len(seeds)} seed(s)): planner time per iteration and plan quality against the"
        " full pipeline (own model; FIFO)"
    )
    header = f"{'nodes':>6}{'stages':>7}{'data':>5}{'mbs':>5}{'full s':>8}{'skippipe s':>11}{'vs full':>8}"
    header += f"{'fifo vs full':>13}{'cpu s':>8}{'wall s':>8}"
    if old is not None:
        header += f"{'old vs full':>12}{'old cpu s':>10}{'quality new/old':>16}{'cpu new/old':>12}"
    print(header)
    out = []
    for n_nodes, n_stages in SCALING:
        if (n_nodes, n_stages) == (20, 5):
            scenario = scenario_from_dict(data)
            view, rules = scenario.view, scenario.rules
        else:
            view, rules = scaled_swarm(data, n_nodes, n_stages, seed=0)
        full = full_pipeline_plan(view, rules)
        full_fifo = _fifo(full, view)
        runs = [_timed(schedule, view, rules, seed) for seed in seeds]
        row: dict[str, Any] = {
            "nodes": n_nodes,
            "stages": n_stages,
            "data_nodes": len(view.data_nodes),
            "microbatches": len(runs[0][0].paths),
            "full_s": full.iteration_time_s,
            "skippipe_s": statistics.fmean(plan.iteration_time_s for plan, _, _ in runs),
            "fifo_vs_full": statistics.fmean(_fifo(plan, view) for plan, _, _ in runs) / full_fifo,
            "cpu_s": statistics.fmean(cpu for _, _, cpu in runs) / 1000,
            "wall_s": statistics.fmean(wall for _, wall, _ in runs) / 1000,
        }
        row["vs_full"] = row["skippipe_s"] / row["full_s"]
        line = (
            f"{n_nodes:>6}{n_stages:>7}{row['data_nodes']:>5}{row['microbatches']:>5}{row['full_s']:>8.1f}"
            f"{row['skippipe_s']:>11.1f}{row['vs_full']:>8.3f}{row['fifo_vs_full']:>13.3f}"
            f"{row['cpu_s']:>8.3f}{row['wall_s']:>8.3f}"
        )
        if old is not None and n_nodes <= OLD_UP_TO:
            old_runs = [_timed(_old_method(old), view, rules, seed) for seed in seeds]
            old_s = statistics.fmean(plan.iteration_time_s for plan, _, _ in old_runs)
            row["old_vs_full"] = old_s / row["full_s"]
            row["old_cpu_s"] = statistics.fmean(cpu for _, _, cpu in old_runs) / 1000
            row["quality_new_vs_old"] = row["skippipe_s"] / old_s
            row["cpu_new_vs_old"] = row["cpu_s"] / row["old_cpu_s"]
            line += (
                f"{row['old_vs_full']:>12.3f}{row['old_cpu_s']:>10.3f}{row['quality_new_vs_old']:>16.3f}"
                f"{row['cpu_new_vs_old']:>12.3f}"
            )
        out.append(row)
        print(line, flush=True)
    return out


def _old_planner(rev: str) -> ModuleType:
    """`protocols.skippipe` as of git revision `rev`, imported under another name beside today's."""
    archive = subprocess.run(["git", "archive", rev, "protocols"], check=True, capture_output=True).stdout
    root = Path(tempfile.mkdtemp(prefix="skippipe_old_"))
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(root, filter="data")
    package = root / "old_protocols"
    (root / "protocols").rename(package)
    for source in package.rglob("*.py"):
        source.write_text(re.sub(r"\bprotocols([.\s])", r"old_protocols\1", source.read_text()))
    sys.path.insert(0, str(root))
    return importlib.import_module("old_protocols.skippipe")


def _old_method(old: ModuleType) -> Method:
    def method(view: SwarmView, rules: PathRules, seed: int) -> Plan:
        old_view = old.SwarmView(
            view.stages, view.forward_s, view.link_s, view.backward_factor, view.head_factor
        )
        plan = old.schedule(old_view, old.PathRules(**dataclasses.asdict(rules)), seed)
        return Plan(dict(plan.paths), plan.iteration_time_s, plan.collisions)

    return method


if __name__ == "__main__":
    main()
