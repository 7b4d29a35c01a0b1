"""Standby nodes, sans-I/O: a node that has started everything but holds no stage, and takes a transformer
stage the moment its last node is gone.

A standby publishes a `StandbyRecord` under `{run}.standby` (subkey its peer id) and looks at the swarm
every `watch_s`: each look (`Watched`) is every stage's live members (`membership.LiveView`: online nodes
that answer a ping, and `joining`/`recovering` claims) and the standbys standing by. A transformer stage is
lost when this standby has seen it served (or the swarm has trained, so no stage of it is still forming)
and nothing of it is live now. The standbys split the lost stages by rank (sorted peer ids: the i-th takes
the i-th lost stage), so two standbys seldom want one stage; one that outranks nobody still claims a stage
lost for `patience_s` (its standby may have died). Claiming goes through the same records as `--stage
auto` (`membership.StageClaim`): a `joining` claim, a fresh look once it settled, then the stage is kept
(`membership.leaves_claim`: no older claim, no rival building or serving it) or the claim withdrawn (a
`leaving` record replaces it) and the node stands by again. So a claim race has one winner, and a stage
that only looked lost (its node answers again) is left alone. Data stages are not taken: data nodes drive
the run with their own shards and tokenizer, and leave when the run is done.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar

from protocols._message import MAX_STAGE, Message
from protocols._schema import checked, count, optional, text
from protocols.errors import LocalProtocolError
from protocols.links import MAX_SITE_CHARS
from protocols.membership import Claim, LiveView, Take, leaves_claim
from protocols.messages import NodeState


@dataclass(frozen=True)
class StandbyRecord(Message):
    """What a standby publishes under `{run}.standby`, subkey its peer id: standing by (`taken` None), or
    the stage it took (so that the status view and the other standbys stop counting it at once)."""

    KIND: ClassVar[str] = "standby_record"
    taken: int | None = field(default=None, metadata=checked(optional(count(MAX_STAGE))))
    site: str | None = field(default=None, metadata=checked(optional(text(MAX_SITE_CHARS, 1))))


@dataclass(frozen=True)
class Watched:
    """One look at the swarm at monotonic time `now`: every stage's live members, the peers whose standby
    records say they stand by, and whether any record shows a step (the swarm has trained)."""

    live: LiveView
    standbys: frozenset[str]
    trained: bool
    now: float


@dataclass(frozen=True)
class Watch:
    """Look again after `after_s` seconds and report `Watched`; `fresh`: read the records anew (else the
    records read within the last record period will do, with fresh pings)."""

    after_s: float
    fresh: bool


@dataclass(frozen=True)
class Withdraw:
    """Withdraw this node's claim on `stage` (publish a `leaving` record in its place)."""

    stage: int


StandbyAction = Watch | Claim | Withdraw | Take


class StandbyPhase(StrEnum):
    WATCHING = "watching"
    CLAIMING = "claiming"  # a claim published: waiting for the fresh look after it settled
    TAKEN = "taken"


def _duration(name: str, value: float) -> float:
    if not math.isfinite(value) or value < 0:
        raise LocalProtocolError(f"{name} must be a duration, got {value!r}")
    return value


class Standby:
    """The standby `me` of a run of `stages` transformer stages (stages 0..stages)."""

    def __init__(self, *, me: str, stages: int, watch_s: float, settle_s: float, patience_s: float) -> None:
        if stages < 1:
            raise LocalProtocolError(f"a run has at least one transformer stage, got {stages}")
        self.me = me
        self.stages = stages
        self.watch_s = _duration("watch_s", watch_s)
        self.settle_s = _duration("settle_s", settle_s)
        self.patience_s = _duration("patience_s", patience_s)
        self.phase = StandbyPhase.WATCHING
        self.stage: int | None = None  # the stage claimed, then taken
        self.served: frozenset[int] = frozenset()  # transformer stages seen with an answering online node
        self.lost_since: dict[int, float] = {}  # lost transformer stages, from the look that found them
        self._now = -math.inf

    def start(self) -> tuple[StandbyAction, ...]:
        return (Watch(0.0, fresh=True),)

    def handle(self, event: Watched) -> tuple[StandbyAction, ...]:
        """The next actions after a look. Raises LocalProtocolError for a view of another run's stages, a
        look from the past, or one after the stage was taken."""
        if set(event.live) != set(range(self.stages + 1)):
            raise LocalProtocolError(f"a view of stages {sorted(event.live)}, not 0..{self.stages}")
        if not event.now >= self._now:
            raise LocalProtocolError(f"a look at {event.now!r}, after one at {self._now!r}")
        if self.phase is StandbyPhase.TAKEN:
            raise LocalProtocolError(f"stage {self.stage} is taken already")
        self._now = event.now
        lost = self._lost(event)
        if self.phase is StandbyPhase.CLAIMING and self.stage is not None:
            claimed = self.stage
            if not leaves_claim(self.me, event.live[claimed]):
                self.phase = StandbyPhase.TAKEN
                return (Take(claimed),)
            self.phase, self.stage = StandbyPhase.WATCHING, None
            return Withdraw(claimed), Watch(self.watch_s, fresh=False)
        stage = self._mine(lost, event.standbys, event.now)
        if stage is None:
            return (Watch(self.watch_s, fresh=False),)
        self.phase, self.stage = StandbyPhase.CLAIMING, stage
        return Claim(stage), Watch(self.settle_s, fresh=True)

    def _lost(self, event: Watched) -> list[int]:
        """The lost transformer stages in this look (this node's own claims do not count as live)."""
        lost = []
        for k in range(1, self.stages + 1):
            others = [m for m in event.live[k] if m.peer_id != self.me]
            if any(m.state == NodeState.ONLINE for m in others):
                self.served |= {k}
            if not others and (k in self.served or event.trained):
                lost.append(k)
        self.lost_since = {k: self.lost_since.get(k, event.now) for k in lost}
        return lost

    def _mine(self, lost: list[int], standbys: frozenset[str], now: float) -> int | None:
        """The lost stage this standby claims: the one its rank gives it, else one lost for `patience_s`."""
        if not lost:
            return None
        rank = sorted(standbys | {self.me}).index(self.me)
        if rank < len(lost):
            return lost[rank]
        overdue = [k for k in lost if now - self.lost_since[k] >= self.patience_s]
        return overdue[rank % len(overdue)] if overdue else None
