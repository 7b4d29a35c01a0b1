"""Fixtures shared by the integration tests."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_helpers import run
from swarm_harness import LocalTestSwarm, local_test_swarm
from transport_harness import Swarm, running_swarm

from swarmnode.dht_thread import THREAD_NAME
from swarmnode.transport import Transport

TRAINED_STEPS = 6


def _dht_threads() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.name == THREAD_NAME}


@pytest.fixture(autouse=True)
def no_dht_left_running() -> Iterator[None]:
    """Every test shuts down the DHTs it started in this process (each a thread and a p2pd:
    `swarmnode.dht_thread`); one left running fails the test."""
    before = _dht_threads()
    yield
    if left := _dht_threads() - before:
        pytest.fail(f"{len(left)} DHT(s) left running: shut down every SwarmDHT a test starts")


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[LocalTestSwarm]:
    """A local test swarm of a fresh run (`swarm_harness.local_test_swarm`); test files that check more
    on exit define their own."""
    with local_test_swarm(tmp_path / "swarm") as harness:
        yield harness


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, float]]:
    """`swarmnode train --out` after `TRAINED_STEPS` steps: the model folder and the run's figures (its final
    validation loss is the folder's)."""
    out = tmp_path_factory.mktemp("train") / "model"
    code, output = run(
        "train", "--steps", str(TRAINED_STEPS), "--eval-every", "6", "--out", str(out), "--json"
    )
    assert code == 0, output
    return out, json.loads(output.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def transports() -> Iterator[Swarm]:
    """The transport tests' swarm of p2pd daemons and transports (`transport_harness.running_swarm`), one
    per test module."""
    with running_swarm() as swarm:
        yield swarm


@pytest.fixture(params=["libp2p", "direct"])
def caller(request: pytest.FixtureRequest, transports: Swarm) -> Transport:
    """The calling transport, once over libp2p streams and once over the direct TCP path."""
    return transports.libp2p if request.param == "libp2p" else transports.direct
