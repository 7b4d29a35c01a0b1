"""What a local swarm runs: its settings, its children's command lines, and the bootstrap's peers file."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from swarmnode.launcher.kill_plan import StageKill

FAIL_RATE_UNIT = "probability that a given transformer stage fails within one minute"
STALL_TIMEOUT_S = 300.0  # a run whose data nodes report no new step for this long has failed


@dataclass(frozen=True)
class SwarmConfig:
    """What `swarmnode up` runs. `kills` fire at data-node steps; `fail_rate` is `FAIL_RATE_UNIT`.

    `stall_timeout` (None: no bound) ends the run as failed when no data node reports a new step for that many
    seconds. `command` starts the swarmnode CLI in a child; `observe` starts the DHT observer for node states.
    `network` (a links file) emulates WAN links between the nodes, each at its `placement` site (launcher
    node name -> site, every initial node; `protocols.links.Network.place`). `standbys` nodes start as
    `join --standby`: they hold no stage until one loses its last node. `log_level` goes to every daemon
    (their log lines land in `out/logs/NAME.err`).
    """

    preset: str = "tiny"
    stages: int = 3
    replicas: int = 2
    data_nodes: int = 2
    steps: int = 100
    batch_size: int | None = None  # sequences per microbatch (`bootstrap --batch-size`; None: the preset's)
    seq_len: int | None = None  # tokens per sequence (`bootstrap --seq-len`; None: the preset's)
    fail_rate: float = 0.0
    kills: tuple[StageKill, ...] = ()
    checkfree_plus: bool = True
    edge_copies: bool = True  # CheckFree+'s copies of the edge stages (`bootstrap --edge-copies`)
    edge_swaps: bool = False  # the paper's CheckFree+ swaps (`bootstrap --edge-swaps`)
    device: str = "auto"  # every node's `join --device`
    dtype: str = "float32"  # the run's compute dtype (`bootstrap --dtype`)
    respawn_delay: float = 2.0
    standbys: int = 0
    seed: int = 0
    run_id: str = "swarm"
    out: Path = Path("swarm-out")
    timeout: float | None = None
    stall_timeout: float | None = STALL_TIMEOUT_S
    skip_ratio: float = 0.0  # the run's (`bootstrap --skip-ratio`)
    planner: str = "skippipe"  # the run's (`bootstrap --planner`)
    network: Path | None = None
    log_level: str | None = None  # every daemon's `--log-level` (None: theirs, warning)
    placement: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    command: tuple[str, ...] = (sys.executable, "-m", "swarmnode")
    observe: bool = True
    zygote: bool = True  # fork the daemons from one process that has done their imports (`zygote_server`)

    @property
    def peers_file(self) -> Path:
        return (self.out / "peers.txt").resolve()

    @property
    def model_dir(self) -> Path:
        return self.out / "model"

    @property
    def identities(self) -> Path:
        """Where the daemons' identity files go (`write_identity`)."""
        return (self.out / "identities").resolve()

    def write_identity(self, name: str) -> Path:
        """The identity file of the daemon `name`, its key derived from the run's seed and the name: the same
        seed gives the same peer ids, so the order in which a stage applies two data nodes' updates of one
        tick (by peer id) is the same in every run of a seed. The swarm stays on loopback."""
        from swarmnode.identity import Identity  # cryptography and hivemind's protobufs: only when spawning

        path = self.identities / f"{name}.key"
        path.unlink(missing_ok=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        Identity.derived(f"swarmnode up {self.seed} {name}".encode()).save(path)
        return path

    @property
    def initial_nodes(self) -> int:
        return self.data_nodes + self.stages * self.replicas

    def initial_names(self) -> list[str]:
        """The launcher's names of the initial nodes: `data1`.., then `s1r1`, `s1r2`, .., `s2r1`, .."""
        return [f"data{i + 1}" for i in range(self.data_nodes)] + [
            f"s{stage}r{replica}"
            for stage in range(1, self.stages + 1)
            for replica in range(1, self.replicas + 1)
        ]

    def bootstrap_argv(self) -> list[str]:
        """The entry peer, on loopback, on any free port, writing its multiaddrs to `peers_file`."""
        return [
            *self.command, "bootstrap", "--preset", self.preset, "--stages", str(self.stages),
            "--run-id", self.run_id, "--host", "127.0.0.1", "--port", "0",
            "--peers-file", str(self.peers_file), "--steps", str(self.steps), "--seed", str(self.seed),
            "--checkfree-plus" if self.checkfree_plus else "--no-checkfree-plus",
            "--edge-copies" if self.edge_copies else "--no-edge-copies",
            "--edge-swaps" if self.edge_swaps else "--no-edge-swaps", "--dtype", self.dtype,
            "--skip-ratio", str(self.skip_ratio), "--planner", self.planner,
            "--min-data-nodes", str(self.data_nodes), "--min-replicas", str(self.replicas),
            *(["--batch-size", str(self.batch_size)] if self.batch_size is not None else []),
            *(["--seq-len", str(self.seq_len)] if self.seq_len is not None else []),
            *self._log_options(),
        ]  # fmt: skip

    def join_argv(
        self,
        stage: int | None,
        shard: str | None,
        site: str | None = None,
        standby: bool = False,
        identity: Path | None = None,
    ) -> list[str]:
        """A daemon of `stage` (None: `--stage auto`), or a standby; `shard` (I/K): the data it reads as a
        data node; `site`: where it sits in the emulated `network` (ignored without one).

        Torch threads are split evenly between the nodes, so a small machine is not oversubscribed. Data nodes
        linger after the last step, so that the final model can be exported (`export_argv`). Every node
        serves its metrics on a free port (listed in the report).
        """
        threads = max(1, usable_cpus() // self.initial_nodes)
        return [
            *self.command, "join",
            *(["--standby"] if standby else ["--stage", "auto" if stage is None else str(stage)]),
            "--initial-peers", str(self.peers_file), "--run-id", self.run_id, "--threads", str(threads),
            "--linger", "--device", self.device, "--metrics-port", "0",
            *(["--shard", shard] if shard is not None else []),
            *(["--network", str(self.network.resolve()), "--site", site] if self.network and site else []),
            *(["--identity", str(identity)] if identity is not None else []),
            *self._log_options(),
        ]  # fmt: skip

    def _log_options(self) -> list[str]:
        return ["--log-level", self.log_level] if self.log_level is not None else []

    def export_argv(self) -> list[str]:
        """The exporter of the final model to `model_dir`, its validation loss read back from the files."""
        return [
            *self.command, "export", "--initial-peers", str(self.peers_file), "--run-id", self.run_id,
            "--out", str(self.model_dir), "--evaluate",
        ]  # fmt: skip

    def observer_argv(self, interval: float) -> list[str]:
        return [
            sys.executable,
            "-m",
            "swarmnode.launcher.observe",
            str(self.peers_file),
            self.run_id,
            str(interval),
        ]

    def settings(self) -> dict[str, Any]:
        """The settings as they go into the report."""
        return {
            "preset": self.preset,
            "stages": self.stages,
            "replicas": self.replicas,
            "data_nodes": self.data_nodes,
            "steps": self.steps,
            "batch_size": self.batch_size,  # None: the preset's
            "seq_len": self.seq_len,
            "fail_rate": self.fail_rate,
            "fail_rate_unit": FAIL_RATE_UNIT,
            "kills": [str(kill) for kill in self.kills],
            "checkfree_plus": self.checkfree_plus,
            "edge_copies": self.edge_copies,
            "edge_swaps": self.edge_swaps,
            "device": self.device,
            "dtype": self.dtype,
            "respawn_delay": self.respawn_delay,
            "standbys": self.standbys,
            "seed": self.seed,
            "run_id": self.run_id,
            "timeout": self.timeout,
            "stall_timeout": self.stall_timeout,
            "skip_ratio": self.skip_ratio,
            "planner": self.planner,
            "network": None if self.network is None else str(self.network),
        }


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask where the OS has one (`taskset`, a cpuset), else
    every CPU of the machine."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def read_peers(path: Path) -> list[str] | None:
    """The multiaddrs in a complete peers file (one per line, ending in a newline), or None if not ready."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    peers = [line.strip() for line in text.splitlines() if line.strip()]
    if not peers or not text.endswith("\n") or not all(peer.startswith("/") for peer in peers):
        return None
    return peers
