"""Swarms across network namespaces (tests/netns.py): nodes on separate addresses, and a volunteer behind a
NAT router. Needs root and `ip netns` (CI runs as root); skipped otherwise.

Every node is a real daemon started inside its namespace by `ip netns exec` (which execs it, so the harness
ends it by pid and process group as on loopback). Namespaces, veths and iptables rules exist only inside
the namespaces made here and are deleted at the end of each test, failed or not.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from netns import Host, Network, unavailable_reason
from swarm_harness import LocalTestSwarm, NodeProcess, metric_samples, poll, step_losses

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

STEPS = 4
ONLINE_S = 180.0  # generous: daemons start slowly on a loaded machine


@pytest.fixture(scope="module")
def can_build() -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture
def network(can_build: None) -> Iterator[Network]:
    net = Network()
    try:
        yield net
    finally:
        net.close()
        assert not net.leftovers(), f"namespaces left behind: {net.leftovers()}"


def daemon(swarm: LocalTestSwarm, host: Host, name: str, *args: str) -> NodeProcess:
    """`python -m swarmnode ARGS` inside `host`'s namespace, listening on its address."""
    argv = [swarm.python, "-m", "swarmnode", *args, "--host", host.address]
    return swarm.spawn(name, Network.exec_argv(host, argv))


def bootstrap(swarm: LocalTestSwarm, host: Host, *options: str) -> NodeProcess:
    args = ["bootstrap", "--run-id", swarm.run_id, "--peers-file", str(swarm.peers_file)]
    node = daemon(swarm, host, "bootstrap", *args, "--stages", "2", "--steps", str(STEPS), *options)
    poll(
        lambda: swarm.peers_file.exists() and bool(swarm.peers_file.read_text().strip()),
        60,
        "the bootstrap's peers file",
        alive=node.check_alive,
    )
    assert host.address in swarm.peers_file.read_text()
    return node


def join(swarm: LocalTestSwarm, host: Host, stage: int, *options: str) -> NodeProcess:
    args = ["join", "--stage", str(stage), "--initial-peers", str(swarm.peers_file), "--run-id", swarm.run_id]
    return daemon(swarm, host, f"stage{stage}", *args, "--threads", "1", "--direct", *options)


def trains(data: NodeProcess) -> dict[str, Any]:
    finished = data.wait_event("finished", 240)
    assert data.wait_exit(30) == 0
    assert finished["step"] == STEPS == len(step_losses(data.events()))
    return finished


def scrape(
    swarm: LocalTestSwarm, host: Host, node: NodeProcess
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The metrics of a node started with `--metrics-port 0`, fetched from inside its namespace (the node
    serves them on the namespace's own loopback)."""
    url = node.wait_event("metrics", 30)["url"]
    fetch = (
        f"import sys, urllib.request as r; sys.stdout.write(r.urlopen({url!r}, timeout=10).read().decode())"
    )
    argv = Network.exec_argv(host, [swarm.python, "-c", fetch])
    return metric_samples(subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout)


def test_nodes_on_separate_addresses_train(swarm: LocalTestSwarm, network: Network) -> None:
    """Bootstrap, two stage nodes and the data node each in its own namespace on one switched segment,
    direct TCP on: each is reachable at its own address, the run trains, and the stage nodes' hops took
    the sealed direct path (the default between hosts), never the plaintext one."""
    hosts = [network.host(name) for name in ("boot", "s1", "s2", "data")]
    bootstrap(swarm, hosts[0])
    stages = [
        join(swarm, hosts[1], 1, "--metrics-port", "0"),
        join(swarm, hosts[2], 2, "--metrics-port", "0"),
    ]
    swarm.wait_online(*stages, timeout=ONLINE_S)
    data = join(swarm, hosts[3], 0)
    finished = trains(data)
    assert finished["microbatches_lost"] == 0
    for node, host in zip(stages, hosts[1:3], strict=True):
        seen = scrape(swarm, host, node)
        assert seen[("swarmnode_streams_opened_total", (("path", "encrypted"),))] >= 1, seen
        assert seen[("swarmnode_streams_opened_total", (("path", "direct"),))] == 0, seen
    for node, host in zip([*stages, data], hosts[1:], strict=True):
        line = node.wait_event("reachability", 60)
        assert line["reachable"] is True, line
        assert line["address"].startswith(f"/ip4/{host.address}/tcp/"), line


def test_volunteer_behind_nat_joins_and_trains(swarm: LocalTestSwarm, network: Network) -> None:
    """Stage 2 runs behind a masquerading router that forwards nothing inbound (and drops what comes to the
    router itself). Its reachability line says peers cannot reach it and what to do; it joins and the run
    trains through it: peers reach it over the libp2p connections it opened to them (measured with `ss`:
    the data node's connection to it comes from the router's address), and its peers' direct TCP path to
    it falls back to libp2p. The relayed path is the next test's."""
    boot, s1, data_host = (network.host(name) for name in ("boot", "s1", "data"))
    home = network.host_behind_nat("home")
    public = ("--reachability", "public")
    bootstrap(swarm, boot, *public)
    s1_node = join(swarm, s1, 1, *public)
    volunteer = join(swarm, home, 2, "--use-auto-relay", "--reachability", "private")
    swarm.wait_online(s1_node, volunteer, timeout=ONLINE_S)
    line = volunteer.wait_event("reachability", 60)
    assert line["reachable"] is False, line
    assert line["message"].startswith("not reachable from the swarm"), line
    assert "--announce-maddrs" in line["message"] and "open TCP port" in line["message"], line
    assert s1_node.wait_event("reachability", 60)["reachable"] is True
    data = join(swarm, data_host, 0, *public)
    trains(data)


def test_volunteers_behind_two_nats_train_through_a_relay(swarm: LocalTestSwarm, network: Network) -> None:
    """Stage 2 and the data node each behind their own masquerading router: neither can open a connection
    to the other, so the hops between them (stage 2's forward to the data node, the data node's backward to
    stage 2) can only cross a relay. Both join with `--use-auto-relay` and nothing else: their records list
    their initial peer, the bootstrap, as their relay, and the bootstrap splices the streams each opens to
    the other there (`transport._relay`). The run trains without losing a microbatch, and stage 2's streams
    to the data node went through the relay."""
    boot, s1 = (network.host(name) for name in ("boot", "s1"))
    home, cafe = network.host_behind_nat("home"), network.host_behind_nat("cafe")
    bootstrap(swarm, boot)
    s1_node = join(swarm, s1, 1)
    volunteer = join(swarm, home, 2, "--use-auto-relay", "--metrics-port", "0")
    swarm.wait_online(s1_node, volunteer, timeout=ONLINE_S)
    line = volunteer.wait_event("reachability", 60)
    assert line["reachable"] is False and "relays" in line["message"], line
    data = join(swarm, cafe, 0, "--use-auto-relay")
    finished = trains(data)
    assert finished["microbatches_lost"] == 0, finished
    seen = scrape(swarm, home, volunteer)
    assert seen[("swarmnode_streams_opened_total", (("path", "relayed"),))] >= 1, seen
