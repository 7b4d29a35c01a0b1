"""The tables and the plot of `swarm_quality.py`: per-configuration summaries of its runs (means and
spreads over seeds, ratios against the trainer and against smaller swarms), as Markdown and as a PNG."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPLICA_TOLERANCE = 1.02  # adding replicas should never make the validation loss worse than this ratio

Curve = dict[int, float]  # data-node step -> validation loss


@dataclass(frozen=True)
class SwarmShape:
    """D data nodes and R replicas per transformer stage."""

    data_nodes: int
    replicas: int

    @property
    def name(self) -> str:
        return f"{self.data_nodes}x{self.replicas}"

    @property
    def batches_per_step(self) -> int:
        """How many of the single process's batches a data-node step of this swarm trains on: each data node
        sends one for each pipeline (`planning.pipeline_width`: here R)."""
        return self.data_nodes * self.replicas


def label(checkfree_plus: bool) -> str:
    return "on" if checkfree_plus else "off"


def spread(values: list[float]) -> dict[str, float] | None:
    """Mean, min, max and (with two values or more) the sample standard deviation."""
    if not values:
        return None
    return {
        "mean": statistics.fmean(values),
        "min": min(values),
        "max": max(values),
        "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
    }


def paired_ratio(runs: list[dict[str, Any]], reference: dict[int, float]) -> float | None:
    """Mean over the seeds both have of the run's loss over the reference's."""
    ratios = [r["val_at_steps"] / reference[r["seed"]] for r in runs if r["seed"] in reference]
    return statistics.fmean(ratios) if ratios else None


def losses_by_seed(runs: list[dict[str, Any]], shape: SwarmShape, checkfree_plus: bool) -> dict[int, float]:
    """Per seed, the loss of the completed runs of this shape and setting (the mean over repeats)."""
    by_seed: dict[int, list[float]] = defaultdict(list)
    for r in runs:
        if r["ok"] and r["config"] == shape.name and r["checkfree_plus"] == checkfree_plus:
            by_seed[r["seed"]].append(r["val_at_steps"])
    return {seed: statistics.fmean(losses) for seed, losses in by_seed.items()}


def repeatability(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration, setting and seed run more than once: the losses and their range over the mean."""
    groups: dict[tuple[str, bool, int], list[float]] = defaultdict(list)
    for r in runs:
        if r["ok"]:
            groups[(r["config"], r["checkfree_plus"], r["seed"])].append(r["val_at_steps"])
    return [
        {
            "config": config,
            "checkfree_plus": checkfree_plus,
            "seed": seed,
            "losses": losses,
            "range_over_mean": (max(losses) - min(losses)) / statistics.fmean(losses),
        }
        for (config, checkfree_plus, seed), losses in groups.items()
        if len(losses) > 1
    ]


def repeatability_table(rows: list[dict[str, Any]]) -> str:
    header = ["config", "CF+", "seed", "validation losses", "range / mean"]
    lines = [
        [
            r["config"],
            label(r["checkfree_plus"]),
            str(r["seed"]),
            ", ".join(f"{loss:.3f}" for loss in r["losses"]),
            f"{r['range_over_mean']:.1%}",
        ]
        for r in rows
    ]
    return markdown(header, lines)


def paired_share(runs: list[dict[str, Any]], shape: SwarmShape) -> dict[str, int] | None:
    """NoLoCo pairing rounds and the paired ones, summed over the runs and the stages with more than one
    node (stage 0: D data nodes, the others R replicas); None where no report has them or no stage does."""
    counts = [
        counts
        for r in runs
        if r["noloco"]
        for stage, counts in r["noloco"].items()
        if (shape.data_nodes if stage == "0" else shape.replicas) > 1
    ]
    if not counts:
        return None
    return {"rounds": sum(int(c["rounds"]) for c in counts), "paired": sum(int(c["paired"]) for c in counts)}


def summarise(
    runs: list[dict[str, Any]],
    shapes: list[SwarmShape],
    settings: list[bool],
    seeds: list[int],
    trainer: dict[int, dict[int, Curve]],
    steps: int,
) -> list[dict[str, Any]]:
    """One row per configuration and CheckFree+ setting."""
    at_steps = {seed: trainer[steps][seed][steps] for seed in seeds}
    rows = []
    for checkfree_plus in settings:
        for shape in shapes:
            mine = [r for r in runs if r["config"] == shape.name and r["checkfree_plus"] == checkfree_plus]
            ok = [r for r in mine if r["ok"]]
            tokens = shape.batches_per_step * steps
            at_tokens = {seed: trainer[tokens][seed][tokens] for seed in seeds}
            by_dx1 = losses_by_seed(runs, SwarmShape(shape.data_nodes, 1), checkfree_plus)
            by_1xr = losses_by_seed(runs, SwarmShape(1, shape.replicas), checkfree_plus)
            vs_dx1 = paired_ratio(ok, by_dx1) if shape.replicas > 1 else None
            walls = [r["wall_seconds"] for r in ok if r["wall_seconds"] is not None]
            rows.append(
                {
                    "config": shape.name,
                    "checkfree_plus": checkfree_plus,
                    "runs": len(mine),
                    "completed": len(ok),
                    "swarm": spread([r["val_at_steps"] for r in ok]),
                    "trainer_equal_steps": spread(list(at_steps.values())),
                    "trainer_equal_tokens": spread(list(at_tokens.values())),
                    "vs_trainer_equal_steps": paired_ratio(ok, at_steps),
                    "vs_trainer_equal_tokens": paired_ratio(ok, at_tokens),
                    "vs_1x1": paired_ratio(ok, losses_by_seed(runs, SwarmShape(1, 1), checkfree_plus)),
                    "vs_dx1": vs_dx1,
                    "vs_1xr": paired_ratio(ok, by_1xr) if shape.data_nodes > 1 else None,
                    "replicas_worse": vs_dx1 is not None and vs_dx1 > REPLICA_TOLERANCE,
                    "noloco": paired_share(ok, shape),
                    "wall_seconds": statistics.fmean(walls) if walls else None,
                }
            )
    return rows


def on_off(runs: list[dict[str, Any]], shapes: list[SwarmShape]) -> list[dict[str, Any]]:
    """Per configuration: CheckFree+ on over off (mean over the seeds where both completed)."""
    rows = []
    for shape in shapes:
        on = losses_by_seed(runs, shape, True)
        off = losses_by_seed(runs, shape, False)
        ratios = [on[seed] / off[seed] for seed in on if seed in off]
        rows.append(
            {
                "config": shape.name,
                "on": spread(list(on.values())),
                "off": spread(list(off.values())),
                "seeds": len(ratios),
                "on_over_off": statistics.fmean(ratios) if ratios else None,
            }
        )
    return rows


def loss_cell(stats: dict[str, float] | None) -> str:
    if stats is None:
        return "-"
    return f"{stats['mean']:.3f} ({stats['min']:.3f}-{stats['max']:.3f}, sd {stats['sd']:.3f})"


def ratio_cell(ratio: float | None, flag: bool = False) -> str:
    return "-" if ratio is None else f"{ratio:.3f}{' !' if flag else ''}"


def markdown(header: list[str], lines: list[list[str]]) -> str:
    rows = [header, ["---"] * len(header), *lines]
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def summary_table(rows: list[dict[str, Any]], steps: int) -> str:
    header = [
        "config",
        "CF+",
        "completed",
        f"swarm val @{steps}: mean (min-max, sd)",
        f"trainer @{steps} (equal steps)",
        "trainer @D x R x steps (equal tokens)",
        "swarm / trainer, equal steps",
        "swarm / trainer, equal tokens",
        "vs 1x1",
        "vs Dx1 (replicas)",
        "vs 1xR (data nodes)",
        "NoLoCo paired",
        "wall s",
    ]
    lines = []
    for r in rows:
        noloco = r["noloco"]
        if noloco is None or noloco["rounds"] == 0:
            paired = "-"
        else:
            paired = f"{noloco['paired'] / noloco['rounds']:.0%} of {noloco['rounds']}"
        lines.append(
            [
                r["config"],
                label(r["checkfree_plus"]),
                f"{r['completed']}/{r['runs']}",
                loss_cell(r["swarm"]),
                loss_cell(r["trainer_equal_steps"]),
                loss_cell(r["trainer_equal_tokens"]),
                ratio_cell(r["vs_trainer_equal_steps"]),
                ratio_cell(r["vs_trainer_equal_tokens"]),
                ratio_cell(r["vs_1x1"]),
                ratio_cell(r["vs_dx1"], r["replicas_worse"]),
                ratio_cell(r["vs_1xr"]),
                paired,
                "-" if r["wall_seconds"] is None else f"{r['wall_seconds']:.0f}",
            ]
        )
    return markdown(header, lines)


def on_off_table(rows: list[dict[str, Any]]) -> str:
    header = ["config", "CF+ on", "CF+ off", "on / off", "seeds"]
    lines = [
        [r["config"], loss_cell(r["on"]), loss_cell(r["off"]), ratio_cell(r["on_over_off"]), str(r["seeds"])]
        for r in rows
    ]
    return markdown(header, lines)


def plot(
    path: Path,
    runs: list[dict[str, Any]],
    shapes: list[SwarmShape],
    settings: list[bool],
    reference: dict[int, Curve],
    steps: int,
) -> None:
    """Validation loss against data-node step: a panel per CheckFree+ setting, a line per configuration
    (mean over the seeds, min-max band), the trainer's `steps`-step runs as a black dashed line."""
    from matplotlib.figure import Figure  # renders PNG with Agg, whatever the default backend

    figure = Figure(figsize=(6 * len(settings), 4.5), layout="constrained")
    panels = figure.subplots(1, len(settings), sharey=True, squeeze=False)[0]
    trainer_steps = sorted(set.intersection(*(set(curve) for curve in reference.values())))
    trainer_mean = [statistics.fmean(curve[s] for curve in reference.values()) for s in trainer_steps]
    for axes, checkfree_plus in zip(panels, settings, strict=True):
        for shape in shapes:
            by_step: dict[int, list[float]] = defaultdict(list)
            for r in runs:
                if r["ok"] and r["config"] == shape.name and r["checkfree_plus"] == checkfree_plus:
                    for point in r["val_curve"]:
                        by_step[point["step"]].append(point["val_loss"])
            if not by_step:
                continue
            xs = sorted(by_step)
            (line,) = axes.plot(xs, [statistics.fmean(by_step[x]) for x in xs], "o-", label=shape.name)
            lows, highs = [min(by_step[x]) for x in xs], [max(by_step[x]) for x in xs]
            axes.fill_between(xs, lows, highs, color=line.get_color(), alpha=0.2)
        axes.plot(trainer_steps, trainer_mean, "k--", label=f"single process ({steps} steps)")
        axes.set_title(f"CheckFree+ {label(checkfree_plus)}")
        axes.set_xlabel("data-node step")
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    panels[0].set_ylabel("validation loss")
    figure.savefig(path, dpi=100)
