"""When may a stage step? Bookkeeping of the microbatches planned through this node, per iteration group.

A group is one data node's iteration: `(origin, iteration)`. Each forward message says how many of the
group's microbatches the plan sends through this node (`visits`); the group is complete once that many
(or as many as actually arrived, if re-routing sent more) have finished their backward pass or were
aborted. A node steps when every group it knows of is complete or expired and nothing is held, so no
global barrier is needed and no microbatch is applied twice.

An abort may arrive before any forward of its group (the microbatch died upstream, and this node is further
down its path): it is remembered for one expiry period, so that the group, once its other microbatches
arrive, does not wait for the one that never will.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from swarmnode.node.worker import Key

Group = tuple[str, int]

MAX_EARLY_ABORTS = 4096  # aborts remembered for groups not seen yet (a bound against a flood of them)


@dataclass
class _GroupState:
    created: float
    expected: int = 0
    seen: set[int] = field(default_factory=set)
    finished: set[int] = field(default_factory=set)
    applied: int = 0  # microbatches whose gradient reached this node's parameters

    @property
    def complete(self) -> bool:
        """Every microbatch that arrived has finished, and as many as planned have finished or been aborted
        (aborts may name microbatches that never arrived: they count toward the plan, not for the held)."""
        return self.seen <= self.finished and len(self.finished) >= self.expected


@dataclass(frozen=True)
class StepDecision:
    groups: int  # groups whose gradients are in `.grad` (the step averages over them)
    applied: int  # microbatches applied
    iteration: int | None  # the latest iteration (swarm clock tick) among them; None if none applied


class StepTracker:
    """Per-group accounting of planned, arrived and finished microbatches on one node."""

    def __init__(self, expiry_s: float) -> None:
        self.expiry_s = expiry_s
        self._groups: dict[Group, _GroupState] = {}
        self._closed: dict[Group, float] = {}  # finished groups, remembered to ignore late messages
        self._early: dict[Group, tuple[float, set[int]]] = {}  # aborts of groups not seen yet

    def on_forward(self, key: Key, expected: int, now: float) -> bool:
        """A forward pass arrived. False if it belongs to a group this node already stepped past."""
        group = key[:2]
        if group in self._closed:
            return False
        state = self._groups.get(group)
        if state is None:
            state = self._groups[group] = _GroupState(created=now)
            state.finished |= self._early.pop(group, (now, set()))[1]
        state.expected = max(state.expected, expected)
        if key[2] in state.seen or key[2] in state.finished:
            return False
        state.seen.add(key[2])
        return True

    def on_finished(self, key: Key, applied: bool, now: float) -> None:
        """A microbatch finished here: its backward pass ran (`applied`) or it was aborted. An abort for a
        group this node has not seen yet is remembered for one expiry period."""
        group = key[:2]
        state = self._groups.get(group)
        if state is None:
            if not applied and group not in self._closed:
                self._remember_early(group, key[2], now)
            return
        if key[2] in state.finished:
            return
        state.finished.add(key[2])
        state.applied += int(applied)

    def _remember_early(self, group: Group, microbatch: int, now: float) -> None:
        for old in [g for g, (seen_at, _) in self._early.items() if now - seen_at > self.expiry_s]:
            del self._early[old]
        if sum(len(keys) for _, keys in self._early.values()) >= MAX_EARLY_ABORTS:
            return
        self._early.setdefault(group, (now, set()))[1].add(microbatch)

    @property
    def open_groups(self) -> set[Group]:
        """Groups still waiting for microbatches (an expired group is no longer open)."""
        return {group for group, state in self._groups.items() if not state.complete}

    def expire(self, now: float) -> list[Group]:
        """Give up on groups older than the expiry (now complete); the caller drops what they hold."""
        expired = [g for g, s in self._groups.items() if not s.complete and now - s.created > self.expiry_s]
        for group in expired:
            state = self._groups[group]
            state.expected = 0
            state.finished |= state.seen
        return expired

    def ready(self, held: int, now: float) -> StepDecision | None:
        """A step decision if this node should step now (nothing held, every group complete), else None."""
        if held or not self._groups or not all(state.complete for state in self._groups.values()):
            return None
        applied = [group for group, state in self._groups.items() if state.applied]
        decision = StepDecision(
            groups=len(applied),
            applied=sum(state.applied for state in self._groups.values()),
            iteration=max((iteration for _, iteration in applied), default=None),
        )
        for group in self._groups:
            self._closed[group] = now
        self._groups.clear()
        self._forget(now)
        return decision

    def _forget(self, now: float) -> None:
        horizon = now - 10 * self.expiry_s
        for group in [g for g, closed in self._closed.items() if closed < horizon]:
            del self._closed[group]
