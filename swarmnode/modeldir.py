"""A Hugging Face Llama model folder: written by `export` and `train --out`, read by `--init-from`.

The folder holds `config.json` (the fields of `transformers.LlamaConfig`, plus a `swarmnode` entry saying
where the weights came from), `model.safetensors` (float32, `LlamaForCausalLM` names),
`generation_config.json` and the tokenizer (`tokenizer.json`, `tokenizer_config.json`,
`special_tokens_map.json`), so that
`AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)` load it without
swarmnode. Nothing here imports `transformers`. A folder is written whole in a temporary sibling and then
renamed into place, so a reader never sees half of one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from swarmnode.hf import SplitStateDicts, from_hf_state_dict, hf_config_kwargs, to_hf_state_dict
from swarmnode.model_config import ModelConfig
from swarmnode.tokenizer import eos_id

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
# LlamaConfig field -> ModelConfig field, for reading a folder back
_FIELDS = {
    "vocab_size": "vocab_size",
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "intermediate_size": "ffn_hidden",
    "max_position_embeddings": "max_seq_len",
    "num_key_value_heads": "n_kv_heads",
    "rms_norm_eps": "norm_eps",
}


class ModelFolderError(ValueError):
    """A model folder that cannot be read or does not fit: the message names the file and the field."""


def write_model_folder(
    out: Path,
    config: ModelConfig,
    pieces: SplitStateDicts,
    tokenizer_path: Path,
    metadata: Mapping[str, Any],
) -> None:
    """Write the model (`pieces`: E, the stages in order, E') and its tokenizer as a folder at `out`,
    replacing a folder already there; `metadata` goes into `config.json` under `swarmnode`."""
    state = to_hf_state_dict(config, pieces.embedding, [dict(s) for s in pieces.stages], pieces.head)
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    eos_token_id = eos_id(tokenizer, tokenizer_path)
    eos = tokenizer.id_to_token(eos_token_id)
    hf_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **hf_config_kwargs(config),
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
        "swarmnode": dict(metadata),
    }
    files: dict[str, Any] = {
        CONFIG_FILE: hf_config,
        "generation_config.json": {"bos_token_id": eos_token_id, "eos_token_id": eos_token_id},
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": eos,
            "eos_token": eos,
            "model_max_length": config.max_seq_len,
            "clean_up_tokenization_spaces": False,
        },
        "special_tokens_map.json": {"bos_token": eos, "eos_token": eos},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".partial"))
    try:
        tensors = {name: t.detach().float().contiguous() for name, t in state.items()}
        save_file(tensors, str(partial / WEIGHTS_FILE), metadata={"format": "pt"})
        shutil.copyfile(tokenizer_path, partial / TOKENIZER_FILE)
        for name, content in files.items():
            (partial / name).write_text(json.dumps(content, indent=2) + "\n")
        os.chmod(partial, 0o755)  # mkdtemp makes it private
        _replace_folder(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _replace_folder(new: Path, out: Path) -> None:
    """Rename `new` to `out`; an older `out` is moved aside first and removed after."""
    if not out.exists():
        new.rename(out)
        return
    old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".old"))
    out.rename(old / out.name)
    new.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def check_out_folder(out: Path, snapshots: str | None = None) -> None:
    """Raise ModelFolderError unless `out` can take an export: absent, empty, or an earlier model folder
    (with `snapshots`, a prefix: a folder of model folders named with it)."""
    if out.exists() and not out.is_dir():
        raise ModelFolderError(f"{out} is a file, not a folder")
    if out.is_dir():
        entries = list(out.iterdir())
        if snapshots is not None:
            foreign = [p for p in entries if not p.name.startswith((snapshots, "."))]
        else:
            foreign = [] if (out / CONFIG_FILE).is_file() else entries
        if foreign:
            what = f"{snapshots}* snapshots" if snapshots else "a model"
            raise ModelFolderError(f"{out} holds {foreign[0].name!r}: not a folder of {what}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ModelFolderError(f"cannot create {out.parent}: {error.strerror}") from None
    if not os.access(out.parent, os.W_OK):
        raise ModelFolderError(f"cannot write in {out.parent}")


def read_config(folder: Path) -> tuple[ModelConfig, dict[str, Any]]:
    """The model's shape from `folder/config.json`, and the whole file's content."""
    path = folder / CONFIG_FILE
    if not folder.is_dir():
        raise ModelFolderError(f"{folder} is not a folder")
    try:
        raw = json.loads(path.read_text())
    except OSError as error:
        raise ModelFolderError(f"cannot read {path}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise ModelFolderError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(raw, dict) or raw.get("model_type") != "llama":
        raise ModelFolderError(f"{path}: model_type must be 'llama'")
    for name, expected in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if raw.get(name, expected) != expected:
            raise ModelFolderError(f"{path}: {name} is {raw[name]!r}, only {expected!r} is supported")
    values = {ours: raw.get(theirs) for theirs, ours in _FIELDS.items() if raw.get(theirs) is not None}
    if values.get("n_kv_heads") == values.get("n_heads"):
        del values["n_kv_heads"]  # one key/value head per query head
    rope = raw.get("rope_parameters") or {}
    theta = raw.get("rope_theta", rope.get("rope_theta") if isinstance(rope, dict) else None)
    if theta is not None:
        values["rope_theta"] = theta
    try:
        config = ModelConfig(**values)
    except TypeError as error:  # a required field is missing
        raise ModelFolderError(f"{path}: {error}") from None
    except ValueError as error:
        raise ModelFolderError(f"{path}: {error}") from None
    head_dim = raw.get("head_dim")
    if head_dim is not None and head_dim != config.head_dim:
        raise ModelFolderError(f"{path}: head_dim {head_dim} is not hidden_size / num_attention_heads")
    return config, raw


def read_model_folder(folder: Path, n_stages: int) -> tuple[ModelConfig, SplitStateDicts]:
    """The model in `folder`, as float32 state dicts of E, `n_stages` stages and E'."""
    config, _ = read_config(folder)
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise ModelFolderError(f"{folder} has no {WEIGHTS_FILE}")
    try:
        state = {name: t.float() for name, t in load_file(str(path)).items()}
    except (SafetensorError, OSError) as error:
        raise ModelFolderError(f"{path}: {error}") from None
    try:
        split = from_hf_state_dict(config, state, n_stages)
    except ValueError as error:
        raise ModelFolderError(f"{path}: {error}") from None
    return config, split


def tokenizer_of(folder: Path) -> Path | None:
    """The folder's `tokenizer.json`, if it has one."""
    path = folder / TOKENIZER_FILE
    return path if path.is_file() else None


def check_shape(found: ModelConfig, expected: ModelConfig, what: str) -> None:
    """Raise ModelFolderError naming the first LlamaConfig field where `found` differs from `expected`."""
    for theirs, ours in (*_FIELDS.items(), ("rope_theta", "rope_theta")):
        attribute = "kv_heads" if ours == "n_kv_heads" else ours
        a, b = getattr(found, attribute), getattr(expected, attribute)
        if a != b:
            raise ModelFolderError(f"{theirs} is {a} in the folder, {b} in {what}")


def load_pieces(pieces: list[torch.nn.Module], split: SplitStateDicts) -> None:
    """Load E and E' into the data piece (`pieces[0]`) and each stage's layers into `pieces[k]`."""
    data = {f"embedding.{k}": v for k, v in split.embedding.items()}
    data.update({f"head.{k}": v for k, v in split.head.items()})
    for piece, state in zip(pieces, [data, *split.stages], strict=True):
        try:
            missing, unexpected = piece.load_state_dict(state, strict=False)
        except RuntimeError as error:  # a shape that differs
            raise ModelFolderError(f"weights do not fit: {str(error).splitlines()[-1].strip()}") from None
        if missing or unexpected:
            raise ModelFolderError(f"weights do not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
