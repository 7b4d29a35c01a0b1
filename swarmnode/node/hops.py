"""Who may send what about the microbatches a stage node has taken, whatever path their messages claim.

A message's path is written by its sender, so it cannot say who may send a gradient back or abort. This
node remembers, per microbatch it took: the path up to itself as it arrived, and every peer it tried to send
the microbatch on to (re-routes included, added before each try). Only one of those may send its gradient;
aborts come from those, the upstream peers or its data node.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from swarmnode.node.worker import Key


@dataclass
class _Hops:
    upstream: tuple[str, ...]
    downstream: set[str] = field(default_factory=set)


class HopBook:
    """The microbatches a node has taken and not yet finished (queued, held, or out downstream)."""

    def __init__(self) -> None:
        self._taken: dict[Key, _Hops] = {}

    def __len__(self) -> int:
        return len(self._taken)

    def __contains__(self, key: object) -> bool:
        return key in self._taken

    def take(self, key: Key, upstream: tuple[str, ...]) -> set[str]:
        """Remember a microbatch that arrived along `upstream`; returns the set to record its tries in."""
        self._taken[key] = _Hops(upstream)
        return self._taken[key].downstream

    def keys(self) -> frozenset[Key]:
        return frozenset(self._taken)

    def tries(self, key: Key) -> set[str] | None:
        """The set the router records its tries for `key` in, or None once `key` is finished or aborted."""
        hops = self._taken.get(key)
        return None if hops is None else hops.downstream

    def may_send_gradient(self, key: Key, peer: str) -> bool:
        hops = self._taken.get(key)
        return hops is not None and peer in hops.downstream

    def may_abort(self, key: Key, peer: str) -> bool:
        """An abort from the data node or a peer on the path as this node knows it; for a microbatch this
        node has not taken, anyone's (the tracker remembers it, for one expiry period at most)."""
        hops = self._taken.get(key)
        return hops is None or peer == key[0] or peer in hops.upstream or peer in hops.downstream

    def forget(self, key: Key) -> None:
        self._taken.pop(key, None)

    def forget_groups_except(self, open_groups: Collection[tuple[str, int]]) -> None:
        """Forget every microbatch whose group is closed or expired."""
        for key in [key for key in self._taken if key[:2] not in open_groups]:
            del self._taken[key]
