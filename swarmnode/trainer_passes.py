"""The single-process trainer's pass of one microbatch through every piece, its gradients summed for a step.

At a small microbatch in float32 each transformer stage's backward pass is split as a stage daemon splits
it (`node.split_backward`) and its microbatches' gradients are summed as the daemon sums them
(`IndexOrderedSum`, each weight gradient added into its sum by the product itself, in microbatch order): the
trainer and a stage daemon then compute a stage's gradients with the same code and get the same bits.
Otherwise autograd's whole pass accumulates into `.grad`: under autocast (bfloat16, float16), where a daemon
does not split either, and at larger microbatches, where the split saves nothing in one process (it costs
the tiny preset's trainer 5%).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from swarmnode.node.gradient_sums import IndexOrderedSum
from swarmnode.node.split_backward import SplitBackward, holds_whole
from swarmnode.pieces import DataPiece
from swarmnode.precision import Precision


class WholePasses:
    """Autograd's backward through the whole model, accumulated into every parameter's `.grad`."""

    def __init__(self, data: DataPiece, stages: list[nn.Module], precision: Precision) -> None:
        self._data, self._stages, self._precision = data, stages, precision

    def microbatch(self, index: int, inputs: Tensor, targets: Tensor, weight: float) -> float:
        """Forward and backward of microbatch `index`, its loss times `weight` differentiated; its loss."""
        with self._precision.autocast():
            hidden = self._data.embed(inputs)
            for stage in self._stages:
                hidden = stage(hidden)
            loss = self._data.loss(hidden, targets)
        (loss.float() * weight).backward()
        return float(loss.detach())

    def load(self) -> None:
        """Nothing to do: the gradients are in `.grad` already."""


class SplitPasses:
    """Each transformer stage's backward split and summed in microbatch order as a stage daemon's (float32
    only); the data piece's gradients accumulate into `.grad`."""

    def __init__(self, data: DataPiece, stages: list[nn.Module]) -> None:
        self._data, self._stages = data, stages
        self._splits = [SplitBackward(stage, list(stage.parameters())) for stage in stages]
        self._sums = [IndexOrderedSum(list(stage.parameters())) for stage in stages]

    def microbatch(self, index: int, inputs: Tensor, targets: Tensor, weight: float) -> float:
        """As `WholePasses.microbatch`; a stage's gradients go to its sum, not to `.grad`."""
        embedded = self._data.embed(inputs)
        hidden = embedded
        held = []
        for stage, split in zip(self._stages, self._splits, strict=True):
            leaf = hidden.detach().requires_grad_(True)
            with split.recording() as records:
                hidden = stage(leaf)
            held.append((leaf, hidden, records))
        top = hidden.detach().requires_grad_(True)
        loss = self._data.loss(top, targets)
        (loss * weight).backward()
        grad = top.grad
        for split, sums in zip(reversed(self._splits), reversed(self._sums), strict=True):
            leaf, outputs, records = held.pop()  # each stage's activations let go once its part is out
            sums.add_work(index, split.input_pass(outputs, _present(grad), leaf, records).to_hold())
            grad = leaf.grad
        torch.autograd.backward((embedded * _present(grad)).sum())  # as a data node's: no sympy
        return float(loss.detach())

    def load(self) -> None:
        """Point each stage parameter's `.grad` at its sum, for the step; the sums start anew."""
        for sums in self._sums:
            sums.load()


def _present(grad: Tensor | None) -> Tensor:
    if grad is None:
        raise RuntimeError("a piece's output got no gradient: the model does not reach the loss through it")
    return grad


def microbatch_passes(
    data: DataPiece, stages: list[nn.Module], precision: Precision, tokens: int
) -> WholePasses | SplitPasses:
    """The passes a single process runs for microbatches of `tokens` tokens: split in float32 where a
    stage's weights' parts are held whole (`split_backward.holds_whole`), else whole (under autocast, or
    where the split would only reorder the work: a stage daemon then computes each product apart and adds
    it, as autograd's accumulation does, to the same bits here, `tests/test_split_backward.py`)."""
    if precision.mixed or not all(holds_whole(stage, tokens) for stage in stages):
        return WholePasses(data, stages, precision)
    return SplitPasses(data, stages)
