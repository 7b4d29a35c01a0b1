"""Bytes of a direct connection go straight into the buffer a reader waits with (`DirectReader.readinto`).

A `Channel` on a real loopback TCP connection is fed as the event loop feeds it (`get_buffer`, then
`buffer_updated`): sealed records open in the waiting buffer, the head of a record that straddles its end
too, and what is left waits in the reader, in order; plaintext is received into the waiting buffer itself.
Then whole frames, sealed and not, cross real connections between two channels.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import torch
import uvloop
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from transport_harness import LIMITS

from swarmnode.transport import Compression
from swarmnode.transport._channel import MAX_RECORD, Channel
from swarmnode.transport._framing import encode_request, read_frame, write_frame
from swarmnode.transport._reader import DirectReader

pytestmark = pytest.mark.timeout(30)


def _records(key: bytes, payload: bytes, first: int = 0) -> bytes:
    """`payload` sealed as a channel seals it: records of at most MAX_RECORD, nonces counting from `first`."""
    sealed = bytearray()
    for number, start in enumerate(range(0, len(payload), MAX_RECORD), first):
        piece = payload[start : start + MAX_RECORD]
        length = len(piece).to_bytes(4, "little")
        sealed += length + AESGCM(key).encrypt(number.to_bytes(12, "big"), piece, length)
    return bytes(sealed)


def _receive(channel: Channel, data: bytes) -> None:
    """Hand `data` to the channel as one receive of the event loop does."""
    buffer = channel.get_buffer(len(data))
    buffer[: len(data)] = data
    channel.buffer_updated(len(data))


@asynccontextmanager
async def _connected() -> AsyncIterator[Channel]:
    """A channel on a real loopback TCP connection to a server that sends nothing."""
    accepted: list[asyncio.StreamWriter] = []
    server = await asyncio.start_server(lambda _, writer: accepted.append(writer), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport, channel = await asyncio.get_running_loop().create_connection(Channel, "127.0.0.1", port)
    try:
        yield channel
    finally:
        transport.close()
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()


def _fed(reader: DirectReader) -> list[int]:
    """Record the size of everything `reader` is fed through its buffer (what did not go in place)."""
    fed: list[int] = []
    feed = reader.feed_data

    def counted(data: bytes) -> None:
        fed.append(len(data))
        feed(data)

    reader.feed_data = counted  # type: ignore[method-assign]
    return fed


def test_sealed_records_open_in_the_waiting_buffer_and_the_rest_waits_in_order() -> None:
    async def run() -> None:
        key = AESGCM.generate_key(128)
        payload = os.urandom(3 * MAX_RECORD + 100)
        async with _connected() as channel:
            reader, _ = channel.open_streams(AESGCM(key), AESGCM(key))
            assert isinstance(reader, DirectReader)
            fed = _fed(reader)
            target = bytearray(2 * MAX_RECORD + 10)
            waiting = asyncio.ensure_future(reader.readinto(memoryview(target)))
            await asyncio.sleep(0)  # one turn of the loop: the readinto is waiting
            assert reader.room() is not None
            _receive(channel, _records(key, payload))
            assert await waiting == len(target)
            assert target == payload[: len(target)]
            # two records opened in place, the head of the third too; the rest was fed, and comes next
            assert sum(fed) == len(payload) - len(target)
            assert await reader.readexactly(len(payload) - len(target)) == payload[len(target) :]

    uvloop.run(run())


def test_bytes_buffered_first_are_read_first_and_keep_the_channel_out_of_the_buffer() -> None:
    async def run() -> None:
        key = AESGCM.generate_key(128)
        first, second = os.urandom(1000), os.urandom(MAX_RECORD)
        async with _connected() as channel:
            reader, _ = channel.open_streams(AESGCM(key), AESGCM(key))
            _receive(channel, _records(key, first))
            target = bytearray(len(first) + len(second))
            assert await reader.readinto(memoryview(target)) == len(first)  # at once, from the buffer
            waiting = asyncio.ensure_future(reader.readinto(memoryview(target)[len(first) :]))
            await asyncio.sleep(0)
            _receive(channel, _records(key, second, first=1))
            assert await waiting == len(second)
            assert target == first + second

    uvloop.run(run())


def test_an_empty_record_neither_ends_nor_wakes_a_waiting_read() -> None:
    async def run() -> None:
        key = AESGCM.generate_key(128)
        async with _connected() as channel:
            reader, _ = channel.open_streams(AESGCM(key), AESGCM(key))
            target = bytearray(10)
            waiting = asyncio.ensure_future(reader.readinto(memoryview(target)))
            await asyncio.sleep(0)
            length = (0).to_bytes(4, "little")
            _receive(channel, length + AESGCM(key).encrypt((0).to_bytes(12, "big"), b"", length))
            await asyncio.sleep(0)
            assert not waiting.done()
            _receive(channel, _records(key, b"0123456789", first=1))
            assert await waiting == 10 and target == b"0123456789"

    uvloop.run(run())


def test_plaintext_is_received_into_the_waiting_buffer_itself() -> None:
    async def run() -> None:
        async with _connected() as channel:
            reader, _ = channel.open_streams(None, None)
            fed = _fed(reader)
            target = bytearray(100)
            waiting = asyncio.ensure_future(reader.readinto(memoryview(target)[10:]))
            await asyncio.sleep(0)
            given = channel.get_buffer(65536)
            assert given.nbytes == 90  # the waiting buffer, not the channel's
            given[:5] = b"hello"
            channel.buffer_updated(5)
            assert await waiting == 5 and target[10:15] == b"hello" and fed == []
            _receive(channel, b"later")  # nobody waits: into the reader's buffer
            assert fed == [5] and await reader.readexactly(5) == b"later"

    uvloop.run(run())


def test_a_reader_ends_with_its_stream_and_fails_with_it() -> None:
    async def run() -> None:
        reader = DirectReader(asyncio.get_running_loop())
        target = memoryview(bytearray(4))
        waiting = asyncio.ensure_future(reader.readinto(target))
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="filled past"):
            reader.filled(5)
        reader.feed_eof()
        assert await waiting == 0
        failed = DirectReader(asyncio.get_running_loop())
        waiting = asyncio.ensure_future(failed.readinto(target))
        await asyncio.sleep(0)
        failed.set_exception(ConnectionError("bad record"))
        with pytest.raises(ConnectionError, match="bad record"):
            await waiting

    uvloop.run(run())


@pytest.mark.parametrize("sealed", [True, False], ids=["sealed", "plaintext"])
def test_frames_of_any_size_cross_a_real_connection_whole(sealed: bool) -> None:
    """Tensors whose ends fall anywhere in a record, from one channel to another over loopback TCP."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        key = AESGCM.generate_key(128)
        keys = (AESGCM(key), AESGCM(key)) if sealed else (None, None)
        accepted: asyncio.Future[Channel] = loop.create_future()
        server = await loop.create_server(lambda: Channel(accepted.set_result), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        transport, dialled = await loop.create_connection(Channel, "127.0.0.1", port)
        try:
            _, writer = dialled.open_streams(*keys)
            reader, _ = (await accepted).open_streams(*keys)
            writer.transport.set_write_buffer_limits(high=0, low=0)
            tensors = [torch.randn(n) for n in (786_433, 1, 0, 16_385)]
            for compression in Compression:
                frame = encode_request("m", 1.0, compression, b"meta", tensors, compression)
                sent = asyncio.ensure_future(write_frame(writer, frame))
                head, received = await read_frame(reader, LIMITS)
                await sent
                assert head.meta == b"meta" and len(received) == len(tensors)
                for got, want in zip(received, tensors, strict=True):
                    if compression is Compression.FLOAT16:
                        want = want.to(torch.float16).to(torch.float32)
                    assert torch.equal(got, want)
        finally:
            transport.close()
            if accepted.done():
                accepted.result().close()
            server.close()
            await server.wait_closed()

    uvloop.run(run())
