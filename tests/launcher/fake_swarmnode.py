"""A stand-in for the `swarmnode` CLI that the launcher tests run instead of real daemons.

`bootstrap` writes a peers file (and the run's step count beside it); `join` prints the daemons' JSON event
lines: data nodes (stage 0) train `steps` steps quickly and exit 0, other stages idle until ended; `export`
writes a stand-in model folder and its `exported` line. Like a real
daemon, every process leaves a grandchild behind in its process group (standing in for its
p2pd), and records both pids under $FAKE_PIDS_DIR so tests can check that nothing survives the launcher.

Environment knobs: FAKE_AUTO_STAGE (the stage `--stage auto` picks, default 1; such a node then reports a
CheckFree recovery), FAKE_BOOTSTRAP_EXIT / FAKE_JOIN_EXIT (exit at once with that code), FAKE_STEP_S.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def emit(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields, "time": time.time()}), flush=True)


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def leave_grandchild() -> None:
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    pids_dir = Path(os.environ["FAKE_PIDS_DIR"])
    pids_dir.mkdir(parents=True, exist_ok=True)
    (pids_dir / str(os.getpid())).write_text(f"{os.getpid()} {grandchild.pid}\n")


def bootstrap(args: list[str]) -> None:
    if "FAKE_BOOTSTRAP_EXIT" in os.environ:
        print("fake bootstrap: cannot listen", file=sys.stderr)
        sys.exit(int(os.environ["FAKE_BOOTSTRAP_EXIT"]))
    leave_grandchild()
    peers = Path(option(args, "--peers-file"))
    peers.with_suffix(".steps").write_text(option(args, "--steps"))
    peers.write_text(f"/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWfakeboot{os.getpid()}\n")
    while True:
        time.sleep(1)


def join(args: list[str]) -> None:
    if "FAKE_JOIN_EXIT" in os.environ:
        print("fake join: boom", file=sys.stderr)
        sys.exit(int(os.environ["FAKE_JOIN_EXIT"]))
    leave_grandchild()
    peers = Path(option(args, "--initial-peers"))
    assert peers.read_text().startswith("/ip4/")
    stage_arg = option(args, "--stage")
    stage = int(os.environ.get("FAKE_AUTO_STAGE", "1")) if stage_arg == "auto" else int(stage_arg)
    assert int(option(args, "--threads")) >= 1
    assert stage != 0 or "--shard" in args
    assert option(args, "--metrics-port") == "0"
    emit("metrics", url=f"http://127.0.0.1:9{os.getpid() % 1000:03d}/metrics", port=9000 + os.getpid() % 1000)
    emit("joining", phase="stage", stage=stage, seconds=0.1)
    emit("online", stage=stage, peer_id=f"12D3KooWfake{os.getpid()}")
    if stage_arg == "auto":
        emit("recovered", stage=stage, method="checkfree", seconds=0.25)
    if stage != 0:
        while True:
            time.sleep(1)
    steps = int(peers.with_suffix(".steps").read_text())
    pause = float(os.environ.get("FAKE_STEP_S", "0.05"))
    emit("validation", step=0, val_loss=8.5)
    for step in range(1, steps + 1):
        time.sleep(pause)
        emit("step", step=step, loss=8.0 - 0.1 * step, tokens=1024)
        if step == 3:
            emit("microbatch_lost", step=step, count=2)
        if step % 5 == 0 or step == steps:
            emit("validation", step=step, val_loss=8.2 - 0.1 * step)
    print("not an event line")
    sys.exit(0)


def export(args: list[str]) -> None:
    """Writes a stand-in model folder and the exporter's line (validation loss 7.0)."""
    out = Path(option(args, "--out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text("{}\n")
    emit("exported", path=str(out), step=0, steps={"0": 0}, val_loss=7.0)


def main() -> None:
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))  # leaves its grandchild behind
    command, *args = sys.argv[1:]
    {"bootstrap": bootstrap, "join": join, "export": export}[command](args)


if __name__ == "__main__":
    main()
