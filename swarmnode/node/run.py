"""Starting and stopping a daemon process: the DHT, the run definition, the stage, the node, signals."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from protocols.links import Network
from protocols.membership import Claim, ClaimAction, Looked, Member, StageClaim, Take, settle_seconds
from protocols.messages import NodeRecord, NodeState
from swarmnode.data import check_run_data, check_splits, load_corpus
from swarmnode.datasource import cache_dir
from swarmnode.dht import Reach, SwarmDHT, peer_ids_of
from swarmnode.malloc_tuning import stop_protobuf_trims
from swarmnode.node.context import NodeContext
from swarmnode.node.daemon import Node
from swarmnode.node.driver import DataNode
from swarmnode.node.events import emit, listen
from swarmnode.node.human_lines import PROGRESS_EVERY_STEPS
from swarmnode.node.liveness import answering
from swarmnode.node.metrics import DaemonMetrics
from swarmnode.node.planning import SwarmRead
from swarmnode.node.reachability import ReachServer, report_reachability
from swarmnode.node.stage import StageNode
from swarmnode.node.standby import stand_by
from swarmnode.precision import Precision
from swarmnode.runspec import RunSpec
from swarmnode.tokenizer_fetch import TokenizerServer, obtain_tokenizer
from swarmnode.transport import LinkEmulator, Transport

logger = logging.getLogger(__name__)

RUN_WAIT_S = 60.0
PROGRESS_LOOK_S = 1.0  # how often a stage node looks whether its step passed a `progress` multiple
DHT_CHECK_S = 1.0  # how often a daemon checks that its DHT (its thread and p2pd) still runs
CLAIM_SETTLE_S = 0.1  # the least a claim settles (`membership.settle_seconds`: more after a slow store)


class JoinRefused(Exception):
    """The daemon cannot serve as asked (a stage the run lacks, a metrics port taken, data too small for
    its shard): the volunteer's to fix, told in one line. Any other error is a fault, shown in full."""


@dataclass(frozen=True)
class JoinOptions:
    run_id: str
    stage: int | None  # None: auto
    initial_peers: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 0
    public: bool = False
    direct: bool = True
    threads: int | None = None
    shard: tuple[int, int] | None = None  # (index, count); None: all the data, in this node's own order
    tokenizer: Path | None = None
    dump_recovery: Path | None = None
    rebalance: bool = False
    identity: Path | None = None  # where this node's key is kept (None: a fresh key each start)
    run_owners: tuple[str, ...] = ()  # whose run definition to accept (empty: the initial peers')
    linger: bool = False  # a data node that finished the run stays online (serving its weights) until stopped
    metrics_port: int | None = None  # serve Prometheus metrics on this port (0: any free one); None: none
    metrics_host: str = "127.0.0.1"
    device: str = "auto"  # `precision.resolve_device`
    dtype: str | None = None  # this node's compute dtype; None: the run's
    network: Network | None = None  # emulated links (`--network`): sends to peers at other sites wait
    site: str | None = None  # this node's site in `network`, announced in its records
    reach: Reach = field(default_factory=Reach)  # announced addresses, relays (`--announce-maddrs`, ...)
    standby: bool = False  # hold no stage; take one that loses its last node (`node.standby`)


async def live_view(dht: SwarmDHT, spec: RunSpec) -> dict[int, tuple[Member, ...]]:
    """Every stage's nodes that are alive or about to be: online records whose peer answers a ping (a dead
    node's record outlives it), plus joining and recovering claims (short-lived records of nodes that have
    chosen the stage but do not serve yet)."""
    read = SwarmRead(await dht.read_swarm(spec.stages))
    transport = Transport(await dht.replicate_p2p())
    stages = range(spec.stages + 1)
    answers = await asyncio.gather(*(answering(transport, read.online(k), k) for k in stages))
    await transport.close()
    return {
        stage: tuple(
            Member(p.peer_id, p.record.state, p.expires_at, p.record.throughput)
            for p in read.stages.get(stage, ())
            if p.peer_id in answering_peers or p.record.state in (NodeState.JOINING, NodeState.RECOVERING)
        )
        for stage, answering_peers in zip(stages, map(set, answers), strict=True)
    }


async def claim_stage(dht: SwarmDHT, spec: RunSpec) -> int:
    """`--stage auto`: carry out `protocols.membership.StageClaim`'s actions (look at the live swarm, claim
    an empty stage, look again once the claim settled) until it takes a stage."""
    claim = StageClaim(me=dht.peer_id, stages=spec.stages, settle_s=CLAIM_SETTLE_S)
    actions = claim.start()
    stored_s = 0.0  # how long the last claim's store took
    while True:
        following: tuple[ClaimAction, ...] = ()
        for action in actions:
            if isinstance(action, Take):
                return action.stage
            if isinstance(action, Claim):
                began = time.monotonic()
                await dht.publish(NodeRecord(NodeState.JOINING, action.stage, 0, 0), spec.record_ttl_s)
                stored_s = time.monotonic() - began
                continue
            await asyncio.sleep(settle_seconds(action.after_s, stored_s))
            left = claim.left
            following = claim.handle(Looked(await live_view(dht, spec)))
            for stage in claim.left - left:
                logger.info("stage %d was claimed first by another joiner; choosing again", stage)
        actions = following


async def run_join(options: JoinOptions) -> int:
    """Run one daemon until its data node finishes the run, or until SIGINT/SIGTERM. Returns an exit code.

    With `options.rebalance`, a transformer-stage node whose stage has another live replica moves to a stage
    that has lost all its nodes (it leaves, then rejoins that stage and rebuilds it). With `options.standby`,
    the node first stands by (`node.standby.stand_by`) until it takes a lost stage.
    """
    if options.threads:
        torch.set_num_threads(options.threads)
    stop_protobuf_trims()  # a daemon keeps the heap its iterations take again (malloc_tuning)
    started = time.monotonic()
    dht = SwarmDHT(
        options.run_id,
        options.initial_peers,
        options.host,
        options.port,
        options.public,
        identity_path=options.identity,
        run_owners=options.run_owners,
        reach=options.reach,
    )
    metrics = _serve_metrics(options)
    emit("joining", phase="dht", seconds=round(time.monotonic() - started, 3))
    check: asyncio.Task[object] | None = None
    try:
        await ReachServer().start(await dht.replicate_p2p())
        check = asyncio.create_task(report_reachability(dht, peer_ids_of(options.initial_peers)))
        spec = await dht.wait_for_run(RUN_WAIT_S)
        links = LinkEmulator(options.network, options.site) if options.network and options.site else None
        building: asyncio.Future[Node] | None = None
        if options.standby:
            taken = await _stand_by(options, spec, dht, links, metrics)
            if taken is None:
                if dht.alive:
                    return 0
                _say_dht_died(dht)  # a standby has no node for `_watch_dht` to stop
                return 1
            stage, building = taken
        else:
            stage = await claim_stage(dht, spec) if options.stage is None else options.stage
        emit("joining", phase="stage", stage=stage, seconds=round(time.monotonic() - started, 3))
        if not 0 <= stage <= spec.stages:
            raise JoinRefused(
                f"stage {stage} does not exist: run {spec.run_id!r} has stages 0..{spec.stages}"
            )
        next_stage: int | None = stage
        while next_stage is not None:
            if next_stage == 0:  # the run's tokenizer: the node's own, cached, or fetched from a peer
                tokenizer = await obtain_tokenizer(spec, options.tokenizer, dht, cache_dir())
                options = replace(options, tokenizer=tokenizer)
            if building is None:
                building = asyncio.ensure_future(_build_node(options, spec, dht, next_stage, links, metrics))
            node = await _announce_building(spec, dht, next_stage, options.site, building)
            building = None
            if metrics is not None:
                metrics.attach(node)
            watchdog = asyncio.create_task(_watch_dht(dht, node))
            progress = asyncio.create_task(_report_progress(node)) if node.stage > 0 else None
            try:
                await _serve(node, options.linger, options.tokenizer)
            finally:
                watchdog.cancel()
                if progress is not None:
                    progress.cancel()
                await node.close()
                if metrics is not None:
                    metrics.attach(None)
            if not dht.alive:
                return 1
            next_stage = node.move_to
            if next_stage is not None:
                emit("moving", from_stage=node.stage, to_stage=next_stage)
        return 0
    finally:
        if check is not None:
            check.cancel()
        await dht.close()


async def _report_progress(node: Node) -> None:
    """A stage node's `progress` event each time its step passes a multiple of `PROGRESS_EVERY_STEPS`
    (looked at every `PROGRESS_LOOK_S`): what its volunteer sees of it (`join --human`)."""
    reported = node.optimizer.step_count // PROGRESS_EVERY_STEPS
    while True:
        await asyncio.sleep(PROGRESS_LOOK_S)
        step = node.optimizer.step_count
        if step // PROGRESS_EVERY_STEPS <= reported:
            continue
        reported = step // PROGRESS_EVERY_STEPS
        busy = node.compute.busy_seconds
        emit(
            "progress",
            stage=node.stage,
            step=step,
            outer_step=node.outer.outer_step,
            served=node.microbatches_served,
            lost=node.microbatches_lost,
            tokens_per_second=round(node.tokens_processed / busy, 1) if busy > 0 else 0.0,
        )


async def _stand_by(
    options: JoinOptions,
    spec: RunSpec,
    dht: SwarmDHT,
    links: LinkEmulator | None,
    metrics: DaemonMetrics | None,
) -> tuple[int, asyncio.Future[Node]] | None:
    """`--standby`: stand by until a lost stage is taken (its node built while the claim settled); None
    if stopped by SIGINT/SIGTERM meanwhile, or the DHT died."""
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)

    def prepare(stage: int) -> asyncio.Future[Node]:
        return asyncio.ensure_future(_build_node(options, spec, dht, stage, links, metrics))

    try:
        return await stand_by(dht, spec, options.site, stopping, prepare)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _serve_metrics(options: JoinOptions) -> DaemonMetrics | None:
    """`--metrics-port`: the daemon's metrics, served from now on, their address announced in an event."""
    if options.metrics_port is None:
        return None
    metrics = DaemonMetrics("node")
    try:
        port = metrics.serve(options.metrics_host, options.metrics_port)
    except OSError as error:
        where = f"{options.metrics_host}:{options.metrics_port}"
        raise JoinRefused(
            f"--metrics-port: cannot serve metrics on {where}: {error.strerror or error}"
        ) from None
    listen(metrics.on_event)
    emit("metrics", url=f"http://{options.metrics_host}:{port}/metrics", port=port)
    return metrics


async def _announce_building(
    spec: RunSpec, dht: SwarmDHT, stage: int, site: str | None, building: asyncio.Future[Node]
) -> Node:
    """Wait for the node's build while a `recovering` record for its stage stays on the DHT, republished
    every record period: building a large preset's stage, or a data node's corpus, takes longer than one
    record lives, and a `--stage auto` claim that lapsed would send the next joiner to the same stage. Not
    `joining`: a claim kept is no longer a claim that an older one beats (`membership.leaves_claim` orders
    `joining` claims by expiry, which a republished record would push forward)."""
    while True:
        try:
            await dht.publish(NodeRecord(NodeState.RECOVERING, stage, 0, 0, site=site), spec.record_ttl_s)
        except TimeoutError:
            logger.warning("the DHT did not store this node's record in time")
        done, _ = await asyncio.wait({building}, timeout=spec.record_period_s)
        if done:
            return building.result()


async def _build_node(
    options: JoinOptions,
    spec: RunSpec,
    dht: SwarmDHT,
    stage: int,
    links: LinkEmulator | None,
    metrics: DaemonMetrics | None,
) -> Node:
    """The node of `stage`, complete: its transport first, then the node itself in a thread (building a
    large preset's stage, or a data node's corpus, takes a while)."""
    direct = options.host if options.direct else None
    precision = Precision.parse(options.device, options.dtype or spec.dtype)
    context = await NodeContext.connect(spec, dht, direct, precision, links, metrics, options.dump_recovery)
    return await asyncio.to_thread(_construct, context, options, stage)


def _construct(context: NodeContext, options: JoinOptions, stage: int) -> Node:
    spec = context.spec
    if stage == 0:
        corpus = load_corpus(spec.source, options.tokenizer, spec.vocab_size)
        check_run_data(corpus, spec.source, spec.tokenizer_digest, spec.vocab_size)
        check_splits(corpus, spec.seq_len, str(spec.source))
        try:
            return DataNode(context, corpus, options.shard)
        except ValueError as error:  # the shard's tokens or the batch shape (`data.batches`)
            raise JoinRefused(f"{spec.source}: {error}") from None
    return StageNode(context, stage, rebalance=options.rebalance)


async def _watch_dht(dht: SwarmDHT, node: Node) -> None:
    """Stop `node` if its DHT dies (its p2pd exits): without it the node can neither publish its record nor
    see the swarm, and would live on as a zombie that peers route to until its record expires."""
    while dht.alive:
        await asyncio.sleep(DHT_CHECK_S)
    _say_dht_died(dht)
    node.stop()


def _say_dht_died(dht: SwarmDHT) -> None:
    logger.error(
        "the DHT's p2p daemon (pid %s) ended with exit code %s; this node can no longer publish its record. "
        "Stopping: start it again to rejoin the swarm",
        dht.p2pd_pid,
        dht.p2pd_exit_code,
    )


async def _serve(node: Node, linger: bool, tokenizer: Path | None = None) -> None:
    """Start `node` and run it until it finishes (data node; with `linger`, until stopped after that), is
    stopped by a signal, or decides to move. A data node serves its `tokenizer` to peers that lack it."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, node.stop)
    await node.start()
    if not isinstance(node, DataNode):
        await node.wait()
        return
    if tokenizer is not None:
        TokenizerServer(node.spec.run_id, tokenizer).register(node.transport)
    trainer = asyncio.create_task(node.train())
    stopper = asyncio.create_task(node.wait())
    await asyncio.wait({trainer, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if trainer.done():
        trainer.result()
        emit(
            "finished",
            step=node.optimizer.step_count,
            loss=node.last_loss,
            val_loss=node.val_loss,
            microbatches_lost=node.microbatches_lost,
            failures_seen=node.router.failures_seen,
            reroutes=node.router.reroutes,
            skips=node.router.skips,
            routes_reported=node.routes_reported,
        )
        if linger:
            await node.wait()
    else:
        trainer.cancel()
        await asyncio.gather(trainer, return_exceptions=True)
