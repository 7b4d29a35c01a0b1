"""The result file and plot every reproduction script writes.

A result is `{"claim": ..., "rows": [{"method": ..., "metric": ..., "seeds": [...]}], "verdict": ...}`
plus fields of the script's own (for example `"replicas"`); `seeds` holds one value per seed, in seed order.
"""

from __future__ import annotations

import json
import math
import resource
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Row:
    """One method's values of one metric, one per seed."""

    method: str
    metric: str
    seeds: tuple[float, ...]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.seeds) if self.seeds else math.nan

    @property
    def spread(self) -> float:
        return max(self.seeds) - min(self.seeds) if self.seeds else math.nan


def result(claim: str, rows: Sequence[Row], verdict: str, **extra: Any) -> dict[str, Any]:
    """The JSON object of a reproduction run."""
    if not claim or not verdict:
        raise ValueError("a result needs a claim and a verdict")
    body = {
        "claim": claim,
        "rows": [{"method": r.method, "metric": r.metric, "seeds": list(r.seeds)} for r in rows],
        "verdict": verdict,
    }
    clash = set(extra) & set(body)
    if clash:
        raise ValueError(f"extra fields {sorted(clash)} would overwrite the result's own")
    return {**body, **extra}


def cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and of its children waited for so far: with the wall
    time, what a run would take on an idle machine (a single-threaded run: about its CPU time)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return round(own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime, 1)


def write_json(path: Path, body: Mapping[str, Any]) -> None:
    """Write `body` to `path` (its folder is created), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(body, indent=2) + "\n")
    tmp.replace(path)


def table(rows: Sequence[Row]) -> str:
    """A plain-text table: method, metric, mean, min-max over seeds."""
    lines = [f"{'method':<24} {'metric':<28} {'mean':>10} {'min':>10} {'max':>10} {'seeds':>5}"]
    for r in rows:
        low, high = (min(r.seeds), max(r.seeds)) if r.seeds else (math.nan, math.nan)
        lines.append(
            f"{r.method:<24} {r.metric:<28} {r.mean:>10.4f} {low:>10.4f} {high:>10.4f} {len(r.seeds):>5}"
        )
    return "\n".join(lines)


def plot(path: Path, title: str, rows: Sequence[Row]) -> None:
    """One panel per metric: a bar per method at the mean over seeds, each seed as a dot."""
    from matplotlib.figure import Figure  # Agg, whatever the default backend

    metrics = list(dict.fromkeys(r.metric for r in rows))
    if not metrics:
        raise ValueError("nothing to plot")
    fig = Figure(figsize=(4.5 * len(metrics), 3.6), layout="constrained")
    axes = fig.subplots(1, len(metrics), squeeze=False)[0]
    for ax, metric in zip(axes, metrics, strict=True):
        mine = [r for r in rows if r.metric == metric]
        ax.bar(range(len(mine)), [r.mean for r in mine], color="#9ecae1")
        for i, r in enumerate(mine):
            ax.plot([i] * len(r.seeds), r.seeds, "k.", markersize=4)
        ax.set_xticks(range(len(mine)), [r.method for r in mine], rotation=30, ha="right")
        ax.set_title(metric, fontsize=9)
    fig.suptitle(title, fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
