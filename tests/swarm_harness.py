"""A real swarm on loopback for integration tests and benchmarks: every node a separate OS process.

    with LocalTestSwarm(tmp_path, run_id="t1") as swarm:
        swarm.bootstrap(steps=40)                     # waits for the peers file
        stages = [swarm.join(k) for k in (1, 2, 3)]
        swarm.wait_online(*stages)                    # polls their logs for the "online" event
        data = swarm.join(0)
        data.wait_event("finished", timeout=60)
    # on exit: every process group is ended (SIGTERM, then SIGKILL after a bound) and checked gone

Each node runs `python -m swarmnode ...` in its own session (`start_new_session=True`), so its pid is its
process group id and the group holds what it started: the forked DHT process and the libp2p daemon (p2pd).
Its stdout (one JSON event per line) and stderr go to `{name}.out` / `{name}.err` under the swarm's folder.
Every wait polls files or `swarmnode status --json` until a deadline; nothing sleeps in place of a signal.

Run as a script, this file is also the tests' clients of a swarm: a hostile peer (`hostile_main`) and an
observer of two replicas' weights (`weights_main`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

POLL_S = 0.2
TERM_GRACE_S = 10.0  # a daemon gets this long to leave cleanly after SIGTERM before its group is killed
KILL_SETTLE_S = 5.0
STATUS_TIMEOUT_S = 60.0
VALID_ATTEMPTS = 10  # the hostile peer's tries of its valid-looking call (see hostile_main)
WEIGHTS_PERIOD_S = 0.1  # how often the weights observer asks both replicas for their weights
_HIVEMIND_SOCKET = re.compile(r"/tmp/hivemind-[A-Za-z0-9_-]+\.sock")


class HarnessError(AssertionError):
    """A wait ran out, a process died early, or something was left behind."""


# ---- processes ------------------------------------------------------------------------------------------


def _proc_stat(pid: int) -> tuple[str, str, int, int] | None:
    """(comm, state, ppid, pgid) of a live /proc entry, or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    rest = stat[stat.rindex(")") + 2 :].split()
    return comm, rest[0], int(rest[1]), int(rest[2])


def group_members(pgids: Iterable[int]) -> dict[int, tuple[int, str]]:
    """Live (not zombie) processes of the given process groups: pid -> (pgid, command name)."""
    wanted = set(pgids)
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _proc_stat(int(entry))
        if stat is not None and stat[3] in wanted and stat[1] != "Z":
            found[int(entry)] = (stat[3], stat[0])
    return found


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        pass
    return inodes


def unix_socket_paths(pids: Iterable[int]) -> set[str]:
    """Filesystem paths of the unix sockets the given processes hold open (from /proc/net/unix)."""
    inodes: set[str] = set()
    for pid in pids:
        inodes |= _socket_inodes(pid)
    paths = set()
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return paths
    for line in lines:
        parts = line.split()
        if len(parts) >= 8 and parts[6] in inodes and parts[7].startswith("/"):
            paths.add(parts[7])
    return paths


def udp_sockets_of(pids: Iterable[int]) -> list[str]:
    """Lines of `ss -uanp` naming any of the given pids: UDP sockets they own."""
    wanted = {str(pid) for pid in pids}
    out = subprocess.run(["ss", "-uanp"], capture_output=True, text=True, timeout=10, check=True).stdout
    return [line for line in out.splitlines() if set(re.findall(r"pid=(\d+)", line)) & wanted]


def tcp_listeners_of(pids: Iterable[int]) -> list[str]:
    """Lines of `ss -tlnp` naming any of the given pids: TCP sockets they listen on."""
    wanted = {str(pid) for pid in pids}
    out = subprocess.run(["ss", "-tlnp"], capture_output=True, text=True, timeout=10, check=True).stdout
    return [line for line in out.splitlines() if set(re.findall(r"pid=(\d+)", line)) & wanted]


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


@dataclass
class NodeProcess:
    """One child process in its own session; stdout and stderr in files; JSON event lines parsed on read."""

    name: str
    argv: tuple[str, ...]
    folder: Path
    env: dict[str, str] | None = None
    popen: subprocess.Popen[bytes] = field(init=False)
    started_at: float = field(init=False)

    def __post_init__(self) -> None:
        self.out_path = self.folder / f"{self.name}.out"
        self.err_path = self.folder / f"{self.name}.err"
        self.started_at = time.monotonic()
        with self.out_path.open("wb") as out, self.err_path.open("wb") as err:
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=self.env,
                cwd=self.folder,  # not the checkout: `python -m` puts the working directory first on sys.path
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def pgid(self) -> int:
        return self.popen.pid  # start_new_session: the child leads its own group

    def poll(self) -> int | None:
        return self.popen.poll()

    def lines(self) -> list[str]:
        try:
            return self.out_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return []

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        """The JSON events printed so far (complete lines only), optionally only those of one kind."""
        found = []
        text = self.out_path.read_text(errors="replace") if self.out_path.exists() else ""
        for line in text.split("\n")[:-1]:  # the last piece may be a line still being written
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict) and (kind is None or event.get("event") == kind):
                found.append(event)
        return found

    def stderr_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.err_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def check_alive(self) -> None:
        code = self.popen.poll()
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
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise HarnessError(f"{self.name} did not exit within {timeout:.0f} s") from None

    def terminate(self) -> None:
        """SIGTERM to the leader only, so that the daemon can close its DHT and p2pd in order."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)

    def kill_group(self, signum: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, signum)


def stop_processes(nodes: Sequence[NodeProcess], grace: float = TERM_GRACE_S) -> dict[int, tuple[int, str]]:
    """End every node: SIGTERM to each leader, `grace` seconds to exit, SIGTERM then SIGKILL to every group.

    Returns the processes of their groups still alive afterwards (empty when all is clean).
    """
    for node in nodes:
        node.terminate()
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(node.poll() is None for node in nodes):
        time.sleep(0.05)
    pgids = [node.pgid for node in nodes]
    if group_members(pgids):  # a daemon that exited may have left its DHT process or p2pd
        for node in nodes:
            node.kill_group(signal.SIGTERM)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and group_members(pgids):
            time.sleep(0.05)
    for node in nodes:
        node.kill_group(signal.SIGKILL)
    for node in nodes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.popen.wait(KILL_SETTLE_S)
    deadline = time.monotonic() + KILL_SETTLE_S
    while time.monotonic() < deadline and group_members(pgids):
        time.sleep(0.05)
    return group_members(pgids)


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
            lambda: self.peers_file.exists() and self.peers_file.read_text().strip(),
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
        """A client of this file run as a script (`hostile`: `hostile_main`, `weights`: `weights_main`)."""
        script = str(Path(__file__).resolve())
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
        left = stop_processes([node])
        self.left_behind.update(left)

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
        """Socket files of our processes that still exist: path -> node name."""
        return {path: name for path, name in sorted(self.sockets.items()) if os.path.exists(path)}

    def remove_leftover_sockets(self) -> dict[str, str]:
        """Unlink socket files our (now dead) processes left in /tmp; returns them (path -> node)."""
        left = self.leftover_sockets()
        for path in left:
            with contextlib.suppress(OSError):
                os.unlink(path)
        return left


def step_losses(events: Iterable[dict[str, Any]]) -> list[float]:
    return [e["loss"] for e in events if e.get("event") == "step"]


def stage_peers(summary: dict[str, Any], stage: int) -> list[dict[str, Any]]:
    return next((s["peers"] for s in summary["stages"] if s["stage"] == stage), [])


# ---- clients of the swarm (run as scripts) -------------------------------------------------------------


def _client_dht(peers_file: str):  # type: ignore[no-untyped-def]
    """A DHT client of the run on loopback, no NAT port mapping (hivemind imported here, not by pytest)."""
    import hivemind

    from swarmnode.dht import read_initial_peers

    return hivemind.DHT(
        initial_peers=read_initial_peers(peers_file),
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        nat_port_map=False,
        client_mode=True,
        start=True,
        await_ready=True,
    )


def _say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def hostile_main(argv: Sequence[str]) -> int:
    """`python swarm_harness.py hostile PEERS_FILE RUN_ID DIM GO_FILE STAGE:PEER_ID:ATTACK ...`

    Joins the run's DHT as a client and waits for GO_FILE to exist. Then, for each target, it sends one bad
    "forward" (ATTACK: garbage, nan or shape) and then a valid-looking one, printing one JSON line per call:
    {"target", "stage", "attack", "call": "bad"|"valid", "outcome": "error"|"raised"|"ok", "kind", "detail"}.
    Its first line is {"event": "ready", "peer_id": ...}, its last {"event": "done"}.
    """
    import asyncio

    import torch
    from hivemind.p2p import PeerID

    from protocols.messages import Error, Forward, TensorSpec, decode, encode
    from swarmnode.transport import RemoteError, Transport, TransportError

    peers_file, run_id, width_text, go_file, *targets = argv
    width = int(width_text)  # the model's hidden size: a valid-looking tensor is (1, 16, width)
    go = Path(go_file)

    async def call(transport: Transport, peer: str, meta: bytes, tensors: list[torch.Tensor]) -> dict:
        try:
            reply, _ = await transport.call(PeerID.from_base58(peer), "forward", meta, tensors, timeout=20.0)
        except RemoteError as error:
            return {"outcome": "raised", "kind": error.kind, "detail": error.message}
        except TransportError as error:
            return {"outcome": "raised", "kind": type(error).__name__, "detail": str(error)}
        try:
            message = decode(reply)
        except Exception as error:  # an unreadable reply counts as refused too, but say so
            return {"outcome": "raised", "kind": "undecodable_reply", "detail": str(error)}
        if isinstance(message, Error):
            return {"outcome": "error", "kind": str(message.code), "detail": message.reason}
        return {"outcome": "ok", "kind": type(message).__name__, "detail": ""}

    def forward(me: str, peer: str, stage: int, shape: tuple[int, ...], iteration: int) -> bytes:
        spec = (TensorSpec("hidden", shape, "float32"),)
        return encode(Forward(run_id, iteration, 0, (me, peer, me), 1, (0, stage, 0), (1, 1, 1), spec))

    async def attack(p2p) -> None:  # type: ignore[no-untyped-def]
        transport = Transport(p2p)
        me = str(p2p.peer_id)
        _say(event="ready", peer_id=me)
        deadline = time.monotonic() + 120
        while not go.exists():  # the test says when to attack (for example: once training runs)
            if time.monotonic() > deadline:
                raise SystemExit("no go signal")
            await asyncio.sleep(0.1)
        good = (1, 16, width)
        for target in targets:
            stage_text, peer, kind = target.split(":")
            stage = int(stage_text)
            if kind == "garbage":
                meta, tensors = b"\xc1\xff not msgpack at all", [torch.zeros(good)]
            elif kind == "nan":
                meta, tensors = forward(me, peer, stage, good, 10**9), [torch.full(good, float("nan"))]
            elif kind == "shape":
                bad = (1, 16, width + 3)
                meta, tensors = forward(me, peer, stage, bad, 10**9), [torch.zeros(bad)]
            else:
                raise SystemExit(f"unknown attack {kind!r}")
            result = await call(transport, peer, meta, tensors)
            _say(target=peer, stage=stage, attack=kind, call="bad", **result)
            valid = forward(me, peer, stage, good, 10**9 + 1), [torch.randn(good)]
            # A refusal can reach us as a broken stream instead of the "banned" answer: the server closes
            # the stream after reading only the frame's prefix, our next write fails, and asyncio's reader
            # then raises that error instead of returning the answer it holds. So try a few fresh streams.
            attempts = []
            for _ in range(VALID_ATTEMPTS):
                attempts.append(await call(transport, peer, *valid))
                if attempts[-1]["kind"] != "PeerUnreachable":
                    break
                await asyncio.sleep(0.2)
            _say(target=peer, stage=stage, attack=kind, call="valid", **attempts[-1], attempts=attempts)
        await transport.close()
        _say(event="done")

    return _run_client(peers_file, attack)


def weights_main(argv: Sequence[str]) -> int:
    """`python swarm_harness.py weights PEERS_FILE RUN_ID STAGE STOP_FILE PEER_A PEER_B`

    Until STOP_FILE exists, asks both replicas for their weights (the "state" RPC a newcomer uses) every
    WEIGHTS_PERIOD_S, keeping the first copy it sees after each of their steps, and, once per outer step,
    their NoLoCo slow weights phi (in the "optimizer" part). Then it prints one JSON line per step both were
    seen at, {"step", "outer": [outer step of a, of b], "distance": |theta_a - theta_b|, "norm": |theta_a|},
    one per outer step both were seen at, {"outer_step", "phi_distance": |phi_a - phi_b|, "phi_norm"}, and
    finally {"event": "done", "rounds": n}.
    """
    import asyncio

    import torch
    from hivemind.p2p import PeerID

    from protocols.messages import StatePart, StateRequest, StateTransfer, decode, encode
    from swarmnode.node.state import unpack
    from swarmnode.transport import Transport, TransportError

    peers_file, run_id, stage_text, stop_file, *peers = argv
    stage = int(stage_text)
    stop = Path(stop_file)
    thetas: dict[str, dict[int, tuple[int, torch.Tensor]]] = {peer: {} for peer in peers}
    phis: dict[str, dict[int, torch.Tensor]] = {peer: {} for peer in peers}

    async def fetch(transport: Transport, peer: str, part: StatePart) -> tuple[StateTransfer, dict] | None:
        request = encode(StateRequest(run_id, stage, (part,)))
        try:
            meta, tensors = await transport.call(PeerID.from_base58(peer), "state", request, [], timeout=20.0)
            header = decode(meta, StateTransfer)
        except (TransportError, ValueError):
            return None  # not online yet, or busy: next round
        return header, unpack(header.tensors, tensors)

    def flat(tensors: dict) -> torch.Tensor:
        return torch.cat([tensors[name].flatten().double() for name in sorted(tensors)])

    async def sample(transport: Transport, peer: str) -> None:
        got = await fetch(transport, peer, StatePart.WEIGHTS)
        if got is None:
            return
        header, weights = got
        thetas[peer].setdefault(header.step, (header.outer_step, flat(weights)))
        if header.outer_step not in phis[peer]:
            got = await fetch(transport, peer, StatePart.OPTIMIZER)
            if got is not None:
                prefix = "outer.phi."
                phi = {name: t for name, t in got[1].items() if name.startswith(prefix)}
                phis[peer].setdefault(got[0].outer_step, flat(phi))

    async def observe(p2p) -> None:  # type: ignore[no-untyped-def]
        transport = Transport(p2p)
        _say(event="ready", peer_id=str(p2p.peer_id))
        deadline = time.monotonic() + 600
        rounds = 0
        while not stop.exists() and time.monotonic() < deadline:
            await asyncio.gather(*(sample(transport, peer) for peer in peers))
            rounds += 1
            await asyncio.sleep(WEIGHTS_PERIOD_S)
        await transport.close()
        a, b = (thetas[peer] for peer in peers)
        for step in sorted(set(a) & set(b)):
            (outer_a, theta_a), (outer_b, theta_b) = a[step], b[step]
            distance = float((theta_a - theta_b).norm())
            _say(step=step, outer=[outer_a, outer_b], distance=distance, norm=float(theta_a.norm()))
        a, b = (phis[peer] for peer in peers)
        for outer in sorted(set(a) & set(b)):
            phi_distance = float((a[outer] - b[outer]).norm())
            _say(outer_step=outer, phi_distance=phi_distance, phi_norm=float(a[outer].norm()))
        _say(event="done", rounds=rounds)

    return _run_client(peers_file, observe)


def _run_client(peers_file: str, body) -> int:  # type: ignore[no-untyped-def]
    """Run `body(p2p)` on a replica of a fresh DHT client's P2P; shut both down whatever happens."""
    import asyncio

    async def main(dht) -> None:  # type: ignore[no-untyped-def]
        p2p = await dht.replicate_p2p()
        try:
            await body(p2p)
        finally:
            await p2p.shutdown()  # the replica's client socket file goes with it

    dht = _client_dht(peers_file)
    try:
        asyncio.run(main(dht))
    finally:
        dht.shutdown()
    return 0


CLIENTS = {"hostile": hostile_main, "weights": weights_main}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in CLIENTS:
        raise SystemExit(f"usage: {sys.argv[0]} {{{','.join(CLIENTS)}}} ARGS... (see their docstrings)")
    raise SystemExit(CLIENTS[sys.argv[1]](sys.argv[2:]))
