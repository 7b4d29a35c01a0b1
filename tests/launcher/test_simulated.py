"""The report's per-node figures read from a daemon's real metrics page, and the simulator's prediction of a
swarm's iteration on its emulated links."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from protocols.links import parse_network
from swarmnode.launcher.nodes import RATE_METRIC, SERVED_METRIC
from swarmnode.launcher.scrape import parse_metrics
from swarmnode.launcher.simulated import SimNode, simulated_iteration_seconds
from swarmnode.node.metrics import DaemonMetrics
from swarmnode.presets import get_preset
from swarmnode.runspec import RunSpec
from swarmnode.transport import TransportStats


def test_the_served_count_and_the_throughput_are_read_from_the_metrics_page() -> None:
    metrics = DaemonMetrics("node")
    compute = SimpleNamespace(busy_seconds=2.0, depth=0)
    node = SimpleNamespace(
        stage=2,
        tokens_processed=4096,
        microbatches_lost=1,
        microbatches_served=37,
        optimizer=SimpleNamespace(step_count=5),
        compute=compute,
        outer=SimpleNamespace(outer_step=1),
        transport=SimpleNamespace(stats=TransportStats()),
    )
    metrics.attach(node)
    samples = parse_metrics(generate_latest(metrics.registry).decode())
    assert samples[SERVED_METRIC] == 37 and samples[RATE_METRIC] == 2048.0
    assert samples["swarmnode_outer_step"] == 1
    assert parse_metrics('# HELP x\nx{a="1"} 3\ny nan\nz 4\nbad line here\n') == {"z": 4.0}


def swarm(sites: list[str]) -> list[SimNode]:
    """One data node and three stages of one replica each, at `sites` in that order, 4096 tokens/s each."""
    return [SimNode(f"12D3KooW{stage}", stage, site, 4096.0) for stage, site in enumerate(sites)]


def test_the_simulated_iteration_pays_for_the_links() -> None:
    network = parse_network(
        {
            "sites": ["A", "B"],
            "same_site": {"latency_ms": 0, "bandwidth_GBps": 1000},
            "links": [{"a": "A", "b": "B", "latency_ms": 100, "bandwidth_GBps": 0.001}],
        }
    )
    spec = RunSpec.for_preset("tiny", stages=3, total_steps=40)
    near = simulated_iteration_seconds(spec, network, swarm(["A"] * 4))
    loopback = simulated_iteration_seconds(spec, None, swarm(["A"] * 4))
    far = simulated_iteration_seconds(spec, network, swarm(["A", "B", "A", "B"]))
    assert near is not None and loopback is not None and far is not None
    assert near == pytest.approx(loopback, rel=1e-3)  # a free link costs what loopback does
    activation = spec.batch_size * spec.seq_len * get_preset("tiny").model.dim * 4
    hop = 0.1 + activation / (0.001 * 2**30)
    assert far >= 8 * hop and far > near  # every hop of a path crosses the link, forward and back


def test_a_stage_without_a_node_gives_no_prediction() -> None:
    spec = RunSpec.for_preset("tiny", stages=3, total_steps=40)
    assert simulated_iteration_seconds(spec, None, swarm(["A"] * 3)) is None
