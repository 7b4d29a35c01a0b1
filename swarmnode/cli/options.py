"""Shared CLI validation: user errors become one-line click usage errors (exit code 2), never tracebacks."""

from __future__ import annotations

from pathlib import Path

import click

from swarmnode.data import Corpus, DataError, load_corpus
from swarmnode.presets import Preset, get_preset


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


def load_corpus_or_fail(data: Path | None, tokenizer: Path | None, vocab_size: int) -> Corpus:
    try:
        return load_corpus(data, tokenizer, vocab_size)
    except DataError as error:
        raise click.UsageError(_message(error)) from None


def _message(error: Exception) -> str:
    return error.args[0] if error.args else str(error)
