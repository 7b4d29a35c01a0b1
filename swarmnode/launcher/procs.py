"""Process supervision: each child in its own process group, its output in files, ended by group.

A daemon starts a libp2p daemon (p2pd); killing only the daemon's pid would leave it running. Every child
therefore starts a new session (`start_new_session=True`, so its pid is its process group id and the
terminal's Ctrl-C does not reach it) and is ended with `os.killpg`, which reaches whatever it started.
Orphans that died but were not reaped by init (zombies) count as gone.

A group id is safe to signal while the group has a member or its leader is not reaped yet. Once the leader is
reaped and the group has no live member, the id is free for the system to reuse: the group is then marked
gone, as soon as `poll()` sees it, and never signalled again.

hivemind's p2pd and its client listen on `hivemind-*.sock` files, which they remove when they shut down; a
SIGKILLed group cannot, so the sockets its members hold are noted just before the kill and removed after it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import suppress
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from swarmnode.launcher.zygote import ForkedProcess, Zygote, ZygoteError
from swarmnode.procstat import proc_stat

_PROC = Path("/proc")
GROUP_GRACE_S = 2.0  # a group whose leader is gone (or would not go) gets this long after SIGTERM


class ChildProcess:
    """One child process: `argv` run in a new session (in `cwd`, default ours), stdout to
    `{log_dir}/{name}.out`, stderr to `.err`. With a `zygote`, a `swarmnode` command (argv starting with
    `zygote.command`) is forked from it instead, its heavy imports already done; a fresh process if the
    zygote cannot."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_dir: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        zygote: Zygote | None = None,
    ) -> None:
        self.name = name
        self.argv = tuple(argv)
        self.stdout_path = log_dir / f"{name}.out"
        self.stderr_path = log_dir / f"{name}.err"
        self.started_at = time.monotonic()
        self.removed_sockets: set[Path] = set()  # socket files `kill` removed for the group
        forked = self._fork(zygote, env, cwd)
        self._popen: subprocess.Popen[bytes] | ForkedProcess = forked or self._start(env, cwd)
        self._group_gone = False

    def _start(self, env: Mapping[str, str] | None, cwd: Path | None) -> subprocess.Popen[bytes]:
        with self.stdout_path.open("wb") as out, self.stderr_path.open("wb") as err:
            return subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )

    def _fork(
        self, zygote: Zygote | None, env: Mapping[str, str] | None, cwd: Path | None
    ) -> ForkedProcess | None:
        if zygote is None or not zygote.alive or self.argv[: len(zygote.command)] != zygote.command:
            return None
        args = self.argv[len(zygote.command) :]
        try:
            environment = os.environ if env is None else env
            return zygote.spawn(args, self.stdout_path, self.stderr_path, environment, cwd)
        except ZygoteError:
            return None

    @property
    def pid(self) -> int:
        """The child's pid, which is also its process group id."""
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    def poll(self) -> int | None:
        """The exit code if the child (the group leader) has exited, else None; once it has, marks the group
        gone when no member runs any more (the supervisor polls often, so this happens before any reuse)."""
        code = self._popen.poll()
        if code is not None:
            self.group_running()
        return code

    def wait(self, timeout: float) -> int:
        """The child's exit code once it has exited; subprocess.TimeoutExpired after `timeout` seconds."""
        code = self._popen.wait(timeout)
        self.poll()
        return code

    def signal_group(self, signum: int) -> None:
        """Send `signum` to the child's whole process group, if anything in it still runs."""
        self.poll()
        if self._group_gone:
            return
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:
            self._group_gone = True

    def terminate(self) -> None:
        """Ask the child alone to shut down (SIGTERM), so it can end its own DHT and p2pd in order."""
        if self._popen.poll() is None:
            self._popen.send_signal(signal.SIGTERM)

    def kill(self) -> int:
        """SIGKILL the whole group at once (a spot instance vanishing) and reap the child; its exit code. The
        hivemind socket files the group held are removed (nothing in it can remove them any more)."""
        self.poll()
        sockets = set() if self._group_gone else hivemind_sockets(self.pid)
        self.signal_group(signal.SIGKILL)
        code = self._popen.wait()
        for path in sockets:
            with suppress(OSError):
                path.unlink(missing_ok=True)
        self.removed_sockets |= sockets
        return code

    def group_running(self) -> bool:
        """Whether any process of the child's group still runs (zombies do not count)."""
        if not self._group_gone:
            self._group_gone = not group_running(self.pid)
        return not self._group_gone

    def stderr_tail(self, limit: int = 300) -> str:
        """The last non-empty stderr line, shortened to `limit` characters (for one-line error messages)."""
        try:
            with self.stderr_path.open("rb") as err:
                err.seek(max(0, err.seek(0, os.SEEK_END) - 8192))
                lines = err.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return ""
        last = next((line.strip() for line in reversed(lines) if line.strip()), "")
        return last[-limit:]


def group_running(pgid: int) -> bool:
    """Whether process group `pgid` has a member that is not a zombie."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not _PROC.is_dir():
        return True
    return any(_running_member(entry, pgid) for entry in _PROC.iterdir() if entry.name.isdigit())


def hivemind_sockets(pgid: int) -> set[Path]:
    """The `hivemind-*.sock` unix socket files that the live members of group `pgid` hold open (Linux)."""
    inodes: set[str] = set()
    for entry in _PROC.iterdir() if _PROC.is_dir() else ():
        if entry.name.isdigit() and _running_member(entry, pgid):
            with suppress(OSError):
                for fd in (entry / "fd").iterdir():
                    with suppress(OSError):
                        target = os.readlink(fd)
                        if target.startswith("socket:["):
                            inodes.add(target[8:-1])
    try:
        table = (_PROC / "net" / "unix").read_text().splitlines()[1:]
    except OSError:
        return set()
    paths = {Path(fields[7]) for line in table if len(fields := line.split()) >= 8 and fields[6] in inodes}
    return {path for path in paths if path.name.startswith("hivemind-") and path.suffix == ".sock"}


def _running_member(entry: Path, pgid: int) -> bool:
    stat = proc_stat(int(entry.name))
    return stat is not None and not stat.zombie and stat.pgid == pgid


def stop_all(
    children: Iterable[ChildProcess],
    grace: float,
    hurry: Callable[[], bool] = lambda: False,
    settle: float = 3.0,
) -> list[ChildProcess]:
    """End every child: SIGTERM to the child, up to `grace` seconds to exit (less once `hurry()` is true);
    then, where its group still runs (a leader that exited may leave its p2pd), SIGTERM to
    the group and up to `GROUP_GRACE_S` more (so a p2pd removes its own socket files); then SIGKILL to the
    group.

    Groups are always SIGKILLed at the end, even when their leader exited cleanly, so a p2pd it left behind
    dies too. Returns the children whose groups still had running members `settle` seconds later.
    """
    children = list(children)
    if grace > 0:
        for child in children:
            child.terminate()
        _wait_while(lambda: any(child.poll() is None for child in children), grace, hurry)
        running = [child for child in children if child.group_running()]
        for child in running:
            child.signal_group(signal.SIGTERM)
        _wait_while(lambda: any(child.group_running() for child in running), GROUP_GRACE_S, hurry)
    for child in children:
        child.kill()
    deadline = time.monotonic() + settle
    while True:
        left = [child for child in children if child.group_running()]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def _wait_while(busy: Callable[[], bool], seconds: float, hurry: Callable[[], bool]) -> None:
    """Poll `busy` until it is false, `seconds` have passed, or `hurry()` is true."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not hurry() and busy():
        time.sleep(0.05)


class LineTail:
    """Reads the complete lines appended to a file since the last call (the file may not exist yet)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def read_lines(self) -> list[str]:
        try:
            with self.path.open("rb") as file:
                file.seek(self._offset)
                chunk = file.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        return [line.decode("utf-8", "replace") for line in lines]


class StopSignals:
    """While active (in the main thread), the `SIGNALS` are recorded in `received` instead of ending the
    process, so the supervisor can end its children first; a second signal means: stop without grace.

    The children run in sessions of their own, so a hangup or a quit from the terminal reaches only the
    launcher: it must end them itself."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)
