"""`worker.OrderFreeSum`: a data node's gradients do not depend on the order its microbatches came back in."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from swarmnode.node.gradient_sums import OrderFreeSum, SpareSums


def terms(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randn(4096, generator=generator) * 10.0 ** (i - 2) for i in range(count)]


def summed(order: tuple[int, ...], parts: list[torch.Tensor]) -> torch.Tensor:
    param = nn.Parameter(torch.zeros(4096))
    gradients = OrderFreeSum([param])
    for i in order:
        gradients.backward((param * parts[i]).sum())  # d/dparam = parts[i]
    gradients.load()
    assert param.grad is not None and param.grad.dtype == torch.float32
    return param.grad


def test_any_order_of_the_passes_gives_the_same_bits() -> None:
    parts = terms(4)
    orders = list(itertools.permutations(range(4)))
    plain = {tuple(sum((parts[i] for i in order), torch.zeros(4096)).tolist()) for order in orders}
    assert len(plain) > 1  # summed in float32, the order shows in the last bits
    results = [summed(order, parts) for order in orders]
    assert all(torch.equal(results[0], result) for result in results[1:])
    exact = sum((p.double() for p in parts), torch.zeros(4096, dtype=torch.float64)).float()
    assert torch.equal(results[0], exact)


def test_inputs_keep_their_gradient_and_new_sums_start_after_a_load() -> None:
    param = nn.Parameter(torch.ones(3))
    gradients = OrderFreeSum([param])
    inputs = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    gradients.backward((param * inputs).sum())
    assert param.grad is None and torch.equal(inputs.grad, torch.ones(3))  # held in the sums, not in .grad
    gradients.load()
    assert torch.equal(param.grad, torch.tensor([1.0, 2.0, 3.0]))
    gradients.load()
    assert param.grad is None  # nothing since the last load
    gradients.backward((param * 2.0).sum())
    gradients.clear()
    gradients.load()
    assert param.grad is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_pass_with_an_upstream_gradient_matches_torchs_backward_bit_for_bit(dtype: torch.dtype) -> None:
    """A stage node's pass takes the next stage's gradient; it runs as a scalar's backward (no sympy import),
    and must give exactly the gradients `outputs.backward(grad)` gives."""
    generator = torch.Generator().manual_seed(3)
    layer = nn.Linear(16, 16).to(dtype)
    inputs = torch.randn(4, 16, generator=generator, dtype=dtype)
    grad = torch.randn(4, 16, generator=generator)  # float32 on the wire, as `StageWorker.backward` passes it
    expected = nn.Linear(16, 16).to(dtype)
    expected.load_state_dict(layer.state_dict())
    expected(inputs).backward(grad)
    gradients = OrderFreeSum(list(layer.parameters()))
    gradients.backward(layer(inputs), grad)
    gradients.load()
    for ours, theirs in zip(layer.parameters(), expected.parameters(), strict=True):
        assert ours.grad is not None and torch.equal(ours.grad, theirs.grad.float()), dtype


def test_bfloat16_gradients_are_summed_exactly_too() -> None:
    """Later passes are added into the float64 sums without a float64 copy of each term: the widening
    inside the add is exact, as the copy's was."""
    parts = [part.to(torch.bfloat16) for part in terms(3)]
    param = nn.Parameter(torch.zeros(4096, dtype=torch.bfloat16))
    gradients = OrderFreeSum([param])
    for part in parts:
        gradients.backward((param * part).sum())
    gradients.load()
    exact = sum((p.double() for p in parts), torch.zeros(4096, dtype=torch.float64)).to(torch.bfloat16)
    assert param.grad is not None and torch.equal(param.grad, exact)


def test_a_new_group_reuses_a_finished_groups_buffers_and_starts_from_its_own_gradients() -> None:
    parts = terms(3)
    param = nn.Parameter(torch.zeros(4096))
    spare = SpareSums()
    first = OrderFreeSum([param], spare)
    for part in parts[:2]:
        first.backward((param * part).sum())
    first.load()
    assert len(spare) == 1  # the float64 sum, given back
    assert torch.equal(param.grad, (parts[0].double() + parts[1].double()).float())
    second = OrderFreeSum([param], spare)
    second.backward((param * parts[2]).sum())
    assert len(spare) == 0  # taken: no fresh buffer
    second.load()
    assert torch.equal(param.grad, parts[2])  # nothing of the first group's sum left in it
    second.backward((param * parts[0]).sum())
    second.clear()  # dropped sums are spare too
    assert len(spare) == 1
