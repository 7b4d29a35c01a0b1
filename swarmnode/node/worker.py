"""The torch side of a daemon: run a stage's piece forward and backward for microbatches in flight.

Everything here runs on the compute thread (`node.compute`), one call at a time. Activations are kept
between a microbatch's forward and backward pass, keyed by `(origin peer, iteration, microbatch)`, and
dropped when the backward pass is done or the microbatch is aborted. A transformer stage keeps one gradient
buffer per group (a data node's iteration): each backward pass accumulates into its group's buffer, and each
group is one optimizer update (`protocols.stepbook`). The daemon steps only when no activation is held, so
an update never changes weights that a pending backward pass still needs.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from protocols.stepbook import Group, MicrobatchKey
from swarmnode.optim import StageOptimizer
from swarmnode.pieces import DataPiece


class MissingActivations(KeyError):
    """A backward pass arrived for a microbatch this node holds nothing for (never seen, aborted, expired)."""


@dataclass
class _Held:
    inputs: Tensor
    outputs: Tensor
    created: float


class StageWorker:
    """Forward and backward passes of one transformer stage, with its optimizer."""

    def __init__(self, module: nn.Module, optimizer: StageOptimizer) -> None:
        self.module = module
        self.optimizer = optimizer
        self._held: dict[MicrobatchKey, _Held] = {}
        self._params = list(module.parameters())
        self._grads: dict[Group, list[Tensor | None]] = {}  # each group's accumulated gradients

    @property
    def in_flight(self) -> int:
        return len(self._held)

    @property
    def gradient_groups(self) -> int:
        """Groups with gradients waiting for their update."""
        return len(self._grads)

    def forward(self, key: MicrobatchKey, hidden: Tensor, now: float) -> Tensor:
        inputs = hidden.detach().float().requires_grad_(True)
        outputs = self.module(inputs)
        self._held[key] = _Held(inputs, outputs, now)
        return outputs.detach()

    def backward(self, key: MicrobatchKey, grad: Tensor) -> Tensor:
        held = self._held.pop(key, None)
        if held is None:
            raise MissingActivations(key)
        self._load_grads(key.group)
        try:
            held.outputs.backward(grad.float())
        finally:
            self._grads[key.group] = [p.grad for p in self._params]
            self._load_grads(None)
        if held.inputs.grad is None:
            raise RuntimeError(f"no input gradient for microbatch {key}")
        return held.inputs.grad

    def _load_grads(self, group: Group | None) -> None:
        """Point the parameters' `.grad` at `group`'s buffer (None: at nothing)."""
        buffers = self._grads.get(group) if group is not None else None
        for param, buffer in zip(self._params, buffers or [None] * len(self._params), strict=True):
            param.grad = buffer

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
            del self._grads[group]
        return len(stale)

    def step_group(self, group: Group) -> float | None:
        """One optimizer update with `group`'s gradients, at the learning rate of its iteration; the gradient
        norm, or None if the group has no gradients here."""
        if group not in self._grads:
            return None
        self._load_grads(group)
        del self._grads[group]
        return self.optimizer.step(1.0, group[1])


class DataWorker:
    """Stage 0: embed a microbatch, compute its loss at the head, and finish its backward pass."""

    def __init__(self, piece: DataPiece, optimizer: StageOptimizer) -> None:
        self.piece = piece
        self.optimizer = optimizer
        self._embedded: dict[MicrobatchKey, _Held] = {}

    @property
    def in_flight(self) -> int:
        return len(self._embedded)

    def embed(self, key: MicrobatchKey, tokens: Tensor, now: float) -> Tensor:
        hidden = self.piece.embed(tokens)
        self._embedded[key] = _Held(tokens, hidden, now)
        return hidden.detach()

    def loss_and_grad(self, hidden: Tensor, targets: Tensor, scale: float) -> tuple[float, Tensor]:
        """Loss at the head for returned activations; backward through the head; the hidden-state gradient.

        `scale` weights this microbatch in the iteration's mean loss (1 / microbatches per iteration).
        """
        inputs = hidden.detach().float().requires_grad_(True)
        loss = self.piece.loss(inputs, targets)
        (loss * scale).backward()
        if inputs.grad is None:
            raise RuntimeError("no gradient at the head")
        return float(loss.detach()), inputs.grad

    def finish(self, key: MicrobatchKey, grad: Tensor) -> None:
        """The gradient has come back to the embedding: complete the backward pass."""
        held = self._embedded.pop(key, None)
        if held is None:
            raise MissingActivations(key)
        held.outputs.backward(grad.float())

    def drop(self, key: MicrobatchKey) -> bool:
        return self._embedded.pop(key, None) is not None

    def output_shape(self, key: MicrobatchKey) -> tuple[int, ...] | None:
        held = self._embedded.get(key)
        return None if held is None else tuple(held.outputs.shape)

    def step(self, grad_scale: float = 1.0, at: int | None = None) -> float:
        return self.optimizer.step(grad_scale, at)

    def discard_gradients(self) -> None:
        """An iteration in which no microbatch completed: drop its partial gradients."""
        self.optimizer.adam.zero_grad(set_to_none=True)


def check_activations(tensor: Tensor, batch_limit: int, seq_len: int, dim: int) -> str | None:
    """Why a peer's hidden-state tensor is unacceptable, or None: shape, dtype and finiteness."""
    if tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {tensor.dtype} is not a floating type"
    if tensor.dim() != 3:
        return f"expected (batch, seq, dim), got shape {tuple(tensor.shape)}"
    batch, seq, width = tensor.shape
    if not (1 <= batch <= batch_limit and 1 <= seq <= seq_len and width == dim):
        return f"shape {tuple(tensor.shape)} exceeds (<= {batch_limit}, <= {seq_len}, {dim})"
    if not bool(torch.isfinite(tensor).all()):
        return "non-finite values"
    return None
