"""What signed DHT records cost a node: signing and checking one record, side by side with the schema check
every record got before signatures, and the share of one CPU core that follows for a swarm of N nodes.

Every node signs its record once per record period (`record_period_s`, 1 s) and, reading the swarm once
per period, checks every node's record it gets back; each store is also checked by the DHT peers that keep
it (hivemind stores to a handful of nearest peers; `STORE_REPLICAS` below). So per node and period:
1 signature and about `N + STORE_REPLICAS` checks. Run `python benchmarks/record_signing.py` (seconds).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from protocols.messages import NodeRecord, NodeState, encode
from swarmnode.identity import Identity
from swarmnode.records import SwarmRecordValidator, decode_record, stage_key, subkey_of

STORE_REPLICAS = 5
SWARM_SIZES = (10, 100, 1000)


def per_call(function: Callable[[], object], seconds: float) -> float:
    """Mean seconds per call of `function`, over at least `seconds` of calls."""
    calls, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        for _ in range(100):
            function()
        calls += 100
    return elapsed / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="time spent measuring each operation")
    args = parser.parse_args()

    identity = Identity.generate()
    validator = SwarmRecordValidator("bench", identity)
    value = MSGPackSerializer.dumps(
        encode(NodeRecord(NodeState.ONLINE, 2, 1234, 24, loss=3.2, throughput=1e4))
    )
    record = DHTRecord(
        DHTID.generate(source=stage_key("bench", 2)).to_bytes(),
        MSGPackSerializer.dumps(subkey_of(identity.peer_id)),
        value,
        get_dht_time() + 60,
    )
    signed = dataclasses.replace(record, value=validator.sign_value(record))
    if not validator.validate(signed):
        raise SystemExit("the benchmark's own record does not validate")

    baseline = per_call(lambda: decode_record(MSGPackSerializer.loads(value)), args.seconds)
    sign = per_call(lambda: validator.sign_value(record), args.seconds)
    fresh = [
        validator.sign_value(dataclasses.replace(record, expiration_time=record.expiration_time + k * 1e-3))
        for k in range(5_000)
    ]  # distinct records: the check's cache of signatures never hits
    records = iter(
        dataclasses.replace(record, expiration_time=record.expiration_time + k * 1e-3, value=v)
        for k, v in enumerate(fresh)
    )
    check = per_call(lambda: validator.validate(next(records)), min(args.seconds, 1.0))

    print(f"{'operation':<34} {'us/record':>10} {'x schema check':>15}")
    for name, cost in (
        ("schema check (before signatures)", baseline),
        ("sign (own record)", sign),
        ("check: signature + expiry + schema", check),
    ):
        print(f"{name:<34} {cost * 1e6:>10.1f} {cost / baseline:>15.1f}")
    print()
    print(
        f"{'nodes':>6} {'checks/s/node':>14} {'CPU share, before':>18} {'CPU share, signed':>18} {'added':>8}"
    )
    for nodes in SWARM_SIZES:
        checks = nodes + STORE_REPLICAS
        before = checks * baseline
        after = sign + checks * check
        print(f"{nodes:>6} {checks:>14} {before:>17.3%} {after:>18.3%} {after - before:>8.3%}")


if __name__ == "__main__":
    main()
