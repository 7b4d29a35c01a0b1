"""The launcher's side of the zygote (`zygote_server`): start it, have it fork `swarmnode` commands, learn
when they end.

A forked child is the zygote's child, not the launcher's, so the launcher cannot wait for it; the zygote
reaps it and reports its exit code, which a reader thread here records. `ForkedProcess` gives such a child
the part of `subprocess.Popen`'s interface that `procs.ChildProcess` uses.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from swarmnode.procstat import proc_stat

READY_TIMEOUT_S = 120.0  # the zygote's imports, on a loaded machine
SPAWN_TIMEOUT_S = 30.0
ZYGOTE_LOST = -1  # the exit code of a child whose zygote ended before reporting it (the child is gone)


class ZygoteError(RuntimeError):
    """The zygote did not start, or ended: the launcher starts its children as fresh processes instead."""


class Zygote:
    """A running zygote (its stderr in `{log_dir}/zygote.err`); `spawn` forks a child of it."""

    def __init__(self, log_dir: Path, env: Mapping[str, str], python: str = sys.executable) -> None:
        self.command = (python, "-m", "swarmnode")  # what a child forked here stands for
        with (log_dir / "zygote.err").open("wb") as err:
            self._popen = subprocess.Popen(
                [python, "-m", "swarmnode.launcher.zygote_server"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=dict(env),
                start_new_session=True,
            )
        self._changed = threading.Condition()
        self._ready = False
        self._pids: dict[int, int] = {}  # request id -> pid
        self._codes: dict[int, int] = {}  # pid -> exit code
        self._closed = False
        self._requests = 0
        if self._popen.stdout is None or self._popen.stdin is None:
            raise ZygoteError("the zygote's pipes did not open")
        self._stdin: IO[bytes] = self._popen.stdin
        threading.Thread(target=self._read, args=(self._popen.stdout,), name="zygote", daemon=True).start()

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def alive(self) -> bool:
        return not self._closed

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Return once the zygote has done its imports; ZygoteError if it ended or took over `timeout` s."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._ready or self._closed, timeout) or not self._ready:
                raise ZygoteError(f"the zygote was not ready within {timeout:g} s (see zygote.err)")

    def spawn(
        self,
        args: Sequence[str],
        stdout: Path,
        stderr: Path,
        env: Mapping[str, str],
        cwd: Path | None = None,
    ) -> ForkedProcess:
        """Fork `swarmnode ARGS` in a session of its own, its output to the two files."""
        self.wait_ready()
        with self._changed:
            self._requests += 1
            request = self._requests
        line = {"id": request, "args": list(args), "stdout": str(stdout), "stderr": str(stderr)}
        line |= {"env": dict(env), "cwd": str(cwd) if cwd is not None else None}
        try:
            self._stdin.write((json.dumps(line) + "\n").encode())
            self._stdin.flush()
        except OSError as error:
            raise ZygoteError(f"the zygote took no request: {error}") from None
        with self._changed:
            got = self._changed.wait_for(lambda: request in self._pids or self._closed, SPAWN_TIMEOUT_S)
            if not got or request not in self._pids:
                raise ZygoteError("the zygote started no child")
            return ForkedProcess(self, self._pids[request])

    def exit_code(self, pid: int) -> int | None:
        """`pid`'s exit code once it has ended; `ZYGOTE_LOST` if the zygote ended first and `pid` is gone."""
        with self._changed:
            if pid in self._codes:
                return self._codes[pid]
            if self._closed and not _running(pid):
                return ZYGOTE_LOST
            return None

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        """`exit_code(pid)`, waiting up to `timeout` seconds (None: for ever) for it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            code = self.exit_code(pid)
            left = None if deadline is None else deadline - time.monotonic()
            if code is not None or (left is not None and left <= 0):
                return code
            with self._changed:
                self._changed.wait(0.1 if left is None else min(left, 0.1))

    def close(self, timeout: float = 5.0) -> None:
        """End the zygote (its children are the launcher's to end): close its stdin, then kill if needed."""
        with contextlib.suppress(OSError):
            self._stdin.close()
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self._popen.kill()
            self._popen.wait()

    def _read(self, answers: IO[bytes]) -> None:
        for line in answers:
            try:
                answer = json.loads(line)
            except ValueError:
                continue
            with self._changed:
                if "ready" in answer:
                    self._ready = True
                elif "exit" in answer:
                    self._codes[answer["exit"]] = answer["code"]
                elif "id" in answer:
                    self._pids[answer["id"]] = answer["pid"]
                self._changed.notify_all()
        with self._changed:
            self._closed = True
            self._changed.notify_all()


class ForkedProcess:
    """A child the zygote forked, as `procs.ChildProcess` sees a `subprocess.Popen`."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self._zygote = zygote
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.wait_exit(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)


def _running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    stat = proc_stat(pid)
    return stat is not None and not stat.zombie
