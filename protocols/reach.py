"""The reachability check's messages, sans-I/O: a joining node asks a peer to dial it back.

The asker names the TCP ports it listens on (or announces); the peer dials each of them at the IP its
connection with the asker comes from (never an address the asker names, so the check cannot be turned
against a third party) and answers which ports accepted a libp2p connection. Both messages are
`protocols.messages` messages: `encode`/`decode` them with `MAX_REACH_BYTES`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from protocols._message import Message
from protocols._schema import checked, count, items, text

MAX_REACH_PORTS = 4  # ports one request may ask about: each costs the peer a dial of up to a few seconds
MAX_REACH_BYTES = 256  # a request or reply fits in far less
MAX_HOST = 45  # the longest textual IPv6 address

_PORT = count(65535, 1)


@dataclass(frozen=True)
class ReachRequest(Message):
    """Dial me back at these TCP ports, at the address you see me at."""

    KIND: ClassVar[str] = "reach_request"
    ports: tuple[int, ...] = field(metadata=checked(items(_PORT, MAX_REACH_PORTS, 1, unique=True)))


@dataclass(frozen=True)
class ReachReply(Message):
    """`observed`: the IP the asker's connection comes from ("" when it came through a relay, so no
    address could be dialed); `reachable`: the asked ports at which a libp2p listener answered."""

    KIND: ClassVar[str] = "reach_reply"
    observed: str = field(metadata=checked(text(MAX_HOST)))
    reachable: tuple[int, ...] = field(
        default=(), metadata=checked(items(_PORT, MAX_REACH_PORTS, unique=True))
    )
