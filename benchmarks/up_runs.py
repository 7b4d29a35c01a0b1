"""Running `swarmnode up` from a benchmark: one supervised run and its report (swarm_quality, wan_swarm)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from swarmnode.launcher.procs import ChildProcess

GRACE_S = 180.0  # beyond `up --timeout` before a benchmark stops `up` itself
STOP_S = 60.0  # after SIGTERM, before SIGKILL


def run_up(command: list[str], name: str, log_dir: Path, timeout: float) -> int | None:
    """Run `up` (through the launcher's supervisor: its output in `{log_dir}/{name}.out` and `.err`); its
    exit status, or None if it had to be stopped. Stopped, `up` gets SIGTERM (it ends its nodes and writes
    its report), then SIGKILL to its group after STOP_S; the same when the benchmark is interrupted."""
    up = ChildProcess(name, command, log_dir)
    try:
        return up.wait(timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        if up.poll() is None:
            up.terminate()
            try:
                up.wait(STOP_S)
            except subprocess.TimeoutExpired:
                up.kill()


def read_report(path: Path) -> dict[str, Any] | None:
    """A run's `report.json`, or None if it is missing or unreadable."""
    try:
        report: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return report
