"""Failures on real swarms (issue 5): SIGKILL of a node's whole process group, then `join --stage auto`.

Every test runs one small swarm on loopback (tests/swarm_harness.py: a bootstrap, one data node, three or
four stage nodes, one torch thread each), kills nodes mid-run with SIGKILL to their process group (daemon
and p2pd die together, as on a lost machine), starts replacements with `join --stage auto
--dump-recovery DIR`, and checks what the replacements did and that training went on:

- a lost middle stage is rebuilt by CheckFree: the loaded weights are the gradient-norm weighted average of
  the neighbours' weights the new node fetched (its dumped evidence), which are trained weights;
- a lost first / last stage is restored from the copy of its own weights that stage 2 keeps (`edge_copy`,
  the default): trained stage-1 / stage-3 weights, as stage 2's node sent them;
- without edge copies, a lost first / last stage of this 3-stage model is an exact copy of stage 2, its
  only transformer neighbour, and says that stage 2 served in its place in fewer than `MIN_STAND_INS`
  iterations (none, or the one or two of the microbatches re-routed past the dying stage; the records'
  counts) and that a model of 3 stages never swaps: CheckFree over one neighbour, not a swap partner's copy;
- in a run that skips, without edge copies, stage 2 stands in for a skipped edge stage (1 or 3, as the
  scheduler's paths have it), counts it, and that edge stage, lost, is a copy of stage 2
  (`checkfree_plus_copy`; the decision from the counts is tested in tests/protocols/test_checkfree.py, the
  counting in tests/protocols/test_standins.py);
- a lost data stage is restored exactly from the copies of E (stage 1) and E' (last stage);
- one of two replicas killed: no iteration waits past the iteration timeout, and the data node's counts of
  lost microbatches add up (lost + completed == planned, per iteration and in total);
- two adjacent stages lost: the replacements say plainly that CheckFree cannot rebuild them and re-initialise
  (`reinit`) through the same load as a rebuild: fresh weights drawn from `reinit_seed` (not the run's step-0
  weights) at the swarm's step (no warm-up again); nothing hangs, training goes on.

The runs are long (`--steps` far beyond what a test waits for): each test stops its swarm once it has seen
what it needs, so a slow machine costs time, not a run that ends before the replacement is online.
Paths in `step` events are the PLANNED stage lists of the iteration; whether microbatches really went
through a replacement is read from its DHT record (`swarmnode status`): its step count grows.
"""

from __future__ import annotations

import math
import re
from statistics import mean
from typing import Any

import pytest
import torch
from failure_scenarios import (
    ITERATION_BOUND_S,
    SPEC,
    START_S,
    TOKENS_PER_MICROBATCH,
    WINDOW,
    assert_learning,
    assert_trained,
    assert_waited_meanwhile,
    initial_loss,
    initial_weights,
    join_auto,
    kill,
    load_dump,
    record_of,
    replace_one_by_one,
    start_swarm,
    steps_between,
    wait_recovered,
    wait_step,
    wait_steps_through,
)
from swarm_harness import HarnessError, LocalTestSwarm, poll

from protocols.checkfree import reinit_seed
from protocols.standins import MIN_STAND_INS

pytestmark = pytest.mark.integration


# ---- a: a middle stage -------------------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_lost_middle_stage_is_rebuilt_by_checkfree(swarm: LocalTestSwarm) -> None:
    dump = swarm.folder / "dump"
    data, (_, stage2, _) = start_swarm(swarm, [1, 2, 3])
    wait_step(data, 8)
    killed = kill(swarm, stage2)
    new = join_auto(swarm, "new2", dump)
    recovered, online = wait_recovered(swarm, new)

    # the new node chose the lost stage and rebuilt it by CheckFree
    assert recovered["stage"] == 2 and recovered["method"] == "checkfree", recovered
    assert "weighted average of stages 1 and 3" in recovered["reason"]
    evidence = load_dump(dump, 2)
    assert evidence["stage"] == 2 and evidence["method"] == "checkfree"
    previous, following = evidence["sources"]
    assert (previous["stage"], following["stage"]) == (1, 3)
    # the neighbours' trained weights, with stage 2's layout (stages are keyed by names relative to the stage)
    for source in (previous, following):
        assert_trained(source["tensors"], source["stage"])
        assert source["step"] > 0 and source["grad_norm"] > 0, source["grad_norm"]
    w1, w2 = previous["grad_norm"], following["grad_norm"]
    loaded = evidence["loaded"]
    assert set(loaded) == set(previous["tensors"]) == set(following["tensors"])
    for name, tensor in loaded.items():
        expected = (w1 * previous["tensors"][name] + w2 * following["tensors"][name]) / (w1 + w2)
        assert torch.allclose(tensor, expected, rtol=1e-5, atol=1e-6), name

    # training waited for stage 2's rebuild, then went on through the new node, and keeps learning
    assert_waited_meanwhile(data, 2, killed, recovered["time"])
    wait_steps_through(data, 2, online["time"], 10)
    record = record_of(swarm, 2, online["peer_id"])
    restored_step = max(previous["step"], following["step"])
    assert record["step"] > restored_step, (record, restored_step)  # it has stepped since its rebuild
    assert record["recovery"]["method"] == "checkfree"
    assert_learning(data, killed)


# ---- b: the edge stages ------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_lost_edge_stages_are_restored_from_the_copies_their_partner_keeps(swarm: LocalTestSwarm) -> None:
    data, (stage1, stage2, stage3) = start_swarm(swarm, [1, 2, 3])
    keeper = stage2.events("online")[0]["peer_id"]
    kept = {"first_stage_copy", "last_stage_copy"}
    poll(lambda: kept <= set(record_of(swarm, 2, keeper)["copies"]), START_S, "stage 2 to keep both copies")
    killed_first = None
    for stage, killed, recovered, online, dump in replace_one_by_one(swarm, [(stage1, 1), (stage3, 3)]):
        killed_first = killed_first or killed

        assert recovered["stage"] == stage and recovered["method"] == "edge_copy", recovered
        assert recovered["reason"] == f"stage {stage} restored from the copy of its weights kept by stage 2"
        evidence = load_dump(dump, stage)
        [source] = evidence["sources"]
        assert source["stage"] == 2 and source["step"] > 0  # served by stage 2's node...
        assert_trained(source["tensors"], stage)  # ...and the edge stage's own trained weights, not stage 2's
        own, partners = initial_weights(stage, SPEC.vocab_size), initial_weights(2, SPEC.vocab_size)
        # nearer its own initial weights than stage 2's: ||W - W0||^2 < ||W - W0'||^2, whose difference is
        # about ||W0 - W0'||^2 (independent draws) whatever training added to W
        drift = sum(float((t - own[name]).square().sum()) for name, t in source["tensors"].items())
        apart = sum(float((t - partners[name]).square().sum()) for name, t in source["tensors"].items())
        assert drift < apart, (drift, apart)
        for name, tensor in evidence["loaded"].items():
            assert torch.equal(tensor, source["tensors"][name]), name

        assert_waited_meanwhile(data, stage, killed, recovered["time"])
        wait_steps_through(data, stage, online["time"], 6)
        record = record_of(swarm, stage, online["peer_id"])
        assert record["step"] > source["step"] and record["recovery"]["method"] == "edge_copy"
    assert killed_first is not None
    # restored from copies a few steps old, the stages set training back by nothing a loss window shows: the
    # last 10 training losses against the 10 before the first kill (this model's loss is on a plateau here,
    # a few tenths up or down from step to step, so "lower than before" would be a coin toss)
    steps = data.events("step")
    before = [e["loss"] for e in steps if e["time"] < killed_first][-10:]
    after = [e["loss"] for e in steps[-10:] if e["time"] > killed_first]
    assert len(before) == len(after) == 10 and mean(after) < mean(before) + 0.25, (before, after)


@pytest.mark.timeout(300)
def test_lost_edge_stages_without_copies_are_copies_of_their_only_neighbour(swarm: LocalTestSwarm) -> None:
    data, (stage1, _, stage3) = start_swarm(swarm, [1, 2, 3], run={"edge_copies": False})
    wait_step(data, 8)
    killed_first = None
    for stage, killed, recovered, online, dump in replace_one_by_one(swarm, [(stage1, 1), (stage3, 3)]):
        killed_first = killed_first or killed

        assert recovered["stage"] == stage and recovered["method"] == "checkfree", recovered
        reason = recovered["reason"]
        assert reason.startswith(
            f"stage {stage} rebuilt as a copy of stage 2, its only transformer neighbour"
        )
        # the microbatches re-routed past the killed stage when it died put stage 2 in its place: a few
        served = re.search(r"stage 2 served (a microbatch|microbatches) in stage (\d)'s place", reason)
        assert served is not None and int(served[2]) == stage, reason
        few = re.search(r"in at most (\d+) of the last", reason)
        assert few is None or 0 < int(few[1]) < MIN_STAND_INS, reason
        assert "a model of 3 transformer stages never swaps" in reason, reason
        evidence = load_dump(dump, stage)
        [source] = evidence["sources"]
        assert source["stage"] == 2 and source["step"] > 0
        assert_trained(source["tensors"], 2)
        assert set(evidence["loaded"]) == set(source["tensors"])
        for name, tensor in evidence["loaded"].items():
            assert torch.equal(tensor, source["tensors"][name]), name

        assert_waited_meanwhile(data, stage, killed, recovered["time"])
        wait_steps_through(data, stage, online["time"], 6)
        record = record_of(swarm, stage, online["peer_id"])
        assert record["step"] > source["step"] and record["recovery"]["method"] == "checkfree"
    assert killed_first is not None
    assert_learning(data, killed_first)


@pytest.mark.timeout(300)
def test_a_lost_edge_stage_whose_partner_stood_in_is_its_copy(swarm: LocalTestSwarm) -> None:
    """A run that skips (SkipPipe at skip ratio 0.34: each path visits 2 of the 3 stages) puts stage 2 right
    after the embeddings on paths that skip stage 1, or right before the head on paths that skip stage 3.
    Stage 2's node counts those microbatches and publishes the counts; the replacement of the lost edge stage
    reads them and is a copy of stage 2, its swap partner that stood in for it (`checkfree_plus_copy`), the
    count in its reason. Which edge stage 2 stands in for is the scheduler's choice from measured speeds (a
    calm swarm may choose the same paths every iteration), so the test kills the one it stood in for. A
    skipping run does not wait for the lost stage: its paths go on skipping it meanwhile."""
    dump = swarm.folder / "dump1"
    data, stage_nodes = start_swarm(swarm, [1, 2, 3], run={"edge_copies": False}, skip_ratio=0.34)

    def edge_stood_in_for() -> int | None:  # planned paths: enough iterations to be sure of stage 2's count
        steps = data.events("step")
        first = sum(any(path[1] == 2 for path in e["paths"]) for e in steps)
        last = sum(any(path[-2] == 2 for path in e["paths"]) for e in steps)
        enough = {1: first, 3: last}
        return max((k for k in enough if enough[k] >= 2 * MIN_STAND_INS), key=enough.get, default=None)

    lost = poll(edge_stood_in_for, START_S, "paths that put stage 2 at an edge", alive=data.check_alive)
    killed = kill(swarm, stage_nodes[lost - 1])
    new = join_auto(swarm, f"new{lost}", dump)
    recovered, online = wait_recovered(swarm, new)

    assert recovered["stage"] == lost and recovered["method"] == "checkfree_plus_copy", recovered
    reason = recovered["reason"]
    served = re.fullmatch(
        rf"stage {lost} rebuilt as a copy of stage 2, its CheckFree\+ swap partner: a node of stage 2 served "
        rf"microbatches in stage {lost}'s place in (\d+) of the last \d+ steps",
        reason,
    )
    assert served is not None and int(served[1]) >= MIN_STAND_INS, reason
    evidence = load_dump(dump, lost)
    [source] = evidence["sources"]
    assert source["stage"] == 2 and source["step"] > 0
    assert_trained(source["tensors"], 2)
    for name, tensor in evidence["loaded"].items():
        assert torch.equal(tensor, source["tensors"][name]), name
    record = poll(
        lambda: (r := record_of(swarm, lost, online["peer_id"]))["step"] > source["step"] and r,
        START_S,
        f"steps of the rebuilt stage {lost}",
        alive=data.check_alive,
    )
    assert record["recovery"]["method"] == "checkfree_plus_copy"
    assert all(math.isfinite(e["loss"]) for e in steps_between(data, killed))


# ---- c: the data stage -------------------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_lost_data_stage_is_restored_from_the_embedding_copies(swarm: LocalTestSwarm) -> None:
    dump = swarm.folder / "dump"
    data, _ = start_swarm(swarm, [1, 2, 3])
    # copies of E and E' are refreshed every copy_refresh_steps stage steps: wait for the first refresh
    wait_step(data, SPEC.copy_refresh_steps + 4)
    kill(swarm, data)
    last = data.events("step")[-1]
    new = join_auto(swarm, "newdata", dump)
    recovered, _ = wait_recovered(swarm, new)

    assert recovered["stage"] == 0 and recovered["method"] == "embedding_copy", recovered
    evidence = load_dump(dump, 0)
    embedding, head = evidence["sources"]
    assert (embedding["stage"], head["stage"]) == (1, SPEC.stages)
    vocab = embedding["tensors"]["embed_tokens.weight"].shape[0]  # the run's tokenizer's, not the preset's
    loaded = evidence["loaded"]
    expected = {f"embedding.{n}": t for n, t in embedding["tensors"].items()}
    expected |= {f"head.{n}": t for n, t in head["tensors"].items()}
    assert set(loaded) == set(expected)
    for name, tensor in loaded.items():
        assert torch.equal(tensor, expected[name]), name
    assert_trained(loaded, 0, vocab)  # the copies were refreshed from the trained data node

    # the new data node drives the run on: iterations through every stage, learning
    steps = poll(
        lambda: new.events("step") if len(new.events("step")) >= 12 else None,
        START_S,
        "12 steps of the new data node",
        alive=new.check_alive,
    )
    assert all(sorted(set(s for p in e["paths"] for s in p)) == [0, 1, 2, 3] for e in steps[-5:])
    losses = [e["loss"] for e in steps]
    assert all(math.isfinite(x) for x in losses)
    before = [e["loss"] for e in data.events("step")][-WINDOW:]
    assert mean(losses[-WINDOW:]) < mean(before) + 0.5, (before, losses)  # restored, not restarted
    assert mean(losses[-WINDOW:]) < initial_loss(vocab) - 1.0, losses

    # ...and continues the run's step count (which ends the run and drives the lr schedule) from the step
    # of the copies' holders, where the old data node was, instead of starting the run again
    restored = max(embedding["step"], head["step"])
    assert last["step"] - 2 <= restored <= last["step"] + 1, (restored, last)
    assert [e["step"] for e in steps] == list(range(restored + 1, restored + 1 + len(steps)))


# ---- d: one of two replicas --------------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_killing_one_replica_costs_at_most_the_iteration_timeout(swarm: LocalTestSwarm) -> None:
    steps_total = 24
    data, (_, replica_a, _, _) = start_swarm(swarm, [1, 2, 2, 3], steps=steps_total, microbatches=4)
    wait_step(data, 6)
    killed = kill(swarm, replica_a)
    finished = data.wait_event("finished", 4 * ITERATION_BOUND_S + START_S)
    assert data.wait_exit(30) == 0

    steps = data.events("step")
    failed = data.events("iteration_failed")
    lost_events = data.events("microbatch_lost")
    # every tick is a step or, if the kill took all of its microbatches (each goes to either replica of
    # stage 2: about one in 16 iterations in flight at the kill), a failed iteration; never both or none
    ticks = sorted([e["step"] for e in steps] + [e["iteration"] + 1 for e in failed])
    assert finished["step"] == steps_total and ticks == list(range(1, steps_total + 1)), ticks
    assert len(failed) <= 1, failed
    assert steps_between(data, killed), "no step after the kill"
    # no iteration waited past the bound
    slow = [e for e in steps if e["seconds"] >= ITERATION_BOUND_S]
    assert not slow, slow
    # per iteration: lost + completed == planned (4)
    for e in steps:
        completed, rest = divmod(e["tokens"], TOKENS_PER_MICROBATCH)
        assert rest == 0 and completed >= 1 and e["lost"] >= 0
        assert e["lost"] + completed == len(e["paths"]) == 4, e
    for e in failed:
        assert e["lost"] == 4, e  # nothing completed: every planned microbatch lost
    # totals: each lost microbatch counted exactly once
    per_iteration = [e["lost"] for e in steps if e["lost"]] + [e["lost"] for e in failed]
    assert sorted(e["count"] for e in lost_events) == sorted(per_iteration), (lost_events, per_iteration)
    assert sum(per_iteration) == finished["microbatches_lost"]
    # the loss stays finite and falls
    losses = [e["loss"] for e in steps]
    assert all(math.isfinite(x) for x in losses)
    assert mean(losses[-WINDOW:]) < mean(losses[:WINDOW]), losses


# ---- e: two adjacent stages --------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_two_adjacent_stages_lost_are_reinitialised(swarm: LocalTestSwarm) -> None:
    """Stages 1 and 2 die together: CheckFree cannot rebuild either from a live neighbour pair.

    Two replacements start at once with `--stage auto`: their claims send them to different stages, and
    both say plainly that their stage cannot be rebuilt and re-initialise it (a freshly re-initialised
    neighbour is no rebuild source). Nothing hangs; training goes on through both stages.
    """
    dump = swarm.folder / "dump"
    data, (stage1, stage2, _) = start_swarm(swarm, [1, 2, 3])
    wait_step(data, 8)
    killed = kill(swarm, stage1, stage2)
    options = ("--dump-recovery", str(dump))
    new = [swarm.join("auto", *options, name=name) for name in ("newa", "newb")]
    for node in new:
        wait_recovered(swarm, node)

    def online_stages() -> dict[int, dict[str, Any]] | None:
        """Each node's latest `online` event by stage, once stages 1 and 2 are both served."""
        latest = {}
        for node in new:
            events = node.events("online")
            moved = node.events("moving")
            if events and not (moved and moved[-1]["time"] > events[-1]["time"]):
                latest[events[-1]["stage"]] = events[-1]
        return latest if {1, 2} <= set(latest) else None

    try:
        back = poll(online_stages, START_S, "stages 1 and 2 to be served again", alive=data.check_alive)
    except HarnessError as error:
        kinds = ("joining", "recovered", "online", "moving")
        seen = {node.name: [e for e in node.events() if e.get("event") in kinds] for node in new}
        raise HarnessError(f"{error}; the replacements' events: {seen}") from error
    swarm.note_sockets()
    by_node = [(e, node) for node in new for e in node.events("recovered")]
    recovered = [e for e, _ in sorted(by_node, key=lambda pair: pair[0]["time"])]
    # the first replacement found both stages lost: a plain message (event and log), and a fresh stage
    first, first_node = min(by_node, key=lambda pair: pair[0]["time"])
    assert first["reason"] in first_node.err_path.read_text(), first_node.stderr_tail()
    assert first["method"] == "reinit", recovered
    assert first["reason"].startswith(f"stage {first['stage']} cannot be rebuilt: its "), first
    assert "is lost too" in first["reason"] and "adjacent stages lost" in first["reason"], first
    assert first["reason"].endswith("re-initialising it"), first
    assert sorted(e["stage"] for e in recovered) == [1, 2], recovered  # the claims split the joiners
    assert all(e["method"] == "reinit" for e in recovered), recovered
    for e in recovered:
        if e["method"] == "reinit":
            assert "cannot be rebuilt" in e["reason"] and "lost too" in e["reason"], e
    # each re-initialised stage went through the rebuild's load: the swarm's step, not 0 (no second warm-up),
    # and fresh weights drawn from the run's seed, the stage and that step, not the run's step-0 weights
    before_kill = max(e["step"] for e in data.events("step") if e["time"] < killed)
    for stage in (1, 2):
        evidence = load_dump(dump, stage)
        assert evidence["method"] == "reinit" and evidence["sources"] == [], evidence["method"]
        assert evidence["step"] >= before_kill - 2, (evidence["step"], before_kill)
        assert evidence["seed"] == reinit_seed(SPEC.seed, stage, evidence["step"])
        fresh = initial_weights(stage, SPEC.vocab_size, evidence["seed"])
        step0 = initial_weights(stage, SPEC.vocab_size)
        assert set(evidence["loaded"]) == set(fresh)
        for name, tensor in evidence["loaded"].items():
            assert torch.equal(tensor, fresh[name]), name
        differ = [n for n, t in evidence["loaded"].items() if not torch.equal(t, step0[n])]
        assert len(differ) >= len(step0) // 2, differ  # every matrix differs; RMSNorm scales are 1 in both

    # training waited for the lost stages' rebuild, then went on through both new stages, with finite losses
    assert_waited_meanwhile(data, first["stage"], killed, first["time"])
    online = max(e["time"] for e in back.values())
    wait_steps_through(data, 1, online, 6)
    wait_steps_through(data, 2, online, 6)
    losses = [e["loss"] for e in data.events("step")]
    assert all(math.isfinite(x) for x in losses), losses
    for stage, e in back.items():
        record = record_of(swarm, stage, e["peer_id"])
        assert record["step"] > load_dump(dump, stage)["step"], record  # on from the swarm's step
