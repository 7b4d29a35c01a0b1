"""One node as read from the DHT, without the DHT: importable where hivemind is not (the launcher's
simulation of the planner). `swarmnode.records` reads and checks these records on the DHT."""

from __future__ import annotations

from dataclasses import dataclass

from protocols.messages import NodeRecord


@dataclass(frozen=True)
class PeerRecord:
    """One node as seen on the DHT."""

    peer_id: str
    record: NodeRecord
    expires_at: float
