"""Wall-clock to a target loss under stage failures (spec/checkfree.md, the paper's Table 2 shape).

A model of the tiny preset's dimensions in 6 stages of one layer trains until its validation loss reaches the
target: the loss a failure-free run of the same seed reaches after `target_steps` steps (both as the mean of
the last 3 evaluations, 4 steps apart: one evaluation is too noisy to be a target). Each transformer
stage fails with probability p in each iteration, drawn independently (the paper's failure model); the draws
of a (seed, rate) are the same for every method, indexed by executed iteration. Methods:

- `checkpointing`: a checkpoint every K steps; a failure rolls the whole model back to it (the steps since
  are trained again on the same batches). The paper checkpoints the 500M model every 100 iterations at the
  rates below; the full mode keeps that interval relative to its failure rates (K x rate scale = 100: K =
  50), since checkpoints much more frequent than failures cost little (K = 10 at 2x the rates put
  checkpointing first in five of the six comparisons); the quick mode checkpoints every 10 at 7x (70),
  smoke every 3;
- `redundant`: Bamboo-style redundant computation: a failure loses nothing, every iteration is slower (each
  stage also runs its successor's forward); its trajectory is the failure-free run's;
- `checkfree`: lost stages rebuilt as `protocols.checkfree.plan_recovery` plans them (CheckFree+ off);
- `checkfree_plus`: CheckFree+ swaps on, copies of E and E' refreshed every 10 steps, plans with CheckFree+;
- `no_failure`: the failure-free run, for reference.

Times are measured in this run, in this process: a plain iteration, and against it in interleaved pairs (the
load of a shared machine changes) an iteration with the redundant forward and a CheckFree+ iteration; taking
and restoring a checkpoint, each rebuild, each copy refresh. Wall-clock is expressed in plain iterations.
What one process cannot measure is the start of a replacement node; it is
added per failure event as `J` plain iterations, under two assumptions: the paper's (about 30 s to recover
at 92 s per iteration: J = 0.33) and the default loopback swarm of the tiny preset (a replacement's first
iteration through its stage 4.74 s after the kill on an idle machine,
benchmarks/results/recovery_time_compare_idle_session13.json, at a median swarm step of 0.735 s: J = 6.5).
Rates are the paper's per-iteration probabilities (0.0009, 0.002, 0.004 for 5%, 10%, 16% per hour)
scaled up so that a run this short sees several failures.

    python benchmarks/repro/failure_wallclock.py --quick --json out.json --plot out.png
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from _report import Row, cpu_seconds, result, table, write_json
from _staged import Data, Setup, StagedModel, common_args, mean, mode_name

PAPER_RATES = {"5%": 0.0009, "10%": 0.002, "16%": 0.004}
JOIN_ITERATIONS = {"paper J=0.33": 30 / 92, "loopback swarm J=6.5": 6.5}
METHODS = ("checkpointing", "redundant", "checkfree", "checkfree_plus")
PAPER_HOURS = {  # 500M, hours to validation loss 2.85 (spec/checkfree.md)
    "checkpointing": (558.2, 621.7, 634.4),
    "redundant": (419.6, 419.6, 419.6),
    "checkfree": (367.8, 405.9, 563.0),
    "checkfree_plus": (355.1, 367.8, 460.6),
}
COPY_REFRESH_STEPS = 10
# mode: (setup, target steps, seeds, rate scale, checkpoint every, evaluate every, cap in target runs)
MODES = {
    "smoke": (Setup(seq_len=32, val_batches=1), 6, 1, 20.0, 3, 2, 3),
    "quick": (Setup(), 48, 2, 7.0, 10, 4, 3),
    "full": (Setup(val_batches=16), 200, 3, 2.0, 50, 5, 3),
}


@dataclass
class Run:
    """What one method did until it reached the target (or the cap)."""

    iterations: int = 0  # executed, including those a rollback threw away
    reached: bool = False
    events: int = 0  # iterations in which at least one stage failed
    stages_lost: int = 0
    saves: int = 0
    refreshes: int = 0
    overhead_s: float = 0.0  # measured seconds of saves, restores, rebuilds and refreshes
    methods: dict[str, int] = field(default_factory=dict)  # rebuild method -> count
    iteration_s: list[float] = field(default_factory=list)
    evals: dict[int, float] = field(default_factory=dict)  # model step -> validation loss


SMOOTH = 3  # a run reaches the target when the mean of its last SMOOTH evaluations does (one is noisy)


def timed_step(model: StagedModel, data: Data, run: Run, plus: bool) -> None:
    tick = time.perf_counter()
    model.train_step(data, checkfree_plus=plus)
    run.iteration_s.append(time.perf_counter() - tick)
    run.iterations += 1


def smoothed(evals: dict[int, float], step: int, every: int) -> float | None:
    """The mean of the evaluations at the last SMOOTH evaluated steps up to `step` (None if too few)."""
    steps = [step - i * every for i in range(SMOOTH)]
    if any(s not in evals for s in steps):
        return None
    return mean([evals[s] for s in steps])


def reached(model: StagedModel, data: Data, run: Run, target: float, every: int) -> bool:
    """Evaluate every `every` steps; evaluations are keyed by model step, so a rollback's lost steps are
    evaluated again as they are trained again."""
    if model.step % every:
        return False
    run.evals[model.step] = model.evaluate(data)
    loss = smoothed(run.evals, model.step, every)
    return loss is not None and loss <= target


def run_checkpointing(
    start: StagedModel, data: Data, draws: np.ndarray, target: float, every: int, ckpt_every: int
) -> Run:
    run, model = Run(), start.fork()
    checkpoint = model.fork()
    for failed in draws:
        if failed.any():
            tick = time.perf_counter()
            model = checkpoint.fork()
            run.overhead_s += time.perf_counter() - tick
            run.events, run.stages_lost = run.events + 1, run.stages_lost + int(failed.sum())
        timed_step(model, data, run, plus=False)
        if model.step % ckpt_every == 0:
            tick = time.perf_counter()
            checkpoint = model.fork()
            run.overhead_s += time.perf_counter() - tick
            run.saves += 1
        if reached(model, data, run, target, every):
            run.reached = True
            break
    return run


def run_checkfree(
    start: StagedModel, data: Data, draws: np.ndarray, target: float, every: int, plus: bool
) -> Run:
    run, model = Run(), start.fork()
    if plus:
        model.refresh_copies()
    for failed in draws:
        if failed.any():
            lost = {int(k) + 1 for k in np.flatnonzero(failed)}
            tick = time.perf_counter()
            plans = [model.plan(k, lost, checkfree_plus=plus) for k in sorted(lost)]
            for plan in plans:
                model.rebuild(plan)
                run.methods[plan.method.value] = run.methods.get(plan.method.value, 0) + 1
            run.overhead_s += time.perf_counter() - tick
            run.events, run.stages_lost = run.events + 1, run.stages_lost + len(lost)
        timed_step(model, data, run, plus=plus)
        if plus and model.step % COPY_REFRESH_STEPS == 0:
            tick = time.perf_counter()
            model.refresh_copies()
            run.overhead_s += time.perf_counter() - tick
            run.refreshes += 1
        if reached(model, data, run, target, every):
            run.reached = True
            break
    return run


def paired_ratio(model: StagedModel, data: Data, pairs: int, redundant: bool, plus: bool) -> float:
    """Median over interleaved pairs, on a fork, of the time of a variant iteration (with the redundant
    forward, or CheckFree+ order) over a plain one: both in the same moment of a shared machine's load."""
    fork, ratios = model.fork(), []
    for _ in range(pairs):
        tick = time.perf_counter()
        fork.train_step(data)
        plain = time.perf_counter() - tick
        tick = time.perf_counter()
        if redundant:
            fork.redundant_forward(data)
        fork.train_step(data, checkfree_plus=plus)
        ratios.append((time.perf_counter() - tick) / plain)
    return statistics.median(ratios)


def wallclock(
    method: str, run: Run, t_plain: float, join: float, red_ratio: float, swap_ratio: float
) -> float:
    """Time to target in plain iterations."""
    if method == "redundant":
        return run.iterations * red_ratio
    per_iteration = swap_ratio if method == "checkfree_plus" else 1.0
    return run.iterations * per_iteration + run.events * join + run.overhead_s / t_plain


def run_seed(setup: Setup, data: Data, seed: int, mode: tuple, rates: dict[str, float]) -> dict[str, object]:
    _, target_steps, _, _, ckpt_every, every, cap = mode
    start = StagedModel(setup, data.corpus.vocab_size, seed)
    if target_steps % every or target_steps < SMOOTH * every:
        raise ValueError(
            f"target steps {target_steps} must be a multiple of {every}, at least {SMOOTH * every}"
        )
    base, model = Run(), start.fork()
    for _ in range(target_steps):
        timed_step(model, data, base, plus=False)
        if model.step % every == 0:
            base.evals[model.step] = model.evaluate(data)
    target = smoothed(base.evals, target_steps, every)
    curve = sorted(base.evals.items())
    base.iterations = next(
        s for s, _ in curve if (v := smoothed(base.evals, s, every)) is not None and v <= target
    )
    base.reached = True
    pairs = max(3, target_steps // 10)
    red = paired_ratio(start, data, pairs, redundant=True, plus=False)
    swap = paired_ratio(start, data, pairs, redundant=False, plus=True)
    runs: dict[str, dict[str, Run]] = {}
    for label, p in rates.items():
        rng = np.random.default_rng([seed, round(p * 1e9)])
        draws = rng.random((cap * target_steps, setup.n_stages)) < p
        runs[label] = {
            "checkpointing": run_checkpointing(start, data, draws, target, every, ckpt_every),
            "redundant": base,
            "checkfree": run_checkfree(start, data, draws, target, every, plus=False),
            "checkfree_plus": run_checkfree(start, data, draws, target, every, plus=True),
        }
    t_plain = statistics.median(base.iteration_s)
    times = {
        jname: {
            label: {m: wallclock(m, by[m], t_plain, j, red, swap) for m in METHODS}
            | {"no_failure": base.iterations}
            for label, by in runs.items()
        }
        for jname, j in JOIN_ITERATIONS.items()
    }
    detail = {
        label: {
            m: {k: v for k, v in by[m].__dict__.items() if k not in ("iteration_s", "evals")} for m in METHODS
        }
        for label, by in runs.items()
    }
    return {
        "seed": seed,
        "target": target,
        "baseline_curve": curve,
        "plain_iteration_s": t_plain,
        "redundant_ratio": red,
        "swap_ratio": swap,
        "times": times,
        "runs": detail,
    }


def order_verdict(times: dict[str, dict[str, float]], labels: list[str]) -> str:
    """Compare the order of the mean wall-clock at each rate with the paper's order at the same rate."""
    matches, lines = 0, []
    for label, paper in zip(labels, range(3), strict=True):
        ours = sorted(METHODS, key=lambda m: times[label][m])
        theirs = sorted(METHODS, key=lambda m: PAPER_HOURS[m][paper])
        matches += ours == theirs
        lines.append(f"{label}: {' < '.join(ours)} (paper: {' < '.join(theirs)})")
    checkfree_wins = all(
        min(times[label]["checkfree"], times[label]["checkfree_plus"]) < times[label]["checkpointing"]
        for label in labels
    )
    head = (
        "reproduced"
        if matches == len(labels)
        else "in shape"
        if checkfree_wins and matches >= 1
        else "not reproduced"
    )
    return f"{head} ({matches} of {len(labels)} rates in the paper's order): " + "; ".join(lines)


def main() -> None:
    parser = common_args(__doc__.splitlines()[0])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    name = mode_name(args)
    mode = MODES[name]
    setup, target_steps, n_seeds, scale = mode[0], mode[1], args.seeds or mode[2], mode[3]
    rates = {label: p * scale for label, p in PAPER_RATES.items()}
    data = Data(setup)
    started = time.perf_counter()
    seeds = []
    for seed in range(n_seeds):
        seeds.append(run_seed(setup, data, seed, mode, rates))
        print(f"seed {seed} done at {time.perf_counter() - started:.0f} s", flush=True)

    rows, means = [], {}
    for jname in JOIN_ITERATIONS:
        means[jname] = {}
        for label in rates:
            means[jname][label] = {}
            for m in (*METHODS, "no_failure"):
                values = tuple(float(s["times"][jname][label][m]) for s in seeds)
                means[jname][label][m] = mean(list(values))
                if m != "no_failure" or jname == next(iter(JOIN_ITERATIONS)):
                    rows.append(Row(f"{m} @{label}", f"iterations to target, {jname}", values))
    verdicts = {jname: order_verdict(means[jname], list(rates)) for jname in JOIN_ITERATIONS}
    censored = sum(not r["reached"] for s in seeds for by in s["runs"].values() for r in by.values())
    body = result(
        "CheckFree(+) reaches a target loss faster than checkpointing, and than redundant computation at "
        "low failure rates (paper Table 2, 500M)",
        rows,
        verdicts[next(iter(JOIN_ITERATIONS))],
        verdict_by_join=verdicts,
        mode=name,
        stages=setup.n_stages,
        target_steps=target_steps,
        rates=rates,
        rate_scale=scale,
        checkpoint_every=mode[4],
        copy_refresh_steps=COPY_REFRESH_STEPS,
        join_iterations=JOIN_ITERATIONS,
        runs_not_reaching_target=censored,
        setup=setup.__dict__,
        seeds=seeds,
        seconds=round(time.perf_counter() - started, 1),
        cpu_seconds=cpu_seconds(),
    )
    print(table(rows))
    for jname, text in verdicts.items():
        print(f"{jname}: {text}")
    if args.json:
        write_json(Path(args.json), body)
    if args.plot:
        plot_lines(Path(args.plot), means, list(rates), name, n_seeds)


def plot_lines(path: Path, means: dict, labels: list[str], mode: str, n_seeds: int) -> None:
    """One panel per join assumption and one for the paper: wall-clock to target against failure rate."""
    from matplotlib.figure import Figure

    panels = [(jname, means[jname], "plain iterations to target") for jname in means]
    paper = {label: {m: PAPER_HOURS[m][i] for m in METHODS} for i, label in enumerate(labels)}
    panels.append(("paper, 500M (hours to loss 2.85)", paper, "hours"))
    fig = Figure(figsize=(4.2 * len(panels), 3.4), layout="constrained")
    for ax, (title, values, unit) in zip(fig.subplots(1, len(panels)), panels, strict=True):
        for m in METHODS:
            ax.plot(labels, [values[label][m] for label in labels], marker="o", label=m)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("failure rate (paper's label)")
        ax.set_ylabel(unit)
    fig.axes[0].legend(fontsize=7)
    fig.suptitle(f"Time to target loss under stage failures ({mode}, {n_seeds} seeds)", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
