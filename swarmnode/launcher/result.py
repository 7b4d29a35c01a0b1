"""The end of a `swarmnode up` run: its outcome, and the `report.json` and `loss.png` that record it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from protocols.errors import LocalProtocolError
from swarmnode.launcher.config import SwarmConfig
from swarmnode.launcher.nodes import LaunchedNode, daemon_entry, network_entry, report_entry
from swarmnode.launcher.procs import ChildProcess
from swarmnode.launcher.record import RunRecord
from swarmnode.launcher.report import build_report, plot_loss, write_report
from swarmnode.launcher.simulated import swarm_simulated_seconds


class RunOutcome(Enum):
    """How a run ended."""

    COMPLETED = "completed"
    INTERRUPTED = "interrupted"
    TIMEOUT = "timeout"
    FAILED = "failed"


@dataclass(frozen=True)
class SwarmResult:
    """What `LocalSwarm.run` returns: `signum` is the first stop signal received, if any."""

    outcome: RunOutcome
    message: str
    signum: int | None
    report: dict[str, Any]


def write_results(
    config: SwarmConfig,
    record: RunRecord,
    outcome: RunOutcome,
    message: str,
    *,
    wall_seconds: float,
    helpers: Sequence[ChildProcess],
    nodes: Sequence[LaunchedNode],
    final: Sequence[LaunchedNode],
    model: dict[str, Any] | None,
    warn: Callable[[str], None],
) -> dict[str, Any]:
    """Write `report.json` and `loss.png` to `config.out`; the report. `helpers`: the children that are not
    daemons (bootstrap peer, observer); `final`: the daemons online when the swarm was ended, whose simulated
    iteration time the report gives (`warn` gets a line when it cannot be computed); `model`: the report's
    `model` entry, None unless the model was exported."""
    entries = [report_entry(child, None, None, killed=False) for child in helpers]
    entries += [daemon_entry(node) for node in nodes]
    network = None if config.network is None else network_entry(config.network, nodes)
    settings, simulated = config.settings(), _simulated(config, final, warn)
    report = build_report(
        record, outcome.value, message, wall_seconds, settings, entries, model, simulated, network
    )
    write_report(config.out / "report.json", report)
    title = (
        f"swarmnode up: {config.preset}, {config.data_nodes} data nodes, {config.stages} stages x "
        f"{config.replicas}, {len(record.failures)} failures, {len(record.recoveries)} recoveries"
    )
    plot_loss(config.out / "loss.png", record, title)
    return report


def _simulated(
    config: SwarmConfig, final: Sequence[LaunchedNode], warn: Callable[[str], None]
) -> float | None:
    """The simulator's iteration time for the daemons in `final`, or None (said to `warn`) if it fails."""
    try:
        return swarm_simulated_seconds(config, final)
    except (LocalProtocolError, OSError) as error:
        warn(f"warning: no simulated iteration time: {error}")
        return None
