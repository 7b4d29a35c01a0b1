"""`join --rebalance` (issue 5): a spare replica moves by itself to a stage that lost all its nodes.

Stages 1, 2, 2, 3, every stage node started with `--rebalance`; the only node of stage 3 is SIGKILLed and
no replacement is started. Exactly one of the two stage-2 replicas leaves (the lowest peer id: two never
both leave), rejoins as stage 3 and rebuilds it; the other keeps stage 2, and training goes on through both.
"""

from __future__ import annotations

from typing import Any

import pytest
from failure_scenarios import START_S, kill, start_swarm, wait_step, wait_steps_through
from swarm_harness import LocalTestSwarm, NodeProcess, poll

pytestmark = pytest.mark.integration


@pytest.mark.timeout(240)
def test_a_spare_replica_moves_to_the_stage_that_lost_its_only_node(swarm: LocalTestSwarm) -> None:
    data, (_, spare_a, spare_b, last) = start_swarm(swarm, [1, 2, 2, 3], "--rebalance")
    wait_step(data, 6)
    killed = kill(swarm, last)

    def moved() -> list[tuple[NodeProcess, dict[str, Any]]] | None:
        found = [(node, e) for node in (spare_a, spare_b) for e in node.events("moving")]
        return found or None

    [(mover, move)] = poll(moved, START_S, "a stage-2 replica to move", alive=data.check_alive)
    assert (move["from_stage"], move["to_stage"]) == (2, 3), move
    assert move["time"] > killed
    recovered = mover.wait_event("recovered", START_S, where=lambda e: e["stage"] == 3)
    # stage 3 had no node left: its copy at stage 2, once stage 2 has taken one, else stage 2's weights
    assert recovered["method"] in ("edge_copy", "checkfree"), recovered
    online = mover.wait_event("online", START_S, where=lambda e: e["stage"] == 3)
    swarm.note_sockets()
    # training goes on through the rebuilt stage 3 and through stage 2, served by the replica that stayed
    wait_steps_through(data, 3, online["time"], 4)
    stayed = spare_b if mover is spare_a else spare_a
    assert not stayed.events("moving"), stayed.events("moving")
    stayed.check_alive()
    assert mover.events("online")[0]["peer_id"] < stayed.events("online")[0]["peer_id"]  # the lowest id moves
    wait_steps_through(data, 2, online["time"], 4)
