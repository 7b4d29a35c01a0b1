"""`swarmnode status`: the swarm as the DHT shows it (and nothing else), for people and for programs."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from protocols.messages import NodeState
from swarmnode.dht import SwarmDHT
from swarmnode.records import PeerRecord
from swarmnode.runspec import RunSpec
from swarmnode.standbys import StandbyPeer, read_standbys


def swarm_summary(
    run_id: str,
    spec: RunSpec | None,
    stages: dict[int, list[PeerRecord]],
    standbys: Sequence[StandbyPeer] = (),
) -> dict[str, Any]:
    """The `status --json` object: every stage's peers, whether every stage has an online node, the loss,
    and the standby nodes (`taken`: the stage one took lately; null while it stands by)."""
    n_stages = spec.stages if spec is not None else max(stages, default=0)
    out_stages = []
    losses = []
    for stage in range(n_stages + 1):
        peers = []
        for peer in stages.get(stage, []):
            record = peer.record
            peers.append(
                {
                    "peer_id": peer.peer_id,
                    "state": str(record.state),
                    "step": record.step,
                    "outer_step": record.outer_step,
                    "loss": record.loss,
                    "grad_norm": record.grad_norm,
                    "tokens_per_second": record.throughput,
                    "queue_depth": record.queue_depth,
                    "microbatches_lost": record.microbatches_lost,
                    "copies": [str(part) for part in record.copies],
                    "recovery": (
                        {"method": record.recovery, "seconds": record.recovery_seconds}
                        if record.recovery
                        else None
                    ),
                }
            )
            if stage == 0 and record.loss is not None:
                losses.append((record.step, record.loss))
        out_stages.append({"stage": stage, "peers": peers})
    complete = spec is not None and all(
        any(p["state"] == NodeState.ONLINE for p in s["peers"]) for s in out_stages
    )
    return {
        "run_id": run_id,
        "complete": complete,
        "loss": max(losses)[1] if losses else None,
        "stages": out_stages,
        "standbys": [
            {"peer_id": p.peer_id, "taken": p.record.taken, "site": p.record.site} for p in standbys
        ],
        "run": spec.to_dict() if spec is not None else None,
    }


def format_table(summary: dict[str, Any]) -> str:
    """A table for people: one line per peer, grouped by stage."""
    if summary["run"] is None:
        return f"run {summary['run_id']}: no run definition on the DHT (check --run-id and --initial-peers)"
    lines = [
        f"run {summary['run_id']}: {'complete' if summary['complete'] else 'INCOMPLETE'}"
        + (f", loss {summary['loss']:.4f}" if summary["loss"] is not None else "")
    ]
    lines.append(
        f"{'stage':>5}  {'peer':<14} {'state':<10} {'step':>6} {'outer':>5} {'loss':>8} "
        f"{'tok/s':>9} {'queue':>5}"
    )
    for stage in summary["stages"]:
        if not stage["peers"]:
            lines.append(f"{stage['stage']:>5}  {'(no node)':<14}")
        for peer in stage["peers"]:
            loss = f"{peer['loss']:.4f}" if peer["loss"] is not None else "-"
            lines.append(
                f"{stage['stage']:>5}  ..{peer['peer_id'][-12:]:<12} {peer['state']:<10} {peer['step']:>6} "
                f"{peer['outer_step']:>5} {loss:>8} {peer['tokens_per_second']:>9.0f} "
                f"{peer['queue_depth']:>5}"
            )
    for standby in summary.get("standbys", ()):
        state = "standby" if standby["taken"] is None else f"took {standby['taken']}"
        lines.append(f"{'-':>5}  ..{standby['peer_id'][-12:]:<12} {state:<10}")
    return "\n".join(lines)


class SwarmObserver:
    """A DHT client that reads the swarm on demand (used by `status` and by the local-swarm launcher)."""

    def __init__(self, initial_peers: Sequence[str], run_id: str, run_owners: Sequence[str] = ()) -> None:
        self.run_id = run_id
        self._dht = SwarmDHT(run_id, initial_peers, client_mode=True, run_owners=run_owners)
        self._spec: RunSpec | None = None

    async def read(self) -> dict[str, Any]:
        if self._spec is None:
            self._spec = await self._dht.read_run()
        n_stages = self._spec.stages if self._spec is not None else 0
        stages, standbys = await asyncio.gather(self._dht.read_swarm(n_stages), read_standbys(self._dht))
        return swarm_summary(self.run_id, self._spec, stages, standbys)

    def snapshot(self) -> dict[str, Any]:
        return asyncio.run(self.read())

    def close(self) -> None:
        self._dht.shutdown()
