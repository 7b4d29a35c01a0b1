"""Standby records on the DHT: a standby node's announcement under `{run}.standby` (subkey its peer id,
signed like every record: `records.SwarmRecordValidator`), published by the standby and read by the other
standbys and by `swarmnode status`."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from hivemind.utils import get_dht_time

from protocols.errors import ProtocolError
from protocols.messages import encode
from protocols.standby import StandbyRecord
from swarmnode.dht import DHT_CALL_TIMEOUT_S, SwarmDHT
from swarmnode.records import decode_standby, peer_of_subkey, standby_key, subkey_of

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StandbyPeer:
    """One standby as seen on the DHT."""

    peer_id: str
    record: StandbyRecord
    expires_at: float


async def publish_standby(dht: SwarmDHT, record: StandbyRecord, ttl: float) -> bool:
    """Store this node's standby record for `ttl` seconds."""
    stored = dht.dht.store(
        standby_key(dht.run_id),
        encode(record),
        get_dht_time() + ttl,
        subkey=subkey_of(dht.peer_id),
        return_future=True,
    )
    return await asyncio.wait_for(stored, DHT_CALL_TIMEOUT_S)


async def read_standbys(dht: SwarmDHT) -> list[StandbyPeer]:
    """The live standby records of the run (those standing by and those that took a stage lately), sorted
    by peer id; invalid ones are skipped with a warning."""
    found = await asyncio.wait_for(
        dht.dht.get(standby_key(dht.run_id), latest=True, return_future=True), DHT_CALL_TIMEOUT_S
    )
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
