"""`swarmnode schedule`: plan one SkipPipe iteration for a scenario file and compare with the baselines."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import click

from protocols.errors import LocalProtocolError
from protocols.skippipe import (
    METHODS,
    PathRules,
    Plan,
    Scenario,
    SwarmView,
    scenario_from_dict,
)
from protocols.skippipe import schedule as plan_skippipe
from protocols.skippipe.simulator import EVENT_LOOP


@click.command()
@click.option(
    "--scenario",
    "scenario_path",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="Scenario JSON in the gcp12_links.json format (sites, links, skippipe_reference_scenario).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the scheduler and baselines.")
@click.option(
    "--restarts",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Planner constructions (fewer: faster, plans a little slower).",
)
@click.option(
    "--rounds",
    type=click.IntRange(min=0),
    default=600,
    show_default=True,
    help="Planner improvement steps (fewer: faster, plans a little slower).",
)
def schedule(scenario_path: Path, as_json: bool, seed: int, restarts: int, rounds: int) -> None:
    """Plan one iteration with SkipPipe and print each method's expected iteration time."""
    scenario = _load(scenario_path)
    view, rules = scenario.view, scenario.rules
    started, cpu = time.perf_counter(), time.process_time()
    try:
        plan = plan_skippipe(view, rules, seed, restarts=restarts, rounds=rounds)
    except LocalProtocolError as error:
        raise click.BadParameter(
            f"cannot plan this scenario: {error.reason}", param_hint="--scenario"
        ) from None
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu
    plans = {
        name: plan if name == "skippipe" else _baseline(method, scenario, seed)
        for name, method in METHODS.items()
    }
    if as_json:
        times = {name: None if p is None else p.iteration_time_s for name, p in plans.items()}
        out = {"paths": plan.as_dict(), "iteration_time_s": times, "scheduler_seconds": seconds}
        click.echo(json.dumps({**out, "scheduler_cpu_seconds": cpu_seconds, "event_loop": EVENT_LOOP}))
    else:
        _print_table(scenario, plans, seed, seconds, cpu_seconds)


def _print_table(
    scenario: Scenario, plans: dict[str, Plan | None], seed: int, seconds: float, cpu_seconds: float
) -> None:
    view, rules = scenario.view, scenario.rules
    click.echo(
        f"{view.n_nodes} nodes, {len(view.data_nodes)} data nodes x {rules.microbatches_per_data_node} "
        f"microbatches, {rules.stages_per_path(view.n_stages)} of {view.n_stages} stages per path, "
        f"memory {rules.memory}, seed {seed}"
    )
    click.echo(f"{'method':<38}{'iteration s':>12}{'vs full pipeline':>18}{'collisions':>12}")
    full = plans["full_pipeline"]
    for name, p in plans.items():
        label = name.replace("_", " ")
        if p is None:
            click.echo(f"{label:<38}{'deadlock':>12}")
            continue
        change = "" if full is None or p is full else f"{p.iteration_time_s / full.iteration_time_s - 1:+.1%}"
        click.echo(f"{label:<38}{p.iteration_time_s:>12.1f}{change:>18}{p.collisions:>12}")
    click.echo(f"skippipe scheduler: {seconds:.3f} s ({cpu_seconds:.3f} s of CPU; event loop: {EVENT_LOOP})")


def _load(path: Path) -> Scenario:
    try:
        data = json.loads(path.read_text())
    except OSError as error:
        raise click.BadParameter(f"cannot read {path}: {error.strerror}", param_hint="--scenario") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise click.BadParameter(f"{path} is not valid JSON: {error}", param_hint="--scenario") from None
    try:
        return scenario_from_dict(data)
    except LocalProtocolError as error:
        raise click.BadParameter(f"{path}: {error.reason}", param_hint="--scenario") from None


def _baseline(
    method: Callable[[SwarmView, PathRules, int], Plan], scenario: Scenario, seed: int
) -> Plan | None:
    """A baseline's plan, or None where every plan it draws deadlocks on memory."""
    try:
        return method(scenario.view, scenario.rules, seed)
    except LocalProtocolError:
        return None
