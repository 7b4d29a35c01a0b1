"""`--network FILE` and `--site NAME`: place a daemon at a site of an emulated network (`protocols.links`).

The command receives `network` (a parsed `protocols.links.Network`, or None) and `site` (one of its sites, or
None); a file that cannot be read or parsed, a site it lacks, or one option without the other is a one-line
usage error naming the option and what is wrong.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    from protocols.links import Network

F = TypeVar("F", bound=Callable[..., Any])

NETWORK_HELP = (
    "Emulate WAN links: a links file (sites, links with one-way latency_ms and bandwidth_GBps, same_site; "
    "the format of gcp12_links.json). What this node sends to a peer at another site is delayed and paced "
    "as over their link. Needs --site."
)
SITE_HELP = "This node's site in the --network file (announced in its record)."


def network_options(func: F) -> F:
    """Add `--network` and `--site` to a command, which gets them as `network` and `site`, both checked."""

    @functools.wraps(func)
    def placed(*args: Any, network: Path | None, site: str | None, **kwargs: Any) -> Any:
        parsed = None if network is None else read_network(network)
        return func(*args, network=parsed, site=check_site(parsed, site), **kwargs)

    for option in (
        click.option("--site", default=None, metavar="NAME", help=SITE_HELP),
        click.option(
            "--network", type=click.Path(dir_okay=False, path_type=Path), default=None, help=NETWORK_HELP
        ),
    ):
        placed = option(placed)
    return placed  # type: ignore[return-value]


def read_network(path: Path, hint: str = "--network") -> Network:
    """The network in `path`; a one-line usage error naming the file if it cannot be read or is not one."""
    from protocols.errors import LocalProtocolError
    from protocols.links import loads_network

    try:
        return loads_network(path.read_bytes())
    except OSError as error:
        raise click.BadParameter(f"cannot read {path}: {error.strerror or error}", param_hint=hint) from None
    except LocalProtocolError as error:
        raise click.BadParameter(f"{path}: {error.reason}", param_hint=hint) from None


def check_site(network: Network | None, site: str | None) -> str | None:
    """`site`, checked against `network`: both given or neither, and a site the network has."""
    from protocols.errors import LocalProtocolError

    if network is None:
        if site is not None:
            raise click.BadParameter(
                "needs --network (the links file the site belongs to)", param_hint="--site"
            )
        return None
    if site is None:
        raise click.BadParameter("needs --site (this node's site in the file)", param_hint="--network")
    try:
        return network.check_site(site)
    except LocalProtocolError as error:
        raise click.BadParameter(error.reason, param_hint="--site") from None
