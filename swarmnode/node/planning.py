"""From DHT records to this data node's paths for one iteration, via the SkipPipe scheduler.

Every data node plans the whole swarm's iteration with the same scheduler (deterministic for a seed) from
its view of the DHT and takes its own microbatches: no round trip per microbatch, no planner to elect.
Views that differ for a moment cost some collisions, and a stage node may wait for a data node that another
data node's plan sent there and its own did not (`PlannedMicrobatch.senders`, `StepBook.take`). Stages with
no online node are left out of the view, so in a run that skips, paths skip past a lost stage while it is
being rebuilt; a run with skip ratio 0 waits for the rebuild instead (`RebuildWait`, bounded) and keeps every
path in stage order (the scheduler then only picks replicas); one that skips also lets SkipPipe reorder
stages. A run whose `planner` is
`random_skips` skips as SkipPipe's paper's baseline does instead: a random balanced choice of stages per
microbatch, in stage order, blind to collisions (the replicas then dealt out as in every plan).
CheckFree+ swaps are not the scheduler's choice: they are fixed by the iteration and the microbatch
(`protocols.checkfree.swaps_edge_pairs`), so every data node and replica sees both orders evenly, whatever
the timing.
A data node sends `microbatches` for every replica of the narrowest live stage (`pipeline_width`): each
replica trains on a batch of its own, as NoLoCo's replicas do, and a volunteer who joins a stage adds data to
every step instead of splitting a fixed batch into noisier updates.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import statistics
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from protocols import membership
from protocols.checkfree import swap_edge_pairs, swaps_edge_pairs
from protocols.errors import LocalProtocolError
from protocols.hops import MAX_COHORT
from protocols.messages import NodeState
from protocols.sightings import Sightings
from protocols.skippipe import (
    PathRules,
    SwarmView,
    full_pipeline_plan,
    mix_replicas,
    schedule,
    skips_without_collision_awareness,
)
from swarmnode.peer_record import PeerRecord
from swarmnode.runspec import RunSpec

logger = logging.getLogger(__name__)

REBUILD_WAIT_S = 180.0  # how long a data node of a run that skips nothing waits for a lost stage's rebuild

LOOPBACK_LINK_S = 0.002  # one activation hop on loopback, where no node measured the link (`link_costs`)
DEFAULT_FORWARD_S = 0.05
COST_GRAIN = 1.1  # plans cost hops and compute in steps of 10% (`quantised`)


@dataclass(frozen=True)
class SwarmRead:
    """The swarm as last read from the DHT: live records per stage."""

    stages: Mapping[int, Sequence[PeerRecord]]

    def online(self, stage: int) -> list[str]:
        return [p.peer_id for p in self.stages.get(stage, ()) if p.record.state == NodeState.ONLINE]

    def clock(self) -> int:
        """The swarm clock as the records show it: the furthest step of an online data node."""
        return max(
            (p.record.step for p in self.stages.get(0, ()) if p.record.state == NodeState.ONLINE), default=0
        )

    def without(self, peers: set[str]) -> SwarmRead:
        """This view less `peers` (suspected dead since the records were read)."""
        if not peers:
            return self
        return SwarmRead({k: [p for p in ps if p.peer_id not in peers] for k, ps in self.stages.items()})

    def record(self, peer_id: str) -> PeerRecord | None:
        for peers in self.stages.values():
            for peer in peers:
                if peer.peer_id == peer_id:
                    return peer
        return None

    def records(self, peer_id: str) -> list[PeerRecord]:
        """Every record of `peer_id`: a node that moved to another stage has one under each until the old
        one expires."""
        return [peer for peers in self.stages.values() for peer in peers if peer.peer_id == peer_id]


class RememberedView:
    """A data node's view to plan with: the latest read of the DHT, plus the peers that a recent read showed
    online and this one lacks (`protocols.sightings`: a live stage's records can vanish from one read on a
    loaded machine), each with its last record."""

    def __init__(self, grace_s: float) -> None:
        self._sightings = Sightings(grace_s)
        self._records: dict[tuple[str, int], PeerRecord] = {}
        self._last_read: SwarmRead | None = None

    def observe(self, read: SwarmRead, now: float) -> None:
        """A read of the DHT, made at `now` (a read already seen renews no sighting). The node observes every
        read it makes, not only those a plan looks at: a data node plans every few seconds and reads every
        second, and a replica shown by the reads between two plans, missing from the one a plan saw, was
        left out of its first step (one pipeline's microbatches instead of two)."""
        if read is self._last_read:
            return
        self._last_read = read
        sightings = [
            (peer.peer_id, stage, peer.record.state == NodeState.ONLINE)
            for stage, peers in read.stages.items()
            for peer in peers
        ]
        self._sightings.observe(sightings, now)
        for stage, peers in read.stages.items():
            for peer in peers:
                if peer.record.state == NodeState.ONLINE:
                    self._records[(peer.peer_id, stage)] = peer

    def update(self, latest: SwarmRead, now: float, suspects: Collection[str] = ()) -> SwarmRead:
        """The view at `now`; `latest` is the latest read (`observe`d if new). Peers in `suspects` (calls to
        them failed) that the latest read lacks are forgotten."""
        self.observe(latest, now)
        in_read = {peer.peer_id for peers in latest.stages.values() for peer in peers}
        self._sightings.forget(peer for peer in suspects if peer not in in_read)
        present = self._sightings.present(now)
        self._records = {key: record for key, record in self._records.items() if key in present}
        stages = {stage: list(peers) for stage, peers in latest.stages.items()}
        for (peer_id, stage), record in sorted(self._records.items()):
            if all(peer.peer_id != peer_id for peer in stages.get(stage, ())):
                stages.setdefault(stage, []).append(record)
        return SwarmRead(stages)


@dataclass(frozen=True)
class PlannedMicrobatch:
    microbatch: int
    path: tuple[str, ...]  # peer ids, starting and ending at this data node
    stages: tuple[int, ...]  # the stage each hop serves (0 at both ends)
    visits: tuple[int, ...]  # how many of this iteration's microbatches the plan sends through each hop
    cohort: tuple[str, ...] = ()  # the iteration's data nodes, sorted (empty: more than a forward names)
    senders: tuple[int, ...] = ()  # per hop, which of them the plan sends through its node (bit j: cohort[j])


def skip_ratio_of_live(skip_ratio: float, stages: int, live: int) -> float:
    """The skip ratio over the `live` transformer stages that keeps the run's path length: a path visits
    as many stages as the run's `skip_ratio` over all `stages` says, the lost ones counting as skipped, so
    skipping goes on while a stage is rebuilt (and stops only when fewer stages live than a path visits)."""
    if not 1 <= live <= stages:
        raise ValueError(f"live stages must lie in 1..{stages}, got {live}")
    visited = min(live, max(1, stages - round(skip_ratio * stages)))
    return (live - visited) / live


def plan_iteration(
    read: SwarmRead, me: str, spec: RunSpec, iteration: int, tokens_per_microbatch: int
) -> list[PlannedMicrobatch]:
    """This data node's microbatch paths for `iteration`; empty if no transformer stage is online."""
    data_nodes = sorted({*read.online(0), me})
    alive = [k for k in range(1, spec.stages + 1) if read.online(k)]
    if not alive:
        return []
    per_data_node = spec.microbatches * pipeline_width(read, alive, spec.max_pipelines)
    view_stages: list[list[int]] = []
    peers: list[str] = []
    forward_s: list[float] = []
    for stage in (0, *alive):
        members = data_nodes if stage == 0 else sorted(read.online(stage))
        view_stages.append(list(range(len(peers), len(peers) + len(members))))
        peers.extend(members)
        forward_s.extend(stage_forward_seconds([read.record(p) for p in members], tokens_per_microbatch))
    view = SwarmView.build(view_stages, forward_s, link_costs(read, peers))
    skipping = spec.skip_ratio > 0
    rules = PathRules(
        microbatches_per_data_node=per_data_node,
        skip_ratio=skip_ratio_of_live(spec.skip_ratio, spec.stages, len(alive)),
        # a run that skips nothing keeps every path in stage order: SkipPipe's reorderings are part of
        # opting in to its paths (they cost quality at small scale; see docs/design.md)
        max_swaps=PathRules.max_swaps if skipping else 0,
        memory=spec.node_memory,
    )
    seed = spec.seed * 1_000_003 + iteration
    try:
        if spec.planner == "random_skips" and skipping:
            plan = skips_without_collision_awareness(view, rules, seed)
        else:
            plan = schedule(view, rules, seed=seed, restarts=2, rounds=60)
    except LocalProtocolError:
        plan = full_pipeline_plan(view, rules)
    paths = mix_replicas(plan.paths, view, random.Random(seed))
    if logger.isEnabledFor(logging.DEBUG):
        hops = itertools.pairwise(view_stages)
        logger.debug(
            "iteration %d: forward s %s; links s %s; paths %s",
            iteration,
            [f"{peers[n][-6:]}={s:.3g}" for n, s in enumerate(forward_s)],
            [
                f"{peers[a][-6:]}>{peers[b][-6:]}={view.link_s[a][b]:.3g}"
                for here, there in hops
                for a in here
                for b in there
            ],
            [[peers[n][-6:] for n in path[1:-1]] for _, path in sorted(paths.items())],
        )

    mine = data_nodes.index(me)
    first = mine * per_data_node
    ids = range(first, first + per_data_node)
    visits: dict[int, int] = {}
    for mb in ids:
        for node in set(paths[mb][1:-1]):
            visits[node] = visits.get(node, 0) + 1
    named = len(data_nodes) <= MAX_COHORT
    senders: dict[int, int] = {}  # node -> the data nodes (bits) whose paths visit it: whom it waits for
    for path in paths.values() if named else ():
        for node in path[1:-1]:  # a path starts at its data node, view node path[0] = data_nodes[path[0]]
            senders[node] = senders.get(node, 0) | 1 << path[0]
    stage_ids = (0, *alive)
    planned = []
    for mb in ids:
        path = paths[mb]
        hops = path[1:-1]
        if spec.checkfree_plus and spec.edge_swaps and swaps_edge_pairs(spec.stages, iteration, mb):
            order = swap_edge_pairs(tuple(stage_ids[view.stage_of[node]] for node in hops), spec.stages)
            path = (path[0], *(hops[i] for i in order), path[-1])
        planned.append(
            PlannedMicrobatch(
                microbatch=mb - first,
                path=tuple(peers[node] for node in path),
                stages=tuple(stage_ids[view.stage_of[node]] for node in path),
                visits=tuple(
                    visits.get(node, 0) if 0 < i < len(path) - 1 else 1 for i, node in enumerate(path)
                ),
                cohort=tuple(data_nodes) if named else (),
                senders=tuple(senders[node] if 0 < i < len(path) - 1 else 0 for i, node in enumerate(path))
                if named
                else (),
            )
        )
    return planned


def pipeline_width(read: SwarmRead, stages: Collection[int], most: int) -> int:
    """How many pipelines the swarm runs side by side: the online replicas of the narrowest of `stages`, at
    least 1 and at most `most`. Each data node sends the run's `microbatches` per pipeline every iteration, so
    every replica of the narrowest stage gets about a full batch of each data node's (wider stages, or more
    replicas than `most`: less)."""
    return max(1, min(most, min((len(read.online(k)) for k in stages), default=1)))


def not_ready_to_start(read: SwarmRead, me: str, spec: RunSpec) -> list[str]:
    """What a fresh swarm still lacks before data node `me` trains: nodes of each stage short of the run's
    `min_replicas`, and data nodes short of its `min_data_nodes` (empty: start)."""
    lacking = []
    for k in range(1, spec.stages + 1):
        short = spec.min_replicas - len(read.online(k))
        if short > 0:
            lacking.append(f"stage {k}" if short == spec.min_replicas else f"{short} more of stage {k}")
    short = spec.min_data_nodes - len({*read.online(0), me})
    return lacking + ([f"{short} more data node{'s' if short > 1 else ''}"] if short > 0 else [])


def lost_stages(read: SwarmRead, spec: RunSpec) -> list[int]:
    """The stages this run's data nodes wait for, as `read` shows the swarm
    (`membership.stages_to_wait_for`)."""
    online = [k for k in range(1, spec.stages + 1) if read.online(k)]
    return membership.stages_to_wait_for(online, spec.stages, spec.skip_ratio)


def rebuild_waits(wait: membership.RebuildWait, lost: Sequence[int], now: float) -> bool:
    """`wait`'s decision for the `lost` stages at `now`, logged when a wait begins and when it ends."""
    update = wait.update(lost, now)
    if update.began:
        names = ", ".join(f"stage {k}" for k in lost)
        logger.info("%s has no online node: waiting up to %.0f s for a rebuild", names, wait.limit_s)
    if update.ended_after_s is not None:
        logger.info("every stage is online again after %.1f s: training", update.ended_after_s)
    return update.waits


def link_costs(read: SwarmRead, peers: Sequence[str]) -> Callable[[int, int], float]:
    """The seconds of a hop from `peers[a]` to `peers[b]`: what a measured (its record's `links`), else what
    b measured the other way, and never less than `LOOPBACK_LINK_S` (the cost of an unmeasured link), so
    that replicas on links alike are costed alike, whatever the noise in their measurements."""
    measured: dict[tuple[str, str], float] = {}
    for peer in peers:
        record = read.record(peer)
        for link in record.record.links if record is not None else ():
            measured[(peer, link.peer)] = link.seconds

    def cost(a: int, b: int) -> float:
        there, back = measured.get((peers[a], peers[b])), measured.get((peers[b], peers[a]))
        known = there if there is not None else back
        if known is None or known <= LOOPBACK_LINK_S:  # unmeasured, or timed at 0 s by a coarse clock
            return LOOPBACK_LINK_S
        return max(quantised(known), LOOPBACK_LINK_S)

    return cost


def quantised(seconds: float) -> float:
    """`seconds` (> 0) rounded to a power of `COST_GRAIN`. Data nodes plan one iteration apart, each from its
    own read of the records, whose measured costs drift between reads; the scheduler then often chose other
    paths, and a stage node waited for a data node that another's plan sent there and its own did not
    (`PlannedMicrobatch.senders`): about a second each time on the emulated WAN. Rounded, reads a moment apart
    give one plan, except when a cost crosses a step."""
    return COST_GRAIN ** round(math.log(seconds, COST_GRAIN))


def stage_forward_seconds(members: Sequence[PeerRecord | None], tokens: int) -> list[float]:
    """Each member's seconds for a microbatch of `tokens`, from the throughput its record announces. A
    member not yet measured (throughput 0: it has served too few microbatches to tell) costs what its
    stage's measured members cost (their median), else `DEFAULT_FORWARD_S`: costed apart, a replica just
    measured and its unmeasured partner were often more than `EVEN_WITHIN` apart, and the first ticks'
    deal of microbatches between replicas, and with it the model, depended on which measured first."""
    rates = [m.record.throughput if m is not None else 0.0 for m in members]
    measured = [quantised(tokens / rate) for rate in rates if rate > 0]
    unknown = statistics.median(measured) if measured else DEFAULT_FORWARD_S
    return [quantised(tokens / rate) if rate > 0 else unknown for rate in rates]
