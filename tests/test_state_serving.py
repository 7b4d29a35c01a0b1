"""StateServer's slots and snapshots, driven in memory: a real tiny stage, no network.

A slot is held from a request until the transport says its reply was written (`Reply.written`), one per
peer and `MAX_TRANSFERS` in all; replies share one snapshot until the state changes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
import torch
from state_donor import TinyDonor

from protocols.messages import ErrorCode, NodeState, decode
from protocols.transfers import StatePart, StateRequest, StateTransfer
from swarmnode.node.checks import Rejected
from swarmnode.node.serving import MAX_TRANSFERS, StateServer
from swarmnode.transport import Reply

BOTH = (StatePart.WEIGHTS, StatePart.OPTIMIZER)
PEERS = ("joiner-a", "joiner-b", "joiner-c")


def run(donor: TinyDonor, scenario: Callable[[StateServer], Awaitable[None]]) -> None:
    """`scenario(server)` on a fresh event loop, with the donor's compute queue running."""

    async def main() -> None:
        donor.compute.start()
        try:
            await scenario(StateServer(donor))
        finally:
            await donor.compute.close()

    asyncio.run(main())


def ask(
    server: StateServer, peer: str, parts: tuple[StatePart, ...] = BOTH, stage: int = 1
) -> Awaitable[Reply]:
    return server.serve(peer, StateRequest("unit", stage, parts))


async def refused(server: StateServer, peer: str, code: ErrorCode, **kwargs: object) -> str:
    with pytest.raises(Rejected) as caught:
        await ask(server, peer, **kwargs)  # type: ignore[arg-type]
    assert caught.value.code == code, caught.value.reason
    return caught.value.reason


def train_one_step(donor: TinyDonor) -> None:
    for param in donor.piece.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    donor.optimizer.step()


def test_one_slot_per_peer_and_two_in_all_each_held_until_its_reply_is_written() -> None:
    assert MAX_TRANSFERS == 2
    donor = TinyDonor.build(1, PEERS)

    async def scenario(server: StateServer) -> None:
        a = await ask(server, "joiner-a")
        assert server.serving == {"joiner-a"}  # prepared, not yet written: the slot is held
        assert "to this peer" in await refused(server, "joiner-a", ErrorCode.BUSY)
        b = await ask(server, "joiner-b")
        assert "2 state transfers" in await refused(server, "joiner-c", ErrorCode.BUSY)
        a.written(True)  # a's reply left: its slot frees, and a third peer is served
        c = await ask(server, "joiner-c")
        assert server.serving == {"joiner-b", "joiner-c"}
        b.written(False)  # b's stream failed mid-write: its slot frees all the same
        c.written(True)
        assert server.serving == frozenset()
        again = await ask(server, "joiner-a")  # a may ask again once its first transfer ended
        again.written(True)

    run(donor, scenario)


def test_a_second_request_of_a_peer_while_its_snapshot_is_taken_is_busy() -> None:
    donor = TinyDonor.build(1, PEERS)

    async def scenario(server: StateServer) -> None:
        first, second = await asyncio.gather(
            ask(server, "joiner-a"), ask(server, "joiner-a"), return_exceptions=True
        )
        assert isinstance(first, Reply), first  # the first waits for the compute thread, holding its slot
        assert isinstance(second, Rejected) and second.code == ErrorCode.BUSY, second
        first.written(True)
        assert server.serving == frozenset()

    run(donor, scenario)


def test_a_request_that_fails_releases_its_slot() -> None:
    # CheckFree+: a stage-1 node serves its copy of E to a data node that recovers; this one holds none yet
    donor = TinyDonor.build(1, (), checkfree_plus=True)
    donor.swarm_read = TinyDonor.build(0, ("data-joiner",)).swarm_read

    async def scenario(server: StateServer) -> None:
        for _ in range(MAX_TRANSFERS + 1):  # a leaked slot would make the last one "busy: in progress"
            reason = await refused(server, "data-joiner", ErrorCode.BUSY, parts=(StatePart.EMBEDDING_COPY,))
            assert "holds no embedding_copy" in reason
        assert server.serving == frozenset()

    run(donor, scenario)


def test_refusals_before_a_slot_take_none() -> None:
    donor = TinyDonor.build(1, PEERS)

    async def scenario(server: StateServer) -> None:
        assert "no record" in await refused(server, "stranger", ErrorCode.WRONG_STAGE)
        assert donor.reads == 1  # an unknown peer costs one fresh read of the DHT
        await refused(server, "joiner-a", ErrorCode.WRONG_STAGE, stage=2)
        donor.state = NodeState.RECOVERING
        await refused(server, "joiner-a", ErrorCode.BUSY)
        assert server.serving == frozenset()

    run(donor, scenario)


def test_replies_share_one_snapshot_until_the_state_changes(capsys: pytest.CaptureFixture[str]) -> None:
    donor = TinyDonor.build(1, PEERS)

    def sent(reply: Reply) -> dict[str, torch.Tensor]:
        header = decode(reply.meta, StateTransfer)
        return {spec.name: t for spec, t in zip(header.tensors, reply.tensors, strict=True)}

    async def scenario(server: StateServer) -> None:
        weights = await ask(server, "joiner-a", (StatePart.WEIGHTS,))
        both = await ask(server, "joiner-b")
        shared = sent(weights)
        # the weights cloned for a are b's too (the optimizer part was added to the same snapshot)
        assert all(sent(both)[name] is tensor for name, tensor in shared.items())
        for reply in (weights, both):
            reply.written(True)
        again = await ask(server, "joiner-a")
        assert all(sent(again)[name] is tensor for name, tensor in sent(both).items())
        again.written(True)
        await donor.compute.submit(0, lambda: train_one_step(donor))  # type: ignore[arg-type]
        fresh = await ask(server, "joiner-c")
        assert decode(fresh.meta, StateTransfer).step == 1
        changed = sent(fresh)
        assert all(changed[name] is not tensor for name, tensor in shared.items())
        assert any(not torch.equal(changed[name], tensor) for name, tensor in shared.items())
        assert any(name.endswith(".exp_avg") for name in changed)  # Adam moments exist after the step
        fresh.written(True)

    run(donor, scenario)
    snapshots = [line for line in capsys.readouterr().out.splitlines() if '"state_snapshot"' in line]
    assert len(snapshots) == 3, snapshots  # weights; the optimizer added; after the step, both again
