"""What one node of a given stage holds: the model piece it trains.

Stage 0 (data nodes) trains `E` and `E'` together (`DataPiece`); stage k in 1..s trains its decoder layers
(`model.DecoderStage`). The single-process trainer and the daemon build pieces through `build_piece`, so
both run the same code on the same initial weights.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from protocols.checkfree import copy_source
from protocols.transfers import StatePart
from swarmnode.model import DecoderStage, OutputHead, TokenEmbedding, build_embedding, build_head, build_stage
from swarmnode.model_config import ModelConfig, stage_layers


class DataPiece(nn.Module):
    """Stage 0: the token embedding `E` and the output head `E'` (final norm, projection, loss)."""

    def __init__(self, embedding: TokenEmbedding, head: OutputHead) -> None:
        super().__init__()
        self.embedding = embedding
        self.head = head

    def embed(self, tokens: Tensor) -> Tensor:
        return self.embedding(tokens)

    def loss(self, hidden: Tensor, targets: Tensor) -> Tensor:
        return self.head.loss(hidden, targets)


def build_piece(config: ModelConfig, stage: int, n_stages: int, seed: int = 0) -> nn.Module:
    """The piece of stage `stage` (0 = data stage) of a model split into `n_stages` transformer stages."""
    if stage == 0:
        return DataPiece(build_embedding(config, seed), build_head(config, seed))
    return build_stage(config, stage, n_stages, seed)


def copy_layout(config: ModelConfig, part: StatePart, n_stages: int) -> dict[str, Tensor]:
    """What a CheckFree+ copy (`part`) of a model of `n_stages` transformer stages must hold: its names and
    shapes, as meta tensors (E's or E''s parameters, or the edge stage's)."""
    source = copy_source(part, n_stages)
    with torch.device("meta"):
        if part == StatePart.EMBEDDING_COPY:
            module: nn.Module = TokenEmbedding(config)
        elif part == StatePart.HEAD_COPY:
            module = OutputHead(config)
        else:
            module = DecoderStage(config, len(stage_layers(config, source, n_stages)))
    return {name: param for name, param in module.named_parameters()}
