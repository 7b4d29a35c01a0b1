"""Which peers a data node plans with: the DHT's records, each remembered for a grace period.

A record lives `record_ttl_s` (4 s) and is republished every second. On a loaded machine a node's publish,
or this node's read of the DHT, can be late by more than that, and a live stage vanishes from one read: a
data node that planned from that read alone routed every microbatch of the iteration past the stage (paths
`0, 1, 3, 0` in a run whose skip ratio is 0), which trains a different network for that step and made the
outcome of a run depend on the machine's load. So a peer seen online is remembered for `grace_s` after the
last read that showed it. It is forgotten at once when a read shows its record in another state (leaving,
recovering) or under another stage only, or when calls to it failed and the latest read lacks it too
(`forget`): a peer that is really gone is found out sooner by the calls that fail to reach it than by its
record's expiry.

Sans-I/O: reads come in as `(peer, stage, online)` sightings with the time they were made.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from protocols.errors import LocalProtocolError

Sighting = tuple[str, int, bool]  # peer id, stage of the record, whether the record says online


class Sightings:
    """The (peer, stage) pairs seen online within the last `grace_s` seconds, by the reads given."""

    def __init__(self, grace_s: float) -> None:
        if not (math.isfinite(grace_s) and grace_s >= 0):
            raise LocalProtocolError(f"grace_s must be a finite number >= 0, got {grace_s!r}")
        self.grace_s = grace_s
        self._seen: dict[tuple[str, int], float] = {}  # (peer, stage) -> when last read online

    def observe(self, read: Iterable[Sighting], now: float) -> None:
        """One read of the DHT, made at `now`."""
        online: dict[str, set[int]] = {}
        other: set[tuple[str, int]] = set()
        for peer, stage, is_online in read:
            if is_online:
                online.setdefault(peer, set()).add(stage)
            else:
                other.add((peer, stage))
        for peer, stages in online.items():
            for stage in stages:
                self._seen[(peer, stage)] = now
            for moved in [key for key in self._seen if key[0] == peer and key[1] not in stages]:
                del self._seen[moved]  # it moved to another stage
        for key in other:
            if key[0] not in online or key[1] not in online[key[0]]:
                self._seen.pop(key, None)  # its record says it is leaving or recovering
        for key in [key for key, seen in self._seen.items() if now - seen > self.grace_s]:
            del self._seen[key]

    def forget(self, peers: Iterable[str]) -> None:
        """Drop `peers` (calls to them failed): what the next read shows of them counts again."""
        gone = set(peers)
        for key in [key for key in self._seen if key[0] in gone]:
            del self._seen[key]

    def present(self, now: float) -> set[tuple[str, int]]:
        """The (peer, stage) pairs to plan with at `now`."""
        return {key for key, seen in self._seen.items() if now - seen <= self.grace_s}
