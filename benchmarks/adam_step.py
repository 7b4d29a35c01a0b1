"""What one optimizer step of a stage costs on a CPU thread, by Adam kernel, as a table.

One transformer stage of a preset's layers (default: llama-124m's, 3 stages of 4 layers) on one CPU thread,
its parameters given random gradients, then `StageOptimizer.step` (scale, clip, Adam, zero) and the Adam
update alone, with `swarmnode.adam.Adam` on each of its paths, taking turns in each round:

- `foreach`: torch's `_foreach` kernels (the path off a CPU; on a CPU until session 25): each kernel a pass
  over every parameter or moment, about seven in all;
- `fused`: torch's fused kernel (the default on a CPU): one pass.

Columns: milliseconds of the thread's CPU time per step (the median of the rounds, with the range) and the
ratio to `foreach`. A stage node steps once an iteration, and the first stage's step lies on the swarm's
critical path: the next iteration's first forward waits for it.

    python benchmarks/adam_step.py
    python benchmarks/adam_step.py --preset tiny --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

from swarmnode.malloc_tuning import tune_malloc

if __name__ == "__main__":  # before torch starts a thread: the stage allocates as a daemon's does
    tune_malloc()

import torch

from swarmnode.model import build_stage
from swarmnode.optim import Schedule, StageOptimizer
from swarmnode.presets import get_preset

PATHS = {"foreach": False, "fused": True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-124m")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps timed per row and round")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = replace(get_preset(args.preset).model, vocab_size=4096)
    stage = build_stage(config, 1, args.stages, seed=0)
    params = [p for p in stage.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=generator) * 1e-3 for p in params]
    schedule = Schedule(peak_lr=1e-3, warmup_steps=1, total_steps=10**6)
    optimizers = {name: StageOptimizer(stage, schedule) for name in PATHS}
    for name, fused in PATHS.items():
        optimizers[name].adam.fused = fused

    rows: dict[str, Callable[[], object]] = {}
    for name, optimizer in optimizers.items():
        rows[f"stage step, {name}"] = optimizer.step
        rows[f"Adam alone, {name}"] = optimizer.adam.step
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(args.rounds):
        for name, step in rows.items():
            spent = 0.0
            for timed in (False, *[True] * args.steps):  # the first warms: the moments' allocation
                for param, grad in zip(params, grads, strict=True):
                    param.grad = grad.clone()
                started = time.thread_time()
                step()
                spent += (time.thread_time() - started) if timed else 0.0
            times[name].append(spent / args.steps * 1000)
    count = sum(p.numel() for p in params)
    print(f"{args.preset}: one stage of {args.stages}, {count:,} parameters, one thread")
    print(f"| step | ms (median of {args.rounds}) | x foreach |")
    print("|---|---|---|")
    for name, values in times.items():
        baseline = statistics.median(times[name.replace("fused", "foreach")])
        median = statistics.median(values)
        print(f"| {name} | {median:.1f} ({min(values):.1f}-{max(values):.1f}) | {median / baseline:.2f} |")


if __name__ == "__main__":
    main()
