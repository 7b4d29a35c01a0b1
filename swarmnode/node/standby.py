"""A standby node's runtime (`join --standby`): it carries out `protocols.standby.Standby`'s actions (look
at the swarm, claim a lost stage, withdraw or take the claim) while its standby record is republished,
and hands the stage it took back to `node.run`, which serves it like any joiner's.

A look pings the online nodes of every transformer stage (a killed peer fails in milliseconds) every
`WATCH_S`, against the records read at most once a record period (a fresh read after a claim settled).
The node for a claimed stage is built while the claim settles, so a kept claim goes straight to
recovery; a withdrawn claim's node is dropped unused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from protocols.membership import Claim, Member, Take, settle_seconds
from protocols.messages import NodeRecord, NodeState
from protocols.standby import (
    Standby,
    StandbyAction,
    StandbyPhase,
    StandbyRecord,
    Watch,
    Watched,
    Withdraw,
)
from swarmnode.dht import SwarmDHT
from swarmnode.node.liveness import answering
from swarmnode.node.planning import SwarmRead
from swarmnode.node.recovery import swarm_has_trained
from swarmnode.runspec import RunSpec
from swarmnode.standbys import publish_standby, read_standbys
from swarmnode.transport import Transport

logger = logging.getLogger(__name__)

WATCH_S = 0.25  # how often a standby pings the stages' nodes
SETTLE_S = 0.1  # the least a claim waits for rivals' claims to show (`membership.settle_seconds`)
PATIENCE_S = 2.0  # an outranked standby claims a stage still lost after this long

CLAIMS = (NodeState.JOINING, NodeState.RECOVERING)  # records of nodes that chose a stage, not serving it yet

T = TypeVar("T")


class Watcher:
    """A standby's view of the swarm: records read at most once a record period, pings every look."""

    def __init__(self, dht: SwarmDHT, spec: RunSpec, transport: Transport) -> None:
        self.dht = dht
        self.spec = spec
        self.transport = transport
        self.swarm_read = SwarmRead({})
        self.standbys: frozenset[str] = frozenset()
        self._read_at = -float("inf")

    async def look(self, fresh: bool) -> Watched:
        if fresh or time.monotonic() - self._read_at >= self.spec.record_period_s:
            self._read_at = time.monotonic()
            stages, standbys = await asyncio.gather(
                self.dht.read_swarm(self.spec.stages), read_standbys(self.dht)
            )
            self.swarm_read = SwarmRead(stages)
            self.standbys = frozenset(p.peer_id for p in standbys if p.record.taken is None)
        transformer = range(1, self.spec.stages + 1)
        answers = await asyncio.gather(
            *(answering(self.transport, self.swarm_read.online(k), k) for k in transformer)
        )
        alive = {k: set(peers) for k, peers in zip(transformer, answers, strict=True)}
        live = {  # the data stage, never taken, as its records say
            stage: tuple(
                Member(p.peer_id, p.record.state, p.expires_at, p.record.throughput)
                for p in self.swarm_read.stages.get(stage, ())
                if stage == 0 or p.peer_id in alive[stage] or p.record.state in CLAIMS
            )
            for stage in range(self.spec.stages + 1)
        }
        return Watched(live, self.standbys, swarm_has_trained(self.swarm_read), time.monotonic())


async def stand_by(
    dht: SwarmDHT,
    spec: RunSpec,
    site: str | None,
    stopping: asyncio.Event,
    prepare: Callable[[int], asyncio.Future[T]],
) -> tuple[int, asyncio.Future[T]] | None:
    """Stand by until a lost stage is taken: returns it and its node's build (`prepare(stage)`, started
    when the stage was claimed); None once `stopping` is set or the DHT died."""
    machine = Standby(
        me=dht.peer_id, stages=spec.stages, watch_s=WATCH_S, settle_s=SETTLE_S, patience_s=PATIENCE_S
    )
    transport = Transport(await dht.replicate_p2p())
    watcher = Watcher(dht, spec, transport)
    announcing = asyncio.create_task(_announce(dht, spec, site))
    building: asyncio.Future[T] | None = None
    settle_s = SETTLE_S  # after a claim: `settle_seconds` of its store
    logger.info("standing by for a lost stage of run %r", spec.run_id)
    try:
        actions: tuple[StandbyAction, ...] = machine.start()
        while True:
            following: tuple[StandbyAction, ...] = ()
            for action in actions:
                if isinstance(action, Take):
                    if building is None:
                        raise RuntimeError(f"stage {action.stage} taken without a claim")
                    return action.stage, building
                if isinstance(action, Claim):
                    logger.warning("stage %d lost: claiming it as a standby", action.stage)
                    claim = NodeRecord(NodeState.JOINING, action.stage, 0, 0, site=site)
                    began = time.monotonic()
                    await _quietly(
                        dht.publish(claim, spec.record_ttl_s), "claim"
                    )  # if lost: seen at the settle
                    settle_s = settle_seconds(SETTLE_S, time.monotonic() - began)
                    building = prepare(action.stage)
                elif isinstance(action, Withdraw):
                    logger.info(
                        "stage %d is served or claimed by another node: standing by again", action.stage
                    )
                    building = None
                    withdrawn = NodeRecord(NodeState.LEAVING, action.stage, 0, 0, site=site)
                    await _quietly(dht.publish(withdrawn, spec.record_ttl_s), "withdrawal")
                elif isinstance(action, Watch):
                    after_s = settle_s if machine.phase is StandbyPhase.CLAIMING else action.after_s
                    if await _stopped(stopping, after_s) or not dht.alive:
                        return None
                    try:
                        following = machine.handle(await watcher.look(action.fresh))
                    except TimeoutError:  # a slow DHT: look again (the machine waits for its look)
                        logger.warning("reading the swarm timed out; looking again")
                        following = (action,)
            actions = following
    finally:
        announcing.cancel()
        await asyncio.gather(announcing, return_exceptions=True)
        await transport.close()
        if machine.stage is not None and machine.phase is StandbyPhase.TAKEN:
            taken = StandbyRecord(taken=machine.stage, site=site)
            await _quietly(publish_standby(dht, taken, spec.record_ttl_s), "standby record")


async def _announce(dht: SwarmDHT, spec: RunSpec, site: str | None) -> None:
    """Republish this node's standby record every record period."""
    while True:
        await _quietly(publish_standby(dht, StandbyRecord(site=site), spec.record_ttl_s), "standby record")
        await asyncio.sleep(spec.record_period_s)


async def _quietly(publishing: Coroutine[Any, Any, bool], what: str) -> None:
    """Store a record; a DHT that does not answer in time is logged, not raised (the next look decides)."""
    try:
        await publishing
    except TimeoutError:
        logger.warning("the DHT did not store this node's %s in time", what)


async def _stopped(stopping: asyncio.Event, seconds: float) -> bool:
    """Wait `seconds`; whether `stopping` was set meanwhile (or before)."""
    try:
        await asyncio.wait_for(stopping.wait(), seconds)
    except TimeoutError:
        return False
    return True
