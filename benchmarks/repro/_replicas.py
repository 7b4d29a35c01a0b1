"""Replicas of a pipeline-split model in one process, for the NoLoCo and SkipPipe reproductions.

Everything trains on the project's own pieces: `swarmnode.pieces.build_piece` (stage 0 = embedding and
head, stages 1..s = decoder layers), `swarmnode.optim.StageOptimizer` (per-stage Adam, clipping and the
warm-up/cosine schedule), the corpus and batches of `swarmnode.data`, and `swarmnode.trainer.evaluate`.
What the project lacks for these experiments, and is built here: many replicas of every stage in one
process, a microbatch routed through any chosen replica of each stage in any stage order, and the
weight average and spread across replicas.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from swarmnode.data import Corpus, batches, data_node_tokens, load_corpus, val_batches
from swarmnode.model_config import ModelConfig
from swarmnode.optim import Schedule, StageOptimizer
from swarmnode.pieces import DataPiece, build_piece
from swarmnode.presets import get_preset
from swarmnode.trainer import evaluate

VOCAB = 1024  # a quarter of the tiny preset's: the output layer would otherwise dominate the replicas' cost
Batch = tuple[Tensor, Tensor]
TensorMap = dict[str, Tensor]


@dataclass(frozen=True)
class Shape:
    """The benchmark model: the `tiny` preset narrowed so that many replicas train on two CPU cores."""

    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    ffn_hidden: int = 192
    seq_len: int = 64
    batch_size: int = 4

    def model(self, corpus: Corpus) -> ModelConfig:
        """The tiny preset's model with this width and depth and the corpus's vocabulary."""
        tiny = get_preset("tiny").model
        return replace(
            tiny,
            vocab_size=corpus.vocab_size,
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            ffn_hidden=self.ffn_hidden,
            max_seq_len=max(self.seq_len, tiny.max_seq_len),
        )


def corpus() -> Corpus:
    """The project's standard corpus with its byte-level BPE trained at `VOCAB` tokens (both cached after the
    first use)."""
    return load_corpus(None, None, VOCAB)


def stream(data: Corpus, shape: Shape, seed: int, shard: tuple[int, int] = (0, 1)) -> Iterator[Batch]:
    """The batches a data node with this shard of the training split reads in a run with `seed`."""
    tokens, order = data_node_tokens(data.train_tokens, shard, seed, "")
    return batches(tokens, shape.batch_size, shape.seq_len, seed=order)


def validation(data: Corpus, shape: Shape, n_batches: int) -> list[Batch]:
    """Fixed validation windows spread over the held-out split."""
    return val_batches(data.val_tokens, shape.batch_size, shape.seq_len, n_batches)


class Replicas:
    """`n` replicas of every stage (0 = data stage, 1..s transformer stages), all from one seed's weights,
    each with its own optimizer on a shared schedule."""

    def __init__(self, config: ModelConfig, n_stages: int, n: int, seed: int, schedule: Schedule) -> None:
        if n < 1 or n_stages < 1:
            raise ValueError(f"need at least one replica and one stage, got {n} and {n_stages}")
        self.n, self.n_stages = n, n_stages
        first = [build_piece(config, k, n_stages, seed) for k in range(n_stages + 1)]
        self.pieces: list[list[nn.Module]] = [
            [piece if r == 0 else _clone(piece) for r in range(n)] for piece in first
        ]  # pieces[stage][replica]
        self.optimizers = [[StageOptimizer(p, schedule) for p in stage] for stage in self.pieces]

    def data(self, replica: int) -> DataPiece:
        piece = self.pieces[0][replica]
        if not isinstance(piece, DataPiece):
            raise TypeError("stage 0 must hold data pieces")
        return piece

    def forward_backward(
        self, origin: int, hops: Sequence[tuple[int, int]], batch: Batch, scale: float
    ) -> float:
        """One microbatch from data replica `origin` through `hops` ((stage, replica) in visit order) and
        back: loss at the origin's head, gradients accumulated (weighted `scale`) in every piece visited."""
        inputs, targets = batch
        data = self.data(origin)
        hidden = data.embed(inputs)
        for stage, replica in hops:
            hidden = self.pieces[stage][replica](hidden)
        loss = data.loss(hidden, targets)
        (loss * scale).backward()
        value = float(loss.detach())
        if not math.isfinite(value):
            raise FloatingPointError(f"loss became {value}")
        return value

    def step(self) -> None:
        """One optimizer step of every replica of every stage (a piece with no gradient keeps its weights)."""
        for stage in self.optimizers:
            for optimizer in stage:
                optimizer.step()

    def params(self, stage: int, replica: int) -> TensorMap:
        """A detached copy of one piece's parameters."""
        return {name: p.detach().clone() for name, p in self.pieces[stage][replica].named_parameters()}

    def load(self, stage: int, replica: int, tensors: TensorMap) -> None:
        """Overwrite one piece's parameters (optimizer state untouched, as NoLoCo and DiLoCo require)."""
        with torch.no_grad():
            for name, p in self.pieces[stage][replica].named_parameters():
                p.copy_(tensors[name])

    def mean(self, stage: int) -> TensorMap:
        """The parameter-wise mean over the replicas of `stage`."""
        maps = [dict(self.pieces[stage][r].named_parameters()) for r in range(self.n)]
        return {name: torch.stack([m[name].detach() for m in maps]).mean(0) for name in maps[0]}

    def averaged(self) -> tuple[DataPiece, list[nn.Module]]:
        """A model whose every stage holds the mean weights of that stage's replicas."""
        pieces = []
        for stage in range(self.n_stages + 1):
            piece, mean = _clone(self.pieces[stage][0]), self.mean(stage)
            with torch.no_grad():
                for name, p in piece.named_parameters():
                    p.copy_(mean[name])
            pieces.append(piece)
        data = pieces[0]
        if not isinstance(data, DataPiece):
            raise TypeError("stage 0 must hold data pieces")
        return data, pieces[1:]

    def pipeline(self, replica: int) -> tuple[DataPiece, list[nn.Module]]:
        """Replica `replica` of every stage, in stage order."""
        return self.data(replica), [self.pieces[k][replica] for k in range(1, self.n_stages + 1)]

    def spread(self) -> float:
        """Relative weight spread: sqrt(mean over replicas of ||w_r - w_mean||^2) / ||w_mean||, every stage's
        parameters together (0 when all replicas agree)."""
        deviation = norm = 0.0
        for stage in range(self.n_stages + 1):
            maps = [dict(self.pieces[stage][r].named_parameters()) for r in range(self.n)]
            for name, centre in self.mean(stage).items():
                norm += float(centre.pow(2).sum())
                deviation += sum(float((m[name].detach() - centre).pow(2).sum()) for m in maps) / self.n
        return math.sqrt(deviation / norm)


def val_loss(model: tuple[DataPiece, Sequence[nn.Module]], fixed: list[Batch]) -> float:
    """`trainer.evaluate` over these stages, in this order."""
    data, stages = model
    return evaluate(data, list(stages), fixed)


def _clone(piece: nn.Module) -> nn.Module:
    return copy.deepcopy(piece)
