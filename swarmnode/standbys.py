"""Standby records on the DHT: a standby node's announcement under `{run}.standby` (subkey its peer id,
signed like every record: `records.SwarmRecordValidator`), published by the standby and read by the other
standbys and by `swarmnode status`."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from hivemind.utils import get_dht_time

from protocols.errors import ProtocolError
from protocols.messages import encode
from protocols.standby import StandbyRecord
from swarmnode.dht import SwarmDHT
from swarmnode.records import decode_standby, peer_of_subkey, standby_key

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StandbyPeer:
    """One standby as seen on the DHT."""

    peer_id: str
    record: StandbyRecord
    expires_at: float


async def publish_standby(dht: SwarmDHT, record: StandbyRecord, ttl: float) -> bool:
    """Store this node's standby record for `ttl` seconds."""
    return await dht.store(standby_key(dht.run_id), encode(record), ttl)


async def read_standbys(dht: SwarmDHT) -> list[StandbyPeer]:
    """The live standby records of the run (those standing by and those that took a stage lately), sorted
    by peer id; invalid ones are skipped with a warning."""
    found = await dht.get_latest(standby_key(dht.run_id))
    if found is None or not isinstance(found.value, dict):
        return []
    now = get_dht_time()
    peers = []
    for subkey, item in found.value.items():
        peer_id = peer_of_subkey(subkey)
        if item.expiration_time <= now:
            continue
        try:
            if peer_id is None:
                raise ProtocolError("the subkey names no peer")
            peers.append(StandbyPeer(peer_id, decode_standby(item.value), item.expiration_time))
        except ProtocolError as error:
            logger.warning("skipping a standby record: %s", error.reason)
    return sorted(peers, key=lambda p: p.peer_id)
