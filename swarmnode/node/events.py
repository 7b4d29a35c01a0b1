"""One JSON object per line on stdout for every event a daemon reports (the launcher and logs read them),
of a kind and with fields that `swarmnode.event_schema` defines; or, for a volunteer at a terminal, a
human line for the events that matter to them (`print_human`, `node.human_lines`)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

from swarmnode.event_schema import check_fields
from swarmnode.node.human_lines import HumanLines

Listener = Callable[[str, dict[str, Any]], None]
_listeners: list[Listener] = []  # this process's (`listen`): the metrics of a daemon
_human: list[HumanLines] = []  # set by `print_human`: this process prints human lines, not JSON


def emit(event: str, **fields: Any) -> None:
    """Print `{"event": event, "time": <unix seconds>, **fields}` as one line (or its human line, after
    `print_human`) and flush; then tell the
    listeners. Raises `event_schema.EventSchemaError` if the event breaks the schema (a bug)."""
    check_fields(event, fields)
    now = time.time()
    if _human:
        line = _human[0].line(event, fields, now)
        if line is not None:
            sys.stdout.write(line + "\n")
    else:
        sys.stdout.write(json.dumps({"event": event, "time": round(now, 3), **fields}) + "\n")
    sys.stdout.flush()
    for listener in _listeners:
        listener(event, fields)


def listen(listener: Listener) -> None:
    """Call `listener(event, fields)` after every event this process emits from now on."""
    _listeners.append(listener)


def print_human(every_steps: int) -> None:
    """From now on, print this process's events as human lines (`human_lines.HumanLines`) instead of JSON."""
    _human[:] = [HumanLines(every_steps)]


def print_json() -> None:
    """From now on, print this process's events as JSON objects (the default)."""
    _human.clear()
