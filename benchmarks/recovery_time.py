"""Recovery time: SIGKILL of the last node of a stage to the first iteration through its rebuilt stage.

One loopback swarm (tests/swarm_harness.py: a bootstrap, stages 1..3 with one node each, one data node, one
torch thread per daemon, the tiny preset with the default run settings) trains; each trial then

1. SIGKILLs the whole process group (daemon, p2pd) of the only node of `--stage` (default 2,
   a middle stage: CheckFree; 1 or 3: CheckFree+ copy) and, at once, starts `swarmnode join --stage auto`;
2. reads the replacement's events and the data node's `step` events, all stamped with unix time.

Phases, in seconds after the kill (and each phase's own length):

- `import`: the replacement process started and imported swarmnode (Python, torch, hivemind);
- `dht`: its DHT (a forked process with its own p2pd) is ready (`joining` event, phase dht);
- `stage`: it read the run and chose a stage (`joining` phase stage; `--stage auto` pings the listed peers);
- `build`: it built its stage (model piece, optimizer), started its transport and announced `recovering`;
- `fetch`: state fetch and rebuild (`recovered.seconds`: pings, weights of the neighbours, the average);
- `online`: it announced itself online (`online` event);
- `first`: the first iteration through the rebuilt stage is complete: the first data-node `step` event
  whose iteration started after the `online` event and whose planned paths include the stage (paths in
  step events are the planned ones; a microbatch planned through a live node goes through it).

`stall`: the longest time between two data-node iterations' ends (`step`, `iteration_failed` or
`validation` events) from the last one before the kill to `first`. The microbatch inside the killed node
when it died is lost; the data node notices by pinging the peers of pending paths every second. (Before
that check it waited the run's whole `iteration_timeout_s`, 30 s, for such a microbatch, and then that
wait, not the rebuild, set the time to the first iteration through the new node: 2 trials of 9.)
The goals: at most 4 s for a replacement, 2 s for a standby; the CheckFree paper reports about 30 s.

Where the time goes on a 2-core machine at load 0.5-3 (tiny preset, 2026-12-03, docs/design.md): almost
all of it is starting a process, not recovering: the interpreter's imports 2.4 s (torch 1.3-1.5 s of it),
the DHT 0.55 s, the stage choice 0.3 s (a look with pings, the claim, its settle, a second look), building
the node 0.1 s, fetch and rebuild 0.05-0.1 s, and 0.3-0.4 s from `online` to the end of the first
iteration through the node (the node greets the data nodes, which read the DHT at once). Median 3.8 s.

With `--standby` the stage is taken by a standby node (`join --standby`, started and standing by before
the kill, listed by `swarmnode status`) instead of a replacement started at the kill: its `import` and
`dht` phases lie before the kill (null in the JSON), and `stage` is when it took the stage (it pinged the
stage's nodes, claimed it and let the claim settle). `--compare` alternates replacement and standby
trials in one swarm (the same machine load), `--trials` of each, and prints the ratio of their medians.

    python benchmarks/recovery_time.py                    # 3 trials on stage 2
    python benchmarks/recovery_time.py --trials 5 --stage 1 --json out.json
    python benchmarks/recovery_time.py --compare --json out.json   # 3 replacement and 3 standby trials

Takes one to two minutes for 3 trials on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from itertools import pairwise
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from swarm_harness import LocalTestSwarm, NodeProcess, group_members, poll  # noqa: E402

STEPS = 100_000  # never reached: the benchmark stops the swarm after its trials
START_S = 180.0
TRIAL_S = 180.0
STEPS_BETWEEN = 6  # data-node steps through the new node before the next trial kills it
ITERATION_ENDS = ("step", "iteration_failed", "validation")  # data-node events that end an iteration
PHASES = ("import", "dht", "stage", "build", "fetch", "online", "first")
MODES = ("replacement", "standby")


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def wait_phase(node: NodeProcess, phase: str) -> dict[str, Any]:
    return node.wait_event("joining", TRIAL_S, where=lambda e: e["phase"] == phase)


def first_through(data: NodeProcess, stage: int, online: float) -> dict[str, Any] | None:
    for event in data.events("step"):
        if event["time"] - event["seconds"] >= online and all(stage in path for path in event["paths"]):
            return event
    return None


def start_standby(swarm: LocalTestSwarm, n: int) -> NodeProcess:
    """A standby, once the status view lists it standing by (its first look is then a record period old)."""
    standby = swarm.join("auto", "--standby", name=f"standby{n}")
    wait_phase(standby, "dht")
    poll(
        lambda: any(s["taken"] is None for s in swarm.status()["standbys"]),
        TRIAL_S,
        "the standby to stand by",
        alive=standby.check_alive,
    )
    return standby


def trial(
    swarm: LocalTestSwarm,
    data: NodeProcess,
    victim: NodeProcess,
    stage: int,
    n: int,
    standby: NodeProcess | None = None,
) -> dict[str, Any]:
    """Kill `victim` (the last node of `stage`); time the phases of the `standby` that takes the stage, or
    of a replacement started at once."""
    swarm.note_sockets()
    victim.kill_group(signal.SIGKILL)
    killed = time.time()
    new = standby or swarm.join("auto", name=f"new{n}")
    spawned = time.time()
    victim.wait_exit(10)
    poll(lambda: not group_members([victim.pgid]), 10, "the killed process group to be gone")

    joining = {phase: wait_phase(new, phase) for phase in ("dht", "stage")}
    recovered = new.wait_event("recovered", TRIAL_S)
    online = new.wait_event("online", TRIAL_S)
    swarm.note_sockets()
    first = poll(
        lambda: first_through(data, stage, online["time"]),
        TRIAL_S,
        "an iteration through the stage",
        alive=data.check_alive,
    )
    ends = [
        e["time"] for e in data.events() if e.get("event") in ITERATION_ENDS and e["time"] <= first["time"]
    ]
    ends = [max((t for t in ends if t <= killed), default=killed), *(t for t in ends if t > killed)]
    dht_ready, chosen = joining["dht"]["time"], joining["stage"]["time"]
    at: dict[str, float | None] = {
        "import": dht_ready - joining["dht"]["seconds"],
        "dht": dht_ready,
        "stage": chosen,
        "build": recovered["time"] - recovered["seconds"],
        "fetch": recovered["time"],
        "online": online["time"],
        "first": first["time"],
    }
    if standby is not None:  # started before the kill
        at["import"] = at["dht"] = None
    return {
        "trial": n,
        "mode": MODES[standby is not None],
        "stage": joining["stage"]["stage"],
        "method": recovered["method"],
        "spawn_delay": spawned - killed,
        "at": {phase: None if t is None else t - killed for phase, t in at.items()},
        "stall": max(later - earlier for earlier, later in pairwise(ends)),
        "first_step": first["step"],
        "node": new,
    }


def run(modes: list[str], stage: int, folder: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """One trial per entry of `modes` (in that order), all in one swarm."""
    loads = [uptime()]
    with LocalTestSwarm(folder, run_id=f"rec{uuid.uuid4().hex[:8]}") as swarm:
        swarm.bootstrap(timeout=120, steps=STEPS)
        nodes = {k: swarm.join(k) for k in (1, 2, 3)}
        swarm.wait_online(*nodes.values(), timeout=START_S)
        data = swarm.join(0, name="data")
        data.wait_event("online", START_S)
        data.wait_event("step", START_S, where=lambda e: e["step"] >= 10)
        victim = nodes[stage]
        results = []
        for n, mode in enumerate(modes, 1):
            standby = start_standby(swarm, n) if mode == "standby" else None
            if standby is not None:  # the standby's start is over: let the swarm run calmly again
                after = data.events("step")[-1]["step"] + STEPS_BETWEEN
                data.wait_event("step", TRIAL_S, where=lambda e, after=after: e["step"] >= after)
            result = trial(swarm, data, victim, stage, n, standby)
            victim = result.pop("node")
            results.append(result)
            print(
                f"# trial {n} ({mode}): first iteration through stage {stage} {result['at']['first']:.2f} s "
                f"after the kill",
                file=sys.stderr,
                flush=True,
            )
            after = result["first_step"] + STEPS_BETWEEN
            data.wait_event("step", TRIAL_S, where=lambda e, after=after: e["step"] >= after)
            loads.append(uptime())
    swarm.remove_leftover_sockets()  # the killed nodes' p2pd sockets
    if swarm.left_behind:
        print(f"# processes left behind: {swarm.left_behind}", file=sys.stderr)
    return results, loads


def table(results: list[dict[str, Any]]) -> str:
    """Markdown: per trial, each phase's end after the kill (and its own length), then each mode's medians
    (a standby's `import` and `dht` lie before the kill: `-`)."""
    header = "| trial | mode | stage | method | " + " | ".join(PHASES) + " | stall |"
    lines = [header, "|" + "---|" * (len(PHASES) + 5)]

    def cells(at: dict[str, float | None]) -> list[str]:
        out, previous = [], 0.0
        for phase in PHASES:
            t = at[phase]
            out.append("-" if t is None else f"{t:.2f} ({t - previous:.2f})")
            previous = previous if t is None else t
        return out

    for r in results:
        row = [str(r["trial"]), r["mode"], str(r["stage"]), r["method"], *cells(r["at"]), f"{r['stall']:.2f}"]
        lines.append("| " + " | ".join(row) + " |")
    for mode, median, stall in medians(results):
        lines.append(f"| median | {mode} | | | " + " | ".join(cells(median)) + f" | {stall:.2f} |")
    return "\n".join(lines)


def medians(results: list[dict[str, Any]]) -> list[tuple[str, dict[str, float | None], float]]:
    """Per mode run: the median end of each phase (None where the mode has no such phase) and stall."""
    out = []
    for mode in MODES:
        of = [r for r in results if r["mode"] == mode]
        if of:
            median = {
                p: None if of[0]["at"][p] is None else statistics.median(r["at"][p] for r in of)
                for p in PHASES
            }
            out.append((mode, median, statistics.median(r["stall"] for r in of)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), default=2, help="the stage to kill")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--keep", type=Path, default=None, help="keep the daemons' logs in this new folder")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--standby", action="store_true", help="a standby takes the stage, not a replacement")
    which.add_argument("--compare", action="store_true", help="alternate replacement and standby trials")
    args = parser.parse_args()
    if args.compare:
        modes = [mode for _ in range(args.trials) for mode in MODES]
    else:
        modes = [MODES[args.standby]] * args.trials
    if args.keep is not None:
        results, loads = run(modes, args.stage, args.keep)
    else:
        with TemporaryDirectory(prefix="recovery-time-") as tmp:
            results, loads = run(modes, args.stage, Path(tmp))
    print("Seconds after the SIGKILL at which each phase ended (the phase's own length in brackets):\n")
    print(table(results))
    if args.compare:
        first = {mode: median["first"] for mode, median, _ in medians(results)}
        ratio = first["standby"] / first["replacement"]
        print(f"\nmedian first iteration through the stage, standby / replacement: {ratio:.2f}")
    print("\nmachine load during the run:")
    for line in loads:
        print(f"    {line}")
    if args.json is not None:
        args.json.write_text(json.dumps({"trials": results, "load": loads}, indent=1))


if __name__ == "__main__":
    main()
