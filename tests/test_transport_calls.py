"""The tensor transport between real p2pd processes on loopback, when calls succeed.

Round trips of every dtype, FLOAT16 on the wire, concurrent calls and stream reuse, the direct TCP path and
its libp2p fallback, and arguments refused before anything is sent.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto.runtime_pb2 import CompressionType
from transport_harness import LIBP2P, Swarm, call, echo

from swarmnode.transport import Compression, Transport, TransportConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def test_round_trip_small_and_large(transports: Swarm, caller: Transport) -> None:
    tensors = [
        torch.randn(3, 5),
        torch.randn(6 << 20 >> 2),  # 6 MiB: over hivemind's 4 MiB unary cap
        torch.randn(2, 3).to(torch.bfloat16),
        torch.randn(7).half(),
        torch.arange(10),
        torch.arange(4, dtype=torch.int32).reshape(2, 2),
        torch.tensor(3.5),
        torch.zeros(0, 4),
        torch.randn(4, 6).t(),  # not contiguous
    ]
    meta, out = call(transports, caller, "echo", b"\x00meta", tensors)
    assert meta == b"\x00meta"
    assert len(out) == len(tensors)
    for sent, got in zip(tensors, out, strict=True):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got, sent)
    out[1].add_(1.0)  # received tensors are writable and own their memory


def test_float16_on_the_wire_matches_hivemind(transports: Swarm, caller: Transport) -> None:
    x = torch.randn(5 << 20 >> 2) * 1000
    x[:3] = torch.tensor([1e9, -1e9, float("inf")])
    ints = torch.arange(6)
    _, (got, got_ints) = call(transports, caller, "echo", b"", [x, ints], compression=Compression.FLOAT16)
    hivemind = deserialize_torch_tensor(serialize_torch_tensor(x, CompressionType.FLOAT16))
    assert got.dtype == torch.float32 and torch.equal(got, hivemind)
    assert torch.equal(got_ints, ints)


def test_several_methods_and_concurrent_calls(transports: Swarm, caller: Transport) -> None:
    pairs = [(torch.full((1000,), float(i)), torch.full((1000,), 2.0)) for i in range(24)]

    async def one(i: int) -> tuple[bytes, list[torch.Tensor]]:
        method = "add" if i % 2 else "mul"
        return await caller.call(transports.server.peer_id, method, b"", list(pairs[i]), 10.0)

    async def all_of_them() -> list[tuple[bytes, list[torch.Tensor]]]:
        return await asyncio.gather(*(one(i) for i in range(len(pairs))))

    results = transports.run(all_of_them())
    for i, (meta, (out,)) in enumerate(results):
        a, b = pairs[i]
        assert meta == (b"sum" if i % 2 else b"product")
        assert torch.equal(out, a + b if i % 2 else a * b)
    opened = sum(caller.stats.streams_opened.values())
    for i in range(5):  # one at a time: an idle stream is reused every time
        assert transports.run(one(i))[0] in (b"sum", b"product")
    assert sum(caller.stats.streams_opened.values()) == opened


def test_direct_path_is_used_and_bound_to_the_caller(transports: Swarm) -> None:
    seen = []

    async def whoami(
        peer_id: PeerID, meta: bytes, tensors: list[torch.Tensor]
    ) -> tuple[bytes, list[torch.Tensor]]:
        seen.append(peer_id)
        return b"", []

    transports.server.register("whoami", whoami)
    call(transports, transports.direct, "whoami", b"", [])
    call(transports, transports.libp2p, "whoami", b"", [])
    assert seen == [transports.direct.peer_id, transports.libp2p.peer_id]
    assert transports.direct.stats.streams_opened["direct"] >= 1
    assert transports.libp2p.stats.streams_opened["direct"] == 0


def test_direct_caller_falls_back_to_libp2p(transports: Swarm) -> None:
    async def scenario() -> None:
        plain_p2p = await transports.spawn()
        plain = Transport(plain_p2p, LIBP2P)  # serves over libp2p only
        plain.register("echo", echo)
        await plain.start()
        try:
            meta, _ = await transports.direct.call(plain.peer_id, "echo", b"hello", [], 10.0)
            assert meta == b"hello"
            assert (
                plain.stats.errors_returned["unknown_method"] == 1
            )  # the direct-path grant it could not give
        finally:
            await plain.close()

    transports.run(scenario())


def test_arguments_that_cannot_travel_fail_locally(transports: Swarm) -> None:
    peer = transports.server.peer_id
    with pytest.raises(TypeError, match="float64"):
        transports.run(transports.libp2p.call(peer, "echo", b"", [torch.zeros(2, dtype=torch.float64)], 1.0))
    with pytest.raises(TypeError, match="meta"):
        transports.run(transports.libp2p.call(peer, "echo", "text", [], 1.0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_message_bytes"):
        transports.run(transports.libp2p.call(peer, "echo", b"", [torch.zeros(17 << 20)], 1.0))
    with pytest.raises(ValueError, match="reserved"):
        transports.server.register("_direct", echo)


def test_config_is_checked() -> None:
    with pytest.raises(ValueError):
        TransportConfig(direct_host="localhost")  # a name may resolve to several addresses
    with pytest.raises(ValueError):
        TransportConfig(header_timeout=0)
