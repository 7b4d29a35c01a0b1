"""What a node is built with beside its stage (`NodeContext`): the run, the process's DHT, the node's own
transport, where it computes, and the options that watch it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from swarmnode.dht import SwarmDHT
from swarmnode.node.metrics import DaemonMetrics
from swarmnode.node.serving import request_seconds
from swarmnode.precision import Precision
from swarmnode.relays import relays_of
from swarmnode.runspec import RunSpec
from swarmnode.transport import LinkEmulator, Transport, TransportConfig

BAN_SECONDS = 60.0  # how long a peer that sent malformed or hostile input is refused


@dataclass(frozen=True)
class NodeContext:
    """What a node is built with beside its stage: the run, the process's DHT, this node's transport (not
    serving yet: `Node.start` registers its handlers and starts it; `Node.close` closes it), where and in what
    dtype it computes, and the options that watch it."""

    spec: RunSpec
    dht: SwarmDHT
    transport: Transport
    precision: Precision
    links: LinkEmulator | None = None  # `--network`: emulated links to peers at other sites
    metrics: DaemonMetrics | None = None  # `--metrics-port`: told of rejections and hops
    dump_dir: Path | None = None  # where a recovery writes its evidence (tests, debugging)

    @classmethod
    async def connect(
        cls,
        spec: RunSpec,
        dht: SwarmDHT,
        direct_host: str | None,
        precision: Precision,
        links: LinkEmulator | None = None,
        metrics: DaemonMetrics | None = None,
        dump_dir: Path | None = None,
    ) -> NodeContext:
        """A context with a fresh transport on the process's p2pd client (`direct_host`: also open a direct
        TCP listener there)."""
        config = TransportConfig(
            direct_host=direct_host, ban_seconds=BAN_SECONDS, max_request_seconds=request_seconds(spec)
        )
        transport = Transport(await dht.replicate_p2p(), config, links, identity=dht.identity)
        transport.accept_relayed_from(relays_of(dht.circuit_addrs))
        return cls(spec, dht, transport, precision, links, metrics, dump_dir)
