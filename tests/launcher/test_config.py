"""The children's command lines: how the torch threads are shared out, and the daemons' identities."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from swarmnode.identity import Identity
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


def test_daemons_get_identities_derived_from_the_seed_and_their_name(tmp_path: Path) -> None:
    """The same seed gives the same peer ids, so a stage applies two data nodes' updates of a tick in the
    same order in every run of a seed; another seed or name gives another key."""
    peer_ids = {}
    for seed, name in ((0, "data1"), (0, "data1"), (0, "data2"), (1, "data1")):
        config = SwarmConfig(out=tmp_path / f"run{len(peer_ids)}", seed=seed)
        path = config.write_identity(name)
        argv = config.join_argv(0, "1/2", identity=path)
        assert argv[argv.index("--identity") + 1] == str(path) and path.stat().st_mode & 0o777 == 0o600
        peer_ids.setdefault((seed, name), set()).add(Identity.load(path).peer_id)
        assert config.write_identity(name) == path  # an earlier run's file in the same folder is replaced
    assert [len(ids) for ids in peer_ids.values()] == [1, 1, 1]
    assert len(set().union(*peer_ids.values())) == 3
