"""The single-process reference trainer: the baseline every swarm figure is measured against.

It runs each microbatch through the same stage pieces, in stage order, that the daemons run in separate
processes (`swarmnode.pieces`), with the same per-stage optimizer (`swarmnode.optim`) and, at a small
microbatch in float32, a stage's backward pass split and summed as a stage daemon's (`trainer_passes`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

import torch

from swarmnode.data import Corpus, batches, data_node_tokens, load_corpus, val_batches, validation_set
from swarmnode.hf import SplitStateDicts
from swarmnode.modeldir import check_shape, load_pieces, read_model_folder, write_model_folder
from swarmnode.optim import Schedule, StageOptimizer
from swarmnode.pieces import DataPiece, build_piece
from swarmnode.precision import LossScaler, Precision
from swarmnode.presets import Preset, get_preset
from swarmnode.trainer_passes import microbatch_passes


@dataclass(frozen=True)
class TrainConfig:
    """What `swarmnode train` runs. `stages` counts transformer stages (the data stage always exists)."""

    preset: str = "tiny"
    stages: int | None = None
    steps: int = 200
    data: Path | None = None
    tokenizer: Path | None = None
    seed: int = 0
    eval_every: int = 20
    eval_batches: int | None = None  # None: the standard validation set (`data.validation_set`)
    init_from: Path | None = None  # a Hugging Face Llama folder to start from (`modeldir`), not the seed
    out: Path | None = None  # where to write the trained model as a Hugging Face folder
    device: str = "cpu"  # `precision.resolve_device`: auto, cpu, cuda, cuda:N, mps
    dtype: str = "float32"  # compute dtype under autocast; weights and optimizer state stay float32


@dataclass(frozen=True)
class Progress:
    step: int
    loss: float
    val_loss: float | None
    tokens_per_second: float


@dataclass(frozen=True)
class TrainResult:
    steps: int
    initial_loss: float
    final_loss: float
    initial_val_loss: float
    val_loss: float
    tokens_per_second: float
    seconds: float
    parameters: int

    def as_dict(self) -> dict[str, float | int]:
        return dict(self.__dict__)


def evaluate(
    data: DataPiece,
    stages: list[torch.nn.Module],
    fixed: list[tuple[torch.Tensor, torch.Tensor]],
    precision: Precision | None = None,
) -> float:
    """Mean loss over fixed validation batches, without gradients."""
    precision = precision or Precision()
    with torch.no_grad(), precision.autocast():
        losses = []
        for inputs, targets in fixed:
            hidden = data.embed(inputs.to(precision.device))
            for stage in stages:
                hidden = stage(hidden)
            losses.append(float(data.loss(hidden, targets.to(precision.device))))
    return sum(losses) / len(losses)


def step_together(optimizers: list[StageOptimizer], scaler: LossScaler) -> list[float]:
    """One update of every stage, or of none: a float16 overflow in stage k leaves the gradients of the
    stages before it non-finite, and the stages after it must not step alone (a single process's loss scaler
    skips the whole step). The gradient norms; the scale backs off after an overflow."""
    if scaler.dynamic and not all(optimizer.gradients_finite() for optimizer in optimizers):
        for optimizer in optimizers:
            optimizer.discard()
        scaler.update(overflowed=True)
        return [math.inf] * len(optimizers)
    norms = [optimizer.step(1.0 / scaler.scale) for optimizer in optimizers]
    scaler.update(overflowed=not all(math.isfinite(norm) for norm in norms))
    return norms


def train(
    config: TrainConfig,
    on_progress: Callable[[Progress], None] | None = None,
    corpus: Corpus | None = None,
) -> TrainResult:
    """Train `config.preset` for `config.steps` steps in this process and return the figures.

    One step is one pipeline's batch of a swarm iteration: `preset.microbatches` microbatches whose gradients
    accumulate (each weighted 1 / microbatches), then one optimizer step per stage. A swarm step trains on a
    batch per data node and pipeline (`planning.pipeline_width`).
    """
    preset: Preset = get_preset(config.preset)
    n_stages = config.stages if config.stages is not None else preset.n_stages
    corpus = corpus or load_corpus(config.data, config.tokenizer, preset.vocab_size)
    model_config = replace(preset.model, vocab_size=corpus.vocab_size)
    precision = Precision.parse(config.device, config.dtype)
    torch.manual_seed(config.seed)

    pieces = [build_piece(model_config, k, n_stages, seed=config.seed) for k in range(n_stages + 1)]
    if config.init_from is not None:
        found, split = read_model_folder(config.init_from, n_stages)
        check_shape(found, model_config, f"preset {config.preset!r} with this tokenizer")
        load_pieces(pieces, split)
    pieces = [piece.to(precision.device) for piece in pieces]
    data_piece = cast(DataPiece, pieces[0])
    stages = pieces[1:]
    schedule = Schedule(preset.lr, preset.warmup_steps, config.steps)
    optimizers = [StageOptimizer(piece, schedule) for piece in pieces]
    scaler = precision.scaler()  # float16: one loss scale for the whole model, as in a single process
    passes = microbatch_passes(data_piece, stages, precision, preset.batch_size * preset.seq_len)

    fixed_val = (
        validation_set(corpus.val_tokens, preset.batch_size, preset.seq_len)
        if config.eval_batches is None
        else val_batches(corpus.val_tokens, preset.batch_size, preset.seq_len, config.eval_batches)
    )
    initial_val = evaluate(data_piece, stages, fixed_val, precision)
    val_loss = initial_val
    # what the data node of a swarm with one data node reads, in the same order, so that a swarm and this
    # trainer with the same seed see the same batches (compared pairwise: a 1xR swarm's step N with this
    # trainer's step R x N)
    tokens, order = data_node_tokens(corpus.train_tokens, (0, 1), config.seed, "")
    stream = batches(tokens, preset.batch_size, preset.seq_len, seed=order)
    tokens_per_step = preset.microbatches * preset.batch_size * preset.seq_len

    losses: list[float] = []
    compute_seconds = 0.0
    started = time.perf_counter()
    for step in range(config.steps):
        tick = time.perf_counter()
        step_loss = 0.0
        for index in range(preset.microbatches):
            inputs, targets = (t.to(precision.device) for t in next(stream))
            loss = passes.microbatch(index, inputs, targets, scaler.scale / preset.microbatches)
            step_loss += loss / preset.microbatches
        passes.load()
        step_together(optimizers, scaler)
        compute_seconds += time.perf_counter() - tick
        losses.append(step_loss)
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"loss became {losses[-1]} at step {step}")

        last = step == config.steps - 1
        evaluated = (step + 1) % config.eval_every == 0 or last
        if evaluated:
            val_loss = evaluate(data_piece, stages, fixed_val, precision)
        if on_progress is not None:
            on_progress(
                Progress(
                    step + 1,
                    losses[-1],
                    val_loss if evaluated else None,
                    (step + 1) * tokens_per_step / compute_seconds,
                )
            )

    if config.out is not None:
        for piece in pieces:
            piece.to("cpu")
        split = SplitStateDicts(
            data_piece.embedding.state_dict(), [s.state_dict() for s in stages], data_piece.head.state_dict()
        )
        metadata = {
            "trainer": "swarmnode train",
            "preset": config.preset,
            "stages": n_stages,
            "step": config.steps,
        }
        write_model_folder(config.out, model_config, split, corpus.tokenizer_path, metadata)
    tail = losses[-min(10, len(losses)) :]
    return TrainResult(
        steps=config.steps,
        initial_loss=losses[0],
        final_loss=sum(tail) / len(tail),
        initial_val_loss=initial_val,
        val_loss=val_loss,
        tokens_per_second=config.steps * tokens_per_step / compute_seconds,
        seconds=time.perf_counter() - started,
        parameters=sum(p.numel() for piece in pieces for p in piece.parameters()),
    )
