"""Devices and precision: `--device` / `--dtype` resolution, autocast with float32 master weights, float16
loss scaling, the wire dtypes, and the one-line errors of bad values."""

from __future__ import annotations

import math

import pytest
import torch
from click.testing import CliRunner

from protocols.stepbook import MicrobatchKey
from swarmnode.cli import main
from swarmnode.model import build_stage
from swarmnode.model_config import ModelConfig
from swarmnode.node.worker import DataWorker, StageWorker, Wire
from swarmnode.optim import Schedule, StageOptimizer
from swarmnode.pieces import build_piece
from swarmnode.precision import (
    LossScaler,
    Overflow,
    Precision,
    PrecisionError,
    all_finite,
    parse_dtype,
    resolve_device,
    wire_dtypes,
)
from swarmnode.runspec import RunSpec, RunSpecError
from swarmnode.trainer import TrainConfig, step_together, train

CONFIG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_hidden=64, max_seq_len=8)
CPU = torch.device("cpu")


def stage_worker(dtype: torch.dtype, wire: Wire | None = None) -> tuple[torch.nn.Module, StageWorker]:
    module = build_stage(CONFIG, 1, 1, seed=0)
    optimizer = StageOptimizer(module, Schedule(1e-2, 0, 100), 1.0)
    return module, StageWorker(module, optimizer, Precision(CPU, dtype), wire)


def test_devices_resolve_or_say_what_is_missing() -> None:
    assert resolve_device("cpu") == CPU
    assert resolve_device("auto") == (torch.device("cuda", 0) if torch.cuda.is_available() else CPU)
    for bad in ("gpu", "cuda:x", "CPU", "cuda:", ""):
        with pytest.raises(PrecisionError, match="unknown device"):
            resolve_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(PrecisionError, match="no CUDA device"):
            resolve_device("cuda:1")
    if not torch.backends.mps.is_available():
        with pytest.raises(PrecisionError, match="Metal"):
            resolve_device("mps")
    with pytest.raises(PrecisionError, match="float64"):
        parse_dtype("float64")


def test_run_dtype_is_checked_and_sets_the_wire() -> None:
    assert RunSpec().dtype == "float32"
    with pytest.raises(RunSpecError, match="dtype"):
        RunSpec(dtype="int8")
    assert wire_dtypes("float32") == (torch.float32, torch.float32)
    assert wire_dtypes("bfloat16") == (torch.bfloat16, torch.bfloat16)
    assert wire_dtypes("float16") == (torch.float16, torch.float32)  # gradients keep their range


def test_loss_scaler_backs_off_on_overflow_and_grows_after_clean_steps() -> None:
    scaler = LossScaler(dynamic=True, initial=1024.0, growth_interval=3)
    scaler.update(overflowed=True)
    assert scaler.scale == 512.0 and scaler.overflows == 1
    for _ in range(2):
        scaler.update(overflowed=False)
    assert scaler.scale == 512.0
    scaler.update(overflowed=False)
    assert scaler.scale == 1024.0
    constant = LossScaler(dynamic=False)
    constant.update(overflowed=True)
    assert constant.scale == 1.0
    with pytest.raises(PrecisionError):
        LossScaler(dynamic=True, initial=0.5, minimum=1.0)


def test_bfloat16_stage_keeps_float32_masters_and_follows_float32() -> None:
    """A bfloat16 stage computes under autocast: its weights stay float32, its outputs travel in the wire
    dtype, and one update lands close to the float32 stage's."""
    torch.manual_seed(1)
    hidden, grad = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
    key = MicrobatchKey("a", 0, 0)
    results = {}
    for dtype, wire in ((torch.float32, Wire()), (torch.bfloat16, Wire(torch.bfloat16, torch.bfloat16))):
        module, worker = stage_worker(dtype, wire)
        out = worker.forward(key, hidden, 0.0)
        assert out.dtype == wire.activations and out.device == CPU
        grad_in = worker.backward(key, grad)
        assert grad_in.dtype == wire.gradients
        assert math.isfinite(worker.step_group(key.group) or math.nan)
        assert all(p.dtype == torch.float32 for p in module.parameters())
        results[dtype] = (out.float(), grad_in.float(), [p.detach().clone() for p in module.parameters()])
    (out32, grad32, params32), (out16, grad16, params16) = results[torch.float32], results[torch.bfloat16]
    assert not torch.equal(out32, out16)  # it really computed in bfloat16
    assert torch.allclose(out32, out16, rtol=0.05, atol=0.05)
    assert torch.allclose(grad32, grad16, rtol=0.1, atol=0.05)
    for a, b in zip(params32, params16, strict=True):  # Adam's first step moves each weight by about lr
        assert float((a - b).abs().mean()) < 0.2 * 1e-2


def test_float16_overflow_loses_the_microbatch_skips_the_update_and_backs_off() -> None:
    module, worker = stage_worker(torch.float16)
    worker.scaler.scale = 2.0**24
    before = [p.detach().clone() for p in module.parameters()]
    key = MicrobatchKey("a", 0, 0)
    worker.forward(key, torch.randn(2, 8, 32), 0.0)
    with pytest.raises(Overflow, match="overflowed"):
        worker.backward(key, torch.full((2, 8, 32), 1e4))
    assert not math.isfinite(worker.step_group(key.group) or 0.0)
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
    assert worker.scaler.scale == 2.0**23 and worker.optimizer.updates == 0

    # at a sane scale the next group trains, and its update is unscaled (a true gradient norm)
    worker.scaler.scale = 2.0**8
    key = MicrobatchKey("a", 1, 0)
    worker.forward(key, torch.randn(2, 8, 32), 0.0)
    worker.backward(key, torch.randn(2, 8, 32) * 1e-3)
    norm = worker.step_group(key.group)
    assert norm is not None and 0 < norm < 10 and worker.optimizer.updates == 1


def test_activations_beyond_float16_stop_at_their_sender() -> None:
    """A float16 wire cannot carry an activation above 65504; the receiver would reject the infinity as
    hostile and ban the sender, so the sender raises Overflow (the stage aborts the microbatch) and keeps
    the microbatch held until that abort drops it. A float32 wire carries the same values."""
    _, worker = stage_worker(torch.float16, Wire(torch.float16, torch.float32))
    key = MicrobatchKey("a", 0, 0)
    with pytest.raises(Overflow, match="exceed float16's range"):
        worker.forward(key, torch.full((2, 8, 32), 1e6), 0.0)
    assert worker.in_flight == 1 and worker.drop(key)
    with pytest.raises(Overflow, match="a validation microbatch"):
        worker.evaluate(torch.full((2, 8, 32), 1e6))
    assert torch.isfinite(worker.forward(key, torch.randn(2, 8, 32), 0.0)).all()
    _, wide = stage_worker(torch.float16, Wire(torch.float32, torch.float32))
    assert torch.isfinite(wide.forward(key, torch.full((2, 8, 32), 1e6), 0.0)).all()


def test_the_trainer_steps_every_stage_or_none_after_a_float16_overflow() -> None:
    """An overflow in one stage leaves the stages before it non-finite; those after it must not step alone."""
    pieces = [build_stage(CONFIG, k, 2, seed=0) for k in (1, 2)]
    optimizers = [StageOptimizer(piece, Schedule(1e-2, 0, 100)) for piece in pieces]
    scaler = LossScaler(dynamic=True, initial=2.0**10)
    before = [[p.detach().clone() for p in piece.parameters()] for piece in pieces]
    for piece, value in zip(pieces, (math.inf, 1e-3), strict=True):
        for p in piece.parameters():
            p.grad = torch.full_like(p, value)
    norms = step_together(optimizers, scaler)
    assert not any(math.isfinite(n) for n in norms) and scaler.scale == 2.0**9
    for piece, old in zip(pieces, before, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(old, piece.parameters(), strict=True))
        assert all(p.grad is None for p in piece.parameters())
    assert [o.updates for o in optimizers] == [0, 0]
    for piece in pieces:
        for p in piece.parameters():
            p.grad = torch.full_like(p, 1e-3 * scaler.scale)
    norms = step_together(optimizers, scaler)
    assert all(0 < n < 1 for n in norms) and [o.updates for o in optimizers] == [1, 1]


def test_float16_data_node_scales_its_loss_and_unscales_its_step() -> None:
    """The head's gradient leaves at its true scale whatever the loss scale; the step divides it out."""
    piece = build_piece(CONFIG, 0, 1, seed=0)
    tokens = torch.randint(0, 64, (2, 8))
    grads = {}
    for scale in (1.0, 2.0**10):
        worker = DataWorker(
            piece, StageOptimizer(piece, Schedule(1e-2, 0, 100)), Precision(CPU, torch.float16)
        )
        worker.scaler.scale = scale
        key = MicrobatchKey("d", 0, 0)
        hidden = worker.embed(key, tokens, 0.0)
        _, grad = worker.loss_and_grad(hidden + 0.1, tokens, 1.0)
        grads[scale] = grad
        worker.finish(key, grad)
        worker.discard_gradients()
    assert torch.allclose(grads[1.0], grads[2.0**10], rtol=1e-2, atol=1e-6)


def test_validation_embedding_travels_like_training_ones_and_holds_nothing() -> None:
    """A validation microbatch's embedding leaves in the wire's dtype on the host, as a training one does
    (on a GPU the token ids go to the device first), with no gradient and nothing held for a backward."""
    piece = build_piece(CONFIG, 0, 1, seed=0)
    worker = DataWorker(
        piece, StageOptimizer(piece, Schedule(1e-2, 0, 100)), wire=Wire(torch.bfloat16, torch.bfloat16)
    )
    tokens = torch.randint(0, 64, (2, 8))
    hidden = worker.embed_eval(tokens)
    assert hidden.dtype == torch.bfloat16 and hidden.device.type == "cpu" and not hidden.requires_grad
    assert worker.in_flight == 0
    assert torch.equal(hidden, worker.embed(MicrobatchKey("d", 0, 0), tokens, 0.0))


def test_bfloat16_training_on_cpu_lowers_the_loss_like_float32() -> None:
    figures = {
        dtype: train(TrainConfig(steps=12, eval_every=12, eval_batches=2, dtype=dtype, device="cpu"))
        for dtype in ("float32", "bfloat16")
    }
    for result in figures.values():
        assert result.val_loss < result.initial_val_loss - 0.5
    assert (
        abs(figures["bfloat16"].val_loss - figures["float32"].val_loss) < 0.05 * figures["float32"].val_loss
    )


@pytest.mark.parametrize(
    ("command", "args", "words"),
    [
        ("train", ["--device", "gpu"], "unknown device 'gpu'"),
        ("train", ["--dtype", "float64"], "'float64' is not one of"),
        ("join", ["--stage", "1", "--device", "tpu"], "unknown device 'tpu'"),
        ("join", ["--stage", "1", "--dtype", "int8"], "'int8' is not one of"),
        ("up", ["--device", "cuda:x"], "unknown device 'cuda:x'"),
        ("up", ["--dtype", "half"], "'half' is not one of"),
        ("bootstrap", ["--dtype", "fp8"], "'fp8' is not one of"),
    ]
    + (
        []
        if torch.cuda.is_available()
        else [
            ("train", ["--device", "cuda"], "no CUDA device"),
            ("join", ["--stage", "1", "--device", "cuda:0"], "no CUDA device"),
        ]
    ),
)
def test_bad_device_or_dtype_is_a_one_line_usage_error(command: str, args: list[str], words: str) -> None:
    result = CliRunner().invoke(main, [command, *args])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and words in errors[0], result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_all_finite_finds_any_nan_or_infinity_anywhere(dtype: torch.dtype) -> None:
    for size in (1, 7, 16, 33, 1000, 65_537):
        clean = torch.randn(size).to(dtype)
        assert all_finite(clean) and all_finite(clean.view(1, -1)[:, ::2])
        for where in {0, size // 2, size - 1}:
            for bad in (math.nan, math.inf, -math.inf):
                poisoned = clean.clone()
                poisoned[where] = bad
                assert not all_finite(poisoned), (size, where, bad)
    assert all_finite(torch.empty(0, dtype=dtype))
    assert all_finite(torch.tensor([3, -1])) and all_finite(torch.tensor([True]))  # integers are finite
