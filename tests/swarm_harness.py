"""A real swarm on loopback for integration tests and benchmarks: every node a separate OS process.

    with LocalTestSwarm(tmp_path, run_id="t1") as swarm:
        swarm.bootstrap(steps=40)                     # waits for the peers file
        stages = [swarm.join(k) for k in (1, 2, 3)]
        swarm.wait_online(*stages)                    # polls their logs for the "online" event
        data = swarm.join(0)
        data.wait_event("finished", timeout=60)
    # on exit: every process group is ended (SIGTERM, then SIGKILL after a bound) and checked gone

Each node runs `python -m swarmnode ...` in its own session, started and ended by the launcher's supervisor
(`swarmnode.launcher.procs`), so its pid is its process group id and the group holds what it started: the
libp2p daemon (p2pd).
Its stdout (one JSON event per line) and stderr go to `{name}.out` / `{name}.err` under the swarm's folder.
Every wait polls files or `swarmnode status --json` until a deadline; nothing sleeps in place of a signal.

The /proc inspection lives in procinfo.py; the clients a test can start (`LocalTestSwarm.client`) in
swarm_clients.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import swarm_clients
from procinfo import group_members, unix_socket_paths
from prometheus_client.parser import text_string_to_metric_families

from swarmnode.event_schema import KINDS, MalformedEvent, parse_object
from swarmnode.launcher.procs import ChildProcess, stop_all

T = TypeVar("T")
logger = logging.getLogger(__name__)

POLL_S = 0.2
TERM_GRACE_S = 10.0  # a daemon gets this long to leave cleanly after SIGTERM before its group is killed
KILL_SETTLE_S = 5.0
STATUS_TIMEOUT_S = 60.0
_HIVEMIND_SOCKET = re.compile(r"/tmp/hivemind-[A-Za-z0-9_-]+\.sock")


class HarnessError(AssertionError):
    """A wait ran out, a process died early, or something was left behind."""


# ---- processes ------------------------------------------------------------------------------------------


def poll(
    check: Callable[[], T | bool | None],
    timeout: float,
    what: str,
    interval: float = POLL_S,
    alive: Callable[[], None] | None = None,
) -> T:
    """Call `check` until it returns something other than None/False, or raise after `timeout` seconds.

    `alive` (optional) is called each round and may raise to stop early (a process died).
    """
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result is not None and result is not False:
            return result  # type: ignore[return-value]
        if alive is not None:
            alive()
        if time.monotonic() >= deadline:
            raise HarnessError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def event_objects(lines: Iterable[str], source: str, kind: str | None = None) -> list[dict[str, Any]]:
    """The JSON objects among `lines`, optionally only the events of one kind. A daemon's event (a kind
    `swarmnode.event_schema` defines) that breaks the schema is skipped with a warning naming `source`;
    other objects (status snapshots, the test clients' own lines) are taken as printed."""
    found = []
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(event, dict) or (kind is not None and event.get("event") != kind):
            continue
        if event.get("event") in KINDS:
            try:
                parse_object(event, received=0.0)
            except MalformedEvent as error:
                logger.warning("%s printed a malformed event line: %s", source, error)
                continue
        found.append(event)
    return found


class NodeProcess:
    """One process of the swarm, started and ended by `swarmnode.launcher.procs.ChildProcess` (its own
    session; stdout and stderr in files), its JSON event lines parsed on read."""

    def __init__(
        self, name: str, argv: Sequence[str], folder: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        # in the swarm's folder, not the checkout: `python -m` puts the working directory first on sys.path
        self.process = ChildProcess(name, argv, folder, env, cwd=folder)
        self.out_path = self.process.stdout_path
        self.err_path = self.process.stderr_path

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def pgid(self) -> int:
        return self.process.pid  # a new session: the child leads its own group

    def poll(self) -> int | None:
        return self.process.poll()

    def lines(self) -> list[str]:
        try:
            return self.out_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return []

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        """The JSON objects printed so far (complete lines only), optionally only the events of one kind
        (`event_objects`)."""
        text = self.out_path.read_text(errors="replace") if self.out_path.exists() else ""
        return event_objects(text.split("\n")[:-1], self.name, kind)  # the last piece may be unfinished

    def stderr_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.err_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def check_alive(self) -> None:
        code = self.process.poll()
        if code is not None:
            raise HarnessError(f"{self.name} exited with {code}; stderr:\n{self.stderr_tail()}")

    def wait_event(
        self,
        kind: str,
        timeout: float,
        where: Callable[[dict[str, Any]], bool] = lambda e: True,
        must_live: bool = True,
    ) -> dict[str, Any]:
        """The first event of `kind` satisfying `where`, polling the log until `timeout`."""

        def found() -> dict[str, Any] | None:
            return next((e for e in self.events(kind) if where(e)), None)

        def alive() -> None:
            if must_live and found() is None:
                self.check_alive()

        return poll(found, timeout, f"a {kind!r} event from {self.name}", alive=alive)

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise HarnessError(f"{self.name} did not exit within {timeout:.0f} s") from None

    def terminate(self) -> None:
        """SIGTERM to the leader only, so that the daemon can close its DHT and p2pd in order."""
        self.process.terminate()

    def kill_group(self, signum: int = signal.SIGKILL) -> None:
        """Signal the node's whole process group, unless the group is gone (`ChildProcess.signal_group`)."""
        self.process.signal_group(signum)


def stop_processes(nodes: Sequence[NodeProcess]) -> dict[int, tuple[int, str]]:
    """End every node (`procs.stop_all`: SIGTERM to each leader, then to each group still running, then
    SIGKILL to every group); the processes of their groups still alive after that (none when all is clean)."""
    left = stop_all([node.process for node in nodes], TERM_GRACE_S, settle=KILL_SETTLE_S)
    return group_members(child.pid for child in left)


# ---- the swarm ------------------------------------------------------------------------------------------


def python_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


class LocalTestSwarm:
    """Bootstrap, daemons, status readers and helper clients of one run, all ended and checked on close."""

    def __init__(self, folder: Path, run_id: str, python: str = sys.executable) -> None:
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id
        self.python = python
        self.peers_file = folder / "peers.txt"
        self.nodes: list[NodeProcess] = []
        self.sockets: dict[str, str] = {}  # hivemind unix socket path -> the node seen holding it
        self.left_behind: dict[int, tuple[int, str]] = {}
        self._counts: dict[str, int] = {}
        self._closed = False

    def __enter__(self) -> LocalTestSwarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _name(self, prefix: str) -> str:
        self._counts[prefix] = self._counts.get(prefix, 0) + 1
        count = self._counts[prefix]
        return prefix if count == 1 else f"{prefix}-{count}"

    def spawn(self, name: str, argv: Sequence[str]) -> NodeProcess:
        node = NodeProcess(self._name(name), tuple(argv), self.folder, python_env())
        self.nodes.append(node)
        return node

    def swarmnode(self, name: str, *args: str) -> NodeProcess:
        return self.spawn(name, [self.python, "-m", "swarmnode", *args])

    def bootstrap(self, *options: str, timeout: float = 60.0, **flags: Any) -> NodeProcess:
        """Start the bootstrap peer (`--flag value` from keyword arguments) and wait for its peers file."""
        args = ["bootstrap", "--run-id", self.run_id, "--peers-file", str(self.peers_file), *options]
        for key, value in flags.items():
            args += [f"--{key.replace('_', '-')}", str(value)]
        node = self.swarmnode("bootstrap", *args)
        poll(
            lambda: self.peers_file.exists() and bool(self.peers_file.read_text().strip()),
            timeout,
            "the bootstrap's peers file",
            alive=node.check_alive,
        )
        node.wait_event("bootstrap", timeout)
        return node

    def join(self, stage: int | str, *options: str, threads: int = 1, name: str | None = None) -> NodeProcess:
        args = ["join", "--stage", str(stage), "--initial-peers", str(self.peers_file)]
        args += ["--run-id", self.run_id, "--threads", str(threads), *options]
        return self.swarmnode(name or f"stage{stage}", *args)

    def wait_online(self, *nodes: NodeProcess, timeout: float = 90.0) -> list[dict[str, Any]]:
        """Each node's "online" event (it has published its record), polling their logs."""
        return [node.wait_event("online", max(1.0, timeout)) for node in nodes]

    def status(self, timeout: float = STATUS_TIMEOUT_S) -> dict[str, Any]:
        """One `swarmnode status --json` read (a separate process, in its own group, ended on any outcome)."""
        node = self.swarmnode(
            "status", "status", "--initial-peers", str(self.peers_file), "--run-id", self.run_id, "--json"
        )
        try:
            code = node.wait_exit(timeout)
            if code != 0:
                raise HarnessError(f"status exited with {code}:\n{node.stderr_tail()}")
            return json.loads(node.lines()[-1])
        finally:
            self._reap(node)

    def watch_status(self) -> NodeProcess:
        """`swarmnode status --json --watch`: one snapshot line every 2 s until stopped (see `snapshots`)."""
        return self.swarmnode(
            "watch",
            "status",
            "--initial-peers",
            str(self.peers_file),
            "--run-id",
            self.run_id,
            "--json",
            "--watch",
        )

    def client(self, kind: str, *args: object) -> NodeProcess:
        """One of the clients in swarm_clients.py, run as a script (`hostile` or `weights`, see CLIENTS)."""
        script = str(Path(swarm_clients.__file__).resolve())
        argv = [self.python, script, kind, str(self.peers_file), self.run_id, *map(str, args)]
        return self.spawn(kind, argv)

    @staticmethod
    def snapshots(watcher: NodeProcess) -> list[dict[str, Any]]:
        return [e for e in watcher.events() if "stages" in e]

    def stop(self, node: NodeProcess) -> None:
        """End one node now (and check its group is gone)."""
        self._reap(node)

    def _reap(self, node: NodeProcess) -> None:
        self.note_sockets()
        self.left_behind.update(stop_processes([node]))

    def live_pids(self) -> list[int]:
        return list(group_members(node.pgid for node in self.nodes))

    def note_sockets(self) -> None:
        """Remember the hivemind unix sockets our processes hold (path -> node), to check them after close."""
        members = group_members(node.pgid for node in self.nodes)
        names = {node.pgid: node.name for node in self.nodes}
        for pid, (pgid, _) in members.items():
            for path in unix_socket_paths([pid]):
                if _HIVEMIND_SOCKET.fullmatch(path):
                    self.sockets.setdefault(path, names[pgid])

    def close(self) -> None:
        """End every process of every group, then record what is left: processes and socket files."""
        if self._closed:
            return
        self._closed = True
        self.note_sockets()
        self.left_behind.update(stop_processes(self.nodes))
        (self.folder / "teardown.json").write_text(
            json.dumps(
                {
                    "left_behind": {str(k): v for k, v in self.left_behind.items()},
                    "sockets_seen": self.sockets,
                    "sockets_left": self.leftover_sockets(),
                }
            )
        )

    def leftover_sockets(self) -> dict[str, str]:
        """Socket files of our processes that still exist, or that ending a group by SIGKILL had to remove
        (`ChildProcess.kill`): path -> node name."""
        removed = {str(path) for node in self.nodes for path in node.process.removed_sockets}
        return {
            path: name
            for path, name in sorted(self.sockets.items())
            if path in removed or os.path.exists(path)
        }

    def remove_leftover_sockets(self) -> dict[str, str]:
        """Unlink socket files our (now dead) processes left in /tmp; returns them (path -> node)."""
        left = self.leftover_sockets()
        for path in left:
            with contextlib.suppress(OSError):
                os.unlink(path)
        return left


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A Prometheus scrape's samples as {(sample name, sorted labels): value}."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def step_losses(events: Iterable[dict[str, Any]]) -> list[float]:
    return [e["loss"] for e in events if e.get("event") == "step"]


def stage_peers(summary: dict[str, Any], stage: int) -> list[dict[str, Any]]:
    return next((s["peers"] for s in summary["stages"] if s["stage"] == stage), [])


@contextlib.contextmanager
def local_test_swarm(
    folder: Path, prefix: str = "test", sockets_clean: bool = False
) -> Iterator[LocalTestSwarm]:
    """A test swarm of a fresh run id; on exit every process it started is ended (and checked gone), and
    the socket files of SIGKILLed nodes (which cannot remove their own) are removed. With `sockets_clean`,
    it also checks that no p2pd or test client left a socket file behind (beyond those the kills noted)."""
    harness = LocalTestSwarm(folder, run_id=f"{prefix}{uuid.uuid4().hex[:10]}")
    try:
        yield harness
    finally:
        harness.close()
        sockets = harness.remove_leftover_sockets()
        if harness.left_behind:
            raise AssertionError(f"processes left behind: {harness.left_behind}")
        clients = swarm_clients.CLIENTS
        ours = {path: name for path, name in sockets.items() if "p2pd" in path or name in clients}
        if sockets_clean and ours:
            raise AssertionError(f"socket files left behind: {ours}")
