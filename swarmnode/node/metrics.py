"""A daemon's Prometheus metrics (`--metrics-port`): what it does, for its volunteer and their dashboards.

Three sources, one registry:
- the node's state, read at each scrape (`NodeGauges`): stage, step, outer step, tokens, tokens per busy
  second, compute queue depth, microbatches served and lost, outbound streams opened by path;
- the daemon's events (`node.events.emit`), counted as they happen (`on_event`): steps' loss, validation
  loss, NoLoCo rounds paired or alone, recoveries by method;
- the daemon's request guard and router, as they act: rejections and bans by reason (`rejected`), hop
  latency and bytes by direction and peer stage (`observe_hop`).

Every family is prefixed `swarmnode_`; docs/monitoring.md lists them with a sample scrape config.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from swarmnode import __version__
from swarmnode.node.averaging import OuterLoop
from swarmnode.node.compute import ComputeQueue
from swarmnode.optim import StageOptimizer
from swarmnode.transport import Transport

HOP_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
HOP_BYTES = tuple(float(2**k) for k in range(10, 31, 2))  # 1 KiB .. 1 GiB


class Observed(Protocol):
    """What the scrape reads of a node (`node.daemon.Node`)."""

    stage: int
    tokens_processed: int
    microbatches_lost: int
    microbatches_served: int
    optimizer: StageOptimizer
    compute: ComputeQueue
    outer: OuterLoop
    transport: Transport


class NodeGauges(Collector):
    """The node's state at scrape time (nothing while no node runs: between a move's two stages)."""

    def __init__(self) -> None:
        self.node: Observed | None = None

    def collect(self) -> Iterator[Metric]:
        node = self.node
        if node is None:
            return
        step, busy = node.optimizer.step_count, node.compute.busy_seconds
        outer_step, depth = node.outer.outer_step, node.compute.depth
        yield _gauge("swarmnode_stage", "The stage this node serves (0: data).", node.stage)
        yield _gauge("swarmnode_step", "Optimizer steps on the swarm clock.", step)
        yield _gauge("swarmnode_outer_step", "NoLoCo outer steps taken.", outer_step)
        yield _gauge("swarmnode_queue_depth", "Jobs waiting for the compute thread.", depth)
        rate = node.tokens_processed / busy if busy > 0 else 0.0
        yield _gauge("swarmnode_tokens_per_second", "Tokens per busy second of the compute thread.", rate)
        yield _counter(
            "swarmnode_tokens",
            "Tokens this node has trained on (validation passes left out).",
            node.tokens_processed,
        )
        served = "Microbatches whose backward pass this node completed."
        yield _counter("swarmnode_microbatches_served", served, node.microbatches_served)
        yield _counter(
            "swarmnode_microbatches_lost", "Microbatches this node dropped.", node.microbatches_lost
        )
        streams = CounterMetricFamily(
            "swarmnode_streams_opened",
            "Outbound streams this node opened to peers, by path: encrypted (direct TCP, sealed), direct "
            "(direct TCP in plaintext: loopback only), libp2p, relayed (libp2p through a relay).",
            labels=["path"],
        )
        for path in ("encrypted", "direct", "libp2p", "relayed"):
            streams.add_metric([path], node.transport.stats.streams_opened[path])
        yield streams


class DaemonMetrics:
    """The registry of one daemon process, served over HTTP by `serve`."""

    def __init__(self, role: str) -> None:
        self.registry = CollectorRegistry()
        self.gauges = NodeGauges()
        self.registry.register(self.gauges)
        info = Gauge(
            "swarmnode_info", "This daemon: version and role.", ["version", "role"], registry=self.registry
        )
        info.labels(__version__, role).set(1)
        self.loss = Gauge(
            "swarmnode_loss", "Training loss of the last step (data nodes).", registry=self.registry
        )
        self.val_loss = Gauge(
            "swarmnode_val_loss", "Last validation loss (data nodes).", registry=self.registry
        )
        self.rounds = Counter(
            "swarmnode_noloco_rounds", "NoLoCo outer steps by result.", ["result"], registry=self.registry
        )
        self.recoveries = Counter(
            "swarmnode_recoveries",
            "Recoveries of this node's stage by method.",
            ["method"],
            registry=self.registry,
        )
        self.rejections = Counter(
            "swarmnode_rejections", "Peer requests refused, by reason.", ["reason"], registry=self.registry
        )
        self.bans = Counter("swarmnode_bans", "Peers banned, by reason.", ["reason"], registry=self.registry)
        self.hop_seconds = Histogram(
            "swarmnode_hop_seconds",
            "Seconds a hop took to be accepted by the next node, by direction and that node's stage.",
            ["direction", "peer_stage"],
            buckets=HOP_SECONDS,
            registry=self.registry,
        )
        self.hop_bytes = Histogram(
            "swarmnode_hop_bytes",
            "Tensor bytes a hop carried, by direction and the receiving node's stage.",
            ["direction", "peer_stage"],
            buckets=HOP_BYTES,
            registry=self.registry,
        )

    def serve(self, host: str, port: int) -> int:
        """Serve `/metrics` on `host:port` (0: any free port) from a daemon thread; the port bound."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return int(server.server_port)

    def attach(self, node: Observed | None) -> None:
        self.gauges.node = node

    def observe_hop(self, direction: str, peer_stage: int, seconds: float, size: int) -> None:
        self.hop_seconds.labels(direction, str(peer_stage)).observe(seconds)
        self.hop_bytes.labels(direction, str(peer_stage)).observe(size)

    def on_event(self, event: str, fields: dict[str, Any]) -> None:
        """Count what a daemon event says (`node.events.emit` calls this for every event)."""
        if event == "step" and isinstance(fields.get("loss"), int | float):
            self.loss.set(fields["loss"])
        elif event == "validation" and isinstance(fields.get("val_loss"), int | float):
            self.val_loss.set(fields["val_loss"])
        elif event == "outer_step":
            result = (
                "paired" if fields.get("paired") else "alone" if not fields.get("matched") else "unmatched"
            )
            self.rounds.labels(result).inc()
        elif event == "recovered":
            self.recoveries.labels(str(fields.get("method"))).inc()
        elif event == "rejected" and fields.get("code") == "out_of_bounds":  # averaging tensors declined
            self.rejected("out_of_bounds", banned=False)

    def rejected(self, reason: str, banned: bool) -> None:
        """A peer's request refused (`reason`: its error code), and whether its sender was banned."""
        self.rejections.labels(reason).inc()
        if banned:
            self.bans.labels(reason).inc()


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)
