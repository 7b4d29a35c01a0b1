"""What summing a stage's gradients so that timing cannot change them costs, per microbatch, as a table.

One transformer stage of a preset's layers (default: llama-124m's, 3 stages of 4 layers) on one CPU thread,
a forward and backward pass of one microbatch (1 x 128 tokens) with the next stage's gradient, in rounds of
four microbatches (a group, summed and loaded as for an update). Rows, taking turns in each round:

- `bare`: the pass alone, its gradients dropped (the floor);
- `float64 sums`: `gradient_sums.OrderFreeSum` (each pass widened into float64 sums, rounded once);
- `index order, in order` / `reversed`: `gradient_sums.IndexOrderedSum` with the passes in microbatch order
  (each folded at once) and in reverse order (each held until the group's load).

Columns: milliseconds of the thread's CPU time per pass (the median of the rounds) and the ratio to `bare`.

    python benchmarks/gradient_sums.py
    python benchmarks/gradient_sums.py --preset tiny --rounds 5
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
from swarmnode.node.gradient_sums import IndexOrderedSum, OrderFreeSum, SpareSums
from swarmnode.presets import get_preset

GROUP = 4  # microbatches summed between loads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-124m")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128, help="tokens of the one-sequence microbatch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--groups", type=int, default=3, help="groups of 4 passes timed per row and round")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = replace(get_preset(args.preset).model, vocab_size=4096)
    stage = build_stage(config, 1, args.stages, seed=0)
    params = list(stage.parameters())
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(1, args.tokens, config.dim, generator=generator)
    upstream = torch.randn(1, args.tokens, config.dim, generator=generator)

    def outputs() -> torch.Tensor:
        return stage(inputs.clone().requires_grad_(True))

    def bare() -> None:
        for _ in range(GROUP):
            (outputs() * upstream).sum().backward()
            for param in params:
                param.grad = None

    spare = SpareSums()

    def float64_sums() -> None:
        sums = OrderFreeSum(params, spare)
        for _ in range(GROUP):
            sums.backward(outputs(), upstream)
        sums.load()

    def index_order(order: range) -> Callable[[], None]:
        def run() -> None:
            sums = IndexOrderedSum(params)
            for index in order:
                sums.backward(index, outputs(), upstream)
            sums.load()

        return run

    rows: dict[str, Callable[[], None]] = {
        "bare": bare,
        "float64 sums": float64_sums,
        "index order, in order": index_order(range(GROUP)),
        "index order, reversed": index_order(range(GROUP - 1, -1, -1)),
    }
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(args.rounds):
        for name, run in rows.items():
            run()  # warm: buffers, caches
            for param in params:
                param.grad = None
            started = time.thread_time()
            for _ in range(args.groups):
                run()
                for param in params:
                    param.grad = None
            times[name].append((time.thread_time() - started) / (args.groups * GROUP) * 1000)
    floor = statistics.median(times["bare"])
    count = sum(p.numel() for p in params)
    shape = f"1 x {args.tokens} tokens"
    print(f"{args.preset}: one stage of {args.stages}, {count:,} parameters, {shape}, one thread")
    print(f"| sums | ms per pass (median of {args.rounds}) | x bare |")
    print("|---|---|---|")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.1f} ({min(values):.1f}-{max(values):.1f}) | {median / floor:.2f} |")


if __name__ == "__main__":
    main()
