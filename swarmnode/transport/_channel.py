"""A direct TCP connection's protocol: raw bytes for a handshake, then asyncio streams, sealed or not.

`Channel` is the protocol of one TCP connection (either side). Until `open_streams`, the handshake reads and
writes raw bytes (`read_raw`, `write_raw`); then it hands a `DirectReader`/`StreamWriter` pair to the
transport, a `StreamReader` like the libp2p path's, so framing and serving do not know which path they run
on; where the framing waits in `DirectReader.readinto` for a tensor's bytes, they go straight into the
tensor's memory (the kernel's recv writes plaintext there; sealed records open there).

Sealed, every write becomes records of at most `MAX_RECORD` plaintext bytes:

    record  length: uint32 little-endian (of the plaintext), then AES-GCM(plaintext) and its 16-byte tag

with the length as associated data and a 96-bit nonce counting the records of that direction from 0 (each
direction has its own key, fresh per connection: a nonce is never used twice under one key). A record that
is too long, does not authenticate, or comes out of order ends the connection: the reader then raises
ConnectionError. Unsealed (the loopback plaintext path), bytes pass through untouched.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from swarmnode.transport._reader import DirectReader

logger = logging.getLogger(__name__)

MAX_RECORD = 1 << 16  # plaintext bytes per record: small enough that sealing, sending and opening overlap
TAG_BYTES = 16
_LENGTH_BYTES = 4
_RECORD_BYTES = MAX_RECORD + TAG_BYTES + _LENGTH_BYTES  # the most one record takes on the wire
_CAPACITY = 4 * _RECORD_BYTES  # the receive buffer: several whole records
_MAX_COUNTER = 1 << 64


def _nonce(counter: int) -> bytes:
    if counter >= _MAX_COUNTER:
        raise ConnectionError("record counter exhausted")  # 2**64 records: never in practice
    return counter.to_bytes(12, "big")


class _SealedTransport(asyncio.Transport):
    """What the app's StreamWriter writes to: seals each write into records on the TCP transport."""

    def __init__(self, inner: asyncio.Transport, seal: AESGCM) -> None:
        super().__init__()
        self._inner = inner
        self._seal = seal
        self._sent = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        records: list[bytes] = []
        with memoryview(data) as view, view.cast("B") as octets:
            for start in range(0, octets.nbytes, MAX_RECORD):
                piece = octets[start : start + MAX_RECORD]
                length = piece.nbytes.to_bytes(_LENGTH_BYTES, "little")
                records += (length, self._seal.encrypt(_nonce(self._sent), piece, length))
                self._sent += 1
        self._inner.writelines(records)  # one system call for the whole write, not one per record

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def can_write_eof(self) -> bool:
        return False

    def is_closing(self) -> bool:
        return self._inner.is_closing()

    def close(self) -> None:
        self._inner.close()

    def abort(self) -> None:
        self._inner.abort()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._inner.get_extra_info(name, default)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._inner.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._inner.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._inner.get_write_buffer_limits()

    def pause_reading(self) -> None:
        self._inner.pause_reading()

    def resume_reading(self) -> None:
        self._inner.resume_reading()

    def is_reading(self) -> bool:
        return self._inner.is_reading()


class Channel(asyncio.BufferedProtocol):
    """One direct TCP connection. `on_open(channel)` runs once the connection is made (the listener starts
    its handshake there). Bytes are received straight into one buffer kept per connection (no bytes object
    per read), where the records are opened from."""

    def __init__(self, on_open: Callable[[Channel], None] | None = None) -> None:
        self._on_open = on_open
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray(_CAPACITY)
        self._start = self._end = 0  # what is received and not yet read or opened: buffer[start:end]
        self._waiter: asyncio.Future[None] | None = None  # the handshake's read, while bytes are missing
        self._app: asyncio.StreamReaderProtocol | None = None
        self._reader: DirectReader | None = None
        self._into_room = False  # the last buffer given to the transport was the reader's room
        self._open: AESGCM | None = None
        self._received = 0  # records opened
        self._plain = bytearray()  # where the records received open (once sealed)
        self._lost: BaseException | None = None
        self._ended = False  # the connection is lost (or the peer sent EOF)
        self._writing_paused = False  # the TCP transport's write buffer is over its high mark
        self._reading_paused = False  # by this protocol: its buffer is full before the handshake ended

    @property
    def peername(self) -> object:
        return None if self._transport is None else self._transport.get_extra_info("peername")

    # ---- asyncio.BufferedProtocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # always a TCP transport here
        if self._on_open is not None:
            self._on_open(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        room = None if self._open is not None or self._reader is None else self._reader.room()
        self._into_room = room is not None
        if room is not None:  # plaintext, and a readinto waits: the kernel writes straight into its buffer
            return room
        if self._start > 0 and (self._start == self._end or _CAPACITY - self._end < _RECORD_BYTES):
            held = self._end - self._start  # less than a record: move it to the front
            self._buffer[:held] = self._buffer[self._start : self._end]
            self._start, self._end = 0, held
        return memoryview(self._buffer)[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._into_room and self._reader is not None:
            self._into_room = False
            self._reader.filled(nbytes)
            return
        if self._app is not None and self._open is None:  # plaintext: pass it on (the reader copies it)
            with memoryview(self._buffer)[self._end : self._end + nbytes] as data:
                self._app.data_received(data)  # type: ignore[arg-type]  # StreamReader takes any buffer
            return
        self._end += nbytes
        if self._app is not None:
            self._unseal()
            return
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        if self._end == _CAPACITY and self._start == 0 and self._transport is not None:
            self._reading_paused = True  # full before the handshake read it: until it does
            self._transport.pause_reading()

    def eof_received(self) -> bool | None:
        self._ended = True
        if self._app is not None:
            return self._app.eof_received()
        self._wake(asyncio.IncompleteReadError(bytes(self._held()), None))
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended = True
        error = self._lost or exc
        if self._app is not None:
            self._app.connection_lost(error)  # type: ignore[arg-type]  # ours is a ConnectionError
        self._wake(ConnectionError(f"connection lost: {error}"))

    def pause_writing(self) -> None:
        self._writing_paused = True
        if self._app is not None:
            self._app.pause_writing()

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self._app is not None:
            self._app.resume_writing()

    # ---- the handshake ----------------------------------------------------------------------------------

    async def read_raw(self, n: int) -> bytes:
        """Exactly `n` bytes; IncompleteReadError or ConnectionError if the connection ends first."""
        while self._end - self._start < n:
            if self._ended:
                raise asyncio.IncompleteReadError(bytes(self._held()), n)
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        with memoryview(self._buffer)[self._start : self._start + n] as view:
            data = bytes(view)
        self._start += n
        self._resume()
        return data

    def write_raw(self, data: bytes) -> None:
        if self._transport is not None:
            self._transport.write(data)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def open_streams(
        self, seal: AESGCM | None, unseal: AESGCM | None
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """After the handshake: the streams of the connection, sealed with these keys (None: plaintext)."""
        if self._transport is None:
            raise ConnectionError("not connected")
        loop = asyncio.get_running_loop()
        reader = DirectReader(loop)
        app = asyncio.StreamReaderProtocol(reader, loop=loop)
        transport = self._transport if seal is None else _SealedTransport(self._transport, seal)
        app.connection_made(transport)
        if self._writing_paused:
            app.pause_writing()
        writer = asyncio.StreamWriter(transport, app, reader, loop)
        self._app, self._reader, self._open = app, reader, unseal
        if unseal is None:
            if self._end > self._start:
                app.data_received(bytes(self._held()))
            self._start = self._end = 0
        else:
            self._plain = bytearray(_CAPACITY)  # the records one receive buffer holds, opened
            self._unseal()
        self._resume()
        if self._ended:
            if self._transport.is_closing():
                app.connection_lost(self._lost)  # type: ignore[arg-type]
            else:
                app.eof_received()
        return reader, writer

    # ---- records ----------------------------------------------------------------------------------------

    def _held(self) -> memoryview:
        return memoryview(self._buffer)[self._start : self._end]

    def _resume(self) -> None:
        if self._reading_paused and self._transport is not None:
            self._reading_paused = False
            self._transport.resume_reading()

    def _unseal(self) -> None:
        """Open every whole record received: into a waiting `readinto`'s buffer while it has room and nothing
        came before, else into `_plain`, passed on at once (the head of a record that straddles the end of
        that buffer goes there). A bad record ends the connection (after passing on those before it)."""
        app, reader, unseal, error = self._app, self._reader, self._open, None
        opened = given = 0  # plaintext in `_plain`; of it, at its start, what went into the reader's room
        if app is None or reader is None or unseal is None:
            return
        with memoryview(self._buffer) as view, memoryview(self._plain) as plain:
            while self._end - self._start >= _LENGTH_BYTES:
                start = self._start
                length = bytes(view[start : start + _LENGTH_BYTES])
                size = int.from_bytes(length, "little")
                if size > MAX_RECORD:
                    error = f"a record of {size} bytes (at most {MAX_RECORD})"
                    break
                end = start + _LENGTH_BYTES + size + TAG_BYTES
                if self._end < end:
                    break
                room = None if opened else reader.room()
                whole = room is not None and room.nbytes >= size
                # else into a buffer kept for the purpose: no fresh memory to fault in per record
                into = room[:size] if room is not None and whole else plain[opened : opened + size]
                try:
                    unseal.decrypt_into(
                        _nonce(self._received), view[start + _LENGTH_BYTES : end], length, into
                    )
                except InvalidTag:
                    error = "a record that does not authenticate"
                    break
                self._received += 1
                self._start = end
                if room is not None and whole:
                    reader.filled(size)
                    continue
                if room is not None:  # opened is 0: the record is at the start of `_plain`
                    given = room.nbytes
                    room[:] = plain[:given]
                    reader.filled(given)
                opened += size
            if opened > given:
                app.data_received(plain[given:opened])  # a StreamReader copies what it is given
        if error is not None:
            self._fail(error)

    def _fail(self, what: str) -> None:
        logger.warning("closing a direct connection from %s: %s", self.peername, what)
        self._lost = ConnectionError(f"bad record: {what}")
        self._start = self._end = 0
        if self._transport is not None:
            self._transport.abort()

    def _wake(self, error: BaseException) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(error)
