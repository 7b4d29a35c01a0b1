"""A stage's backward pass in two parts, as zero-bubble pipeline schedules split it: first the gradient at the
stage's inputs, which the previous stage waits for, then the gradients of its linear layers' weights, which
only this stage's update needs and which can wait until the stage has nothing else to do.

In a pipeline the backward passes travel from the last stage to the first; each stage's full pass lies on
that path, although half of it (a linear layer's weight gradient, `grad_out^T @ input`, as much work as the
gradient at its input) is needed by nobody upstream. Split, the path carries only the first part; the second
fills the bubbles. The first part asks autograd for the gradients at the inputs, at the parameters of every
other kind (norms) and at each linear layer's output (recorded in the forward pass); autograd then skips the
weight products, which the second part computes, one matrix product per layer, as autograd would: on a CPU
in float32 they equal autograd's to the bit (`tests/test_split_backward.py`), so a split stage sums the same
gradients as a whole pass. Under autocast (bfloat16, float16) a layer's product is taken in the compute
dtype, which these parts do not reproduce, so only a float32 stage splits (`StageWorker`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor, nn

Record = tuple[int, Tensor, Tensor]  # (the weight's position among the parameters, the layer's input, output)


@dataclass
class WeightWork:
    """A microbatch's second part: the gradients of every parameter (by position; those of the linear
    layers' weights still missing) and, per linear layer, its input and the gradient at its output."""

    grads: list[Tensor | None]
    linears: list[tuple[int, Tensor, Tensor]] = field(default_factory=list)

    def complete(self) -> list[Tensor | None]:
        """The missing weight gradients, computed; every parameter's gradient, by position."""
        for position, inputs, grad_out in self.linears:
            product = grad_out.reshape(-1, grad_out.shape[-1]).t().mm(inputs.reshape(-1, inputs.shape[-1]))
            total = self.grads[position]
            self.grads[position] = product if total is None else total + product
        self.linears = []
        return self.grads


class SplitBackward:
    """The two-part backward pass of `module`, whose parameters are `params` (in the order gradients are
    summed): `recording` around a forward pass, `input_pass` for the first part."""

    def __init__(self, module: nn.Module, params: Sequence[nn.Parameter]) -> None:
        positions = {id(param): i for i, param in enumerate(params)}
        self._params = list(params)
        self._records: list[Record] | None = None  # while `recording`
        for layer in module.modules():  # hooks kept for the module's life: none added per pass
            if isinstance(layer, nn.Linear) and layer.bias is None and layer.weight.requires_grad:
                layer.register_forward_hook(partial(self._record, positions[id(layer.weight)]))

    def _record(self, position: int, _layer: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> None:
        if self._records is not None:
            self._records.append((position, args[0], output))

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[Record]]:
        """Within: each linear layer's input and output, as the forward pass runs it."""
        self._records = records = []
        try:
            yield records
        finally:
            self._records = None

    def input_pass(self, outputs: Tensor, grad: Tensor, inputs: Tensor, records: list[Record]) -> WeightWork:
        """The first part for a forward pass that gave `outputs` from `inputs` (recorded as `records`): the
        gradient at `inputs` goes to `inputs.grad`; what the second part needs is returned."""
        recorded = {position for position, _, _ in records}
        others = [i for i, param in enumerate(self._params) if i not in recorded and param.requires_grad]
        targets = [inputs, *(self._params[i] for i in others), *(output for _, _, output in records)]
        # as `IndexOrderedSum.backward`: the backward of sum(outputs * grad), which imports no sympy
        found = torch.autograd.grad((outputs * grad).sum(), targets, allow_unused=True)
        inputs.grad = found[0]
        grads: list[Tensor | None] = [None] * len(self._params)
        for i, param_grad in zip(others, found[1 : 1 + len(others)], strict=True):
            grads[i] = param_grad
        work = WeightWork(grads)
        for (position, layer_input, _), grad_out in zip(records, found[1 + len(others) :], strict=True):
            if grad_out is not None:
                work.linears.append((position, layer_input.detach(), grad_out))
        return work
