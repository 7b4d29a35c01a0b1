"""The zygote `swarmnode up` starts its daemons from: a process that has imported torch, hivemind and the
daemon's code once, and forks a child for each `swarmnode` command it is sent.

Eight daemons started as fresh interpreters on two cores spent about 9 s importing the same libraries side
by side before any of them reached the DHT; forked from here, each starts with them loaded.

Protocol, one JSON object per line. Requests on stdin: `{"id": N, "args": [...], "stdout": PATH, "stderr":
PATH, "env": {...}, "cwd": PATH | null}`. Answers on stdout: `{"ready": PID}` once the imports are done,
`{"id": N, "pid": PID}` per child started, `{"exit": PID, "code": CODE}` per child ended (a negative code: the
signal that ended it, as in `subprocess`). The zygote ends when its stdin closes (the launcher ended); its
children live on in their own sessions, ended by the launcher as any other child.

Starts no thread of its own, so that a fork copies no lock that a thread of ours holds. The libraries it
imports start native threads (one each on importing torch and hivemind, and pyarrow's jemalloc background
thread), which the children do not inherit; Python 3.12 warns of that at each fork (a DeprecationWarning in
each daemon's log). glibc's malloc, which torch allocates through, and jemalloc hold their locks across a fork
(pthread_atfork), so a child's allocations do not wait on a lock one of those threads held.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import random
import select
import sys
from typing import Any

from swarmnode.hivemind_parts import register_package
from swarmnode.malloc_tuning import tune_malloc

REAP_S = 0.05  # how often the zygote reaps its ended children while no request comes
WARM_MODULES = (
    "uvloop",
    "swarmnode.cli.daemons",
    "swarmnode.data",
    "swarmnode.identity",
    "swarmnode.node.events",
    "swarmnode.node.run",
    "swarmnode.node.seed",
)


def _warm() -> None:
    """Import what every daemon imports, with malloc set as the CLI sets it (`swarmnode.cli.main`) before
    the imports start threads: the children run the CLI, but their threads' arenas would be set by then."""
    tune_malloc()
    register_package()  # as the CLI does: the children run it
    for module in WARM_MODULES:
        importlib.import_module(module)


def _become(request: dict[str, Any], answers: int) -> None:
    """In the forked child: a session of its own, the request's files, environment and directory, fresh
    random state; then the command, whose exit ends the process (never returns)."""
    os.setsid()
    os.close(answers)
    with open(os.devnull, "rb") as null:
        os.dup2(null.fileno(), 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
    if request.get("cwd"):
        os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _reseed()
    from swarmnode.cli import main

    sys.argv = ["swarmnode", *request["args"]]
    main.main(args=list(request["args"]), prog_name="swarmnode")  # click exits (SystemExit) when done


def _reseed() -> None:
    """A forked child shares the zygote's random state; a fresh interpreter would not (DHT ids, pairing)."""
    import numpy as np
    import torch

    random.seed()
    np.random.seed(int.from_bytes(os.urandom(4), "little"))
    torch.seed()


def _answer(answers: int, **fields: int) -> None:
    os.write(answers, (json.dumps(fields) + "\n").encode())


def _reap(answers: int) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _answer(answers, exit=pid, code=os.waitstatus_to_exitcode(status))


def serve() -> None:
    """Warm up, then start a child per request until stdin closes."""
    answers = os.dup(1)  # the answer pipe; fd 1 itself goes to /dev/null, so no stray print reaches it
    with open(os.devnull, "wb") as null:
        os.dup2(null.fileno(), 1)
    _warm()
    gc.freeze()  # the imports' objects, shared by every child: their collections skip them (and copy no page)
    _answer(answers, ready=os.getpid())
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], REAP_S)
        _reap(answers)
        if not readable:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            return
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _become(request, answers)
            _answer(answers, id=request["id"], pid=pid)


if __name__ == "__main__":
    serve()
