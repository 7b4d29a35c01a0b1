"""One JSON object per line on stdout for every event a daemon reports (the launcher and logs read them)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def emit(event: str, **fields: Any) -> None:
    """Print `{"event": event, "time": <unix seconds>, **fields}` as one line and flush."""
    sys.stdout.write(json.dumps({"event": event, "time": round(time.time(), 3), **fields}) + "\n")
    sys.stdout.flush()
