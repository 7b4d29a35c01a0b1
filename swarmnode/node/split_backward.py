"""A stage's backward pass in two parts, as zero-bubble pipeline schedules split it: first the gradient at the
stage's inputs, which the previous stage waits for, then the gradients of its linear layers' weights, which
only this stage's update needs and which can wait until the stage has nothing else to do.

In a pipeline the backward passes travel from the last stage to the first; each stage's full pass lies on that
path, although half of it (a linear layer's weight gradient, `grad_out^T @ input`, as much work as the
gradient at its input) is needed by nobody upstream. Split, the path carries only the first part; the second
fills the bubbles. The first part asks autograd for the gradients at the inputs, at the parameters of every
other kind (norms) and at each linear layer's output (recorded in the forward pass); autograd then skips the
weight products, which the second part computes, one matrix product per layer, as autograd would: on a CPU in
float32 they equal autograd's to the bit (`tests/test_split_backward.py`). Summed over microbatches, a large
microbatch's products are written apart and added, as autograd accumulates, and a small one's added into the
sum by the product itself (`WeightWork.to_hold`, `fold_into`), which may round otherwise. Under autocast
(bfloat16, float16) a layer's product is taken in the compute dtype, which these parts do not reproduce, so
only a float32 stage splits (`StageWorker`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor, nn

from swarmnode.node.gradient_sums import add_into

Record = tuple[int, Tensor, Tensor]  # (the weight's position among the parameters, the layer's input, output)


@dataclass
class WeightWork:
    """A microbatch's second part: the gradients of every parameter (by position; those of the linear
    layers' weights still missing) and, per linear layer, its input and the gradient at its output."""

    grads: list[Tensor | None]
    linears: list[tuple[int, Tensor, Tensor]] = field(default_factory=list)

    def to_hold(self) -> WeightWork:
        """This work as a gradient sum should hold it until its turn to fold: as it is where what it holds
        (each layer's input and output gradient) is no larger than the weight gradients it makes, else with
        those computed now, apart (`fold_into` adds them). Decided by shapes alone, never by timing, so a
        microbatch's terms are summed the same way in every run."""
        held = sum(inputs.numel() + grad_out.numel() for _, inputs, grad_out in self.linears)
        made = sum(inputs.shape[-1] * grad_out.shape[-1] for _, inputs, grad_out in self.linears)
        if held > made:  # as `holds_whole` foresees
            for position, inputs, grad_out in self.linears:
                product = _flat(grad_out).t().mm(_flat(inputs))
                total = self.grads[position]
                self.grads[position] = product if total is None else total + product
            self.linears = []
        return self

    def fold_into(self, sums: list[Tensor | None]) -> None:
        """Add every parameter's gradient to `sums` (by position; None: no sum yet), each weight gradient
        still missing computed into its sum as one matrix product with the sum added (`addmm_`), not
        written apart and added after: at a small microbatch the product's output, as large as the weight,
        costs more memory traffic than its arithmetic (`benchmarks/weight_gradients.py`)."""
        add_into(sums, self.grads)
        for position, inputs, grad_out in self.linears:
            total = sums[position]
            if total is None:
                sums[position] = _flat(grad_out).t().mm(_flat(inputs))
            else:
                total.addmm_(_flat(grad_out).t(), _flat(inputs))
        self.grads, self.linears = [None] * len(self.grads), []


def _flat(tensor: Tensor) -> Tensor:
    return tensor.reshape(-1, tensor.shape[-1])


def _split_linears(module: nn.Module) -> list[nn.Linear]:
    """The layers whose weight gradients a split pass leaves to its second part."""
    return [
        layer
        for layer in module.modules()
        if isinstance(layer, nn.Linear) and layer.bias is None and layer.weight.requires_grad
    ]


def holds_whole(module: nn.Module, tokens: int) -> bool:
    """Whether the weights' parts of a `tokens`-token microbatch through `module` are held whole
    (`WeightWork.to_hold`), their products added into the sums: the case where a split pass saves work in
    one process too (elsewhere it only reorders it)."""
    linears = _split_linears(module)
    held = tokens * sum(layer.in_features + layer.out_features for layer in linears)
    return held <= sum(layer.in_features * layer.out_features for layer in linears)


class SplitBackward:
    """The two-part backward pass of `module`, whose parameters are `params` (in the order gradients are
    summed): `recording` around a forward pass, `input_pass` for the first part."""

    def __init__(self, module: nn.Module, params: Sequence[nn.Parameter]) -> None:
        positions = {id(param): i for i, param in enumerate(params)}
        self._params = list(params)
        self._records: list[Record] | None = None  # while `recording`
        for layer in _split_linears(module):  # hooks kept for the module's life: none added per pass
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
