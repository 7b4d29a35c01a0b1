"""`gradient_sums.IndexOrderedSum`: a stage's gradients are the float32 sum in microbatch order, whatever
order the backward passes ran in, with microbatches missing (another replica's, lost) or out of order."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from swarmnode.node.gradient_sums import IndexOrderedSum


def terms(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randn(4096, generator=generator) * 10.0 ** (i - 2) for i in range(count)]


def folded(indices: list[int], parts: list[torch.Tensor]) -> torch.Tensor:
    """The single process's sum: float32, in index order."""
    total = parts[indices[0]].clone()
    for i in indices[1:]:
        total += parts[i]
    return total


def summed(order: tuple[int, ...], parts: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """The sum of the passes run in `order`, and how many passes were held after each."""
    param = nn.Parameter(torch.zeros(4096))
    gradients = IndexOrderedSum([param])
    held = []
    for i in order:
        gradients.backward(i, param * 1.0, parts[i])  # d/dparam = parts[i]
        held.append(gradients.held)
    gradients.load()
    assert param.grad is not None and param.grad.dtype == torch.float32 and gradients.held == 0
    return param.grad, held


def test_any_order_gives_the_index_ordered_float32_sum_bit_for_bit() -> None:
    parts = terms(4)
    orders = list(itertools.permutations(range(4)))
    plain = {tuple(sum((parts[i] for i in order), torch.zeros(4096)).tolist()) for order in orders}
    assert len(plain) > 1  # summed in the order they came, the order shows in the last bits
    expected = folded([0, 1, 2, 3], parts)
    for order in orders:
        assert torch.equal(summed(order, parts)[0], expected), order


@pytest.mark.parametrize("present", [[1, 3], [0, 2, 3], [2], [1, 2, 3]])
def test_indices_that_never_come_are_left_out_and_the_rest_keep_their_order(present: list[int]) -> None:
    """A replica sees some of a group's microbatches; a lost one never comes back."""
    parts = terms(4)
    for order in itertools.permutations(present):
        assert torch.equal(summed(order, parts)[0], folded(present, parts)), order


def test_passes_in_order_are_folded_at_once_and_a_late_one_releases_those_after_it() -> None:
    parts = terms(4)
    assert summed((0, 1, 2, 3), parts)[1] == [0, 0, 0, 0]
    assert summed((1, 3, 2, 0), parts)[1] == [1, 2, 3, 0]  # 0 comes last: all fold then, in order
    assert summed((0, 2, 3, 1), parts)[1] == [0, 1, 2, 0]


def test_a_second_pass_for_one_microbatch_is_refused() -> None:
    param = nn.Parameter(torch.zeros(3))
    gradients = IndexOrderedSum([param])
    gradients.backward(0, param * 1.0, torch.ones(3))
    gradients.backward(2, param * 1.0, torch.ones(3))
    for index in (0, 2, -1):
        with pytest.raises(ValueError, match="already had its backward pass"):
            gradients.backward(index, param * 1.0, torch.ones(3))


def test_inputs_keep_their_gradient_and_the_sum_starts_anew_after_a_load_or_clear() -> None:
    param = nn.Parameter(torch.ones(3))
    gradients = IndexOrderedSum([param])
    inputs = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    gradients.backward(1, param * inputs, torch.ones(3))
    assert param.grad is None and torch.equal(inputs.grad, torch.ones(3))  # held, not in .grad
    gradients.load()
    assert torch.equal(param.grad, torch.tensor([1.0, 2.0, 3.0]))
    gradients.load()
    assert param.grad is None  # nothing since the last load
    gradients.backward(0, param * 2.0, torch.ones(3))  # index 0 again: a new sum
    gradients.clear()
    gradients.load()
    assert param.grad is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_stage_pass_matches_torchs_backward_and_the_trainers_accumulation(dtype: torch.dtype) -> None:
    """Each pass gives exactly the gradients `outputs.backward(grad)` gives, and passes in any order sum to
    what the single-process trainer's accumulation into `.grad` gives in microbatch order."""
    generator = torch.Generator().manual_seed(3)
    layer = nn.Linear(16, 16).to(dtype)
    expected = nn.Linear(16, 16).to(dtype)
    expected.load_state_dict(layer.state_dict())
    batches = [torch.randn(4, 16, generator=generator, dtype=dtype) for _ in range(3)]
    grads = [torch.randn(4, 16, generator=generator) for _ in range(3)]  # float32, as on the wire
    for inputs, grad in zip(batches, grads, strict=True):
        expected(inputs).backward(grad)  # accumulates in order
    gradients = IndexOrderedSum(list(layer.parameters()))
    for i in (2, 0, 1):
        gradients.backward(i, layer(batches[i]), grads[i])
    gradients.load()
    for ours, theirs in zip(layer.parameters(), expected.parameters(), strict=True):
        assert ours.grad is not None and torch.equal(ours.grad, theirs.grad), dtype
