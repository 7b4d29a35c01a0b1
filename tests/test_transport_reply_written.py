"""A handler's `Reply.written` over real p2pd: a state transfer's slot is held until its reply is written.

A real tiny stage's StateServer (`state_donor.TinyDonor`, one Adam step taken so that its reply is about
10 MB, far more than the streams buffer) serves "state" on the harness's server p2pd. Two callers ask and read
only the head of their replies; while they stall, a third peer is refused as busy (two transfers in all) and
so is a second request of a stalled one (one per peer). One reader then reads its reply to the end, the other
never does: each slot frees when its write ends, by completion or at the request's deadline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch
from hivemind.p2p import P2P
from state_donor import TinyDonor
from transport_harness import LIBP2P, LIMITS, Swarm, open_raw, until

from protocols.messages import Error, ErrorCode, decode, encode
from protocols.transfers import StatePart, StateRequest, StateTransfer
from swarmnode.node.checks import Rejected
from swarmnode.node.serving import StateServer
from swarmnode.transport import Reply, Transport
from swarmnode.transport._framing import PREFIX, Kind, encode_request, parse_prefix

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

STALL_TIMEOUT_S = 3.0  # the never-reading caller's request timeout: its write is cut off after this
PARTS = (StatePart.WEIGHTS, StatePart.OPTIMIZER)
CONFIG = dataclasses.replace(LIBP2P, protocol="swarmnode.test.state")  # the harness server has the default


def request(timeout: float) -> bytes:
    meta = encode(StateRequest("unit", 1, PARTS))
    return b"".join(bytes(part) for part in encode_request("state", timeout, 0, meta, [], 0))


async def stalled_reader(
    p2p: P2P, server: Transport, timeout: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int]:
    """Ask for the state on a raw stream and read only the reply's prefix; returns the stream and the bytes
    left of the reply."""
    reader, writer = await open_raw(p2p, server)
    writer.write(request(timeout))
    await writer.drain()
    async with asyncio.timeout(30):
        kind, head_len, body_len = parse_prefix(await reader.readexactly(PREFIX.size), LIMITS)
    assert kind is Kind.RESPONSE and body_len > 8 << 20
    return reader, writer, head_len + body_len


async def ask(client: Transport, server: Transport) -> str:
    """One state request through the transport: "ok", or the error code it got."""
    meta, _ = await client.call(server.peer_id, "state", encode(StateRequest("unit", 1, PARTS)), [], 30.0)
    answer = decode(meta)
    if isinstance(answer, Error):
        return str(answer.code)
    assert isinstance(answer, StateTransfer)
    return "ok"


def test_a_slot_is_held_until_the_reply_is_written_or_its_write_times_out(transports: Swarm) -> None:
    p2ps = transports.p2ps  # 0 serves; 1 and 2 stall; 3 asks as a third peer
    donor = TinyDonor.build(1, tuple(str(p2p.peer_id) for p2p in p2ps[1:]))
    for param in donor.piece.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    donor.optimizer.step()

    async def scenario() -> None:
        states = StateServer(donor)

        async def handler(peer, meta: bytes, tensors: list[torch.Tensor]) -> tuple[bytes, list] | Reply:  # type: ignore[no-untyped-def]
            try:
                return await states.serve(str(peer), decode(meta, StateRequest))
            except Rejected as rejected:
                return encode(Error(rejected.code, rejected.reason)), []

        server = Transport(p2ps[0], CONFIG)
        server.register("state", handler)
        first_caller, third = Transport(p2ps[1], CONFIG), Transport(p2ps[3], CONFIG)
        donor.compute.start()
        try:
            await server.start()
            finishing, first_writer, left = await stalled_reader(p2ps[1], server, timeout=30.0)
            _, stalled_writer, _ = await stalled_reader(p2ps[2], server, timeout=STALL_TIMEOUT_S)
            asked = time.monotonic()
            assert states.serving == {str(p2ps[1].peer_id), str(p2ps[2].peer_id)}
            assert await ask(third, server) == ErrorCode.BUSY  # two transfers in all
            assert await ask(first_caller, server) == ErrorCode.BUSY  # one per peer

            await finishing.readexactly(left)  # the first reader takes its reply to the end
            await until(lambda: str(p2ps[1].peer_id) not in states.serving)
            assert str(p2ps[2].peer_id) in states.serving  # the stalled write still holds its slot
            assert server.stats.dropped["stalled"] == 0
            assert await ask(third, server) == "ok"

            await until(lambda: not states.serving, timeout=STALL_TIMEOUT_S + 10)  # cut at its deadline
            assert time.monotonic() - asked > STALL_TIMEOUT_S - 1.0
            assert server.stats.dropped["stalled"] == 1
            assert await ask(first_caller, server) == "ok"
            for writer in (first_writer, stalled_writer):
                writer.close()
        finally:
            for transport in (first_caller, third, server):
                await transport.close()
            await donor.compute.close()

    transports.run(scenario())
