"""What the kernel says about test processes: members of process groups and their CPU time
(`swarmnode.procstat`), the unix sockets they hold open (/proc fd and /proc/net/unix), and their UDP sockets
and TCP listeners (`ss`). Benchmarks import it too (benchmarks/daemon_footprint.py).
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterable
from pathlib import Path

from swarmnode.procstat import ProcStat, processes


def group_stats(pgids: Iterable[int]) -> list[ProcStat]:
    """Live (not zombie) processes of the given process groups."""
    wanted = set(pgids)
    return [stat for stat in processes() if stat.pgid in wanted and not stat.zombie]


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
