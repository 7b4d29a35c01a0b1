"""The run's report: `report.json` (figures, failures, recoveries, settings) and `loss.png` (loss curves)."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from swarmnode.launcher.record import RunRecord


def build_report(
    record: RunRecord,
    outcome: str,
    message: str,
    wall_seconds: float,
    settings: Mapping[str, Any],
    nodes: Sequence[Mapping[str, Any]],
    model: Mapping[str, Any] | None = None,
    simulated_s: float | None = None,
    network: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The report as a JSON-ready dict. Times named `at_seconds` count from the launcher's start. `model`: the
    exported model (`launcher.export`), None when the run did not complete. `simulated_s`: the simulator's
    iteration time for the swarm (`launcher.simulated`); `network`: the emulated links file and placement."""
    by_method: dict[str, list[float]] = defaultdict(list)
    for recovery in record.recoveries:
        by_method[recovery.method].append(recovery.duration)
    return {
        "outcome": outcome,
        "message": message,
        "wall_seconds": round(wall_seconds, 3),
        "steps_completed": record.step,
        "initial_loss": record.initial_loss,
        "final_loss": record.final_loss,
        "initial_val_loss": record.initial_val_loss,
        "val_loss": record.val_loss,
        "tokens_per_second": record.tokens_per_second(),
        "iteration_seconds": iteration_seconds(record.iteration_seconds, simulated_s),
        "skip_ratio": settings.get("skip_ratio", 0.0),
        "planner": settings.get("planner", "skippipe"),
        "network": None if network is None else dict(network),
        "model": None if model is None else dict(model),
        "failures": [
            {
                "step": failure.step,
                "stage": failure.stage,
                "peer_id": failure.peer_id,
                "node": failure.node,
                "cause": failure.cause,
                "at_seconds": round(failure.seconds, 3),
            }
            for failure in record.failures
        ],
        "recoveries": [
            {
                "stage": recovery.stage,
                "method": recovery.method,
                "seconds": recovery.duration,
                "downtime_seconds": None if recovery.downtime is None else round(recovery.downtime, 3),
                "step": recovery.step,
                "at_seconds": round(recovery.seconds, 3),
            }
            for recovery in record.recoveries
        ],
        "recoveries_by_method": {
            method: {"count": len(durations), "mean_seconds": statistics.fmean(durations)}
            for method, durations in sorted(by_method.items())
        },
        "stages_not_recovered": [
            {"stage": lost.stage, "lost_at_step": lost.step, "lost_at_seconds": round(lost.seconds, 3)}
            for lost in record.unrecovered
        ],
        "microbatches_lost": record.microbatches_lost,
        "noloco": {
            str(stage): {
                "rounds": steps.rounds,
                "paired": steps.paired,
                "alone": steps.alone,
                "unmatched": steps.unmatched,
                "paired_share": steps.paired_share,
            }
            for stage, steps in sorted(record.outer_steps.items())
        },
        "settings": dict(settings),
        "nodes": [dict(node) for node in nodes],
        "loss_curve": [
            {"step": point.step, "loss": point.loss, "at_seconds": round(point.seconds, 3)}
            for point in record.loss_curve()
        ],
        "val_curve": [
            {"step": point.step, "val_loss": point.loss, "at_seconds": round(point.seconds, 3)}
            for point in record.val_curve()
        ],
    }


def iteration_seconds(seconds: Sequence[float], simulated: float | None) -> dict[str, Any]:
    """Median and 90th percentile of the data nodes' iteration times (None without any), their count, and
    the simulator's prediction."""
    ordered = sorted(seconds)
    p90 = statistics.quantiles(ordered, n=10, method="inclusive")[-1] if len(ordered) > 1 else None
    return {
        "median": round(statistics.median(ordered), 4) if ordered else None,
        "p90": round(p90 if p90 is not None else ordered[0], 4) if ordered else None,
        "count": len(ordered),
        "simulated": None if simulated is None else round(simulated, 4),
    }


def write_report(path: Path, report: Mapping[str, Any]) -> None:
    """Write the report as indented JSON (written to a temporary file, then renamed into place)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(report, indent=2) + "\n")
    partial.replace(path)


def plot_loss(path: Path, record: RunRecord, title: str) -> None:
    """Loss against step and against wall-clock time, failures as red and recoveries as green lines."""
    from matplotlib.figure import Figure  # imported here: every `swarmnode` command imports the CLI

    figure = Figure(figsize=(11, 4.2), layout="constrained")
    by_step, by_time = figure.subplots(1, 2, sharey=True)
    curve, vals = record.loss_curve(), record.val_curve()
    for axes, x_of, label in ((by_step, "step", "step"), (by_time, "seconds", "wall-clock time (s)")):
        axes.plot(
            [getattr(p, x_of) for p in curve],
            [p.loss for p in curve],
            color="tab:blue",
            label="training loss",
        )
        if vals:
            axes.plot(
                [getattr(p, x_of) for p in vals],
                [p.loss for p in vals],
                "o-",
                color="tab:orange",
                label="validation loss",
            )
        for index, failure in enumerate(record.failures):
            at = failure.step if x_of == "step" else failure.seconds
            axes.axvline(at, color="tab:red", linestyle="--", linewidth=1, label=None if index else "failure")
        for index, recovery in enumerate(record.recoveries):
            at = recovery.step if x_of == "step" else recovery.seconds
            axes.axvline(
                at, color="tab:green", linestyle=":", linewidth=1, label=None if index else "recovery"
            )
        axes.set_xlabel(label)
        axes.grid(alpha=0.3)
    by_step.set_ylabel("loss")
    if not curve:
        by_step.text(0.5, 0.5, "no steps recorded", ha="center", va="center", transform=by_step.transAxes)
    by_step.legend(loc="upper right", fontsize="small")
    figure.suptitle(title)
    figure.savefig(path, dpi=100)
