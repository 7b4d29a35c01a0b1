"""The encrypted direct path between real p2pd processes on loopback, each running with its own identity.

Calls travel sealed (the loopback plaintext is turned off, as between hosts); a caller or callee that cannot
sign as the peer id expected is refused and logged while the listener serves on; garbage, unknown tokens and
tampered records are refused; without a direct path calls fall back to libp2p. The record layer itself is
checked on a bare TCP connection: what crosses the wire is not the plaintext.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import msgpack
import pytest
import torch
import uvloop
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hivemind.p2p import P2P
from transport_harness import LIMITS, echo, new_p2p, p2pd_children, until

from swarmnode.identity import Identity
from swarmnode.transport import Transport, TransportConfig
from swarmnode.transport._channel import MAX_RECORD, TAG_BYTES, Channel
from swarmnode.transport._direct import GRANT_METHOD
from swarmnode.transport._handshake import SEALED_MAGIC, dial

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

SEALED = TransportConfig(
    limits=LIMITS, header_timeout=2.0, direct_host="127.0.0.1", plaintext_loopback=False, ban_seconds=0.0
)


@dataclass
class Pair:
    loop: asyncio.AbstractEventLoop
    server: Transport
    client: Transport
    server_p2p: P2P
    client_p2p: P2P
    server_identity: Identity
    client_identity: Identity

    def run(self, coro):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(coro)

    async def grant(self) -> tuple[int, bytes]:
        """A token the server grants the client's peer id, asked for over libp2p as a dialer does."""
        libp2p = Transport(self.client_p2p, TransportConfig(limits=LIMITS))
        try:
            meta, _ = await libp2p.call(self.server.peer_id, GRANT_METHOD, b"", [], 5.0)
        finally:
            await libp2p.close()
        port, token, plaintext = msgpack.unpackb(meta)
        assert plaintext is False
        return port, token


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    loop = uvloop.new_event_loop()
    before = p2pd_children()
    p2ps: list[P2P] = []
    transports: list[Transport] = []

    async def setup() -> Pair:
        server_identity, client_identity = Identity.generate(), Identity.generate()
        p2ps.append(await new_p2p(identity=server_identity))
        p2ps.append(await new_p2p(await p2ps[0].get_visible_maddrs(), identity=client_identity))
        server = Transport(p2ps[0], SEALED, identity=server_identity)
        client = Transport(p2ps[1], SEALED, identity=client_identity)
        transports.extend((server, client))
        server.register("echo", echo)
        await server.start()
        return Pair(loop, server, client, p2ps[0], p2ps[1], server_identity, client_identity)

    async def teardown() -> None:
        for transport in transports:
            await transport.close()
        for p2p in p2ps:
            await p2p.shutdown()

    try:
        yield loop.run_until_complete(setup())
    finally:
        loop.run_until_complete(teardown())
        loop.close()
        assert p2pd_children() <= before, "a p2pd outlived its P2P"


def _echoes(pair: Pair, caller: Transport) -> None:
    tensors = [torch.randn(3 << 20 >> 2), torch.arange(5), torch.randn(4, 6).t(), torch.zeros(0, 3)]
    meta, out = pair.run(caller.call(pair.server.peer_id, "echo", b"sealed", tensors, 10.0))
    assert meta == b"sealed"
    for sent, got in zip(tensors, out, strict=True):
        assert got.dtype == sent.dtype and torch.equal(got, sent)


def test_calls_travel_sealed_and_reuse_the_connection(pair: Pair) -> None:
    opened = pair.client.stats.streams_opened["encrypted"]
    for _ in range(3):
        _echoes(pair, pair.client)  # 3 MiB and more, over several records each way
    assert pair.client.stats.streams_opened["encrypted"] == opened + (1 if opened == 0 else 0)
    assert pair.client.stats.streams_opened["direct"] == 0


def test_a_caller_signing_with_another_key_is_refused_and_logged(
    pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    """The token was granted to the client's peer id over libp2p; a connection that presents it but signs
    with another key is refused, and the listener serves honest callers on."""

    async def impostor() -> None:
        port, token = await pair.grant()
        _, channel = await asyncio.get_running_loop().create_connection(Channel, "127.0.0.1", port)
        try:
            await dial(channel, Identity.generate(), pair.client_p2p.peer_id, pair.server.peer_id, token)
            await until(lambda: pair.server.stats.refused["identity"] > refused)
            with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
                await asyncio.wait_for(channel.read_raw(1), 5.0)  # closed by the server
        finally:
            channel.close()

    refused = pair.server.stats.refused["identity"]
    with caplog.at_level(logging.WARNING, logger="swarmnode.transport"):
        pair.run(impostor())
    assert pair.server.stats.refused["identity"] == refused + 1
    assert any("refused a direct connection" in r.getMessage() for r in caplog.records)
    _echoes(pair, pair.client)


def test_a_callee_that_cannot_sign_for_its_peer_id_is_refused(
    pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    """A listener answering with another key than its peer id's (a stolen port, a man in the middle): the
    caller refuses it, logs it, and calls over libp2p instead."""

    async def run() -> None:
        config = dataclasses.replace(SEALED, protocol="swarmnode.test.mitm")
        server = Transport(pair.server_p2p, config, identity=pair.server_identity)
        server._listener._identity = Identity.generate()  # type: ignore[union-attr]  # signs as someone else
        server.register("echo", echo)
        client = Transport(
            pair.client_p2p,
            dataclasses.replace(SEALED, protocol="swarmnode.test.mitm"),
            identity=pair.client_identity,
        )
        await server.start()
        try:
            meta, _ = await client.call(server.peer_id, "echo", b"over libp2p", [torch.ones(2)], 10.0)
            assert meta == b"over libp2p"
            assert client.stats.streams_opened["encrypted"] == 0
            assert client.stats.streams_opened["libp2p"] >= 1
        finally:
            await client.close()
            await server.close()

    with caplog.at_level(logging.WARNING, logger="swarmnode.transport"):
        with pytest.raises(ValueError, match="needs the daemon's identity"):
            Transport(pair.server_p2p, SEALED)
        pair.run(run())
    assert any("not signed by it" in r.getMessage() for r in caplog.records)


def test_garbage_unknown_tokens_and_tampered_records_are_refused(pair: Pair) -> None:
    stats = pair.server.stats

    async def send(data: bytes) -> bytes:
        """What the server answers to `data` before it hangs up."""
        port, _ = await pair.grant()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(data)
            async with asyncio.timeout(5):
                return await reader.read()
        finally:
            writer.close()

    async def tampered() -> None:
        port, token = await pair.grant()
        _, channel = await asyncio.get_running_loop().create_connection(Channel, "127.0.0.1", port)
        try:
            await dial(channel, pair.client_identity, pair.client_p2p.peer_id, pair.server.peer_id, token)
            channel.write_raw((32).to_bytes(4, "little") + os.urandom(32 + TAG_BYTES))  # forged record
            with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
                await asyncio.wait_for(channel.read_raw(1), 5.0)
        finally:
            channel.close()

    hellos, identity = stats.refused["direct_hello"], stats.refused["identity"]
    assert pair.run(send(os.urandom(200))) == b""  # garbage
    assert pair.run(send(SEALED_MAGIC + os.urandom(48))) == b""  # a hello with a token never granted
    assert pair.run(send(b"SWND" + os.urandom(16))) == b""  # a plaintext hello: loopback plaintext is off
    assert stats.refused["direct_hello"] == hellos + 3
    _, token = pair.run(pair.grant())
    answer = pair.run(send(SEALED_MAGIC + token + os.urandom(32 + 64)))  # a good token, a forged signature
    assert len(answer) == 32 + 64  # the server's half of the handshake, then it hangs up
    pair.run(tampered())
    assert stats.refused["identity"] == identity + 1
    _echoes(pair, pair.client)


def test_without_a_direct_path_calls_fall_back_to_libp2p(pair: Pair) -> None:
    async def run() -> None:
        # a callee whose direct port refuses connections (its listener closed), and a callee without one
        for config, closed in (
            (dataclasses.replace(SEALED, protocol="swarmnode.test.closed"), True),
            (dataclasses.replace(SEALED, protocol="swarmnode.test.none", direct_host=None), False),
        ):
            server = Transport(pair.server_p2p, config, identity=pair.server_identity)
            server.register("echo", echo)
            await server.start()
            if closed:
                server._listener.close()  # type: ignore[union-attr]
            client = Transport(pair.client_p2p, config, identity=pair.client_identity)
            try:
                meta, _ = await client.call(server.peer_id, "echo", b"fallback", [torch.ones(3)], 10.0)
                assert meta == b"fallback"
                assert client.stats.streams_opened["encrypted"] == 0
                assert client.stats.streams_opened["libp2p"] >= 1
            finally:
                await client.close()
                await server.close()
        # a caller without an identity cannot take an encrypted-only direct path: libp2p
        anonymous = Transport(pair.client_p2p, dataclasses.replace(SEALED, plaintext_loopback=True))
        try:
            meta, _ = await anonymous.call(pair.server.peer_id, "echo", b"anonymous", [], 10.0)
            assert meta == b"anonymous" and anonymous.stats.streams_opened["direct"] == 0
        finally:
            await anonymous.close()

    pair.run(run())


def test_a_transport_refuses_an_identity_not_its_p2ps(pair: Pair) -> None:
    with pytest.raises(ValueError, match="is not that of the p2p daemon"):
        Transport(pair.client_p2p, SEALED, identity=Identity.generate())


def test_records_hide_the_plaintext_and_carry_any_size() -> None:
    """A sealed stream over a bare TCP connection: the bytes on the wire are records (length, ciphertext,
    tag) in which the plaintext does not appear, and they open to the plaintext, split at MAX_RECORD."""

    async def run() -> None:
        received = bytearray()
        done = asyncio.Event()

        async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            received.extend(await reader.read())
            done.set()
            writer.close()

        server = await asyncio.start_server(record, "127.0.0.1", 0)
        key = AESGCM.generate_key(128)
        _, channel = await asyncio.get_running_loop().create_connection(
            Channel, "127.0.0.1", server.sockets[0].getsockname()[1]
        )
        _, writer = channel.open_streams(AESGCM(key), AESGCM(key))
        plaintext = b"activation" * ((MAX_RECORD + 5000) // 10)
        writer.write(plaintext)
        await writer.drain()
        writer.close()
        await asyncio.wait_for(done.wait(), 5.0)
        server.close()
        assert b"activation" * 4 not in received
        assert len(received) == len(plaintext) + 2 * (4 + TAG_BYTES)
        first = int.from_bytes(received[:4], "little")
        assert first == MAX_RECORD
        opened = AESGCM(key).decrypt(
            (0).to_bytes(12, "big"), bytes(received[4 : 4 + first + TAG_BYTES]), received[:4]
        )
        assert opened == plaintext[:MAX_RECORD]

    uvloop.run(run())
