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
    limits: the largest frame, head, tensor count, rank and tensor size accepted from a peer.
    header_timeout: bound on each small step: a started frame's head, a direct-path hello (and its token's
        life), an error answer to a refused stream (which lingers at most 1 s of it).
    idle_timeout: how long an inbound stream may wait for the start of its next request (or of its first): a
        silent or trickling stream is dropped then. Callers keep idle streams for reuse half as long.
    max_request_seconds: the server's bound on one request (body, handler, reply), whatever the caller asks.
    min_body_rate, body_grace: a request body must arrive at `min_body_rate` bytes/s on average, counted from
        `body_grace` seconds after its head; a slower one is dropped (0: no floor).
    max_inbound_streams: concurrent streams served; more are refused ("overloaded").
    max_inbound_per_peer: concurrent streams served to one peer. Far below `max_inbound_streams`, so that one
        peer holding all of its streams (silent, trickling or busy) leaves the rest to the others.
        A stream past either bound closes the oldest stream waiting for a request (the peer's own first); it
        is refused ("overloaded") only when none is waiting.
    max_calls_per_peer: calls to one peer in flight at once (more wait for one to end), and streams to it kept
        open: at most the peer's `max_inbound_per_peer`, so that it never refuses us for having too many.
    max_inbound_bytes, max_inbound_bytes_per_peer: request-body bytes held at once (received, not yet
        answered), in all and from one peer; taken as the bytes arrive, and a request that would go past
        either bound is refused ("overloaded").
    max_meta_bytes: the default bound on a request's meta (`Transport.register` may set one per method); a
        larger meta is refused as malformed before its handler sees it.
    max_idle_streams: outbound streams kept open for reuse, across all peers.
    ban_seconds: how long a peer that sent a malformed frame is refused (0: never ban).
    direct_host: listen for direct TCP on this IP address ("127.0.0.1", or "0.0.0.0" for other hosts) and use
        peers' direct paths; None (default): libp2p only. The direct path is encrypted and bound to both
        libp2p identities (`Transport`'s `identity` is then required), except as `plaintext_loopback` allows.
    plaintext_loopback: with a loopback `direct_host`, also accept plaintext direct connections (they cannot
        leave the machine), and use them to peers at a loopback IP that offer them. False: encrypted there
        too.
    max_pending_hellos: direct TCP connections that have not yet finished their handshake; a newer one closes
        the oldest (an honest caller completes its handshake at once).
    direct_retry_seconds: after a peer's direct path failed, use libp2p to it for this long.
    """

    protocol: str = "swarmnode.transport.v1"
    compression: Compression = Compression.NONE
    limits: Limits = field(default_factory=Limits)
    header_timeout: float = 10.0
    idle_timeout: float = 20.0
    max_request_seconds: float = 600.0
    min_body_rate: float = 64 << 10
    body_grace: float = 5.0
    max_inbound_streams: int = 256
    max_inbound_per_peer: int = 16
    max_calls_per_peer: int = 16
    max_inbound_bytes: int = 4 << 30
    max_inbound_bytes_per_peer: int = 3 << 29
    max_meta_bytes: int = 64 << 10
    max_idle_streams: int = 64
    ban_seconds: float = 60.0
    direct_host: str | None = None
    plaintext_loopback: bool = True
    max_pending_hellos: int = 64
    direct_retry_seconds: float = 60.0

    def __post_init__(self) -> None:
        if self.direct_host is not None:
            ipaddress.ip_address(self.direct_host)  # ValueError unless one IP: a name may bind several ports
        if min(self.header_timeout, self.idle_timeout, self.max_request_seconds) <= 0:
            raise ValueError("header_timeout, idle_timeout and max_request_seconds must be positive")
        if min(self.min_body_rate, self.body_grace, self.max_meta_bytes) < 0:
            raise ValueError("min_body_rate, body_grace and max_meta_bytes must be >= 0")
        if not 1 <= self.max_inbound_per_peer <= self.max_inbound_streams:
            raise ValueError("max_inbound_per_peer must be within 1..max_inbound_streams")
        if not 1 <= self.max_inbound_bytes_per_peer <= self.max_inbound_bytes:
            raise ValueError("max_inbound_bytes_per_peer must be within 1..max_inbound_bytes")
        if min(self.max_calls_per_peer, self.max_pending_hellos) < 1:
            raise ValueError("max_calls_per_peer and max_pending_hellos must be positive")


@dataclass
class TransportStats:
    """Counters since start: calls that succeeded and failed (by error type), requests served and answered
    with an error (by code), outbound streams opened (by path: "libp2p", "encrypted" direct, plaintext
    "direct").

    refused: streams and requests refused, by reason: "malformed" (answered "bad_request"), "banned",
        "streams" (all stream slots busy), "peer_streams" (the peer's slots busy), "bytes" (the inbound byte
        budget), "hello" (a direct connection closed for a newer one before its handshake ended),
        "direct_hello" (a direct connection with a bad hello or token), "identity" (a direct connection whose
        caller could not sign as the peer its token was granted to), "relay_busy" and "relay_header" (relay
        requests past the splice limits, or malformed), "relayed" (a relayed stream not from one of this
        node's relays, or malformed).
    dropped: inbound streams closed without an answer, by reason: "idle" (no request within idle_timeout),
        "evicted" (waiting for a request when a new stream needed its slot), "head" (a head slower than
        header_timeout), "slow_body" (under the rate floor), "stalled" (past the request's deadline),
        "unanswered" (a refusal while too many others were being answered).
    inbound_streams: inbound streams served now.
    inbound_bytes, inbound_bytes_peak: request-body bytes held now, and the most held at once.
    relayed: streams this node relayed between two other peers (`_relay`).
    """

    calls_ok: int = 0
    calls_failed: Counter[str] = field(default_factory=Counter)
    served: int = 0
    errors_returned: Counter[str] = field(default_factory=Counter)
    streams_opened: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)
    inbound_streams: int = 0
    inbound_bytes: int = 0
    inbound_bytes_peak: int = 0
    relayed: int = 0
