"""What one read of the swarm costs as the swarm grows: time, CPU and bytes of `SwarmDHT.read_swarm` with N
signed node records spread over S + 1 stage keys, on real DHT peers on loopback.

`--replicas` DHT peers (each a DHT thread of this process and its p2pd) hold every record in their storage, as
the replicas of the stage keys do in a swarm (hivemind stores each key on 5 peers); one more peer reads. Each
record is a typical training node's (4 measured links), signed by its own Ed25519 identity, so the reader
checks every signature as a daemon does. For each N: the first read (every signature new to the reader,
as when every record changed since the last read, which is the case while training) and the median of
`--reads` later ones (the signatures already checked, as at idle), against the read before batching (one
DHT lookup per stage key, `--per-key`, in the same run), with the CPU seconds the reader's DHT thread and
p2pd and the replicas' spent per read.

    python benchmarks/dht_read_cost.py --records 100 1000 10000 --stages 16

A swarm of N nodes reads N records a node a record period; the docs/scaling.md model takes it from here.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from protocols.links import LinkCost
from protocols.messages import NodeRecord, NodeState, encode
from swarmnode.dht import SwarmDHT
from swarmnode.identity import Identity
from swarmnode.records import SwarmRecordValidator, stage_key, subkey_of

RUN = "readcost"
TTL_S = 300.0  # the records outlive the measurement
_TICK = os.sysconf("SC_CLK_TCK")


def signed_records(count: int, stages: int) -> list[tuple[str, bytes, bytes, float]]:
    """(key, subkey, signed value, expiry) of `count` node records over stages 0..stages, each signed by
    its own identity."""
    owners = [Identity.generate() for _ in range(count)]
    expiry = get_dht_time() + TTL_S
    out = []
    for n, owner in enumerate(owners):
        stage = n % (stages + 1)
        links = tuple(LinkCost(owners[(n + k) % count].peer_id, 0.01 * k) for k in range(1, 5))
        record = NodeRecord(NodeState.ONLINE, stage, 1000 + n, 20, loss=3.2, throughput=1e4, links=links)
        key, subkey = stage_key(RUN, stage), subkey_of(owner.peer_id)
        dht_record = DHTRecord(
            DHTID.generate(source=key).to_bytes(),
            MSGPackSerializer.dumps(subkey),
            MSGPackSerializer.dumps(encode(record)),
            expiry,
        )
        out.append((key, subkey, SwarmRecordValidator(RUN, owner).sign_value(dht_record), expiry))
    return out


async def _hold(entries: list[tuple[str, bytes, bytes, float]], node: DHTNode) -> int:
    """Run on a replica's DHT thread: put `entries` in its storage, as stores would."""
    for key, subkey, value, expiry in entries:
        node.protocol.storage.store_subkey(DHTID.generate(source=key), subkey, value, expiry)
    return len(entries)


def cpu_seconds(stats: list[Path]) -> float:
    """User + system seconds of the threads and processes whose /proc stat files are `stats`."""
    total = 0.0
    for stat in stats:
        rest = stat.read_text().rsplit(")", 1)[1].split()
        total += (int(rest[11]) + int(rest[12])) / _TICK
    return total


def workers(dht: SwarmDHT) -> list[Path]:
    """The /proc stat files of `dht`'s thread (in this process) and of its p2pd."""
    return [Path(f"/proc/self/task/{dht.thread.native_id}/stat"), Path(f"/proc/{dht.p2pd_pid}/stat")]


async def per_key(dht: SwarmDHT, stages: int) -> int:
    """The read before batching: one latest lookup per stage key, concurrently; the records found."""
    found = await asyncio.gather(
        *(
            dht.thread.call(partial(DHTNode.get, key=stage_key(RUN, k), latest=True))
            for k in range(stages + 1)
        )
    )
    return sum(len(f.value) for f in found if f is not None and isinstance(f.value, dict))


async def batched(dht: SwarmDHT, stages: int) -> int:
    return sum(map(len, (await dht.read_swarm(stages)).values()))


async def measure(
    read: Callable[[], Awaitable[int]], reader: list[Path], replicas: list[Path], reads: int
) -> dict[str, Any]:
    """The first read, then the medians of `reads` more: seconds, CPU of reader and replicas, records."""
    rows = []
    for _ in range(reads + 1):
        cpu_r, cpu_s, start = cpu_seconds(reader), cpu_seconds(replicas), time.perf_counter()
        found = await read()
        rows.append((time.perf_counter() - start, cpu_seconds(reader) - cpu_r, cpu_seconds(replicas) - cpu_s))
        rows[-1] += (found,)
    first, later = rows[0], rows[1:]
    return {
        "first": {"seconds": first[0], "reader_cpu": first[1], "replicas_cpu": first[2], "found": first[3]},
        "later": {
            "seconds": statistics.median(r[0] for r in later),
            "reader_cpu": statistics.median(r[1] for r in later),
            "replicas_cpu": statistics.median(r[2] for r in later),
            "found": min(r[3] for r in later),
        },
    }


async def one_size(count: int, stages: int, replicas: int, reads: int) -> dict[str, Any]:
    entries = signed_records(count, stages)
    size = sum(len(e[1]) + len(e[2]) + 9 for e in entries) / count
    holders = [SwarmDHT(RUN)]
    holders += [SwarmDHT(RUN, holders[0].visible_maddrs()) for _ in range(replicas - 1)]
    out: dict[str, Any] = {"records": count, "stages": stages, "record_bytes": size}
    try:
        for holder in holders:
            await holder.thread.call(partial(_hold, entries))
        replica_stats = [stat for h in holders for stat in workers(h)]
        for mode, read in (("per_key", per_key), ("batched", batched)):
            reader = SwarmDHT(RUN, holders[0].visible_maddrs())  # a fresh reader: nothing checked yet
            try:
                reading = partial(read, reader, stages)
                out[mode] = await measure(reading, workers(reader), replica_stats, reads)
            finally:
                await reader.close()
    finally:
        for holder in holders:
            await holder.close()
    return out


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| records | stages | bytes/record | read | first: s | reader CPU s | replicas CPU s | later: s | "
        "reader CPU s | replicas CPU s | found |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for mode in ("per_key", "batched"):
            f, later = r[mode]["first"], r[mode]["later"]
            lines.append(
                f"| {r['records']} | {r['stages']} | {r['record_bytes']:.0f} | {mode} | {f['seconds']:.3f} | "
                f"{f['reader_cpu']:.2f} | {f['replicas_cpu']:.2f} | {later['seconds']:.3f} | "
                f"{later['reader_cpu']:.3f} | {later['replicas_cpu']:.3f} | {later['found']} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--stages", type=int, default=16, help="transformer stages (keys: stages + 1)")
    parser.add_argument("--replicas", type=int, default=3, help="DHT peers holding every record")
    parser.add_argument("--reads", type=int, default=5, help="reads after the first, per size and mode")
    args = parser.parse_args()
    if min(args.records) < 1 or args.replicas < 1 or args.reads < 1 or not 1 <= args.stages <= 255:
        parser.error("records, replicas and reads must be positive, stages within 1..255")
    load = [subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()]
    results = [asyncio.run(one_size(n, args.stages, args.replicas, args.reads)) for n in args.records]
    load.append(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    print(table(results))
    print("\nmachine load:\n    " + "\n    ".join(load))


if __name__ == "__main__":
    main()
