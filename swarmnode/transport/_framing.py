"""The wire format: length-prefixed frames carrying a msgpack head and raw tensor bytes.

A frame is a fixed prefix, a msgpack head, then a body of tensor bytes back to back:

    prefix  struct "<4sBBHIQ": magic b"SWNT", version, kind, flags (0), head length, body length
    head    REQUEST  [method: str, timeout: float, reply compression: int, meta: bytes, specs]
            RESPONSE [meta: bytes, specs]
            ERROR    [code: str, message: str]
    specs   one [dtype: str, compression: int, shape: [int, ...]] per tensor
    body    each tensor's bytes, in order; the body length must equal the sum the specs imply

Tensors travel as hivemind.compression does it (`runtime_pb2.Tensor` semantics: dtype name, shape, and
`CompressionType` NONE or FLOAT16), minus the protobuf copies: NONE sends a tensor's own memory (bfloat16 as
its raw 16 bits), FLOAT16 sends float32 as float16 clamped to its range (byte for byte what hivemind's
Float16Compression sends; other dtypes travel as they are). Each decoded tensor owns fresh memory (writable,
never shared), allocated uninitialised and filled as its bytes arrive, in place where the stream can
(`_reader.DirectReader.readinto`), so the memory of a body announced but not sent is never touched (the
system commits pages as they are written). Everything read from the wire is checked against `Limits` and
the dtype allow-list before any tensor is built; whatever a peer sends, decoding raises only WireError
(or IncompleteReadError when the stream ends mid-frame). Error texts are cut to `MAX_ERROR_CHARS`, both sent
and received, and peer-supplied values quoted in a WireError are cut short.
"""

from __future__ import annotations

import asyncio
import enum
import math
import struct
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
from hivemind.proto.runtime_pb2 import CompressionType

from swarmnode.transport._errors import WireError
from swarmnode.transport._reader import DirectReader

MAGIC = b"SWNT"
VERSION = 1
PREFIX = struct.Struct("<4sBBHIQ")
IO_CHUNK = 1 << 20  # bytes per write and read call while streaming a body
MAX_METHOD_CHARS = 128  # longest method name a request may carry
MAX_CODE_CHARS = 64  # longest error code an ERROR frame may carry
MAX_ERROR_CHARS = 1024  # error messages longer than this are cut, when sent and when received
_SHOWN_CHARS = 80  # how much of a peer-supplied value a WireError quotes

Buffer = bytes | bytearray | memoryview


class Kind(enum.IntEnum):
    """What a frame is."""

    REQUEST = 1
    RESPONSE = 2
    ERROR = 3


class Compression(enum.IntEnum):
    """How float32 tensors travel (values are hivemind's `CompressionType`); other dtypes travel as is."""

    NONE = CompressionType.NONE
    FLOAT16 = CompressionType.FLOAT16


WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
}
_DTYPE_NAMES = {dtype: name for name, dtype in WIRE_DTYPES.items()}
_FP16_MAX = torch.finfo(torch.float16).max
_KINDS = frozenset(Kind)
_COMPRESSIONS = frozenset(Compression)


@dataclass(frozen=True)
class Limits:
    """Bounds on what a peer may send; anything beyond them is rejected before it is allocated.

    max_elements bounds each tensor's element count with every zero dimension counted as 1, so that a
    zero-sized tensor cannot announce absurd dimensions either (each dimension is thus at most max_elements).
    """

    max_message_bytes: int = 1 << 30
    max_head_bytes: int = 1 << 20
    max_tensors: int = 4096
    max_ndim: int = 8
    max_elements: int = 1 << 31

    def __post_init__(self) -> None:
        if min(self.max_message_bytes, self.max_head_bytes, self.max_tensors, self.max_ndim) < 1:
            raise ValueError(f"every limit must be positive: {self}")
        if not 1 <= self.max_elements <= 1 << 62:  # torch's sizes and strides are int64
            raise ValueError(f"max_elements must be within 1..2**62, got {self.max_elements}")


@dataclass(frozen=True)
class WireTensor:
    """One tensor as described in a head: its dtype, how it travels, its shape."""

    dtype: str
    compression: Compression
    shape: tuple[int, ...]

    @property
    def wire_dtype(self) -> torch.dtype:
        return torch.float16 if self.compression is Compression.FLOAT16 else WIRE_DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.wire_dtype.itemsize


@dataclass(frozen=True)
class Request:
    method: str
    timeout: float
    reply_compression: Compression
    meta: bytes
    specs: tuple[WireTensor, ...]


@dataclass(frozen=True)
class Response:
    meta: bytes
    specs: tuple[WireTensor, ...]


@dataclass(frozen=True)
class ErrorFrame:
    code: str
    message: str


Head = Request | Response | ErrorFrame


# ---- encoding -------------------------------------------------------------------------------------------


def _encode_tensor(tensor: torch.Tensor, compression: Compression) -> tuple[list[Any], memoryview]:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    name = _DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise TypeError(f"dtype {tensor.dtype} cannot travel; allowed: {', '.join(WIRE_DTYPES)}")
    data = tensor.detach()
    wire = Compression.NONE
    if compression == Compression.FLOAT16 and data.dtype == torch.float32:
        data = data.to(torch.float16).clamp_(-_FP16_MAX, _FP16_MAX)  # = hivemind's clamp, then cast
        wire = Compression.FLOAT16
    data = data.cpu().contiguous().reshape(-1)
    return [name, int(wire), list(tensor.shape)], memoryview(data.view(torch.uint8).numpy())


def _meta(meta: object) -> bytes:
    if not isinstance(meta, bytes | bytearray | memoryview):
        raise TypeError(f"meta must be bytes, got {type(meta).__name__}")
    return bytes(meta)


def _encode(
    kind: Kind, fields: list[Any], tensors: Sequence[torch.Tensor], compression: Compression
) -> list[Buffer]:
    specs, buffers = [], []
    for tensor in tensors:
        spec, buffer = _encode_tensor(tensor, compression)
        specs.append(spec)
        buffers.append(buffer)
    if kind is not Kind.ERROR:
        fields = [*fields, specs]
    head = msgpack.packb(fields, use_bin_type=True)
    body_len = sum(buffer.nbytes for buffer in buffers)
    return [PREFIX.pack(MAGIC, VERSION, kind, 0, len(head), body_len) + head, *buffers]


def encode_request(
    method: str,
    timeout: float,
    reply_compression: Compression,
    meta: bytes,
    tensors: Sequence[torch.Tensor],
    compression: Compression,
) -> list[Buffer]:
    """Encode a request as buffers to write in order; tensor bytes are views of the tensors, not copies.

    Raises TypeError for a method, meta or tensor that cannot travel.
    """
    if not isinstance(method, str):
        raise TypeError(f"method must be a str, got {type(method).__name__}")
    fields = [method, float(timeout), int(reply_compression), _meta(meta)]
    return _encode(Kind.REQUEST, fields, tensors, compression)


def encode_response(meta: bytes, tensors: Sequence[torch.Tensor], compression: Compression) -> list[Buffer]:
    """Encode a response like `encode_request`."""
    return _encode(Kind.RESPONSE, [_meta(meta)], tensors, compression)


def encode_error(code: str, message: str) -> list[Buffer]:
    """Encode an error answer; a message longer than MAX_ERROR_CHARS is cut."""
    return _encode(Kind.ERROR, [code, truncate(message)], (), Compression.NONE)


def truncate(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """`text`, cut to `limit` characters (an ellipsis marks the cut)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def show(value: object) -> str:
    """A peer-supplied value for an error message: its repr, cut short."""
    return truncate(repr(value), _SHOWN_CHARS)


def frame_size(buffers: Sequence[Buffer]) -> int:
    """Total bytes of an encoded frame."""
    return sum(memoryview(buffer).nbytes for buffer in buffers)


# ---- decoding -------------------------------------------------------------------------------------------


def parse_prefix(prefix: bytes, limits: Limits) -> tuple[Kind, int, int]:
    """Check a frame prefix; return (kind, head length, body length)."""
    magic, version, kind, flags, head_len, body_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}")
    if version != VERSION:
        raise WireError(f"unsupported wire version {version} (this side speaks {VERSION})")
    if kind not in _KINDS or flags != 0:
        raise WireError(f"bad frame kind {kind} or flags {flags:#x}")
    if head_len > limits.max_head_bytes:
        raise WireError(f"head of {head_len} bytes exceeds the limit of {limits.max_head_bytes}")
    if head_len + body_len > limits.max_message_bytes:
        raise WireError(
            f"message of {head_len + body_len} bytes exceeds the limit of {limits.max_message_bytes}"
        )
    return Kind(kind), head_len, body_len


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise WireError(f"malformed head: {what}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_spec(raw: object, limits: Limits) -> WireTensor:
    _check(isinstance(raw, list) and len(raw) == 3, "tensor spec is not [dtype, compression, shape]")
    dtype, compression, shape = raw
    if not (isinstance(dtype, str) and dtype in WIRE_DTYPES):
        raise WireError(f"dtype {show(dtype)} is not allowed")
    if not (_is_int(compression) and compression in _COMPRESSIONS):
        raise WireError(f"compression {show(compression)} is not allowed")
    if compression == Compression.FLOAT16 and dtype != "float32":
        raise WireError(f"FLOAT16 compression of a {dtype} tensor")
    _check(isinstance(shape, list) and len(shape) <= limits.max_ndim, "shape is not a short list")
    _check(all(_is_int(dim) and dim >= 0 for dim in shape), "shape has a non-natural dimension")
    elements = math.prod(max(dim, 1) for dim in shape)  # Python ints: no overflow, zero dims count as 1
    if elements > limits.max_elements:
        raise WireError(f"shape {show(shape)} exceeds the limit of {limits.max_elements} elements")
    return WireTensor(dtype, Compression(compression), tuple(shape))


def _parse_specs(raw: object, body_len: int, limits: Limits) -> tuple[WireTensor, ...]:
    _check(isinstance(raw, list) and len(raw) <= limits.max_tensors, "tensor list is missing or too long")
    specs = tuple(_parse_spec(item, limits) for item in raw)
    expected = sum(spec.nbytes for spec in specs)
    if expected != body_len:
        raise WireError(f"tensors take {expected} bytes but the body has {body_len}")
    return specs


def _unpack_head(head: bytes, limits: Limits) -> object:
    """msgpack-decode a head, refusing maps and extension types and arrays longer than any valid head has
    (so that the objects built stay few)."""
    try:
        return msgpack.unpackb(
            head,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_array_len=max(5, limits.max_tensors, limits.max_ndim),
            max_map_len=0,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises several unrelated types on garbage
        reason = truncate(str(e), _SHOWN_CHARS)
        raise WireError(f"head is not msgpack: {type(e).__name__}: {reason}") from None


def parse_head(kind: Kind, head: bytes, body_len: int, limits: Limits) -> Head:
    """Decode and check a frame head against the body length the prefix announced."""
    fields = _unpack_head(head, limits)
    if not isinstance(fields, list):
        raise WireError("malformed head: head is not a list")
    if kind is Kind.REQUEST:
        _check(len(fields) == 5, "request head needs 5 fields")
        method, timeout, reply_compression, meta, specs = fields
        _check(isinstance(method, str) and len(method) <= MAX_METHOD_CHARS, "method is not a short string")
        _check(isinstance(timeout, float) and 0 < timeout < math.inf, "timeout is not a positive float")
        _check(_is_int(reply_compression) and reply_compression in _COMPRESSIONS, "unknown reply compression")
        _check(isinstance(meta, bytes), "meta is not bytes")
        return Request(
            method, timeout, Compression(reply_compression), meta, _parse_specs(specs, body_len, limits)
        )
    if kind is Kind.RESPONSE:
        _check(len(fields) == 2, "response head needs 2 fields")
        meta, specs = fields
        _check(isinstance(meta, bytes), "meta is not bytes")
        return Response(meta, _parse_specs(specs, body_len, limits))
    _check(
        len(fields) == 2 and all(isinstance(field, str) for field in fields),
        "error head is not [code, message]",
    )
    _check(len(fields[0]) <= MAX_CODE_CHARS, "error code is too long")
    _check(body_len == 0, "error frame has a body")
    return ErrorFrame(fields[0], truncate(fields[1]))


ReadInto = Callable[[memoryview], Awaitable[int]]
"""Fills a byte buffer with the next bytes of a stream, as many as come at once; 0 once it ended."""


def read_into(reader: asyncio.StreamReader) -> ReadInto:
    """How to fill a buffer from `reader`: in place from a direct connection's, else through `read`."""
    if isinstance(reader, DirectReader):
        return reader.readinto

    async def through_read(view: memoryview) -> int:
        chunk = await reader.read(view.nbytes)
        view[: len(chunk)] = chunk
        return len(chunk)

    return through_read


def _build(spec: WireTensor, raw: torch.Tensor) -> torch.Tensor:
    try:
        tensor = raw.view(spec.wire_dtype).view(spec.shape)
        return tensor.to(torch.float32) if spec.compression is Compression.FLOAT16 else tensor
    except (RuntimeError, TypeError, ValueError, OverflowError) as e:  # whatever torch objects to
        raise WireError(f"cannot build shape {show(spec.shape)}: {type(e).__name__}") from None


async def read_tensors(fill: ReadInto, specs: Sequence[WireTensor]) -> list[torch.Tensor]:
    """Read a body with `fill` and build its tensors, each owning fresh memory.

    Each tensor's memory is allocated uninitialised and filled as its bytes arrive, so the pages of a body
    announced but not sent are never touched. Raises IncompleteReadError if the stream ends first."""
    tensors = []
    for spec in specs:
        size = spec.nbytes
        raw = torch.empty(size, dtype=torch.uint8)
        got = 0
        with memoryview(raw.numpy()) as view:
            while got < size:
                n = await fill(view[got : min(size, got + IO_CHUNK)])
                if not n:
                    raise asyncio.IncompleteReadError(b"", size)
                got += n
        tensors.append(_build(spec, raw))
    return tensors


async def read_frame(reader: asyncio.StreamReader, limits: Limits) -> tuple[Head, list[torch.Tensor]]:
    """Read one whole frame (prefix, head, tensors)."""
    kind, head_len, body_len = parse_prefix(await reader.readexactly(PREFIX.size), limits)
    head = parse_head(kind, await reader.readexactly(head_len), body_len, limits)
    tensors = await read_tensors(read_into(reader), head.specs) if not isinstance(head, ErrorFrame) else []
    return head, tensors


async def write_frame(writer: asyncio.StreamWriter, buffers: Sequence[Buffer]) -> None:
    """Write an encoded frame. Returns once every byte left the process: the tensors may then change.

    The writer must have been set up with `prepare_writer` so that `drain` waits for a full flush.
    """
    for buffer in buffers:
        view = memoryview(buffer).cast("B")
        for start in range(0, view.nbytes, IO_CHUNK):
            writer.write(view[start : start + IO_CHUNK])
            await writer.drain()


def prepare_writer(writer: asyncio.StreamWriter) -> None:
    """Make `drain` wait until the transport holds no unsent bytes (uvloop keeps views of what we write)."""
    writer.transport.set_write_buffer_limits(high=0, low=0)
