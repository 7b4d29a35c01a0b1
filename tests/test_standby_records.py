"""Standby records: signed and checked under `{run}.standby` like node records, and listed by `status`."""

from __future__ import annotations

import dataclasses

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from protocols.messages import NodeRecord, NodeState, encode
from protocols.standby import StandbyRecord
from swarmnode.identity import Identity
from swarmnode.records import SwarmRecordValidator, standby_key, subkey_of
from swarmnode.runspec import RunSpec
from swarmnode.standbys import StandbyPeer
from swarmnode.status import format_table, swarm_summary


def dht_record(key: str, subkey: bytes, value: bytes) -> DHTRecord:
    return DHTRecord(
        DHTID.generate(source=key).to_bytes(),
        MSGPackSerializer.dumps(subkey),
        MSGPackSerializer.dumps(value),
        get_dht_time() + 60.0,
    )


def test_standby_records_are_signed_and_must_decode_as_one() -> None:
    owner, stranger = Identity.generate(), Identity.generate()
    mine, theirs = SwarmRecordValidator("run", owner), SwarmRecordValidator("run", stranger)
    subkey = subkey_of(owner.peer_id)

    def signed(validator: SwarmRecordValidator, value: bytes) -> DHTRecord:
        record = dht_record(standby_key("run"), subkey, value)
        return dataclasses.replace(record, value=validator.sign_value(record))

    good = encode(StandbyRecord(site="Belgium"))
    assert mine.validate(signed(mine, good)) and theirs.validate(signed(mine, good))
    assert not mine.validate(dht_record(standby_key("run"), subkey, good))  # unsigned
    assert not mine.validate(signed(theirs, good))  # a stranger in the owner's name
    assert not mine.validate(signed(mine, encode(NodeRecord(NodeState.ONLINE, 1, 0, 0))))  # another schema


def test_status_lists_the_standbys() -> None:
    spec = RunSpec.for_preset("tiny")
    standbys = [
        StandbyPeer("12D3KooWstandbyA", StandbyRecord(), 1e12),
        StandbyPeer("12D3KooWtookB", StandbyRecord(2), 1e12),
    ]
    summary = swarm_summary("run", spec, {}, standbys)
    assert summary["standbys"] == [
        {"peer_id": "12D3KooWstandbyA", "taken": None, "site": None},
        {"peer_id": "12D3KooWtookB", "taken": 2, "site": None},
    ]
    table = format_table(summary)
    assert "..KooWstandbyA standby" in table and "..2D3KooWtookB took 2" in table
    assert swarm_summary("run", spec, {})["standbys"] == []
