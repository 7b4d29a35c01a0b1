"""The zygote `swarmnode up` forks its daemons from: real forks of real `swarmnode` commands, each in a
session of its own with its own files and environment, reaped by the zygote and reported to the launcher;
killed by group like any child; a fresh process when the zygote is gone."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from proc_state import running

from swarmnode import __version__
from swarmnode.launcher.procs import ChildProcess, stop_all
from swarmnode.launcher.zygote import ZYGOTE_LOST, ForkedProcess, Zygote

SWARMNODE = (sys.executable, "-m", "swarmnode")

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def zygote(tmp_path: Path) -> Iterator[Zygote]:
    zygote = Zygote(tmp_path, os.environ)
    try:
        zygote.wait_ready()
        yield zygote
    finally:
        zygote.close()
        assert not running(zygote.pid)


def wait_for(check: object, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s"
        time.sleep(0.05)


def test_a_forked_command_gets_its_own_session_files_and_environment(tmp_path: Path, zygote: Zygote) -> None:
    env = {**os.environ, "SWARMNODE_INITIAL_PEERS": "not-a-multiaddr"}  # join reads it when no flag names one
    child = ChildProcess("join", [*SWARMNODE, "join", "--stage", "1"], tmp_path, env, zygote=zygote)
    assert isinstance(child._popen, ForkedProcess)  # forked, not started afresh
    assert child.wait(60) == 2  # a usage error, reported by the zygote, which reaped it
    assert "'not-a-multiaddr'" in child.stderr_path.read_text() and "Traceback" not in child.stderr_tail()
    other = ChildProcess("version", [*SWARMNODE, "--version"], tmp_path, zygote=zygote)
    assert other.wait(60) == 0 and __version__ in other.stdout_path.read_text()
    assert other.pid != child.pid and not running(child.pid) and not running(other.pid)


def test_a_forked_daemon_is_killed_by_group_and_reported(tmp_path: Path, zygote: Zygote) -> None:
    peers = tmp_path / "peers.txt"
    argv = [*SWARMNODE, "bootstrap", "--run-id", "zyg", "--peers-file", str(peers), "--host", "127.0.0.1"]
    child = ChildProcess("bootstrap", argv, tmp_path, zygote=zygote)
    try:
        wait_for(lambda: peers.exists() and peers.read_text().strip(), "peers file")
        assert os.getpgid(child.pid) == child.pid != os.getpgid(zygote.pid)  # a session of its own
        assert os.getsid(child.pid) == child.pid
        assert child.poll() is None and child.group_running()
        assert child.kill() == -signal.SIGKILL
        wait_for(lambda: not child.group_running(), "end of the group (its p2pd)", 10)
    finally:
        stop_all([child], grace=0.0)


def test_children_outlive_a_lost_zygote_and_later_ones_start_afresh(tmp_path: Path, zygote: Zygote) -> None:
    peers = tmp_path / "peers.txt"
    argv = [*SWARMNODE, "bootstrap", "--run-id", "zyg", "--peers-file", str(peers), "--host", "127.0.0.1"]
    child = ChildProcess("bootstrap", argv, tmp_path, zygote=zygote)
    later: list[ChildProcess] = []
    try:
        wait_for(lambda: peers.exists() and peers.read_text().strip(), "peers file")
        os.kill(zygote.pid, signal.SIGKILL)
        wait_for(lambda: not zygote.alive, "word of the zygote's end", 10)
        assert child.poll() is None  # the daemon runs on
        later.append(ChildProcess("version", [*SWARMNODE, "--version"], tmp_path, zygote=zygote))
        assert not isinstance(later[0]._popen, ForkedProcess)
        assert later[0].wait(60) == 0 and __version__ in later[0].stdout_path.read_text()
        child.signal_group(signal.SIGKILL)
        wait_for(lambda: child.poll() is not None, "the orphan's end", 10)
        assert child.returncode == ZYGOTE_LOST  # nobody could tell its exit code
    finally:
        stop_all([child, *later], grace=0.0)
