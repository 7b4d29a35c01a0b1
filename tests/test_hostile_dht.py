"""Hostile bytes on the DHT: a ~700-byte msgpack value nested 200 deep used to crash the DHT of any node
that decoded it (a C stack overflow, before any validator ran). Now every decoder refuses it, and a daemon
whose p2pd dies stops with a clear message instead of living on as a zombie.

The attacker is a real libp2p peer (hivemind's P2P and p2pd) speaking hivemind's DHT protocol to real
daemons: the bootstrap and a stage node.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import msgpack
import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PHandlerError
from hivemind.proto import dht_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time
from procinfo import group_members
from swarm_harness import LocalTestSwarm, NodeProcess, poll

from protocols.messages import NodeRecord, NodeState, encode
from swarmnode import msgpack_guard
from swarmnode.dht import SwarmDHT
from swarmnode.identity import Identity
from swarmnode.procstat import processes
from swarmnode.records import SwarmRecordValidator, decode_run, run_key, signed_bytes, stage_key, subkey_of
from swarmnode.runspec import RunSpec, RunSpecError

TUPLE_EXT = 0x40  # hivemind's extension type for tuples
STORE = "DHTProtocol.rpc_store"  # hivemind's handler name for DHT stores


def nested(depth: int) -> bytes:
    """`[1]` wrapped `depth` times in hivemind's tuple extension: 714 bytes at depth 200."""
    value = msgpack.packb([1])
    for _ in range(depth):
        value = msgpack.packb(msgpack.ExtType(TUPLE_EXT, value))
    return value


BOMB = nested(200)


def test_the_bomb_is_small_and_crashes_an_unguarded_decoder() -> None:
    """The attack is real here: without the guard, decoding it kills the process (SIGSEGV), not an error."""
    assert len(BOMB) < 1000
    script = (
        "import sys; from hivemind.utils import MSGPackSerializer; "
        "MSGPackSerializer.loads(sys.stdin.buffer.read())"
    )
    crashed = subprocess.run([sys.executable, "-c", script], input=BOMB, capture_output=True, timeout=60)
    assert crashed.returncode == -signal.SIGSEGV
    guarded = subprocess.run(
        [sys.executable, "-c", "from swarmnode import msgpack_guard; msgpack_guard.install(); " + script],
        input=BOMB,
        capture_output=True,
        timeout=60,
    )
    assert guarded.returncode == 1 and b"NestingTooDeep" in guarded.stderr


def test_guarded_decoders_refuse_deep_nesting_and_keep_shallow_values() -> None:
    msgpack_guard.install()
    assert msgpack_guard.installed()
    with pytest.raises(msgpack_guard.NestingTooDeep):
        MSGPackSerializer.loads(BOMB)
    shallow = (1, (2, (3, ("x",))), [4])
    assert MSGPackSerializer.loads(MSGPackSerializer.dumps(shallow)) == shallow
    assert MSGPackSerializer.loads(nested(msgpack_guard.MAX_EXT_DEPTH)) is not None
    with pytest.raises(RunSpecError):
        decode_run(BOMB)
    identity = Identity.generate()
    validator = SwarmRecordValidator("bombed", identity)
    owned = MSGPackSerializer.dumps(subkey_of(identity.peer_id))
    for key in (stage_key("bombed", 1), run_key("bombed")):
        key_id = DHTID.generate(source=key).to_bytes()
        assert not validator.validate(DHTRecord(key_id, BOMB, b"x" * 80, get_dht_time() + 10))
        bombed = DHTRecord(key_id, owned, BOMB, get_dht_time() + 10)
        assert not validator.validate(dataclasses.replace(bombed, value=validator.sign_value(bombed)))


async def _attack(victims: list[str], maddrs: list[str], run_id: str) -> int:
    """Send every store that carries the bomb to each victim; returns how many requests were answered
    with an error (the victim refused them) rather than a crash."""
    p2p = await P2P.create(initial_peers=maddrs)
    refused = 0
    try:
        for victim in victims:
            peer = PeerID.from_base58(victim)
            expiry = get_dht_time() + 30
            stage = DHTID.generate(source=stage_key(run_id, 1)).to_bytes()
            other = DHTID.generate(source="anything").to_bytes()
            for key, subkey, value in (
                (other, DHTProtocol.IS_DICTIONARY, BOMB),  # a whole-dictionary store, before any validator
                (other, BOMB, b"value"),  # a subkey, decoded by the signature validator
                (stage, BOMB, b"value"),  # our run's key: our validator decodes the subkey
                (stage, MSGPackSerializer.dumps(b"x"), BOMB),  # ...and the value
            ):
                request = dht_pb2.StoreRequest(
                    keys=[key], subkeys=[subkey], values=[value], expiration_time=[expiry], in_cache=[False]
                )
                try:
                    response = await asyncio.wait_for(
                        p2p.call_protobuf_handler(peer, STORE, request, dht_pb2.StoreResponse), 10
                    )
                    refused += not any(response.store_ok)
                except P2PHandlerError:  # the victim's handler failed: it answered with an error
                    refused += 1
    finally:
        await p2p.shutdown()
    return refused


def _peer_id(node: NodeProcess) -> str:
    return node.events("online")[0]["peer_id"]


def _dialable(maddrs: list[str], node: NodeProcess) -> list[str]:
    """The bootstrap's addresses and the node's own: a stranger dials its victims directly rather than
    waiting for its libp2p routing table to learn them."""
    return maddrs + node.events("online")[0]["maddrs"]


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_a_stranger_cannot_crash_a_daemon_with_deep_msgpack(swarm: LocalTestSwarm) -> None:
    bootstrap = swarm.bootstrap(steps=1)
    node = swarm.join(1)
    swarm.wait_online(node)
    before = {node.name: group_members([node.pgid]), bootstrap.name: group_members([bootstrap.pgid])}
    maddrs = swarm.peers_file.read_text().split()
    victims = [_peer_id(node), maddrs[0].rsplit("/p2p/", 1)[1]]

    refused = asyncio.run(_attack(victims, _dialable(maddrs, node), swarm.run_id))

    assert refused == 8  # four bombs, two victims: each refused
    for process in (bootstrap, node):
        process.check_alive()
        assert group_members([process.pgid]) == before[process.name]  # its p2pd lives on
    summary = swarm.status()  # the swarm still reads: the node's DHT publishes its record
    assert [p["peer_id"] for s in summary["stages"] if s["stage"] == 1 for p in s["peers"]] == [victims[0]]


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_daemon_whose_p2p_daemon_dies_stops_and_leaves_nothing(swarm: LocalTestSwarm) -> None:
    swarm.bootstrap(steps=1)
    node = swarm.join(1)
    swarm.wait_online(node)
    children = [proc for proc in processes() if proc.ppid == node.pid and not proc.zombie]
    assert [proc.comm for proc in children] == ["p2pd"], children  # the DHT runs in the daemon's own process
    killed_at = time.monotonic()
    os.kill(children[0].pid, signal.SIGKILL)  # as a crash would

    assert node.wait_exit(30) == 1
    assert time.monotonic() - killed_at < 10
    assert "the DHT's p2p daemon" in node.stderr_tail() and "Stopping" in node.stderr_tail()
    poll(lambda: not group_members([node.pgid]), 10, "nothing of the daemon's to be left")


async def _impersonate(victims: list[str], maddrs: list[str], run_id: str, attacker: Identity) -> list[bool]:
    """Store, at each victim, a record in the name of victims[0]: signed with the attacker's own key, and
    expiring in five minutes. Returns each victim's store_ok."""
    p2p = await P2P.create(initial_peers=maddrs)
    try:
        key = DHTID.generate(source=stage_key(run_id, 1)).to_bytes()
        subkey = MSGPackSerializer.dumps(subkey_of(victims[0]))
        value = MSGPackSerializer.dumps(encode(NodeRecord(NodeState.ONLINE, 1, 10**6, 0)))
        expiry = get_dht_time() + 300
        signature = attacker.sign(signed_bytes(key, subkey, value, expiry))
        request = dht_pb2.StoreRequest(
            keys=[key],
            subkeys=[subkey],
            values=[value + signature],
            expiration_time=[expiry],
            in_cache=[False],
        )
        answers = []
        for victim in victims:
            call = p2p.call_protobuf_handler(
                PeerID.from_base58(victim), STORE, request, dht_pb2.StoreResponse
            )
            answers.append(all((await asyncio.wait_for(call, 10)).store_ok))
        return answers
    finally:
        await p2p.shutdown()


async def _publish_run(spec: RunSpec, maddrs: list[str], seconds: float) -> str:
    """A stranger's own DHT peer publishes its run definition under the run's key, validly self-signed."""
    dht = SwarmDHT(spec.run_id, maddrs)
    try:
        if not await dht.publish_run(spec, seconds):
            raise RuntimeError("the stranger's run definition was not stored")
        return dht.peer_id
    finally:
        await dht.close()


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_a_stranger_can_neither_speak_for_a_node_nor_redefine_the_run(swarm: LocalTestSwarm) -> None:
    swarm.bootstrap(steps=1)
    node = swarm.join(1)
    swarm.wait_online(node)
    maddrs = swarm.peers_file.read_text().split()
    victims = [_peer_id(node), maddrs[0].rsplit("/p2p/", 1)[1]]

    forged = asyncio.run(_impersonate(victims, _dialable(maddrs, node), swarm.run_id, Identity.generate()))
    assert forged == [False, False]
    evil = RunSpec.for_preset("tiny", run_id=swarm.run_id, stages=1, lr=10.0)
    stranger = asyncio.run(_publish_run(evil, maddrs, 300.0))

    summary = swarm.status()  # reads the run through the bootstrap's address: the bootstrap owns the run
    assert len(summary["stages"]) == 4  # the bootstrap's three transformer stages, not the stranger's one
    peers = [p for s in summary["stages"] for p in s["peers"]]
    assert [(p["peer_id"], p["step"]) for p in peers] == [(victims[0], 0)]  # no forged step 10**6
    late = swarm.join(2)  # a later joiner also takes the owner's definition
    swarm.wait_online(late)
    assert late.events("online")[0]["stage"] == 2
    watcher = swarm.swarmnode(
        "status-owner", "status", "--initial-peers", str(swarm.peers_file), "--run-id", swarm.run_id,
        "--run-owner", stranger, "--json",
    )  # fmt: skip
    assert watcher.wait_exit(60) == 0
    assert len(json.loads(watcher.lines()[-1])["stages"]) == 2  # named as the owner, the stranger is believed
