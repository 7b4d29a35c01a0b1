"""`swarmnode up`: a whole swarm as separate processes on loopback, with failure injection and a report.

The launcher starts the bootstrap peer, waits for its peers file, then starts the data nodes and the stage
nodes (and an observer of the DHT). It reads the daemons' JSON event lines from their stdout files, kills
nodes as the kill plan says, brings each killed or crashed node back after `respawn_delay` seconds as
`join --stage auto` (a spot market in miniature), and stops when the data nodes have finished the run, on
SIGINT, SIGTERM, SIGHUP or SIGQUIT, when no data node reports a new step for `stall_timeout` seconds, or at
the timeout. Every child is then ended by process group, and `report.json` and `loss.png` are written to the
output folder.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any, TextIO

from swarmnode.event_schema import (
    Finished,
    Joining,
    MetricsServed,
    Online,
    Recovered,
    Step,
    Validation,
    parse_line,
)
from swarmnode.launcher.config import SwarmConfig, read_peers
from swarmnode.launcher.display import Display, StageCount, status_line
from swarmnode.launcher.export import describe, export_model
from swarmnode.launcher.kill_plan import Kill, KillPlan, RandomKills
from swarmnode.launcher.nodes import (
    LaunchedNode,
    exit_message,
    read_node_metrics,
    short_peer,
    sites_text,
    stage_counts,
    stage_name,
)
from swarmnode.launcher.observe import parse_snapshot
from swarmnode.launcher.procs import ChildProcess, LineTail, StopSignals, stop_all
from swarmnode.launcher.record import RecoveryRecord, RunRecord
from swarmnode.launcher.result import RunOutcome, SwarmResult, write_results
from swarmnode.launcher.zygote import Zygote

TICK_S = 0.2  # supervision loop period
BOOTSTRAP_TIMEOUT_S = 180.0  # the bootstrap's peers file must appear within this
FINISH_GRACE_S = 30.0  # once the run is finished, how long the other data nodes get to exit on their own
STOP_GRACE_S = 5.0  # SIGTERM to SIGKILL on shutdown
OBSERVE_INTERVAL_S = 2.0
SNAPSHOT_STALE_S = 10.0


class LocalSwarm:
    """Runs one local swarm to the end; progress lines go to `stream`."""

    def __init__(self, config: SwarmConfig, stream: TextIO = sys.stderr) -> None:
        self.config = config
        self.out = config.out
        self.logs = config.out / "logs"
        self.peers_file = config.peers_file
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._started = time.monotonic()
        self._display = Display(stream, self._started)
        self._record = RunRecord(time.time())
        transformer_stages = range(1, config.stages + 1)
        self._plan = KillPlan(config.kills, RandomKills(config.fail_rate, transformer_stages, config.seed))
        self._nodes: list[LaunchedNode] = []
        self._bootstrap: ChildProcess | None = None
        self._observer: ChildProcess | None = None
        self._zygote: Zygote | None = None  # what the daemons are forked from (`zygote_server`)
        self._observer_tail: LineTail | None = None  # None once the observer has stopped
        self._snapshot: tuple[float, dict[int, StageCount]] | None = None
        self._respawns: list[tuple[float, LaunchedNode]] = []
        self._spawned = 0
        self._crashes = 0
        self._finishing_since: float | None = None
        self._all_joined = False
        self._last_step = 0  # the furthest step seen, and since when (a monotonic time): the stall bound
        self._last_step_at = self._started
        self._model: dict[str, Any] | None = None  # the report's `model` entry, once exported
        self._final: list[LaunchedNode] = []  # the daemons online when the swarm was ended

    def run(self) -> SwarmResult:
        """Run the swarm, end every child, write the report; never leaves a child process behind."""
        self.logs.mkdir(parents=True, exist_ok=True)
        outcome, message = RunOutcome.FAILED, "the launcher stopped on an unexpected error"
        with StopSignals() as stop:
            try:
                outcome, message = self._supervise(stop)
                if outcome is RunOutcome.COMPLETED:
                    self._export(stop)
            finally:
                try:
                    self._shutdown(stop)
                finally:
                    report = self._write_report(outcome, message)
        self._display.event(f"{outcome.value}: {message}; report in {self.out / 'report.json'}")
        return SwarmResult(outcome, message, stop.received[0] if stop.received else None, report)

    def _supervise(self, stop: StopSignals) -> tuple[RunOutcome, str]:
        config = self.config
        self._zygote = self._start_zygote()
        failed = self._start_bootstrap(stop)
        if failed is not None:
            return failed
        if config.observe:
            argv = config.observer_argv(OBSERVE_INTERVAL_S)
            self._observer = ChildProcess("observer", argv, self.logs, self._env, zygote=self._zygote)
            self._observer_tail = LineTail(self._observer.stdout_path)
        for index in range(config.data_nodes):
            self._spawn(f"data{index + 1}", 0, f"{index}/{config.data_nodes}")
        for stage in range(1, config.stages + 1):
            for replica in range(1, config.replicas + 1):
                self._spawn(f"s{stage}r{replica}", stage, None)
        for index in range(config.standbys):
            self._spawn(f"standby{index + 1}", None, None, standby=True)
        if config.network is not None:
            self._display.event(f"emulated links of {config.network}: {sites_text(self._nodes)}")
        standbys = f", {config.standbys} standby node(s)" if config.standbys else ""
        self._display.event(
            f"started {config.data_nodes} data node(s) and {config.stages} stage(s) x {config.replicas} "
            f"replica(s){standbys}; logs in {self.logs}"
        )
        self._last_step_at = time.monotonic()
        while True:
            now = time.monotonic()
            self._read_events()
            if self._record.step > self._last_step:
                self._last_step, self._last_step_at = self._record.step, now
            verdict = self._check_exits(now)
            if verdict is not None:
                return verdict
            if self._finishing_since is None and self._record.step >= config.steps:
                self._finishing_since = now
            if self._finishing_since is not None:
                training = any(
                    node.alive and node.stage == 0 and node.trained and not node.finished
                    for node in self._nodes
                )
                if not training or now - self._finishing_since >= FINISH_GRACE_S:
                    return RunOutcome.COMPLETED, f"{self._record.step} steps done"
            else:
                self._respawn_due(now)
                for kill in self._plan.due(now, self._record.step):
                    self._inject(kill)
                if self._stalled(now):
                    return (
                        RunOutcome.FAILED,
                        f"stalled: no data node reported a new step for {config.stall_timeout:g} s "
                        f"(at step {self._record.step}; see the logs in {self.logs})",
                    )
            if self._timed_out(now):
                return (
                    RunOutcome.TIMEOUT,
                    f"stopped by the {config.timeout:g} s timeout at step {self._record.step}",
                )
            if stop.received:
                name = signal.Signals(stop.received[0]).name
                return RunOutcome.INTERRUPTED, f"stopped by {name} at step {self._record.step}"
            self._display.status(self._status_text)
            time.sleep(TICK_S)

    def _export(self, stop: StopSignals) -> None:
        """Export the final model while the swarm still runs; say how its loss compares to the swarm's."""
        self._display.event(f"exporting the model to {self.config.model_dir}")
        self._model = export_model(self.config, self.logs, self._env, stop, self._zygote)
        self._display.event(describe(self._model, self._record.val_loss))

    def _start_zygote(self) -> Zygote | None:
        """The zygote, importing while the bootstrap peer starts (which it does not serve: the bootstrap
        imports no torch); None if the swarm runs another command than `python -m swarmnode`, or none is
        wanted."""
        command = self.config.command
        if not self.config.zygote or len(command) != 3 or command[1:] != ("-m", "swarmnode"):
            return None
        return Zygote(self.logs, self._env, python=command[0])

    def _start_bootstrap(self, stop: StopSignals) -> tuple[RunOutcome, str] | None:
        self.peers_file.unlink(missing_ok=True)
        argv = self.config.bootstrap_argv()
        self._bootstrap = bootstrap = ChildProcess("bootstrap", argv, self.logs, self._env)
        deadline = time.monotonic() + BOOTSTRAP_TIMEOUT_S
        while (peers := read_peers(self.peers_file)) is None:
            if bootstrap.poll() is not None:
                return RunOutcome.FAILED, exit_message("the bootstrap peer", bootstrap)
            if stop.received:
                return RunOutcome.INTERRUPTED, "stopped while the bootstrap peer was starting"
            if time.monotonic() >= deadline:
                return (
                    RunOutcome.FAILED,
                    f"the bootstrap peer wrote no peers file in {BOOTSTRAP_TIMEOUT_S:g} s",
                )
            if self._timed_out(time.monotonic()):
                return RunOutcome.TIMEOUT, f"stopped by the {self.config.timeout:g} s timeout during startup"
            time.sleep(TICK_S)
        self._display.event(f"bootstrap ready at {peers[0]}")
        return None

    def _timed_out(self, now: float) -> bool:
        return self.config.timeout is not None and now - self._started >= self.config.timeout

    def _stalled(self, now: float) -> bool:
        """Whether `stall_timeout` seconds passed without a new step (counted from the nodes' start)."""
        stall = self.config.stall_timeout
        return stall is not None and now - self._last_step_at >= stall

    def _spawn(
        self, name: str, stage: int | None, shard: str | None, site: str | None = None, standby: bool = False
    ) -> None:
        """Start a daemon (a standby: `join --standby`); an initial node sits at its placement's site, a
        respawned one at `site`."""
        site = self.config.placement.get(name, site)
        argv = self.config.join_argv(stage, shard, site, standby, self.config.write_identity(name))
        process = ChildProcess(name, argv, self.logs, self._env, zygote=self._zygote)
        tail = LineTail(process.stdout_path)
        initial = stage is not None
        self._nodes.append(LaunchedNode(process, stage, shard, tail, initial, site=site, standby=standby))

    def _read_events(self) -> None:
        for node in self._nodes:
            for line in node.tail.read_lines():
                event = parse_line(line, time.time())
                late = self._finishing_since is not None and not node.trained
                if event is None or (late and isinstance(event, Step | Validation)):
                    continue  # a data node that joined after the run finished does not count
                self._record.add(event)
                if isinstance(event, Step):
                    node.trained = True
                elif isinstance(event, Finished):
                    node.finished = True
                elif isinstance(event, Joining) and event.stage is not None:
                    node.stage = event.stage
                elif isinstance(event, Online):
                    self._on_online(node, event)
                elif isinstance(event, Recovered):
                    self._on_recovered(node, self._record.recoveries[-1])  # just recorded by add()
                elif isinstance(event, MetricsServed):
                    node.metrics_url = event.url
        if self._observer_tail is not None:
            for line in self._observer_tail.read_lines():
                counts = parse_snapshot(line)
                if counts is not None:
                    self._snapshot = (time.monotonic(), counts)

    def _on_online(self, node: LaunchedNode, event: Online) -> None:
        node.stage, node.peer_id, node.joined = event.stage, event.peer_id, True
        if not node.initial:
            self._display.event(
                f"{node.process.name} joined stage {event.stage} as {short_peer(event.peer_id)}"
            )
        elif not self._all_joined and all(other.joined for other in self._nodes if other.initial):
            self._all_joined = True
            seconds = time.monotonic() - self._started
            self._display.event(f"all {self.config.initial_nodes} nodes joined after {seconds:.1f} s")

    def _on_recovered(self, node: LaunchedNode, recovery: RecoveryRecord) -> None:
        how = (
            "synced from a live replica" if recovery.method == "replica" else f"rebuilt by {recovery.method}"
        )
        down = "" if recovery.downtime is None else f", after {recovery.downtime:.1f} s without a node"
        self._display.event(
            f"stage {recovery.stage} {how} in {recovery.duration:.1f} s ({node.process.name}{down})"
        )

    def _check_exits(self, now: float) -> tuple[RunOutcome, str] | None:
        if (
            self._bootstrap is not None
            and self._bootstrap.poll() is not None
            and self._finishing_since is None
        ):
            return RunOutcome.FAILED, exit_message("the bootstrap peer", self._bootstrap)
        observer = self._observer  # polled even once it stopped: poll() notes when its group is gone
        if observer is not None and observer.poll() is not None and self._observer_tail is not None:
            observer.kill()
            self._display.event(
                f"{exit_message('the swarm observer', observer)}; recovering states not shown"
            )
            self._observer_tail, self._snapshot = None, None
        for node in self._nodes:
            code = node.process.poll()
            if node.exited or code is None:
                continue
            node.exited = True
            node.process.kill()  # whatever the daemon left in its group (a p2pd) goes too
            name = node.process.name
            if code == 0 and node.stage == 0:
                self._display.event(f"{name} finished at step {self._record.step}")
                self._finishing_since = self._finishing_since or now
            elif self._finishing_since is not None:
                continue
            elif code == 0:
                self._display.event(f"{name} left the swarm")
                self._respawns.append((now + self.config.respawn_delay, node))
            else:
                self._crashes += 1
                self._record.add_failure(time.time(), node.stage, node.peer_id, name, "crash")
                self._display.event(exit_message(f"{name} (stage {stage_name(node)})", node.process))
                if self._crashes > max(10, 2 * self.config.initial_nodes):
                    last = exit_message(name, node.process)
                    return RunOutcome.FAILED, f"{self._crashes} nodes crashed; the last: {last}"
                self._respawns.append((now + self.config.respawn_delay, node))
                self._report_lost(node.stage)
        return None

    def _inject(self, kill: Kill) -> None:
        live = [node for node in self._nodes if node.alive and node.stage == kill.stage]
        if not live:
            if kill.whole_stage:
                self._display.event(f"planned kill of stage {kill.stage}: no live node in it")
            return
        victims = live if kill.whole_stage else [self._plan.random_kills.choose(live)]
        now = time.monotonic()
        for node in victims:
            read_node_metrics(node)  # what it served, before it goes
            node.process.kill()
            node.killed = node.exited = True
            name = node.process.name
            self._record.add_failure(time.time(), node.stage, node.peer_id, name, kill.cause)
            peer = f" ({short_peer(node.peer_id)})" if node.peer_id else ""
            self._display.event(
                f"killed {name}{peer} of stage {kill.stage} at step {self._record.step} [{kill.cause}]"
            )
            self._respawns.append((now + self.config.respawn_delay, node))
        self._report_lost(kill.stage)

    def _report_lost(self, stage: int | None) -> None:
        if stage is not None and not any(node.alive and node.stage == stage for node in self._nodes):
            self._record.stage_lost(time.time(), stage)
            self._display.event(f"stage {stage} lost: no node left")

    def _respawn_due(self, now: float) -> None:
        """Bring back each lost node as `--stage auto`, with its data shard in case it lands on stage 0."""
        due = [node for at, node in self._respawns if at <= now]
        self._respawns = [(at, node) for at, node in self._respawns if at > now]
        for replaced in due:
            self._spawned += 1
            name = f"spot{self._spawned}"
            self._spawn(name, None, replaced.shard, replaced.site)
            self._display.event(f"{name} starts as `join --stage auto` in place of {replaced.process.name}")

    @property
    def _helpers(self) -> list[ChildProcess]:
        """The children that are not daemons: the bootstrap peer and the observer."""
        return [child for child in (self._bootstrap, self._observer) if child is not None]

    def _fresh_snapshot(self, now: float) -> dict[int, StageCount]:
        """The observer's latest counts per stage, or none if they are older than `SNAPSHOT_STALE_S`."""
        if self._snapshot is not None and now - self._snapshot[0] <= SNAPSHOT_STALE_S:
            return self._snapshot[1]
        return {}

    def _status_text(self) -> str:
        record = self._record
        if record.step == 0 and not self._all_joined:
            online = sum(node.joined and node.alive for node in self._nodes)
            return f"starting: {online}/{self.config.initial_nodes} nodes online"
        return status_line(
            record.step,
            self.config.steps,
            record.latest_loss,
            record.val_loss,
            record.tokens_per_second(window=20.0, now=time.time()),
            stage_counts(self._nodes, self.config.stages, self._fresh_snapshot(time.monotonic())),
            record.microbatches_lost,
        )

    def _shutdown(self, stop: StopSignals) -> None:
        """End every child, whatever the display does; a second stop signal cuts the grace period short."""
        if not stop.received:
            for node in self._nodes:
                read_node_metrics(node)
        self._final = [node for node in self._nodes if node.alive and node.joined]
        children = [node.process for node in self._nodes] + self._helpers
        running = sum(child.poll() is None for child in children)
        try:
            if running:
                self._display.event(
                    f"ending {running} process(es): SIGTERM, then SIGKILL after {STOP_GRACE_S:g} s"
                )
        finally:
            try:
                left = stop_all(children, STOP_GRACE_S, hurry=lambda: len(stop.received) > 1)
            finally:
                if self._zygote is not None:
                    self._zygote.close()
        for child in left:
            self._display.event(
                f"warning: process group {child.pid} ({child.name}) still has running members"
            )
        self._read_events()

    def _write_report(self, outcome: RunOutcome, message: str) -> dict[str, Any]:
        return write_results(
            self.config,
            self._record,
            outcome,
            message,
            wall_seconds=time.monotonic() - self._started,
            helpers=self._helpers,
            nodes=self._nodes,
            final=self._final,
            model=self._model,
            warn=self._display.event,
        )
