"""`swarmnode up`: a whole local swarm on loopback, with failure injection, progress and a report."""

from __future__ import annotations

import logging
import math
import signal
import sys
from dataclasses import replace
from pathlib import Path

import click

from swarmnode.cli.compute import device_option, device_or_fail, dtype_option
from swarmnode.cli.config_file import config_option
from swarmnode.cli.log_options import logging_options
from swarmnode.cli.network_options import read_network
from swarmnode.cli.options import batch_options, preset_or_fail, stages_or_fail
from swarmnode.launcher import (
    FAIL_RATE_UNIT,
    STALL_TIMEOUT_S,
    LocalSwarm,
    RunOutcome,
    StageKill,
    SwarmConfig,
    SwarmResult,
    parse_stage_kill,
)
from swarmnode.runspec import PLANNERS, RunSpec, RunSpecError


class StageKillParam(click.ParamType):
    """A `STAGE@STEP` value."""

    name = "STAGE@STEP"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> StageKill:
        if isinstance(value, StageKill):
            return value
        try:
            return parse_stage_kill(str(value))
        except ValueError as error:
            self.fail(str(error), param, ctx)


class FiniteFloatRange(click.FloatRange):
    """A `click.FloatRange` that also refuses nan and the infinities (nan passes any bounds check)."""

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> float:
        number: float = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


@click.command()
@config_option
@logging_options
@click.option("--preset", default="tiny", show_default=True, help="Model preset name.")
@click.option(
    "--stages", type=click.IntRange(min=1), default=None, help="Transformer stages (default: the preset's)."
)
@click.option(
    "--replicas",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Nodes per transformer stage (each adds a batch per data node and step, up to 4).",
)
@click.option(
    "--data-nodes",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Nodes of the data stage 0.",
)
@click.option(
    "--steps", type=click.IntRange(min=1), default=100, show_default=True, help="Training steps of the run."
)
@batch_options
@click.option(
    "--fail-rate",
    type=FiniteFloatRange(0.0, 1.0, max_open=True),
    default=0.0,
    show_default=True,
    help=f"Random failures: the {FAIL_RATE_UNIT}; each failure kills one random node of that stage.",
)
@click.option(
    "--kill",
    "kills",
    type=StageKillParam(),
    multiple=True,
    help="Kill every node of STAGE when the data nodes reach STEP (repeatable; stage 0 = the data nodes). "
    "STEP must come before the last step. Without --kill, --fail-rate or --calm (and with --steps 2 or "
    "more): the middle transformer stage at half the steps.",
)
@click.option("--calm", is_flag=True, help="No failures at all (overrides the default kill).")
@click.option(
    "--checkfree-plus/--no-checkfree-plus",
    default=True,
    show_default=True,
    help="CheckFree+: copies of the embeddings and (--edge-copies) of the edge stages next door.",
)
@click.option(
    "--edge-copies/--no-edge-copies",
    default=True,
    show_default=True,
    help="CheckFree+'s copies of stage 1 at stage 2 and of stage s at stage s-1.",
)
@click.option(
    "--edge-swaps/--no-edge-swaps",
    default=False,
    show_default=True,
    help="The paper's CheckFree+ edge-stage swaps (4 or more transformer stages only).",
)
@click.option(
    "--respawn-delay",
    type=FiniteFloatRange(min=0.0),
    default=2.0,
    show_default=True,
    help="Seconds before a killed or crashed node comes back as `join --stage auto`.",
)
@click.option(
    "--standby",
    "standbys",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Standby nodes (`join --standby`): they hold no stage and take one the moment its last node is "
    "gone.",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("swarm-out"),
    show_default=True,
    metavar="DIR",
    help="Where report.json, loss.png, peers.txt and logs/ go.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds the run and the random failures.")
@click.option(
    "--run-id", default="swarm", show_default=True, help="Run id on the DHT (1-64 characters, no '.')."
)
@click.option(
    "--timeout",
    type=FiniteFloatRange(min=0.0, min_open=True),
    default=None,
    help="Stop after this many seconds.",
)
@click.option(
    "--stall-timeout",
    type=FiniteFloatRange(min=0.0),
    default=STALL_TIMEOUT_S,
    show_default=True,
    help="End the run as failed when no data node reports a new step for this many seconds, counted from "
    "the nodes' start (0: never).",
)
@click.option(
    "--skip-ratio",
    type=FiniteFloatRange(0.0, 1.0, max_open=True),
    default=0.0,
    show_default=True,
    help="Share of the transformer stages a SkipPipe path may skip (0: every path visits every stage).",
)
@click.option(
    "--planner",
    type=click.Choice(PLANNERS),
    default="skippipe",
    show_default=True,
    help="How data nodes choose paths that skip: SkipPipe's scheduler, or random skips in stage order "
    "(the paper's baseline, for comparisons).",
)
@click.option(
    "--network",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Emulate WAN links (a links file in the format of gcp12_links.json): each node sits at a site, by "
    "the file's `placement` of node names (data1, s2r1, ..) or round robin, and what it sends to a node "
    "at another site is delayed and paced as over their link.",
)
@device_option
@dtype_option("The run's compute dtype (autocast; weights stay float32).", default="float32")
def up(
    preset: str,
    stages: int | None,
    replicas: int,
    data_nodes: int,
    steps: int,
    batch_size: int | None,
    seq_len: int | None,
    fail_rate: float,
    kills: tuple[StageKill, ...],
    calm: bool,
    checkfree_plus: bool,
    edge_copies: bool,
    edge_swaps: bool,
    respawn_delay: float,
    standbys: int,
    out: Path,
    seed: int,
    run_id: str,
    timeout: float | None,
    stall_timeout: float,
    skip_ratio: float,
    planner: str,
    network: Path | None,
    device: str,
    dtype: str,
) -> None:
    """Start a whole swarm on this machine (a bootstrap peer, data nodes, stage nodes with replicas, each its
    own process on loopback), train, inject failures, and write DIR/report.json and DIR/loss.png; print a
    one-line summary of the run, whatever its outcome."""
    n_stages = stages_or_fail(preset_or_fail(preset), stages)
    device_or_fail(device)
    if calm and (kills or fail_rate):
        given = "--kill" if kills else "--fail-rate"
        raise click.UsageError(f"--calm means no failures: give either --calm or {given}, not both")
    if calm:
        kills = ()
    elif not kills and fail_rate == 0.0 and steps >= 2:
        kills = (StageKill(stage=(n_stages + 1) // 2, step=steps // 2),)  # show a stage being rebuilt
    for kill in kills:
        _check_kill(kill, n_stages, steps)
    try:  # the run the bootstrap will publish: fail here, before any process starts
        spec = RunSpec.for_preset(
            preset,
            run_id=run_id,
            stages=n_stages,
            total_steps=steps,
            batch_size=batch_size,
            seq_len=seq_len,
            seed=seed,
            checkfree_plus=checkfree_plus,
            edge_copies=edge_copies,
            skip_ratio=skip_ratio,
            planner=planner,
        )
    except RunSpecError as error:
        raise click.UsageError(str(error)) from None
    _memory_or_fail(spec, replicas, data_nodes, standbys, device)
    config = SwarmConfig(
        preset=preset,
        stages=n_stages,
        replicas=replicas,
        data_nodes=data_nodes,
        steps=steps,
        batch_size=batch_size,
        seq_len=seq_len,
        fail_rate=fail_rate,
        kills=kills,
        checkfree_plus=checkfree_plus,
        edge_copies=edge_copies,
        edge_swaps=edge_swaps,
        device=device,
        dtype=dtype,
        respawn_delay=respawn_delay,
        standbys=standbys,
        seed=seed,
        run_id=run_id,
        out=out,
        timeout=timeout,
        stall_timeout=stall_timeout or None,
        skip_ratio=skip_ratio,
        planner=planner,
        log_level=_daemon_log_level(),
    )
    if network is not None:
        config = replace(config, network=network, placement=_placement_or_fail(network, config))
    _out_or_fail(out)
    result = LocalSwarm(config).run()  # prints progress and its outcome to stderr
    click.echo(summary(result))
    if result.outcome is RunOutcome.INTERRUPTED:
        sys.exit(128 + (result.signum or signal.SIGINT))
    if result.outcome is not RunOutcome.COMPLETED:
        sys.exit(1)


def _memory_or_fail(spec: RunSpec, replicas: int, data_nodes: int, standbys: int, device: str) -> None:
    """A swarm computing on the CPU that this machine's memory cannot hold is refused before any process
    starts (`launcher.footprint`): one line, with the largest `--batch-size` that fits."""
    from swarmnode.launcher.footprint import GIB, available_bytes, swarm_footprint
    from swarmnode.precision import resolve_device

    available = available_bytes()
    if resolve_device(device).type != "cpu" or available is None:
        return
    footprint = swarm_footprint(spec, replicas, data_nodes, standbys)
    if footprint.total_bytes <= available:
        return
    fit = footprint.largest_batch(available)
    remedy = (
        f"use --batch-size {fit} or less"
        if fit >= 1
        else "use a smaller --preset or --seq-len, or fewer --replicas and --data-nodes"
    )
    raise click.UsageError(
        f"this swarm needs about {footprint.total_bytes / GIB:.1f} GiB of memory and this machine has "
        f"{available / GIB:.1f} GiB available: its {footprint.nodes} nodes compute on the CPU, and a stage "
        f"node holds the activations of up to {footprint.in_flight} microbatches of "
        f"{spec.batch_size} x {spec.seq_len} tokens at once, {footprint.microbatch_bytes / GIB:.2f} GiB "
        f"each; {remedy}"
    )


def _daemon_log_level() -> str | None:
    """The level `--log-level`/`-v` set for this process (`logging_options`), for the daemons too; None at
    the default (warning), which they have anyway."""
    level = logging.getLogger().getEffectiveLevel()
    return None if level == logging.WARNING else logging.getLevelName(level).lower()


def _check_kill(kill: StageKill, n_stages: int, steps: int) -> None:
    """A `--kill` must name a stage of the run and a step before the last (which ends the run at once)."""
    if kill.stage > n_stages:
        raise click.BadParameter(
            f"{kill}: stage {kill.stage} is beyond --stages {n_stages} (stages 0..{n_stages})",
            param_hint="--kill",
        )
    if kill.step >= steps:
        raise click.BadParameter(
            f"{kill}: step {kill.step} is not before the last step (--steps {steps}), so it would never fire",
            param_hint="--kill",
        )


def _placement_or_fail(path: Path, config: SwarmConfig) -> dict[str, str]:
    """Each initial node's site in the links file at `path`; a one-line usage error if it cannot be."""
    from protocols.errors import LocalProtocolError

    try:
        return read_network(path).place(config.initial_names())
    except LocalProtocolError as error:
        raise click.BadParameter(f"{path}: {error.reason}", param_hint="--network") from None


def _out_or_fail(out: Path) -> None:
    """Create DIR and DIR/logs now, so that an unusable `--out` is a usage error before any process starts."""
    logs = out / "logs"
    try:
        logs.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise click.BadParameter(f"cannot create {logs}: {error.strerror}", param_hint="--out") from None


def summary(result: SwarmResult) -> str:
    """One line of the report's headline figures, led by the outcome unless the run completed."""
    report = result.report

    def loss(key: str) -> str:
        return "?" if report[key] is None else f"{report[key]:.3f}"

    methods = ", ".join(
        f"{method} x{entry['count']} ({entry['mean_seconds']:.1f} s)"
        for method, entry in report["recoveries_by_method"].items()
    )
    speed = report["tokens_per_second"]
    unrecovered = "".join(
        f", stage {lost['stage']} lost at step {lost['lost_at_step']} and not rebuilt by the end"
        for lost in report["stages_not_recovered"]
    )
    outcome = "" if result.outcome is RunOutcome.COMPLETED else f"{result.outcome.value}: "
    return (
        f"{outcome}{report['steps_completed']} steps: loss {loss('initial_loss')} -> {loss('final_loss')}, "
        f"validation {loss('val_loss')}, {'?' if speed is None else f'{speed:.0f}'} tokens/s, "
        f"{len(report['failures'])} failures, recoveries: {methods or 'none'}{unrecovered}, "
        f"{report['microbatches_lost']} microbatches lost"
    )
