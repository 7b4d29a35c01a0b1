"""The torch side of a daemon: run a stage's piece forward and backward for microbatches in flight.

Everything here runs on the compute thread (`node.compute`), one call at a time. Activations are kept
between a microbatch's forward and backward pass, keyed by `(origin peer, iteration, microbatch)`, and
dropped when the backward pass is done or the microbatch is aborted. A transformer stage keeps one gradient
buffer per group (a data node's iteration): each backward pass adds into its group's sums, and each group is
one optimizer update (`protocols.stepbook`). The daemon steps only when no activation is held, so
an update never changes weights that a pending backward pass still needs.

Tensors arrive and leave on the CPU in the run's wire dtypes (`precision.wire_dtypes`); the module runs on
the node's device in its compute dtype (`precision.Precision`, float32 master weights). Under float16 each
group's gradients are scaled by the loss scale of its first backward pass and unscaled at its update.

Gradients are summed so that the order of the backward passes does not matter (`node.gradient_sums`):
microbatches come and go in the order the network's timing gives.

A float32 stage splits each backward pass (`node.split_backward`): `backward` computes the gradient at the
inputs, which the previous hop waits for, and leaves the linear layers' weight gradients pending; `weights`
hands them to the group's sum when the compute thread has nothing more urgent (computed then, or, for a small
microbatch, when its turn in the sum comes: `WeightWork.to_hold`), and a group's update first hands over
whatever of its own is still pending. A large microbatch's sums are a whole pass's to the bit; a small one's
may differ from autograd's accumulation in the last bits (its products are added into the sums by `addmm_`),
and are the trainer's own (`swarmnode.trainer_passes`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Collection
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from protocols.stepbook import Group, MicrobatchKey
from swarmnode.node.gradient_sums import IndexOrderedSum, OrderFreeSum
from swarmnode.node.split_backward import Record, SplitBackward, WeightWork
from swarmnode.optim import StageOptimizer
from swarmnode.pieces import DataPiece
from swarmnode.precision import Overflow, Precision, all_finite


class MissingActivations(KeyError):
    """A backward pass arrived for a microbatch this node holds nothing for (never seen, aborted, expired)."""


@dataclass
class _Held:
    inputs: Tensor
    outputs: Tensor
    created: float
    records: list[Record] = field(default_factory=list)  # linear layers' inputs and outputs (a split pass)


@dataclass(frozen=True)
class Wire:
    """The dtypes activations and gradients travel in between nodes."""

    activations: torch.dtype = torch.float32
    gradients: torch.dtype = torch.float32


def _to_wire(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    return tensor.detach().to(device="cpu", dtype=dtype)


def _activations_to_wire(outputs: Tensor, dtype: torch.dtype, what: object) -> Tensor:
    """`outputs` as they travel; Overflow if they do not fit float16's range (a receiver rejects non-finite
    values as hostile and bans their sender, so an honest overflow must stop here)."""
    wired = _to_wire(outputs, dtype)
    if dtype == torch.float16 and not all_finite(wired):
        raise Overflow(f"the activations of {what} exceed float16's range on the wire")
    return wired


def _unscaled_gradient(inputs: Tensor, scale: float, key: object) -> Tensor:
    """The gradient at a piece's inputs, divided by the loss scale; Overflow if it is not finite."""
    if inputs.grad is None:
        raise RuntimeError(f"no input gradient for microbatch {key}")
    grad = inputs.grad / scale if scale != 1.0 else inputs.grad
    if not all_finite(grad):
        raise Overflow(f"the gradient of microbatch {key} overflowed at loss scale {scale:g}")
    return grad


class StageWorker:
    """Forward and backward passes of one transformer stage, with its optimizer. `split`: split backward
    passes (the default for a float32 stage, the only kind that can: `node.split_backward`)."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: StageOptimizer,
        precision: Precision | None = None,
        wire: Wire | None = None,
        split: bool | None = None,
    ) -> None:
        self.module = module
        self.optimizer = optimizer
        self.precision = precision or Precision()
        self.wire = wire or Wire()
        self.scaler = self.precision.scaler()
        if split and self.precision.mixed:
            raise ValueError(f"a {self.precision.dtype} stage cannot split its backward passes")
        self._held: dict[MicrobatchKey, _Held] = {}
        self._params = list(module.parameters())
        self._grads: dict[Group, IndexOrderedSum] = {}  # each group's accumulated gradients
        self._scales: dict[Group, float] = {}  # each group's loss scale (float16)
        wanted = not self.precision.mixed if split is None else split
        self._split = SplitBackward(module, self._params) if wanted else None
        self._pending: dict[MicrobatchKey, WeightWork] = {}  # split passes whose weights' part is left

    @property
    def in_flight(self) -> int:
        return len(self._held)

    @property
    def gradient_groups(self) -> int:
        """Groups with gradients waiting for their update."""
        return len(self._grads)

    @property
    def pending_weights(self) -> int:
        """Split backward passes whose weights' part is still to compute."""
        return len(self._pending)

    def forward(self, key: MicrobatchKey, hidden: Tensor, now: float) -> Tensor:
        """The forward pass of a microbatch, held for its backward; its outputs as they travel. Raises
        Overflow if they do not fit a float16 wire (the microbatch stays held until it is aborted)."""
        inputs = hidden.detach().to(self.precision.device, torch.float32).requires_grad_(True)
        recording = self._split.recording() if self._split else contextlib.nullcontext([])
        with self.precision.autocast(), recording as records:
            outputs = self.module(inputs)
        self._held[key] = _Held(inputs, outputs, now, records)
        return _activations_to_wire(outputs, self.wire.activations, f"microbatch {key}")

    def evaluate(self, hidden: Tensor) -> Tensor:
        """A validation forward pass: nothing held, no gradient. Raises Overflow as `forward` does."""
        with torch.no_grad(), self.precision.autocast():
            outputs = self.module(hidden.to(self.precision.device, torch.float32))
        return _activations_to_wire(outputs, self.wire.activations, "a validation microbatch")

    def backward(self, key: MicrobatchKey, grad: Tensor) -> Tensor:
        """The backward pass of a held microbatch into its group's gradients; the gradient at its inputs.
        Raises MissingActivations if nothing is held for it, Overflow if a float16 pass overflowed."""
        held = self._held.pop(key, None)
        if held is None:
            raise MissingActivations(key)
        scale = self._scales.setdefault(key.group, self.scaler.scale)
        gradients = self._grads.get(key.group)
        if gradients is None:
            gradients = self._grads[key.group] = IndexOrderedSum(self._params)
        upstream = grad.to(self.precision.device, torch.float32) * scale
        if self._split is None:
            gradients.backward(key.microbatch, held.outputs, upstream)
        else:
            self._pending[key] = self._split.input_pass(held.outputs, upstream, held.inputs, held.records)
        return _to_wire(_unscaled_gradient(held.inputs, scale, key), self.wire.gradients)

    def weights(self, key: MicrobatchKey) -> None:
        """The weights' part of microbatch `key`'s split backward pass, into its group's gradients (computed
        into the sum now if its turn has come, else when it comes or now if it is large:
        `WeightWork.to_hold`); nothing if it is done already or its group was dropped."""
        work = self._pending.pop(key, None)
        gradients = self._grads.get(key.group)
        if work is not None and gradients is not None:
            gradients.add_work(key.microbatch, work.to_hold())

    def drop(self, key: MicrobatchKey) -> bool:
        """Forget a microbatch (aborted); True if it was held."""
        return self._held.pop(key, None) is not None

    def drop_all_except(self, live: Collection[MicrobatchKey]) -> int:
        """Forget every microbatch not in `live` (its group expired, or closed while a drop was interrupted);
        returns how many were dropped. On the compute thread, like every change of `_held`."""
        stale = [key for key in self._held if key not in live]
        for key in stale:
            del self._held[key]
        return len(stale)

    def output_shape(self, key: MicrobatchKey) -> tuple[int, ...] | None:
        held = self._held.get(key)
        return None if held is None else tuple(held.outputs.shape)

    def discard_gradients_except(self, groups: Collection[Group]) -> int:
        """Drop the gradient buffers of every group not in `groups` (closed without an update: expired
        before its backward pass was counted); returns how many were dropped."""
        stale = [group for group in self._grads if group not in groups]
        for group in stale:
            self._grads.pop(group).clear()
            self._scales.pop(group, None)
        for key in [key for key in self._pending if key.group not in groups]:
            del self._pending[key]
        return len(stale)

    def step_group(self, group: Group, grad_scale: float = 1.0) -> float | None:
        """One optimizer update with `group`'s gradients times `grad_scale`, at the learning rate of its
        iteration; the gradient norm, or None if the group has no gradients here."""
        for key in [key for key in self._pending if key.group == group]:
            self.weights(key)
        gradients = self._grads.pop(group, None)
        if gradients is None:
            return None
        gradients.load()
        norm = self.optimizer.step(grad_scale / self._scales.pop(group, 1.0), group[1])
        self.scaler.update(overflowed=not math.isfinite(norm))
        return norm


class DataWorker:
    """Stage 0: embed a microbatch, compute its loss at the head, and finish its backward pass."""

    def __init__(
        self,
        piece: DataPiece,
        optimizer: StageOptimizer,
        precision: Precision | None = None,
        wire: Wire | None = None,
    ) -> None:
        self.piece = piece
        self.optimizer = optimizer
        self.precision = precision or Precision()
        self.wire = wire or Wire()
        self.scaler = self.precision.scaler()  # constant during an iteration: a data node steps after each
        self._overflowed = False  # a microbatch of this iteration overflowed (float16)
        self._embedded: dict[MicrobatchKey, _Held] = {}
        self._gradients = OrderFreeSum(list(piece.parameters()))

    @property
    def in_flight(self) -> int:
        return len(self._embedded)

    def embed(self, key: MicrobatchKey, tokens: Tensor, now: float) -> Tensor:
        hidden = self.piece.embed(tokens.to(self.precision.device))
        self._embedded[key] = _Held(tokens, hidden, now)
        return _to_wire(hidden, self.wire.activations)

    def embed_eval(self, tokens: Tensor) -> Tensor:
        """A validation microbatch's embedding, as it travels: nothing held, no gradient."""
        with torch.no_grad():
            return _to_wire(self.piece.embed(tokens.to(self.precision.device)), self.wire.activations)

    def loss_and_grad(self, hidden: Tensor, targets: Tensor, scale: float) -> tuple[float, Tensor]:
        """Loss at the head for returned activations; backward through the head; the hidden-state gradient.

        `scale` weights this microbatch in the iteration's mean loss (1 / microbatches per iteration).
        Raises Overflow if a float16 pass overflowed.
        """
        inputs = hidden.detach().to(self.precision.device, torch.float32).requires_grad_(True)
        with self.precision.autocast():
            loss = self.piece.loss(inputs, targets.to(self.precision.device))
        self._gradients.backward(loss.float() * (scale * self.scaler.scale))
        try:
            grad = _unscaled_gradient(inputs, self.scaler.scale, "at the head")
        except Overflow:
            self._overflowed = True
            raise
        return float(loss.detach()), _to_wire(grad, self.wire.gradients)

    def eval_loss(self, hidden: Tensor, targets: Tensor) -> float:
        """The validation loss of returned activations: no gradient."""
        with torch.no_grad(), self.precision.autocast():
            inputs = hidden.to(self.precision.device, torch.float32)
            return float(self.piece.loss(inputs, targets.to(self.precision.device)))

    def finish(self, key: MicrobatchKey, grad: Tensor) -> None:
        """The gradient has come back to the embedding: complete the backward pass."""
        held = self._embedded.pop(key, None)
        if held is None:
            raise MissingActivations(key)
        self._gradients.backward(
            held.outputs, grad.to(self.precision.device, torch.float32) * self.scaler.scale
        )

    def drop(self, key: MicrobatchKey) -> bool:
        return self._embedded.pop(key, None) is not None

    def output_shape(self, key: MicrobatchKey) -> tuple[int, ...] | None:
        held = self._embedded.get(key)
        return None if held is None else tuple(held.outputs.shape)

    def step(self, grad_scale: float = 1.0, at: int | None = None) -> float:
        self._gradients.load()
        norm = self.optimizer.step(grad_scale / self.scaler.scale, at)
        self.scaler.update(overflowed=self._overflowed or not math.isfinite(norm))
        self._overflowed = False
        return norm

    def discard_gradients(self) -> None:
        """An iteration in which no microbatch completed: drop its partial gradients."""
        self._gradients.clear()
        self.optimizer.adam.zero_grad()
        if self._overflowed:  # the overflow, not a lost swarm, emptied it: back off
            self.scaler.update(overflowed=True)
        self._overflowed = False


def check_activations(tensor: Tensor, batch_limit: int, seq_len: int, dim: int) -> str | None:
    """Why a peer's hidden-state tensor is unacceptable, or None: shape, dtype and finiteness."""
    if tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {tensor.dtype} is not a floating type"
    if tensor.dim() != 3:
        return f"expected (batch, seq, dim), got shape {tuple(tensor.shape)}"
    batch, seq, width = tensor.shape
    if not (1 <= batch <= batch_limit and 1 <= seq <= seq_len and width == dim):
        return f"shape {tuple(tensor.shape)} exceeds (<= {batch_limit}, <= {seq_len}, {dim})"
    if not all_finite(tensor):
        return "non-finite values"
    return None
