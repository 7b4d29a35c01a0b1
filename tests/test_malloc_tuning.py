"""`malloc_tuning.tune_malloc`: a thread that allocates and frees gradient-sized blocks stops faulting in."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from swarmnode.malloc_tuning import tune_malloc

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


def _probe(mode: str) -> tuple[bool, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode, str(ROUNDS)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    tuned, faults = done.stdout.split()
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
