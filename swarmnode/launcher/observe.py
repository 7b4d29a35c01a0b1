"""The launcher's view of the DHT: a child process that prints swarm snapshots as JSON lines.

`python -m swarmnode.launcher.observe PEERS_FILE RUN_ID [INTERVAL]` prints a `SwarmObserver` snapshot (the
`swarmnode status --json` object) every INTERVAL seconds (none where a DHT read timed out). It runs as a
supervised child like the daemons, so its p2pd lives in a process group the launcher ends, and
the terminal's Ctrl-C never reaches them mid-call. The launcher reads its lines with `parse_snapshot`; of a
snapshot it uses only `stages[].stage` and `stages[].peers[].state`.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from swarmnode.launcher.display import StageCount


def parse_snapshot(line: str) -> dict[int, StageCount] | None:
    """Nodes per stage by state from one snapshot line, or None if the line is not a snapshot."""
    try:
        snapshot = json.loads(line)
    except json.JSONDecodeError:
        return None
    stages = snapshot.get("stages") if isinstance(snapshot, dict) else None
    if not isinstance(stages, list):
        return None
    counts: dict[int, StageCount] = {}
    for entry in stages:
        if not isinstance(entry, dict) or not isinstance(entry.get("stage"), int):
            return None
        states = [peer.get("state") for peer in entry.get("peers", []) if isinstance(peer, dict)]
        counts[entry["stage"]] = StageCount(
            online=states.count("online"),
            recovering=states.count("recovering"),
            joining=states.count("joining"),
        )
    return counts


def main(argv: Sequence[str] | None = None) -> None:
    """Print snapshots until SIGTERM or SIGINT."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) not in (2, 3):
        raise SystemExit("usage: python -m swarmnode.launcher.observe PEERS_FILE RUN_ID [INTERVAL]")
    peers_file, run_id = Path(args[0]), args[1]
    interval = float(args[2]) if len(args) == 3 else 2.0
    from swarmnode.status import SwarmObserver  # imports hivemind: only in this child, never in the launcher

    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    initial_peers = [line.strip() for line in peers_file.read_text().splitlines() if line.strip()]
    observer = SwarmObserver(initial_peers, run_id)
    try:
        while True:
            try:
                print(json.dumps(observer.snapshot()), flush=True)
            except TimeoutError:  # a DHT call got no answer in time: no snapshot this once
                print("a DHT read timed out", file=sys.stderr, flush=True)
            time.sleep(interval)
    finally:
        observer.close()


if __name__ == "__main__":
    main()
