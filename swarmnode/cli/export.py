"""`swarmnode export`: the model of a running swarm as a Hugging Face folder (`swarmnode.exporter`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from swarmnode.cli.daemons import (
    OWNER_HELP,
    PEERS_HELP,
    RUN_ID_HELP,
    _owners_or_fail,
    _peers_or_fail,
    _run_async,
)
from swarmnode.cli.log_options import logging_options
from swarmnode.runspec import RunVersionMismatch


@click.command()
@click.option("--initial-peers", envvar="SWARMNODE_INITIAL_PEERS", default=None, help=PEERS_HELP)
@click.option("--run-id", default="swarm", show_default=True, help=RUN_ID_HELP)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    required=True,
    metavar="DIR",
    help="The model folder to write (with --every-steps: the folder of the snapshots step-NNNNNN).",
)
@click.option(
    "--tokenizer",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="The run's tokenizer.json (refused if its digest is not the run's; default: the cached file "
    "with the run's digest, else fetched from the run's owners or data nodes).",
)
@click.option(
    "--every-steps",
    type=click.IntRange(min=1),
    default=None,
    help="Keep exporting while the swarm trains: a snapshot every N steps, and the last step's.",
)
@click.option(
    "--keep",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="With --every-steps: how many of the newest snapshots to keep.",
)
@click.option(
    "--evaluate",
    is_flag=True,
    help="Also read each folder back and print its validation loss on the run's validation set.",
)
@click.option("--run-owner", "run_owners", multiple=True, envvar="SWARMNODE_RUN_OWNER", help=OWNER_HELP)
@logging_options
def export(
    initial_peers: str | None,
    run_id: str,
    out: Path,
    tokenizer: Path | None,
    every_steps: int | None,
    keep: int,
    evaluate: bool,
    run_owners: tuple[str, ...],
) -> None:
    """Fetch every stage's weights from live nodes of the run and write a Hugging Face Llama folder
    (config.json, model.safetensors, generation_config.json, the tokenizer); prints one JSON line per
    folder written."""
    from swarmnode.data import DataError
    from swarmnode.dht import DHTUnavailable, RunNotFound
    from swarmnode.exporter import SNAPSHOT_PREFIX, ExportError, export_command
    from swarmnode.modeldir import ModelFolderError, check_out_folder

    peers = _peers_or_fail(initial_peers)
    owners = _owners_or_fail(run_owners)
    if tokenizer is not None and not tokenizer.is_file():
        raise click.BadParameter(f"{tokenizer}: no such file", param_hint="--tokenizer")
    try:
        check_out_folder(out, None if every_steps is None else SNAPSHOT_PREFIX)
    except ModelFolderError as error:
        raise click.BadParameter(str(error), param_hint="--out") from None
    try:
        code = _run_async(export_command(peers, run_id, owners, out, tokenizer, every_steps, keep, evaluate))
    except (ExportError, DataError, ModelFolderError, RunVersionMismatch) as error:
        raise click.ClickException(str(error)) from None
    except RunNotFound as error:
        raise click.ClickException(f"{error} (check --run-id and --initial-peers)") from None
    except DHTUnavailable as error:
        raise click.ClickException(str(error)) from None
    except asyncio.CancelledError:
        code = 130
    raise SystemExit(code)
