"""A transport's settings and its counters."""

from __future__ import annotations

import ipaddress
from collections import Counter
from dataclasses import dataclass, field

from swarmnode.transport._framing import Compression, Limits


@dataclass(frozen=True)
class TransportConfig:
    """Settings of one transport; the defaults suit a loopback swarm.

    protocol: the libp2p protocol id of the stream handler.
    compression: how float32 tensors travel unless a call says otherwise (FLOAT16 halves the bytes).
    limits: the largest frame, head, tensor count and rank accepted from a peer.
    header_timeout: bound on each small step: a started frame's head, a direct-path hello (and its token's
        life), an error answer to a refused stream.
    max_request_seconds: the server's bound on one request (body, handler, reply), whatever the caller asks.
    max_inbound_streams: concurrent streams served; more are refused ("overloaded").
    max_inbound_per_peer: concurrent streams served to one peer; more are refused ("overloaded").
    max_idle_streams: outbound streams kept open for reuse, across all peers.
    ban_seconds: how long a peer that sent a malformed frame is refused (0: never ban).
    direct_host: listen for direct TCP on this IP address ("127.0.0.1", or "0.0.0.0" for a LAN) and use
        peers' direct paths; None (default): libp2p only. Plaintext: for loopback and trusted networks.
    direct_retry_seconds: after a peer's direct path failed, use libp2p to it for this long.
    """

    protocol: str = "swarmnode.transport.v1"
    compression: Compression = Compression.NONE
    limits: Limits = field(default_factory=Limits)
    header_timeout: float = 10.0
    max_request_seconds: float = 600.0
    max_inbound_streams: int = 256
    max_inbound_per_peer: int = 64
    max_idle_streams: int = 64
    ban_seconds: float = 60.0
    direct_host: str | None = None
    direct_retry_seconds: float = 60.0

    def __post_init__(self) -> None:
        if self.direct_host is not None:
            ipaddress.ip_address(self.direct_host)  # ValueError unless one IP: a name may bind several ports
        if not (self.header_timeout > 0 and self.max_request_seconds > 0):
            raise ValueError("header_timeout and max_request_seconds must be positive")


@dataclass
class TransportStats:
    """Counters since start: calls that succeeded and failed (by error type), requests served and answered
    with an error (by code), outbound streams opened (by path: "libp2p", "direct")."""

    calls_ok: int = 0
    calls_failed: Counter[str] = field(default_factory=Counter)
    served: int = 0
    errors_returned: Counter[str] = field(default_factory=Counter)
    streams_opened: Counter[str] = field(default_factory=Counter)
