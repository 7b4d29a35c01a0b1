"""`trainer_passes`: the single process's float32 passes split and summed as a stage daemon's, against
autograd's whole pass (the same losses; the same gradients within rounding), and which it runs."""

from __future__ import annotations

import pytest
import torch

from protocols.stepbook import MicrobatchKey
from swarmnode.model_config import ModelConfig
from swarmnode.node.split_backward import holds_whole
from swarmnode.node.worker import StageWorker
from swarmnode.optim import Schedule, StageOptimizer
from swarmnode.pieces import DataPiece, build_piece
from swarmnode.precision import Precision
from swarmnode.trainer_passes import SplitPasses, WholePasses, microbatch_passes

CONFIG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_hidden=64, max_seq_len=128)
BROAD = ModelConfig(vocab_size=64, dim=1024, n_layers=1, n_heads=8, ffn_hidden=1024, max_seq_len=512)


def _pieces() -> tuple[DataPiece, list[torch.nn.Module]]:
    data = build_piece(CONFIG, 0, 2, seed=3)
    assert isinstance(data, DataPiece)
    return data, [build_piece(CONFIG, k, 2, seed=3) for k in (1, 2)]


@pytest.mark.parametrize("seq", [8, 128])  # 16 and 256 tokens a microbatch
def test_split_passes_give_the_whole_passes_losses_and_gradients(seq: int) -> None:
    generator = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randint(0, 64, (2, seq), generator=generator),
            torch.randint(0, 64, (2, seq), generator=generator),
        )
        for _ in range(3)
    ]
    whole_data, whole_stages = _pieces()
    split_data, split_stages = _pieces()
    whole = WholePasses(whole_data, whole_stages, Precision())
    split = SplitPasses(split_data, split_stages)
    for index, (inputs, targets) in enumerate(batches):
        assert whole.microbatch(index, inputs, targets, 1 / 3) == split.microbatch(
            index, inputs, targets, 1 / 3
        )
    assert all(p.grad is None for stage in split_stages for p in stage.parameters())  # in the sums until load
    whole.load()
    split.load()
    for a, b in zip(whole_data.parameters(), split_data.parameters(), strict=True):
        assert a.grad is not None and torch.equal(a.grad, b.grad)  # the same passes, accumulated alike
    for whole_stage, split_stage in zip(whole_stages, split_stages, strict=True):
        for a, b in zip(whole_stage.parameters(), split_stage.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None
            assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7)


def test_small_float32_microbatches_split_and_large_or_mixed_precision_ones_do_not() -> None:
    data, stages = _pieces()
    assert isinstance(microbatch_passes(data, stages, Precision(), 16), SplitPasses)
    assert isinstance(microbatch_passes(data, stages, Precision(), 256), WholePasses)  # would compute apart
    bfloat16 = Precision(torch.device("cpu"), torch.bfloat16)
    assert isinstance(microbatch_passes(data, stages, bfloat16, 16), WholePasses)


@pytest.mark.parametrize(("config", "shape"), [(CONFIG, (2, 8)), (BROAD, (1, 512))])
def test_the_trainer_and_a_stage_daemon_update_a_stage_to_the_same_bits(
    config: ModelConfig, shape: tuple[int, int]
) -> None:
    """Weights' parts held whole and added into the sums by `addmm_` (16 tokens; and 512 tokens of a
    1024-wide stage, where `addmm_` rounds otherwise than a product written apart and added, here): the
    trainer's split passes and a `StageWorker` given the same inputs and head gradients, its weights' parts
    run out of order, take the same step."""
    generator = torch.Generator().manual_seed(1)
    batches = [
        (torch.randint(0, 64, shape, generator=generator), torch.randint(0, 64, shape, generator=generator))
        for _ in range(3)
    ]
    data = build_piece(config, 0, 1, seed=3)
    assert isinstance(data, DataPiece)
    trainer_stage, daemon_stage = build_piece(config, 1, 1, seed=3), build_piece(config, 1, 1, seed=3)
    assert holds_whole(trainer_stage, shape[0] * shape[1])
    passes = SplitPasses(data, [trainer_stage])
    for index, (inputs, targets) in enumerate(batches):
        passes.microbatch(index, inputs, targets, 1 / 3)
    passes.load()
    StageOptimizer(trainer_stage, Schedule(1e-2, 0, 100)).step(1.0, 0)

    worker = StageWorker(daemon_stage, StageOptimizer(daemon_stage, Schedule(1e-2, 0, 100)), split=True)
    keys = [MicrobatchKey("a", 0, index) for index in range(3)]
    for key, (inputs, targets) in zip(keys, batches, strict=True):
        with torch.no_grad():
            hidden = data.embed(inputs)
        top = worker.forward(key, hidden, 0.0).detach().requires_grad_(True)
        (data.loss(top, targets) * (1 / 3)).backward()
        assert top.grad is not None
        worker.backward(key, top.grad)
    for index in (2, 0, 1):
        worker.weights(keys[index])
    worker.step_group(("a", 0))
    for a, b in zip(trainer_stage.parameters(), daemon_stage.parameters(), strict=True):
        assert torch.equal(a, b)
