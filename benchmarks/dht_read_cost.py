"""What one read of the swarm costs as the swarm grows: time, CPU and bytes of `SwarmDHT.read_swarm` with N
signed node records spread over S + 1 stage keys, on real DHT peers on loopback.

`--replicas` DHT peers (each its own DHT process and p2pd) hold every record in their storage, as the
replicas of the stage keys do in a swarm (hivemind stores each key on 5 peers); one more peer reads. Each
record is a typical training node's (4 measured links), signed by its own Ed25519 identity, so the reader
checks every signature as a daemon does. For each N: the first read (every signature new to the reader,
as when every record changed since the last read, which is the case while training) and the median of
`--reads` later ones (the signatures already checked, as at idle), against the read before batching (one
DHT lookup per stage key, `--per-key`, in the same run), with the CPU seconds the reader's DHT process and
p2pd and the replicas' spent per read.

    python benchmarks/dht_read_cost.py --records 100 1000 10000 --stages 16

A swarm of N nodes reads N records a node a record period; the docs/scaling.md model takes it from here.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import hivemind
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


async def _hold(path: str, _dht: hivemind.DHT, node: DHTNode) -> int:
    """Run in a replica's DHT process: put the records pickled in `path` in its storage, as stores would
    (passed by file: hivemind's DHT process fails to read a message longer than its pipe's atomic write)."""
    entries = pickle.loads(Path(path).read_bytes())
    for key, subkey, value, expiry in entries:
        node.protocol.storage.store_subkey(DHTID.generate(source=key), subkey, value, expiry)
    return len(entries)


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(rest[11]) + int(rest[12])) / _TICK
    return total


def processes(dht: SwarmDHT) -> list[int]:
    """The DHT process of `dht` and its children (p2pd)."""
    pid = dht.dht.pid
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry))
    return [pid, *children]


async def per_key(dht: SwarmDHT, stages: int) -> int:
    """The read before batching: one latest lookup per stage key, concurrently; the records found."""
    found = await asyncio.gather(
        *(dht.dht.get(stage_key(RUN, k), latest=True, return_future=True) for k in range(stages + 1))
    )
    return sum(len(f.value) for f in found if f is not None and isinstance(f.value, dict))


async def batched(dht: SwarmDHT, stages: int) -> int:
    return sum(map(len, (await dht.read_swarm(stages)).values()))


async def measure(
    read: Callable[[], Awaitable[int]], reader: list[int], replicas: list[int], reads: int
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
        with tempfile.TemporaryDirectory(prefix="dht-read-cost-") as folder:
            path = Path(folder) / "records.pickle"
            path.write_bytes(pickle.dumps(entries))
            for holder in holders:
                await holder.dht.run_coroutine(partial(_hold, str(path)), return_future=True)
        replica_pids = [pid for h in holders for pid in processes(h)]
        for mode, read in (("per_key", per_key), ("batched", batched)):
            reader = SwarmDHT(RUN, holders[0].visible_maddrs())  # a fresh reader: nothing checked yet
            try:
                reading = partial(read, reader, stages)
                out[mode] = await measure(reading, processes(reader), replica_pids, reads)
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
