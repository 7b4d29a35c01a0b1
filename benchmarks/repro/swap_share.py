"""CheckFree+ swap share: what swapping one microbatch in 2 (the paper's half) or in 4 costs when nothing
fails, and what it buys when S1 is lost, beside an edge copy (which costs nothing when nothing fails).

The model of `checkfree_plus.py` (the tiny preset's dimensions in 6 stages of one layer), here with 2
microbatches of 4 sequences a step (the tiny preset's) and 16 validation batches, trained `--steps` steps per
seed without swaps and with swaps of one microbatch in `every` (`protocols.checkfree.swaps_edge_pairs`; the
copies of `E` and `E'` refreshed every 10 steps). At the end S1 is lost and rebuilt as `plan_recovery` plans
it (with swaps: a copy of S2, which stood in for it; without: CheckFree's neighbour copy and, as another
fork, the edge copy of S1 taken `--copy-age` steps before the loss: the daemons' default), and training
goes on `--window` steps, beside a control that lost nothing. Printed per seed and as means: the cost of
the swaps (validation loss at the end over no swaps), S1's loss just after (over the loss before) and
`--window` steps later (over the control). With `--eval-every K`, also the cost along the way: every
regime's validation loss every K steps over no swaps' at the same step (does the cost shrink as the stages
learn both orders?).
`--stages` and `--layers` cut a deeper or finer model (the tiny preset's width, `--layers` layers in
`--stages` stages): does the cost depend on how much of the network a swap permutes? `--schedule cosine`
trains with the daemons' learning-rate schedule (a cosine to a tenth of the peak at `--steps`) instead of
the paper's constant rate.

    python benchmarks/repro/swap_share.py --json out.json
    python benchmarks/repro/swap_share.py --steps 400 --shares 0,2 --eval-every 50 --json longer.json
    python benchmarks/repro/swap_share.py --stages 12 --layers 12 --steps 150 --shares 0,2 --eval-every 25
    python benchmarks/repro/swap_share.py --stages 12 --layers 12 --steps 150 --shares 0,2 --schedule cosine
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from _report import write_json
from _staged import Data, Setup, StagedModel

SHARES = "0,2,4"  # 0: no swaps; else one microbatch in this many
REFRESH_STEPS = 10


def run(
    data: Data, setup: Setup, seed: int, every: int, steps: int, window: int, eval_every: int, copy_age: int
) -> dict[str, object]:
    """One regime of one seed: train (evaluating every `eval_every` steps, 0: only at the end), lose S1,
    rebuild, go on beside a control. Without swaps, S1 is also restored from an edge copy taken `copy_age`
    steps before the loss (`s1_copy_*`)."""
    plus = every > 0
    model = StagedModel(replace(setup, swap_every=every or 2), data.corpus.vocab_size, seed)
    if plus:
        model.refresh_copies()
    curve = {}
    for _ in range(steps):
        model.train_step(data, checkfree_plus=plus)
        if plus and model.step % REFRESH_STEPS == 0:
            model.refresh_copies()
        if not plus and model.step == steps - copy_age:
            model.refresh_edge_copies()
        if eval_every and model.step % eval_every == 0 and model.step < steps:
            curve[model.step] = model.evaluate(data)
    before = model.evaluate(data)
    curve[steps] = before
    control = model.fork()
    for _ in range(window):
        control.train_step(data, checkfree_plus=plus)
    out = {"val": before, "control_later": control.evaluate(data), "curve": curve}
    regimes = [("s1", False)] + ([("s1_copy", True)] if not plus else [])
    for name, from_copy in regimes:  # without swaps: CheckFree's neighbour copy, then the edge copy
        lost = model.fork()
        if not from_copy:
            lost.edge_copies = {}
        plan = lost.plan(1, {1}, plus or from_copy)
        lost.rebuild(plan)
        just_after = lost.evaluate(data)
        for _ in range(window):
            lost.train_step(data, checkfree_plus=plus)
        out |= {f"{name}_rebuild": plan.method.value, f"{name}_just_after": just_after}
        out[f"{name}_later"] = lost.evaluate(data)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="how many seeds, from --first-seed on")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--window", type=int, default=25)
    parser.add_argument("--shares", default=SHARES, help="swap one microbatch in N (0: none; must hold 0)")
    parser.add_argument(
        "--eval-every", type=int, default=0, help="also evaluate every K steps (0: only at the end)"
    )
    parser.add_argument("--stages", type=int, default=Setup.n_stages, help="transformer stages")
    parser.add_argument("--layers", type=int, default=Setup.n_layers, help="layers, split evenly over them")
    parser.add_argument(
        "--schedule",
        choices=("constant", "cosine"),
        default="constant",
        help="the learning rate after the warm-up: constant (the paper's) or the daemons' cosine decay",
    )
    parser.add_argument(
        "--copy-age",
        type=int,
        default=REFRESH_STEPS - 1,
        help="steps between the edge copy and the loss (default 9: the oldest a copy refreshed every 10 is)",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    try:
        shares = list(dict.fromkeys(int(share) for share in args.shares.split(",")))
    except ValueError as error:
        parser.error(f"--shares: {error}")
    if 0 not in shares or any(share < 0 or share == 1 for share in shares):
        parser.error("--shares must hold 0 (no swaps, the baseline) and periods of 2 or more")
    if args.eval_every < 0:
        parser.error("--eval-every must be 0 or more")
    if not 0 <= args.copy_age < args.steps:
        parser.error("--copy-age must lie in 0..--steps - 1")
    if args.stages < 4 or args.layers % args.stages:
        parser.error("--stages must be 4 or more (fewer never swap both pairs) and divide --layers")
    torch.set_num_threads(1)
    decay_steps = args.steps if args.schedule == "cosine" else 0
    setup = Setup(
        n_stages=args.stages, n_layers=args.layers, microbatches=2, val_batches=16, decay_steps=decay_steps
    )
    data = Data(setup)
    started = time.perf_counter()
    runs = [
        {
            "seed": seed,
            "every": every,
            **run(data, setup, seed, every, args.steps, args.window, args.eval_every, args.copy_age),
        }
        for seed in range(args.first_seed, args.first_seed + args.seeds)
        for every in shares
    ]
    print("| swaps | seed | val | / no swaps | rebuild | S1 just after / before | S1 later / control |")
    print("|---|---|---|---|---|---|---|")
    ratios: dict[str, list[tuple[float, float, float]]] = {}
    for r in runs:
        base = next(x for x in runs if x["seed"] == r["seed"] and x["every"] == 0)
        regimes = [(f"1 in {r['every']}" if r["every"] else "none", "s1")]
        if not r["every"]:
            regimes.append((f"none, edge copy {args.copy_age} steps old", "s1_copy"))
        for label, name in regimes:
            cost = r["val"] / base["val"]
            after, later = r[f"{name}_just_after"] / r["val"], r[f"{name}_later"] / r["control_later"]
            ratios.setdefault(label, []).append((cost, after, later))
            cells = (label, r["seed"], f"{r['val']:.3f}", f"{cost:.3f}", r[f"{name}_rebuild"])
            print("| " + " | ".join(map(str, (*cells, f"{after:.3f}", f"{later:.3f}"))) + " |")
    for label, rows in ratios.items():
        means = [statistics.fmean(column) for column in zip(*rows, strict=True)]
        print(f"| {label} | mean | | {means[0]:.3f} | | {means[1]:.3f} | {means[2]:.3f} |")
    if args.eval_every:
        print_costs_along_the_way(runs, shares)
    seconds = round(time.perf_counter() - started, 1)
    print(f"{seconds} s")
    if args.json:
        write_json(
            args.json,
            {
                "setup": setup.__dict__,
                "steps": args.steps,
                "window": args.window,
                "eval_every": args.eval_every,
                "copy_age": args.copy_age,
                "runs": runs,
                "seconds": seconds,
            },
        )


def print_costs_along_the_way(runs: list[dict[str, object]], shares: list[int]) -> None:
    """Per regime with swaps, the mean over seeds of its validation loss over no swaps' at each step."""
    base = {run["seed"]: run["curve"] for run in runs if run["every"] == 0}
    steps = sorted(next(iter(base.values())))
    print("\n| swaps | " + " | ".join(f"step {step}" for step in steps) + " |")
    print("|---|" + "---|" * len(steps))
    for every in (share for share in shares if share):
        curves = [run for run in runs if run["every"] == every]
        cells = [
            statistics.fmean(run["curve"][step] / base[run["seed"]][step] for run in curves) for step in steps
        ]
        print(f"| 1 in {every} | " + " | ".join(f"{cell:.3f}" for cell in cells) + " |")


if __name__ == "__main__":
    main()
