"""One JSON object per line on stdout for every event a daemon reports (the launcher and logs read them)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

Listener = Callable[[str, dict[str, Any]], None]
_listeners: list[Listener] = []  # this process's (`listen`): the metrics of a daemon


def emit(event: str, **fields: Any) -> None:
    """Print `{"event": event, "time": <unix seconds>, **fields}` as one line and flush; then tell the
    listeners."""
    sys.stdout.write(json.dumps({"event": event, "time": round(time.time(), 3), **fields}) + "\n")
    sys.stdout.flush()
    for listener in _listeners:
        listener(event, fields)


def listen(listener: Listener) -> None:
    """Call `listener(event, fields)` after every event this process emits from now on."""
    _listeners.append(listener)
