"""Failures on real swarms (issue 5): SIGKILL of a node's whole process group, then `join --stage auto`.

Every test runs one small swarm on loopback (tests/swarm_harness.py: a bootstrap, one data node, three or
four stage nodes, one torch thread each), kills nodes mid-run with SIGKILL to their process group (daemon,
DHT process and p2pd die together, as on a lost machine), starts replacements with `join --stage auto
--dump-recovery DIR`, and checks what the replacements did and that training went on:

- a lost middle stage is rebuilt by CheckFree: the loaded weights are the gradient-norm weighted average of
  the neighbours' weights the new node fetched (its dumped evidence), which are trained weights;
- a lost first / last stage is a copy of its CheckFree+ swap partner (stage 2), exactly;
- a lost data stage is restored exactly from the copies of E (stage 1) and E' (last stage);
- one of two replicas killed: no iteration waits past the iteration timeout, and the data node's counts of
  lost microbatches add up (lost + completed == planned, per iteration and in total);
- two adjacent stages lost: the replacements say plainly that CheckFree cannot rebuild them and re-initialise
  (`reinit`), nothing hangs, training goes on.

The runs are long (`--steps` far beyond what a test waits for): each test stops its swarm once it has seen
what it needs, so a slow machine costs time, not a run that ends before the replacement is online.
Paths in `step` events are the PLANNED stage lists of the iteration; whether microbatches really went
through a replacement is read from its DHT record (`swarmnode status`): its step count grows.
"""

from __future__ import annotations

import json
import math
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from statistics import mean
from typing import Any

import pytest
import torch
from swarm_harness import HarnessError, LocalTestSwarm, NodeProcess, group_members, poll, stage_peers

from swarmnode.pieces import build_piece
from swarmnode.presets import get_preset
from swarmnode.runspec import RunSpec

pytestmark = pytest.mark.integration

# The runs: the tiny preset with a shorter iteration timeout than the default 30 s, so that the worst case
# of the bound (an iteration waiting its whole timeout for a lost microbatch) costs seconds, not minutes.
RUN = {"preset": "tiny", "iteration_timeout_s": 10.0, "hop_timeout_s": 5.0}
SPEC = RunSpec.from_dict({**RunSpec.for_preset("tiny").to_dict(), **RUN})
STEPS = 1000  # never reached: a test stops its swarm once it has seen what it needs
TOKENS_PER_MICROBATCH = SPEC.batch_size * SPEC.seq_len
ITERATION_BOUND_S = SPEC.iteration_timeout_s + 8.0  # the timeout, plus slack for a loaded machine
START_S = 120.0  # bound for a process to come online on a loaded 2-core machine
WINDOW = 5  # steps per loss window


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[LocalTestSwarm]:
    harness = LocalTestSwarm(tmp_path / "swarm", run_id=f"fail{uuid.uuid4().hex[:10]}")
    try:
        yield harness
    finally:
        harness.close()
        harness.remove_leftover_sockets()  # SIGKILLed nodes cannot remove their p2pd sockets
        assert not harness.left_behind, f"processes left behind: {harness.left_behind}"


# ---- helpers -----------------------------------------------------------------------------------------------


def start_swarm(
    swarm: LocalTestSwarm, stages: list[int], **bootstrap: Any
) -> tuple[NodeProcess, list[NodeProcess]]:
    """Bootstrap, the stage nodes (waited online), then the data node (waited online)."""
    run_file = swarm.folder / "run.json"
    run_file.write_text(json.dumps(RUN))
    swarm.bootstrap("--run", str(run_file), **{"steps": STEPS, **bootstrap})
    nodes = [swarm.join(k) for k in stages]
    swarm.wait_online(*nodes, timeout=START_S)
    data = swarm.join(0, name="data")
    data.wait_event("online", START_S)
    swarm.note_sockets()
    return data, nodes


def wait_step(data: NodeProcess, step: int, timeout: float = START_S) -> dict[str, Any]:
    return data.wait_event("step", timeout, where=lambda e: e["step"] >= step)


def kill(swarm: LocalTestSwarm, *nodes: NodeProcess) -> float:
    """SIGKILL the whole process group of each node (daemon, DHT process, p2pd); the unix time of the kill."""
    swarm.note_sockets()  # their p2pd sockets stay behind; the fixture removes them
    for node in nodes:
        node.kill_group(signal.SIGKILL)
    killed = time.time()
    for node in nodes:
        node.popen.wait(10)
    pgids = [node.pgid for node in nodes]
    poll(lambda: not group_members(pgids), 10, "the killed process groups to be gone")
    return killed


def join_auto(swarm: LocalTestSwarm, name: str, dump: Path) -> NodeProcess:
    return swarm.join("auto", "--dump-recovery", str(dump), name=name)


def wait_recovered(swarm: LocalTestSwarm, node: NodeProcess) -> tuple[dict[str, Any], dict[str, Any]]:
    """The node's `recovered` and `online` events."""
    recovered = node.wait_event("recovered", START_S)
    online = node.wait_event("online", START_S)
    swarm.note_sockets()
    return recovered, online


def load_dump(folder: Path, stage: int) -> dict[str, Any]:
    files = sorted(folder.glob(f"recovery-stage{stage}-*.pt"))
    assert len(files) == 1, f"expected one recovery dump of stage {stage} in {folder}: {files}"
    return torch.load(files[0])


def initial_weights(stage: int, vocab_size: int) -> dict[str, torch.Tensor]:
    """The run's seeded initial weights of `stage` (what every node starts from before training)."""
    config = replace(get_preset(SPEC.preset).model, vocab_size=vocab_size)
    piece = build_piece(config, stage, SPEC.stages, SPEC.seed)
    return {name: p.detach() for name, p in piece.named_parameters()}


def assert_trained(tensors: dict[str, torch.Tensor], stage: int, vocab_size: int = SPEC.vocab_size) -> None:
    """`tensors` have stage `stage`'s layout and are not its initial weights (they were trained)."""
    initial = initial_weights(stage, vocab_size)
    assert set(tensors) == set(initial), sorted(set(tensors) ^ set(initial))[:5]
    changed = [n for n, t in tensors.items() if not torch.allclose(t, initial[n], rtol=0, atol=1e-6)]
    assert len(changed) >= len(initial) // 2, f"stage {stage}: only {changed} differ from the initial weights"


def initial_loss(vocab_size: int) -> float:
    """The loss of uniform predictions: where an untrained (or re-initialised) data stage starts."""
    return math.log(vocab_size)


def steps_between(data: NodeProcess, after: float, before: float = math.inf) -> list[dict[str, Any]]:
    return [e for e in data.events("step") if after < e["time"] < before]


def wait_steps_through(data: NodeProcess, stage: int, after: float, count: int) -> list[dict[str, Any]]:
    """Wait for `count` step events after unix time `after` whose planned paths all include `stage`."""

    def enough() -> list[dict[str, Any]] | None:
        through = [e for e in steps_between(data, after) if all(stage in p for p in e["paths"])]
        return through if len(through) >= count else None

    return poll(enough, START_S, f"{count} steps through stage {stage}", alive=data.check_alive)


def record_of(swarm: LocalTestSwarm, stage: int, peer: str) -> dict[str, Any]:
    """The node's record as `swarmnode status --json` shows it."""
    peers = {p["peer_id"]: p for p in stage_peers(swarm.status(), stage)}
    assert peer in peers, f"{peer[-8:]} not listed in stage {stage}: {sorted(peers)}"
    return peers[peer]


def assert_learning(data: NodeProcess, killed: float) -> None:
    """Every loss finite; the last window's mean below the window before the kill."""
    steps = data.events("step")
    losses = [e["loss"] for e in steps]
    assert all(math.isfinite(x) for x in losses), losses
    before = [e["loss"] for e in steps if e["time"] < killed][-WINDOW:]
    last = losses[-WINDOW:]
    assert len(before) == WINDOW and steps[-WINDOW]["time"] > killed
    assert mean(last) < mean(before), (before, last, losses)


def assert_skipped_meanwhile(data: NodeProcess, stage: int, killed: float, recovered: float) -> None:
    """After the kill no iteration waited past the bound; iterations planned once the dead node's record had
    expired (TTL, then a refresh of the data node's view) and before the replacement announced itself left
    the lost stage out. (Whether there were any depends on timing: the replacement may be online first.)"""
    after = steps_between(data, killed)
    assert all(e["seconds"] < ITERATION_BOUND_S for e in after), [e["seconds"] for e in after]
    expired = killed + SPEC.record_ttl_s + 2 * SPEC.record_period_s
    meanwhile = [e for e in after if expired < e["time"] - e["seconds"] < recovered]
    assert all(stage not in path for e in meanwhile for path in e["paths"]), meanwhile


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

    # training went on without stage 2, then through the new node again, and keeps learning
    assert_skipped_meanwhile(data, 2, killed, recovered["time"])
    wait_steps_through(data, 2, online["time"], 10)
    record = record_of(swarm, 2, online["peer_id"])
    restored_step = max(previous["step"], following["step"])
    assert record["step"] > restored_step, (record, restored_step)  # it has stepped since its rebuild
    assert record["recovery"]["method"] == "checkfree"
    assert_learning(data, killed)


# ---- b: the edge stages ------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_lost_edge_stages_are_copies_of_their_swap_partner(swarm: LocalTestSwarm) -> None:
    data, (stage1, _, stage3) = start_swarm(swarm, [1, 2, 3])
    wait_step(data, 8)
    killed_first = None
    for victim, stage in ((stage1, 1), (stage3, 3)):
        dump = swarm.folder / f"dump{stage}"
        killed = kill(swarm, victim)
        killed_first = killed_first or killed
        new = join_auto(swarm, f"new{stage}", dump)
        recovered, online = wait_recovered(swarm, new)

        assert recovered["stage"] == stage and recovered["method"] == "checkfree_plus_copy", recovered
        assert recovered["reason"] == f"stage {stage} rebuilt as a copy of stage 2"
        evidence = load_dump(dump, stage)
        [source] = evidence["sources"]
        assert source["stage"] == 2 and source["step"] > 0
        assert_trained(source["tensors"], 2)
        assert set(evidence["loaded"]) == set(source["tensors"])
        for name, tensor in evidence["loaded"].items():
            assert torch.equal(tensor, source["tensors"][name]), name

        assert_skipped_meanwhile(data, stage, killed, recovered["time"])
        wait_steps_through(data, stage, online["time"], 6)
        record = record_of(swarm, stage, online["peer_id"])
        assert record["step"] > source["step"] and record["recovery"]["method"] == "checkfree_plus_copy"
    assert killed_first is not None
    assert_learning(data, killed_first)


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
    assert finished["step"] == steps_total == len(steps)
    assert [e["step"] for e in steps] == list(range(1, steps_total + 1))
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

    # training went on (without the lost stages), then through both new stages, with finite losses
    assert_skipped_meanwhile(data, first["stage"], killed, first["time"])
    online = max(e["time"] for e in back.values())
    wait_steps_through(data, 1, online, 6)
    wait_steps_through(data, 2, online, 6)
    losses = [e["loss"] for e in data.events("step")]
    assert all(math.isfinite(x) for x in losses), losses
