"""The children's command lines: how the torch threads are shared out."""

from __future__ import annotations

import os

import pytest

from swarmnode.launcher import SwarmConfig


def threads(config: SwarmConfig) -> int:
    argv = config.join_argv(1, None)
    return int(argv[argv.index("--threads") + 1])


def test_threads_are_split_over_the_cpus_this_process_may_run_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)  # taskset -c 0-3
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert threads(SwarmConfig(stages=1, replicas=1, data_nodes=1)) == 2  # 4 CPUs, 2 nodes
    assert threads(SwarmConfig()) == 1  # 4 CPUs, 8 nodes: never fewer than one thread


def test_without_an_affinity_mask_every_cpu_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert threads(SwarmConfig(stages=1, replicas=1, data_nodes=1)) == 32
