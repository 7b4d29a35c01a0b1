"""`swarmnode.adam.Adam` against `torch.optim.Adam`."""

from __future__ import annotations

import copy

import pytest
import torch

from swarmnode.adam import STATE_FIELDS, Adam


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 6))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    ("fused", "torch_path"), [(None, {"fused": True}), (True, {"fused": True}), (False, {"foreach": False})]
)
def test_the_update_is_torchs_bit_for_bit(seed: int, fused: bool | None, torch_path: dict[str, bool]) -> None:
    ours_model = _model(seed)
    torch_model = copy.deepcopy(ours_model)
    ours = Adam(ours_model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, fused=fused)
    theirs = torch.optim.Adam(torch_model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, **torch_path)
    generator = torch.Generator().manual_seed(seed)
    for step in range(40):
        x = torch.randn(5, 12, generator=generator)
        lr = 3e-3 * (step + 1) / 40  # a schedule: the rate changes every step
        ours.lr = lr
        for group in theirs.param_groups:
            group["lr"] = lr
        for model, optimizer in ((ours_model, ours), (torch_model, theirs)):
            model(x).square().mean().backward()
            if step == 7:  # a step in which the first layer got no gradient: left alone, its step not counted
                model[0].weight.grad = None
            optimizer.step()
            optimizer.zero_grad()
    pairs = list(zip(ours_model.parameters(), torch_model.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in pairs)
    for a, b in pairs:
        for field in STATE_FIELDS:
            assert torch.equal(ours.state[a][field], theirs.state[b][field]), field
    assert ours.state[ours_model[0].weight]["step"].item() == 39
    assert all(p.grad is None for p in ours_model.parameters())


def test_cleared_moments_start_again_from_zero() -> None:
    model = _model(0)
    optimizer = Adam(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    model(torch.ones(2, 12)).sum().backward()
    optimizer.step()
    optimizer.state.clear()
    optimizer.zero_grad()
    model(torch.ones(2, 12)).sum().backward()
    optimizer.step()
    assert all(s["step"].item() == 1 for s in optimizer.state.values())


def test_a_step_without_gradients_changes_nothing() -> None:
    model = _model(0)
    before = [p.clone() for p in model.parameters()]
    Adam(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8).step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize(
    ("lr", "betas", "eps"),
    [(-1.0, (0.9, 0.95), 1e-8), (1e-3, (1.0, 0.95), 1e-8), (1e-3, (0.9, 0.95), float("nan"))],
)
def test_invalid_settings_are_refused(lr: float, betas: tuple[float, float], eps: float) -> None:
    with pytest.raises(ValueError):
        Adam(_model(0).parameters(), lr=lr, betas=betas, eps=eps)
