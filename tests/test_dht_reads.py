"""Reading the swarm off the DHT with what a daemon's footprint needs: every stage's records in one lookup
(real DHT peers on loopback), stores and reads that ask only the peers nearest a key, and each signature
checked once however many peers return the record."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from protocols.messages import NodeRecord, NodeState, encode
from swarmnode import records
from swarmnode.dht import NUM_REPLICAS, SwarmDHT
from swarmnode.identity import SIGNATURE_BYTES, Identity
from swarmnode.records import SwarmRecordValidator, stage_key, subkey_of


async def _expired(dht: SwarmDHT, stage: int, timeout: float) -> bool:
    """Whether `stage` reads empty within `timeout` seconds (polled)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not await dht.read_stage(stage):
            return True
        await asyncio.sleep(0.2)
    return False


def test_one_read_returns_every_stage_and_drops_expired_records() -> None:
    async def scenario() -> None:
        first = SwarmDHT("reads")
        second = SwarmDHT("reads", first.visible_maddrs())
        try:
            await first.publish(NodeRecord(NodeState.ONLINE, 1, 7, 0), 60.0)
            await second.publish(NodeRecord(NodeState.ONLINE, 2, 9, 0), 60.0)
            swarm = await second.read_swarm(3)
            assert sorted(swarm) == [0, 1, 2, 3]
            assert swarm[0] == swarm[3] == []
            assert [(p.peer_id, p.record.step) for p in swarm[1]] == [(first.peer_id, 7)]
            assert [(p.peer_id, p.record.step) for p in swarm[2]] == [(second.peer_id, 9)]
            assert await first.read_stage(2) == (await first.read_swarm(3))[2]
            assert await first.read_stages([2, 1]) == {2: swarm[2], 1: swarm[1]}

            await first.publish(NodeRecord(NodeState.ONLINE, 3, 1, 0), 5.0)
            assert [p.peer_id for p in await second.read_stage(3)] == [first.peer_id]
            assert await _expired(second, 3, 20.0), "a record past its expiry is still read"
            assert [p.peer_id for p in await second.read_stage(1)] == [first.peer_id]
            with pytest.raises(ValueError):
                await first.read_swarm(-1)
        finally:
            await second.close()
            await first.close()

    asyncio.run(scenario())


def test_every_peer_reads_every_newest_record_in_a_swarm_wider_than_the_replicas() -> None:
    """Stores and reads look for the NUM_REPLICAS peers nearest a key (not every peer): in a swarm of more
    peers than that, every peer still reads every peer's newest record of every stage."""

    async def scenario() -> None:
        peers = [SwarmDHT("wide")]
        try:
            while len(peers) < NUM_REPLICAS + 3:
                peers.append(SwarmDHT("wide", peers[0].visible_maddrs()))
            for step in (1, 2):
                await asyncio.gather(
                    *(
                        dht.publish(NodeRecord(NodeState.ONLINE, 1 + i % 3, step, 0), 60.0)
                        for i, dht in enumerate(peers)
                    )
                )
            expected = {
                stage: sorted(dht.peer_id for i, dht in enumerate(peers) if 1 + i % 3 == stage)
                for stage in (1, 2, 3)
            }
            for reader in peers:
                swarm = await reader.read_swarm(3)
                for stage in (1, 2, 3):
                    assert sorted(p.peer_id for p in swarm[stage]) == expected[stage]
                    assert {p.record.step for p in swarm[stage]} == {2}, "a read returned an older record"
        finally:
            for dht in peers:
                await dht.close()

    asyncio.run(scenario())


def _signed(validator: SwarmRecordValidator, owner: Identity, step: int) -> DHTRecord:
    record = DHTRecord(
        DHTID.generate(source=stage_key("reads", 1)).to_bytes(),
        MSGPackSerializer.dumps(subkey_of(owner.peer_id)),
        MSGPackSerializer.dumps(encode(NodeRecord(NodeState.ONLINE, 1, step, 0))),
        get_dht_time() + 30,
    )
    return dataclasses.replace(record, value=validator.sign_value(record))


def test_a_record_returned_by_several_peers_is_verified_once(monkeypatch: pytest.MonkeyPatch) -> None:
    owner = Identity.generate()
    validator = SwarmRecordValidator("reads", owner)
    checks: list[str] = []
    real_verify = records.verify

    def counted(peer: str, data: bytes, signature: bytes) -> bool:
        checks.append(peer)
        return real_verify(peer, data, signature)

    monkeypatch.setattr(records, "verify", counted)
    records._verified.cache_clear()
    genuine = _signed(validator, owner, 5)
    assert all(validator.validate(genuine) for _ in range(5))  # as from five replicas
    assert checks == [owner.peer_id]

    newer = _signed(validator, owner, 6)
    assert validator.validate(newer)
    assert len(checks) == 2, "a new value (a new step, a new expiry) is checked anew"

    signature = genuine.value[-SIGNATURE_BYTES:]
    forged = dataclasses.replace(genuine, value=newer.value[:-SIGNATURE_BYTES] + signature)
    assert not validator.validate(forged), "another value under a cached signature must fail"
    stretched = dataclasses.replace(genuine, expiration_time=genuine.expiration_time + 10)
    assert not validator.validate(stretched), "a cached signature must not cover another expiry"
