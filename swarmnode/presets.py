"""Named model presets: a :class:`~swarmnode.model.ModelConfig` plus the training defaults that go with it.

``tiny`` is for laptops, tests and the demo: it trains visibly on two CPU cores in minutes. The others are the
papers' sizes. Their dim, heads, layers, context, stage count, microbatching and learning rate are those of
the reference code (gensyn-ai/CheckFree ``simulate_training/*_config.json``; gensyn-ai/noloco's 125M config).

Parameter-count convention of the paper presets: every parameter counted, input and output embeddings untied
(``E`` and ``E'`` are separate pieces, as in the reference code), vocabulary 32,000 (the LLaMA-2 SentencePiece
vocabulary of CheckFree's reference code). The references do not reproduce the published sizes themselves:
CheckFree's model library uses ``ffn_hidden = 4 * dim``, which gives 83M, 468M and 1.74B for the "124M",
"500M" and "1.5B" models; NoLoCo's "125M" (``ffn_hidden`` 3072 and the Llama-3 vocabulary of 128,002, untied)
has 310M. So ``ffn_hidden`` (a multiple of 256) is chosen here to bring each total within 2% of the published
size (``published_params``), keeping every other dimension as published.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from swarmnode.model_config import ModelConfig, stage_layers


@dataclass(frozen=True)
class Preset:
    """A model and its training defaults. Invalid combinations raise ``ValueError``.

    ``n_stages`` is the default number of transformer stages (``S1..Ss``); a data node runs ``microbatches``
    microbatches of ``batch_size`` sequences of ``seq_len`` tokens per optimizer step for each pipeline
    (replica of the narrowest stage) of the swarm: one pipeline's batch is the single process's. The tokenizer
    is trained with :attr:`vocab_size` tokens. ``noloco_inner_steps`` is NoLoCo's H (the paper's 50 unless a
    preset says why not). ``published_params`` is the paper's size (``None`` for ``tiny``).
    """

    name: str
    model: ModelConfig
    n_stages: int
    seq_len: int
    batch_size: int
    microbatches: int
    lr: float
    warmup_steps: int
    noloco_inner_steps: int = 50
    published_params: int | None = None

    def __post_init__(self) -> None:
        stage_layers(self.model, 1, self.n_stages)  # raises if the layers do not split evenly
        for name in ("seq_len", "batch_size", "microbatches", "noloco_inner_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"preset {self.name!r}: {name} must be positive, got {getattr(self, name)}")
        if self.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"preset {self.name!r}: seq_len {self.seq_len} exceeds max_seq_len {self.model.max_seq_len}"
            )
        if not self.lr > 0 or self.warmup_steps < 0:
            raise ValueError(f"preset {self.name!r}: need lr > 0 and warmup_steps >= 0")

    @property
    def vocab_size(self) -> int:
        """Vocabulary size the tokenizer is trained with (the model's ``vocab_size``)."""
        return self.model.vocab_size


def _paper_model(dim: int, n_heads: int, n_layers: int, ffn_hidden: int, context: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=32000,
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        ffn_hidden=ffn_hidden,
        max_seq_len=context,
    )


PRESETS: Mapping[str, Preset] = MappingProxyType(
    {
        preset.name: preset
        for preset in (
            # Measured on 2 CPU cores, whole model in one process: 0.12 s per AdamW step of 8 x 128 tokens;
            # on stdlib text (BPE 4096) validation loss 8.35 -> 0.74x after 20 steps, 0.59x after 120.
            Preset(
                name="tiny",
                model=ModelConfig(
                    vocab_size=4096, dim=128, n_layers=6, n_heads=4, ffn_hidden=384, max_seq_len=128
                ),
                n_stages=3,
                seq_len=128,
                # two microbatches of 4 rather than one of 8 (the same step in the single process): a replica
                # that gets only part of a data node's microbatches still takes a step every iteration
                batch_size=4,
                microbatches=2,
                lr=3e-3,
                warmup_steps=10,
                # the demo runs 100-200 steps: H = 50 would average two to four times in a whole run
                noloco_inner_steps=10,
            ),
            # CheckFree: TinyStories; 4 stages of 3 layers; 4 microbatches of 64; Adam 6e-4, constant.
            Preset(
                name="llama-124m",
                model=_paper_model(dim=512, n_heads=8, n_layers=12, ffn_hidden=4352, context=512),
                n_stages=4,
                seq_len=512,
                batch_size=64,
                microbatches=4,
                lr=6e-4,
                warmup_steps=0,
                published_params=124_000_000,
            ),
            # CheckFree: OpenWebText; 6 stages of 4 layers; 4 microbatches of 16; Adam 3e-4, constant.
            Preset(
                name="llama-500m",
                model=_paper_model(dim=1024, n_heads=16, n_layers=24, ffn_hidden=4608, context=1024),
                n_stages=6,
                seq_len=1024,
                batch_size=16,
                microbatches=4,
                lr=3e-4,
                warmup_steps=0,
                published_params=500_000_000,
            ),
            # CheckFree: RedPajama v2; 6 stages of 4 layers; 8 microbatches of 2; Adam 3e-4, constant.
            Preset(
                name="llama-1.5b",
                model=_paper_model(dim=2048, n_heads=16, n_layers=24, ffn_hidden=6656, context=4096),
                n_stages=6,
                seq_len=4096,
                batch_size=2,
                microbatches=8,
                lr=3e-4,
                warmup_steps=0,
                published_params=1_500_000_000,
            ),
            # NoLoCo: 8 replicas x 2 stages; 128 sequences of 1024 per replica and step (the reference
            # pipelines them one at a time; here 8 microbatches of 16); peak lr 6e-4 after 1000 warm-up steps.
            Preset(
                name="noloco-125m",
                model=_paper_model(dim=768, n_heads=12, n_layers=12, ffn_hidden=1792, context=1024),
                n_stages=2,
                seq_len=1024,
                batch_size=16,
                microbatches=8,
                lr=6e-4,
                warmup_steps=1000,
                published_params=125_000_000,
            ),
        )
    }
)
"""Every preset by name."""


def get_preset(name: str) -> Preset:
    """The preset called ``name``; ``ValueError`` listing the known names if there is none."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}") from None
