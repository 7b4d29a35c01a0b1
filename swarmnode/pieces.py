"""What one node of a given stage holds: the model piece it trains.

Stage 0 (data nodes) trains `E` and `E'` together (`DataPiece`); stage k in 1..s trains its decoder layers
(`model.DecoderStage`). The single-process trainer and the daemon build pieces through `build_piece`, so
both run the same code on the same initial weights.
"""

from __future__ import annotations

from torch import Tensor, nn

from swarmnode.model import OutputHead, TokenEmbedding, build_embedding, build_head, build_stage
from swarmnode.model_config import ModelConfig


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
