"""`--announce-maddrs`, `--use-relay/--no-use-relay`, `--use-auto-relay`, `--relay` and `--reachability`:
how a node on another host, or behind a NAT, is reached (`swarmnode.dht.Reach`).

The command receives them as one `reach` argument; a bad value is a one-line usage error.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def reach_options(func: F) -> F:
    """Add the reachability options to a command, which gets them as `reach` (a `swarmnode.dht.Reach`)."""

    @functools.wraps(func)
    def configured(
        *args: Any,
        announce_maddrs: tuple[str, ...],
        use_relay: bool,
        use_auto_relay: bool,
        relays: tuple[str, ...],
        reachability: str,
        **kwargs: Any,
    ) -> Any:
        from swarmnode.dht import Reach

        try:
            reach = Reach(announce_maddrs, use_relay, use_auto_relay, reachability, relays)  # type: ignore[arg-type]
        except ValueError as error:
            raise click.UsageError(str(error)) from None
        return func(*args, reach=reach, **kwargs)

    for option in (
        click.option(
            "--reachability",
            type=click.Choice(["auto", "public", "private"]),
            default="auto",
            show_default=True,
            help="Override libp2p's NAT detection, which never decides on private address ranges: "
            "'public' for a node others can dial (libp2p then relays for nodes behind NATs), 'private' for "
            "one behind a NAT.",
        ),
        click.option(
            "--relay",
            "relays",
            multiple=True,
            metavar="MADDR",
            help="With --use-auto-relay: a peer to be reached through (/ip4/.../tcp/.../p2p/ID; "
            "repeatable; every daemon relays). Default: the initial peers.",
        ),
        click.option(
            "--use-auto-relay",
            is_flag=True,
            help="Behind a NAT: list relays (--relay, else the initial peers) in this node's record, so "
            "that peers that cannot connect to it open their streams through them (and take libp2p relay "
            "slots there).",
        ),
        click.option(
            "--use-relay/--no-use-relay",
            default=True,
            show_default=True,
            help="Reach peers through relays when they cannot be dialed directly (and relay for others "
            "while publicly reachable).",
        ),
        click.option(
            "--announce-maddrs",
            multiple=True,
            metavar="MADDR",
            help="Tell peers to dial this address (/ip4/PUBLIC_IP/tcp/PORT, explicit port; repeatable) "
            "instead of the one listened on: for a port forwarded to this machine.",
        ),
    ):
        configured = option(configured)
    return configured  # type: ignore[return-value]
