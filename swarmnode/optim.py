"""Inner optimizer and learning-rate schedule, shared by the single-process trainer and the daemon.

Each stage owns its own Adam and clips its own gradient at `max_grad_norm`: a swarm has no global gradient
norm, so the reference trainer clips per stage too and both run the same algorithm. The gradient norm is
measured before clipping (CheckFree weights stages by it; see protocols.checkfree).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from swarmnode.adam import Adam


@dataclass(frozen=True)
class Schedule:
    """Linear warm-up to `peak_lr`, then cosine decay to `min_ratio * peak_lr` at `total_steps`."""

    peak_lr: float
    warmup_steps: int
    total_steps: int
    min_ratio: float = 0.1

    def __post_init__(self) -> None:
        if self.peak_lr <= 0 or self.warmup_steps < 0 or self.total_steps < 1:
            raise ValueError(f"invalid schedule {self}")

    def lr_at(self, step: int) -> float:
        """Learning rate for optimizer step `step` (0-based); constant at the floor after `total_steps`."""
        if step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.peak_lr * (self.min_ratio + (1.0 - self.min_ratio) * cosine)


class StageOptimizer:
    """Adam over one stage's parameters, with per-stage clipping and an lr multiplier.

    `lr_factor` is what CheckFree's rebuild sets (x1.1 on a rebuilt stage). `step_count` is the position on
    the schedule: in the single process the steps taken; in a swarm the swarm clock (the data nodes'
    iteration) this stage has reached, which advances also while the stage takes no step (a replica that
    received no microbatch in an iteration). Replicas of a stage therefore share the learning rate and the
    NoLoCo outer-step boundaries whatever share of the microbatches each one gets. `updates` counts the
    Adam updates this stage really took.
    """

    def __init__(self, module: nn.Module, schedule: Schedule, max_grad_norm: float = 1.0) -> None:
        self.module = module
        self.schedule = schedule
        self.max_grad_norm = max_grad_norm
        self.lr_factor = 1.0
        self.step_count = 0
        self.updates = 0
        self.last_grad_norm: float | None = None
        trained = [p for p in module.parameters() if p.requires_grad]
        self.adam = Adam(trained, lr=schedule.lr_at(0), betas=(0.9, 0.95), eps=1e-8)

    @property
    def lr(self) -> float:
        return self.schedule.lr_at(self.step_count) * self.lr_factor

    def advance(self, clock: int) -> None:
        """The swarm clock reached `clock`: move the schedule there (it never moves back)."""
        self.step_count = max(self.step_count, clock)

    def step(self, grad_scale: float = 1.0, at: int | None = None) -> float:
        """Scale the accumulated gradients, clip, take one Adam step for clock tick `at` (default: the
        current position), zero the gradients; the position is then past `at`.

        Returns the gradient norm measured before clipping. A non-finite norm skips the update (the
        gradients are dropped) so one poisoned microbatch cannot corrupt the weights.
        """
        tick = self.step_count if at is None else max(at, 0)
        params = [p for p in self.module.parameters() if p.grad is not None]
        if grad_scale != 1.0:
            for p in params:
                p.grad.mul_(grad_scale)
        norm = float(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)) if params else 0.0
        if math.isfinite(norm):
            self.adam.lr = self.schedule.lr_at(tick) * self.lr_factor
            self.adam.step()
            self.advance(tick + 1)
            self.updates += 1
            self.last_grad_norm = norm
        self.adam.zero_grad()
        return norm

    def gradients_finite(self) -> bool:
        """Whether every accumulated gradient is finite (a float16 pass may have overflowed)."""
        norms = [torch.linalg.vector_norm(p.grad) for p in self.module.parameters() if p.grad is not None]
        return not norms or math.isfinite(float(torch.linalg.vector_norm(torch.stack(norms))))

    def discard(self) -> None:
        """Drop the accumulated gradients without an update."""
        self.adam.zero_grad()

    def reset(self, lr_factor: float) -> None:
        """Fresh Adam moments (a rebuilt stage) and the lr multiplied by `lr_factor`; the schedule goes on."""
        self.adam.state.clear()
        self.lr_factor = lr_factor
