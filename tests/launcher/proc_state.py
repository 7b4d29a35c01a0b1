"""Shared by the launcher tests: whether a process runs, read from /proc."""

from __future__ import annotations

from swarmnode.procstat import proc_stat


def running(pid: int) -> bool:
    """Whether `pid` runs (an unreaped zombie does not)."""
    stat = proc_stat(pid)
    return stat is not None and not stat.zombie
