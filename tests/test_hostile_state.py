"""Hostile peers against a real daemon's state transfers and NoLoCo averaging (issue 9).

A bootstrap and one stage node (no data node, so nothing trains and the node's state stays put), and
clients from state_clients.py acting as a stranger, a joining node and a poisoning averaging partner. Then a
training swarm (bootstrap, data node, one stage) whose stage node leaves while a hostile donor claims its
stage, and a real joiner of that stage; and a training swarm of two stages where a hostile node claims
stage 1 beside the honest one and serves stage 2 a poisoned CheckFree+ copy of stage 1. Every test ends
every process group it started (the `swarm` fixture checks that nothing is left).

The bounds themselves are tested at the unit level (tests/test_node_pieces.py on the loading function,
tests/protocols/test_bounds.py on the checks).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from state_clients import BURST, POISONS
from swarm_harness import LocalTestSwarm, NodeProcess, local_test_swarm, poll

pytestmark = pytest.mark.integration

STEPS = 400  # far more than the test needs: the swarm is stopped when it ends


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[LocalTestSwarm]:
    """conftest's swarm, which here also checks that no p2pd or client socket file was left behind."""
    with local_test_swarm(tmp_path / "swarm", sockets_clean=True) as harness:
        yield harness


def stage_node(swarm: LocalTestSwarm, stage: int) -> tuple[NodeProcess, str]:
    swarm.bootstrap(steps=10)
    node = swarm.join(stage)
    swarm.wait_online(node)
    return node, node.events("online")[0]["peer_id"]


def answers(client: NodeProcess) -> list[dict]:
    assert client.wait_exit(90) == 0, client.stderr_tail()
    return [e for e in client.events() if "call" in e]


@pytest.mark.timeout(150)
def test_state_goes_to_a_joiner_only_once_per_step_and_a_few_at_a_time(swarm: LocalTestSwarm) -> None:
    node, target = stage_node(swarm, 2)
    stranger = answers(swarm.client("requester", target, 2, "none"))
    joiner = answers(swarm.client("requester", target, 2, "recovering"))

    # a peer with no record in the run gets nothing, and is not banned (its record may only lag)
    assert {(a["outcome"], a["kind"]) for a in stranger} == {("error", "wrong_stage")}, stranger
    assert all("no record" in a["detail"] for a in stranger)
    # a peer whose record says it recovers this stage gets weights and optimizer; of a burst of concurrent
    # requests, each is either served or refused as busy (the joiner retries another donor)
    single, burst = joiner[0], joiner[1:]
    assert single["outcome"] == "ok", single
    assert len(burst) == BURST and any(a["outcome"] == "ok" for a in burst), burst
    assert all(a["outcome"] == "ok" or a["kind"] == "busy" for a in burst), burst
    assert {a["sum"] for a in joiner if a["outcome"] == "ok"} == {single["sum"]}  # one state, served alike
    # ... all from one snapshot: the node's state did not change, so it cloned it once for all of them
    snapshots = node.events("state_snapshot")
    assert [sorted(e["parts"]) for e in snapshots] == [["optimizer", "weights"]], snapshots


@pytest.mark.timeout(150)
def test_averaging_tensors_far_from_ours_are_declined_and_never_applied(swarm: LocalTestSwarm) -> None:
    node, target = stage_node(swarm, 1)
    averager = swarm.client("averager", target, 1)
    calls = {a["call"]: a for a in answers(averager)}
    attacker = averager.events("ready")[0]["peer_id"]

    poison, near, after = calls["poison"], calls["near"], calls["after"]
    # 1e30 everywhere: declined for its distance from this node's weights, said in the reply and the log
    assert not poison["accept"] and poison["decline"] == "malformed", poison
    assert "x our norm away from ours" in poison["reason"], poison
    event = node.wait_event("rejected", 10, where=lambda e: e["peer_id"] == attacker)
    assert event["code"] == "out_of_bounds" and "phi" in event["reason"], event
    # tensors within the bound pass it (declined only because no outer step runs: nobody's partner)
    assert not near["accept"] and near["decline"] == "not_reached", near
    # and the node's weights are untouched and finite
    assert after["unchanged"] and after["finite"], after
    assert node.poll() is None, node.stderr_tail()


def _step(node: NodeProcess) -> int:
    steps = node.events("step")
    return steps[-1]["step"] if steps else 0


@pytest.mark.timeout(300)
def test_a_joiner_refuses_a_poisoned_donor_and_training_goes_on(swarm: LocalTestSwarm) -> None:
    swarm.bootstrap(steps=STEPS, stages=1)
    honest = swarm.join(1)
    swarm.wait_online(honest)
    data = swarm.join(0)
    swarm.wait_online(data)
    poll(lambda: _step(data) >= 3, 120, "the data node's first steps", alive=data.check_alive)
    swarm.stop(honest)  # stage 1's only honest node leaves; a hostile donor claims the stage
    stop = swarm.folder / "stop-donor"
    donor = swarm.client("donor", 1, 1, stop)
    attacker = donor.wait_event("ready", 60)["peer_id"]
    joiner = swarm.join(1, name="joiner")
    joined = swarm.wait_online(joiner, timeout=150)[0]
    trained = _step(data)

    # the donor answered each of the joiner's three attempts, each time with another poison...
    served = [e for e in donor.events() if "served" in e]
    assert [e["served"] for e in served] == list(POISONS), served
    assert {e["to"] for e in served} == {joined["peer_id"]}, served
    # ...and each was refused, for what it was, with the donor named in the log
    log = joiner.err_path.read_text()
    refusals = [line for line in log.splitlines() if f"state fetch from {attacker[-8:]} failed" in line]
    assert len(refusals) == len(POISONS), log[-3000:]
    for refusal, why in zip(
        refusals, ("exp_avg of", "ahead of the swarm clock", "donor lr factor 10"), strict=True
    ):
        assert why in refusal, refusal
    # with no honest replica left, the recovery rules re-initialise the stage, and say why
    recovered = joiner.events("recovered")
    assert [e["method"] for e in recovered] == ["reinit"], recovered
    assert "could not be recovered in 3 attempts" in recovered[0]["reason"], recovered

    # training goes on through the joiner, whose weights and moments are finite and within bounds
    poll(lambda: _step(data) >= trained + 3, 120, "training to go on", alive=data.check_alive)
    state = answers(swarm.client("requester", joined["peer_id"], 1, "recovering"))
    served_ok = [a for a in state if a["outcome"] == "ok"]
    assert served_ok and all(0 < a["largest"] < 100 for a in served_ok), state
    assert all(math.isfinite(e["loss"]) for e in data.events("step")), data.events("step")[-3:]
    stop.touch()
    assert donor.wait_exit(60) == 0, donor.stderr_tail()
    for node in (data, joiner):
        node.check_alive()


@pytest.mark.timeout(300)
def test_a_copy_holder_refuses_a_poisoned_copy_and_keeps_refreshing_from_honest_donors(
    swarm: LocalTestSwarm,
) -> None:
    swarm.bootstrap(steps=STEPS, stages=2)
    honest, last = swarm.join(1), swarm.join(2)
    donor_of_copy = swarm.wait_online(honest)[0]["peer_id"]
    swarm.wait_online(last)
    data = swarm.join(0)
    swarm.wait_online(data)
    poll(lambda: _step(data) >= 3, 120, "the data node's first steps", alive=data.check_alive)
    # a hostile node claims stage 1 beside the honest one: stage 2, which keeps stage 1's edge copy, asks
    # the two in random order at each refresh (every 10 steps) until one sends a copy it accepts
    stop = swarm.folder / "stop-donor"
    donor = swarm.client("donor", 1, 2, stop, "copy")
    attacker = donor.wait_event("ready", 60)["peer_id"]

    def asked() -> bool:
        return any(e.get("parts") == ["first_stage_copy"] for e in donor.events() if "served" in e)

    poll(asked, 180, "stage 2 to ask the hostile donor for its copy", alive=last.check_alive)
    trained = _step(data)

    # the copy was refused, for what it was, with the donor named in the log...
    def refused() -> list[str]:
        log = last.err_path.read_text()
        return [line for line in log.splitlines() if f"state fetch from {attacker[-8:]} failed" in line]

    poll(lambda: bool(refused()), 30, "stage 2 to refuse the copy", alive=last.check_alive)
    assert all("not a finite floating-point tensor" in line for line in refused()), refused()

    # ...no refresh ever took the hostile copy, and refreshes went on from the honest node
    def refreshes() -> list[dict]:
        return [e for e in last.events("copy_refreshed") if e["part"] == "first_stage_copy"]

    later = "a refresh after the refusal"  # one made after it: refreshing goes on
    poll(lambda: any(e["step"] > trained for e in refreshes()), 120, later, alive=last.check_alive)
    assert {e["donor"] for e in refreshes()} == {donor_of_copy}, refreshes()
    poll(lambda: _step(data) >= trained + 3, 120, "training to go on", alive=data.check_alive)
    assert all(math.isfinite(e["loss"]) for e in data.events("step")), data.events("step")[-3:]
    stop.touch()
    assert donor.wait_exit(60) == 0, donor.stderr_tail()
    for node in (data, honest, last):
        node.check_alive()
