"""The LLaMA-style transformer, cut into the pieces that swarm nodes serve.

The model is split as ``E, S1..Ss, E'`` (spec/checkfree.md):

- :class:`TokenEmbedding` (``E``): token ids -> hidden states.
- :class:`DecoderStage` (``S_k``): a run of consecutive decoder layers, hidden states -> hidden states.
- :class:`OutputHead` (``E'``): final RMSNorm, output projection and the loss.

Each piece is an ``nn.Module`` that is built alone (:func:`build_embedding`, :func:`build_stage`,
:func:`build_head`) from a :class:`ModelConfig` and a seed, so every node of a stage starts from identical
weights without talking. Every decoder layer is initialised from its *global* index, so the initial model
does not depend on how it is cut into stages. Parameter names mirror Hugging Face ``LlamaForCausalLM``
(``self_attn.q_proj``, ``mlp.gate_proj``, ``input_layernorm``, ...) and a stage numbers its layers locally
(``layers.0`` .. ``layers.{L-1}``), so stages of equal depth have identical state-dict keys: CheckFree
averages neighbouring stages key by key. :mod:`swarmnode.hf` maps the pieces to and from ``LlamaForCausalLM``.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from swarmnode.model_config import ModelConfig, stage_layers

INIT_STD = 0.02
"""Standard deviation of the normal init of linear and embedding weights (GPT-2, LLaMA)."""


# ------------------------------------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with a learned scale, computed in float32 (as Hugging Face does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rotary_cos_sin(config: ModelConfig, seq_len: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Rotary cos and sin of positions ``0..seq_len-1``, each ``(seq_len, head_dim)``, for ``rotate_half``."""
    exponents = (
        torch.arange(0, config.head_dim, 2, dtype=torch.int64, device=device).float() / config.head_dim
    )
    inv_freq = 1.0 / (config.rope_theta**exponents)
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: Tensor) -> Tensor:
    """``(x1, x2) -> (-x2, x1)`` on the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """Causal multi-head (or grouped-query) self-attention with rotary positions."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.kv_heads, config.head_dim
        self.q_proj = nn.Linear(config.dim, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        batch, seq_len, _ = x.shape
        q = self.q_proj(x).view(batch, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if self.n_kv_heads != self.n_heads:  # query heads h share key/value head h // group
            group = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq_len, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(config.ffn_hidden, config.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One pre-norm transformer block: attention and MLP, each around a residual connection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


# ----------------------------------------------------------------------------------------------------- pieces


class TokenEmbedding(nn.Module):
    """``E``: token ids ``(batch, seq)`` -> hidden states ``(batch, seq, dim)``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # `_weight` skips nn.Embedding's own init (``init_weights`` sets it): on the meta device its normal_
        # runs through torch's reference ops, which import torch._dynamo (a second of a daemon's start)
        weight = torch.empty(config.vocab_size, config.dim)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim, _weight=weight)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.embed_tokens(tokens)


class DecoderStage(nn.Module):
    """``S_k``: ``n_layers`` consecutive decoder layers, numbered locally, hidden states -> hidden states."""

    def __init__(self, config: ModelConfig, n_layers: int) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(n_layers))

    def forward(self, hidden: Tensor) -> Tensor:
        seq_len = hidden.shape[1]
        if seq_len > self.config.max_seq_len:
            raise ValueError(f"sequence of {seq_len} positions exceeds max_seq_len {self.config.max_seq_len}")
        cos, sin = (t.to(hidden.dtype) for t in rotary_cos_sin(self.config, seq_len, hidden.device))
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        return hidden


class OutputHead(nn.Module):
    """``E'``: final RMSNorm and output projection to logits, and the language-modelling loss."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.norm(hidden))

    def loss(self, hidden: Tensor, targets: Tensor) -> Tensor:
        """Mean cross-entropy of the logits at each position against ``targets`` (same shape as the tokens).

        ``targets[b, t]`` is the token that should follow position ``t`` (the caller shifts); positions whose
        target is -100 are ignored.
        """
        logits = self(hidden)
        return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=-100)


# --------------------------------------------------------------------------------------------- initialisation


def piece_seed(seed: int, piece: str) -> int:
    """The seed of one piece (``"embed_tokens"``, ``"layer.{i}"``, ``"head"``); the same in every process."""
    digest = hashlib.sha256(f"swarmnode/{seed}/{piece}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def init_weights(module: nn.Module, seed: int, n_layers: int) -> None:
    """Set every parameter of ``module`` from ``seed`` alone, with a local generator (never the global RNG).

    Linear and embedding weights are drawn from N(0, 0.02); the projections that write into the residual
    stream (``o_proj``, ``down_proj``) from N(0, 0.02 / sqrt(2 * n_layers)) as in GPT-2, with ``n_layers`` the
    depth of the whole model; RMSNorm scales are 1. The draws follow the module's registration order.
    """
    generator = torch.Generator().manual_seed(seed)
    residual_std = INIT_STD / math.sqrt(2 * n_layers)
    with torch.no_grad():
        for name, sub in module.named_modules():
            if isinstance(sub, RMSNorm):
                sub.weight.fill_(1.0)
            elif isinstance(sub, nn.Linear | nn.Embedding):
                std = residual_std if name.endswith(("o_proj", "down_proj")) else INIT_STD
                sub.weight.copy_(torch.empty(sub.weight.shape).normal_(0.0, std, generator=generator))
            elif any(True for _ in sub.parameters(recurse=False)):
                raise TypeError(f"init_weights does not know how to initialise {type(sub).__name__} {name!r}")


def on_cpu(module: nn.Module) -> None:
    """Give ``module``, built on the meta device, uninitialised CPU storage for ``init_weights`` to fill.

    ``Module.to_empty`` would do it through torch's reference ops, which import sympy on their first use
    (0.3-0.5 s of CPU in every daemon that builds a piece, a replacement node's rebuild included).
    """
    for sub in module.modules():
        if any(True for _ in sub.buffers(recurse=False)):
            raise TypeError(f"on_cpu does not materialise buffers ({type(sub).__name__})")
        for name, param in list(sub.named_parameters(recurse=False)):
            setattr(sub, name, nn.Parameter(torch.empty(param.shape, dtype=param.dtype), param.requires_grad))


def build_embedding(config: ModelConfig, seed: int = 0) -> TokenEmbedding:
    """``E``, initialised from ``seed``, on the CPU."""
    with torch.device("meta"):
        embedding = TokenEmbedding(config)
    on_cpu(embedding)
    init_weights(embedding, piece_seed(seed, "embed_tokens"), config.n_layers)
    return embedding


def build_stage(config: ModelConfig, stage_index: int, n_stages: int, seed: int = 0) -> DecoderStage:
    """Transformer stage ``stage_index`` (1..n_stages), each layer initialised from ``seed`` and its index."""
    layers = stage_layers(config, stage_index, n_stages)
    with torch.device("meta"):
        stage = DecoderStage(config, len(layers))
    on_cpu(stage)
    for layer, global_index in zip(stage.layers, layers, strict=True):
        init_weights(layer, piece_seed(seed, f"layer.{global_index}"), config.n_layers)
    return stage


def build_head(config: ModelConfig, seed: int = 0) -> OutputHead:
    """``E'``, initialised from ``seed``, on the CPU."""
    with torch.device("meta"):
        head = OutputHead(config)
    on_cpu(head)
    init_weights(head, piece_seed(seed, "head"), config.n_layers)
    return head


class Llama(nn.Module):
    """The whole model composed of its pieces, in one process: ``E``, ``n_stages`` stages, ``E'``.

    For a given seed the weights do not depend on ``n_stages``, so ``Llama(config, 1, seed)`` is the unsplit
    reference for ``Llama(config, s, seed)``.
    """

    def __init__(self, config: ModelConfig, n_stages: int = 1, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.embedding = build_embedding(config, seed)
        self.stages = nn.ModuleList(build_stage(config, k, n_stages, seed) for k in range(1, n_stages + 1))
        self.head = build_head(config, seed)

    def hidden(self, tokens: Tensor) -> Tensor:
        """Hidden states after the last stage, before ``E'``."""
        hidden = self.embedding(tokens)
        for stage in self.stages:
            hidden = stage(hidden)
        return hidden

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits ``(batch, seq, vocab_size)``."""
        return self.head(self.hidden(tokens))

    def loss(self, tokens: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy; see :meth:`OutputHead.loss`."""
        return self.head.loss(self.hidden(tokens), targets)
