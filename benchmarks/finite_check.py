"""What checking received tensors for NaN and infinity costs on a CPU thread, by method, as a table.

A node checks every tensor a peer sends before it touches a model: each hop's activations, a NoLoCo
partner's phi and theta (twice a stage's parameters), every CheckFree+ copy it refreshes (a stage's
weights, or E / E') and every state transfer. Until session 29 each check was `torch.isfinite(t).all()`,
on the event loop for copies and averaging requests; now `precision.all_finite` (the least and greatest
value, in one pass without a mask the tensor's size), and those two checks run off the event loop.

Rows: one transformer stage of a preset's layers (default: llama-124m's, 3 stages of 4 layers), a NoLoCo
request of that stage (phi and theta), and one hop's activations (1 x 128 x dim), each checked with:

- `isfinite().all()`: a boolean mask as large as the tensor, then a reduction over it;
- `all_finite`: `torch.aminmax`, finite iff both ends are.

Columns: milliseconds of the thread's CPU time per check (the median of the rounds, with the range) and
the ratio to `isfinite().all()`.

    python benchmarks/finite_check.py
    python benchmarks/finite_check.py --preset tiny --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from swarmnode.malloc_tuning import tune_malloc

if __name__ == "__main__":  # before torch starts a thread: tensors allocate as a daemon's do
    tune_malloc()

import torch

from swarmnode.model import build_stage
from swarmnode.precision import all_finite
from swarmnode.presets import get_preset


def _mask_check(tensors: Sequence[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _minmax_check(tensors: Sequence[torch.Tensor]) -> bool:
    return all(all_finite(t) for t in tensors)


METHODS: dict[str, Callable[[Sequence[torch.Tensor]], bool]] = {
    "isfinite().all()": _mask_check,
    "all_finite": _minmax_check,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-124m")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="checks timed per row and round")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = replace(get_preset(args.preset).model, vocab_size=4096)
    weights = [p.detach() for p in build_stage(config, 1, args.stages, seed=0).parameters()]
    cases = {
        "a stage's weights (a copy)": weights,
        "phi and theta (NoLoCo)": weights + [w.clone() for w in weights],
        "one hop's activations": [torch.randn(1, 128, config.dim)],
    }
    times: dict[tuple[str, str], list[float]] = {(c, m): [] for c in cases for m in METHODS}
    for _ in range(args.rounds):
        for case, tensors in cases.items():
            for method, check in METHODS.items():
                if not check(tensors):  # warms, and the tensors must pass
                    raise RuntimeError(f"{method} found a non-finite value in {case}")
                started = time.thread_time()
                for _ in range(args.repeats):
                    check(tensors)
                times[case, method].append((time.thread_time() - started) / args.repeats * 1000)
    count = sum(w.numel() for w in weights)
    print(f"{args.preset}: one stage of {args.stages}, {count:,} parameters, one thread")
    print(f"| tensors | check | ms (median of {args.rounds}) | x isfinite().all() |")
    print("|---|---|---|---|")
    for (case, method), values in times.items():
        baseline = statistics.median(times[case, "isfinite().all()"])
        median = statistics.median(values)
        spread = f"{min(values):.2f}-{max(values):.2f}"
        print(f"| {case} | {method} | {median:.2f} ({spread}) | {median / baseline:.2f} |")


if __name__ == "__main__":
    main()
