"""Shared by the launcher tests: whether a process runs, read from /proc."""

from __future__ import annotations

from pathlib import Path


def running(pid: int) -> bool:
    """Whether `pid` runs (an unreaped zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"
