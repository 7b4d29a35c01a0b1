"""Adam as `torch.optim.Adam` computes it, without `torch.optim`.

Building or stepping any `torch.optim` optimizer imports `torch._dynamo` (`torch._disable_dynamo`): 1.0-1.25 s
of CPU on a 2-core machine, paid by every daemon at start and, in a swarm, on a replacement node's path to
its first step. This is the same update (without weight decay, amsgrad or maximize; the per-parameter state
`step`, `exp_avg` and `exp_avg_sq` torch keeps):

- on a CPU, torch's fused kernel (`torch.optim.Adam(fused=True)`), one pass over each parameter and its
  moments: on a stage of four llama-124m layers (31M parameters), one thread, 0.036 s a step against 0.118 s
  for the `_foreach` kernels, which pass over the memory about seven times (`benchmarks/adam_step.py`, with
  the daemons' malloc settings; 0.150 s without them, in session 25).
  Within a few units in the last place of the single-tensor path (the arithmetic is ordered differently);
- elsewhere (a GPU), or with `fused=False`, torch's `_foreach` kernels computing the single-tensor update.

`tests/test_adam.py` checks both bit for bit against `torch.optim.Adam(fused=True)` and
`torch.optim.Adam(foreach=False)`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

STATE_FIELDS = ("step", "exp_avg", "exp_avg_sq")


class Adam:
    """Adam over `params`. `state[param]` holds `step` (a float32 scalar on the host, as torch keeps it),
    `exp_avg` and `exp_avg_sq`, created at the parameter's first step; a parameter without a gradient is
    left alone. `state` may be cleared (fresh moments) or filled by the caller (a transferred state).
    `fused`: torch's fused kernel; by default where every parameter stepped is on a CPU."""

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float,
        betas: tuple[float, float],
        eps: float,
        fused: bool | None = None,
    ) -> None:
        beta1, beta2 = betas
        for name, value in (("lr", lr), ("eps", eps)):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
            raise ValueError(f"betas must lie in [0, 1), got {betas!r}")
        self.params = list(params)
        self.lr = lr
        self.betas = (beta1, beta2)
        self.eps = eps
        self.fused = fused
        self.state: dict[Tensor, dict[str, Tensor]] = {}

    @torch.no_grad()
    def step(self) -> None:
        """One update of every parameter that has a gradient, at `self.lr`."""
        beta1, beta2 = self.betas
        params = [p for p in self.params if p.grad is not None]
        if not params:
            return
        states = [self._state(p) for p in params]
        grads = [p.grad for p in params]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1)
        fused = self.fused if self.fused is not None else all(p.device.type == "cpu" for p in params)
        if fused:
            torch._fused_adam_(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                [],
                steps,
                amsgrad=False,
                lr=self.lr,
                beta1=beta1,
                beta2=beta2,
                weight_decay=0.0,
                eps=self.eps,
                maximize=False,
            )
            return
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        counts = [step.item() for step in steps]
        denoms = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denoms, [(1 - beta2**count) ** 0.5 for count in counts])
        torch._foreach_add_(denoms, self.eps)
        step_sizes = [-(self.lr / (1 - beta1**count)) for count in counts]
        torch._foreach_addcdiv_(params, exp_avgs, denoms, step_sizes)

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None

    def _state(self, param: Tensor) -> dict[str, Tensor]:
        state = self.state.get(param)
        if not state:
            state = self.state[param] = {
                "step": torch.tensor(0.0, dtype=torch.float32),
                "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
            }
        return state
