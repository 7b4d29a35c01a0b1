"""Swarm efficiency: a loopback swarm's tokens/s over the single-process trainer's, same model and batch.

For each case (a model and a microbatch size) and each number M of microbatches per iteration, in one run:

1. the single-process reference trainer (`swarmnode.trainer.train`, the same stage pieces and optimizer the
   daemons run) trains a few steps with 1 torch thread, the budget of one daemon (`--baseline-threads 1,2`
   adds 2 threads; on a loaded 2-core machine that was often slower than 1: the threads wait on each other);
2. a swarm of separate processes on loopback trains the same model and batch: a bootstrap peer, one data
   node and one replica per transformer stage, each daemon with 1 torch thread (tests/swarm_harness.py).

Swarm tokens/s is wall-clock: the tokens of the steady iterations over the time between their step events. The
first `SKIP` iterations are warm-up: the first ones, and the first refresh of the CheckFree+ copies in
training (`copy_refresh_steps`, 10), in which each stage's heap grows once to hold the copies beside a pass's
gradients (26,000-56,000 pages faulted in at up to 40 us each, where later refreshes fault a few thousand:
that iteration took 1.8-5.0 s, 2.6 in the mean of 8 runs, where the others took 1.7). The step events of every
iteration are kept in the `--json` rows (`step_times`). Efficiency = swarm tokens/s / single-process tokens/s
(the first of `--baseline-threads`). The machine is shared and its speed drifts by 10-20% within minutes, so
the single process is measured before and after the swarm, and the ratio is against the mean of the two;
`--rounds N` repeats single process and swarm N times in turn (N + 1 single-process runs, each swarm between
two) and prints each round's row and the median efficiency.

Where the time goes, from what the daemons expose: the data node's step events give seconds per iteration
(`s/iter`; the time between step events also holds the planning of the next iteration, `plan`), and every
node's DHT record gives tokens per busy second of its compute thread, so `busy` = tokens per iteration /
that rate = the seconds each node's compute thread works per iteration (stage 0: embedding, head, loss;
every node: forward, backward, optimizer step; cumulative over the run, warm-up included). The rest of each
node's iteration is waiting: for its neighbours (pipeline bubbles: one data node starting M microbatches at
once leaves stages idle at the start and end of every iteration), for the network (p2pd, serialisation).
`sum busy / single s/step` above 1 is CPU lost to running four processes on two cores (busy seconds
include time-slicing) and to per-process overhead. `load` is the 1-minute load average when the swarm run
ended (the swarm itself adds 2-4): the machine is shared and figures move by 30-50% between runs.

The default `swarmnode up` swarm (`--up-steps N`, N > 0): `up --calm --steps N` (2 data nodes, 3 stages x
2 replicas, 8 daemons with 1 torch thread each) against the single-process trainer on the tiny preset's own
batch (2 microbatches of 4 x 128 tokens a step), with 1 thread and with every usable core. Each data node
sends its microbatches through every replica, so a swarm step is 4 single-process steps of tokens. `whole
run` is the report's tokens/s (first to last step, the validation passes included); `steady` is tokens per
step over the report's median iteration seconds. The single process's figures exclude its validation.

    python benchmarks/swarm_efficiency.py                  # tiny and llama-124m (narrowed), M = 1 and 4
    python benchmarks/swarm_efficiency.py --cases tiny --microbatches 1,2,4,8 --json out.json
    python benchmarks/swarm_efficiency.py --cases llama-124m --microbatches 4 --baseline-threads 2 --rounds 3
    python benchmarks/swarm_efficiency.py --cases llama-124m-2 --microbatches 4 --baseline-threads 2
    python benchmarks/swarm_efficiency.py --cases none --up-steps 100

Takes four to eight minutes on two cores with M = 1 and 4 (each swarm needs 20-40 s to start); M = 8 for
both cases adds about six more; `--up-steps 100` about two.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from swarmnode.malloc_tuning import tune_malloc

if __name__ == "__main__":  # before torch starts a thread: the single process allocates as `swarmnode train`
    tune_malloc()

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from swarm_harness import LocalTestSwarm, poll, stage_peers  # noqa: E402
from up_runs import GRACE_S, read_report, run_up  # noqa: E402

from swarmnode import trainer  # noqa: E402
from swarmnode.data import Corpus, load_corpus  # noqa: E402
from swarmnode.launcher.config import usable_cpus  # noqa: E402
from swarmnode.presets import Preset, get_preset  # noqa: E402
from swarmnode.runspec import RunSpec  # noqa: E402

VOCAB = 4096  # the default stdlib tokenizer; the paper presets' 32,000 would only grow E and E'


SKIP = RunSpec().copy_refresh_steps + 2  # warm-up: the first iterations and the first copy refresh (above)


@dataclass(frozen=True)
class Case:
    """A model and the batch of one microbatch; `stages` transformer stages of `layers / stages` layers."""

    name: str
    preset: str
    stages: int
    batch_size: int
    seq_len: int
    baseline_steps: int  # single-process steps (the first is warm-up)
    swarm_steps: int  # swarm iterations (the first `SKIP` are warm-up)


CASES = {
    # 3 stages of 2 layers (dim 128): about 50 ms of compute per stage and microbatch (8 x 128 tokens)
    "tiny": Case("tiny", "tiny", 3, 8, 128, baseline_steps=12, swarm_steps=SKIP + 12),
    # llama-124m's layers (dim 512, ffn 4352), 3 stages of 4 layers, 1 x 128 tokens: 31M parameters per
    # stage, about 0.2 s of compute (forward and backward) per stage and microbatch on one thread. 12
    # iterations measured after the warm-up: of 6, one was often 1.5x the rest
    "llama-124m": Case("llama-124m", "llama-124m", 3, 1, 128, baseline_steps=6, swarm_steps=SKIP + 12),
    # the same model as 2 stages of 6 layers: on two cores, about a core per stage, as volunteers' machines
    # each serve one (the data node's head and embedding are small beside a stage)
    "llama-124m-2": Case("llama-124m-2", "llama-124m", 2, 1, 128, baseline_steps=6, swarm_steps=SKIP + 12),
}


def make_preset(case: Case, microbatches: int) -> Preset:
    base = get_preset(case.preset)
    return replace(
        base,
        model=replace(base.model, vocab_size=VOCAB),
        n_stages=case.stages,
        batch_size=case.batch_size,
        seq_len=case.seq_len,
        microbatches=microbatches,
    )


def single_process(case: Case, microbatches: int, threads: int, corpus: Corpus) -> float:
    """Steady tokens/s of `swarmnode.trainer.train` on the case's model and batch (warm-up step excluded)."""
    preset = make_preset(case, microbatches)
    tokens_per_step = microbatches * case.batch_size * case.seq_len
    compute_at: dict[int, float] = {}

    def progress(p: trainer.Progress) -> None:  # cumulative tokens/s -> cumulative compute seconds
        compute_at[p.step] = p.step * tokens_per_step / p.tokens_per_second

    original = trainer.get_preset
    trainer.get_preset = lambda name: preset if name == case.preset else original(name)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        config = trainer.TrainConfig(
            case.preset, case.stages, case.baseline_steps, eval_every=10**6, eval_batches=1
        )
        trainer.train(config, progress, corpus=corpus)
    finally:
        trainer.get_preset = original
        torch.set_num_threads(previous_threads)
    last = case.baseline_steps
    return (last - 1) * tokens_per_step / (compute_at[last] - compute_at[1])


def swarm_run(case: Case, microbatches: int, folder: Path, node_threads: int = 1) -> dict[str, Any]:
    """Train the case on a loopback swarm, each daemon with `node_threads` torch threads; tokens/s, seconds
    per iteration and each node's busy seconds."""
    run = {
        "preset": case.preset,
        "stages": case.stages,
        "vocab_size": VOCAB,
        "batch_size": case.batch_size,
        "seq_len": case.seq_len,
        "microbatches": microbatches,
        "total_steps": case.swarm_steps,
        "noloco_inner_steps": 1000,  # one replica per stage: no averaging to measure
        "hop_timeout_s": 60.0,
        "iteration_timeout_s": 120.0,
    }
    run_file = folder / "run.json"
    run_file.write_text(json.dumps(run))
    with LocalTestSwarm(folder, run_id=f"eff{uuid.uuid4().hex[:8]}") as swarm:
        swarm.bootstrap("--run", str(run_file), timeout=120)
        stages = [swarm.join(k, threads=node_threads) for k in range(1, case.stages + 1)]
        swarm.wait_online(*stages, timeout=180)
        data = swarm.join(0, threads=node_threads)
        watcher = swarm.watch_status()
        data.wait_event("online", 180)
        data.wait_event("step", 600, where=lambda e: e["step"] >= case.swarm_steps)

        def late_snapshot() -> dict[str, Any] | None:  # records as of the last iterations, all nodes online
            for snapshot in reversed(swarm.snapshots(watcher)):
                peers = [stage_peers(snapshot, k) for k in range(case.stages + 1)]
                if all(len(p) == 1 for p in peers) and peers[0][0]["step"] >= case.swarm_steps - 2:
                    return snapshot
            return None

        snapshot = poll(late_snapshot, 60, "a status snapshot from the end of the run")
        steps = data.events("step")
    steady = steps[SKIP:]
    window = steady[-1]["time"] - steps[SKIP - 1]["time"]  # from the end of the warm-up to the last step
    tokens = sum(e["tokens"] for e in steady)
    per_iteration = statistics.mean(e["seconds"] for e in steady)
    wall_per_iteration = window / len(steady)
    tokens_per_iteration = microbatches * case.batch_size * case.seq_len
    busy = []
    for k in range(case.stages + 1):
        rate = stage_peers(snapshot, k)[0]["tokens_per_second"]
        busy.append(tokens_per_iteration / rate if rate > 0 else float("nan"))
    return {
        "tokens_per_second": tokens / window,
        "seconds_per_iteration": per_iteration,
        "wall_per_iteration": wall_per_iteration,
        "busy": busy,
        "lost": sum(e["lost"] for e in steps),
        "load": os.getloadavg()[0],  # the machine is shared: how busy it was
        "step_times": [round(e["time"], 3) for e in steps],
        "paths": sorted({tuple(p) for e in steady for p in e["paths"]}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases", default="tiny,llama-124m", help=f"comma separated: {', '.join(CASES)} (or none)"
    )
    parser.add_argument("--microbatches", default="1,4", help="values of M, comma separated")
    parser.add_argument("--baseline-threads", default="1", help="torch threads of the single-process runs")
    parser.add_argument(
        "--node-threads",
        default="1",
        help="torch threads of each swarm daemon: a swarm per value, comma separated",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="single process and swarm in turn, N times (a row per round)"
    )
    parser.add_argument(
        "--up-steps", type=int, default=0, help="also measure the default `swarmnode up` swarm over N steps"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    cases = [CASES[name] for name in args.cases.split(",") if name != "none"]
    ms = [int(m) for m in args.microbatches.split(",")]
    threads = [int(t) for t in args.baseline_threads.split(",")]
    node_threads = [int(t) for t in args.node_threads.split(",")]
    corpus = load_corpus(None, None, VOCAB)

    rows = []
    for case in cases:
        for m in ms:
            rows += rounds(case, m, threads, node_threads, args.rounds, corpus)

    up = up_row(args.up_steps, corpus) if args.up_steps > 0 else None
    if rows:
        print(table(rows))
        if args.rounds > 1:
            print(median_lines(rows))
    if up is not None:
        print(up_table(up))
    if args.json is not None:
        args.json.write_text(json.dumps({"cases": rows, "up": up}, indent=1, default=list))


def rounds(
    case: Case, m: int, threads: list[int], node_threads: list[int], count: int, corpus: Corpus
) -> list[dict[str, Any]]:
    """`count` rounds of the single process (every thread count) and a swarm per node-thread count, then the
    single process once more; each swarm's row is measured against the mean of the runs before and after
    it (`single`; both kept, `single_before` and `single_after`)."""
    started = time.monotonic()
    before = {t: single_process(case, m, t, corpus) for t in threads}
    rows = []
    for round_index in range(count):
        swarms = {}
        for n in node_threads:
            with TemporaryDirectory(prefix="swarm-efficiency-") as tmp:
                swarms[n] = swarm_run(case, m, Path(tmp), n)
        after = {t: single_process(case, m, t, corpus) for t in threads}
        for n, swarm in swarms.items():
            row = {
                "case": case.name,
                "batch": f"{case.batch_size}x{case.seq_len}",
                "M": m,
                "round": round_index,
                "single": {t: (before[t] + after[t]) / 2 for t in threads},
                "single_before": before,
                "single_after": after,
            }
            row.update(swarm, tokens_per_iteration=m * case.batch_size * case.seq_len, node_threads=n)
            row["minutes"] = (time.monotonic() - started) / 60
            rows.append(row)
        print(
            f"# {case.name} M={m} round {round_index + 1} of {count}: {rows[-1]['minutes']:.1f} min",
            file=sys.stderr,
            flush=True,
        )
        before = after
    return rows


def efficiency(row: dict[str, Any]) -> float:
    """The swarm's tokens/s over the single process's (the first of `--baseline-threads`)."""
    return row["tokens_per_second"] / next(iter(row["single"].values()))


def median_lines(rows: list[dict[str, Any]]) -> str:
    """One line per case, M and node threads: the median efficiency over the rounds, and its range."""
    groups: dict[tuple[str, int, int], list[float]] = {}
    for r in rows:
        groups.setdefault((r["case"], r["M"], r["node_threads"]), []).append(efficiency(r))
    return "\n".join(
        f"{name} M={m} node threads {n}: median efficiency {statistics.median(e):.2f} over {len(e)} rounds "
        f"({min(e):.2f}-{max(e):.2f})"
        for (name, m, n), e in groups.items()
    )


UP_CASE = Case("up", "tiny", 3, 4, 128, baseline_steps=12, swarm_steps=0)  # the tiny preset's own batch


def up_row(steps: int, corpus: Corpus) -> dict[str, Any]:
    """The default `swarmnode up` swarm, calm, over `steps` steps, and the single process on its batch,
    measured before and after the swarm (`single`: the mean of the two)."""
    preset = get_preset("tiny")
    threads = sorted({1, usable_cpus()})
    before = {t: single_process(UP_CASE, preset.microbatches, t, corpus) for t in threads}
    with TemporaryDirectory(prefix="swarm-efficiency-up-") as tmp:
        out = Path(tmp) / "up"
        up = ["up", "--calm", "--steps", str(steps), "--out", str(out)]
        command = [sys.executable, "-m", "swarmnode", *up]
        code = run_up(command, "up", Path(tmp), 60.0 * steps + GRACE_S)
        report = read_report(out / "report.json") or {}
    if code != 0 or not report.get("tokens_per_second"):
        raise SystemExit(f"swarmnode up failed (exit {code}): {report.get('message', 'no report')}")
    after = {t: single_process(UP_CASE, preset.microbatches, t, corpus) for t in threads}
    settings = report["settings"]
    pipelines_per_step = settings["data_nodes"] * settings["replicas"]
    tokens_per_step = pipelines_per_step * preset.microbatches * preset.batch_size * preset.seq_len
    return {
        "steps": steps,
        "daemons": settings["data_nodes"] + settings["replicas"] * settings["stages"],
        "tokens_per_step": tokens_per_step,
        "whole_run": report["tokens_per_second"],
        "steady": tokens_per_step / report["iteration_seconds"]["median"],
        "iteration_median_s": report["iteration_seconds"]["median"],
        "wall_seconds": report["wall_seconds"],
        "single": {t: (before[t] + after[t]) / 2 for t in threads},
        "single_before": before,
        "single_after": after,
        "load": os.getloadavg()[0],
    }


def up_table(r: dict[str, Any]) -> str:
    """Markdown: the default swarm's tokens/s over the single process's, with 1 thread and every core."""
    head = (
        "| swarm | steps | tokens/step | s/step (median) | swarm tok/s: whole run / steady "
        "| single tok/s: mean (before, after) | whole run / single | steady / single | load |"
    )
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for threads, single in r["single"].items():
        before, after = r["single_before"][threads], r["single_after"][threads]
        lines.append(
            f"| `up` default, {r['daemons']} daemons | {r['steps']} | {r['tokens_per_step']} "
            f"| {r['iteration_median_s']:.3f} | {r['whole_run']:.0f} / {r['steady']:.0f} "
            f"| {single:.0f} ({before:.0f}, {after:.0f}; {threads} thr) "
            f"| {r['whole_run'] / single:.2f} | {r['steady'] / single:.2f} "
            f"| {r['load']:.1f} |"
        )
    return "\n".join(lines)


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: throughput of both, their ratio, and where each swarm iteration's time goes."""
    head = (
        "| case | batch | M | round | single tok/s: mean (before, after) | single s/step | node threads "
        "| swarm tok/s | efficiency "
        "| swarm s/iter (+ plan) | busy s/iter: stage 0, 1, ..., s | busiest node "
        "| sum busy / single s/step | lost | load |"
    )
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        busy = r["busy"]
        plan = r["wall_per_iteration"] - r["seconds_per_iteration"]
        swarm = r["tokens_per_second"]
        single = next(iter(r["single"].values()))
        single_step = r["tokens_per_iteration"] / single
        singles = " / ".join(
            f"{tps:.0f} ({r['single_before'][t]:.0f}, {r['single_after'][t]:.0f}; {t} thr)"
            for t, tps in r["single"].items()
        )
        lines.append(
            f"| {r['case']} | {r['batch']} | {r['M']} | {r['round'] + 1} | {singles} | {single_step:.2f} "
            f"| {r['node_threads']} | {swarm:.0f} "
            f"| {efficiency(r):.2f} | {r['seconds_per_iteration']:.2f} (+{plan:.2f}) "
            f"| {', '.join(f'{b:.2f}' for b in busy)} | {max(busy) / r['wall_per_iteration']:.0%} busy "
            f"| {sum(busy) / single_step:.2f} | {r['lost']} | {r['load']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
