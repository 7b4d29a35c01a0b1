"""A standby node on a real swarm (issue 15): `join --standby` stands by (the status view lists it), takes
the middle stage the moment its only node is SIGKILLed, rebuilds it by CheckFree as a replacement would,
and training goes on through it. Every process is ended and checked gone by the fixture."""

from __future__ import annotations

import pytest
from failure_scenarios import (
    START_S,
    kill,
    start_swarm,
    wait_recovered,
    wait_step,
    wait_steps_through,
)
from swarm_harness import LocalTestSwarm, poll

pytestmark = pytest.mark.integration


@pytest.mark.timeout(240)
def test_a_standby_takes_the_lost_stage_and_training_goes_through_it(swarm: LocalTestSwarm) -> None:
    data, (_, stage2, _) = start_swarm(swarm, [1, 2, 3])
    standby = swarm.join("auto", "--standby", name="standby")
    standby.wait_event("joining", START_S, where=lambda e: e["phase"] == "dht")
    standing = poll(
        lambda: swarm.status()["standbys"] or None, START_S, "the status view to list the standby"
    )
    assert [s["taken"] for s in standing] == [None], standing
    wait_step(data, 6)
    assert not standby.events("online")  # it held no stage while every stage was served

    killed = kill(swarm, stage2)
    taken = standby.wait_event("joining", START_S, where=lambda e: e["phase"] == "stage")
    recovered, online = wait_recovered(swarm, standby)
    assert taken["stage"] == recovered["stage"] == online["stage"] == 2, (taken, recovered)
    assert recovered["method"] == "checkfree" and online["peer_id"] == standing[0]["peer_id"]
    assert online["time"] - killed < 10.0, online["time"] - killed  # no record had to expire first
    wait_steps_through(data, 2, online["time"], 3)
