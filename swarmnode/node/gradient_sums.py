"""Gradients of several backward passes, summed so that the order the passes ran in does not change a bit.

Microbatches come back in the order the network's timing gives. Summed in float32 in that order, two runs of
one seed parted in the last bits within a few steps, and training grew that to 0.15 in a step's loss by step
40. Two ways to a sum that timing cannot change:

- `IndexOrderedSum` (a transformer stage): float32, in the order of the microbatches' indices, whatever order
  their passes ran in; a pass that comes before a lower index's is held until its turn. As cheap as
  float32 accumulation when the passes come in order, and the same sum as the single-process trainer's.
- `OrderFreeSum` (a data node, whose passes are the head's and the embedding's): float64 sums, rounded once.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn


class SpareSums:
    """Sum buffers that finished groups gave back, for the next groups to write into. A fresh float64 sum for
    a llama-124m stage is 250 MB whose pages fault in on its first write: in a live swarm that took 22% of a
    stage's compute thread (py-spy). Holds at most as many as were in use at once, and keeps them between
    iterations (the memory a worker's groups in flight need, held instead of freed and faulted in again)."""

    def __init__(self) -> None:
        self._free: dict[tuple[tuple[int, ...], torch.dtype, torch.device], list[Tensor]] = {}

    def take(self, like: Tensor, dtype: torch.dtype) -> Tensor | None:
        """A spare buffer of `like`'s shape and device in `dtype` (its contents are stale), or None."""
        free = self._free.get((tuple(like.shape), dtype, like.device))
        return free.pop() if free else None

    def give(self, buffer: Tensor) -> None:
        self._free.setdefault((tuple(buffer.shape), buffer.dtype, buffer.device), []).append(buffer)

    def __len__(self) -> int:
        return sum(map(len, self._free.values()))


class OrderFreeSum:
    """The gradients of several backward passes, summed so that the order of the passes does not change the
    result: each pass's gradients are computed alone and added into float64 sums, exact while the terms of a
    sum lie within 2^29 of each other (a few float32 gradients of one parameter do), then rounded to float32
    once. Summed in float32 in the order the microbatches came back, two runs of one seed parted in the last
    bits within a few steps, and training grew that to 0.15 in a step's loss by step 40. On Apple's MPS,
    which has no float64, the sums stay float32 (and the order shows again).

    The first pass's gradients are widened into a buffer from `spare` (kept across loads and shared by the
    sums of one worker), later ones added as they are: widening is exact, so neither changes a bit."""

    def __init__(self, params: list[nn.Parameter], spare: SpareSums | None = None) -> None:
        self._params = params
        self._spare = spare if spare is not None else SpareSums()
        self._sums: list[Tensor | None] = [None] * len(params)

    def backward(self, outputs: Tensor, grad: Tensor | None = None) -> None:
        """`outputs.backward(grad)`, its parameter gradients added to the sums (the inputs' `.grad`, if they
        require one, is set as usual)."""
        for param in self._params:
            param.grad = None
        try:
            if grad is None:
                outputs.backward()
            else:  # the same pass: outputs' gradient is `grad` times one, exactly; a gradient passed to
                # backward() imports sympy on its first use (0.5 s of a new node's first microbatch)
                (outputs * grad).sum().backward()
            for i, param in enumerate(self._params):
                if param.grad is not None:
                    total = self._sums[i]
                    if total is None:
                        dtype = _sum_dtype(param.grad.device)
                        buffer = self._spare.take(param.grad, dtype)
                        self._sums[i] = param.grad.to(dtype) if buffer is None else buffer.copy_(param.grad)
                    else:
                        total.add_(param.grad)
        finally:
            for param in self._params:
                param.grad = None

    def load(self) -> None:
        """Point the parameters' `.grad` at the sums, rounded to their dtype, and start new sums."""
        for i, (param, total) in enumerate(zip(self._params, self._sums, strict=True)):
            param.grad = None if total is None else total.to(param.dtype)
            if param.grad is total:  # the sum is the gradient now (MPS: both float32): not a spare
                self._sums[i] = None
        self.clear()

    def clear(self) -> None:
        """Drop the sums (their buffers go to the spares)."""
        for total in self._sums:
            if total is not None:
                self._spare.give(total)
        self._sums = [None] * len(self._params)


def _sum_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


class Folds(Protocol):
    """A pass's gradients not yet computed in full (`split_backward.WeightWork`): `fold_into` adds them to
    the sums, by parameter position, computing what is missing as it goes."""

    def fold_into(self, sums: list[Tensor | None]) -> None: ...


def add_into(sums: list[Tensor | None], grads: list[Tensor | None]) -> None:
    """Add `grads` to `sums`, by parameter position (None: no gradient, or no sum yet: the gradient becomes
    the sum)."""
    for i, grad in enumerate(grads):
        if grad is None:
            continue
        total = sums[i]
        if total is None:
            sums[i] = grad
        else:
            total.add_(grad)


class _Computed:
    """A pass's gradients as computed (by parameter position; None: no gradient)."""

    def __init__(self, grads: list[Tensor | None]) -> None:
        self._grads = grads

    def fold_into(self, sums: list[Tensor | None]) -> None:
        add_into(sums, self._grads)


class IndexOrderedSum:
    """The gradients of a group's backward passes summed in float32 in the order of their microbatch index:
    `((g0 + g1) + g2) + ...` over the indices that had a pass, whatever order the passes ran in.

    A pass is folded into the sum at once when no lower index can still come (every lower index has been
    folded); otherwise its gradients are held until then, or until `load`, which folds what is held in index
    order. Indices a node never sees (another replica's, a lost microbatch's) are simply absent. In order,
    a pass costs one float32 add per parameter (the first none): a stage of llama-124m's layers on one CPU
    thread took 1.07-1.08x a bare forward and backward pass, against 1.29-1.30x with `OrderFreeSum`'s float64
    sums (`benchmarks/gradient_sums.py`, with the daemons' malloc settings).

    A split pass's weights' part (`add_work`) is folded when its turn comes, what of it is still to compute
    (a small microbatch's products, `WeightWork.to_hold`) computed then, into the sum (`fold_into`): each
    term is folded the same way whatever the timing, so the sum stays independent of it."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self._params = params
        self._sums: list[Tensor | None] = [None] * len(params)
        self._next = 0  # every index below this one that had a pass is in `_sums`
        self._held: dict[int, Folds] = {}  # passes that came before a lower index's

    def backward(self, index: int, outputs: Tensor, grad: Tensor) -> None:
        """`outputs.backward(grad)` for microbatch `index` of the group, its parameter gradients into the sum
        (the inputs' `.grad`, if they require one, is set as usual). Raises ValueError for an index that
        already had a pass."""
        self._check_new(index)
        for param in self._params:
            param.grad = None
        try:
            (outputs * grad).sum().backward()  # as `OrderFreeSum.backward`: the same pass, no sympy
            grads = [param.grad for param in self._params]
        finally:
            for param in self._params:
                param.grad = None
        self.add(index, grads)

    def add(self, index: int, grads: list[Tensor | None]) -> None:
        """Microbatch `index`'s gradients, computed elsewhere (by parameter position; None: no gradient),
        into the sum. Raises ValueError for an index that already had a pass."""
        if len(grads) != len(self._params):
            raise ValueError(f"{len(grads)} gradients for {len(self._params)} parameters")
        self.add_work(index, _Computed(grads))

    def add_work(self, index: int, work: Folds) -> None:
        """Microbatch `index`'s gradients as `work` folds them (a split pass's weights' part, computed when
        its turn comes). Raises ValueError for an index that already had a pass."""
        self._check_new(index)
        if index != self._next:
            self._held[index] = work
            return
        work.fold_into(self._sums)
        self._next += 1
        while self._next in self._held:
            self._held.pop(self._next).fold_into(self._sums)
            self._next += 1

    def _check_new(self, index: int) -> None:
        if index < self._next or index in self._held or index < 0:
            raise ValueError(f"microbatch {index} already had its backward pass in this group")

    def load(self) -> None:
        """Fold what is held, in index order, and point the parameters' `.grad` at the sums; start anew."""
        for index in sorted(self._held):
            self._held[index].fold_into(self._sums)
        for param, total in zip(self._params, self._sums, strict=True):
            param.grad = total
        self.clear()

    def clear(self) -> None:
        """Drop the sums and what is held."""
        self._sums = [None] * len(self._params)
        self._held.clear()
        self._next = 0

    @property
    def held(self) -> int:
        """Passes held for a lower index's turn."""
        return len(self._held)
