"""Hostile peers against a real daemon's state transfers and NoLoCo averaging (issue 9).

A bootstrap and one stage node (no data node, so nothing trains and the node's state stays put), and
clients from state_clients.py acting as a stranger, a joining node and a poisoning averaging partner. Every
test ends every process group it started (the `swarm` fixture checks that nothing is left).

A poisoned donor (Adam moments of `1e30`, `step = 2**63 - 1`, `lr_factor = 10`) is tested at the unit level
(tests/test_node_pieces.py on the loading function, tests/protocols/test_bounds.py on the checks).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from state_clients import BURST
from swarm_clients import CLIENTS
from swarm_harness import LocalTestSwarm, NodeProcess

pytestmark = pytest.mark.integration


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[LocalTestSwarm]:
    harness = LocalTestSwarm(tmp_path / "swarm", run_id=f"test{uuid.uuid4().hex[:10]}")
    try:
        yield harness
    finally:
        harness.close()
        sockets = harness.remove_leftover_sockets()
        assert not harness.left_behind, f"processes left behind: {harness.left_behind}"
        ours = {path: name for path, name in sockets.items() if "p2pd" in path or name in CLIENTS}
        assert not ours, f"socket files left behind: {ours}"


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
