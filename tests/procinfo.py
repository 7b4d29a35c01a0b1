"""What the kernel says about test processes: members of process groups and their CPU time (/proc stat),
the unix sockets they hold open (/proc fd and /proc/net/unix), and their UDP sockets and TCP listeners (`ss`).
Benchmarks import it too (benchmarks/daemon_footprint.py).
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcStat:
    """A process as /proc/PID/stat describes it; `started` (clock ticks after boot) with `pid` names it across
    pid reuse, `cpu_seconds` is its user + system time so far."""

    pid: int
    comm: str
    state: str
    pgid: int
    cpu_seconds: float
    started: int


def _proc_stat(pid: int) -> ProcStat | None:
    """The /proc entry of `pid` (a zombie's too, state "Z"), or None if there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid pgrp ... utime stime ... starttime" (fields 1-3, 5, 14, 15, 22): comm may hold
    # spaces and parentheses, so the fields after it are split after the last ')'.
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    rest = stat[stat.rindex(")") + 2 :].split()
    cpu = (int(rest[11]) + int(rest[12])) / _TICK
    return ProcStat(pid, comm, rest[0], int(rest[2]), cpu, int(rest[19]))


def group_stats(pgids: Iterable[int]) -> list[ProcStat]:
    """Live (not zombie) processes of the given process groups."""
    wanted = set(pgids)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _proc_stat(int(entry))
        if stat is not None and stat.pgid in wanted and stat.state != "Z":
            found.append(stat)
    return found


def group_members(pgids: Iterable[int]) -> dict[int, tuple[int, str]]:
    """Live (not zombie) processes of the given process groups: pid -> (pgid, command name)."""
    return {stat.pid: (stat.pgid, stat.comm) for stat in group_stats(pgids)}


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        pass
    return inodes


def unix_socket_paths(pids: Iterable[int]) -> set[str]:
    """Filesystem paths of the unix sockets the given processes hold open (from /proc/net/unix)."""
    inodes: set[str] = set()
    for pid in pids:
        inodes |= _socket_inodes(pid)
    paths = set()
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return paths
    for line in lines:
        parts = line.split()
        if len(parts) >= 8 and parts[6] in inodes and parts[7].startswith("/"):
            paths.add(parts[7])
    return paths


def udp_sockets_of(pids: Iterable[int]) -> list[str]:
    """Lines of `ss -uanp` naming any of the given pids: UDP sockets they own."""
    wanted = {str(pid) for pid in pids}
    out = subprocess.run(["ss", "-uanp"], capture_output=True, text=True, timeout=10, check=True).stdout
    return [line for line in out.splitlines() if set(re.findall(r"pid=(\d+)", line)) & wanted]


def tcp_listeners_of(pids: Iterable[int]) -> list[str]:
    """Lines of `ss -tlnp` naming any of the given pids: TCP sockets they listen on."""
    wanted = {str(pid) for pid in pids}
    out = subprocess.run(["ss", "-tlnp"], capture_output=True, text=True, timeout=10, check=True).stdout
    return [line for line in out.splitlines() if set(re.findall(r"pid=(\d+)", line)) & wanted]
