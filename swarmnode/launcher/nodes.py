"""The launcher's daemons as it tracks them: one `LaunchedNode` per daemon process, the nodes per stage
for the status line, and how a child is named in progress lines and in the report."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarmnode.launcher.display import StageCount
from swarmnode.launcher.procs import ChildProcess, LineTail
from swarmnode.launcher.scrape import read_metrics

SERVED_METRIC = "swarmnode_microbatches_served_total"  # `node.metrics`
RATE_METRIC = "swarmnode_tokens_per_second"


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
    served: int | None = None  # microbatches it completed, from its metrics when last read
    tokens_per_second: float | None = None  # per busy second of its compute, from its metrics likewise
    standby: bool = False  # started as `join --standby` (`stage` is the one it took, if any)

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


def daemon_entry(node: LaunchedNode) -> dict[str, Any]:
    """A daemon as the report lists it: `report_entry`, its site, the microbatches it served (null when its
    metrics were never read: a node that crashed, or was killed before they were), and whether it started
    as a standby (its `stage` null while it stood by to the end)."""
    entry = report_entry(node.process, node.stage, node.peer_id, node.killed, node.metrics_url)
    return {**entry, "site": node.site, "microbatches_served": node.served, "standby": node.standby}


def network_entry(path: Path, nodes: Iterable[LaunchedNode]) -> dict[str, Any]:
    """The report's `network`: the links file and each daemon's site, by name."""
    return {"file": str(path), "placement": {node.process.name: node.site for node in nodes}}


def sites_text(nodes: Iterable[LaunchedNode]) -> str:
    """Which nodes sit at which site, for a progress line."""
    at: dict[str, list[str]] = {}
    for node in nodes:
        at.setdefault(node.site or "?", []).append(node.process.name)
    return "; ".join(f"{site}: {', '.join(names)}" for site, names in at.items())


def read_node_metrics(node: LaunchedNode) -> None:
    """Note a live daemon's microbatches served and throughput from its metrics page, if it answers."""
    if node.metrics_url is None or not node.alive:
        return
    samples = read_metrics(node.metrics_url)
    served, rate = samples.get(SERVED_METRIC), samples.get(RATE_METRIC)
    if served is not None:
        node.served = int(served)
    if rate is not None and rate > 0:
        node.tokens_per_second = rate


def exit_message(what: str, process: ChildProcess) -> str:
    tail = process.stderr_tail()
    detail = f": {tail}" if tail else ""
    return f"{what} exited with code {process.returncode}{detail} (see {process.stderr_path})"


def short_peer(peer_id: str) -> str:
    return peer_id if len(peer_id) <= 12 else f"{peer_id[:4]}…{peer_id[-6:]}"


def stage_name(node: LaunchedNode) -> str:
    return "unknown" if node.stage is None else str(node.stage)
