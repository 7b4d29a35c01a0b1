"""The end of a completed local swarm: its model exported to `OUT/model` while the swarm still runs.

The launcher runs `swarmnode export --evaluate` as one more child (the data nodes linger after the last
step, so every stage can still serve its final weights) and reads the exporter's `exported` line: the
folder, the step each stage's weights came from, and the validation loss recomputed from the written files
(so the report checks the export against the swarm's own figure).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from swarmnode.event_schema import Exported, parse_line
from swarmnode.launcher.config import SwarmConfig
from swarmnode.launcher.procs import ChildProcess, StopSignals
from swarmnode.launcher.zygote import Zygote

EXPORT_TIMEOUT_S = 300.0  # the exporter's start, the transfers, the write and the evaluation
POLL_S = 0.2


def export_model(
    config: SwarmConfig, logs: Path, env: Mapping[str, str], stop: StopSignals, zygote: Zygote | None = None
) -> dict[str, Any]:
    """Export the swarm's model to `config.model_dir` (forked from `zygote`, if given); the report's `model`
    entry (with an `error` instead of the figures if the export failed, was stopped or ran out of time)."""
    entry: dict[str, Any] = {"path": str(config.model_dir)}
    child = ChildProcess("export", config.export_argv(), logs, env, zygote=zygote)
    deadline = time.monotonic() + EXPORT_TIMEOUT_S
    try:
        while child.poll() is None:
            if stop.received or time.monotonic() >= deadline:
                why = "stopped by a signal" if stop.received else f"not done in {EXPORT_TIMEOUT_S:g} s"
                return {**entry, "error": f"the export was {why}"}
            time.sleep(POLL_S)
    finally:
        child.kill()  # reaps it, and ends whatever it left in its group
    exported = _exported(child.stdout_path)
    if child.returncode != 0 or exported is None:
        why = child.stderr_tail() or "no exported line"
        return {**entry, "error": f"the exporter exited with code {child.returncode}: {why}"}
    return {**entry, "step": exported.step, "steps": dict(exported.steps), "val_loss": exported.val_loss}


def describe(model: Mapping[str, Any], swarm_val_loss: float | None) -> str:
    """One line on the exported model for the launcher's display."""
    if "error" in model:
        return f"export failed: {model['error']}"
    swarm = "?" if swarm_val_loss is None else f"{swarm_val_loss:.4f}"
    loss = "?" if model["val_loss"] is None else f"{model['val_loss']:.4f}"
    return (
        f"model of step {model['step']} in {model['path']}: validation loss {loss} recomputed from its "
        f"files (the swarm's: {swarm})"
    )


def _exported(path: Path) -> Exported | None:
    """The exporter's last `exported` line."""
    found = None
    for line in path.read_text(errors="replace").splitlines():
        event = parse_line(line, time.time())
        if isinstance(event, Exported):
            found = event
    return found
