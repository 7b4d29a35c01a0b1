"""Measured link costs reach the planner: a replica whose links are slow gets fewer microbatches."""

from __future__ import annotations

from protocols.links import LinkCost
from protocols.messages import NodeRecord, NodeState
from swarmnode.node.planning import LOOPBACK_LINK_S, SwarmRead, link_costs, plan_iteration, quantised
from swarmnode.records import PeerRecord
from swarmnode.runspec import RunSpec

SPEC = RunSpec.for_preset("tiny", stages=3, microbatches=4, total_steps=100)
TOKENS = SPEC.batch_size * SPEC.seq_len


def record(peer: str, stage: int, links: dict[str, float] | None = None) -> PeerRecord:
    costs = tuple(LinkCost(other, seconds) for other, seconds in (links or {}).items())
    return PeerRecord(
        peer, NodeRecord(NodeState.ONLINE, stage, 0, 0, throughput=TOKENS / 0.05, links=costs), 0.0
    )


def swarm(far_s: float) -> SwarmRead:
    """Data nodes d1, d2; stage 1 has a near and a far replica; the far one's links cost `far_s` each way
    (measured by the far node itself, and by d1 towards it)."""
    far_links = {"d1": far_s, "d2": far_s, "s2": far_s}
    return SwarmRead(
        {
            0: [record("d1", 0, {"s1far": far_s}), record("d2", 0)],
            1: [record("s1near", 1), record("s1far", 1, far_links)],
            2: [record("s2", 2)],
            3: [record("s3", 3)],
        }
    )


def visits(snapshot: SwarmRead, peer: str) -> int:
    return sum(
        planned.path.count(peer)
        for iteration in range(10)
        for me in ("d1", "d2")
        for planned in plan_iteration(snapshot, me, SPEC, iteration, TOKENS)
    )


def test_costs_come_from_either_end_of_a_link() -> None:
    peers = ["d1", "d2", "s1near", "s1far", "s2"]
    cost = link_costs(swarm(0.5), peers)
    assert cost(0, 3) == cost(3, 0) == quantised(0.5)  # d1 measured it, and s1far too
    assert cost(1, 3) == cost(3, 1) == quantised(0.5)  # d2 did not: s1far's measure stands for both ways
    assert cost(0, 2) == LOOPBACK_LINK_S  # nobody measured it
    fast = link_costs(swarm(0.0), peers)  # a link timed at 0 s (coarse clock) costs what loopback does
    assert fast(0, 3) == fast(3, 0) == LOOPBACK_LINK_S


def test_a_far_replica_gets_fewer_microbatches() -> None:
    # measured: of 80 microbatches through stage 1, the far replica took 41 at 2 ms, 20 at 50 ms, 10 at
    # 200 ms and 1 at 500 ms
    near, far = visits(swarm(0.5), "s1near"), visits(swarm(0.5), "s1far")
    even = visits(swarm(LOOPBACK_LINK_S), "s1far")
    assert near + far == 2 * 10 * SPEC.microbatches  # every microbatch visits stage 1 (no skips)
    assert far < even and far < near, (near, far, even)
