"""Reservation tables for the planner: when a node is busy and which microbatches it holds."""

from __future__ import annotations

from bisect import bisect_right


class Timeline:
    """Non-overlapping busy intervals of one node, sorted, plus the intervals its memory slots are held."""

    __slots__ = ("ends", "holds", "starts")

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.holds: list[tuple[float, float]] = []

    def earliest_start(self, ready: float, duration: float) -> float:
        """The first moment at or after `ready` when a task of `duration` fits between reservations."""
        start = ready
        for i in range(bisect_right(self.ends, ready), len(self.starts)):
            if start + duration <= self.starts[i]:
                return start
            start = max(start, self.ends[i])
        return start

    def reserve(self, start: float, end: float) -> None:
        i = bisect_right(self.starts, start)
        self.starts.insert(i, start)
        self.ends.insert(i, end)

    def slot_free(self, ready: float, memory: int) -> float:
        """The first moment at or after `ready` when fewer than `memory` microbatches are held."""
        if len(self.holds) < memory or sum(1 for a, b in self.holds if a <= ready < b) < memory:
            return ready
        for moment in sorted(b for _, b in self.holds if b > ready):
            if sum(1 for a, b in self.holds if a <= moment < b) < memory:
                return moment
        return ready  # unreachable: after the last release nothing is held

    def holders(self, start: float, end: float) -> int:
        """The most microbatches held at once during [start, end)."""
        overlapping = [(a, b) for a, b in self.holds if a < end and b > start]
        if len(overlapping) < 2:
            return len(overlapping)
        points = []
        for a, b in overlapping:
            points += [(max(a, start), 1), (min(b, end), -1)]
        most = held = 0
        for _, change in sorted(points):  # at equal times a release comes before a take
            held += change
            most = max(most, held)
        return most
