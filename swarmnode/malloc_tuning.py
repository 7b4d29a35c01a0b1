"""glibc's malloc, set at a swarmnode process's start so that freed tensor memory is reused, not faulted in.

A stage's backward pass allocates a fresh gradient for every parameter (autograd's matmul outputs: 124 MB a
pass for a stage of four llama-124m layers) and frees it once summed. glibc's malloc serves blocks that
large with mmap at first, unmapping them on free; and a daemon computes in a thread of its own
(`node.compute`), whose allocations come from an arena of their own, with heaps unmapped once empty. So
every pass faulted its gradients' pages in again: 10,000-32,000 minor faults and 0.02-0.05 s of system
time a pass, 1.2-1.4x the CPU time of a pass without them (a live llama-124m swarm, traced per compute job).

`tune_malloc` has every thread allocate from the main arena (`M_ARENA_MAX` 1), serves blocks up to 32 MiB
(glibc's most) from it (`M_MMAP_THRESHOLD`), and returns free memory at its top to the system only beyond
256 MiB (`M_TRIM_THRESHOLD`): a daemon keeps the memory its iterations reuse. It must run before the process
starts a thread (a thread that allocated before has its own arena already). An operator's own malloc
settings (`GLIBC_TUNABLES` with `glibc.malloc.*`, or any `MALLOC_*` variable) are left alone, as is any
other C library.

256 MiB is too little once a stage's weights are large: the memory an iteration frees and takes again (its
gradient sums, the weights' parts of split backward passes, weight snapshots for peers) can pass it, and a
heap trimmed at each iteration's end faults all of that in again at the next (a llama-124m stage, 124 MB of
weights: 50,000-80,000 minor faults an iteration in some runs). `keep_freed` raises the threshold to what
the daemon's piece needs.

No threshold holds against `malloc_trim(0)`, which hands back every free page of the heap. The protobuf
extension that hivemind's messages use (upb) calls it once every 10,000 frees of its message arenas, and a
daemon's DHT and p2pd control traffic frees that many in 20-25 s: in a llama-124m swarm every stage handed
back 150-225 MiB at each call and faulted 40,000-80,000 pages in again over the next two seconds (0.05-0.15 s
of system time in one traced run; 1.1-2.2 s a stage in the slowest rounds measured, docs/local-swarm.md).
`stop_protobuf_trims` points the extension's call at a C library function that does nothing with it.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path

from swarmnode.elf_slots import SlotError, redirect, slot_values

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
TRIM_THRESHOLD = 256 << 20
SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, TRIM_THRESHOLD))
MAX_TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int


def tune_malloc(environ: Mapping[str, str] = os.environ) -> bool:
    """Apply `SETTINGS` through glibc's `mallopt`; whether they all took. False, and nothing changed, where
    the operator set malloc's parameters, or the C library is not glibc."""
    mallopt = _mallopt(environ)
    return mallopt is not None and all(mallopt(parameter, value) == 1 for parameter, value in SETTINGS)


def keep_freed(nbytes: int, environ: Mapping[str, str] = os.environ) -> bool:
    """Return free memory at the heap's top to the system only beyond `nbytes` (never below
    `TRIM_THRESHOLD`, at most `MAX_TRIM_THRESHOLD`); whether it took. As `tune_malloc`, nothing where the
    operator set malloc's parameters or the C library is not glibc. Any time after `tune_malloc`."""
    if nbytes < 0:
        raise ValueError(f"nbytes must not be negative, got {nbytes}")
    mallopt = _mallopt(environ)
    threshold = min(max(nbytes, TRIM_THRESHOLD), MAX_TRIM_THRESHOLD)
    return mallopt is not None and mallopt(M_TRIM_THRESHOLD, threshold) == 1


def stop_protobuf_trims() -> bool:
    """Keep protobuf's upb extension from calling glibc's `malloc_trim` (see above); whether it is kept
    from it (or never calls it). Its slot for the function is pointed at glibc's `malloc_usable_size`, which
    takes one word as `malloc_trim` does, returns 0 for the null pointer upb passes (`malloc_trim(0)`), and
    does nothing else: a C function, so no Python runs inside the frees that call it, and it outlives the
    interpreter. False, and nothing changed, without glibc or the upb extension, or for a build of it this
    cannot change (logged)."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return False
        from google._upb import _message  # type: ignore[import-not-found]
    except (ValueError, OSError, ImportError):  # no glibc, or protobuf's pure-Python build (it never trims)
        return False
    library = Path(_message.__file__)
    try:
        libc = ctypes.CDLL(None)
        trim, instead = (
            ctypes.cast(f, ctypes.c_void_p).value for f in (libc.malloc_trim, libc.malloc_usable_size)
        )
        if trim is None or instead is None:
            raise SlotError("no address for malloc_trim or malloc_usable_size")
        values = slot_values(library, "malloc_trim", "PyInit__message")
        if all(value == instead for value in values):
            return True  # already done (or no slot: the extension never calls it)
        redirect(library, "malloc_trim", "PyInit__message", trim, instead)
    except (SlotError, OSError, AttributeError) as error:
        logger.warning("protobuf's malloc_trim calls stay (%s): %s", library.name, error)
        return False
    return True


def _mallopt(environ: Mapping[str, str]) -> Callable[[int, int], int] | None:
    """glibc's `mallopt`, or None where the operator set malloc's parameters or there is no glibc."""
    set_by_operator = "glibc.malloc." in environ.get("GLIBC_TUNABLES", "")
    if set_by_operator or any(name.startswith("MALLOC_") for name in environ):
        return None
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
        mallopt = ctypes.CDLL(None).mallopt
    except (ValueError, OSError, AttributeError):  # no such name here, no C library handle, no mallopt
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt
