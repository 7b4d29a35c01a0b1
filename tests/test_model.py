"""The model, its split into E, S1..Ss, E', its Hugging Face mapping, and the presets."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from swarmnode.hf import from_hf_state_dict, hf_config_kwargs, to_hf_state_dict
from swarmnode.model import Llama, build_embedding, build_head, build_stage
from swarmnode.model_config import ModelConfig, param_count, stage_layers
from swarmnode.presets import PRESETS, get_preset

# Small, and not default in any knob the HF mapping has to carry: grouped KV heads, rope theta, norm eps.
CONFIG = ModelConfig(
    vocab_size=97, dim=48, n_layers=6, n_heads=6, n_kv_heads=2, ffn_hidden=80, max_seq_len=32,
    rope_theta=500.0, norm_eps=1e-5,
)  # fmt: skip
MHA_CONFIG = dataclasses.replace(CONFIG, n_kv_heads=None)


def tokens(config: ModelConfig = CONFIG, batch: int = 3, seq_len: int = 17, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed)
    )


def hf_state(model: Llama) -> dict[str, torch.Tensor]:
    return to_hf_state_dict(
        model.config,
        model.embedding.state_dict(),
        [stage.state_dict() for stage in model.stages],
        model.head.state_dict(),
    )


def reference_logits(config: ModelConfig, w: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """Unsplit LLaMA written out independently, in float64, from a LlamaForCausalLM state dict: explicit
    causal mask and softmax, one head at a time, rotary positions as rotations of pairs (i, i + hd / 2)."""
    w = {key: value.double() for key, value in w.items()}
    heads, kv_heads, hd = config.n_heads, config.kv_heads, config.head_dim
    batch, seq_len = ids.shape
    angle = torch.outer(
        torch.arange(seq_len, dtype=torch.float64),
        config.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd),
    )
    mask = torch.full((seq_len, seq_len), -math.inf, dtype=torch.float64).triu(1)

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + config.norm_eps)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        a, b = x[..., : hd // 2], x[..., hd // 2 :]
        return torch.cat((a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()), dim=-1)

    x = w["model.embed_tokens.weight"][ids]
    for i in range(config.n_layers):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(batch, seq_len, heads, hd)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(batch, seq_len, kv_heads, hd)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(batch, seq_len, kv_heads, hd)
        outputs = []
        for head in range(heads):
            kv = head // (heads // kv_heads)
            scores = rotate(q[:, :, head]) @ rotate(k[:, :, kv]).transpose(1, 2) / math.sqrt(hd) + mask
            outputs.append(torch.softmax(scores, dim=-1) @ v[:, :, kv])
        x = x + torch.cat(outputs, dim=-1) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


# ------------------------------------------------------------------------------------------------ the split


@pytest.mark.parametrize("n_stages", [2, 3, 6])
def test_split_model_equals_unsplit_model(n_stages: int) -> None:
    ids = tokens()
    unsplit, split = Llama(CONFIG, n_stages=1, seed=3), Llama(CONFIG, n_stages=n_stages, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(split(ids), unsplit(ids), atol=1e-5, rtol=0)
        hidden = split.embedding(ids)  # the pieces one after another, as separate nodes would run them
        for stage in split.stages:
            hidden = stage(hidden)
        torch.testing.assert_close(split.head(hidden), unsplit(ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("config", [CONFIG, MHA_CONFIG], ids=["grouped-kv", "multi-head"])
def test_model_matches_independent_reference(config: ModelConfig) -> None:
    model, ids = Llama(config, n_stages=3, seed=1), tokens(config)
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids).double(), reference_logits(config, hf_state(model), ids), atol=1e-5, rtol=0
        )


def test_grouped_kv_heads_have_fewer_key_value_weights() -> None:
    attention = build_stage(CONFIG, 1, 3).layers[0].self_attn
    assert attention.q_proj.weight.shape == (CONFIG.dim, CONFIG.dim)
    assert attention.k_proj.weight.shape == attention.v_proj.weight.shape == (2 * CONFIG.head_dim, CONFIG.dim)


def test_causal_positions_do_not_see_the_future() -> None:
    model, ids = Llama(CONFIG, n_stages=2), tokens()
    changed = ids.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % CONFIG.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(model(changed)[:, :10], model(ids)[:, :10])


def test_loss_is_cross_entropy_of_logits_against_targets() -> None:
    model, ids = Llama(CONFIG), tokens()
    targets = torch.roll(ids, -1, dims=1)
    targets[:, -1] = -100
    with torch.no_grad():
        expected = F.cross_entropy(model(ids)[:, :-1].reshape(-1, CONFIG.vocab_size), ids[:, 1:].reshape(-1))
        torch.testing.assert_close(model.loss(ids, targets), expected)
    fresh = Llama(dataclasses.replace(CONFIG, vocab_size=4096))
    with torch.no_grad():
        assert fresh.loss(ids, targets).item() == pytest.approx(math.log(4096), abs=0.05)


def test_stage_rejects_sequences_longer_than_max_seq_len() -> None:
    stage = build_stage(CONFIG, 1, 3)
    with pytest.raises(ValueError, match="max_seq_len 32"):
        stage(torch.zeros(1, 33, CONFIG.dim))


# ------------------------------------------------------------------------------------ building and init


def test_pieces_built_separately_with_the_same_seed_are_identical() -> None:
    rng_before = torch.get_rng_state()
    for build in (
        lambda seed: build_embedding(CONFIG, seed),
        lambda seed: build_stage(CONFIG, 2, 3, seed),
        lambda seed: build_head(CONFIG, seed),
    ):
        a, b, other = build(11).state_dict(), build(11).state_dict(), build(12).state_dict()
        assert a.keys() == b.keys() == other.keys()
        assert all(torch.equal(a[key], b[key]) for key in a)
        assert not all(torch.equal(a[key], other[key]) for key in a if not key.endswith("norm.weight"))
    assert torch.equal(torch.get_rng_state(), rng_before), "building must not touch the global RNG"


def test_stages_of_equal_depth_have_identical_keys_and_different_weights() -> None:
    first, last = build_stage(CONFIG, 1, 3).state_dict(), build_stage(CONFIG, 3, 3).state_dict()
    assert list(first) == list(last)
    assert "layers.0.self_attn.q_proj.weight" in first and "layers.1.mlp.down_proj.weight" in first
    assert not torch.equal(first["layers.0.mlp.up_proj.weight"], last["layers.0.mlp.up_proj.weight"])


def test_init_is_normal_with_scaled_residual_projections() -> None:
    config = ModelConfig(vocab_size=64, dim=256, n_layers=8, n_heads=4, ffn_hidden=512)
    layer = build_stage(config, 1, 1).layers[0]
    assert layer.self_attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    residual_std = 0.02 / math.sqrt(2 * config.n_layers)
    assert layer.self_attn.o_proj.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert layer.mlp.down_proj.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert torch.equal(layer.input_layernorm.weight, torch.ones(config.dim))


def test_indivisible_layers_raise_a_clear_error() -> None:
    with pytest.raises(ValueError, match="cannot split 6 layers evenly into 4 stages"):
        build_stage(CONFIG, 1, 4)
    with pytest.raises(ValueError, match="stage_index must be between 1 and 3"):
        build_stage(CONFIG, 0, 3)
    assert stage_layers(CONFIG, 3, 3) == range(4, 6)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dim": 50}, "divisible by n_heads"),
        ({"n_kv_heads": 4}, "divisible by n_kv_heads"),
        ({"dim": 42, "n_heads": 6}, "must be even"),
        ({"n_layers": 0}, "n_layers must be a positive integer"),
        ({"ffn_hidden": 8.0}, "ffn_hidden must be a positive integer"),
        ({"norm_eps": 0.0}, "norm_eps must be positive"),
    ],
)
def test_config_validation(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(CONFIG, **changes)


@pytest.mark.parametrize("config", [CONFIG, MHA_CONFIG, get_preset("tiny").model], ids=["gqa", "mha", "tiny"])
def test_param_count_matches_the_modules(config: ModelConfig) -> None:
    model = Llama(config, n_stages=2)
    assert param_count(config) == sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------------- Hugging Face

HF_NAMES = [f"self_attn.{p}_proj.weight" for p in "qkvo"] + [
    f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")
]
HF_NAMES += ["input_layernorm.weight", "post_attention_layernorm.weight"]


def test_hf_state_dict_names_and_round_trip() -> None:
    model = Llama(CONFIG, n_stages=3, seed=5)
    state = hf_state(model)
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    expected |= {f"model.layers.{i}.{name}" for i in range(CONFIG.n_layers) for name in HF_NAMES}
    assert set(state) == expected
    assert torch.equal(
        state["model.layers.2.mlp.up_proj.weight"], model.stages[1].layers[0].mlp.up_proj.weight
    )

    split = from_hf_state_dict(CONFIG, state, n_stages=3)
    pieces = [model.embedding, *model.stages, model.head]
    for piece, loaded in zip(pieces, [split.embedding, *split.stages, split.head], strict=True):
        assert piece.state_dict().keys() == loaded.keys()
        assert all(torch.equal(value, loaded[key]) for key, value in piece.state_dict().items())


def test_hf_state_dict_resplits_into_another_number_of_stages() -> None:
    source, target, ids = Llama(CONFIG, n_stages=3, seed=5), Llama(CONFIG, n_stages=2, seed=6), tokens()
    split = from_hf_state_dict(CONFIG, hf_state(source), n_stages=2)
    target.embedding.load_state_dict(split.embedding)
    for stage, state in zip(target.stages, split.stages, strict=True):
        stage.load_state_dict(state)
    target.head.load_state_dict(split.head)
    with torch.no_grad():
        torch.testing.assert_close(target(ids), source(ids), atol=1e-5, rtol=0)


def test_hf_mapping_rejects_what_it_does_not_know() -> None:
    state = hf_state(Llama(CONFIG, n_stages=3))
    with pytest.raises(ValueError, match=r"unexpected key 'model\.layers\.6\."):
        from_hf_state_dict(CONFIG, {**state, "model.layers.6.mlp.up_proj.weight": torch.zeros(1)}, 3)
    model = Llama(CONFIG, n_stages=3)
    with pytest.raises(ValueError, match="the 2 stages hold 4 layers, the model has 6"):
        to_hf_state_dict(CONFIG, model.embedding.state_dict(), [s.state_dict() for s in model.stages[:2]],
                         model.head.state_dict())  # fmt: skip


def test_hf_config_kwargs() -> None:
    kwargs = hf_config_kwargs(CONFIG)
    assert kwargs["num_key_value_heads"] == 2 and kwargs["intermediate_size"] == 80
    assert kwargs["rope_theta"] == 500.0 and kwargs["tie_word_embeddings"] is False


@pytest.mark.parametrize("config", [CONFIG, MHA_CONFIG], ids=["grouped-kv", "multi-head"])
def test_logits_equal_transformers_llama(config: ModelConfig) -> None:
    transformers = pytest.importorskip("transformers")
    model, ids = Llama(config, n_stages=3, seed=2), tokens(config)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config_kwargs(config)))
    hf.load_state_dict(hf_state(model), strict=True)
    hf.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(input_ids=ids).logits, atol=1e-5, rtol=0)
    split = from_hf_state_dict(config, hf.state_dict(), n_stages=3)
    assert all(torch.equal(value, split.head[key]) for key, value in model.head.state_dict().items())


# ------------------------------------------------------------------------------------------------- presets


@pytest.mark.parametrize("name", [name for name, preset in PRESETS.items() if preset.published_params])
def test_paper_presets_are_within_5_percent_of_their_published_size(name: str) -> None:
    preset = get_preset(name)
    assert preset.published_params is not None
    assert param_count(preset.model) == pytest.approx(preset.published_params, rel=0.05)


def test_presets_are_consistent() -> None:
    assert {"tiny", "llama-124m", "llama-500m", "llama-1.5b", "noloco-125m"} <= set(PRESETS)
    for preset in PRESETS.values():
        assert len(stage_layers(preset.model, 1, preset.n_stages)) * preset.n_stages == preset.model.n_layers
        assert preset.seq_len <= preset.model.max_seq_len
    tiny = get_preset("tiny")
    assert tiny.vocab_size == 4096 and tiny.model.n_layers % 2 == tiny.model.n_layers % 3 == 0


def test_unknown_preset_lists_the_known_names() -> None:
    with pytest.raises(ValueError, match=r"unknown preset 'huge'; known presets: tiny, llama-124m"):
        get_preset("huge")
