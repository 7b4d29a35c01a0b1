"""Relay addresses: how a node that peers cannot dial tells them where to reach it.

A volunteer behind a NAT that joins with `--use-auto-relay` publishes one circuit address per relay in its
record (`NodeRecord.addrs`): `/ip4/RELAY_IP/tcp/PORT/p2p/RELAY_ID/p2p-circuit`. Its relays are `--relay`,
else its initial peers, to which it opens connections as it joins; a relay reaches it over those. A peer
that cannot open a stream to it opens one through a relay named there (`transport._relay`).
"""

from __future__ import annotations

from collections.abc import Iterable

from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

CIRCUIT = "/p2p-circuit"
MAX_RELAYS = 4  # relays taken from one peer's record


def circuit_addrs(relays: Iterable[str]) -> tuple[str, ...]:
    """The circuit address through each relay (a multiaddr ending in `/p2p/ID`), in order."""
    return tuple(f"{relay.rstrip('/')}{CIRCUIT}" for relay in relays)


def relay_of(addr: str) -> PeerID | None:
    """The relay of a circuit address (`/ip4|ip6/HOST/tcp/PORT/p2p/RELAY_ID/p2p-circuit`); None for anything
    else, such as an address a hostile record made up."""
    if not addr.endswith(CIRCUIT):
        return None
    try:
        relay = Multiaddr(addr[: -len(CIRCUIT)])
        names = [protocol.name for protocol in relay.protocols()]
        if names[:1] not in (["ip4"], ["ip6"]) or names[1:] != ["tcp", "p2p"]:
            return None
        return PeerID.from_base58(relay.value_for_protocol("p2p"))
    except Exception:  # multiaddr and base58 raise several unrelated types for bad input
        return None


def relays_of(addrs: Iterable[str]) -> tuple[PeerID, ...]:
    """The relays a record's circuit addresses name, in order, without repeats, at most `MAX_RELAYS`;
    whatever is not a circuit address is ignored."""
    found = dict.fromkeys(relay for relay in map(relay_of, addrs) if relay is not None)
    return tuple(found)[:MAX_RELAYS]
