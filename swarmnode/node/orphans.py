"""The processes a crashed DHT process leaves behind.

hivemind runs the DHT in a forked process that starts its own p2pd. If that process dies without shutting
down (a crash, SIGKILL), its p2pd lives on as an orphan, still listening. A daemon that registers as a child
subreaper (Linux) adopts such orphans, so when it finds its DHT process dead it can end them by pid.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import sys

from swarmnode.procstat import processes

logger = logging.getLogger(__name__)

_PR_SET_CHILD_SUBREAPER = 36


def adopt_orphans() -> bool:
    """Make this process the reaper of its descendants' orphans; False where the platform cannot."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def live_children(parent: int) -> list[int]:
    """Pids of the live (not zombie) direct children of `parent`, from /proc."""
    return [proc.pid for proc in processes() if proc.ppid == parent and not proc.zombie]


def end_orphans() -> list[int]:
    """SIGTERM every live child of this process; call it on the way out, once the DHT process is known dead.
    What remains are the orphans it left (its p2pd) and helpers that end with this process anyway (torch's
    shared-memory manager). Returns the pids signalled."""
    pids = live_children(os.getpid())
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
            logger.warning("ended process %d, left behind by the dead DHT process", pid)
    return pids
