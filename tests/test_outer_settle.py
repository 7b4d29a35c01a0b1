"""NoLoCo's outer update lands after the same step in every run: two replicas' `OuterLoop`s over real p2pd
transports on loopback pair for an outer step, and the step that is due to apply it waits for the exchange
(`OuterLoop.settle`) instead of leaving it to whichever step comes after the exchange happens to end."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import torch
import uvloop
from hivemind.p2p import P2P, PeerID
from torch import Tensor, nn
from transport_harness import new_p2p

from protocols.messages import AveragingRequest, ErrorCode, Pong, Rpc, decode, encode
from protocols.noloco import OuterConfig, find_partner, pairing_seed
from swarmnode.node.averaging import APPLY_LAG, OuterLoop
from swarmnode.node.checks import Rejected
from swarmnode.node.compute import ComputeQueue, Priority
from swarmnode.node.liveness import answering
from swarmnode.node.state import manifest
from swarmnode.transport import Transport

INNER_STEPS = 4
RUN = "settle-test"


@asynccontextmanager
async def two_replicas() -> AsyncIterator[tuple[OuterLoop, OuterLoop]]:
    """Two replicas of stage 1 (different weights), each with its transport and compute queue."""
    p2ps: list[P2P] = []
    transports: list[Transport] = []
    queues: list[ComputeQueue] = []
    try:
        first = await new_p2p()
        p2ps.append(first)
        p2ps.append(await new_p2p(await first.get_visible_maddrs()))
        loops = []
        for seed, p2p in enumerate(p2ps):
            torch.manual_seed(seed)
            compute = ComputeQueue()
            queues.append(compute)
            compute.start()
            transport = Transport(p2p)
            transports.append(transport)
            outer = OuterLoop(
                nn.Linear(8, 8),
                OuterConfig(inner_steps=INNER_STEPS),
                RUN,
                1,
                p2p.peer_id.to_base58(),
                transport,
                compute,
                timeout_s=20.0,
            )
            transport.register(Rpc.AVERAGE, _serving(outer))
            transport.register(Rpc.PING, _pong)
            await transport.start()
            loops.append(outer)
        yield loops[0], loops[1]
    finally:
        for compute in queues:
            await compute.close()
        for transport in transports:
            await transport.close()
        for p2p in p2ps:
            await p2p.shutdown()


def _serving(outer: OuterLoop):  # type: ignore[no-untyped-def]
    async def on_average(peer: PeerID, meta: bytes, tensors: list[Tensor]) -> tuple[bytes, list[Tensor]]:
        reply, out = await outer.serve(peer.to_base58(), decode(meta, AveragingRequest), tensors)
        return encode(reply), out

    return on_average


async def _pong(peer: PeerID, meta: bytes, tensors: list[Tensor]) -> tuple[bytes, list[Tensor]]:
    return encode(Pong(1)), []


def _distance(a: OuterLoop, b: OuterLoop) -> float:
    return sum(
        float((pa - pb).detach().norm())
        for pa, pb in zip(a.module.parameters(), b.module.parameters(), strict=True)
    )


async def _scenario() -> None:
    async with two_replicas() as (a, b):
        replicas = [a.me, b.me]
        boundary = INNER_STEPS  # the clock after the step that reaches outer step 1's boundary
        before = _distance(a, b)
        for outer in (a, b):
            if outer.take_due(boundary - 1) is not None:
                raise AssertionError("no outer step is due before its boundary")
        rounds = []
        for outer in (a, b):
            if outer.take_due(boundary) != 1:
                raise AssertionError("outer step 1 is due at its boundary")
            rounds.append(asyncio.create_task(outer.run(1, replicas, asyncio.get_running_loop().time)))
        # a step before the one that applies it leaves it alone, without waiting for the exchange
        not_yet = await a.compute.submit(Priority.STEP, lambda: a.settle(boundary + APPLY_LAG - 1))
        assert not_yet is False and a.outer_step == 0
        # the step that reaches the lag waits for the exchange (queued right after the rounds copied their
        # weights, it runs while they exchange) and applies it
        due = boundary + APPLY_LAG
        steps = [o.compute.submit(Priority.STEP, lambda o=o: o.settle(due)) for o in (a, b)]
        applied = await asyncio.gather(*steps)
        assert applied == [True, True]
        assert (a.outer_step, b.outer_step) == (1, 1)
        await asyncio.gather(*rounds)
        assert _distance(a, b) < 0.5 * before  # they paired: the update pulled them together
        # nothing more to apply until the next outer step
        assert not a.settle(due + 1) and not a.idle_apply_due(due + 1)


def test_the_due_step_waits_for_the_exchange_and_applies_it() -> None:
    uvloop.run(asyncio.wait_for(_scenario(), 60))


async def _idle_scenario() -> None:
    async with two_replicas() as (a, _):
        a.take_due(INNER_STEPS)
        await a.run(1, [a.me], asyncio.get_running_loop().time)  # a lone replica: alone at once
        due = INNER_STEPS + APPLY_LAG
        # a replica with work applies it in its step at `due`; one without work applies it once the clock
        # has passed that step
        assert not a.idle_apply_due(due) and a.idle_apply_due(due + 1)
        assert await a.compute.submit(Priority.STEP, lambda: a.apply_pending(due + 1))
        assert a.outer_step == 1 and not a.idle_apply_due(due + 1)


def test_an_idle_replica_applies_once_the_clock_has_passed_the_due_step() -> None:
    uvloop.run(asyncio.wait_for(_idle_scenario(), 60))


async def _late_joiner_scenario() -> None:
    async with two_replicas() as (a, b):
        # `a` ran outer step 1 alone (the only replica at its boundary); `b` takes over a state at clock
        # INNER_STEPS + 1, whose last outer step is 0 (a copy of `a` before its update, or rebuilt weights)
        a.take_due(INNER_STEPS)
        await a.run(1, [a.me], asyncio.get_running_loop().time)
        b.resume_at(0, INNER_STEPS + 1)
        assert b.outer_step == 1 and b.take_due(INNER_STEPS + 1) is None  # no round it could pair in
        b.resume_at(3, INNER_STEPS + 1)
        assert b.outer_step == 3  # a state further on keeps its own count
        b.resume_at(1, INNER_STEPS + 1)
        # at the next boundary both run outer step 2, and pair
        clock = 2 * INNER_STEPS
        if a.take_due(clock) != 2 or b.take_due(clock) != 2:
            raise AssertionError("outer step 2 is due at its boundary for both")
        timer, before = asyncio.get_running_loop().time, _distance(a, b)
        await asyncio.gather(a.run(2, [a.me, b.me], timer), b.run(2, [a.me, b.me], timer))
        due = clock + APPLY_LAG
        applied = await asyncio.gather(
            *(o.compute.submit(Priority.STEP, lambda o=o: o.settle(due)) for o in (a, b))
        )
        assert applied == [True, True] and (a.outer_step, b.outer_step) == (2, 2)
        assert _distance(a, b) < 0.5 * before  # they paired


def test_a_replica_that_joins_after_a_boundary_owes_no_round_and_pairs_at_the_next() -> None:
    uvloop.run(asyncio.wait_for(_late_joiner_scenario(), 60))


async def _gone_replica_scenario() -> None:
    async with two_replicas() as (a, b):
        gone = await new_p2p()  # a third replica, whose record a view may still hold after it is gone
        gone_id = gone.peer_id.to_base58()
        await gone.shutdown()
        replicas = sorted([a.me, b.me, gone_id])
        # an outer step whose matching, drawn among all three, pairs the gone replica with `a` or `b`:
        # without asking, that one fails to reach it (or waits for it until the round times out) and steps
        # alone
        k = next(k for k in range(1, 100) if find_partner(gone_id, replicas, pairing_seed(RUN, 1, k)))
        timer, before = asyncio.get_running_loop().time, _distance(a, b)
        rounds = []
        for outer in (a, b):
            if outer.take_due(k * INNER_STEPS) != k:
                raise AssertionError(f"outer step {k} is due at its boundary")
            live = partial(answering, outer.transport, stage=1)
            rounds.append(outer.run(k, replicas, timer, live))
        await asyncio.gather(*rounds)
        due = k * INNER_STEPS + APPLY_LAG
        await asyncio.gather(*(o.compute.submit(Priority.STEP, lambda o=o: o.settle(due)) for o in (a, b)))
        assert _distance(a, b) < 0.5 * before  # they paired


def test_a_round_is_matched_among_the_replicas_that_answer() -> None:
    uvloop.run(asyncio.wait_for(_gone_replica_scenario(), 60))


async def _non_finite_scenario() -> None:
    async with two_replicas() as (a, b):
        before = [p.detach().clone() for p in b.module.parameters()]
        names = list(a.phi)
        for poison in (float("nan"), float("inf")):
            theta = {n: a.phi[n].clone() for n in names}
            theta[names[-1]].view(-1)[-1] = poison  # one value, in the last tensor sent
            request = AveragingRequest(RUN, 1, 1, manifest(a.phi), manifest(theta))
            tensors = [a.phi[n] for n in names] + [theta[n] for n in names]
            try:
                await b.serve(a.me, request, tensors)
            except Rejected as refused:
                assert refused.code == ErrorCode.MALFORMED and "not all finite" in str(refused), refused
            else:
                raise AssertionError(f"a {poison} in the tensors was served")
        after = list(b.module.parameters())
        assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))


def test_averaging_tensors_with_a_non_finite_value_are_refused_as_malformed() -> None:
    uvloop.run(asyncio.wait_for(_non_finite_scenario(), 60))
