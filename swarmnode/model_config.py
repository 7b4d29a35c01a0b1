"""The model's shape (`ModelConfig`) and how its layers split into stages: torch-free, so that presets, run
definitions and the CLI can be read without importing torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the transformer. Invalid combinations raise ``ValueError``.

    ``n_kv_heads`` < ``n_heads`` gives grouped-query attention; ``None`` means one key/value head per query
    head. ``ffn_hidden`` is the SwiGLU hidden width. Change a field with ``dataclasses.replace``, which
    validates again (for example to set ``vocab_size`` to the size of the tokenizer actually trained).
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    ffn_hidden: int
    max_seq_len: int = 2048
    n_kv_heads: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        sizes = ["vocab_size", "dim", "n_layers", "n_heads", "ffn_hidden", "max_seq_len"]
        for name in sizes if self.n_kv_heads is None else [*sizes, "n_kv_heads"]:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.head_dim % 2:
            raise ValueError(
                f"head dimension dim / n_heads = {self.head_dim} must be even for rotary positions"
            )
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.kv_heads})")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta!r}")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be positive, got {self.norm_eps!r}")

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads (``n_kv_heads``, or ``n_heads`` when that is ``None``)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads


def param_count(config: ModelConfig) -> int:
    """Number of parameters of ``E``, every layer and ``E'`` (embeddings untied), computed analytically."""
    d, hd = config.dim, config.head_dim
    attention = 2 * d * config.n_heads * hd + 2 * d * config.kv_heads * hd
    layer = attention + 3 * d * config.ffn_hidden + 2 * d
    return config.vocab_size * d + config.n_layers * layer + d + d * config.vocab_size


def stage_layers(config: ModelConfig, stage_index: int, n_stages: int) -> range:
    """Global indices of the decoder layers of transformer stage ``stage_index`` (1-based) of ``n_stages``."""
    if not 1 <= n_stages <= config.n_layers:
        raise ValueError(f"n_stages must be between 1 and n_layers ({config.n_layers}), got {n_stages}")
    if config.n_layers % n_stages:
        raise ValueError(
            f"cannot split {config.n_layers} layers evenly into {n_stages} stages: "
            f"n_layers must be divisible by the number of stages"
        )
    if not 1 <= stage_index <= n_stages:
        raise ValueError(f"stage_index must be between 1 and {n_stages}, got {stage_index}")
    depth = config.n_layers // n_stages
    return range((stage_index - 1) * depth, stage_index * depth)
