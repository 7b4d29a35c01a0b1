"""The daemons' event lines (`swarmnode.event_schema`): what the emitter refuses, what readers make of lines,
and that every `emit` in the daemon names a kind and the fields the schema defines."""

from __future__ import annotations

import ast
import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest

import swarmnode
from protocols.checkfree import Method
from swarmnode.event_schema import (
    KINDS,
    RECOVERY_METHODS,
    EventSchemaError,
    Exported,
    Finished,
    Joining,
    MicrobatchLost,
    Online,
    OuterStep,
    Recovered,
    Step,
    Validation,
    check_fields,
    parse_line,
)
from swarmnode.node.events import emit

START = 1_700_000_000.0
SOURCES = sorted(Path(swarmnode.__file__).parent.rglob("*.py"))


def line(event: str, at: float, **fields: object) -> str:
    return json.dumps({"event": event, **fields, "time": START + at})


def test_readers_get_typed_records() -> None:
    joined = parse_line(line("joining", 1, phase="stage", stage=2, seconds=3.2), 0)
    assert joined == Joining("stage", 3.2, START + 1, stage=2)
    assert parse_line(line("joining", 1, phase="dht", seconds=1.0), 0) == Joining("dht", 1.0, START + 1)
    online = Online(2, "12D3KooWx", START + 1)
    assert parse_line(line("online", 1, stage=2, peer_id="12D3KooWx"), 0) == online
    dialed = line("online", 1, stage=2, peer_id="12D3KooWx", maddrs=["/ip4/127.0.0.1/tcp/1/p2p/12D3KooWx"])
    assert parse_line(dialed, 0).maddrs == ("/ip4/127.0.0.1/tcp/1/p2p/12D3KooWx",)
    step = line("step", 2, step=3, loss=5.0, tokens=8, lost=1, seconds=1.25, grad_norm=0.5, paths=[[0, 1, 0]])
    assert parse_line(step, 0) == Step(3, 5.0, 8, START + 2, 1, 1.25, 0.5, ((0, 1, 0),))
    assert parse_line(line("step", 2, step=12, loss=None, tokens=0), 0) == Step(12, None, 0, START + 2)
    assert parse_line(line("validation", 3, step=0, val_loss=8.3), 0) == Validation(0, 8.3, START + 3)
    recovered = line("recovered", 4, stage=2, method="checkfree", seconds=2.1, reason="r")
    assert parse_line(recovered, 0) == Recovered(2, "checkfree", 2.1, START + 4, "r")
    assert parse_line(line("microbatch_lost", 5, step=7, count=3), 0) == MicrobatchLost(7, START + 5, 3)
    assert parse_line(line("microbatch_lost", 5, step=7), 0) == MicrobatchLost(7, START + 5, 1)
    outer = line("outer_step", 6, stage=1, outer_step=3, paired=True, matched=True, partner="p", reason="")
    assert parse_line(outer, 0) == OuterStep(1, 3, True, True, START + 6, "p", "")
    exported = line("exported", 7, path="/m", step=4, steps={"0": 4, "1": 3}, val_loss=None)
    assert parse_line(exported, 0) == Exported("/m", 4, {"0": 4, "1": 3}, None, START + 7)


def test_a_missing_time_is_the_time_received_and_unknown_fields_are_ignored() -> None:
    assert parse_line('{"event": "step", "step": 1, "loss": 2.0, "tokens": 8}', 42.0) == Step(1, 2.0, 8, 42.0)
    newer = line("recovered", 4, stage=2, method="replica", seconds=1.0, peer_id="p", donors=3)
    assert parse_line(newer, 0) == Recovered(2, "replica", 1.0, START + 4)


def test_a_non_finite_loss_reads_as_none_where_one_may_be_missing() -> None:
    assert parse_line(line("step", 1, step=2, loss=math.nan, tokens=4, grad_norm=math.inf), 0) == Step(
        2, None, 4, START + 1
    )
    assert parse_line(line("finished", 1, step=9, loss=math.inf, val_loss=5.0), 0) == Finished(
        9, START + 1, None, 5.0
    )


@pytest.mark.parametrize(
    "text",
    [
        "INFO hivemind started",
        "{not json",
        "[1, 2]",
        '{"event": "unknown"}',
        '{"no": "event"}',
        '{"event": "step", "step": "3", "loss": 1.0, "tokens": 1}',
        '{"event": "step", "step": -1, "loss": 1.0, "tokens": 1}',
        '{"event": "step", "step": true, "loss": 1.0, "tokens": 1}',
        '{"event": "step", "step": 3, "tokens": 1}',
        '{"event": "step", "step": 3, "loss": 1.0, "tokens": 1, "paths": [[0, "x"]]}',
        '{"event": "validation", "step": 3, "val_loss": NaN}',
        '{"event": "microbatch_lost", "step": 3, "count": -2}',
        '{"event": "recovered", "stage": 2, "method": "magic", "seconds": 1}',
        '{"event": "online", "stage": 1}',
        '{"event": "outer_step", "stage": 1, "outer_step": 2, "paired": 1, "matched": true}',
        '{"event": "metrics", "url": "file:///etc/passwd", "port": 1}',
        '{"event": "exported", "path": "/m", "step": 1, "steps": [1], "val_loss": null}',
    ],
)
def test_a_malformed_line_is_skipped_with_a_warning(text: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="swarmnode.event_schema"):
        assert parse_line(text, 0.0) is None
    assert [r.levelno for r in caplog.records] == [logging.WARNING]


def test_an_empty_line_is_no_event_and_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert parse_line("  \n", 0.0) is None
    assert not caplog.records


def test_the_emitter_prints_what_readers_read(capsys: pytest.CaptureFixture[str]) -> None:
    emit("step", step=3, loss=math.nan, lost=1, tokens=8, seconds=0.5, grad_norm=math.inf, paths=[[0, 1, 0]])
    emit("recovered", stage=2, method="reinit", seconds=1.5, reason="no neighbour")
    first, second = capsys.readouterr().out.splitlines()
    step, recovered = parse_line(first, 0.0), parse_line(second, 0.0)
    assert isinstance(step, Step) and (step.step, step.loss, step.lost, step.paths) == (
        3,
        None,
        1,
        ((0, 1, 0),),
    )
    assert isinstance(recovered, Recovered) and recovered.reason == "no neighbour"


@pytest.mark.parametrize(
    ("kind", "fields", "problem"),
    [
        ("stepped", {"step": 1}, "unknown event"),
        ("step", {"step": 1, "tokens": 8}, "misses its field 'loss'"),
        ("step", {"step": 1, "loss": 1.0, "tokens": 8, "lots": 3}, "no field lots"),
        ("step", {"step": "1", "loss": 1.0, "tokens": 8}, "step must be a count"),
        ("validation", {"step": 1, "val_loss": "low"}, "val_loss must be a number"),
        ("recovered", {"stage": 1, "method": "magic", "seconds": 1.0}, "method must be one of"),
        ("online", {"stage": 1, "peer_id": None}, "peer_id must be a str"),
        ("state_snapshot", {"stage": 1, "step": 2, "parts": "weights"}, "parts must be a list"),
    ],
)
def test_the_emitter_raises_for_an_event_off_the_schema(
    kind: str, fields: dict[str, Any], problem: str
) -> None:
    with pytest.raises(EventSchemaError, match=problem):
        emit(kind, **fields)


def test_a_non_finite_value_is_no_bug() -> None:
    check_fields("validation", {"step": 3, "val_loss": math.nan})  # a diverged run says so; readers skip it
    check_fields("finished", {"step": 3, "loss": math.inf, "val_loss": None, "skips": 0})


def emits(path: Path) -> list[tuple[int, str, set[str]]]:
    """Every `emit("kind", name=...)` call in a source file: line, kind and the field names passed."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "emit":
            kind = node.args[0]
            if not isinstance(kind, ast.Constant) or not isinstance(kind.value, str) or len(node.args) != 1:
                raise AssertionError(
                    f"{path}:{node.lineno}: emit takes the kind as a literal, fields by name"
                )
            names = {keyword.arg for keyword in node.keywords}
            if None in names:
                raise AssertionError(f"{path}:{node.lineno}: emit with **fields the schema cannot check here")
            found.append((node.lineno, kind.value, {name for name in names if name is not None}))
    return found


def test_every_emit_in_the_daemon_names_a_kind_and_its_fields() -> None:
    calls = [(path, *call) for path in SOURCES for call in emits(path)]
    assert len(calls) >= 20  # the checker sees the daemon's calls
    for path, lineno, kind, names in calls:
        record = KINDS.get(kind)
        assert record is not None, f"{path}:{lineno}: unknown event {kind!r}"
        declared = {f.name for f in dataclasses.fields(record)} - {"time"}
        required = {f.name for f in dataclasses.fields(record) if f.default is dataclasses.MISSING} - {"time"}
        assert names <= declared, f"{path}:{lineno}: {kind} has no field {names - declared}"
        assert required <= names, f"{path}:{lineno}: {kind} misses {required - names}"
    assert {kind for *_, kind, _ in calls} == set(KINDS)  # no kind in the schema that nothing emits


def test_recovery_methods_are_the_recovery_plans() -> None:
    assert set(RECOVERY_METHODS) == {str(method) for method in Method}
