"""What a split stage's weights' parts cost, the products written apart and added or added as computed.

One transformer stage of a preset's layers (default: llama-124m's, 3 stages of 4 layers), a group of four
microbatches (`--tokens` each): the first parts of their split backward passes (`node.split_backward`),
then the four weights' parts summed in microbatch order in one of two ways, taking turns in each round:

- `apart, then added`: each linear layer's weight gradient written as a tensor of its own, then added to
  the sum (as autograd's accumulation into `.grad` does, and split stages did before session 32);
- `into the sum`: each product added into the sum by the matrix product itself (`addmm_`,
  `WeightWork.fold_into`), the first written as it is.

At a small microbatch a product's output, as large as its weight (31M floats a stage here), costs more in
memory traffic than its arithmetic, so the second way skips two passes over it a microbatch. Both ways are
timed at every size; a daemon takes the second only where a part is held whole (`WeightWork.to_hold`: up to
about 400 tokens on llama-124m's layers), the first elsewhere. Columns:
milliseconds of wall time per group (the median of the rounds) for each thread count and token count, and
the second way's ratio to the first.

    python benchmarks/weight_gradients.py
    python benchmarks/weight_gradients.py --tokens 128,512,2048 --threads 1,2 --rounds 5
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
from torch import Tensor

from swarmnode.model import build_stage
from swarmnode.node.gradient_sums import add_into
from swarmnode.node.split_backward import SplitBackward, WeightWork
from swarmnode.presets import get_preset

GROUP = 4  # microbatches summed between updates


def first_parts(
    split: SplitBackward, stage: torch.nn.Module, data: list[tuple[Tensor, Tensor]]
) -> list[WeightWork]:
    works = []
    for inputs, upstream in data:
        leaf = inputs.clone().requires_grad_(True)
        with split.recording() as records:
            outputs = stage(leaf)
        works.append(split.input_pass(outputs, upstream, leaf, records))
    return works


def apart_then_added(works: list[WeightWork], sums: list[Tensor | None]) -> None:
    for work in works:
        add_into(sums, work.grads)
        products: list[Tensor | None] = [None] * len(sums)
        for position, inputs, grad_out in work.linears:
            products[position] = (
                grad_out.reshape(-1, grad_out.shape[-1]).t().mm(inputs.reshape(-1, inputs.shape[-1]))
            )
        add_into(sums, products)


def into_the_sum(works: list[WeightWork], sums: list[Tensor | None]) -> None:
    for work in works:
        work.fold_into(sums)


def timed(fold: Callable[[list[WeightWork], list[Tensor | None]], None], works: list[WeightWork]) -> float:
    """Seconds `fold` takes to sum the weights' parts of `works` (their first parts done beforehand)."""
    sums: list[Tensor | None] = [None] * len(works[0].grads)
    started = time.perf_counter()
    fold(works, sums)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-124m")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument(
        "--tokens",
        default="128,512",
        help="tokens of a microbatch (sequences of at most the model's length), comma separated",
    )
    parser.add_argument("--threads", default="1,2", help="torch threads, comma separated")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    config = replace(get_preset(args.preset).model, vocab_size=4096)
    stage = build_stage(config, 1, args.stages, seed=0)
    split = SplitBackward(stage, list(stage.parameters()))
    generator = torch.Generator().manual_seed(0)
    ways = {"apart, then added": apart_then_added, "into the sum": into_the_sum}
    print(f"{args.preset}, stage 1 of {args.stages}: {GROUP} microbatches a group, {args.rounds} rounds")
    print("| threads | tokens | " + " | ".join(f"{way} (ms)" for way in ways) + " | ratio |")
    print("|---|---|" + "---|" * len(ways) + "---|")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for tokens in (int(t) for t in args.tokens.split(",")):
            seq = min(tokens, config.max_seq_len)
            if tokens % seq:
                parser.error(f"--tokens {tokens} is not a whole number of {seq}-token sequences")
            shape = (tokens // seq, seq, config.dim)
            data = [
                (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
                for _ in range(GROUP)
            ]
            seconds: dict[str, list[float]] = {way: [] for way in ways}
            for fold in ways.values():  # one group each, unmeasured: the heap grows once
                timed(fold, first_parts(split, stage, data))
            for _ in range(args.rounds):
                for way, fold in ways.items():
                    seconds[way].append(timed(fold, first_parts(split, stage, data)))
            medians = [1000 * statistics.median(seconds[way]) for way in ways]
            cells = " | ".join(f"{ms:.0f}" for ms in medians)
            print(f"| {threads} | {tokens} | {cells} | {medians[1] / medians[0]:.2f} |")


if __name__ == "__main__":
    main()
