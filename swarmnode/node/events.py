"""One JSON object per line on stdout for every event a daemon reports (the launcher and logs read them),
of a kind and with fields that `swarmnode.event_schema` defines."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

from swarmnode.event_schema import check_fields

Listener = Callable[[str, dict[str, Any]], None]
_listeners: list[Listener] = []  # this process's (`listen`): the metrics of a daemon


def emit(event: str, **fields: Any) -> None:
    """Print `{"event": event, "time": <unix seconds>, **fields}` as one line and flush; then tell the
    listeners. Raises `event_schema.EventSchemaError` if the event breaks the schema (a bug)."""
    check_fields(event, fields)
    sys.stdout.write(json.dumps({"event": event, "time": round(time.time(), 3), **fields}) + "\n")
    sys.stdout.flush()
    for listener in _listeners:
        listener(event, fields)


def listen(listener: Listener) -> None:
    """Call `listener(event, fields)` after every event this process emits from now on."""
    _listeners.append(listener)
