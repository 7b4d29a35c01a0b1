"""CheckFree+ swap share: what swapping one microbatch in 2 (the paper's half) or in 4 costs when nothing
fails, and what it buys when S1 is lost.

The model of `checkfree_plus.py` (the tiny preset's dimensions in 6 stages of one layer), here with 2
microbatches of 4 sequences a step (the tiny preset's) and 16 validation batches, trained `--steps` steps per
seed without swaps and with swaps of one microbatch in `every` (`protocols.checkfree.swaps_edge_pairs`; the
copies of `E` and `E'` refreshed every 10 steps). At the end S1 is lost and rebuilt as `plan_recovery` plans
it (with swaps: a copy of S2, which stood in for it; without: CheckFree's neighbour copy), and training goes
on `--window` steps, beside a control that lost nothing. Printed per seed and as means: the cost of the swaps
(validation loss at the end over no swaps), S1's loss just after (over the loss before) and `--window` steps
later (over the control).

    python benchmarks/repro/swap_share.py --json out.json
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

SHARES = (0, 2, 4)  # 0: no swaps; else one microbatch in this many
REFRESH_STEPS = 10


def run(data: Data, setup: Setup, seed: int, every: int, steps: int, window: int) -> dict[str, float | str]:
    """One regime of one seed: train, lose S1, rebuild, go on beside a control."""
    plus = every > 0
    model = StagedModel(replace(setup, swap_every=every or 2), data.corpus.vocab_size, seed)
    if plus:
        model.refresh_copies()
    for _ in range(steps):
        model.train_step(data, checkfree_plus=plus)
        if plus and model.step % REFRESH_STEPS == 0:
            model.refresh_copies()
    before = model.evaluate(data)
    lost, control = model.fork(), model.fork()
    plan = lost.plan(1, {1}, plus)
    lost.rebuild(plan)
    just_after = lost.evaluate(data)
    for fork in (lost, control):
        for _ in range(window):
            fork.train_step(data, checkfree_plus=plus)
    return {
        "val": before,
        "rebuild": plan.method.value,
        "s1_just_after": just_after,
        "s1_later": lost.evaluate(data),
        "control_later": control.evaluate(data),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--window", type=int, default=25)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    setup = Setup(microbatches=2, val_batches=16)
    data = Data(setup)
    started = time.perf_counter()
    runs = [
        {"seed": seed, "every": every, **run(data, setup, seed, every, args.steps, args.window)}
        for seed in range(args.seeds)
        for every in SHARES
    ]
    print("| swaps | seed | val | / no swaps | rebuild | S1 just after / before | S1 later / control |")
    print("|---|---|---|---|---|---|---|")
    ratios: dict[int, list[tuple[float, float, float]]] = {every: [] for every in SHARES}
    for r in runs:
        base = next(x for x in runs if x["seed"] == r["seed"] and x["every"] == 0)
        cost, after, later = (
            r["val"] / base["val"],
            r["s1_just_after"] / r["val"],
            r["s1_later"] / r["control_later"],
        )
        ratios[r["every"]].append((cost, after, later))
        share = f"1 in {r['every']}" if r["every"] else "none"
        cells = (
            share,
            r["seed"],
            f"{r['val']:.3f}",
            f"{cost:.3f}",
            r["rebuild"],
            f"{after:.3f}",
            f"{later:.3f}",
        )
        print("| " + " | ".join(map(str, cells)) + " |")
    for every, rows in ratios.items():
        means = [statistics.fmean(column) for column in zip(*rows, strict=True)]
        share = f"1 in {every}" if every else "none"
        print(f"| {share} | mean | | {means[0]:.3f} | | {means[1]:.3f} | {means[2]:.3f} |")
    seconds = round(time.perf_counter() - started, 1)
    print(f"{seconds} s")
    if args.json:
        write_json(
            args.json,
            {
                "setup": setup.__dict__,
                "steps": args.steps,
                "window": args.window,
                "runs": runs,
                "seconds": seconds,
            },
        )


if __name__ == "__main__":
    main()
