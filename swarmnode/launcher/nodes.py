"""The launcher's daemons as it tracks them: one `LaunchedNode` per daemon process, the nodes per stage
for the status line, and how a child is named in progress lines and in the report."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from swarmnode.launcher.display import StageCount
from swarmnode.launcher.procs import ChildProcess, LineTail


@dataclass
class LaunchedNode:
    process: ChildProcess
    stage: int | None
    shard: str | None
    tail: LineTail
    initial: bool
    peer_id: str | None = None
    joined: bool = False
    trained: bool = False  # reported a step: a data node in the run, not one that joined after it
    finished: bool = False  # a data node that took the last step (it lingers until ended)
    killed: bool = False
    exited: bool = False
    metrics_url: str | None = None  # where its Prometheus metrics are served
    site: str | None = None  # its site in the emulated network (`up --network`)

    @property
    def alive(self) -> bool:
        return not self.exited


def stage_counts(
    nodes: Iterable[LaunchedNode], stages: int, seen: dict[int, StageCount]
) -> dict[int, StageCount]:
    """Nodes per stage: online once they said so, joining before; `seen` (the DHT's counts, or nothing when
    none are fresh) tells which of those recover."""
    online = dict.fromkeys(range(stages + 1), 0)
    starting = dict.fromkeys(range(stages + 1), 0)
    for node in nodes:
        if node.alive and node.stage is not None:
            counts = online if node.joined else starting
            counts[node.stage] = counts.get(node.stage, 0) + 1
    result = {}
    for stage in online:
        recovering = min(seen.get(stage, StageCount()).recovering, starting.get(stage, 0))
        result[stage] = StageCount(online[stage], recovering, starting.get(stage, 0) - recovering)
    return result


def report_entry(
    child: ChildProcess, stage: int | None, peer_id: str | None, killed: bool, metrics_url: str | None = None
) -> dict[str, Any]:
    """A child as the report lists it."""
    return {
        "name": child.name,
        "pid": child.pid,
        "stage": stage,
        "peer_id": peer_id,
        "exit_code": child.returncode,
        "killed": killed,
        "metrics_url": metrics_url,
    }


def exit_message(what: str, process: ChildProcess) -> str:
    tail = process.stderr_tail()
    detail = f": {tail}" if tail else ""
    return f"{what} exited with code {process.returncode}{detail} (see {process.stderr_path})"


def short_peer(peer_id: str) -> str:
    return peer_id if len(peer_id) <= 12 else f"{peer_id[:4]}…{peer_id[-6:]}"


def stage_name(node: LaunchedNode) -> str:
    return "unknown" if node.stage is None else str(node.stage)
