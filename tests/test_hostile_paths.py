"""Forged returns: a microbatch's path is written by whoever sends it, so before nonces any peer could send a
data node the "returning" forward of a pending microbatch (the real one was then refused as a duplicate), or
a route notice that made the data node watch the wrong peers. Now the data node issues each microbatch a
random nonce that every hop carries, and takes a return only with it. A wrong shape is answered as stale:
the sender may be an honest relay of what it got, so it is never banned for it.

A real swarm (bootstrap, one stage node, one data node) and a real attacker peer on the run's DHT.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from hivemind.p2p import PeerID
from swarm_harness import LocalTestSwarm, NodeProcess, poll

from protocols.hops import Forward, Route
from protocols.manifest import TensorSpec
from protocols.messages import Error, ErrorCode, Rpc, decode, encode
from swarmnode.dht import SwarmDHT
from swarmnode.runspec import RunSpec
from swarmnode.transport import Transport

pytestmark = pytest.mark.integration

STEPS = 400  # far more than the attack needs: the swarm is stopped when the test ends
ATTACK_S = 8.0
TINY = RunSpec.for_preset("tiny")
TINY_DIM = 128


def _step(node: NodeProcess) -> int:
    steps = node.events("step")
    return steps[-1]["step"] if steps else 0


async def _forge(swarm: LocalTestSwarm, data: NodeProcess, data_id: str) -> list[tuple[str, str]]:
    """For ATTACK_S seconds, send the data node forged returns of the microbatches it may have in flight:
    forwards (right and wrong shapes) and route notices, each with a guessed nonce. Returns every answer as
    (message kind, outcome): an error code, or "ack"."""
    dht = SwarmDHT(swarm.run_id, swarm.peers_file.read_text().split(), client_mode=True)
    transport = Transport(await dht.replicate_p2p())
    me = dht.peer_id
    target = PeerID.from_base58(data_id)
    microbatch_rows = TINY.batch_size // TINY.microbatches
    answers = []
    try:
        deadline = time.monotonic() + ATTACK_S
        while time.monotonic() < deadline:
            now = _step(data)
            for iteration in (now, now + 1):
                for microbatch in range(TINY.microbatches):
                    path = (data_id, me, data_id)
                    for rows in (microbatch_rows, microbatch_rows + 1):
                        shape = (rows, TINY.seq_len, TINY_DIM)
                        spec = (TensorSpec("hidden", shape, "float32"),)
                        forward = Forward(
                            swarm.run_id, iteration, microbatch, path, 2, (0, 1, 0), (1, 1, 1), spec, nonce=7
                        )
                        reply, _ = await transport.call(
                            target, Rpc.FORWARD, encode(forward), [torch.zeros(shape)], timeout=10
                        )
                        answers.append(("forward", _outcome(reply)))
                    route = Route(swarm.run_id, iteration, microbatch, path, 1, nonce=7)
                    reply, _ = await transport.call(target, Rpc.ROUTE, encode(route), [], timeout=10)
                    answers.append(("route", _outcome(reply)))
    finally:
        await transport.close()
        await dht.close()
    return answers


async def _evaluations(swarm: LocalTestSwarm, stage_id: str) -> list[tuple[str, str]]:
    """Validation forwards to the stage node from a peer that is no data node, naming itself as their origin
    and a tick far ahead (a validation pass waits for the steps before its tick): each answer's code and
    reason ("ack", "" if served)."""
    dht = SwarmDHT(swarm.run_id, swarm.peers_file.read_text().split(), client_mode=True)
    transport = Transport(await dht.replicate_p2p())
    me, target = dht.peer_id, PeerID.from_base58(stage_id)
    shape = (TINY.batch_size // TINY.microbatches, TINY.seq_len, TINY_DIM)
    spec = (TensorSpec("hidden", shape, "float32"),)
    answers = []
    try:
        for microbatch in range(4):
            path = (me, stage_id, me)
            forward = Forward(
                swarm.run_id, 2**62, microbatch, path, 1, (0, 1, 0), (), spec, True, 7, weights_of=10**9
            )
            reply, _ = await transport.call(target, Rpc.FORWARD, encode(forward), [torch.zeros(shape)], 10)
            message = decode(reply)
            answers.append((str(message.code), message.reason) if isinstance(message, Error) else ("ack", ""))
    finally:
        await transport.close()
        await dht.close()
    return answers


def _outcome(reply: bytes) -> str:
    message = decode(reply)
    return str(message.code) if isinstance(message, Error) else "ack"


@pytest.mark.timeout(180)
def test_forged_returns_are_refused_as_stale_and_training_goes_on(swarm: LocalTestSwarm) -> None:
    swarm.bootstrap(steps=STEPS, stages=1)
    stage = swarm.join(1)
    stage_id = swarm.wait_online(stage)[0]["peer_id"]
    data = swarm.join(0)
    data_id = swarm.wait_online(data)[0]["peer_id"]
    poll(lambda: _step(data) >= 3, 90, "the data node's first steps", alive=data.check_alive)

    answers = asyncio.run(_forge(swarm, data, data_id))
    after_attack = _step(data)

    assert answers and {outcome for _, outcome in answers} == {str(ErrorCode.STALE)}, answers
    refused = data.err_path.read_text().count("without its nonce: refused")
    assert refused > 0, "no forged return reached a pending microbatch: the attack did not test the nonce"
    # validation passes are served to the run's data nodes only (a forged one would wait for a step there)
    evaluations = asyncio.run(_evaluations(swarm, stage_id))
    assert len(evaluations) == 4 and all(code == str(ErrorCode.STALE) for code, _ in evaluations), evaluations
    assert all(reason.endswith("is no online data node of this run") for _, reason in evaluations)
    poll(lambda: _step(data) >= after_attack + 3, 60, "training to go on", alive=data.check_alive)
    assert data.events("microbatch_lost") == []
    stage.check_alive()
