"""The daemon's pure pieces: step bookkeeping, planning from DHT records, state loading,
record validation and the run definition."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest
import torch
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from protocols.messages import NodeRecord, NodeState, encode
from protocols.stepbook import MicrobatchKey
from protocols.transfers import StatePart
from swarmnode.identity import Identity
from swarmnode.model import build_stage
from swarmnode.model_config import ModelConfig
from swarmnode.node.planning import (
    DEFAULT_FORWARD_S,
    RememberedView,
    SwarmRead,
    lost_stages,
    not_ready_to_start,
    pipeline_width,
    plan_iteration,
    quantised,
    skip_ratio_of_live,
    stage_forward_seconds,
)
from swarmnode.node.state import (
    StateMismatch,
    check_replica_state,
    load_replica_state,
    load_weights,
    optimizer_state,
    weights,
)
from swarmnode.node.worker import StageWorker
from swarmnode.optim import Schedule, StageOptimizer
from swarmnode.records import PeerRecord, SwarmRecordValidator, peer_of_subkey, stage_key, subkey_of
from swarmnode.runspec import RunSpec, RunSpecError


def record(
    stage: int, state: NodeState = NodeState.ONLINE, step: int = 0, throughput: float = 0.0
) -> NodeRecord:
    return NodeRecord(state, stage, step, 0, throughput=throughput)


def peers(stage: int, *names: str, **kwargs: float) -> list[PeerRecord]:
    return [PeerRecord(name, record(stage, **kwargs), 1e12) for name in names]  # type: ignore[arg-type]


# ---- the schedule -------------------------------------------------------------------------------------


def test_the_schedule_follows_the_swarm_clock() -> None:
    module = torch.nn.Linear(2, 2)
    optimizer = StageOptimizer(module, Schedule(1.0, 10, 100))
    optimizer.advance(7)  # a replica that saw no microbatch: the clock moved on without it
    optimizer.advance(3)  # never back
    assert optimizer.step_count == 7 and optimizer.updates == 0
    module(torch.ones(1, 2)).sum().backward()
    optimizer.step(at=9)  # gradients of tick 9: the lr of tick 9, then the clock is past it
    assert optimizer.step_count == 10 and optimizer.updates == 1
    assert optimizer.adam.lr == pytest.approx(Schedule(1.0, 10, 100).lr_at(9))
    module(torch.ones(1, 2)).sum().backward()
    optimizer.step()  # the single process: one tick per step
    assert optimizer.step_count == 11 and optimizer.updates == 2


# ---- planning from records ------------------------------------------------------------------------------


def swarm_read(**stage_peers: tuple[str, ...]) -> SwarmRead:
    return SwarmRead({int(k[1:]): peers(int(k[1:]), *names) for k, names in stage_peers.items()})


def test_plan_visits_every_live_stage_and_returns_to_the_data_node() -> None:
    spec = RunSpec(run_id="r", stages=3, microbatches=4, checkfree_plus=False)
    view = swarm_read(s0=("d",), s1=("a",), s2=("b", "b2"), s3=("c",))
    planned = plan_iteration(view, "d", spec, iteration=0, tokens_per_microbatch=1024)
    assert len(planned) == 4
    for mb in planned:
        assert mb.path[0] == mb.path[-1] == "d"
        assert sorted(mb.stages[1:-1]) == [1, 2, 3]
        assert len(mb.visits) == len(mb.path)
    assert sum(mb.visits[mb.stages.index(1)] for mb in planned) == 4 * 4  # a's count is 4 on every message


def test_plan_skips_a_lost_stage() -> None:
    spec = RunSpec(run_id="r", stages=3, microbatches=2)
    view = swarm_read(s0=("d",), s1=("a",), s3=("c",))
    planned = plan_iteration(view, "d", spec, iteration=7, tokens_per_microbatch=1024)
    assert planned and all(2 not in mb.stages for mb in planned)


def test_skipping_goes_on_while_a_stage_is_lost() -> None:
    # the lost stage counts as one of the path's skips: paths keep the run's length (issue 12: the skip ratio
    # used to drop to 0 whenever a stage was missing, so every path visited all the live stages)
    spec = RunSpec(run_id="r", stages=6, microbatches=6, skip_ratio=0.34, checkfree_plus=False)
    full = swarm_read(s0=("d",), s1=("a",), s2=("b",), s3=("c",), s4=("e",), s5=("f",), s6=("g",))
    lost = swarm_read(s0=("d",), s1=("a",), s2=("b",), s4=("e",), s5=("f",), s6=("g",))
    for view in (full, lost):
        planned = plan_iteration(view, "d", spec, iteration=3, tokens_per_microbatch=1024)
        assert [len(mb.stages) - 2 for mb in planned] == [4] * 6
    assert not any(3 in mb.stages for mb in planned)  # the last view: stage 3 lost
    few = swarm_read(s0=("d",), s1=("a",), s2=("b",), s3=("c",))  # fewer live stages than a path visits
    planned = plan_iteration(few, "d", spec, iteration=3, tokens_per_microbatch=1024)
    assert [sorted(mb.stages[1:-1]) for mb in planned] == [[1, 2, 3]] * 6


def test_data_nodes_take_their_shares_of_one_plan() -> None:
    # every data node plans the same iteration from the same inputs (the swarm clock, the run's seed) and
    # takes its own microbatches: together they are one schedule, in which each replica serves a full batch
    # (the run's 2 microbatches) of each data node (apart, two data nodes would often send all their
    # microbatches through one replica)
    spec = RunSpec(run_id="r", stages=3, microbatches=2, checkfree_plus=False)
    view = swarm_read(s0=("d1", "d2"), s1=("a1", "a2"), s2=("b1", "b2"), s3=("c1", "c2"))
    for iteration in range(6):
        served: dict[str, list[str]] = {}
        for data in ("d1", "d2"):
            planned = plan_iteration(view, data, spec, iteration, tokens_per_microbatch=1024)
            assert [mb.microbatch for mb in planned] == [0, 1, 2, 3]  # 2 per pipeline, 2 pipelines
            for mb in planned:
                for peer in mb.path[1:-1]:
                    served.setdefault(peer, []).append(data)
        assert {peer: sorted(datas) for peer, datas in served.items()} == {
            peer: ["d1", "d1", "d2", "d2"] for peer in ("a1", "a2", "b1", "b2", "c1", "c2")
        }


def test_the_narrowest_stage_sets_how_many_pipelines_a_data_node_feeds() -> None:
    # each replica trains on a batch of its own (NoLoCo's replicas): with two replicas in every stage a data
    # node sends two batches an iteration; one stage with a lone node makes it one pipeline again, so that
    # node is never sent more than the run's microbatches by one data node
    spec = RunSpec(run_id="r", stages=3, microbatches=2, checkfree_plus=False)
    wide = swarm_read(s0=("d",), s1=("a1", "a2", "a3"), s2=("b1", "b2"), s3=("c1", "c2", "c3"))
    narrow = swarm_read(s0=("d",), s1=("a1", "a2"), s2=("b1",), s3=("c1", "c2"))
    assert pipeline_width(wide, (1, 2, 3), most=4) == 2 and pipeline_width(narrow, (1, 2, 3), most=4) == 1
    assert pipeline_width(wide, (), most=4) == 1
    assert pipeline_width(wide, (1, 3), most=2) == 2  # the run's max_pipelines bounds a data node's work
    capped = RunSpec(run_id="r", stages=3, microbatches=2, checkfree_plus=False, max_pipelines=1)
    assert len(plan_iteration(wide, "d", capped, iteration=0, tokens_per_microbatch=1024)) == 2
    assert len(plan_iteration(wide, "d", spec, iteration=0, tokens_per_microbatch=1024)) == 4
    planned = plan_iteration(narrow, "d", spec, iteration=0, tokens_per_microbatch=1024)
    assert len(planned) == 2 and {mb.path[2] for mb in planned} == {"b1"}


def test_a_replica_not_yet_measured_costs_what_its_measured_partners_do() -> None:
    # costed apart (a default), a replica just measured and its unmeasured partner were dealt uneven shares
    # in the first ticks, by which announced its throughput first: two runs of one seed then differed
    slow, fast = (PeerRecord(n, record(1, throughput=rate), 0.0) for n, rate in (("a", 1e3), ("c", 4e3)))
    fresh = PeerRecord("b", record(1), 0.0)
    slow_s, fresh_s, fast_s = stage_forward_seconds([slow, fresh, fast], tokens=100)
    assert (slow_s, fast_s) == (quantised(0.1), quantised(0.025)) and fresh_s == pytest.approx(
        (slow_s + fast_s) / 2
    )
    assert stage_forward_seconds([fresh, None], tokens=100) == [DEFAULT_FORWARD_S] * 2


def test_the_skip_ratio_over_the_live_stages_keeps_the_path_length() -> None:
    assert skip_ratio_of_live(0.0, 3, 2) == 0.0
    assert skip_ratio_of_live(0.34, 6, 6) == pytest.approx(2 / 6)
    assert skip_ratio_of_live(0.34, 6, 5) == pytest.approx(1 / 5)
    assert skip_ratio_of_live(0.34, 6, 4) == 0.0
    assert skip_ratio_of_live(0.5, 16, 12) == pytest.approx(4 / 12)
    with pytest.raises(ValueError, match="live stages"):
        skip_ratio_of_live(0.34, 6, 7)


def test_a_stage_missing_from_one_read_is_not_skipped() -> None:
    # on a loaded machine a live stage's records can vanish from one read; a plan from that read alone
    # routed every microbatch past the stage in a run whose skip ratio is 0
    spec = RunSpec(run_id="r", stages=3, microbatches=2)
    remembered = RememberedView(grace_s=8.0)
    remembered.update(swarm_read(s0=("d",), s1=("a",), s2=("b",), s3=("c",)), now=0.0)
    view = remembered.update(swarm_read(s0=("d",), s1=("a",), s3=("c",)), now=1.0)
    planned = plan_iteration(view, "d", spec, iteration=7, tokens_per_microbatch=1024)
    assert [mb.stages for mb in planned] == [(0, 1, 2, 3, 0)] * 2
    assert view.online(2) == ["b"]
    stale = remembered.update(swarm_read(s0=("d",), s1=("a",), s3=("c",)), now=9.0)  # gone past the grace
    assert stale.online(2) == []


def test_a_suspect_missing_from_the_latest_read_is_dropped_and_one_still_in_it_is_kept() -> None:
    remembered = RememberedView(grace_s=8.0)
    remembered.update(swarm_read(s0=("d",), s2=("b", "b2")), now=0.0)
    read = swarm_read(s0=("d",), s2=("b2",))  # b SIGKILLed: its record expired, forwards failed
    assert remembered.update(read, now=1.0, suspects={"b", "b2"}).online(2) == ["b2"]
    assert remembered.update(read, now=2.0).online(2) == ["b2"]  # forgotten, not merely suspected


def test_every_read_observed_counts_not_only_those_a_plan_looked_at() -> None:
    # a data node reads the DHT every second and plans every few: a replica in the reads between two plans
    # and missing from the one the plan saw was left out of the swarm's first step
    remembered = RememberedView(grace_s=8.0)
    remembered.observe(swarm_read(s0=("d",), s2=("b", "b2")), now=0.0)  # the start check's read
    remembered.observe(swarm_read(s0=("d",), s2=("b",)), now=4.0)
    assert remembered.update(swarm_read(s0=("d",), s2=("b",)), now=5.0).online(2) == ["b", "b2"]


def test_a_read_seen_before_renews_nothing() -> None:
    remembered = RememberedView(grace_s=8.0)
    read = swarm_read(s0=("d",), s2=("b",))
    remembered.update(read, now=0.0)
    remembered.update(read, now=20.0)  # no newer read for 20 s: b was last seen at 0
    assert remembered.update(swarm_read(s0=("d",)), now=21.0).online(2) == []


def test_a_fresh_swarm_starts_with_every_stage_and_its_data_nodes() -> None:
    spec = RunSpec(run_id="r", stages=2, min_data_nodes=3)
    assert not_ready_to_start(swarm_read(s0=("d",), s1=("a",)), "d", spec) == ["stage 2", "2 more data nodes"]
    stages = {"s1": ("a",), "s2": ("b",)}
    assert not_ready_to_start(swarm_read(s0=("d", "e"), **stages), "d", spec) == ["1 more data node"]
    assert not_ready_to_start(swarm_read(s0=("e", "f"), **stages), "d", spec) == []  # d counts itself
    with pytest.raises(RunSpecError, match="min_data_nodes"):
        RunSpec(run_id="r", min_data_nodes=0)


def test_a_fresh_swarm_starts_with_the_replicas_it_asks_for() -> None:
    spec = RunSpec(run_id="r", stages=3, min_replicas=2)
    read = swarm_read(s0=("d",), s1=("a", "a2"), s2=("b",))
    assert not_ready_to_start(read, "d", spec) == ["1 more of stage 2", "stage 3"]
    full = swarm_read(s0=("d",), s1=("a", "a2"), s2=("b", "b2"), s3=("c", "c2", "c3"))
    assert not_ready_to_start(full, "d", spec) == []
    with pytest.raises(RunSpecError, match="min_replicas"):
        RunSpec(run_id="r", min_replicas=0)


def test_a_run_that_skips_nothing_waits_for_a_lost_stage() -> None:
    view = swarm_read(s0=("d",), s1=("a",), s3=("c",))
    assert lost_stages(view, RunSpec(run_id="r", stages=3)) == [2]
    assert lost_stages(view, RunSpec(run_id="r", stages=3, skip_ratio=0.25)) == []  # its paths skip it


def test_plan_is_empty_without_any_transformer_stage() -> None:
    spec = RunSpec(run_id="r", stages=3)
    assert plan_iteration(swarm_read(s0=("d",)), "d", spec, iteration=0, tokens_per_microbatch=1) == []


def test_checkfree_plus_swaps_both_edge_pairs_of_every_other_microbatch() -> None:
    spec = RunSpec(run_id="r", stages=6, microbatches=8, checkfree_plus=True, edge_swaps=True, preset="tiny")
    view = swarm_read(s0=("d",), **{f"s{k}": (f"n{k}",) for k in range(1, 7)})
    for iteration in (1, 2):
        planned = plan_iteration(view, "d", spec, iteration=iteration, tokens_per_microbatch=1024)
        swapped = [mb.microbatch for mb in planned if mb.stages[1:-1] == (2, 1, 3, 4, 6, 5)]
        plain = [mb.microbatch for mb in planned if mb.stages[1:-1] == (1, 2, 3, 4, 5, 6)]
        assert swapped == [m for m in range(8) if (iteration + m) % 2 == 1]
        assert sorted(swapped + plain) == list(range(8))
        for mb in planned:  # the nodes, not their order, decide the visit counts
            assert dict(zip(mb.path, mb.visits, strict=True))["n1"] == 8


def test_a_run_without_edge_swaps_keeps_every_path_in_order() -> None:
    spec = RunSpec(run_id="r", stages=6, microbatches=8, checkfree_plus=True, edge_swaps=False, preset="tiny")
    view = swarm_read(s0=("d",), **{f"s{k}": (f"n{k}",) for k in range(1, 7)})
    for iteration in (1, 2):
        planned = plan_iteration(view, "d", spec, iteration=iteration, tokens_per_microbatch=1024)
        assert len(planned) == 8 and all(mb.stages[1:-1] == (1, 2, 3, 4, 5, 6) for mb in planned)


def test_checkfree_plus_swaps_every_data_node_evenly() -> None:
    # two data nodes with one microbatch each: each swaps every other iteration, never both at once
    spec = RunSpec(run_id="r", stages=6, microbatches=1, checkfree_plus=True, edge_swaps=True, preset="tiny")
    view = swarm_read(s0=("d1", "d2"), **{f"s{k}": (f"n{k}",) for k in range(1, 7)})
    for node in ("d1", "d2"):
        orders = [
            plan_iteration(view, node, spec, iteration=t, tokens_per_microbatch=1024)[0].stages[1:-1]
            for t in range(4)
        ]
        assert orders.count((2, 1, 3, 4, 6, 5)) == 2 and orders.count((1, 2, 3, 4, 5, 6)) == 2


@pytest.mark.parametrize("stages", [4, 6])
@pytest.mark.parametrize("data_nodes", [1, 2, 3])
@pytest.mark.parametrize("microbatches", [1, 2, 3])
@pytest.mark.parametrize("replicas", [1, 2])
def test_both_edge_pairs_swap_half_of_every_data_nodes_microbatches_in_every_configuration(
    stages: int, data_nodes: int, microbatches: int, replicas: int
) -> None:
    """Over any two iterations, exactly half of each data node's microbatches run with both edge pairs
    swapped, whatever the numbers of data nodes, microbatches and replicas (a model of 4 or more stages)."""
    preset = "llama-124m"  # 12 layers: 4 or 6 stages
    spec = RunSpec(
        run_id="r",
        stages=stages,
        microbatches=microbatches,
        checkfree_plus=True,
        edge_swaps=True,
        preset=preset,
    )
    drivers = tuple(f"d{i}" for i in range(data_nodes))
    nodes = {f"s{k}": tuple(f"n{k}r{r}" for r in range(replicas)) for k in range(1, stages + 1)}
    view = swarm_read(s0=drivers, **nodes)
    plain = tuple(range(1, stages + 1))
    swapped = (2, 1, *range(3, stages - 1), stages, stages - 1)
    for node in drivers:
        for first in range(3):
            orders = [
                mb.stages[1:-1]
                for t in (first, first + 1)
                for mb in plan_iteration(view, node, spec, iteration=t, tokens_per_microbatch=1024)
            ]
            assert len(orders) == 2 * microbatches * replicas  # a batch per replica (`pipeline_width`)
            assert orders.count(swapped) == orders.count(plain) == len(orders) // 2, (node, first, orders)


def test_a_three_stage_model_never_swaps() -> None:
    spec = RunSpec(run_id="r", stages=3, microbatches=4, checkfree_plus=True)
    view = swarm_read(s0=("d",), s1=("a",), s2=("b",), s3=("c",))
    for iteration in range(3):
        planned = plan_iteration(view, "d", spec, iteration=iteration, tokens_per_microbatch=1024)
        assert all(mb.stages == (0, 1, 2, 3, 0) for mb in planned)


# ---- state transfer --------------------------------------------------------------------------------------


def tiny_stage() -> tuple[torch.nn.Module, StageOptimizer]:
    config = ModelConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, ffn_hidden=32, max_seq_len=8)
    module = build_stage(config, 1, 1, seed=3)
    return module, StageOptimizer(module, Schedule(1e-3, 1, 10))


def test_a_stage_keeps_one_gradient_buffer_and_one_update_per_group() -> None:
    """Backward passes of two groups interleaved: each group's update is what its microbatches alone give."""
    config = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_hidden=64, max_seq_len=8)

    def stage() -> tuple[torch.nn.Module, StageWorker]:
        torch.manual_seed(0)
        module = build_stage(config, 1, 1)
        return module, StageWorker(module, StageOptimizer(module, Schedule(1e-2, 0, 100), 1.0))

    torch.manual_seed(1)
    inputs = {k: torch.randn(2, 8, 32) for k in range(4)}
    grads = {k: torch.randn(2, 8, 32) for k in range(4)}
    groups = {0: ("a", 5), 1: ("b", 5), 2: ("a", 5), 3: ("b", 5)}
    module, worker = stage()
    for k in range(4):
        worker.forward(MicrobatchKey(groups[k][0], 5, k), inputs[k], 0.0)
    for k in (0, 1, 3, 2):
        worker.backward(MicrobatchKey(groups[k][0], 5, k), grads[k])
    assert worker.gradient_groups == 2 and all(p.grad is None for p in module.parameters())
    worker.step_group(("a", 5))
    alone, alone_worker = stage()  # group a's microbatches only
    for k in (0, 2):
        alone_worker.forward(MicrobatchKey("a", 5, k), inputs[k], 0.0)
        alone_worker.backward(MicrobatchKey("a", 5, k), grads[k])
    alone_worker.step_group(("a", 5))
    for mine, reference in zip(module.parameters(), alone.parameters(), strict=True):
        assert torch.equal(mine, reference)
    assert worker.optimizer.updates == 1 and worker.gradient_groups == 1
    assert worker.step_group(("c", 5)) is None  # no gradients: no update
    assert worker.discard_gradients_except({("a", 5)}) == 1 and worker.gradient_groups == 0


def test_a_groups_update_does_not_depend_on_the_order_of_its_backward_passes() -> None:
    """Four microbatches of one group, their backward passes in two orders: the same weights to the bit."""
    config = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_hidden=64, max_seq_len=8)
    torch.manual_seed(1)
    inputs = {k: torch.randn(2, 8, 32) for k in range(4)}
    grads = {k: torch.randn(2, 8, 32) * 10.0**k for k in range(4)}
    trained = []
    for order in ((0, 1, 2, 3), (3, 1, 0, 2)):
        torch.manual_seed(0)
        module = build_stage(config, 1, 1)
        worker = StageWorker(module, StageOptimizer(module, Schedule(1e-2, 0, 100), 1e9))
        for k in range(4):
            worker.forward(MicrobatchKey("a", 5, k), inputs[k], 0.0)
        for k in order:
            worker.backward(MicrobatchKey("a", 5, k), grads[k])
        worker.step_group(("a", 5))
        trained.append([p.detach().clone() for p in module.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*trained, strict=True))


def test_weights_and_optimizer_state_round_trip() -> None:
    donor, donor_opt = tiny_stage()
    donor(torch.randn(2, 4, 16)).sum().backward()
    donor_opt.step()
    receiver, receiver_opt = tiny_stage()
    sent = {**weights(donor), **optimizer_state(donor, donor_opt, weights(donor), None)}
    checked = check_replica_state(receiver, sent, **BOUNDS)
    load_replica_state(receiver, receiver_opt, checked)
    for (name, a), (_, b) in zip(donor.named_parameters(), receiver.named_parameters(), strict=True):
        assert torch.equal(a, b), name
        assert torch.equal(donor_opt.adam.state[a]["exp_avg"], receiver_opt.adam.state[b]["exp_avg"])
        assert torch.equal(checked.phi[name], a.detach())
    assert checked.delta is None


BOUNDS = {"max_grad_norm": 1.0, "max_step": 10}  # the donor's clipping, and the step it claims (+ margin)

Poison = Callable[[dict[str, torch.Tensor], str], dict[str, torch.Tensor]]


def donor_state() -> dict[str, torch.Tensor]:
    donor, donor_opt = tiny_stage()
    donor(torch.randn(2, 4, 16)).sum().backward()
    donor_opt.step()
    delta = {name: torch.zeros_like(t) for name, t in weights(donor).items()}
    return {**weights(donor), **optimizer_state(donor, donor_opt, weights(donor), delta)}


@pytest.mark.parametrize(
    ("poison", "words"),
    [
        (lambda t, n: {f"adam.{n}.exp_avg_sq": -t[f"adam.{n}.exp_avg_sq"] - 1.0}, "negative"),
        (lambda t, n: {f"adam.{n}.exp_avg": t[f"adam.{n}.exp_avg"].long()}, "floating-point"),
        (lambda t, n: {f"adam.{n}.step": torch.tensor(-1.0)}, "negative"),
        (lambda t, n: {f"adam.{n}.step": torch.ones(2)}, "not a scalar"),
        (lambda t, n: {f"outer.phi.{n}": torch.full_like(t[n], math.nan)}, "outer phi"),
        (lambda t, n: {f"outer.delta.{n}": torch.full_like(t[n], math.inf)}, "outer delta"),
        (lambda t, n: {f"outer.phi.{n}": torch.zeros(3)}, "shape"),
        # finite but beyond what an honest donor holds (protocols.bounds)
        (lambda t, n: {f"adam.{n}.exp_avg": torch.full_like(t[n], 1e30)}, "exp_avg of"),
        (lambda t, n: {f"adam.{n}.exp_avg_sq": torch.full_like(t[n], 1e30)}, "exp_avg_sq of"),
        (lambda t, n: {f"adam.{n}.step": torch.tensor(float(2**63 - 1))}, "adam step"),
        (lambda t, n: {f"outer.phi.{n}": torch.full_like(t[n], 1e30)}, "outer phi"),
        (lambda t, n: {f"outer.delta.{n}": torch.full_like(t[n], 1e30)}, "outer delta"),
    ],
)
def test_a_poisoned_replica_state_is_refused_before_anything_changes(poison: Poison, words: str) -> None:
    sent = donor_state()
    name = next(n for n in sent if not n.startswith(("adam.", "outer.")))
    receiver, receiver_opt = tiny_stage()
    before = weights(receiver)
    with pytest.raises(StateMismatch, match=words):
        check_replica_state(receiver, {**sent, **poison(sent, name)}, **BOUNDS)
    incomplete = {k: v for k, v in sent.items() if k != f"adam.{name}.exp_avg"}
    with pytest.raises(StateMismatch, match="incomplete"):
        check_replica_state(receiver, incomplete, **BOUNDS)
    assert all(torch.equal(t, before[n]) for n, t in weights(receiver).items())
    assert not receiver_opt.adam.state


def test_mismatched_or_poisoned_state_is_refused() -> None:
    module, _ = tiny_stage()
    good = weights(module)
    before = {name: t.clone() for name, t in good.items()}
    name = next(iter(good))
    with pytest.raises(StateMismatch, match=f"missing {name!r}, unexpected none"):
        load_weights(module, {k: v for k, v in good.items() if k != name})
    with pytest.raises(StateMismatch, match="finite"):
        load_weights(module, {**good, name: torch.full_like(good[name], math.nan)})
    with pytest.raises(StateMismatch, match="shape"):
        load_weights(module, {**good, name: torch.zeros(3)})
    for key, tensor in weights(module).items():
        assert torch.equal(tensor, before[key])  # nothing was half-loaded


# ---- DHT records ------------------------------------------------------------------------------------------


def dht_record(key: str, subkey: bytes, value: object, expires: float = 60.0) -> DHTRecord:
    return DHTRecord(
        DHTID.generate(source=key).to_bytes(),
        MSGPackSerializer.dumps(subkey),
        MSGPackSerializer.dumps(value),
        get_dht_time() + expires,
    )


def signed(validator: SwarmRecordValidator, record: DHTRecord) -> DHTRecord:
    return dataclasses.replace(record, value=validator.sign_value(record))


def test_records_are_signed_by_the_peer_they_name() -> None:
    owner, stranger = Identity.generate(), Identity.generate()
    mine, theirs = SwarmRecordValidator("run", owner), SwarmRecordValidator("run", stranger)
    subkey = subkey_of(owner.peer_id)
    assert peer_of_subkey(subkey) == owner.peer_id and peer_of_subkey(b"12D3KooWnot-a-peer") is None
    good = encode(record(2))
    stored = signed(mine, dht_record(stage_key("run", 2), subkey, good))
    assert theirs.validate(stored) and mine.validate(stored)
    assert mine.strip_value(stored) == MSGPackSerializer.dumps(good)
    # a stranger speaking in the owner's name: signed with its own key, or the owner's signature reused
    assert not theirs.validate(signed(theirs, dht_record(stage_key("run", 2), subkey, good)))
    assert theirs.sign_value(dht_record(stage_key("run", 2), subkey, good)) == MSGPackSerializer.dumps(good)
    longer = dataclasses.replace(stored, expiration_time=stored.expiration_time + 100)
    assert not mine.validate(longer)
    other = encode(record(3))
    forged = dataclasses.replace(stored, value=MSGPackSerializer.dumps(other) + stored.value[-64:])
    assert not mine.validate(forged)
    assert not mine.validate(dht_record(stage_key("run", 2), subkey, good))  # unsigned
    # signed, but too far in the future, of the wrong schema, or under a subkey that names no peer
    assert not mine.validate(signed(mine, dht_record(stage_key("run", 2), subkey, good, expires=1e6)))
    assert not mine.validate(signed(mine, dht_record(stage_key("run", 2), subkey, b"\x93garbage")))
    assert not mine.validate(signed(mine, dht_record(stage_key("run", 2), b"no-owner", good)))
    run = MSGPackSerializer.dumps({"preset": "x"})
    assert not mine.validate(signed(mine, dht_record("run.run", subkey, run)))
    assert mine.validate(dht_record("another.key", b"x", b"anything"))  # not ours to judge


# ---- run definition ---------------------------------------------------------------------------------------


def test_run_spec_round_trips_and_rejects_bad_fields() -> None:
    spec = RunSpec.for_preset("tiny", total_steps=50, checkfree_plus=False)
    assert RunSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(RunSpecError, match="unknown"):
        RunSpec.from_dict({**spec.to_dict(), "evil": 1})
    with pytest.raises(RunSpecError, match=r"run field 'stages': expected an int"):
        RunSpec.from_dict({**spec.to_dict(), "stages": "3"})
    with pytest.raises(RunSpecError, match="divide"):
        RunSpec.from_dict({**spec.to_dict(), "stages": 4})
    with pytest.raises(RunSpecError):
        RunSpec.from_dict({**spec.to_dict(), "preset": "gpt-9"})
    with pytest.raises(RunSpecError, match="finite"):
        RunSpec.from_dict({**spec.to_dict(), "lr": math.inf})
    assert StatePart.EMBEDDING_COPY.value == "embedding_copy"


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("lr", 0, "a finite number > 0"),
        ("skip_ratio", 1.0, "a finite number in [0, 1)"),
        ("checkfree_plus", 1, "true or false"),
        ("edge_swaps", "yes", "true or false"),
        ("compression", "zip", "one of float16, none"),
        ("batch_size", True, "an int in 1.."),
        ("run_id", "", "printable text of 1..64 characters"),
        ("data_source", 3, "data_source must be a mapping"),
    ],
)
def test_a_bad_run_field_is_one_line_naming_it(field: str, value: object, expected: str) -> None:
    with pytest.raises(RunSpecError) as error:
        RunSpec.from_dict({**RunSpec().to_dict(), field: value})
    message = str(error.value)
    assert message.startswith(f"run field {field!r}: ") and expected in message and "\n" not in message
