"""The `swarmnode` console script: a thin click group over the runtime."""

from __future__ import annotations

import click

from swarmnode import __version__
from swarmnode.cli.schedule import schedule
from swarmnode.cli.swarm import bootstrap, join, status
from swarmnode.cli.train import train


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="swarmnode")
def main() -> None:
    """Train a language model on a swarm of unreliable machines: SkipPipe paths, NoLoCo averaging,
    CheckFree recovery, on a hivemind DHT."""


for command in (train, schedule, bootstrap, join, status):
    main.add_command(command)
