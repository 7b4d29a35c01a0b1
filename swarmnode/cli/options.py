"""Shared CLI validation: user errors become one-line click usage errors (exit code 2), never tracebacks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import click

from swarmnode.model_config import ModelConfig
from swarmnode.presets import Preset, get_preset

if TYPE_CHECKING:
    from swarmnode.data import Corpus

F = TypeVar("F", bound=Callable[..., object])


def batch_options(func: F) -> F:
    """`--batch-size` and `--seq-len`: the shape of the run's microbatches (default: the preset's)."""
    func = click.option(
        "--seq-len",
        type=click.IntRange(min=1),
        default=None,
        help="Tokens per sequence (default: the preset's; at most its context).",
    )(func)
    return click.option(
        "--batch-size",
        type=click.IntRange(min=1),
        default=None,
        help="Sequences per microbatch (default: the preset's).",
    )(func)


def preset_or_fail(name: str) -> Preset:
    try:
        return get_preset(name)
    except (KeyError, ValueError) as error:
        raise click.BadParameter(_message(error), param_hint="--preset") from None


def stages_or_fail(preset: Preset, stages: int | None) -> int:
    n_stages = preset.n_stages if stages is None else stages
    if preset.model.n_layers % n_stages:
        raise click.BadParameter(
            f"{preset.model.n_layers} layers of preset {preset.name!r} do not divide into {n_stages} stages",
            param_hint="--stages",
        )
    return n_stages


def load_corpus_or_fail(data: Path | None, tokenizer: Path | None, vocab_size: int, seq_len: int) -> Corpus:
    """The corpus, with both splits long enough for a batch of `seq_len`; else a one-line usage error."""
    from swarmnode.data import DataError, check_splits, load_corpus

    try:
        corpus = load_corpus(data, tokenizer, vocab_size)
        check_splits(corpus, seq_len, str(data) if data is not None else "the default corpus")
    except DataError as error:
        raise click.UsageError(_message(error)) from None
    return corpus


def out_folder_or_fail(out: Path | None) -> None:
    """`--out DIR` for a model folder: absent, empty or an earlier model folder, in a writable place."""
    from swarmnode.modeldir import ModelFolderError, check_out_folder

    if out is None:
        return
    try:
        check_out_folder(out)
    except ModelFolderError as error:
        raise click.BadParameter(str(error), param_hint="--out") from None


def init_tokenizer_or_fail(folder: Path) -> Path:
    """The tokenizer.json of an `--init-from` folder (the model's vocabulary is that tokenizer's)."""
    from swarmnode.modeldir import tokenizer_of

    if not folder.is_dir():
        raise click.BadParameter(f"{folder} is not a folder", param_hint="--init-from")
    path = tokenizer_of(folder)
    if path is None:
        raise click.BadParameter(
            f"{folder} has no tokenizer.json: give the one its model was trained with as --tokenizer",
            param_hint="--init-from",
        )
    return path


def init_from_or_fail(folder: Path | None, expected: ModelConfig, preset: str) -> None:
    """`--init-from DIR`: a Llama folder whose shape and vocabulary are the run's (the field that differs
    is named)."""
    from swarmnode.modeldir import ModelFolderError, check_shape, read_config

    if folder is None:
        return
    try:
        found, _ = read_config(folder)
        check_shape(found, expected, f"preset {preset!r} with this tokenizer")
    except ModelFolderError as error:
        raise click.BadParameter(str(error), param_hint="--init-from") from None


def _message(error: Exception) -> str:
    return error.args[0] if error.args else str(error)
