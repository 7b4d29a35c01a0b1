"""`bootstrap`, `join` and `status` on the command line: bad input is a one-line error, never a traceback.

Flag and address mistakes are usage errors (exit 2) found before anything starts. A p2p daemon that cannot
start (no initial peer answers, an address that cannot be listened on) is a one-line error with exit 1: those
cases start a real p2pd, which exits on its own.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, ClassVar

import pytest
from click.testing import CliRunner
from hivemind.p2p import PeerID

import swarmnode.status
from swarmnode.cli import daemons as daemons_cli
from swarmnode.cli import main
from swarmnode.dht import SwarmDHT
from swarmnode.identity import Identity
from swarmnode.node import bootstrap as bootstrap_module
from swarmnode.runspec import RunSpec

PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWJb3oK5ovA1gAHwG9cQ7yAqBwHgdBoRa8kBZ1iFZ3bVo2"  # nobody listens there


def remove_orphan_sockets(before: set[Path]) -> None:
    """A p2pd that exits at start leaves its socket file (hivemind does not remove it): remove those that
    appeared since `before` and that no process listens on."""
    bound = {line.split()[-1] for line in Path("/proc/net/unix").read_text().splitlines()[1:]}
    for path in set(Path(tempfile.gettempdir()).glob("hivemind-p2pd-*.sock")) - before:
        if str(path) not in bound:
            path.unlink(missing_ok=True)


def usage_error(*args: str) -> str:
    result = CliRunner().invoke(main, list(args), env={"SWARMNODE_INITIAL_PEERS": ""})
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), result.exception  # click's exit, nothing raised
    assert "Traceback" not in result.output
    return result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["join", "--stage", "x", "--initial-peers", PEER], "neither a stage number nor 'auto'"),
        (["join", "--stage", "-1", "--initial-peers", PEER], "stage numbers start at 0"),
        (["join", "--stage", "1"], "no initial peers given"),
        (["join", "--stage", "0", "--shard", "3/2", "--initial-peers", PEER], "shard 3 of 2 does not exist"),
        (["join", "--stage", "0", "--shard", "a", "--initial-peers", PEER], "'a' is not I/K"),
        (["join", "--stage", "1", "--initial-peers", "garbage"], "neither a multiaddr nor a readable file"),
        (["join", "--stage", "1", "--initial-peers", "/nonexistent/file"], "not a multiaddr with a peer id"),
        (
            ["join", "--stage", "1", "--initial-peers", "/ip4/127.0.0.1/tcp/9"],
            "not a multiaddr with a peer id",
        ),
        (["bootstrap", "--preset", "nope"], "unknown preset 'nope'"),
        (["bootstrap", "--stages", "0"], "0 is not in the range"),
        (["bootstrap", "--run", "/nonexistent/run.json"], "cannot read run file"),
        (["bootstrap", "--seq-len", "4096"], "seq_len 4096 exceeds the preset's context 128"),
        (["bootstrap", "--batch-size", "0"], "0 is not in the range"),
        (["status"], "no initial peers given"),
        (
            ["status", "--initial-peers", PEER, "--run-owner", "QmNotAKey"],
            "peer id QmNotAKey does not carry its public key",
        ),
        (
            ["join", "--stage", "1", "--initial-peers", PEER, "--identity", "/dev/null"],
            "/dev/null is not an Ed25519 libp2p private key",
        ),
        (["bootstrap", "--identity", "/dev/null/x/id.key"], "Invalid value for --identity"),
        (["status", "--initial-peers", f"{PEER},/ip4/1.2.3.4"], "'/ip4/1.2.3.4' (from --initial-peers)"),
    ],
)
def test_bad_flags_are_usage_errors(args: list[str], message: str) -> None:
    assert message in usage_error(*args)


def test_a_peers_file_that_cannot_be_written_is_a_usage_error_before_the_dht_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    async def never(*args: object) -> int:
        pytest.fail("the bootstrap started")

    monkeypatch.setattr(bootstrap_module, "run_bootstrap", never)
    output = usage_error("bootstrap", "--peers-file", "/dev/null/x/peers.txt")
    assert "Invalid value for --peers-file: cannot create /dev/null/x: Not a directory" in output
    output = usage_error("bootstrap", "--peers-file", str(tmp_path))
    assert f"Invalid value for --peers-file: {tmp_path} is a directory" in output


def test_the_bootstrap_publishes_the_batch_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    published: list[RunSpec] = []

    async def run(spec: RunSpec, *args: object) -> int:
        published.append(spec)
        return 0

    monkeypatch.setattr(bootstrap_module, "run_bootstrap", run)
    result = CliRunner().invoke(main, ["bootstrap", "--batch-size", "2", "--seq-len", "64"])
    assert result.exit_code == 0, result.output
    assert (published[0].batch_size, published[0].seq_len) == (2, 64)


class FakeDHT:
    """Stands in for the bootstrap's SwarmDHT: a DHT that starts, publishes and records its shutdown."""

    instances: ClassVar[list[FakeDHT]] = []
    fail_publish = False

    def __init__(self, *args: object, **options: object) -> None:
        self.shut_down = False
        FakeDHT.instances.append(self)

    async def publish_run(self, spec: RunSpec, ttl: float) -> bool:
        if self.fail_publish:
            raise TimeoutError
        return True

    def visible_maddrs(self) -> list[str]:
        return [PEER]

    async def replicate_p2p(self) -> FakeP2P:
        return FakeP2P()

    def shutdown(self) -> None:
        self.shut_down = True

    async def close(self) -> None:
        self.shutdown()


class FakeP2P:
    """The fake DHT's p2pd client: takes stream handlers (the bootstrap serves reachability checks, and its
    transport relays)."""

    peer_id = PeerID.from_base58(PEER.rsplit("/", 1)[-1])

    async def add_binary_stream_handler(self, name: str, handler: object) -> None:
        pass

    async def remove_binary_stream_handler(self, name: str) -> None:
        pass


@pytest.fixture
def fake_dht(monkeypatch: pytest.MonkeyPatch) -> list[FakeDHT]:
    FakeDHT.instances = []
    monkeypatch.setattr(bootstrap_module, "SwarmDHT", FakeDHT)
    return FakeDHT.instances


def test_an_identity_file_keeps_the_peer_id_across_restarts(tmp_path: Path) -> None:
    """`--identity`: the first start creates the key (owner-only), every later start keeps its peer id."""
    path = tmp_path / "keys" / "bootstrap.key"
    dht = SwarmDHT("identity", identity_path=path)
    first = dht.peer_id
    dht.shutdown()
    assert path.stat().st_mode & 0o777 == 0o600
    dht = SwarmDHT("identity", identity_path=path)
    assert dht.peer_id == first == Identity.load(path).peer_id
    # a joiner's identity too (hivemind's identity check reads RSA keys only: every join --identity failed)
    joiner_key = tmp_path / "keys" / "joiner.key"
    joiner = SwarmDHT("identity", dht.visible_maddrs(), identity_path=joiner_key)
    try:
        assert joiner.peer_id == Identity.load(joiner_key).peer_id
    finally:
        joiner.shutdown()
        dht.shutdown()
    fresh = SwarmDHT("identity")
    try:
        assert fresh.peer_id != first  # without one, a fresh key each start
    finally:
        fresh.shutdown()


def test_the_bootstrap_shuts_its_dht_down_when_the_peers_file_cannot_be_written(
    fake_dht: list[FakeDHT], caplog: pytest.LogCaptureFixture
) -> None:
    peers = Path("/dev/null/x/peers.txt")  # its folder went away after the command line was checked
    assert asyncio.run(bootstrap_module.run_bootstrap(RunSpec(), "127.0.0.1", 0, False, peers)) == 1
    assert [dht.shut_down for dht in fake_dht] == [True]
    assert "cannot write the peers file /dev/null/x/peers.txt: Not a directory" in caplog.text


def test_the_bootstrap_shuts_its_dht_down_when_publishing_fails(
    fake_dht: list[FakeDHT], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(FakeDHT, "fail_publish", True)
    with pytest.raises(TimeoutError):
        asyncio.run(bootstrap_module.run_bootstrap(RunSpec(), "127.0.0.1", 0, False, None))
    assert [dht.shut_down for dht in fake_dht] == [True]


class SlowObserver:
    """Stands in for the status command's SwarmObserver: its DHT reads time out as the script says."""

    script: ClassVar[list[Any]] = []
    closed = False

    def __init__(self, initial_peers: list[str], run_id: str, run_owners: tuple[str, ...]) -> None:
        pass

    def snapshot(self) -> dict[str, Any]:
        answer = SlowObserver.script.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def close(self) -> None:
        SlowObserver.closed = True


@pytest.fixture
def slow_observer(monkeypatch: pytest.MonkeyPatch) -> type[SlowObserver]:
    monkeypatch.setattr(swarmnode.status, "SwarmObserver", SlowObserver)
    monkeypatch.setattr(daemons_cli.time, "sleep", lambda seconds: None)
    SlowObserver.script, SlowObserver.closed = [], False
    return SlowObserver


def test_status_reports_a_dht_timeout_in_one_line(slow_observer: type[SlowObserver]) -> None:
    slow_observer.script = [TimeoutError()]
    result = CliRunner().invoke(main, ["status", "--initial-peers", PEER])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert result.output == "Error: a DHT call got no answer within 10 s\n"
    assert slow_observer.closed


def test_status_watch_goes_on_after_a_dht_timeout(slow_observer: type[SlowObserver]) -> None:
    snapshot = {"run_id": "swarm", "complete": False, "loss": None, "stages": [], "run": None}
    slow_observer.script = [TimeoutError(), snapshot, KeyboardInterrupt()]  # Ctrl-C ends --watch
    result = CliRunner().invoke(main, ["status", "--initial-peers", PEER, "--watch", "--json"])
    assert result.exit_code == 0, result.output
    first, second = result.output.splitlines()
    assert first.endswith(" a DHT call got no answer within 10 s; trying again")
    assert second == '{"run_id": "swarm", "complete": false, "loss": null, "stages": [], "run": null}'
    assert slow_observer.closed


def test_a_peers_file_with_a_bad_line_is_named(tmp_path: Path) -> None:
    peers = tmp_path / "peers.txt"
    peers.write_text(f"{PEER}\nnot-an-address\n")
    output = usage_error("status", "--initial-peers", str(peers))
    assert "'not-an-address'" in output and str(peers) in output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["status", "--initial-peers", PEER], "Error: no initial peer answered"),
        (["bootstrap", "--host", "192.0.2.1"], "Error: cannot listen on 192.0.2.1:0"),  # not this machine's
    ],
)
def test_a_p2p_daemon_that_cannot_start_is_a_one_line_error(args: list[str], message: str) -> None:
    before = set(Path(tempfile.gettempdir()).glob("hivemind-p2pd-*.sock"))
    done = subprocess.run(
        [sys.executable, "-m", "swarmnode", *args], capture_output=True, text=True, timeout=120, check=False
    )
    remove_orphan_sockets(before)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert lines and lines[-1].startswith(message), done.stderr
