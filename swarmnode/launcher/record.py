"""What happened in a local swarm run: losses by step, evaluations, failures, recoveries, lost microbatches.

Several data nodes report each step; a step's loss is the mean over the nodes that reported it, placed in time
at the first report. Times are seconds since the launcher started.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

from swarmnode.event_schema import EventRecord, MicrobatchLost, OuterStep, Recovered, Step, Validation

FINAL_LOSS_STEPS = 10  # final_loss averages the last steps, as the single-process trainer does


@dataclass(frozen=True)
class Failure:
    """A node that died: killed by the plan (`planned`, `random`) or on its own (`crash`)."""

    seconds: float
    step: int
    stage: int | None
    peer_id: str | None
    node: str
    cause: str


@dataclass(frozen=True)
class RecoveryRecord:
    """A stage taken over or rebuilt, as the recovering node reported it (`duration`); `downtime` is how long
    the stage had no node at all before (None if it was never lost)."""

    seconds: float
    step: int
    stage: int
    method: str
    duration: float
    downtime: float | None


@dataclass
class OuterSteps:
    """NoLoCo outer steps of one stage's nodes: `rounds` taken, `paired` with a replica, `alone`, and of
    those alone, `unmatched`: the pairing gave them no partner (a lone replica, or the odd one out)."""

    rounds: int = 0
    paired: int = 0
    alone: int = 0
    unmatched: int = 0

    @property
    def paired_share(self) -> float | None:
        """Paired rounds over the rounds that had a partner to pair with (None if none had)."""
        matched = self.rounds - self.unmatched
        return self.paired / matched if matched else None


@dataclass(frozen=True)
class LostStage:
    """A stage left with no node at `seconds` (from the launcher's start), at data-node step `step`."""

    stage: int
    seconds: float
    step: int


@dataclass(frozen=True)
class CurvePoint:
    step: int
    loss: float
    seconds: float


class RunRecord:
    """Accumulates the run's events; `started` is the launcher's start as a unix time."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.failures: list[Failure] = []
        self.recoveries: list[RecoveryRecord] = []
        self.microbatches_lost = 0
        self._lost_since: dict[int, LostStage] = {}
        self._losses: dict[int, list[float]] = defaultdict(list)
        self._step_times: dict[int, float] = {}
        self._vals: dict[int, list[float]] = defaultdict(list)
        self._val_times: dict[int, float] = {}
        self._tokens: list[tuple[float, int]] = []
        self.iteration_seconds: list[float] = []  # the data nodes' iterations that ended in a step
        self.outer_steps: dict[int, OuterSteps] = defaultdict(OuterSteps)

    @property
    def step(self) -> int:
        """The furthest step any data node has finished."""
        return max(self._step_times, default=0)

    def add(self, event: EventRecord) -> None:
        """Record a daemon's event (events that carry no training figures are ignored)."""
        match event:
            case Step():
                seconds = event.time - self.started
                self._step_times.setdefault(event.step, seconds)
                self._tokens.append((seconds, event.tokens))
                if event.seconds is not None:
                    self.iteration_seconds.append(event.seconds)
                if event.loss is not None:
                    self._losses[event.step].append(event.loss)
            case Validation():
                self._val_times.setdefault(event.step, event.time - self.started)
                self._vals[event.step].append(event.val_loss)
            case Recovered():
                seconds = event.time - self.started
                lost = self._lost_since.pop(event.stage, None)
                downtime = None if lost is None else max(0.0, seconds - lost.seconds)
                recovery = RecoveryRecord(
                    seconds, self.step, event.stage, event.method, event.seconds, downtime
                )
                self.recoveries.append(recovery)
            case OuterStep():
                stage = self.outer_steps[event.stage]
                stage.rounds += 1
                stage.paired += int(event.paired)
                stage.alone += int(not event.paired)
                stage.unmatched += int(not event.matched)
            case MicrobatchLost():
                self.microbatches_lost += event.count

    def add_failure(
        self, when: float, stage: int | None, peer_id: str | None, node: str, cause: str
    ) -> Failure:
        """Record a node's death at unix time `when`, at the current step."""
        failure = Failure(when - self.started, self.step, stage, peer_id, node, cause)
        self.failures.append(failure)
        return failure

    def stage_lost(self, when: float, stage: int) -> None:
        """Stage `stage` has no node left since unix time `when` (until a node reports recovering it)."""
        self._lost_since.setdefault(stage, LostStage(stage, when - self.started, self.step))

    @property
    def unrecovered(self) -> list[LostStage]:
        """The stages lost and not recovered (so far), by stage."""
        return sorted(self._lost_since.values(), key=lambda lost: lost.stage)

    def loss_curve(self) -> list[CurvePoint]:
        return [
            CurvePoint(step, statistics.fmean(losses), self._step_times[step])
            for step, losses in sorted(self._losses.items())
        ]

    def val_curve(self) -> list[CurvePoint]:
        return [
            CurvePoint(step, statistics.fmean(vals), self._val_times[step])
            for step, vals in sorted(self._vals.items())
        ]

    @property
    def initial_loss(self) -> float | None:
        curve = self.loss_curve()
        return curve[0].loss if curve else None

    @property
    def final_loss(self) -> float | None:
        """Mean loss over the last `FINAL_LOSS_STEPS` recorded steps."""
        tail = self.loss_curve()[-FINAL_LOSS_STEPS:]
        return statistics.fmean(point.loss for point in tail) if tail else None

    @property
    def latest_loss(self) -> float | None:
        curve = self.loss_curve()
        return curve[-1].loss if curve else None

    @property
    def initial_val_loss(self) -> float | None:
        """Validation loss before training (an evaluation at step 0), if a data node reported one."""
        vals = self._vals.get(0)
        return statistics.fmean(vals) if vals else None

    @property
    def val_loss(self) -> float | None:
        """The latest validation loss."""
        curve = self.val_curve()
        return curve[-1].loss if curve else None

    def tokens_per_second(self, window: float | None = None, now: float | None = None) -> float | None:
        """Training tokens per second of all data nodes together, between their first and last step reports.

        With `window`, only over the last `window` seconds before unix time `now` (the live figure).
        """
        reports = sorted(self._tokens)
        if window is not None and now is not None:
            reports = [(at, tokens) for at, tokens in reports if at >= now - self.started - window]
        if len(reports) < 2:
            return None
        first, last = reports[0][0], reports[-1][0]
        if last <= first:
            return None
        return sum(tokens for _, tokens in reports[1:]) / (last - first)
