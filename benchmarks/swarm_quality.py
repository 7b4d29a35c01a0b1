"""Swarm quality: validation loss of local swarms (D data nodes x R replicas per stage) against the trainer.

For each configuration `DxR`, each CheckFree+ setting and each seed, one run of

    python -m swarmnode up --calm --data-nodes D --replicas R --steps N --seed S --checkfree-plus ...

(a real swarm of separate processes on loopback, no failures, one at a time) is read back from its
`report.json`: the data nodes evaluate every 25 steps and at the last one (`val_curve`; each point is taken
to the nearest multiple of 25, as a data node that catches up with the swarm clock may evaluate a step off,
and averaged there over the data nodes), so the swarm's loss is its validation loss at data-node step N.

The reference is the single-process trainer (`swarmnode.trainer.train`, same preset, stages and seed, its
default validation batches, the same ones the data nodes evaluate; with the same seed it reads the same
batches in the same order as a swarm's lone data node, so the 1x1 row compares pairwise at equal steps and
the 1xR rows at equal tokens: the loss moves by several percent from seed to seed with the data order
alone), run in this process with one torch
thread (a daemon's budget: two threads ran ten times slower on a busy 2-core machine). Its learning-rate
schedule (warm-up, then cosine decay to the last step) depends on the run's length, so it trains once per
length it is compared at, each a complete run like the swarm's own:

- equal steps: N steps, compared with the swarm at step N;
- equal tokens: each of a swarm's D data nodes sends a batch for each of its R pipelines (one per replica of
  a stage) every step, D x R times the trainer's tokens per step, so D x R x N steps.

The summary has one row per configuration and CheckFree+ setting: the swarm's and the trainer's validation
loss over the seeds (mean, min-max, standard deviation), the swarm over the trainer, the swarm over the
1x1 swarm, over the Dx1 swarm (adding replicas should never make the loss worse by more than 2%: `!` marks
the rows that do) and over the 1xR swarm (what adding data nodes does), all means of per-seed ratios; the
share of NoLoCo pairing rounds that found a partner (when the report has a `noloco` block; over the stages
with more than one node: stage 0 when D > 1, the others when R > 1), and the wall time. A second table
gives CheckFree+ on over off per configuration. Runs that fail (any outcome but `completed`, or no
validation loss at step N) are counted as such and left out of the figures; their output folders are kept.

    python benchmarks/swarm_quality.py                    # 1x1, 2x1, 1x2, 2x2, 2x3; CheckFree+ on and off
    python benchmarks/swarm_quality.py --configs 1x1,2x2 --seeds 0 --checkfree-plus on --steps 50 \\
        --json out.json --plot quality.png --markdown quality.md
    python benchmarks/swarm_quality.py --swarm-runs out.json --markdown quality.md   # re-tabulate only
    python benchmarks/swarm_quality.py --configs 2x1 --seeds 0 --checkfree-plus on --repeats 3   # spread

How long it takes, on two idle cores: a swarm run of 100 steps takes about 0.3 s a step per batch it trains
on (1x2: 60 s, 2x2: 110 s), so the default matrix (5 configurations x 2 CheckFree+ settings x 3 seeds = 30
runs, 3,000 step-batches a seed) should take about an hour, start-ups included (estimated from session 10's
runs; the whole default matrix was not run since); the trainer's runs (N, 2N, 4N and 6N steps of 1,024
tokens per seed: 3,900 steps in all at 5,500 tokens/s on one idle thread) add about 12 minutes. Runs
recorded before the batch per pipeline (`--swarm-runs` of sessions 4-9, no `batches_per_step`) trained D
batches a step, not D x R: their equal-token figures from this script are wrong.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path
from tempfile import mkdtemp
from typing import Any

import torch
from quality_summary import (  # benchmarks/, next to this script
    REPLICA_TOLERANCE,
    Curve,
    SwarmShape,
    label,
    on_off,
    on_off_table,
    plot,
    repeatability,
    repeatability_table,
    summarise,
    summary_table,
)
from up_runs import GRACE_S, read_report, run_up

from swarmnode.data import Corpus, load_corpus
from swarmnode.model_config import stage_layers
from swarmnode.presets import get_preset
from swarmnode.trainer import Progress, TrainConfig, train

EVAL_EVERY = 25  # the data nodes' evaluation period (`swarmnode.node.driver.DataNode`)
# `up --timeout` per step and batch a step trains on (`SwarmShape.batches_per_step`): generous, a calm run
# of the tiny preset needs about 0.3 s a step per batch on two idle cores
SECONDS_PER_BATCH = 10
DEFAULT_CONFIGS = "1x1,2x1,1x2,2x2,2x3"


def parse_shape(text: str) -> SwarmShape:
    """`DxR` with D, R >= 1; ValueError otherwise."""
    parts = text.strip().lower().split("x")
    if len(parts) != 2 or not all(part.isdigit() and int(part) >= 1 for part in parts):
        raise ValueError(f"configuration {text!r} is not DxR with D, R >= 1 (for example 2x3)")
    return SwarmShape(int(parts[0]), int(parts[1]))


def curve_points(curve: Curve) -> list[dict[str, float]]:
    return [{"step": step, "val_loss": loss} for step, loss in curve.items()]


def trainer_curve(preset: str, stages: int, steps: int, seed: int, corpus: Corpus) -> Curve:
    """Validation loss of a `steps`-step single-process run: before training and every EVAL_EVERY steps."""
    curve: Curve = {}

    def progress(p: Progress) -> None:
        if p.val_loss is not None:
            curve[p.step] = p.val_loss

    config = TrainConfig(preset=preset, stages=stages, steps=steps, seed=seed, eval_every=EVAL_EVERY)
    result = train(config, progress, corpus=corpus)
    return {0: result.initial_val_loss, **curve}


def mean_per_step(points: list[dict[str, Any]]) -> Curve:
    """A report's `val_curve` on the evaluation grid: each point at the nearest multiple of EVAL_EVERY, the
    mean of the points there. A data node that catches up with the swarm clock skips steps, so it may
    evaluate a step or two off the grid (at 26 rather than 25, or finish at 99 of 100)."""
    by_step: dict[int, list[float]] = defaultdict(list)
    for point in points:
        by_step[EVAL_EVERY * round(int(point["step"]) / EVAL_EVERY)].append(float(point["val_loss"]))
    return {step: statistics.fmean(losses) for step, losses in sorted(by_step.items())}


def swarm_run(
    shape: SwarmShape,
    seed: int,
    checkfree_plus: bool,
    repeat: int,
    args: argparse.Namespace,
    stages: int,
    base: Path,
) -> dict[str, Any]:
    """One calm local swarm; the figures of its report (or why there are none)."""
    out = base / (
        f"{shape.name}-cfp-{label(checkfree_plus)}-seed{seed}" + (f"-run{repeat}" if repeat else "")
    )
    timeout = SECONDS_PER_BATCH * shape.batches_per_step * args.steps
    command = [
        sys.executable,
        "-m",
        "swarmnode",
        "up",
        "--calm",
        "--data-nodes",
        str(shape.data_nodes),
        "--replicas",
        str(shape.replicas),
        "--steps",
        str(args.steps),
        "--seed",
        str(seed),
        "--checkfree-plus" if checkfree_plus else "--no-checkfree-plus",
        "--stages",
        str(stages),
        "--preset",
        args.preset,
        "--run-id",
        f"quality{uuid.uuid4().hex[:8]}",
        "--timeout",
        str(timeout),
        "--out",
        str(out),
    ]
    started = time.monotonic()
    returncode = run_up(command, out.name, base, timeout + GRACE_S)
    seconds = time.monotonic() - started
    report = read_report(out / "report.json")
    curve = mean_per_step(report.get("val_curve") or []) if report else {}
    outcome = report["outcome"] if report else "no report"
    if returncode is None:
        outcome = f"{outcome} (stopped after {seconds:.0f} s)"
    ok = outcome == "completed" and args.steps in curve
    if not args.keep and ok:
        shutil.rmtree(out, ignore_errors=True)
        for log in (base / f"{out.name}.out", base / f"{out.name}.err"):
            log.unlink(missing_ok=True)
    return {
        "config": shape.name,
        "data_nodes": shape.data_nodes,
        "replicas": shape.replicas,
        "batches_per_step": shape.batches_per_step,
        "seed": seed,
        "repeat": repeat,
        "checkfree_plus": checkfree_plus,
        "outcome": outcome,
        "returncode": returncode,
        "ok": ok,
        "val_at_steps": curve.get(args.steps),
        "val_loss": report.get("val_loss") if report else None,
        "val_curve": curve_points(curve),
        "report_val_curve": report.get("val_curve") if report else None,
        "noloco": report.get("noloco") if report else None,
        "wall_seconds": report.get("wall_seconds") if report else None,
        "process_seconds": round(seconds, 1),
        "tokens_per_second": report.get("tokens_per_second") if report else None,
        "output": str(out) if out.exists() else None,
    }


Plan = list[tuple[SwarmShape, bool, int, int]]  # shape, CheckFree+, seed, repeat


def run_swarms(plan: Plan, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every planned swarm, one after the other."""
    base = args.out_dir if args.out_dir is not None else Path(mkdtemp(prefix="swarm-quality-"))
    base.mkdir(parents=True, exist_ok=True)
    runs = []
    for n, (shape, checkfree_plus, seed, repeat) in enumerate(plan, 1):
        run = swarm_run(shape, seed, checkfree_plus, repeat, args, args.n_stages, base)
        runs.append(run)
        val = "-" if run["val_at_steps"] is None else f"{run['val_at_steps']:.3f}"
        print(
            f"# run {n}/{len(plan)}: {shape.name} CheckFree+ {label(checkfree_plus)} seed {seed} "
            f"(repeat {repeat}): "
            f"{run['outcome']}, validation {val}, {run['process_seconds']:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    if args.out_dir is None and not args.keep and not any(base.iterdir()):
        base.rmdir()
    else:
        print(f"# swarm outputs in {base}", file=sys.stderr)
    return runs


def earlier_runs(path: Path, plan: Plan) -> list[dict[str, Any]]:
    """The planned runs out of an earlier `--json` file; SystemExit naming the first one it lacks."""
    try:
        stored = json.loads(path.read_text())["runs"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SystemExit(f"--swarm-runs {path}: no runs to read ({error})") from None
    by_key = {(r["config"], r["checkfree_plus"], r["seed"], r.get("repeat", 0)): r for r in stored}
    runs = []
    for shape, checkfree_plus, seed, repeat in plan:
        run = by_key.get((shape.name, checkfree_plus, seed, repeat))
        if run is None:
            raise SystemExit(
                f"--swarm-runs {path} has no run of {shape.name}, CheckFree+ "
                f"{label(checkfree_plus)}, seed {seed}, repeat {repeat}"
            )
        runs.append(run)
    return runs


def earlier_trainer(path: Path, args: argparse.Namespace) -> dict[tuple[int, int], Curve]:
    """The trainer's curves of an earlier `--json` file, by (steps, seed); SystemExit if its preset or stages
    differ from this run's."""
    try:
        stored = json.loads(path.read_text())
        settings = stored["settings"]
        curves = {
            (int(run["steps"]), int(run["seed"])): {
                int(p["step"]): float(p["val_loss"]) for p in run["val_curve"]
            }
            for run in stored["trainer"]
        }
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SystemExit(f"--trainer-runs {path}: no trainer runs to read ({error})") from None
    if (settings.get("preset"), settings.get("stages")) != (args.preset, args.n_stages):
        raise SystemExit(
            f"--trainer-runs {path} trained {settings.get('preset')} in {settings.get('stages')} stages"
        )
    return curves


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="DxR list, comma separated")
    parser.add_argument("--seeds", default="0,1,2", help="comma separated")
    parser.add_argument("--steps", type=int, default=100, help=f"data-node steps, a multiple of {EVAL_EVERY}")
    parser.add_argument("--stages", type=int, default=None, help="transformer stages (default: the preset's)")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--checkfree-plus", choices=("on", "off", "both"), default="both")
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs of each configuration and seed (the spread of one seed)"
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="where the swarms' outputs go (default: a new temporary folder)",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep every swarm's output (not only failed ones)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write every run and the summary here")
    parser.add_argument("--plot", type=Path, default=None, help="also plot the validation curves to this PNG")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the tables here")
    parser.add_argument(
        "--trainer-runs",
        type=Path,
        default=None,
        help="take the trainer's curves from an earlier --json file (the same preset and stages) instead of "
        "training them again",
    )
    parser.add_argument(
        "--swarm-runs",
        type=Path,
        default=None,
        help="take the swarm runs from an earlier --json file instead of running them (the trainer reruns)",
    )
    args = parser.parse_args()
    try:
        args.shapes = list(dict.fromkeys(parse_shape(text) for text in args.configs.split(",")))
        args.seed_list = list(dict.fromkeys(int(seed) for seed in args.seeds.split(",")))
        preset = get_preset(args.preset)
        args.n_stages = preset.n_stages if args.stages is None else args.stages
        stage_layers(preset.model, 1, args.n_stages)  # raises unless the layers split evenly
    except ValueError as error:
        parser.error(str(error))
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.steps < EVAL_EVERY or args.steps % EVAL_EVERY:
        parser.error(
            f"--steps must be a positive multiple of {EVAL_EVERY}, the data nodes' evaluation period"
        )
    args.settings = {"on": [True], "off": [False], "both": [True, False]}[args.checkfree_plus]
    if args.out_dir is not None:
        taken = sorted(path.name for path in args.out_dir.glob("*-cfp-*-seed*"))
        if taken:
            parser.error(f"--out-dir {args.out_dir} already holds swarm outputs ({taken[0]}, ...)")
    return args


def main() -> None:
    args = parse_args()
    steps, seeds, shapes = args.steps, args.seed_list, args.shapes
    corpus = load_corpus(None, None, get_preset(args.preset).vocab_size)

    lengths = sorted({steps} | {shape.batches_per_step * steps for shape in shapes})
    torch.set_num_threads(1)  # a daemon's budget; two threads on a busy 2-core machine ran 10x slower
    trainer: dict[int, dict[int, Curve]] = {length: {} for length in lengths}
    stored = {} if args.trainer_runs is None else earlier_trainer(args.trainer_runs, args)
    for length in lengths:
        for seed in seeds:
            if (length, seed) in stored:
                trainer[length][seed] = stored[(length, seed)]
                continue
            started = time.monotonic()
            trainer[length][seed] = trainer_curve(args.preset, args.n_stages, length, seed, corpus)
            print(
                f"# trainer {length} steps, seed {seed}: validation {trainer[length][seed][length]:.3f} "
                f"in {time.monotonic() - started:.0f} s",
                file=sys.stderr,
                flush=True,
            )

    plan = [
        (shape, cfp, seed, repeat)
        for cfp in args.settings
        for shape in shapes
        for seed in seeds
        for repeat in range(args.repeats)
    ]
    runs = run_swarms(plan, args) if args.swarm_runs is None else earlier_runs(args.swarm_runs, plan)

    rows = summarise(runs, shapes, args.settings, seeds, trainer, steps)
    tables = [
        f"Validation loss at data-node step {steps} ({args.preset}, {args.n_stages} stages, seeds "
        f"{args.seeds}); ratios are means of per-seed ratios; `!`: replicas worse by more than "
        f"{REPLICA_TOLERANCE - 1:.0%}\n\n{summary_table(rows, steps)}"
    ]
    cfp_rows = on_off(runs, shapes) if len(args.settings) == 2 else []
    if cfp_rows:
        tables.append(f"CheckFree+ on over off, validation loss at step {steps}\n\n{on_off_table(cfp_rows)}")
    repeat_rows = repeatability(runs)
    if repeat_rows:
        table = repeatability_table(repeat_rows)
        tables.append(f"Runs of one seed, validation loss at step {steps}\n\n{table}")
    print("\n\n".join(tables))
    if args.markdown is not None:
        args.markdown.write_text("\n\n".join(tables) + "\n")
    if args.plot is not None:
        plot(args.plot, runs, shapes, args.settings, trainer[steps], steps)
    if args.json is not None:
        results = {
            "settings": {
                "preset": args.preset,
                "stages": args.n_stages,
                "steps": steps,
                "seeds": seeds,
                "configs": [shape.name for shape in shapes],
                "checkfree_plus": [label(cfp) for cfp in args.settings],
            },
            "trainer": [
                {"steps": length, "seed": seed, "val_curve": curve_points(curve)}
                for length, by_seed in trainer.items()
                for seed, curve in by_seed.items()
            ],
            "runs": runs,
            "summary": rows,
            "checkfree_plus_on_over_off": cfp_rows,
            "repeatability": repeat_rows,
        }
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
