"""The `swarmnode` console script: a thin click group over the runtime."""

from __future__ import annotations

import click

from swarmnode import __version__
from swarmnode.cli import daemons as daemons_module
from swarmnode.cli import export as export_module
from swarmnode.cli import schedule as schedule_module
from swarmnode.cli import train as train_module
from swarmnode.cli import up as up_module
from swarmnode.hivemind_parts import register_package
from swarmnode.malloc_tuning import tune_malloc


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="swarmnode")
def main() -> None:
    """Train a language model on a swarm of unreliable machines: SkipPipe paths, NoLoCo averaging,
    CheckFree recovery, on a hivemind DHT."""
    tune_malloc()  # before any thread starts: see its module
    register_package()  # before any command imports hivemind: its DHT and libp2p parts alone


for command in (
    up_module.up,
    train_module.train,
    schedule_module.schedule,
    daemons_module.bootstrap,
    daemons_module.join,
    daemons_module.status,
    export_module.export,
):
    main.add_command(command)
