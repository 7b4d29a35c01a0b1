"""Live progress on stderr, as plain lines that read well in a terminal and in a log file.

Events (kills, lost stages, recoveries, joins) print at once. A status line prints every `interval` seconds
while something changes, and at least every `heartbeat` seconds otherwise. A stream that can no longer be
written (a closed pipe: `swarmnode up 2>&1 | head`) is given up on, never an error of the run:

    [  42.0s] step 37/200 | loss 5.312 | val 5.420 | 1830 tok/s | nodes 0:2 1:2 2:1+1r 3:2 | lost mb 3
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TextIO


@dataclass(frozen=True)
class StageCount:
    """Nodes of one stage by state; `online` also counts nodes whose state is not known yet."""

    online: int = 0
    recovering: int = 0
    joining: int = 0

    def __str__(self) -> str:
        text = str(self.online)
        if self.recovering:
            text += f"+{self.recovering}r"
        if self.joining:
            text += f"+{self.joining}j"
        return text if self.online or self.recovering or self.joining else "0!"


def status_line(
    step: int,
    steps: int,
    loss: float | None,
    val_loss: float | None,
    tokens_per_second: float | None,
    stages: Mapping[int, StageCount],
    microbatches_lost: int,
) -> str:
    """One status line (without the time stamp)."""
    parts = [f"step {step}/{steps}"]
    if loss is not None:
        parts.append(f"loss {loss:.3f}")
    if val_loss is not None:
        parts.append(f"val {val_loss:.3f}")
    if tokens_per_second is not None:
        parts.append(f"{tokens_per_second:.0f} tok/s")
    parts.append("nodes " + " ".join(f"{stage}:{count}" for stage, count in sorted(stages.items())))
    if microbatches_lost:
        parts.append(f"lost mb {microbatches_lost}")
    return " | ".join(parts)


class Display:
    """Writes time-stamped lines (seconds since `started`, a `time.monotonic()` value) to `stream`."""

    def __init__(
        self, stream: TextIO, started: float, interval: float = 2.0, heartbeat: float = 30.0
    ) -> None:
        self._stream = stream
        self._started = started
        self._interval = interval
        self._heartbeat = heartbeat
        self._last_text = ""
        self._last_at = float("-inf")
        self._broken = False

    def event(self, text: str) -> None:
        self._write(time.monotonic(), text)

    def status(self, text: Callable[[], str]) -> None:
        """Print the status line `text()` if it is due: changed after `interval`, or after `heartbeat`."""
        now = time.monotonic()
        elapsed = now - self._last_at
        if elapsed < self._interval:
            return
        line = text()
        if elapsed >= self._heartbeat or line != self._last_text:
            self._last_text, self._last_at = line, now
            self._write(now, line)

    def _write(self, now: float, text: str) -> None:
        """Write one line; after a failed write (OSError: a closed pipe, a full disk) write nothing more."""
        if self._broken:
            return
        try:
            self._stream.write(f"[{now - self._started:7.1f}s] {text}\n")
            self._stream.flush()
        except OSError:
            self._broken = True
