"""How a joining node gets its stage's state: from a live replica, or rebuilt with CheckFree(+).

The decision is `protocols.checkfree.plan_recovery`'s; this module fetches what it names over the
transport and loads it. Liveness is checked by pinging the peers the DHT lists (a record outlives its
node by up to its TTL), so a stage whose last node just died is recognised as lost at once. A swarm that
has not trained yet (no record with a step) needs no recovery: every node starts from the run's seeded
initial weights.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from hivemind.p2p import PeerID

from protocols.checkfree import (
    Method,
    Recovery,
    average_neighbours,
    copy_partner,
    plan_recovery,
    restore_embeddings,
)
from protocols.errors import ProtocolError
from protocols.messages import Pong, Rpc, StatePart, StateRequest, StateTransfer, decode, encode
from swarmnode.node import state
from swarmnode.node.compute import Priority
from swarmnode.node.events import emit
from swarmnode.transport import Transport, TransportError

if TYPE_CHECKING:
    from swarmnode.node.daemon import Node

logger = logging.getLogger(__name__)

PING_TIMEOUT_S = 1.0
FETCH_TIMEOUT_S = 120.0


class RecoveryFailed(RuntimeError):
    """No donor could provide the state the recovery plan needs."""


async def ping(transport: Transport, peer: str, stage: int | None = None) -> bool:
    """Whether `peer` answers now (and, if `stage` is given, serves that stage)."""
    try:
        reply, _ = await transport.call(PeerID.from_base58(peer), Rpc.PING, b"", [], timeout=PING_TIMEOUT_S)
        answer = decode(reply, Pong)
    except (TransportError, ProtocolError, ValueError):
        return False
    return stage is None or answer.stage == stage


async def answering(transport: Transport, peers: list[str], stage: int | None = None) -> list[str]:
    """The peers among `peers` that answer a ping now (serving `stage`, if given)."""
    answers = await asyncio.gather(*(ping(transport, p, stage) for p in peers))
    return [p for p, alive in zip(peers, answers, strict=True) if alive]


async def live_peers(node: Node, stage: int) -> list[str]:
    """Online peers of `stage` (other than this node) that answer a ping now and still serve it."""
    return await answering(node.transport, [p for p in node.snapshot.online(stage) if p != node.me], stage)


async def trained_peers(node: Node, stage: int) -> list[str]:
    """Live peers of `stage` that may serve as a rebuild source: not freshly re-initialised (a stage served
    only by a `reinit` node holds random weights, which an average must not take in)."""
    fresh = {p.peer_id for p in node.snapshot.stages.get(stage, ()) if p.record.recovery == "reinit"}
    return [p for p in await live_peers(node, stage) if p not in fresh]


async def fetch(
    node: Node, peer: str, stage: int, parts: tuple[StatePart, ...]
) -> tuple[StateTransfer, state.TensorMap]:
    request = StateRequest(node.spec.run_id, stage, parts)
    meta, tensors = await node.transport.call(
        PeerID.from_base58(peer), Rpc.STATE, encode(request), [], timeout=FETCH_TIMEOUT_S
    )
    header = decode(meta, StateTransfer)
    if header.stage != stage or set(header.parts) != set(parts):
        raise state.StateMismatch(f"asked stage {stage} {parts}, got stage {header.stage} {header.parts}")
    return header, state.unpack(header.tensors, tensors)


async def fetch_any(
    node: Node, stage: int, parts: tuple[StatePart, ...]
) -> tuple[StateTransfer, state.TensorMap]:
    """State from one live node of `stage`, trying donors in random order (spreads newcomers over donors)."""
    donors = await (live_peers(node, stage) if stage == node.stage else trained_peers(node, stage))
    node.rng.shuffle(donors)
    for donor in donors:
        try:
            return await fetch(node, donor, stage, parts)
        except (TransportError, ProtocolError, state.StateMismatch) as error:
            logger.warning("state fetch from %s failed: %s", donor[-8:], error)
    raise RecoveryFailed(f"no live node of stage {stage} provided {', '.join(parts)}")


def swarm_has_trained(node: Node) -> bool:
    return any(peer.record.step > 0 for peers in node.snapshot.stages.values() for peer in peers)


async def obtain_state(node: Node) -> tuple[Recovery, dict[str, Any]] | None:
    """Give `node` its stage's state before it goes online. Returns the plan it followed and the evidence
    (the sources' tensors and grad norms, and what was loaded); None for a fresh start."""
    spec = node.spec
    if not swarm_has_trained(node):
        return None
    alive = {k for k in range(spec.stages + 1) if await trained_peers(node, k)}
    if await live_peers(node, node.stage):
        alive.add(node.stage)  # a replica of this node's own stage is copied whatever its history
    holders = {
        part: any(
            part in peer.record.copies for peer in node.snapshot.stages.get(k, ()) if peer.peer_id != node.me
        )
        for part, k in ((StatePart.EMBEDDING_COPY, 1), (StatePart.HEAD_COPY, spec.stages))
    }
    plan = plan_recovery(
        node.stage,
        num_stages=spec.stages,
        alive=alive,
        checkfree_plus=spec.checkfree_plus,
        embedding_copy_held=holders[StatePart.EMBEDDING_COPY],
        head_copy_held=holders[StatePart.HEAD_COPY],
    )
    if plan.method == Method.REPLICA:
        parts = (StatePart.WEIGHTS, StatePart.OPTIMIZER)
        header, tensors = await fetch_any(node, node.stage, parts)
        await node.compute.submit(Priority.STEP, lambda: node.load_replica(header, tensors))
        return plan, {"sources": [_evidence(header, tensors)], "loaded": tensors}
    if plan.method == Method.REINIT:
        return plan, {"sources": [], "loaded": {}}
    if plan.method == Method.EMBEDDING_COPY:
        embedding_header, embedding = await fetch_any(node, plan.sources[0], (StatePart.EMBEDDING_COPY,))
        head_header, head = await fetch_any(node, plan.sources[1], (StatePart.HEAD_COPY,))
        restored = restore_embeddings(
            {state.EMBEDDING_PREFIX + k: v for k, v in embedding.items()},
            {state.HEAD_PREFIX + k: v for k, v in head.items()},
        )
        step = max(embedding_header.step, head_header.step)
        await node.compute.submit(Priority.STEP, lambda: node.load_rebuilt(restored, plan, step=step))
        evidence = [_evidence(embedding_header, embedding), _evidence(head_header, head)]
        return plan, {"sources": evidence, "loaded": restored}
    sources = [await fetch_any(node, source, (StatePart.WEIGHTS,)) for source in plan.sources]
    if plan.method == Method.CHECKFREE:
        (prev_header, prev), (next_header, following) = sources
        rebuilt = average_neighbours(prev, following, prev_header.grad_norm, next_header.grad_norm)
    else:
        rebuilt = copy_partner(sources[0][1])
    step = max(header.step for header, _ in sources)
    await node.compute.submit(Priority.STEP, lambda: node.load_rebuilt(rebuilt, plan, step=step))
    return plan, {"sources": [_evidence(header, tensors) for header, tensors in sources], "loaded": rebuilt}


def _evidence(header: StateTransfer, tensors: state.TensorMap) -> dict[str, Any]:
    return {"stage": header.stage, "step": header.step, "grad_norm": header.grad_norm, "tensors": tensors}


RECOVERY_ATTEMPTS = 3


async def recover(node: Node) -> None:
    """Run `obtain_state` and report it: a `recovered` event and the record's recovery fields.

    A donor that dies between the ping and the fetch, or sends state that does not fit, costs an attempt:
    the view is read again and the plan made again; after `RECOVERY_ATTEMPTS` the stage is re-initialised,
    said plainly."""
    started = time.monotonic()
    outcome = None
    for attempt in range(1, RECOVERY_ATTEMPTS + 1):
        try:
            outcome = await obtain_state(node)
            break
        except (RecoveryFailed, TransportError, ProtocolError, state.StateMismatch, RuntimeError) as error:
            logger.warning("recovery attempt %d of stage %d failed: %s", attempt, node.stage, error)
            await node.refresh_snapshot()
    else:
        why = f"stage {node.stage} could not be recovered in {RECOVERY_ATTEMPTS} attempts; re-initialising it"
        logger.warning("%s", why)
        outcome = (Recovery(node.stage, Method.REINIT, (), True, 1.0, why), {"sources": [], "loaded": {}})
    if outcome is None:
        return
    plan, evidence = outcome
    seconds = time.monotonic() - started
    if node.dump_dir is not None:
        node.dump_dir.mkdir(parents=True, exist_ok=True)
        torch.save(
            {"stage": node.stage, "method": str(plan.method), **evidence},
            node.dump_dir / f"recovery-stage{node.stage}-{node.me[-8:]}.pt",
        )
    node.recovery = (str(plan.method), seconds)
    if plan.method == Method.REINIT:
        logger.warning("%s", plan.reason)
    emit(
        "recovered", stage=node.stage, method=str(plan.method), seconds=round(seconds, 3), reason=plan.reason
    )
