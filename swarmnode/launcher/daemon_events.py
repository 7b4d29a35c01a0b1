"""The daemons' JSON event lines, as the launcher reads them from each child's stdout.

Every daemon prints one JSON object per line with an `"event"` name and a unix `"time"`. Lines that are not
JSON objects, name an unknown event or carry mistyped fields are ignored: a log line never stops the launcher.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

RECOVERY_METHODS = ("replica", "checkfree", "checkfree_plus_copy", "embedding_copy", "reinit")


@dataclass(frozen=True)
class Joining:
    """A daemon chose its stage (after `--stage auto`) and is starting to serve it."""

    stage: int
    time: float


@dataclass(frozen=True)
class Online:
    """A daemon serves its stage under its peer id (after `--stage auto` chose the stage)."""

    stage: int
    peer_id: str
    time: float


@dataclass(frozen=True)
class Step:
    """A data node finished optimizer step `step` (1-based); `loss` is None when every microbatch was lost.
    `seconds`: how long its iteration took (None if the line did not say)."""

    step: int
    loss: float | None
    tokens: int
    time: float
    seconds: float | None = None


@dataclass(frozen=True)
class Validation:
    """A data node's validation loss after `step` steps (step 0: before training)."""

    step: int
    val_loss: float
    time: float


@dataclass(frozen=True)
class Recovered:
    """A node rebuilt or took over stage `stage` by `method` in `seconds`."""

    stage: int
    method: str
    seconds: float
    time: float


@dataclass(frozen=True)
class OuterStep:
    """A node of stage `stage` took NoLoCo outer step `outer_step`: `paired` with a replica, or alone;
    `matched`: whether the pairing gave it a partner at all (a lone replica, or the odd one out, has none)."""

    stage: int
    outer_step: int
    paired: bool
    matched: bool
    time: float


@dataclass(frozen=True)
class MicrobatchLost:
    """A data node gave up on `count` microbatches (their paths hit dead nodes and timed out)."""

    step: int
    count: int
    time: float


@dataclass(frozen=True)
class Finished:
    """A data node took the run's last step (a lingering one stays online, serving its weights)."""

    step: int
    time: float


@dataclass(frozen=True)
class MetricsServed:
    """A daemon serves its Prometheus metrics at `url` (`join --metrics-port`)."""

    url: str
    time: float


Event = (
    Joining | Online | Step | Validation | Recovered | OuterStep | MicrobatchLost | Finished | MetricsServed
)


def parse_event(line: str, received: float) -> Event | None:
    """The event on one stdout line, or None. `received` stands in for a missing or bad `"time"`."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        raw = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(raw, dict):
        return None
    stamp = _number(raw.get("time"))
    when = received if stamp is None else stamp
    match raw.get("event"):
        case "joining":
            stage = _count(raw.get("stage"))
            if stage is not None:
                return Joining(stage, when)
        case "online":
            stage, peer_id = _count(raw.get("stage")), raw.get("peer_id")
            if stage is not None and isinstance(peer_id, str):
                return Online(stage, peer_id, when)
        case "step":
            step, tokens, loss = (
                _count(raw.get("step")),
                _count(raw.get("tokens", 0)),
                _number(raw.get("loss")),
            )
            if step is not None and tokens is not None:
                seconds = _number(raw.get("seconds"))
                return Step(
                    step, loss, tokens, when, seconds if seconds is not None and seconds >= 0 else None
                )
        case "validation":
            step, val_loss = _count(raw.get("step")), _number(raw.get("val_loss"))
            if step is not None and val_loss is not None:
                return Validation(step, val_loss, when)
        case "recovered":
            stage, method, seconds = _count(raw.get("stage")), raw.get("method"), _number(raw.get("seconds"))
            if stage is not None and method in RECOVERY_METHODS and seconds is not None:
                return Recovered(stage, method, seconds, when)
        case "outer_step":
            stage, outer = _count(raw.get("stage")), _count(raw.get("outer_step"))
            paired, matched = raw.get("paired"), raw.get("matched")
            if (
                stage is not None
                and outer is not None
                and isinstance(paired, bool)
                and isinstance(matched, bool)
            ):
                return OuterStep(stage, outer, paired, matched, when)
        case "finished":
            step = _count(raw.get("step"))
            if step is not None:
                return Finished(step, when)
        case "metrics":
            url = raw.get("url")
            if isinstance(url, str) and url.startswith("http://") and len(url) < 200:
                return MetricsServed(url, when)
        case "microbatch_lost":
            step, count = _count(raw.get("step", 0)), _count(raw.get("count", 1))
            if step is not None and count is not None:
                return MicrobatchLost(step, count, when)
    return None


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _count(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value
