"""The live planners: SkipPipe's scheduler and the paper's random-skip baseline (`RunSpec.planner`)."""

from __future__ import annotations

from collections import Counter

import pytest

from protocols.hops import MAX_COHORT
from protocols.messages import NodeRecord, NodeState
from swarmnode.node.planning import PlannedMicrobatch, SwarmRead, plan_iteration
from swarmnode.peer_record import PeerRecord
from swarmnode.runspec import RunSpec, RunSpecError

STAGES = 6


def six_stages(replicas: int = 1) -> SwarmRead:
    """Two data nodes and six transformer stages of `replicas` nodes each, all online."""
    stages = {0: ["d1", "d2"]} | {k: [f"s{k}r{r}" for r in range(replicas)] for k in range(1, STAGES + 1)}
    return SwarmRead(
        {
            k: [PeerRecord(peer, NodeRecord(NodeState.ONLINE, k, 0, 0), 0.0) for peer in peers]
            for k, peers in stages.items()
        }
    )


def whole_plan(read: SwarmRead, spec: RunSpec, iteration: int) -> list[PlannedMicrobatch]:
    return [mb for data in read.online(0) for mb in plan_iteration(read, data, spec, iteration, 1024)]


def test_random_skips_visit_a_balanced_random_share_of_the_stages_in_order() -> None:
    spec = RunSpec(
        stages=STAGES, microbatches=6, skip_ratio=0.34, planner="random_skips", checkfree_plus=False
    )
    read = six_stages()
    orders = set()
    for iteration in range(4):
        planned = whole_plan(read, spec, iteration)
        assert len(planned) == 2 * 6
        visits: Counter[int] = Counter()
        for mb in planned:
            hops = mb.stages[1:-1]
            assert len(hops) == 4 and list(hops) == sorted(hops)  # 2 of 6 skipped, never reordered
            visits.update(hops)
            orders.add(hops)
        assert max(visits.values()) - min(visits.values()) <= 1  # every stage visited alike
        assert planned == whole_plan(read, spec, iteration)  # the same inputs, the same plan
    assert len(orders) > 3  # the stage sets are drawn, not fixed


def test_random_skips_deal_every_replica_its_share() -> None:
    # the baseline's paths keep each data node's pipeline, then the replicas are dealt out as for every plan
    # (`mix_replicas`: NoLoCo needs every data node's data on every replica)
    spec = RunSpec(
        stages=STAGES, microbatches=4, skip_ratio=0.34, planner="random_skips", checkfree_plus=False
    )
    planned = whole_plan(six_stages(replicas=2), spec, iteration=5)
    served = Counter(peer for mb in planned for peer in mb.path[1:-1])
    assert len(planned) == 2 * 4 * 2  # two pipelines per data node
    assert set(served) == {f"s{k}r{r}" for k in range(1, STAGES + 1) for r in range(2)}


def test_checkfree_plus_swaps_apply_to_random_skips_too() -> None:
    spec = RunSpec(stages=STAGES, microbatches=6, skip_ratio=0.34, planner="random_skips", edge_swaps=True)
    planned = whole_plan(six_stages(), spec, iteration=0)
    assert any(list(mb.stages[1:-1]) != sorted(mb.stages[1:-1]) for mb in planned)
    assert all(len(mb.stages) == 6 for mb in planned)


def test_the_planners_differ_and_skippipe_is_the_default() -> None:
    base = RunSpec(stages=STAGES, microbatches=6, skip_ratio=0.34, checkfree_plus=False)
    assert base.planner == "skippipe"
    read = six_stages(replicas=2)
    random_skips = RunSpec.from_dict({**base.to_dict(), "planner": "random_skips"})
    assert any(whole_plan(read, base, i) != whole_plan(read, random_skips, i) for i in range(3))


def test_a_planner_that_skips_needs_a_skip_ratio() -> None:
    with pytest.raises(RunSpecError, match="planner 'random_skips' picks the stages to skip"):
        RunSpec(stages=STAGES, planner="random_skips")
    with pytest.raises(RunSpecError, match="run field 'planner': expected one of random_skips, skippipe"):
        RunSpec.from_dict({**RunSpec().to_dict(), "planner": "greedy"})


def test_each_hop_names_the_data_nodes_whose_work_the_plan_sends_through_it() -> None:
    # a stage node steps once the work of every data node the plan sends through it has come, so it waits
    # for no data node whose paths skip it in this tick (`StepBook.take`), and for every one they visit
    for planner, replicas in (("skippipe", 1), ("random_skips", 1), ("skippipe", 2)):
        spec = RunSpec(stages=STAGES, microbatches=2, skip_ratio=0.34, planner=planner)
        read = six_stages(replicas)
        for iteration in range(5):
            planned = {data: plan_iteration(read, data, spec, iteration, 1024) for data in read.online(0)}
            visitors: dict[str, set[str]] = {}
            for data, mbs in planned.items():
                for mb in mbs:
                    for peer in mb.path[1:-1]:
                        visitors.setdefault(peer, set()).add(data)
            for mbs in planned.values():
                for mb in mbs:
                    assert mb.cohort == ("d1", "d2") and mb.senders[0] == mb.senders[-1] == 0
                    for peer, mask in zip(mb.path[1:-1], mb.senders[1:-1], strict=True):
                        assert {mb.cohort[j] for j in range(2) if mask >> j & 1} == visitors[peer]


def test_a_plan_of_more_data_nodes_than_a_forward_can_name_names_nobody() -> None:
    stages = {0: [f"d{i:02d}" for i in range(MAX_COHORT + 1)], 1: ["a"], 2: ["b"], 3: ["c"]}
    read = SwarmRead(
        {
            k: [PeerRecord(p, NodeRecord(NodeState.ONLINE, k, 0, 0), 0.0) for p in peers]
            for k, peers in stages.items()
        }
    )
    [planned] = plan_iteration(read, "d00", RunSpec(microbatches=1, checkfree_plus=False), 0, 1024)
    assert planned.cohort == planned.senders == ()  # the stage nodes fall back to the tick before


def test_reads_a_moment_apart_plan_alike() -> None:
    # two data nodes read the records a second apart: the throughputs they see differ by a few percent,
    # and so did their plans (a stage node then waited for a data node only the other's plan sent there)
    spec = RunSpec(stages=STAGES, microbatches=2, skip_ratio=0.34, checkfree_plus=False)

    def read(jitter: float) -> SwarmRead:
        stages = {0: ["d1", "d2"]} | {k: [f"s{k}r{r}" for r in range(2)] for k in range(1, STAGES + 1)}
        return SwarmRead(
            {
                k: [
                    PeerRecord(
                        p,
                        NodeRecord(NodeState.ONLINE, k, 0, 0, throughput=1024 * 1.1 ** (20 + i) * jitter),
                        0.0,
                    )
                    for i, p in enumerate(peers)
                ]
                for k, peers in stages.items()
            }
        )

    for iteration in range(4):
        assert plan_iteration(read(0.97), "d1", spec, iteration, 1024) == plan_iteration(
            read(1.03), "d1", spec, iteration, 1024
        )
