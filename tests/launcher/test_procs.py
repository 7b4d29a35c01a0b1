"""Process supervision with real child processes: groups, grandchildren, SIGTERM then SIGKILL, log tails."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from proc_state import running

from swarmnode.launcher.procs import ChildProcess, LineTail, StopSignals, group_running, stop_all

# A child that starts a grandchild (as a daemon starts its p2pd), prints its pid, and waits.
PARENT = """
import signal, subprocess, sys, time
if sys.argv[1] == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print(grandchild.pid, flush=True)
print("partial line without newline", end="", flush=True)
time.sleep(300)
"""


def start_parent(tmp_path: Path, name: str, mode: str = "plain") -> tuple[ChildProcess, int]:
    child = ChildProcess(name, [sys.executable, "-c", PARENT, mode], tmp_path)
    tail = LineTail(child.stdout_path)
    deadline = time.monotonic() + 20
    while not (lines := tail.read_lines()):
        assert time.monotonic() < deadline, "the child printed nothing"
        time.sleep(0.02)
    return child, int(lines[0])


@pytest.fixture
def cleanup() -> Iterator[list[ChildProcess]]:
    children: list[ChildProcess] = []
    yield children
    stop_all(children, grace=0.0)


def test_kill_ends_child_and_grandchild(tmp_path: Path, cleanup: list[ChildProcess]) -> None:
    child, grandchild = start_parent(tmp_path, "victim")
    cleanup.append(child)
    assert child.pid == os.getpgid(child.pid) != os.getpgid(0)  # its own process group
    assert os.getpgid(grandchild) == child.pid
    assert child.group_running()
    assert child.kill() == -9
    deadline = time.monotonic() + 5
    while running(grandchild) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not running(child.pid) and not running(grandchild)
    assert not child.group_running() and not group_running(child.pid)
    assert child.stdout_path == tmp_path / "victim.out" and child.stderr_path.exists()


def test_stop_all_terminates_then_kills(tmp_path: Path, cleanup: list[ChildProcess]) -> None:
    polite, polite_grandchild = start_parent(tmp_path, "polite")
    stubborn, stubborn_grandchild = start_parent(tmp_path, "stubborn", "ignore-term")
    cleanup += [polite, stubborn]
    started = time.monotonic()
    left = stop_all([polite, stubborn], grace=1.0)
    assert left == []
    assert 1.0 <= time.monotonic() - started < 10
    assert polite.returncode == -15  # SIGTERM reached the child itself...
    assert stubborn.returncode == -9  # ...and SIGKILL whoever ignored it
    for pid in (polite.pid, polite_grandchild, stubborn.pid, stubborn_grandchild):
        assert not running(pid)  # grandchildren die with their group even though their parent went politely


def test_stop_all_cleans_the_group_of_a_child_that_already_exited(tmp_path: Path) -> None:
    script = "import subprocess, sys; print(subprocess.Popen(['sleep', '300']).pid, flush=True)"
    child = ChildProcess("leaver", [sys.executable, "-c", script], tmp_path)
    deadline = time.monotonic() + 20
    while child.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    grandchild = int(child.stdout_path.read_text())
    assert child.returncode == 0 and running(grandchild)  # the orphan a dead daemon leaves: a p2pd
    assert stop_all([child], grace=1.0) == []
    assert not running(grandchild)


# A child that leaves a grandchild which, on SIGTERM, writes "cleaned" (as a p2pd removes its sockets).
LEAVER = """
import subprocess, sys
code = (
    "import pathlib, signal, sys, time\\n"
    "done = pathlib.Path(sys.argv[1])\\n"
    "signal.signal(signal.SIGTERM, lambda *_: (done.write_text('cleaned'), sys.exit(0)))\\n"
    "print('ready', flush=True); time.sleep(300)\\n"
)
grandchild = subprocess.Popen([sys.executable, "-c", code, sys.argv[1]], stdout=subprocess.PIPE)
print(grandchild.stdout.readline().decode().strip(), flush=True)
"""


def test_stop_all_terms_a_group_its_leader_left_before_killing_it(tmp_path: Path) -> None:
    done = tmp_path / "done"
    child = ChildProcess("leaver", [sys.executable, "-c", LEAVER, str(done)], tmp_path, cwd=tmp_path)
    assert child.wait(20) == 0 and child.stdout_path.read_text() == "ready\n"
    assert child.group_running()  # the grandchild lives on in the group
    assert stop_all([child], grace=1.0) == []
    assert done.read_text() == "cleaned"  # it had its SIGTERM before the group's SIGKILL


def test_a_group_that_emptied_after_its_leader_was_reaped_is_never_signalled_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    child, _ = start_parent(tmp_path, "victim")
    assert child.kill() == -9  # a node killed mid-run
    deadline = time.monotonic() + 5
    while group_running(child.pid):
        assert time.monotonic() < deadline, "the group did not empty"
        time.sleep(0.02)
    assert child.poll() == -9  # the supervisor's next poll: from now on the group id may be reused
    real_killpg = os.killpg
    signalled: list[tuple[int, int]] = []

    def killpg(pgid: int, signum: int) -> None:
        if signum:
            signalled.append((pgid, signum))
        real_killpg(pgid, signum)

    monkeypatch.setattr(os, "killpg", killpg)
    assert stop_all([child], grace=1.0) == []  # the shutdown, maybe much later
    child.signal_group(signal.SIGTERM)
    assert signalled == []


def test_stderr_tail(tmp_path: Path) -> None:
    script = "import sys; sys.stderr.write('Traceback\\n  ...\\nError: ' + 'x' * 500 + '\\n\\n'); sys.exit(3)"
    child = ChildProcess("crasher", [sys.executable, "-c", script], tmp_path)
    while child.poll() is None:
        time.sleep(0.02)
    tail = child.stderr_tail(limit=40)
    assert child.returncode == 3 and len(tail) == 40 and tail.endswith("x")
    child.kill()


def test_line_tail_returns_complete_lines_only(tmp_path: Path) -> None:
    path = tmp_path / "log.out"
    tail = LineTail(path)
    assert tail.read_lines() == []  # no file yet
    with path.open("wb") as file:
        file.write(b'{"event": "step"}\npart')
        file.flush()
        assert tail.read_lines() == ['{"event": "step"}']
        file.write(b"ial\n\xff\n")
        file.flush()
        assert tail.read_lines() == ["partial", "\ufffd"]
        assert tail.read_lines() == []


STOP_SIGNALS = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT]


@pytest.fixture
def outside() -> Iterator[list[int]]:
    """Records the stop signals that reach the test process outside StopSignals (so that one it misses fails
    the test instead of ending the test run), then restores their handlers."""
    received: list[int] = []

    def record(signum: int, frame: object) -> None:
        received.append(signum)

    previous = {signum: signal.signal(signum, record) for signum in STOP_SIGNALS}
    yield received
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def test_stop_signals_record_instead_of_ending(outside: list[int]) -> None:
    before = [signal.getsignal(signum) for signum in STOP_SIGNALS]
    with StopSignals() as stop:
        for signum in STOP_SIGNALS:
            os.kill(os.getpid(), signum)
        deadline = time.monotonic() + 5
        while len(stop.received) + len(outside) < len(STOP_SIGNALS) and time.monotonic() < deadline:
            time.sleep(0.01)
    assert (stop.received, outside) == (STOP_SIGNALS, [])
    assert [signal.getsignal(signum) for signum in STOP_SIGNALS] == before


def test_stop_all_cuts_the_grace_short_when_hurried(tmp_path: Path, cleanup: list[ChildProcess]) -> None:
    stubborn, grandchild = start_parent(tmp_path, "stubborn", "ignore-term")
    cleanup.append(stubborn)
    started = time.monotonic()
    hurried = iter([False, False, True])  # a second Ctrl-C arrives during the grace period
    assert stop_all([stubborn], grace=60.0, hurry=lambda: next(hurried, True)) == []
    assert time.monotonic() - started < 10
    assert stubborn.returncode == -9 and not running(grandchild)


# A child whose grandchild listens on two unix sockets (as p2pd does), then prints and waits.
LISTENER = """
import socket, subprocess, sys, time
code = (
    "import socket, sys, time\\n"
    "servers = []\\n"
    "for path in sys.argv[1:]:\\n"
    "    s = socket.socket(socket.AF_UNIX); s.bind(path); s.listen(); servers.append(s)\\n"
    "print('listening', flush=True); time.sleep(300)\\n"
)
grandchild = subprocess.Popen([sys.executable, "-c", code, *sys.argv[1:]], stdout=subprocess.PIPE)
print(grandchild.stdout.readline().decode().strip(), flush=True)
time.sleep(300)
"""


def test_kill_removes_the_hivemind_sockets_of_the_group(tmp_path: Path, cleanup: list[ChildProcess]) -> None:
    ours, other = tmp_path / "hivemind-p2pd-test.sock", tmp_path / "someone-else.sock"
    child = ChildProcess("listener", [sys.executable, "-c", LISTENER, str(ours), str(other)], tmp_path)
    cleanup.append(child)
    tail, deadline = LineTail(child.stdout_path), time.monotonic() + 20
    while tail.read_lines() != ["listening"]:
        assert time.monotonic() < deadline and child.poll() is None, child.stderr_tail()
        time.sleep(0.02)
    assert ours.exists() and other.exists()
    child.kill()
    assert not ours.exists()  # nothing in the group could remove it any more
    assert other.exists()  # not hivemind's: left alone
