"""A hop passed on by the router between real p2pd processes on loopback: what its next node receives.

The router builds each next hop from the message it received; every field that is not the hop's own (its
position, the path and stages as re-routed, the tensor manifest) must travel on unchanged, or a node further
down the path acts on a default: a validation pass that lost `weights_of` after its first hop measured
whatever weights the later stages had at the time.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from hivemind.p2p import PeerID
from transport_harness import Swarm

from protocols.hops import Forward
from protocols.manifest import TensorSpec
from protocols.messages import Ack, Rpc, decode, encode
from swarmnode.node.router import Router
from swarmnode.transport import Compression, Transport

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def received(transports: Swarm) -> list[Forward]:
    """The forwards the lenient server received (it serves Rpc.FORWARD for this module's tests)."""
    messages: list[Forward] = []

    async def forward(
        peer_id: PeerID, meta: bytes, tensors: list[torch.Tensor]
    ) -> tuple[bytes, list[torch.Tensor]]:
        message = decode(meta)
        if isinstance(message, Forward):
            messages.append(message)
        return encode(Ack()), []

    transports.lenient.register(Rpc.FORWARD, forward)
    return messages


def test_a_forward_arrives_with_every_field_it_was_sent_with(
    transports: Swarm, caller: Transport, received: list[Forward]
) -> None:
    me, stage = caller.peer_id.to_base58(), transports.lenient.peer_id.to_base58()
    router = Router(caller, me, lambda stage: [], 10.0, Compression.NONE, random.Random(0))
    hidden = torch.randn(2, 3, 4)
    for sent in (
        Forward("run", 2**62 + 3, 5, (me, stage, me), 0, (0, 1, 0), evaluate=True, nonce=77, weights_of=41),
        Forward(
            "run", 40, 1, (me, stage, me), 0, (0, 1, 0), (1, 2, 1), nonce=9, cohort=(me,), senders=(1, 1, 0)
        ),
    ):
        delivered = transports.run(router.forward(sent, hidden))

        spec = (TensorSpec("hidden", (2, 3, 4), "float32"),)
        visits = sent.visits or (0, 0, 0)
        assert delivered == received[-1] == replace(sent, hop=1, tensors=spec, visits=visits)
