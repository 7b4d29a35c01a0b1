"""What the kernel says about test processes: members of process groups and their CPU time
(`swarmnode.procstat`), the unix sockets they hold open (/proc fd and /proc/net/unix), and their UDP sockets
and TCP listeners (/proc/net/udp and tcp, so no `ss` is needed). Benchmarks import it too
(benchmarks/daemon_footprint.py).
"""

from __future__ import annotations

import ipaddress
import os
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


def _address(hex_address: str) -> str:
    """`ADDR:PORT` of a /proc/net/{tcp,udp}[6] column (the address in 32-bit words of host byte order)."""
    host, port = hex_address.split(":")
    words = bytes.fromhex(host)
    raw = b"".join(words[i : i + 4][::-1] for i in range(0, len(words), 4))
    return f"{ipaddress.ip_address(raw)}:{int(port, 16)}"


def _inet_sockets(pids: Iterable[int], protocol: str, state: str | None) -> list[str]:
    """`PROTOCOL ADDR:PORT pid=PID` of each socket of `protocol` (tcp or udp, IPv4 and IPv6) that one of the
    given pids holds, in the given state (hex, as the kernel writes it; None: any)."""
    owners = {inode: pid for pid in pids for inode in _socket_inodes(pid)}
    found = []
    for table in (f"/proc/net/{protocol}", f"/proc/net/{protocol}6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) >= 10 and parts[9] in owners and (state is None or parts[3] == state):
                found.append(f"{protocol} {_address(parts[1])} pid={owners[parts[9]]}")
    return found


def udp_sockets_of(pids: Iterable[int]) -> list[str]:
    """The UDP sockets the given processes hold (/proc/net/udp and udp6), as `udp ADDR:PORT pid=PID`."""
    return _inet_sockets(pids, "udp", None)


def tcp_listeners_of(pids: Iterable[int]) -> list[str]:
    """The TCP sockets the given processes listen on (/proc/net/tcp and tcp6), as `tcp ADDR:PORT pid=PID`."""
    return _inet_sockets(pids, "tcp", "0A")
