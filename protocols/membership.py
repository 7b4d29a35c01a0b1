"""A daemon's membership as machines, sans-I/O: which stage it takes (`--stage auto`) and when a spare
replica moves to a stage that lost its last node (`--rebalance`).

Like `iteration.DataIteration`, each machine takes frozen events and returns frozen actions; the runtime
(`node/run.py` for `StageClaim`, `node/stage.py` for `Rebalance`) reads the DHT, pings peers, publishes
records and sleeps. Time comes in as durations the actions name, randomness as the `random.Random` given.

`StageClaim`: look at the live swarm, choose a stage (`choose_stage`); one that has a node is taken at once
(replicas may share it); an empty one is claimed (a `joining` record) and looked at again after the claim
settled (`settle_seconds`), then kept or left to a rival (`leaves_claim`), and another stage chosen. A kept
stage is announced `recovering` while the node is built: a republished `joining` record would look younger
than a rival's claim, and both would keep the stage.

`Rebalance`: a transformer stage is lost when it was seen served and none of its nodes answers now (a
stage never served belongs to a swarm still forming). Lost on a look, then still lost after a random delay
(spares of different stages seldom decide at once), a stage draws the lowest-id replica of a stage that
keeps another live replica (two replicas never both leave).

`RebuildWait`: a data node of a run that skips nothing waits, for a bounded time, for its lost stages'
rebuild (`stages_to_wait_for`) rather than train past them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from protocols.errors import LocalProtocolError
from protocols.messages import NodeState


@dataclass(frozen=True)
class Member:
    """A node of a stage as the DHT shows it: its peer id, state, record expiry and throughput."""

    peer_id: str
    state: NodeState
    expires_at: float
    throughput: float = 0.0


LiveView = Mapping[int, Sequence[Member]]  # every stage's live members: answering nodes, and claims


def choose_stage(live: LiveView) -> int:
    """`--stage auto`, given the live nodes of every stage: a stage with none first (the data stage first),
    else the transformer stage with the fewest replicas, then the least throughput per replica."""
    if not live:
        raise LocalProtocolError("no stages to choose from")
    for stage in sorted(live):
        if not live[stage]:
            return stage

    def per_replica(stage: int) -> float:
        return sum(m.throughput for m in live[stage]) / len(live[stage]) ** 2

    transformer = [k for k in live if k > 0]
    if not transformer:
        raise LocalProtocolError("no transformer stage to choose from")
    return min(transformer, key=lambda k: (len(live[k]), per_replica(k), k))


SETTLE_STORES = 3.0  # a claim settles for this many times its own store's duration (`settle_seconds`)


def settle_seconds(floor_s: float, store_s: float) -> float:
    """How long a claim settles before the look that decides it: a rival's claim stored at the same moment
    is in flight for about as long as this node's own store took (tens of ms on loopback, more on a loaded
    machine or across a WAN), so `SETTLE_STORES` times that, and at least `floor_s`."""
    for name, value in (("floor_s", floor_s), ("store_s", store_s)):
        if not math.isfinite(value) or value < 0:
            raise LocalProtocolError(f"{name} must be a duration, got {value!r}")
    return max(floor_s, SETTLE_STORES * store_s)


def leaves_claim(me: str, claimants: Sequence[Member]) -> bool:
    """Whether this node, having claimed an empty stage, leaves it to a rival found there one settle later.
    A rival that already rebuilds or serves the stage keeps it; of two claims the older one keeps it (the
    lower peer id on a tie). Claims are ordered by expiry (same ttl, so by publication): a node whose first
    look missed a rival, because the rival's claim was stored after it, sees that rival as younger, and the
    rival, which did see it, leaves. My own claim missing from the view means no one saw it: leave."""
    mine = [m for m in claimants if m.peer_id == me]
    rivals = [m for m in claimants if m.peer_id != me]
    if not rivals:
        return False
    if not mine:
        return True
    own = (mine[0].expires_at, me)
    return any(m.state != NodeState.JOINING or (m.expires_at, m.peer_id) < own for m in rivals)


# ---- choosing a stage ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Looked:
    """The live view, read (records, pings) after a `Look`."""

    live: LiveView


@dataclass(frozen=True)
class Look:
    """Read the live view after `after_s` seconds (after a `Claim`: `settle_seconds(after_s, its store's
    duration)`); report `Looked`."""

    after_s: float


@dataclass(frozen=True)
class Claim:
    """Publish a `joining` record for `stage`."""

    stage: int


@dataclass(frozen=True)
class Take:
    """Serve `stage`: build the node while a `recovering` record for it is republished every period."""

    stage: int


ClaimAction = Look | Claim | Take


class ClaimPhase(StrEnum):
    LOOKING = "looking"  # waiting for the first view, or for the view after leaving a claim
    CLAIMING = "claiming"  # a claim published: waiting for the view after it settled
    TAKEN = "taken"


_LEFT = Member("(claimed by a rival)", NodeState.JOINING, math.inf)  # stands in for a stage left


class StageClaim:
    """`--stage auto` for the node `me` in a run of `stages` transformer stages (stages 0..stages)."""

    def __init__(self, *, me: str, stages: int, settle_s: float) -> None:
        if stages < 1:
            raise LocalProtocolError(f"a run has at least one transformer stage, got {stages}")
        if not math.isfinite(settle_s) or settle_s < 0:
            raise LocalProtocolError(f"settle_s must be a duration, got {settle_s!r}")
        self.me = me
        self.stages = stages
        self.settle_s = settle_s
        self.phase = ClaimPhase.LOOKING
        self.stage: int | None = None  # the stage claimed, then taken
        self.left: frozenset[int] = frozenset()  # stages whose claim this node left to a rival

    def start(self) -> tuple[ClaimAction, ...]:
        return (Look(0.0),)

    def handle(self, event: Looked) -> tuple[ClaimAction, ...]:
        """The next actions after a view; raises LocalProtocolError for a view of another run's stages or
        one that comes after the stage was taken."""
        if set(event.live) != set(range(self.stages + 1)):
            raise LocalProtocolError(f"a view of stages {sorted(event.live)}, not 0..{self.stages}")
        if self.phase is ClaimPhase.TAKEN:
            raise LocalProtocolError(f"stage {self.stage} is taken already")
        if self.phase is ClaimPhase.CLAIMING and self.stage is not None:
            claimed = self.stage
            if not leaves_claim(self.me, event.live[claimed]):
                return self._take(claimed)
            self.left |= {claimed}
        live = {k: (*members,) or ((_LEFT,) if k in self.left else ()) for k, members in event.live.items()}
        stage = choose_stage(live)
        if live[stage]:
            return self._take(stage)  # not an empty stage: several joiners may share it
        self.phase, self.stage = ClaimPhase.CLAIMING, stage
        return Claim(stage), Look(self.settle_s)  # a rival's claim stored at the same moment becomes visible

    def _take(self, stage: int) -> tuple[ClaimAction, ...]:
        self.phase, self.stage = ClaimPhase.TAKEN, stage
        return (Take(stage),)


# ---- moving to a lost stage ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Viewed:
    """The DHT view's online nodes of every stage (records only: a dead node's outlives it)."""

    online: Mapping[int, frozenset[str]]


@dataclass(frozen=True)
class Probed:
    """The answers to a `Probe`: per stage probed, the other peers that answer a ping serving it."""

    live: Mapping[int, frozenset[str]]


@dataclass(frozen=True)
class Probe:
    """Ping the online nodes (but this one) of `stages`; report `Probed`."""

    stages: tuple[int, ...]


@dataclass(frozen=True)
class Wait:
    """Wait `seconds`, read the view again and report `Viewed`."""

    seconds: float


@dataclass(frozen=True)
class Move:
    """Leave this stage, rejoin as `stage` and rebuild it."""

    stage: int


RebalanceAction = Probe | Wait | Move


class RebalancePhase(StrEnum):
    IDLE = "idle"  # between looks
    LOOKING = "looking"  # probing the stages seen served
    WAITING = "waiting"  # a stage looked lost: a random delay before the second look
    CONFIRMING = "confirming"  # probing again, with this node's own stage
    MOVED = "moved"


class Rebalance:
    """`--rebalance` for the node `me` of transformer stage `stage` (of `stages`): each look is a `Viewed`."""

    def __init__(self, *, me: str, stage: int, stages: int, max_delay_s: float, rng: random.Random) -> None:
        if not 1 <= stage <= stages:
            raise LocalProtocolError(f"stage {stage} is no transformer stage of 1..{stages}")
        if not math.isfinite(max_delay_s) or max_delay_s < 0:
            raise LocalProtocolError(f"max_delay_s must be a duration, got {max_delay_s!r}")
        self.me = me
        self.stage = stage
        self.stages = stages
        self.max_delay_s = max_delay_s
        self.rng = rng
        self.phase = RebalancePhase.IDLE
        self.served: frozenset[int] = frozenset()  # other transformer stages this node has seen served
        self._probed: tuple[int, ...] = ()  # the stages of the probe out

    def handle(self, event: Viewed | Probed) -> tuple[RebalanceAction, ...]:
        """The next actions (none once moved). A `Viewed` while a probe is out starts the look over (the
        probe failed); a `Probed` with no probe out raises LocalProtocolError."""
        if self.phase is RebalancePhase.MOVED:
            return ()
        if isinstance(event, Viewed):
            others = range(1, self.stages + 1)
            self.served |= {k for k in others if k != self.stage and event.online.get(k)}
            if self.phase is not RebalancePhase.WAITING:
                self.phase = RebalancePhase.LOOKING
                return self._probe(*sorted(self.served)) if self.served else self._idle()
            self.phase = RebalancePhase.CONFIRMING
            return self._probe(*sorted(self.served), self.stage)
        if self.phase not in (RebalancePhase.LOOKING, RebalancePhase.CONFIRMING):
            raise LocalProtocolError(f"answers to no probe while {self.phase}")
        if not set(self._probed) <= set(event.live):
            raise LocalProtocolError(f"answers for stages {sorted(event.live)}, probed {self._probed}")
        lost = sorted(k for k in self.served if not event.live.get(k))
        if self.phase is RebalancePhase.LOOKING:
            if not lost:
                return self._idle()
            self.phase = RebalancePhase.WAITING
            return (Wait(self.rng.uniform(0.0, self.max_delay_s)),)
        replicas = event.live.get(self.stage, frozenset()) - {self.me}
        if lost and replicas and self.me < min(replicas):
            self.phase = RebalancePhase.MOVED
            return (Move(lost[0]),)
        return self._idle()

    def _probe(self, *stages: int) -> tuple[RebalanceAction, ...]:
        self._probed = stages
        return (Probe(stages),)

    def _idle(self) -> tuple[RebalanceAction, ...]:
        self.phase = RebalancePhase.IDLE
        return ()


def stages_to_wait_for(online: Collection[int], stages: int, skip_ratio: float) -> list[int]:
    """The transformer stages (of 1..`stages`) with no online node that a data node waits for rather than
    train past: all of them in a run that skips nothing (`skip_ratio` 0: its model never learnt to do
    without a stage, and its other stages would learn from paths that it will not use again once the
    stage is rebuilt), none in a run that skips (SkipPipe's paths route around a lost stage)."""
    if skip_ratio > 0:
        return []
    return [k for k in range(1, stages + 1) if k not in online]


@dataclass(frozen=True)
class WaitUpdate:
    """What `RebuildWait.update` decided: whether to wait this time; `began` when stages were first found
    lost now; `ended_after_s` when every stage is online again, after that long a wait."""

    waits: bool
    began: bool = False
    ended_after_s: float | None = None


class RebuildWait:
    """Whether a data node waits, rather than train past its lost stages, for their rebuild: from the first
    time it finds one lost, for at most `limit_s`; after that (no node rebuilds them) it trains past them,
    as a run that skips does. A default `up` (stage 2 killed at step 100 of 200, down 27 s) that trained
    past it ended 3% behind the single process; see docs/design.md, "Failures and recovery"."""

    def __init__(self, limit_s: float) -> None:
        if not (math.isfinite(limit_s) and limit_s >= 0):
            raise LocalProtocolError(f"limit_s must be a finite number of seconds >= 0, got {limit_s!r}")
        self.limit_s = limit_s
        self._since: float | None = None

    def update(self, lost: Sequence[int], now: float) -> WaitUpdate:
        if not lost:
            since, self._since = self._since, None
            return WaitUpdate(False, ended_after_s=None if since is None else now - since)
        began = self._since is None
        if began:
            self._since = now
        return WaitUpdate(now - self._since < self.limit_s, began=began)
