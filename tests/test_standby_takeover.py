"""A standby node on a real swarm (issue 15): `join --standby` stands by (the status view lists it), takes
the middle stage the moment its only node is SIGKILLed, rebuilds it by CheckFree as a replacement would,
and training goes on through it; a standby whose p2pd dies stops and says why. Every process is ended and
checked gone by the fixture."""

from __future__ import annotations

import os
import signal

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

from swarmnode.procstat import processes

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


@pytest.mark.timeout(150)
def test_a_standby_whose_p2p_daemon_dies_stops_and_says_why(swarm: LocalTestSwarm) -> None:
    swarm.bootstrap(steps=1)
    swarm.wait_online(*(swarm.join(stage) for stage in (1, 2, 3)))
    standby = swarm.join("auto", "--standby", name="standby")
    poll(lambda: swarm.status()["standbys"] or None, START_S, "the status view to list the standby")
    p2pd = [proc.pid for proc in processes() if proc.ppid == standby.pid and proc.comm == "p2pd"]
    assert len(p2pd) == 1, p2pd
    os.kill(p2pd[0], signal.SIGKILL)  # as a crash would

    assert standby.wait_exit(30) == 1
    assert "the DHT's p2p daemon" in standby.stderr_tail() and "Stopping" in standby.stderr_tail()
    assert not standby.events("online")
