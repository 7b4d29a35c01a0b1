"""How a joining node gets its stage's state: from a live replica, or rebuilt with CheckFree(+).

The decision is `protocols.checkfree.plan_recovery`'s; this module fetches what it names over the
transport and loads it, through the narrow `Joiner` interface of the node. Liveness is checked by pinging
the peers the DHT lists (`node.liveness`), so a stage whose last node just died is recognised as lost at
once. A swarm that
has not trained yet (no record with a step) needs no recovery: every node starts from the run's seeded
initial weights.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from hivemind.p2p import PeerID

from protocols.bounds import clock_problem
from protocols.checkfree import (
    Method,
    Recovery,
    average_neighbours,
    copy_partner,
    edge_copy_part,
    plan_recovery,
    reinit_seed,
    restore_embeddings,
    swap_partner,
)
from protocols.errors import ProtocolError
from protocols.messages import Error, ErrorCode, NodeState, Rpc, decode, encode
from protocols.standins import MIN_STAND_INS
from protocols.transfers import StatePart, StateRequest, StateTransfer
from swarmnode.model_config import ModelConfig
from swarmnode.node import state
from swarmnode.node.compute import ComputeQueue, Priority
from swarmnode.node.events import emit
from swarmnode.node.liveness import live_peers, trained_peers
from swarmnode.node.planning import SwarmRead
from swarmnode.node.serving import STATE_SECONDS
from swarmnode.pieces import build_piece
from swarmnode.runspec import RunSpec
from swarmnode.transport import Transport, TransportError

logger = logging.getLogger(__name__)

FETCH_TIMEOUT_S = STATE_SECONDS  # what a donor allows one transfer (`node.serving`)
BUSY_RETRY_S = 0.5  # when every donor is busy, ask them all again after this pause...
BUSY_WAIT_S = STATE_SECONDS  # ...for as long as one transfer may take
RECOVERY_ATTEMPTS = 3


class RecoveryFailed(Exception):
    """No donor could provide the state the recovery plan needs."""


class DonorBusy(Exception):
    """The donor serves other transfers now (answered BUSY): worth asking again."""


class Joiner(Protocol):
    """What recovery needs of the node that joins: its run, model, stage and identity, the transport and
    compute queue, its view of the swarm, and the two ways to load state (as a replica, or rebuilt)."""

    spec: RunSpec
    model_config: ModelConfig
    stage: int
    me: str
    transport: Transport
    compute: ComputeQueue
    rng: random.Random
    dump_dir: Path | None

    @property
    def swarm_read(self) -> SwarmRead: ...

    async def refresh_swarm_read(self) -> None: ...

    def check_replica(self, header: StateTransfer, received: state.TensorMap) -> state.ReplicaState: ...

    def load_replica(self, header: StateTransfer, received: state.TensorMap) -> None: ...

    def load_rebuilt(self, rebuilt: state.TensorMap, plan: Recovery, step: int) -> None: ...


async def request_state(
    transport: Transport, run_id: str, peer: str, stage: int, parts: tuple[StatePart, ...], timeout: float
) -> tuple[StateTransfer, state.TensorMap]:
    """Ask `peer` for `parts` of `stage`: the transfer's header and tensors, or DonorBusy (it serves others
    now) or StateMismatch (it refused, or sent something else)."""
    request = StateRequest(run_id, stage, parts)
    meta, tensors = await transport.call(
        PeerID.from_base58(peer), Rpc.STATE, encode(request), [], timeout=timeout
    )
    header = decode(meta)
    if isinstance(header, Error):
        refused = DonorBusy if header.code == ErrorCode.BUSY else state.StateMismatch
        raise refused(f"{peer[-8:]} refused: {header.code}: {header.reason}")
    if not isinstance(header, StateTransfer):
        raise state.StateMismatch(f"{peer[-8:]} answered a {type(header).__name__}, not a state transfer")
    if header.stage != stage or set(header.parts) != set(parts):
        raise state.StateMismatch(f"asked stage {stage} {parts}, got stage {header.stage} {header.parts}")
    return header, state.unpack(header.tensors, tensors)


async def fetch(
    node: Joiner, peer: str, stage: int, parts: tuple[StatePart, ...]
) -> tuple[StateTransfer, state.TensorMap]:
    """`parts` of `stage` from `peer`; its step and outer step must lie within the swarm's range
    (`protocols.bounds.clock_problem`; the view is read again once before a donor is refused for it)."""
    header, tensors = await request_state(
        node.transport, node.spec.run_id, peer, stage, parts, FETCH_TIMEOUT_S
    )
    for refreshed in (False, True):
        problem = clock_problem(
            header.step,
            header.outer_step,
            clock=swarm_clock(node.swarm_read),
            inner_steps=node.spec.noloco_inner_steps,
        )
        if problem is None:
            return header, tensors
        if not refreshed:
            await node.refresh_swarm_read()
    raise state.StateMismatch(f"{peer[-8:]} is out of the swarm's range: {problem}")


def swarm_clock(view: SwarmRead) -> int:
    """The swarm clock (`SwarmRead.clock`); while no data node is online, the furthest online node's step."""
    if view.online(0):
        return view.clock()
    online = (p for peers in view.stages.values() for p in peers if p.record.state == NodeState.ONLINE)
    return max((p.record.step for p in online), default=0)


async def fetch_any(
    node: Joiner,
    stage: int,
    parts: tuple[StatePart, ...],
    check: Callable[[StateTransfer, state.TensorMap], object] | None = None,
    among: Collection[str] | None = None,
) -> tuple[StateTransfer, state.TensorMap]:
    """State from one live node of `stage` (`fetch_from_any`, without naming the donor)."""
    _, header, tensors = await fetch_from_any(node, stage, parts, check, among)
    return header, tensors


async def fetch_from_any(
    node: Joiner,
    stage: int,
    parts: tuple[StatePart, ...],
    check: Callable[[StateTransfer, state.TensorMap], object] | None = None,
    among: Collection[str] | None = None,
) -> tuple[str, StateTransfer, state.TensorMap]:
    """The donor, and the state it sent, from one live node of `stage` (one of `among`, if given), trying
    donors in random order (spreads newcomers over donors); `check` (run in a worker thread) may refuse
    what a donor sent (raising StateMismatch or ProtocolError), and the next is tried. While some donor is
    busy, all are asked again after `BUSY_RETRY_S`, for up to `BUSY_WAIT_S`."""
    peers = live_peers if stage == node.stage else trained_peers
    donors = await peers(node.transport, node.swarm_read, node.me, stage)
    if among is not None:
        donors = [donor for donor in donors if donor in among]
    node.rng.shuffle(donors)
    deadline = time.monotonic() + BUSY_WAIT_S
    while True:
        busy = False
        for donor in donors:
            try:
                header, tensors = await fetch(node, donor, stage, parts)
                if check is not None:  # a pass over all it sent: off the event loop, which relays hops
                    await asyncio.to_thread(check, header, tensors)
                return donor, header, tensors
            except DonorBusy as error:
                busy = True
                logger.info("state fetch from %s: %s", donor[-8:], error)
            except (TransportError, ProtocolError, state.StateMismatch) as error:
                logger.warning("state fetch from %s failed: %s", donor[-8:], error)
        if not busy or time.monotonic() >= deadline:
            raise RecoveryFailed(f"no live node of stage {stage} provided {', '.join(parts)}")
        await asyncio.sleep(BUSY_RETRY_S)


def swarm_has_trained(view: SwarmRead) -> bool:
    return any(peer.record.step > 0 for peers in view.stages.values() for peer in peers)


def stand_ins(
    view: SwarmRead, trained: Mapping[int, Collection[str]], stage: int, num_stages: int
) -> dict[str, int]:
    """What each live, trained node (`trained`, by stage) of `stage`'s swap partner reports it served in
    `stage`'s place over the recent window (`NodeRecord.stood_in`; a record without it counts 0); empty
    when `stage` is no edge stage."""
    partner = swap_partner(stage, num_stages)
    if partner is None:
        return {}
    place = 0 if stage == 1 else 1
    counts = {p.peer_id: p.record.stood_in for p in view.stages.get(partner, ())}
    return {peer: c[place] if c is not None else 0 for peer, c in counts.items() if peer in trained[partner]}


async def obtain_state(node: Joiner) -> tuple[Recovery, dict[str, Any]] | None:
    """Give `node` its stage's state before it goes online. Returns the plan it followed and the evidence
    (the sources' tensors and grad norms, and what was loaded); None for a fresh start."""
    spec = node.spec
    view = node.swarm_read
    if not swarm_has_trained(view):
        return None
    stages = range(spec.stages + 1)
    trained, replicas = await asyncio.gather(  # every stage's peers pinged at once
        asyncio.gather(*(trained_peers(node.transport, view, node.me, k) for k in stages)),
        live_peers(node.transport, view, node.me, node.stage),
    )
    alive = {k for k, peers in zip(stages, trained, strict=True) if peers}
    if replicas:
        alive.add(node.stage)  # a replica of this node's own stage is copied whatever its history
    holders = {
        part: any(part in peer.record.copies for peer in view.stages.get(k, ()) if peer.peer_id != node.me)
        for part, k in ((StatePart.EMBEDDING_COPY, 1), (StatePart.HEAD_COPY, spec.stages))
    }
    edge_part, partner = edge_copy_part(node.stage, spec.stages), swap_partner(node.stage, spec.stages)
    keepers = []  # the partner's live, trained nodes whose records say they keep this stage's copy
    if edge_part is not None and partner is not None:
        live = set(trained[partner])
        keepers = [
            p.peer_id
            for p in view.stages.get(partner, ())
            if p.peer_id in live and edge_part in p.record.copies
        ]
    reports = stand_ins(view, dict(zip(stages, trained, strict=True)), node.stage, spec.stages)
    plan = plan_recovery(
        node.stage,
        num_stages=spec.stages,
        alive=alive,
        checkfree_plus=spec.checkfree_plus,
        edge_swaps=spec.edge_swaps,
        stood_in={node.stage: max(reports.values())} if reports else {},
        embedding_copy_held=holders[StatePart.EMBEDDING_COPY],
        head_copy_held=holders[StatePart.HEAD_COPY],
        edge_copies_held={node.stage} if keepers else set(),
    )
    if plan.method == Method.REPLICA:
        parts = (StatePart.WEIGHTS, StatePart.OPTIMIZER)
        header, tensors = await fetch_any(node, node.stage, parts, node.check_replica)
        await node.compute.submit(Priority.STEP, lambda: node.load_replica(header, tensors))
        return plan, {"sources": [_evidence(header, tensors)], "loaded": tensors}
    if plan.method == Method.REINIT:
        return plan, await reinitialise(node, plan)
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
    if plan.method == Method.EDGE_COPY and edge_part is not None:
        header, kept = await fetch_any(node, plan.sources[0], (edge_part,), among=keepers)
        restored = copy_partner(kept)
        await node.compute.submit(Priority.STEP, lambda: node.load_rebuilt(restored, plan, step=header.step))
        return plan, {"sources": [_evidence(header, kept)], "loaded": restored}
    # a swap partner's copy comes from a node that itself stood in for this stage
    among = (
        [p for p, n in reports.items() if n >= MIN_STAND_INS]
        if plan.method == Method.CHECKFREE_PLUS_COPY
        else None
    )
    sources = [await fetch_any(node, source, (StatePart.WEIGHTS,), among=among) for source in plan.sources]
    if len(sources) == 2:
        (prev_header, prev), (next_header, following) = sources
        rebuilt = average_neighbours(prev, following, prev_header.grad_norm, next_header.grad_norm)
    else:  # an edge stage: a copy of its swap partner, or of its only neighbour where none stood in for it
        rebuilt = copy_partner(sources[0][1])
    step = max(header.step for header, _ in sources)
    await node.compute.submit(Priority.STEP, lambda: node.load_rebuilt(rebuilt, plan, step=step))
    return plan, {"sources": [_evidence(header, tensors) for header, tensors in sources], "loaded": rebuilt}


async def reinitialise(node: Joiner, plan: Recovery) -> dict[str, Any]:
    """A `reinit`, loaded like every rebuild (`load_rebuilt`: fresh optimizer, the swarm's step): weights
    drawn from `reinit_seed` of the run's seed, the stage and the swarm clock, so neither the run's step-0
    weights nor a restarted warm-up. Returns the evidence (no sources, what was loaded, step and seed)."""
    step = swarm_clock(node.swarm_read)
    seed = reinit_seed(node.spec.seed, node.stage, step)

    def load() -> state.TensorMap:
        fresh = state.weights(build_piece(node.model_config, node.stage, node.spec.stages, seed))
        node.load_rebuilt(fresh, plan, step=step)
        return fresh

    loaded = await node.compute.submit(Priority.STEP, load)
    return {"sources": [], "loaded": loaded, "step": step, "seed": seed}


def _evidence(header: StateTransfer, tensors: state.TensorMap) -> dict[str, Any]:
    return {"stage": header.stage, "step": header.step, "grad_norm": header.grad_norm, "tensors": tensors}


async def recover(node: Joiner) -> tuple[str, float] | None:
    """Run `obtain_state` and report it in a `recovered` event; returns the method and its seconds for the
    node's record (None for a fresh start).

    A donor that dies between the ping and the fetch, or sends state that does not fit, costs an attempt:
    the view is read again and the plan made again; after `RECOVERY_ATTEMPTS` the stage is re-initialised,
    said plainly. Any other error is a bug and propagates."""
    started = time.monotonic()
    outcome = None
    for attempt in range(1, RECOVERY_ATTEMPTS + 1):
        try:
            outcome = await obtain_state(node)
            break
        except (RecoveryFailed, TransportError, ProtocolError, state.StateMismatch) as error:
            logger.warning("recovery attempt %d of stage %d failed: %s", attempt, node.stage, error)
            await node.refresh_swarm_read()
    else:
        why = f"stage {node.stage} could not be recovered in {RECOVERY_ATTEMPTS} attempts; re-initialising it"
        plan = Recovery(node.stage, Method.REINIT, (), True, 1.0, why)
        outcome = (plan, await reinitialise(node, plan))
    if outcome is None:
        return None
    plan, evidence = outcome
    seconds = time.monotonic() - started
    if node.dump_dir is not None:
        node.dump_dir.mkdir(parents=True, exist_ok=True)
        torch.save(
            {"stage": node.stage, "method": str(plan.method), **evidence},
            node.dump_dir / f"recovery-stage{node.stage}-{node.me[-8:]}.pt",
        )
    if plan.method == Method.REINIT:
        logger.warning("%s", plan.reason)
    emit(
        "recovered", stage=node.stage, method=str(plan.method), seconds=round(seconds, 3), reason=plan.reason
    )
    return str(plan.method), seconds
