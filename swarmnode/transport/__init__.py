"""Tensor RPC between daemons, over hivemind's libp2p daemon.

    transport = Transport(p2p, TransportConfig(direct_host="0.0.0.0"), identity=identity)  # the p2pd's key
    transport.register("forward", handler)  # async (peer_id, meta, tensors) -> (meta, tensors) or Reply
    await transport.start()
    meta, tensors = await transport.call(peer_id, "forward", meta, tensors, timeout=5.0)
    await transport.close()

Messages of any size (far past hivemind's 4 MiB unary cap) travel as length-prefixed frames over pooled,
persistent libp2p streams, or over direct TCP streams negotiated through libp2p when `direct_host` is set
(encrypted and bound to both peers' libp2p identities; plaintext only between loopback daemons). Tensors
travel as hivemind.compression's NONE or FLOAT16; the wire format and its checks are in `_framing`; the
`Transport` facade is in `_transport`, its settings in `_config`, the calling side's streams in `_pool`, the
serving side in `_serving`, the direct TCP path in `_direct` (its handshake in `_handshake`, its sealed
records in `_channel`), the emulated WAN links (`Transport(p2p, config, links=LinkEmulator(network, site))`)
in `_links`, streams through a relay to peers that cannot be dialled (`set_relays`, `accept_relayed_from`)
in `_relay`.
"""

from swarmnode.transport._config import TransportConfig, TransportStats
from swarmnode.transport._errors import (
    CallTimeout,
    PeerUnreachable,
    RemoteError,
    TransportError,
    WireError,
)
from swarmnode.transport._framing import WIRE_DTYPES, Compression, Limits
from swarmnode.transport._links import LinkEmulator
from swarmnode.transport._serving import Handler, Reply
from swarmnode.transport._transport import Transport

__all__ = [
    "WIRE_DTYPES",
    "CallTimeout",
    "Compression",
    "Handler",
    "Limits",
    "LinkEmulator",
    "PeerUnreachable",
    "RemoteError",
    "Reply",
    "Transport",
    "TransportConfig",
    "TransportError",
    "TransportStats",
    "WireError",
]
