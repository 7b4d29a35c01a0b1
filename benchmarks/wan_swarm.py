"""WAN swarm: the local swarm on emulated links, full pipeline vs SkipPipe paths vs random skips.

For each seed and method, one calm run of

    python -m swarmnode up --calm --network FILE --stages S --replicas R --data-nodes D --steps N \\
        --seed SEED --skip-ratio X --planner P

(real daemons on loopback, each at a site of FILE, what they send to another site delayed and paced as over
that link; `docs/design.md`, "Emulated links"), one after the other, read back from its `report.json`:

- `full_pipeline`: skip ratio 0, every path visits every stage in order (the planner only picks replicas);
- `skippipe`: skip ratio X, SkipPipe's scheduler (stage sets, orders and replicas chosen against collisions);
- `random_skips`: skip ratio X, the paper's baseline: a random balanced choice of stages per microbatch, in
  stage order, blind to collisions (`RunSpec.planner`; the replicas dealt out as in every plan).

Per run: the data nodes' median and 90th-percentile iteration time (the first `WARMUP_STEPS` steps included:
the report keeps every iteration that ended in a step), what the SkipPipe simulator predicts for the same
swarm, links and plan (`iteration_seconds.simulated`), live over simulated, tokens/s, and the microbatches
each transformer node served. The summary gives each method's mean over the seeds and its ratio to the full
pipeline of the same seed. The goals (issue 12): SkipPipe at most 0.7x the full pipeline's live iteration
time, and live within 25% of simulated.

    python benchmarks/wan_swarm.py                          # 6 stages x 1, 2 data nodes, 40 steps, seed 0
    python benchmarks/wan_swarm.py --seeds 0,1 --replicas 2 --json out.json --markdown out.md

How long it takes: a run starts in about 25 s and then trains at 1.3-2 s a step on these links: 1.5-2.5
minutes a run, the default's three runs about 6 minutes on two cores (session 11, load 3-9).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from tempfile import mkdtemp
from typing import Any

from up_runs import GRACE_S, read_report, run_up  # benchmarks/, next to this script

NETWORK = Path(__file__).resolve().parent / "data" / "gcp12_links.json"
SECONDS_PER_STEP = 20.0  # `up --timeout` per step: generous (a step takes 1-4 s on the 12 sites' links)
START_S = 300.0  # and for the start
SKIPPIPE_GOAL = 0.7  # SkipPipe's live iteration time over the full pipeline's, at most
SIMULATED_WITHIN = 0.25  # |live / simulated - 1|, at most


@dataclass(frozen=True)
class Method:
    name: str
    skip_ratio: float
    planner: str


def methods(skip_ratio: float) -> tuple[Method, ...]:
    return (
        Method("full_pipeline", 0.0, "skippipe"),
        Method("skippipe", skip_ratio, "skippipe"),
        Method("random_skips", skip_ratio, "random_skips"),
    )


def wan_run(method: Method, seed: int, args: argparse.Namespace, base: Path) -> dict[str, Any]:
    """One calm swarm on the emulated links; the figures of its report (or why there are none)."""
    out = base / f"{method.name}-seed{seed}"
    timeout = START_S + SECONDS_PER_STEP * args.steps
    command = [
        sys.executable, "-m", "swarmnode", "up", "--calm",
        "--network", str(args.network),
        "--stages", str(args.stages), "--replicas", str(args.replicas), "--data-nodes", str(args.data_nodes),
        "--steps", str(args.steps), "--seed", str(seed), "--preset", args.preset,
        "--skip-ratio", str(method.skip_ratio), "--planner", method.planner,
        "--run-id", f"wan{uuid.uuid4().hex[:8]}", "--timeout", str(timeout), "--out", str(out),
    ]  # fmt: skip
    started = time.monotonic()
    returncode = run_up(command, out.name, base, timeout + GRACE_S)
    seconds = time.monotonic() - started
    report = read_report(out / "report.json") or {}
    iterations = report.get("iteration_seconds") or {}
    outcome = report.get("outcome", "no report")
    if returncode is None:
        outcome = f"{outcome} (stopped after {seconds:.0f} s)"
    median, simulated = iterations.get("median"), iterations.get("simulated")
    return {
        "method": method.name,
        "skip_ratio": method.skip_ratio,
        "planner": method.planner,
        "seed": seed,
        "outcome": outcome,
        "ok": outcome == "completed" and median is not None,
        "median_s": median,
        "p90_s": iterations.get("p90"),
        "iterations": iterations.get("count"),
        "simulated_s": simulated,
        "live_over_simulated": None if not (median and simulated) else round(median / simulated, 3),
        "tokens_per_second": report.get("tokens_per_second"),
        "served": {
            node["name"]: node.get("microbatches_served")
            for node in report.get("nodes") or []
            if node.get("stage")
        },
        "placement": (report.get("network") or {}).get("placement"),
        "wall_seconds": report.get("wall_seconds"),
        "output": str(out),
    }


def summarise(runs: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """Per method: means over its completed runs, and its ratios to the full pipeline of the same seed."""
    full = {run["seed"]: run for run in runs if run["method"] == "full_pipeline" and run["ok"]}
    rows = []
    for name in names:
        done = [run for run in runs if run["method"] == name and run["ok"]]
        paired = [run for run in done if run["seed"] in full]

        def mean(key: str, of: list[dict[str, Any]] = done) -> float | None:
            values = [run[key] for run in of if run[key] is not None]
            return round(statistics.fmean(values), 4) if values else None

        rows.append(
            {
                "method": name,
                "runs": len(done),
                "failed": sum(run["method"] == name and not run["ok"] for run in runs),
                "median_s": mean("median_s"),
                "p90_s": mean("p90_s"),
                "simulated_s": mean("simulated_s"),
                "live_over_simulated": mean("live_over_simulated"),
                "tokens_per_second": mean("tokens_per_second"),
                "live_over_full": ratio(paired, full, "median_s"),
                "simulated_over_full": ratio(paired, full, "simulated_s"),
            }
        )
    return rows


def ratio(runs: list[dict[str, Any]], full: dict[int, dict[str, Any]], key: str) -> float | None:
    """The mean over seeds of run[key] / the full pipeline's of the same seed."""
    ratios = [run[key] / full[run["seed"]][key] for run in runs if run[key] and full[run["seed"]][key]]
    return round(statistics.fmean(ratios), 3) if ratios else None


def verdicts(rows: list[dict[str, Any]]) -> dict[str, str]:
    by_name = {row["method"]: row for row in rows}
    skippipe = by_name.get("skippipe", {}).get("live_over_full")
    far = [
        f"{row['method']} {row['live_over_simulated']}"
        for row in rows
        if row["live_over_simulated"] is not None and abs(row["live_over_simulated"] - 1) > SIMULATED_WITHIN
    ]
    return {
        "skippipe_vs_full": "not measured"
        if skippipe is None
        else f"{'met' if skippipe <= SKIPPIPE_GOAL else 'not met'}: {skippipe} (goal <= {SKIPPIPE_GOAL})",
        "live_vs_simulated": f"not met: {', '.join(far)}"
        if far
        else f"met: every method within {SIMULATED_WITHIN:.0%}",
    }


def cell(value: Any, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def tables(runs: list[dict[str, Any]], rows: list[dict[str, Any]]) -> str:
    lines = [
        "| method | runs | live median s | p90 s | simulated s | live / simulated | tokens/s "
        "| live / full pipeline | simulated / full pipeline |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        runs_cell = f"{row['runs']}" + (f" ({row['failed']} failed)" if row["failed"] else "")
        lines.append(
            f"| {row['method']} | {runs_cell} | {cell(row['median_s'])} | {cell(row['p90_s'])} "
            f"| {cell(row['simulated_s'])} | {cell(row['live_over_simulated'], 2)} "
            f"| {cell(row['tokens_per_second'], 0)} | {cell(row['live_over_full'])} "
            f"| {cell(row['simulated_over_full'])} |"
        )
    lines += [
        "",
        "| method | seed | outcome | median s | simulated s | microbatches served |",
        "|---|---|---|---|---|---|",
    ]
    for run in runs:
        served = ", ".join(f"{name} {count}" for name, count in sorted(run["served"].items()))
        lines.append(
            f"| {run['method']} | {run['seed']} | {run['outcome']} | {cell(run['median_s'])} "
            f"| {cell(run['simulated_s'])} | {served or '-'} |"
        )
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--network", type=Path, default=NETWORK, help="links file (default: the 12 sites)")
    parser.add_argument(
        "--stages", type=int, default=6, help="transformer stages (the tiny preset's 6 layers)"
    )
    parser.add_argument("--replicas", type=int, default=1, help="nodes per transformer stage")
    parser.add_argument("--data-nodes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seeds", default="0", help="comma separated")
    parser.add_argument("--skip-ratio", type=float, default=0.34, help="of the skipping methods")
    parser.add_argument("--methods", default="full_pipeline,skippipe,random_skips", help="comma separated")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument(
        "--out-dir", type=Path, default=None, help="the swarms' outputs (default: a temp folder)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write every run and the summary here")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the tables here")
    args = parser.parse_args()
    known = {method.name: method for method in methods(args.skip_ratio)}
    try:
        args.seed_list = list(dict.fromkeys(int(seed) for seed in args.seeds.split(",")))
        args.method_list = [known[name.strip()] for name in args.methods.split(",")]
    except ValueError as error:
        parser.error(f"--seeds: {error}")
    except KeyError as error:
        parser.error(f"--methods: unknown method {error}; the methods are {', '.join(known)}")
    if not 0 < args.skip_ratio < 1:
        parser.error(f"--skip-ratio must lie in (0, 1), got {args.skip_ratio}")
    if not args.network.is_file():
        parser.error(f"--network {args.network}: no such file")
    for name in ("stages", "replicas", "data_nodes", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    base = args.out_dir if args.out_dir is not None else Path(mkdtemp(prefix="wan-swarm-"))
    base.mkdir(parents=True, exist_ok=True)
    runs = []
    plan = [(seed, method) for seed in args.seed_list for method in args.method_list]
    for n, (seed, method) in enumerate(plan, 1):
        run = wan_run(method, seed, args, base)
        runs.append(run)
        print(
            f"# run {n}/{len(plan)}: {method.name} seed {seed}: {run['outcome']}, median "
            f"{cell(run['median_s'])} s, simulated {cell(run['simulated_s'])} s",
            file=sys.stderr,
            flush=True,
        )
    print(f"# swarm outputs in {base}", file=sys.stderr)
    rows = summarise(runs, [method.name for method in args.method_list])
    verdict = verdicts(rows)
    text = tables(runs, rows)
    print(text)
    for name, words in verdict.items():
        print(f"{name}: {words}")
    settings = {
        "network": str(args.network),
        "stages": args.stages,
        "replicas": args.replicas,
        "data_nodes": args.data_nodes,
        "steps": args.steps,
        "seeds": args.seed_list,
        "skip_ratio": args.skip_ratio,
        "preset": args.preset,
    }
    if args.json is not None:
        args.json.write_text(
            json.dumps({"settings": settings, "summary": rows, "verdict": verdict, "runs": runs}, indent=1)
        )
    if args.markdown is not None:
        args.markdown.write_text(text + "\n\n" + "\n".join(f"- {k}: {v}" for k, v in verdict.items()) + "\n")


if __name__ == "__main__":
    main()
