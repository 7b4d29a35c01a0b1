"""`malloc_tuning`: a thread that allocates and frees gradient-sized blocks stops faulting in (`tune_malloc`),
and a heap that frees more than 256 MiB at once keeps it when told to (`keep_freed`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from swarmnode.malloc_tuning import keep_freed, tune_malloc

GLIBC = bool(os.confstr("CS_GNU_LIBC_VERSION")) if "CS_GNU_LIBC_VERSION" in os.confstr_names else False

ROUNDS = 40
ROUND_PAGES = 8 * (9 << 20) // 4096

# In a fresh interpreter: maybe tune, then a thread allocates eight 9 MiB blocks (a stage's largest gradients)
# `ROUNDS` times over, each touched, the previous eight freed; print the thread's minor page faults.
PROBE = textwrap.dedent(
    """
    import resource, sys, threading
    from swarmnode.malloc_tuning import tune_malloc
    tuned = tune_malloc() if sys.argv[1] == "tune" else False
    rounds = int(sys.argv[2])
    def work():
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        blocks = []
        for _ in range(rounds):
            blocks = [bytearray(9 << 20) for _ in range(8)]
        print(tuned, resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    """
)


def _run(probe: str, mode: str, rounds: int) -> list[str]:
    """The words a probe prints, run in a fresh interpreter without the operator's malloc settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    done = subprocess.run(
        [sys.executable, "-c", probe, mode, str(rounds)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def _probe(mode: str) -> tuple[bool, int]:
    tuned, faults = _run(PROBE, mode, ROUNDS)
    return tuned == "True", int(faults)


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_a_tuned_thread_reuses_freed_blocks_instead_of_faulting_them_in() -> None:
    tuned, tuned_faults = _probe("tune")
    untuned, untuned_faults = _probe("plain")
    assert tuned and not untuned
    assert untuned_faults > ROUNDS // 4 * ROUND_PAGES  # the default: freed blocks go back to the system
    assert tuned_faults < 3 * ROUND_PAGES  # two rounds' blocks are live at once; later rounds reuse them


@pytest.mark.parametrize(
    "environ",
    [
        {"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"},
        {"MALLOC_ARENA_MAX": "2"},
        {"MALLOC_TRIM_THRESHOLD_": "0"},
    ],
)
def test_an_operators_own_malloc_settings_are_left_alone(environ: dict[str, str]) -> None:
    assert tune_malloc(environ) is False


# In a fresh interpreter, tuned: maybe keep 640 MiB, then a thread takes 36 blocks of 9 MiB (324 MiB, more
# than the 256 MiB glibc keeps by `tune_malloc`) and frees them all, `TRIM_ROUNDS` times; its minor faults.
TRIM_PROBE = textwrap.dedent(
    """
    import resource, sys, threading
    from swarmnode.malloc_tuning import keep_freed, tune_malloc
    ok = tune_malloc() and (keep_freed(640 << 20) if sys.argv[1] == "keep" else True)
    def work():
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for _ in range(int(sys.argv[2])):
            blocks = [bytearray(9 << 20) for _ in range(36)]
            del blocks
        print(ok, resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    """
)
TRIM_ROUNDS = 4
TRIM_ROUND_PAGES = 36 * (9 << 20) // 4096


def _trim_probe(mode: str) -> int:
    ok, faults = _run(TRIM_PROBE, mode, TRIM_ROUNDS)
    assert ok == "True"
    return int(faults)


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_a_heap_told_to_keep_what_it_frees_stops_faulting_it_in_again() -> None:
    trimmed, kept = _trim_probe("trim"), _trim_probe("keep")
    assert trimmed > (TRIM_ROUNDS - 1) * TRIM_ROUND_PAGES  # each round's blocks went back to the system
    assert kept < 2 * TRIM_ROUND_PAGES  # the first round faulted them in; later rounds reuse them


def test_keep_freed_leaves_an_operators_settings_alone_and_refuses_a_negative_size() -> None:
    assert keep_freed(1 << 30, {"MALLOC_TRIM_THRESHOLD_": "0"}) is False
    with pytest.raises(ValueError, match="negative"):
        keep_freed(-1)


def _upb() -> bool:
    try:
        from google.protobuf.internal import api_implementation
    except ImportError:
        return False
    return api_implementation.Type() == "upb"


# In a fresh interpreter, tuned to keep 1 GiB: 200 MiB of blocks freed below a live one (so free inside the
# heap, not at its top), then 25,000 protobuf messages made and dropped (upb trims every 10,000 arena frees);
# with "stop", protobuf's trims are stopped first (twice: the second finds it done). Prints the resident MiB
# at the start, once the blocks are free, and after the messages.
UPB_PROBE = textwrap.dedent(
    """
    import ctypes, mmap, sys
    from swarmnode.malloc_tuning import keep_freed, stop_protobuf_trims, tune_malloc
    from google.protobuf import duration_pb2
    ok = tune_malloc() and keep_freed(1 << 30)
    if sys.argv[1] == "stop":
        ok = ok and stop_protobuf_trims() and stop_protobuf_trims()
    def resident_mib():
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * mmap.PAGESIZE >> 20
    start = resident_mib()
    blocks = [bytearray(20 << 20) for _ in range(10)]
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    live = libc.malloc(1 << 20)
    del blocks
    freed = resident_mib()
    for _ in range(int(sys.argv[2])):
        duration_pb2.Duration.FromString(bytes([8, 1]))
    print(ok, start, freed, resident_mib())
    """
)


def _upb_probe(mode: str) -> tuple[int, int]:
    """(MiB the freed blocks kept resident, MiB handed back while the messages came and went)."""
    ok, start, freed, after = _run(UPB_PROBE, mode, 25_000)
    assert ok == "True"
    return int(freed) - int(start), int(freed) - int(after)


@pytest.mark.skipif(not GLIBC or not _upb(), reason="glibc's malloc_trim, upb's calls")
def test_protobuf_is_kept_from_trimming_the_heap() -> None:
    kept, handed_back = _upb_probe("plain")
    assert kept >= 150  # the freed blocks stay resident: the threshold keeps them
    if handed_back < 150:
        pytest.skip("this protobuf build does not trim the heap (upstream has the call disabled on main)")
    kept, handed_back = _upb_probe("stop")
    assert kept >= 150
    assert handed_back < 150, handed_back
