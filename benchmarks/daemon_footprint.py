"""Daemon footprint: CPU and memory of every process of every daemon of a small loopback swarm.

One swarm (tests/swarm_harness.py: a bootstrap, stages 1..3 with one node each, one torch thread per daemon,
the tiny preset with the default run settings) is sampled by pid from /proc in three phases of `--seconds`
each:

- `idle`: the bootstrap and the stage nodes online, no data node (nothing trains);
- `training`: a data node trains (sampling starts at its third step);
- `after`: the data node stopped again (stage nodes that trained, idle).

Each daemon is a process group (its own session): the node (the group's leader, `python -m swarmnode`) and
p2pd (libp2p daemon, shared by the DHT and the transport); before the DHT ran in a thread of the node
(`swarmnode/dht_thread.py`), also hivemind's DHT process (forked by the node: kind `dht`).
For every process: CPU as core-seconds per second (utime + stime from /proc/PID/stat over the phase), RSS
and PSS (means of one sample a second, /proc/PID/statm and smaps_rollup; PSS splits shared pages among
their sharers, so it adds up where RSS counts the pages a forked DHT process shares with the node twice). The
table sums each process kind over the daemons; `per daemon` is that sum over the number of daemons.

`--tree DIR` runs the swarm's daemons from another checkout (e.g. an older commit,
`git archive COMMIT swarmnode protocols | tar -x -C DIR`) through PYTHONPATH, instead of this checkout;
`--compare BASE` runs BASE and that tree (or this checkout) in turn, `--rounds` times each, so both are
measured at the same machine load, and prints the ratio of the CPU to the baseline's per phase and kind.

    python benchmarks/daemon_footprint.py --seconds 20
    python benchmarks/daemon_footprint.py --compare /tmp/old --rounds 2 --json out.json

Every process the benchmark starts is ended by its process group (and checked gone) when it finishes or
fails. About two minutes a swarm on two cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from procinfo import group_stats  # noqa: E402
from swarm_harness import LocalTestSwarm, NodeProcess  # noqa: E402

STEPS = 100_000  # never reached: the benchmark stops the swarm after its phases
START_S = 180.0
SETTLE_S = 5.0  # after a phase's change (nodes online, data node started or stopped) before sampling
PHASES = ("idle", "training", "after")
KINDS = ("node", "dht", "p2pd", "other")
_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class ProcId:
    """A process as sampled: pid and start time (so a reused pid is never taken for the same process)."""

    pid: int
    started: int
    pgid: int
    comm: str


def _memory(pid: int) -> tuple[int, int] | None:
    """RSS and PSS in bytes (PSS splits the pages a process shares, e.g. with the parent that forked it, among
    the sharers, so PSS adds up over processes where RSS counts shared pages in each)."""
    try:
        rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
        pss = next(int(line.split()[1]) * 1024 for line in rollup if line.startswith("Pss:"))
    except (OSError, IndexError, ValueError, StopIteration):
        return None
    return rss, pss


def members(pgids: set[int]) -> dict[ProcId, float]:
    """Live processes of the given process groups, with their CPU seconds so far."""
    return {ProcId(s.pid, s.started, s.pgid, s.comm): s.cpu_seconds for s in group_stats(pgids)}


def kind_of(proc: ProcId) -> str:
    if proc.pid == proc.pgid:
        return "node"
    if proc.comm == "p2pd":
        return "p2pd"
    return "dht" if proc.comm.startswith("python") else "other"


@dataclass
class Sample:
    """One process over one phase: CPU seconds at its start and end, RSS and PSS once a second."""

    proc: ProcId
    daemon: str
    cpu_start: float
    cpu_end: float | None = None
    rss: list[int] = field(default_factory=list)
    pss: list[int] = field(default_factory=list)


def sample(daemons: dict[int, str], seconds: float) -> tuple[list[Sample], float]:
    """Sample every process of the daemons (pgid -> name) for `seconds`; the samples of processes alive
    from start to end, and the seconds elapsed."""
    start = time.monotonic()
    samples = {proc: Sample(proc, daemons[proc.pgid], cpu) for proc, cpu in members(set(daemons)).items()}
    while time.monotonic() - start < seconds:
        time.sleep(min(1.0, max(0.0, seconds - (time.monotonic() - start))))
        for proc, item in samples.items():
            memory = _memory(proc.pid)
            if memory is not None:
                item.rss.append(memory[0])
                item.pss.append(memory[1])
    end = members(set(daemons))
    elapsed = time.monotonic() - start
    for proc, item in samples.items():
        item.cpu_end = end.get(proc)
    return [s for s in samples.values() if s.cpu_end is not None and s.rss], elapsed


def summarise(samples: list[Sample], elapsed: float) -> dict[str, Any]:
    """Per process, and per kind summed over the daemons: CPU cores, mean and peak RSS (MiB)."""
    processes = [
        {
            "daemon": s.daemon,
            "kind": kind_of(s.proc),
            "pid": s.proc.pid,
            "comm": s.proc.comm,
            "cpu_cores": (s.cpu_end - s.cpu_start) / elapsed,
            "rss_mib": statistics.fmean(s.rss) / 2**20,
            "rss_peak_mib": max(s.rss) / 2**20,
            "pss_mib": statistics.fmean(s.pss) / 2**20,
        }
        for s in samples
        if s.cpu_end is not None
    ]
    kinds = {}
    for kind in KINDS:
        of = [p for p in processes if p["kind"] == kind]
        if of:
            kinds[kind] = {
                "processes": len(of),
                "cpu_cores": sum(p["cpu_cores"] for p in of),
                "rss_mib": sum(p["rss_mib"] for p in of),
                "pss_mib": sum(p["pss_mib"] for p in of),
            }
    return {
        "seconds": elapsed,
        "daemons": len({p["daemon"] for p in processes}),
        "kinds": kinds,
        "processes": processes,
        "load": os.getloadavg(),
    }


@contextlib.contextmanager
def daemons_from(tree: Path | None) -> Iterator[None]:
    """Daemons started meanwhile import swarmnode from `tree` (None: this checkout)."""
    before = os.environ.get("PYTHONPATH")
    if tree is not None:
        os.environ["PYTHONPATH"] = str(tree.resolve())
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


def groups(nodes: list[NodeProcess]) -> dict[int, str]:
    """Process group id -> name of the nodes still running."""
    return {node.pgid: node.name for node in nodes if node.poll() is None}


def last_step(data: NodeProcess) -> int:
    return max(e["step"] for e in data.events("step"))


def one_swarm(tree: Path | None, seconds: float, folder: Path) -> dict[str, Any]:
    """Start a swarm from `tree`, sample its three phases, end it; the phases' summaries."""
    phases = {}
    with daemons_from(tree), LocalTestSwarm(folder, run_id=f"fp{uuid.uuid4().hex[:8]}") as swarm:
        boot = swarm.bootstrap(timeout=120, steps=STEPS)
        stages = [swarm.join(k) for k in (1, 2, 3)]
        swarm.wait_online(*stages, timeout=START_S)
        time.sleep(SETTLE_S)  # let start-up work (imports, first reads) finish: not what is measured
        phases["idle"] = summarise(*sample(groups([boot, *stages]), seconds))
        data = swarm.join(0, name="data")
        data.wait_event("step", START_S, where=lambda e: e["step"] >= 3)
        first = last_step(data)
        phases["training"] = summarise(*sample(groups([boot, *stages, data]), seconds))
        phases["training"]["steps"] = last_step(data) - first
        swarm.stop(data)
        time.sleep(SETTLE_S)
        phases["after"] = summarise(*sample(groups([boot, *stages]), seconds))
    if swarm.left_behind:
        raise RuntimeError(f"processes left behind: {swarm.left_behind}")
    swarm.remove_leftover_sockets()
    return {"tree": str(tree) if tree else "checkout", "phases": phases}


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _mean(runs: list[dict[str, Any]], phase: str, kind: str, what: str) -> float | None:
    values = [r["phases"][phase]["kinds"][kind][what] for r in runs if kind in r["phases"][phase]["kinds"]]
    return statistics.fmean(values) if values else None


def _mean_of(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def per_step(run: dict[str, Any], kind: str) -> float | None:
    """Core-seconds per training step of one kind (summed over the daemons), or None without steps."""
    training = run["phases"]["training"]
    if not training.get("steps") or kind not in training["kinds"]:
        return None
    return training["kinds"][kind]["cpu_cores"] * training["seconds"] / training["steps"]


def step_table(runs: list[dict[str, Any]]) -> str:
    """Markdown: per swarm, the steps trained while sampled and the CPU each step took, per kind: training
    runs as fast as the machine's load lets it, so CPU per second compares only at equal speed."""
    lines = [
        "| tree | steps | " + " | ".join(f"{k} core-s/step" for k in KINDS[:3]) + " |",
        "|---|---|---|---|---|",
    ]
    for run in runs:
        cells = [per_step(run, kind) for kind in KINDS[:3]]
        text = ["-" if c is None else f"{c:.3f}" for c in cells]
        lines.append(f"| {run['tree']} | {run['phases']['training']['steps']} | " + " | ".join(text) + " |")
    return "\n".join(lines)


def table(runs: list[dict[str, Any]]) -> str:
    """Markdown: per tree, phase and process kind, the CPU (cores) and PSS (MiB) summed over the daemons
    and per daemon, and the RSS sum (means over the runs of that tree)."""
    lines = [
        "| tree | phase | kind | processes | CPU cores | CPU / daemon | PSS MiB | PSS / daemon | RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for tree in dict.fromkeys(r["tree"] for r in runs):
        of = [r for r in runs if r["tree"] == tree]
        for phase in PHASES:
            daemons = statistics.fmean(r["phases"][phase]["daemons"] for r in of)
            totals = [0.0, 0.0, 0.0]
            for kind in KINDS:
                values = [_mean(of, phase, kind, what) for what in ("cpu_cores", "pss_mib", "rss_mib")]
                if any(v is None for v in values):
                    continue
                cpu, pss, rss = (float(v or 0.0) for v in values)
                totals = [totals[0] + cpu, totals[1] + pss, totals[2] + rss]
                count = _mean(of, phase, kind, "processes")
                lines.append(
                    f"| {tree} | {phase} | {kind} | {count:.0f} | {cpu:.3f} | {cpu / daemons:.3f} | "
                    f"{pss:.0f} | {pss / daemons:.0f} | {rss:.0f} |"
                )
            cpu, pss, rss = totals
            lines.append(
                f"| {tree} | {phase} | **all** | | {cpu:.3f} | {cpu / daemons:.3f} | "
                f"{pss:.0f} | {pss / daemons:.0f} | {rss:.0f} |"
            )
    return "\n".join(lines)


def ratios(runs: list[dict[str, Any]], baseline: str) -> str:
    """Markdown: the other tree's CPU over the baseline's, per phase and kind (means over the runs): per
    second, and for the training node also per step trained (its work is per step, done at the load's
    speed; the DHT's is per record period)."""
    base = [r for r in runs if r["tree"] == baseline]
    current = [r for r in runs if r["tree"] != baseline]

    def ratio(now: float | None, then: float | None) -> str:
        return "-" if now is None or then is None or then == 0 else f"{now / then:.2f}"

    lines = ["| phase | " + " | ".join(KINDS[:3]) + " | all | node per step |", "|---|---|---|---|---|---|"]
    for phase in PHASES:
        now = [_mean(current, phase, kind, "cpu_cores") for kind in KINDS[:3]]
        then = [_mean(base, phase, kind, "cpu_cores") for kind in KINDS[:3]]
        cells = [ratio(a, b) for a, b in zip(now, then, strict=True)]
        cells.append(ratio(sum(a or 0.0 for a in now), sum(b or 0.0 for b in then)))
        if phase == "training":
            steps = [_mean_of([per_step(r, "node") for r in of]) for of in (current, base)]
            cells.append(ratio(*steps))
        else:
            cells.append("")
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each sampled phase")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--keep", type=Path, default=None, help="keep the daemons' logs in this new folder")
    parser.add_argument("--tree", type=Path, default=None, help="run the daemons from this checkout")
    parser.add_argument("--compare", type=Path, default=None, help="a baseline checkout, run in turn")
    parser.add_argument("--rounds", type=int, default=1, help="with --compare: swarms of each tree")
    args = parser.parse_args()
    for tree in (args.tree, args.compare):
        if tree is not None and not (tree / "swarmnode" / "__init__.py").is_file():
            parser.error(f"{tree} holds no swarmnode package")
    if args.seconds <= 0 or args.rounds < 1:
        parser.error("--seconds must be positive and --rounds at least 1")
    trees = [args.tree] if args.compare is None else [args.compare, args.tree] * args.rounds
    loads, runs = [uptime()], []
    with contextlib.ExitStack() as stack:
        folder = args.keep or Path(stack.enter_context(TemporaryDirectory(prefix="daemon-footprint-")))
        for n, tree in enumerate(trees):
            runs.append(one_swarm(tree, args.seconds, folder / f"swarm{n}"))
            loads.append(uptime())
            print(f"# swarm {n + 1} of {len(trees)} ({runs[-1]['tree']}) done", file=sys.stderr, flush=True)
    print("CPU (core-seconds per second) and memory of the daemons' processes, per kind:\n")
    print(table(runs))
    print("\nCPU per training step (core-seconds, summed over the daemons):\n")
    print(step_table(runs))
    if args.compare is not None:
        print(f"\nCPU over the baseline's ({args.compare}), swarms in turn:\n")
        print(ratios(runs, str(args.compare)))
    print("\nmachine load during the run:")
    for line in loads:
        print(f"    {line}")
    if args.json is not None:
        args.json.write_text(json.dumps({"runs": runs, "load": loads}, indent=1))


if __name__ == "__main__":
    main()
