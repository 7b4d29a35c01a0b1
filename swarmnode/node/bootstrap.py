"""The swarm's entry peer: a DHT node that publishes the run definition and trains nothing.

It is not a single point of failure once peers know each other: every node keeps the DHT alive, and any
node's multiaddr works as an initial peer for newcomers (the run definition stays on the DHT while the
bootstrap republishes it; a later bootstrap for the same run can take over).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

from swarmnode.dht import Reach, SwarmDHT
from swarmnode.node.events import emit
from swarmnode.node.metrics import DaemonMetrics
from swarmnode.node.reachability import ReachServer
from swarmnode.node.seed import SeedServer, SeedWeights
from swarmnode.runspec import RunSpec
from swarmnode.tokenizer_fetch import TokenizerServer
from swarmnode.transport import Transport, TransportConfig

logger = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "localhost", "::1")  # where the plain-TCP path is used, as `join` does
RUN_TTL_S = 60.0
REPUBLISH_S = 10.0


def write_peers_file(path: Path, maddrs: list[str]) -> None:
    """One multiaddr per line, written atomically so a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(f"{addr}\n" for addr in maddrs))
    os.replace(tmp, path)


async def run_bootstrap(
    spec: RunSpec,
    host: str,
    port: int,
    public: bool,
    peers_file: Path | None,
    identity: Path | None = None,
    seed: SeedWeights | None = None,
    metrics: tuple[str, int] | None = None,
    reach: Reach | None = None,
    tokenizer: Path | None = None,
) -> int:
    """Publish the run until SIGINT/SIGTERM (exit code 0), or until the DHT fails (1); the DHT is shut down
    on every way out, errors included. The bootstrap's key (kept in `identity`, if given) owns the run.
    With `seed` (the run starts from weights, `spec.init_digests`), it also serves them (`node.seed`);
    with `metrics` (host, port), Prometheus metrics of its version and role (`node.metrics`); with `reach`,
    its announced addresses and relay settings (`dht.Reach`). It answers joiners' reachability checks, relays
    streams to nodes behind NATs (`transport._relay`), and with `tokenizer` (the run's tokenizer.json),
    serves it to data nodes that lack it (`tokenizer_fetch`)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if metrics is not None:
        registry = DaemonMetrics("bootstrap")
        try:
            metrics_port = registry.serve(*metrics)
        except OSError as error:
            logger.error("cannot serve metrics on %s:%d: %s", *metrics, error.strerror or error)
            return 1
        emit("metrics", url=f"http://{metrics[0]}:{metrics_port}/metrics", port=metrics_port)
    dht = SwarmDHT(spec.run_id, (), host, port, public, identity_path=identity, reach=reach)
    transport: Transport | None = None
    try:
        await ReachServer().start(await dht.replicate_p2p())
        # started always: besides the seed and the tokenizer, it relays streams to volunteers behind NATs
        direct = host if host in LOOPBACK else None
        transport = Transport(await dht.replicate_p2p(), TransportConfig(direct_host=direct))
        if seed is not None:
            SeedServer(spec, seed).register(transport)
        if tokenizer is not None:
            TokenizerServer(spec.run_id, tokenizer).register(transport)
        await transport.start()
        await dht.publish_run(spec, RUN_TTL_S)
        maddrs = dht.visible_maddrs()
        for addr in maddrs:
            print(addr, flush=True)
        if peers_file is not None:
            try:
                write_peers_file(peers_file, maddrs)
            except OSError as error:
                logger.error("cannot write the peers file %s: %s", peers_file, error.strerror or error)
                return 1
        emit("bootstrap", run_id=spec.run_id, maddrs=maddrs, run=spec.to_dict())
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), REPUBLISH_S)
            except TimeoutError:
                if not dht.alive:
                    logger.error("the DHT's p2p daemon is gone; stopping")
                    return 1
                try:
                    await dht.publish_run(spec, RUN_TTL_S)
                except TimeoutError:
                    logger.warning(
                        "republishing the run definition timed out; retrying in %.0f s", REPUBLISH_S
                    )
        return 0
    finally:
        if transport is not None:
            await transport.close()
        await dht.close()
