"""Processes as Linux's /proc/PID/stat describes them: who a process's parent and process group are, whether
it is a zombie, its CPU time. Where there is no /proc, there are no processes to list."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_PROC = Path("/proc")


@dataclass(frozen=True)
class ProcStat:
    """One process; `started` (clock ticks after boot) with `pid` names it across pid reuse, `cpu_seconds` is
    its user + system time so far."""

    pid: int
    comm: str
    state: str
    ppid: int
    pgid: int
    cpu_seconds: float
    started: int

    @property
    def zombie(self) -> bool:
        """Exited, and not yet reaped by its parent."""
        return self.state == "Z"


def proc_stat(pid: int) -> ProcStat | None:
    """The /proc entry of `pid` (a zombie's too), or None if there is none."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid pgrp ... utime stime ... starttime" (fields 1-5, 14, 15, 22): comm may hold
    # spaces and parentheses, so the fields after it are split after the last ')'.
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    rest = stat[stat.rindex(")") + 2 :].split()
    cpu = (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")
    return ProcStat(pid, comm, rest[0], int(rest[1]), int(rest[2]), cpu, int(rest[19]))


def processes() -> list[ProcStat]:
    """Every process /proc lists, zombies included; none where there is no /proc."""
    if not _PROC.is_dir():
        return []
    found = (proc_stat(int(entry.name)) for entry in _PROC.iterdir() if entry.name.isdigit())
    return [stat for stat in found if stat is not None]
