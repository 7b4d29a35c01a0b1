"""What the serving side takes in: request bodies within a byte budget and above a rate floor.

A body's bytes are taken from the budget as they arrive (its tensors' memory is written as they do, see
`_framing.read_tensors`) and given back once its request is answered, so a head announcing a large body costs
nothing until the body comes; a body slower than `min_body_rate` after `body_grace` is dropped.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from hivemind.p2p import PeerID

from swarmnode.transport._config import TransportConfig, TransportStats
from swarmnode.transport._framing import read_into


class Refusal(Exception):
    """A stream or request the server refuses: answered `code`, counted in `TransportStats.refused`."""

    def __init__(self, reason: str, code: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.code = code
        self.message = message


class Dropped(Exception):
    """A stream the server closes without an answer, counted in `TransportStats.dropped` under `reason`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class InboundBudget:
    """Request-body bytes held by the server (received, request not yet answered), in all and per peer."""

    def __init__(self, config: TransportConfig, stats: TransportStats) -> None:
        self._total = config.max_inbound_bytes
        self._per_peer = config.max_inbound_bytes_per_peer
        self._stats = stats
        self._held: Counter[PeerID] = Counter()

    def admit(self, peer_id: PeerID, body_len: int) -> None:
        """Refuse at once a body that could never fit the peer's share."""
        if body_len > self._per_peer:
            raise Refusal("bytes", "overloaded", f"a body of {body_len} bytes; at most {self._per_peer}")

    def take(self, peer_id: PeerID, n: int) -> None:
        """Count `n` more bytes held for `peer_id`; raises Refusal if that goes past either bound."""
        held = self._stats.inbound_bytes + n
        if held > self._total or self._held[peer_id] + n > self._per_peer:
            raise Refusal("bytes", "overloaded", "inbound byte budget exhausted")
        self._held[peer_id] += n
        self._stats.inbound_bytes = held
        self._stats.inbound_bytes_peak = max(self._stats.inbound_bytes_peak, held)

    def give_back(self, peer_id: PeerID, n: int) -> None:
        self._held[peer_id] -= n
        if not self._held[peer_id]:
            del self._held[peer_id]
        self._stats.inbound_bytes -= n


class BodyReader:
    """Reads one request body for `read_tensors`: each chunk is taken from the budget, and the body must keep
    up with the rate floor. `close` gives its bytes back."""

    def __init__(
        self, budget: InboundBudget, peer_id: PeerID, reader: asyncio.StreamReader, config: TransportConfig
    ) -> None:
        self._budget = budget
        self._peer_id = peer_id
        self._fill = read_into(reader)
        self._rate = config.min_body_rate
        self._start = asyncio.get_running_loop().time() + config.body_grace
        self._taken = 0

    async def readinto(self, view: memoryview) -> int:
        """Fill `view` with the bytes that come (0 once the stream ended); Dropped if they come later than the
        rate floor allows."""
        # at the floor rate, the bytes taken so far were due by this time: the next ones must come by then
        due = self._start + self._taken / self._rate if self._rate > 0 else None
        try:
            async with asyncio.timeout_at(due):
                n = await self._fill(view)
        except TimeoutError:  # only this bound raises it here: a deadline outside cancels instead
            raise Dropped("slow_body", f"body under {self._rate:g} B/s after {self._taken} bytes") from None
        self._budget.take(self._peer_id, n)
        self._taken += n
        return n

    def close(self) -> None:
        self._budget.give_back(self._peer_id, self._taken)
        self._taken = 0
