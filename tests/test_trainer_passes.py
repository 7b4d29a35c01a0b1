"""`trainer_passes`: the single process's float32 passes split and summed as a stage daemon's, against
autograd's whole pass (the same losses; the same gradients within rounding), and which it runs."""

from __future__ import annotations

import pytest
import torch

from swarmnode.model_config import ModelConfig
from swarmnode.pieces import DataPiece, build_piece
from swarmnode.precision import Precision
from swarmnode.trainer_passes import SplitPasses, WholePasses, microbatch_passes

CONFIG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_hidden=64, max_seq_len=128)


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
