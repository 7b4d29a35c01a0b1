"""The time of one NoLoCo exchange on the project's real transport, and an all-reduce tree built from it.

Two OS processes on loopback, each with its own p2pd, talk through `swarmnode.transport.Transport` (pooled
libp2p streams, the daemon's default). One exchange is what `swarmnode.node.averaging` does at an outer
step: an `AveragingRequest` carrying the initiator's phi and theta, answered by an accepting
`AveragingReply` carrying the partner's phi and theta (same sizes). A tree all-reduce over n replicas is not
run: it is computed from the measured exchanges as log2(n) rounds, each round an exchange of the same state
(the paper's 2 t log2(n) against 2 t), either at the median exchange time or, with stragglers, as the
slowest of the n/2 exchanges running at once in each round, drawn from the measured times.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import random
import statistics
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection

import torch
from hivemind.p2p import P2P, PeerID

from protocols.messages import AveragingReply, AveragingRequest, Rpc, decode, encode
from swarmnode.model_config import ModelConfig
from swarmnode.node.state import manifest
from swarmnode.pieces import build_piece
from swarmnode.transport import Transport, TransportConfig

HOST = ["/ip4/127.0.0.1/tcp/0"]
RUN_ID = "repro-noloco"


async def _reply(peer: PeerID, meta: bytes, tensors: list[torch.Tensor]) -> tuple[bytes, list[torch.Tensor]]:
    """The partner: accept, and send back a phi and theta of the same layout (the received ones)."""
    request = decode(meta, AveragingRequest)
    reply = AveragingReply(RUN_ID, request.stage, request.outer_step, True, "", request.phi, request.theta)
    return encode(reply), tensors


async def _serve(conn: Connection) -> None:
    p2p = await P2P.create(host_maddrs=HOST, nat_port_map=False)
    transport = Transport(p2p, TransportConfig())
    transport.register(Rpc.AVERAGE, _reply)
    await transport.start()
    conn.send([str(maddr) for maddr in await p2p.get_visible_maddrs()])
    await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until the client says stop
    await transport.close()
    await p2p.shutdown()


def _server_main(conn: Connection) -> None:
    torch.set_num_threads(1)
    asyncio.run(_serve(conn))


async def _client(
    maddrs: list[str], states: Sequence[dict[str, torch.Tensor]], repeats: int
) -> list[list[float]]:
    p2p = await P2P.create(initial_peers=maddrs, host_maddrs=HOST, nat_port_map=False)
    server = PeerID.from_base58(maddrs[0].rsplit("/p2p/", 1)[1])
    transport = Transport(p2p, TransportConfig())
    times: list[list[float]] = []
    try:
        for outer, state in enumerate(states, start=1):
            request = encode(AveragingRequest(RUN_ID, 1, outer, manifest(state), manifest(state)))
            tensors = list(state.values()) * 2  # phi, then theta
            mine = []
            for attempt in range(repeats + 1):  # the first opens the stream and faults the buffers in
                start = time.perf_counter()
                meta, received = await transport.call(server, Rpc.AVERAGE, request, tensors, timeout=300.0)
                elapsed = time.perf_counter() - start
                if not decode(meta, AveragingReply).accept or len(received) != len(tensors):
                    raise RuntimeError("the partner did not send its phi and theta back")
                if attempt:
                    mine.append(elapsed)
            times.append(mine)
    finally:
        await transport.close()
        await p2p.shutdown()
    return times


def measure_exchanges(states: Sequence[dict[str, torch.Tensor]], repeats: int) -> list[list[float]]:
    """Seconds of `repeats` exchanges of each state (phi and theta both ways), between two processes."""
    ctx = mp.get_context("fork")
    ours, theirs = ctx.Pipe()
    server = ctx.Process(target=_server_main, args=(theirs,), daemon=True)
    server.start()
    try:
        maddrs = ours.recv()
        return asyncio.run(_client(maddrs, states, repeats))
    finally:
        ours.send("stop")
        server.join(timeout=15)
        if server.is_alive():
            server.kill()  # by pid: the process this function started
            server.join()


def tree_allreduce_s(exchange_s: Sequence[float], n: int) -> float:
    """A tree all-reduce over `n` replicas at the median exchange time: log2(n) rounds."""
    return math.log2(n) * statistics.median(exchange_s)


def tree_allreduce_stragglers_s(
    exchange_s: Sequence[float], n: int, rng: random.Random, draws: int = 200
) -> float:
    """The same with every round as slow as the slowest of its n/2 simultaneous exchanges, each drawn from the
    measured times (mean over `draws` simulated all-reduces)."""
    rounds, pairs = math.ceil(math.log2(n)), max(1, n // 2)
    total = 0.0
    for _ in range(draws):
        total += sum(max(rng.choices(exchange_s, k=pairs)) for _ in range(rounds))
    return total / draws


def piece_state(config: ModelConfig, stage: int, n_stages: int) -> dict[str, torch.Tensor]:
    """The parameters of one stage's piece (`swarmnode.pieces.build_piece`): what a replica exchanges."""
    return {name: p.detach() for name, p in build_piece(config, stage, n_stages).named_parameters()}
