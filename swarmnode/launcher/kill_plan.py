"""Failure injection for the local swarm: kills at given steps, and random kills at a given rate.

Pure planning: the caller passes the clock and the training step, and owns the processes.

The random failure rate follows the CheckFree paper's definition, scaled from hours to minutes for a demo:
`rate` is the probability that a given transformer stage suffers a failure within one minute of training.
Each transformer stage fails independently, as a Poisson process of intensity `-ln(1 - rate)` per minute;
a failure kills one random live node of that stage (the whole stage only if it has a single node).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class StageKill:
    """`--kill STAGE@STEP`: kill every node of `stage` when the data nodes reach `step`."""

    stage: int
    step: int

    def __str__(self) -> str:
        return f"{self.stage}@{self.step}"


@dataclass(frozen=True)
class Kill:
    """A failure to inject now: `stage` loses every node (`whole_stage`) or one random node."""

    stage: int
    whole_stage: bool

    @property
    def cause(self) -> str:
        return "planned" if self.whole_stage else "random"


def parse_stage_kill(text: str) -> StageKill:
    """Parse `STAGE@STEP` (for example `2@50`); raises ValueError with a one-line message."""
    stage_text, sep, step_text = text.strip().partition("@")
    if not sep or not stage_text.strip().isdigit() or not step_text.strip().isdigit():
        raise ValueError(f"{text!r} is not STAGE@STEP (two whole numbers, for example 2@50)")
    kill = StageKill(int(stage_text), int(step_text))
    if kill.step < 1:
        raise ValueError(f"{text!r}: the step must be at least 1")
    return kill


class RandomKills:
    """Seeded Poisson failures per stage; see the module docstring for the meaning of `rate`."""

    def __init__(self, rate: float, stages: Sequence[int], seed: int) -> None:
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"the failure rate is a probability per stage per minute in [0, 1), got {rate}")
        self._per_second = -math.log1p(-rate) / 60.0
        self._clocks = {stage: random.Random(f"{seed}:fail:{stage}") for stage in stages}
        self._victims = random.Random(f"{seed}:victims")
        self._next: dict[int, float] | None = None

    @property
    def started(self) -> bool:
        return self._next is not None

    def start(self, now: float) -> None:
        """Start the failure clocks (the launcher does so when training starts)."""
        rate = self._per_second
        self._next = (
            {stage: now + clock.expovariate(rate) for stage, clock in self._clocks.items()} if rate else {}
        )

    def due(self, now: float) -> list[int]:
        """Stages that fail at or before `now`, in time order (a stage may appear more than once)."""
        if not self._next:
            return []
        fired: list[tuple[float, int]] = []
        for stage, at in self._next.items():
            while at <= now:
                fired.append((at, stage))
                at += self._clocks[stage].expovariate(self._per_second)
            self._next[stage] = at
        return [stage for _, stage in sorted(fired)]

    def choose(self, candidates: Sequence[T]) -> T:
        """The victim among a failing stage's nodes (seeded, so a run can be repeated)."""
        return self._victims.choice(candidates)


class KillPlan:
    """What to kill, and when: `--kill` entries by step, plus random failures by wall clock."""

    def __init__(self, planned: Iterable[StageKill], random_kills: RandomKills) -> None:
        self._pending = sorted(planned, key=lambda kill: (kill.step, kill.stage))
        self.random_kills = random_kills

    def due(self, now: float, step: int) -> list[Kill]:
        """Kills to inject now, given the data nodes' step; each planned kill fires once."""
        fired = [kill for kill in self._pending if kill.step <= step]
        self._pending = [kill for kill in self._pending if kill.step > step]
        kills = [Kill(kill.stage, whole_stage=True) for kill in fired]
        if step >= 1 and not self.random_kills.started:
            self.random_kills.start(now)
        return kills + [Kill(stage, whole_stage=False) for stage in self.random_kills.due(now)]
