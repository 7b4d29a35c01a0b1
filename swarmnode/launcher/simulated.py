"""What the SkipPipe simulator predicts for a local swarm's iterations on its emulated links.

The plan is the live one: the data nodes' own planner (`node.planning.plan_iteration`, CheckFree+ swaps
included) run for each data node of the swarm, with the nodes' peer ids and the throughput they measured
(their metrics' tokens per busy second, as their records announce it). The plan is then timed by
`protocols.skippipe.simulate` with the costs the emulation imposes: each change of node costs the two
sites' `latency + activation bytes / bandwidth` (plus the planner's loopback cost per hop), and each node's
compute is its measured busy time per microbatch, split as the simulator splits it (forward, 1.5x forward
backward; at a data node also 0.25x for the head and loss).

Not modelled, so live iterations take longer: the optimizer step and the wait for the stages' steps between
iterations, acknowledgements, NoLoCo averaging and evaluations sharing the CPU, and the 2-core machine's
contention between nodes (the simulator gives each node a processor of its own).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from protocols.links import Network, loads_network
from protocols.messages import NodeRecord, NodeState
from protocols.skippipe import SwarmView, simulate
from swarmnode.launcher.config import SwarmConfig
from swarmnode.launcher.nodes import LaunchedNode
from swarmnode.presets import get_preset
from swarmnode.runspec import RunSpec

ITERATIONS_SIMULATED = 10  # iterations spread over the run, each planned with its own seed


@dataclass(frozen=True)
class SimNode:
    """A node of the swarm as the simulation sees it."""

    peer_id: str
    stage: int
    site: str | None  # None: no emulated network
    tokens_per_second: float  # per busy second of its compute thread (> 0)


def swarm_simulated_seconds(config: SwarmConfig, nodes: Sequence[LaunchedNode]) -> float | None:
    """`simulated_iteration_seconds` for the daemons of a local swarm (those online at its end), with the
    throughputs last read from their metrics; a node that never computed (it joined late) gets the median of
    the others'. None if no node's was read. Raises LocalProtocolError or OSError if the links file changed
    under the run and no longer reads."""
    alive = [node for node in nodes if node.stage is not None]
    measured = [node.tokens_per_second for node in alive if node.tokens_per_second is not None]
    if not measured:
        return None
    typical = statistics.median(measured)
    rates = [typical if node.tokens_per_second is None else node.tokens_per_second for node in alive]
    spec = RunSpec.for_preset(
        config.preset,
        run_id=config.run_id,
        stages=config.stages,
        total_steps=config.steps,
        seed=config.seed,
        checkfree_plus=config.checkfree_plus,
        edge_copies=config.edge_copies,
        edge_swaps=config.edge_swaps,
        dtype=config.dtype,
        skip_ratio=config.skip_ratio,
        planner=config.planner,
    )
    network = None if config.network is None else loads_network(config.network.read_bytes())
    sim_nodes = [
        SimNode(node.peer_id or node.process.name, node.stage or 0, node.site, rate)
        for node, rate in zip(alive, rates, strict=True)
    ]
    return simulated_iteration_seconds(spec, network, sim_nodes)


def simulated_iteration_seconds(
    spec: RunSpec, network: Network | None, nodes: Sequence[SimNode]
) -> float | None:
    """The median simulated iteration time over `ITERATIONS_SIMULATED` iterations of the run (on loopback
    without a `network`), or None when the swarm has no data node or a stage without a node."""
    from swarmnode.node.planning import LOOPBACK_LINK_S, SwarmRead, plan_iteration
    from swarmnode.peer_record import PeerRecord

    stages = [[i for i, node in enumerate(nodes) if node.stage == k] for k in range(spec.stages + 1)]
    if not all(stages):
        return None
    records = []
    for node in nodes:
        record = NodeRecord(NodeState.ONLINE, node.stage, 0, 0, throughput=node.tokens_per_second)
        records.append(PeerRecord(node.peer_id, record, 0.0))
    read = SwarmRead({k: [records[i] for i in members] for k, members in enumerate(stages)})
    tokens = spec.batch_size * spec.seq_len
    element_bytes = 2 if spec.compression == "float16" or spec.dtype != "float32" else 4
    activation = tokens * get_preset(spec.preset).model.dim * element_bytes

    def link_s(a: int, b: int) -> float:
        site_a, site_b = nodes[a].site, nodes[b].site
        if network is None or site_a is None or site_b is None:
            return LOOPBACK_LINK_S
        return LOOPBACK_LINK_S + network.link(site_a, site_b).transfer_s(activation)

    view = SwarmView.build(stages, [_forward_s(node, tokens) for node in nodes], link_s)
    index = {node.peer_id: i for i, node in enumerate(nodes)}
    step = max(1, spec.total_steps // ITERATIONS_SIMULATED)
    times = []
    for iteration in range(0, spec.total_steps, step):
        paths = {}
        for data_node in stages[0]:
            for planned in plan_iteration(read, nodes[data_node].peer_id, spec, iteration, tokens):
                paths[len(paths)] = [index[peer] for peer in planned.path]
        times.append(simulate(paths, view, spec.node_memory).iteration_time_s)
    return statistics.median(times)


def _forward_s(node: SimNode, tokens: int) -> float:
    """The forward time that makes the simulator's work per microbatch equal the node's measured busy time."""
    work = 1.0 + SwarmView.backward_factor + (SwarmView.head_factor if node.stage == 0 else 0.0)
    return tokens / node.tokens_per_second / work
