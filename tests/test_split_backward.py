"""`node.split_backward` and the split in `StageWorker`: the gradient at the inputs first, the linear layers'
weight gradients later, and the same gradients, to the bit, as autograd's whole pass on a CPU in float32."""

from __future__ import annotations

import pytest
import torch

from protocols.stepbook import MicrobatchKey
from swarmnode.model import build_stage
from swarmnode.model_config import ModelConfig
from swarmnode.node.gradient_sums import IndexOrderedSum
from swarmnode.node.split_backward import SplitBackward, WeightWork, holds_whole
from swarmnode.node.worker import StageWorker
from swarmnode.optim import Schedule, StageOptimizer
from swarmnode.precision import Precision

CONFIG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_hidden=64, max_seq_len=8)
LONG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_hidden=64, max_seq_len=256)
WIDE = ModelConfig(
    vocab_size=64, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=688, max_seq_len=64
)


def _data(config: ModelConfig, count: int, seq: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(2, seq, config.dim, generator=generator) for _ in range(count)]
    grads = [torch.randn(2, seq, config.dim, generator=generator) * 10.0**i for i in range(count)]
    return inputs, grads


@pytest.mark.parametrize(("config", "seq"), [(CONFIG, 8), (WIDE, 64)])
def test_both_parts_give_autograds_gradients_bit_for_bit(config: ModelConfig, seq: int) -> None:
    torch.manual_seed(0)
    module = build_stage(config, 1, 1)
    params = list(module.parameters())
    (x,), (grad,) = _data(config, 1, seq)
    whole = x.clone().requires_grad_(True)
    (module(whole) * grad).sum().backward()
    expected = [p.grad.clone() for p in params]
    module.zero_grad(set_to_none=True)

    split = SplitBackward(module, params)
    inputs = x.clone().requires_grad_(True)
    with split.recording() as records:
        outputs = module(inputs)
    assert len(records) == 7 * config.n_layers  # q, k, v, o, gate, up, down
    work = split.input_pass(outputs, grad, inputs, records)
    assert inputs.grad is not None and torch.equal(inputs.grad, whole.grad)
    missing = [i for i, g in enumerate(work.grads) if g is None]
    assert sorted(missing) == sorted(position for position, _, _ in records)  # the weights wait
    assert all(p.grad is None for p in params)  # nothing accumulated into the parameters
    got: list[torch.Tensor | None] = [None] * len(params)
    work.fold_into(got)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert not work.linears and all(g is None for g in work.grads)  # folded once: a second fold adds nothing


def _trained(
    split: bool,
    backward_order: tuple[int, ...],
    weights_order: tuple[int, ...],
    config: ModelConfig = CONFIG,
    seq: int = 8,
) -> list[torch.Tensor]:
    torch.manual_seed(0)
    module = build_stage(config, 1, 1)
    worker = StageWorker(module, StageOptimizer(module, Schedule(1e-2, 0, 100), 1e9), split=split)
    inputs, grads = _data(config, 4, seq)
    keys = [MicrobatchKey("a", 5, k) for k in range(4)]
    for k in range(4):
        worker.forward(keys[k], inputs[k], 0.0)
    for k in backward_order:
        worker.backward(keys[k], grads[k])
    assert worker.pending_weights == (4 if split else 0)
    for k in weights_order:
        worker.weights(keys[k])
    worker.step_group(("a", 5))
    assert worker.pending_weights == 0 and worker.gradient_groups == 0
    return [p.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize("backward_order", [(0, 1, 2, 3), (3, 1, 0, 2)])
@pytest.mark.parametrize("weights_order", [(), (2,), (3, 0), (0, 1, 2, 3), (1, 3, 2, 0)])
def test_a_split_stage_updates_as_a_whole_pass_does_whatever_the_order(
    backward_order: tuple[int, ...], weights_order: tuple[int, ...]
) -> None:
    """The weights' parts done in any order, or left for the step, give the whole passes' update."""
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            _trained(True, backward_order, weights_order), _trained(False, backward_order, ()), strict=True
        )
    )


@pytest.mark.parametrize("backward_order", [(0, 1, 2, 3), (3, 1, 0, 2)])
@pytest.mark.parametrize("weights_order", [(), (2,), (3, 0), (1, 3, 2, 0)])
def test_large_microbatches_give_one_update_whatever_the_order(
    backward_order: tuple[int, ...], weights_order: tuple[int, ...]
) -> None:
    """512 tokens a microbatch of a narrow stage: its weights' parts hold more than the gradients they make,
    so they are computed apart when their job runs (`WeightWork.to_hold`), summed in index order, and give
    a whole pass's update."""
    expected = _trained(True, (0, 1, 2, 3), (0, 1, 2, 3), LONG, 256)
    got = _trained(True, backward_order, weights_order, LONG, 256)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    whole = _trained(False, (0, 1, 2, 3), (), LONG, 256)  # autograd's accumulation: the same products, added
    assert all(torch.equal(a, b) for a, b in zip(got, whole, strict=True))


def _first_parts(
    config: ModelConfig, count: int, seq: int
) -> tuple[list[torch.nn.Parameter], list[WeightWork]]:
    torch.manual_seed(0)
    module = build_stage(config, 1, 1)
    params = list(module.parameters())
    split = SplitBackward(module, params)
    inputs, grads = _data(config, count, seq)
    works = []
    for x, g in zip(inputs, grads, strict=True):
        leaf = x.clone().requires_grad_(True)
        with split.recording() as records:
            outputs = module(leaf)
        works.append(split.input_pass(outputs, g, leaf, records))
    return params, works


def test_a_small_weights_part_is_held_whole_and_a_large_one_computed_apart() -> None:
    _, (small,) = _first_parts(CONFIG, 1, 8)  # 16 tokens: inputs and output gradients smaller than weights
    assert small.to_hold().linears
    _, (large,) = _first_parts(LONG, 1, 256)  # 512 tokens of a 32-wide stage
    assert any(g is None for g in large.grads)
    held = large.to_hold()
    assert not held.linears and all(g is not None for g in held.grads)


@pytest.mark.parametrize("tokens", [18, 19])  # CONFIG's stage holds a part whole up to 18 tokens
def test_the_trainers_foresight_agrees_with_a_parts_own_shapes(tokens: int) -> None:
    torch.manual_seed(0)
    module = build_stage(CONFIG, 1, 1)
    split = SplitBackward(module, list(module.parameters()))
    leaf = torch.randn(tokens, 1, CONFIG.dim).requires_grad_(True)  # `tokens` sequences of one token
    with split.recording() as records:
        outputs = module(leaf)
    work = split.input_pass(outputs, torch.randn_like(outputs), leaf, records)
    assert holds_whole(module, tokens) == bool(work.to_hold().linears) == (tokens <= 18)


def test_a_weights_part_is_computed_when_its_turn_in_the_sum_comes() -> None:
    params, works = _first_parts(CONFIG, 2, 8)
    sums = IndexOrderedSum(params)
    sums.add_work(1, works[1].to_hold())
    assert sums.held == 1 and works[1].linears  # held, its products not computed
    sums.add_work(0, works[0].to_hold())
    assert sums.held == 0 and not works[0].linears and not works[1].linears


def _wide_linear_terms() -> list[WeightWork]:
    """Three microbatches' parts of one 1024 x 1024 layer, 512 tokens each: held whole (as large as the
    weight), and summed by `addmm_`, which here may round otherwise than a product written apart."""
    generator = torch.Generator().manual_seed(2)
    return [
        WeightWork(
            [None],
            [
                (
                    0,
                    torch.randn(512, 1024, generator=generator),
                    torch.randn(512, 1024, generator=generator) * 10.0**i,
                )
            ],
        )
        for i in range(3)
    ]


def test_parts_folded_into_the_sum_give_one_sum_whatever_the_order() -> None:
    param = torch.nn.Parameter(torch.zeros(1024, 1024))
    results = []
    for order in [(0, 1, 2), (2, 1, 0), (1, 2, 0)]:
        works = _wide_linear_terms()
        sums = IndexOrderedSum([param])
        for index in order:
            sums.add_work(index, works[index].to_hold())
        sums.load()
        assert param.grad is not None
        results.append(param.grad)
    assert all(torch.equal(result, results[0]) for result in results[1:])


def test_a_dropped_groups_pending_parts_go_with_it_and_late_calls_do_nothing() -> None:
    torch.manual_seed(0)
    module = build_stage(CONFIG, 1, 1)
    worker = StageWorker(module, StageOptimizer(module, Schedule(1e-2, 0, 100), 1.0), split=True)
    inputs, grads = _data(CONFIG, 2, 8)
    kept, dropped = MicrobatchKey("a", 5, 0), MicrobatchKey("b", 5, 0)
    for key, x, g in zip((kept, dropped), inputs, grads, strict=True):
        worker.forward(key, x, 0.0)
        worker.backward(key, g)
    assert worker.discard_gradients_except({("a", 5)}) == 1
    assert worker.pending_weights == 1
    worker.weights(dropped)  # its group is gone: nothing to add to
    worker.weights(kept)
    worker.weights(kept)  # done already
    assert worker.pending_weights == 0
    before = [p.detach().clone() for p in module.parameters()]
    assert worker.step_group(("a", 5)) is not None
    assert any(not torch.equal(a, p) for a, p in zip(before, module.parameters(), strict=True))


@pytest.mark.parametrize(("dtype", "pending"), [(torch.float32, 1), (torch.bfloat16, 0)])
def test_a_float32_worker_splits_by_default_and_a_mixed_precision_one_does_not(
    dtype: torch.dtype, pending: int
) -> None:
    module = build_stage(CONFIG, 1, 1)
    optimizer = StageOptimizer(module, Schedule(1e-2, 0, 100), 1.0)
    worker = StageWorker(module, optimizer, Precision(torch.device("cpu"), dtype))
    worker.forward(MicrobatchKey("a", 5, 0), torch.zeros(1, 8, CONFIG.dim), 0.0)
    worker.backward(MicrobatchKey("a", 5, 0), torch.ones(1, 8, CONFIG.dim))
    assert worker.pending_weights == pending
    assert worker.step_group(("a", 5)) is not None and worker.pending_weights == 0


def test_a_mixed_precision_worker_refuses_to_split() -> None:
    module = build_stage(CONFIG, 1, 1)
    optimizer = StageOptimizer(module, Schedule(1e-2, 0, 100), 1.0)
    with pytest.raises(ValueError, match="cannot split"):
        StageWorker(module, optimizer, Precision(torch.device("cpu"), torch.bfloat16), split=True)


def test_a_gradient_sum_refuses_a_second_pass_or_a_wrong_count() -> None:
    params = list(build_stage(CONFIG, 1, 1).parameters())
    sums = IndexOrderedSum(params)
    sums.add(1, [torch.ones_like(p) for p in params])  # held for index 0's turn
    with pytest.raises(ValueError, match="already had"):
        sums.add(1, [None] * len(params))
    with pytest.raises(ValueError, match="gradients for"):
        sums.add(0, [None])
