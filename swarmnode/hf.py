"""Hugging Face interchange: the pieces' state dicts to and from a ``LlamaForCausalLM`` state dict.

Nothing here imports ``transformers``. To export::

    from transformers import LlamaConfig, LlamaForCausalLM
    hf = LlamaForCausalLM(LlamaConfig(**hf_config_kwargs(config)))
    hf.load_state_dict(to_hf_state_dict(config, embedding.state_dict(), [s.state_dict() for s in stages],
                                        head.state_dict()))
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from torch import Tensor

from swarmnode.model_config import ModelConfig, stage_layers

_STAGE_KEY = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HEAD_TO_HF = {"norm.weight": "model.norm.weight", "lm_head.weight": "lm_head.weight"}
_HF_TO_HEAD = {hf: ours for ours, hf in _HEAD_TO_HF.items()}


class SplitStateDicts(NamedTuple):
    """State dicts of ``E``, of the transformer stages in order, and of ``E'``."""

    embedding: dict[str, Tensor]
    stages: list[dict[str, Tensor]]
    head: dict[str, Tensor]


def hf_config_kwargs(config: ModelConfig) -> dict[str, Any]:
    """Keyword arguments for ``transformers.LlamaConfig`` describing the same model."""
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.ffn_hidden,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads,
        "max_position_embeddings": config.max_seq_len,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    }


def to_hf_state_dict(
    config: ModelConfig,
    embedding: Mapping[str, Tensor],
    stages: Sequence[Mapping[str, Tensor]],
    head: Mapping[str, Tensor],
) -> dict[str, Tensor]:
    """One ``LlamaForCausalLM`` state dict from the pieces' state dicts (stages in order ``S1..Ss``).

    A stage's local layer ``j`` becomes global layer ``offset + j``, where ``offset`` counts the layers of the
    stages before it. Raises ``ValueError`` on a key no piece has or if the stages do not add up to
    ``config.n_layers`` layers.
    """
    out = {
        f"model.{key}": value for key, value in _expect_keys(embedding, {"embed_tokens.weight"}, "E").items()
    }
    offset = 0
    for k, stage in enumerate(stages, start=1):
        depth = 0
        for key, value in stage.items():
            match = _STAGE_KEY.fullmatch(key)
            if match is None:
                raise ValueError(f"unexpected key {key!r} in the state dict of stage {k}")
            local = int(match[1])
            out[f"model.layers.{offset + local}.{match[2]}"] = value
            depth = max(depth, local + 1)
        offset += depth
    if offset != config.n_layers:
        raise ValueError(f"the {len(stages)} stages hold {offset} layers, the model has {config.n_layers}")
    for key, value in _expect_keys(head, set(_HEAD_TO_HF), "E'").items():
        out[_HEAD_TO_HF[key]] = value
    return out


def from_hf_state_dict(config: ModelConfig, state: Mapping[str, Tensor], n_stages: int) -> SplitStateDicts:
    """Split a ``LlamaForCausalLM`` state dict into the state dicts of ``E``, ``n_stages`` stages and ``E'``.

    Rotary ``inv_freq`` buffers are skipped; a checkpoint with tied embeddings and no ``lm_head.weight`` gets
    ``E'``'s projection from the embedding. Raises ``ValueError`` on an unknown key or a layer out of range.
    """
    depth = len(stage_layers(config, 1, n_stages))
    split = SplitStateDicts({}, [{} for _ in range(n_stages)], {})
    for key, value in state.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue
        match = _HF_LAYER_KEY.fullmatch(key)
        if key == "model.embed_tokens.weight":
            split.embedding["embed_tokens.weight"] = value
        elif key in _HF_TO_HEAD:
            split.head[_HF_TO_HEAD[key]] = value
        elif match is not None and int(match[1]) < config.n_layers:
            stage, local = divmod(int(match[1]), depth)
            split.stages[stage][f"layers.{local}.{match[2]}"] = value
        else:
            raise ValueError(f"unexpected key {key!r} for a {config.n_layers}-layer LlamaForCausalLM")
    if "lm_head.weight" not in split.head and "embed_tokens.weight" in split.embedding:
        split.head["lm_head.weight"] = split.embedding["embed_tokens.weight"]
    return split


def _expect_keys(state: Mapping[str, Tensor], expected: set[str], piece: str) -> Mapping[str, Tensor]:
    if set(state) != expected:
        raise ValueError(f"state dict of {piece} has keys {sorted(state)}, expected {sorted(expected)}")
    return state
