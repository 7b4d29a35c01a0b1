"""The daemons' JSON event lines, defined once: every event kind, its fields and their types.

A daemon prints one JSON object per line on stdout, `{"event": KIND, "time": unix seconds, **fields}`
(`swarmnode.node.events.emit`). Each kind is a frozen record below: fields without a default must be in
every line of that kind, fields with one may be left out. The emitter checks its fields here
(`check_fields`) and raises EventSchemaError for an unknown kind or a missing, undeclared or mistyped field:
a bug. Readers (the launcher, the test harness, benchmarks) parse lines into the records (`parse_line`):
a line that is no event line or breaks the schema is skipped with a warning, never an error; a field a
newer daemon added is ignored.

A float may be non-finite where a run diverged (a loss, an overflowed gradient norm): the emitter writes it
as JSON's NaN or Infinity; a reader takes it as None in a field that may be None, and skips the line
otherwise. Counts (steps, stages, ports) are non-negative ints.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

logger = logging.getLogger(__name__)

RECOVERY_METHODS = ("replica", "checkfree", "checkfree_plus_copy", "edge_copy", "embedding_copy", "reinit")


class EventSchemaError(ValueError):
    """An event that breaks the schema: raised by the emitter (a bug in the daemon)."""


class MalformedEvent(EventSchemaError):
    """A line or value that breaks the schema (the message says how): readers skip the line."""


def _choice(*allowed: str) -> dict[str, Any]:
    return {"valid": (lambda value: value in allowed, f"one of {', '.join(allowed)}")}


_HTTP_URL = {"valid": (lambda value: value.startswith("http://") and len(value) < 200, "an http:// URL")}


@dataclass(frozen=True)
class EventRecord:
    """Base of every event kind: `KIND` is its `"event"` name; `time` the unix time it was emitted at."""

    KIND: ClassVar[str]


@dataclass(frozen=True)
class Joining(EventRecord):
    """A daemon reached a phase of joining: its DHT started, or its stage chosen (`stage`)."""

    KIND: ClassVar[str] = "joining"
    phase: str = field(metadata=_choice("dht", "stage"))
    seconds: float
    time: float
    stage: int | None = None


@dataclass(frozen=True)
class Online(EventRecord):
    """A daemon serves `stage` under `peer_id`, computing on `device` in `dtype`; peers dial `maddrs`."""

    KIND: ClassVar[str] = "online"
    stage: int
    peer_id: str
    time: float
    device: str | None = None
    dtype: str | None = None
    maddrs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Step(EventRecord):
    """A data node finished optimizer step `step` (1-based); `loss` is None when it was not finite. `lost`
    microbatches were lost; `seconds`: how long the iteration took; `paths`: the stages of each path."""

    KIND: ClassVar[str] = "step"
    step: int
    loss: float | None
    tokens: int
    time: float
    lost: int = 0
    seconds: float | None = None
    grad_norm: float | None = None
    paths: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class Progress(EventRecord):
    """A stage node's periodic account (every `human_lines.PROGRESS_EVERY_STEPS` steps of its clock): its
    step and outer step, the microbatches it served and dropped, tokens per busy second."""

    KIND: ClassVar[str] = "progress"
    stage: int
    step: int
    outer_step: int
    served: int
    lost: int
    tokens_per_second: float
    time: float


@dataclass(frozen=True)
class IterationFailed(EventRecord):
    """A data node's iteration ended with every microbatch lost: no step."""

    KIND: ClassVar[str] = "iteration_failed"
    iteration: int
    lost: int
    seconds: float
    time: float


@dataclass(frozen=True)
class Validation(EventRecord):
    """A data node's validation loss after `step` steps (step 0: before training)."""

    KIND: ClassVar[str] = "validation"
    step: int
    val_loss: float
    time: float


@dataclass(frozen=True)
class MicrobatchLost(EventRecord):
    """A data node gave up on `count` microbatches (their paths hit dead nodes and timed out)."""

    KIND: ClassVar[str] = "microbatch_lost"
    step: int
    time: float
    count: int = 1


@dataclass(frozen=True)
class MetricsServed(EventRecord):
    """A daemon serves its Prometheus metrics at `url` (`--metrics-port`)."""

    KIND: ClassVar[str] = "metrics"
    url: str = field(metadata=_HTTP_URL)
    port: int
    time: float


@dataclass(frozen=True)
class Bootstrapped(EventRecord):
    """The bootstrap peer published run `run_id` (its definition `run`) and listens on `maddrs`."""

    KIND: ClassVar[str] = "bootstrap"
    run_id: str
    maddrs: tuple[str, ...]
    run: Mapping[str, Any]
    time: float


@dataclass(frozen=True)
class Reachability(EventRecord):
    """Whether peers can reach this node (None: no peer answered the check), at `address`."""

    KIND: ClassVar[str] = "reachability"
    reachable: bool | None
    address: str | None
    checked_by: str | None
    message: str
    time: float


@dataclass(frozen=True)
class Seeded(EventRecord):
    """A node loaded the run's seeded initial weights of `stage` (their digest)."""

    KIND: ClassVar[str] = "seeded"
    stage: int
    digest: str
    time: float


@dataclass(frozen=True)
class Recovered(EventRecord):
    """A node rebuilt or took over stage `stage` by `method` in `seconds`."""

    KIND: ClassVar[str] = "recovered"
    stage: int
    method: str = field(metadata=_choice(*RECOVERY_METHODS))
    seconds: float
    time: float
    reason: str | None = None


@dataclass(frozen=True)
class RequestRejected(EventRecord):
    """A node refused a peer's request (`code`: the error code)."""

    KIND: ClassVar[str] = "rejected"
    peer_id: str
    code: str
    reason: str
    time: float


@dataclass(frozen=True)
class StateSnapshot(EventRecord):
    """A node took a snapshot of `parts` of its state at `step` to serve joiners."""

    KIND: ClassVar[str] = "state_snapshot"
    stage: int
    step: int
    parts: tuple[str, ...]
    time: float


@dataclass(frozen=True)
class CopyRefreshed(EventRecord):
    """A node replaced its CheckFree+ copy `part` with one `donor` sent at the donor's step `step` (a copy
    refused, or no donor reached, leaves the old one and prints nothing)."""

    KIND: ClassVar[str] = "copy_refreshed"
    stage: int
    part: str
    donor: str
    step: int
    time: float


@dataclass(frozen=True)
class Moving(EventRecord):
    """A spare replica leaves `from_stage` to rebuild `to_stage`, which lost its last node."""

    KIND: ClassVar[str] = "moving"
    from_stage: int
    to_stage: int
    time: float


@dataclass(frozen=True)
class Finished(EventRecord):
    """A data node took the run's last step (a lingering one stays online, serving its weights)."""

    KIND: ClassVar[str] = "finished"
    step: int
    time: float
    loss: float | None = None
    val_loss: float | None = None
    microbatches_lost: int = 0
    failures_seen: int = 0
    reroutes: int = 0
    skips: int = 0
    routes_reported: int = 0


@dataclass(frozen=True)
class OuterStep(EventRecord):
    """A node of `stage` took NoLoCo outer step `outer_step`: `paired` with a replica, or alone; `matched`:
    whether the pairing gave it a partner at all (a lone replica, or the odd one out, has none)."""

    KIND: ClassVar[str] = "outer_step"
    stage: int
    outer_step: int
    paired: bool
    matched: bool
    time: float
    partner: str | None = None
    reason: str | None = None


@dataclass(frozen=True)
class OuterApplied(EventRecord):
    """A node of `stage` applied outer step `outer_step`'s update right after the step that took its clock to
    `clock`; `due` is the clock it was due at (the copy's clock plus one), null when its exchange ran late
    and it was applied when it ended."""

    KIND: ClassVar[str] = "outer_applied"
    stage: int
    outer_step: int
    clock: int
    time: float
    due: int | None = None


@dataclass(frozen=True)
class Exported(EventRecord):
    """`swarmnode export` wrote a model folder at `path` (each stage's step in `steps`)."""

    KIND: ClassVar[str] = "exported"
    path: str
    step: int
    steps: Mapping[str, int]
    val_loss: float | None
    time: float


KINDS: dict[str, type[EventRecord]] = {
    kind.KIND: kind
    for kind in (
        Joining,
        Online,
        Step,
        Progress,
        IterationFailed,
        Validation,
        MicrobatchLost,
        MetricsServed,
        Bootstrapped,
        Reachability,
        Seeded,
        Recovered,
        RequestRejected,
        StateSnapshot,
        CopyRefreshed,
        Moving,
        Finished,
        OuterStep,
        OuterApplied,
        Exported,
    )
}


def check_fields(kind: str, values: Mapping[str, Any]) -> None:
    """What `emit(kind, **values)` may print: raises EventSchemaError for an unknown kind, an undeclared
    field, a missing one or a value of the wrong type (non-finite floats are allowed)."""
    record = KINDS.get(kind)
    if record is None:
        raise EventSchemaError(f"unknown event {kind!r}; the schema has {', '.join(sorted(KINDS))}")
    undeclared = set(values) - set(_fields(record)) - {"time"}
    if undeclared:
        raise EventSchemaError(f"event {kind!r} has no field {', '.join(sorted(undeclared))}")
    for name, (hint, required, valid) in _fields(record).items():
        if name == "time":
            continue
        if name not in values:
            if required:
                raise EventSchemaError(f"event {kind!r} misses its field {name!r}")
            continue
        try:
            _value(values[name], hint, valid, finite=False)
        except MalformedEvent as error:
            raise EventSchemaError(f"event {kind!r}: {name} {error}") from None


def parse_line(line: str, received: float) -> EventRecord | None:
    """The event on one line of a daemon's stdout, or None (with a warning) if the line is none or breaks
    the schema. `received` stands in for a missing `"time"`."""
    text = line.strip()
    if not text:
        return None
    try:
        return parse_object(json.loads(text), received)
    except json.JSONDecodeError:
        problem = "not JSON"
    except MalformedEvent as error:
        problem = str(error)
    logger.warning("skipping a line that is no valid event (%s): %.200s", problem, text)
    return None


def parse_object(raw: object, received: float) -> EventRecord:
    """The event record of one decoded line (fields it does not declare are ignored); raises MalformedEvent
    if it breaks the schema."""
    if not isinstance(raw, dict):
        raise MalformedEvent("not a JSON object")
    kind = raw.get("event")
    record = KINDS.get(kind) if isinstance(kind, str) else None
    if record is None:
        raise MalformedEvent(f"unknown event {kind!r}")
    values = {}
    for name, (hint, required, valid) in _fields(record).items():
        if name == "time" and not isinstance(raw.get("time"), int | float):
            values[name] = received
        elif name in raw:
            try:
                values[name] = _value(raw[name], hint, valid, finite=True)
            except MalformedEvent as error:
                raise MalformedEvent(f"{kind} {name} {error}") from None
        elif required:
            raise MalformedEvent(f"{kind} without {name}")
    return record(**values)


Check = tuple[Callable[[Any], bool], str]  # a predicate on a field's value, and what it asks in words


@functools.cache
def _fields(record: type[EventRecord]) -> dict[str, tuple[Any, bool, Check | None]]:
    """Each field's type, whether every line must have it, and its extra check (a predicate, in words)."""
    hints = typing.get_type_hints(record)
    return {f.name: (hints[f.name], f.default is MISSING, f.metadata.get("valid")) for f in fields(record)}


def _value(value: object, hint: Any, valid: Check | None, finite: bool) -> Any:
    """`value` as `hint` says (lists become tuples); raises MalformedEvent. With `finite`, a non-finite float
    reads as None where the field may be None, and is invalid otherwise."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType):  # `X | None`
        if value is None:
            return None
        (inner,) = [arg for arg in args if arg is not type(None)]
        if finite and inner is float and _is_number(value) and not math.isfinite(value):  # type: ignore[arg-type]
            return None
        return _value(value, inner, valid, finite)
    origin = typing.get_origin(hint)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise MalformedEvent(f"must be a list, not {value!r:.60}")
        return tuple(_value(item, args[0], None, finite) for item in value)
    if origin is Mapping:
        if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
            raise MalformedEvent(f"must be a JSON object, not {value!r:.60}")
        return {key: _value(item, args[1], None, finite) for key, item in value.items()}
    if hint is Any:
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise MalformedEvent(f"must be a count (an int >= 0), not {value!r:.60}")
    elif hint is float:
        if not _is_number(value) or (finite and not math.isfinite(value)):  # type: ignore[arg-type]
            raise MalformedEvent(f"must be a {'finite ' if finite else ''}number, not {value!r:.60}")
        value = float(value)  # type: ignore[arg-type]
    elif not isinstance(value, hint) or (hint is not bool and isinstance(value, bool)):
        raise MalformedEvent(f"must be a {hint.__name__}, not {value!r:.60}")
    if valid is not None and not valid[0](value):
        raise MalformedEvent(f"must be {valid[1]}, not {value!r:.60}")
    return value


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
