"""`swarmnode train`: the single-process reference trainer."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import click

from swarmnode.cli.compute import device_option, device_or_fail, dtype_option
from swarmnode.cli.log_options import logging_options
from swarmnode.cli.options import (
    init_from_or_fail,
    init_tokenizer_or_fail,
    load_corpus_or_fail,
    out_folder_or_fail,
    preset_or_fail,
    stages_or_fail,
)
from swarmnode.source_spec import DataSource, SourceSpecError


@click.command()
@logging_options
@click.option("--preset", default="tiny", show_default=True, help="Model preset name.")
@click.option(
    "--stages", type=click.IntRange(min=1), default=None, help="Transformer stages (default: the preset's)."
)
@click.option("--steps", type=click.IntRange(min=1), default=200, show_default=True, help="Optimizer steps.")
@click.option(
    "--data",
    default=None,
    help="A .txt/.jsonl/.parquet file or folder, or hf:NAME[:CONFIG][:SPLIT] (a Hugging Face dataset).",
)
@click.option(
    "--text-column",
    default=None,
    help="The field or column holding the text (.jsonl, .parquet, hf:; default: text).",
)
@click.option("--tokenizer", type=click.Path(path_type=Path), default=None, help="A tokenizer.json to use.")
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seeds the initial weights and the data order."
)
@click.option(
    "--eval-every",
    type=click.IntRange(min=1),
    default=20,
    show_default=True,
    help="Steps between validation losses.",
)
@click.option(
    "--init-from",
    type=click.Path(path_type=Path),
    default=None,
    metavar="DIR",
    help="Start from the weights of a Hugging Face Llama folder (an export), with its tokenizer by default.",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    metavar="DIR",
    help="Write the trained model here as a Hugging Face folder (as `swarmnode export` does).",
)
@device_option
@dtype_option("Compute dtype (autocast; weights stay float32).", default="float32")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object as the last line.")
def train(
    preset: str,
    stages: int | None,
    steps: int,
    data: str | None,
    text_column: str | None,
    tokenizer: Path | None,
    seed: int,
    eval_every: int,
    init_from: Path | None,
    out: Path | None,
    device: str,
    dtype: str,
    as_json: bool,
) -> None:
    """Train a preset in this one process, through the same stage pieces the daemons run."""
    from swarmnode.modeldir import ModelFolderError
    from swarmnode.trainer import Progress, TrainConfig
    from swarmnode.trainer import train as run_training

    device_or_fail(device)
    chosen = preset_or_fail(preset)
    n_stages = stages_or_fail(chosen, stages)
    out_folder_or_fail(out)
    if init_from is not None and tokenizer is None:
        tokenizer = init_tokenizer_or_fail(init_from)
    try:
        source = DataSource.parse(data, text_column)
    except SourceSpecError as error:
        raise click.UsageError(str(error)) from None
    corpus = load_corpus_or_fail(source, tokenizer, chosen.vocab_size, chosen.seq_len)
    init_from_or_fail(init_from, replace(chosen.model, vocab_size=corpus.vocab_size), chosen.name)
    config = TrainConfig(
        preset, n_stages, steps, source, tokenizer, seed, eval_every, None, init_from, out, device, dtype
    )

    with click.progressbar(length=steps, label="training", file=sys.stderr, show_pos=True) as bar:

        def on_progress(progress: Progress) -> None:
            bar.update(1)
            if progress.val_loss is not None:
                bar.label = (
                    f"loss {progress.loss:.3f} val {progress.val_loss:.3f} "
                    f"tok/s {progress.tokens_per_second:.0f}"
                )

        try:
            result = run_training(config, on_progress, corpus=corpus)
        except ModelFolderError as error:
            raise click.BadParameter(str(error), param_hint="--init-from") from None

    if as_json:
        click.echo(json.dumps(result.as_dict()))
    else:
        click.echo(
            f"{result.steps} steps: loss {result.initial_loss:.3f} -> {result.final_loss:.3f}, "
            f"validation {result.initial_val_loss:.3f} -> {result.val_loss:.3f}, "
            f"{result.tokens_per_second:.0f} tokens/s, {result.parameters:,} parameters"
        )
