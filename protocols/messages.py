"""Versioned msgpack wire schemas for everything a swarmnode daemon sends, sans-I/O.

Every message is a frozen dataclass (`protocols._message.Message`) whose fields are checked on
construction (LocalProtocolError on this side); `encode` turns it into a msgpack map `{"v":
PROTOCOL_VERSION, "kind": ..., <fields>}` and `decode` checks bytes from a peer against the same rules,
raising only RemoteProtocolError with a readable reason. Tensors never travel in msgpack: messages carry
manifests (`protocols.manifest`: name, shape, dtype) and the tensors themselves travel beside them,
serialised by the transport, in manifest order.

This module holds the codec, the table of RPCs every daemon serves, the replies, NoLoCo's averaging
exchange and the node record; a microbatch's hops are in `protocols.hops`, state and tokenizer transfers in
`protocols.transfers`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import ClassVar, TypeVar

import msgpack

from protocols._message import KINDS, MAX_ID, MAX_TEXT, RUN, STAGE, Message
from protocols._schema import (
    checked,
    choice,
    count,
    flag,
    items,
    nested,
    number,
    optional,
    show,
    text,
    to_wire,
)
from protocols.errors import LocalProtocolError, RemoteProtocolError
from protocols.hops import Abort, Backward, Forward, Route
from protocols.links import MAX_LINK_COSTS, MAX_SITE_CHARS, LinkCost
from protocols.manifest import MAX_NAME, MAX_TENSORS, TensorSpec, manifest_field, same_layout
from protocols.transfers import COPIES, StatePart, StateRequest, TokenizerRequest

PROTOCOL_VERSION = 5  # 2: a data node sends a batch per pipeline (`planning.pipeline_width`); 3: a forward
# names the data nodes whose work the plan sends through each hop (`hops._Hop.senders`); 4: a validation
# pass names the tick whose weights it measures (`hops.Forward.weights_of`); 5: copies of the edge stages
# (`transfers.StatePart.FIRST_STAGE_COPY`, `LAST_STAGE_COPY`)
MAX_MESSAGE_BYTES = 1 << 20  # control metadata only; tensors travel beside it
MAX_RECORD_BYTES = 8192  # DHT records: hivemind's DHT failed with values near 60 KB
MAX_ADDRS = 16


class NodeState(StrEnum):
    JOINING = "joining"
    ONLINE = "online"
    RECOVERING = "recovering"
    LEAVING = "leaving"
    EXPORTING = "exporting"  # a `swarmnode export` client reading every stage's weights, serving nothing


class Decline(StrEnum):
    """Why a NoLoCo partner declined an averaging request."""

    NOT_REACHED = "not_reached"  # it has not started that outer step yet: ask again until the deadline
    OTHER_OUTER_STEP = "other_outer_step"  # it is at another outer step
    FINISHED = "finished"  # its round for that outer step is over
    NOT_PARTNER = "not_partner"  # the sender is not its partner in this outer step's matching
    INITIATOR = "initiator"  # it initiates this pair's exchange itself
    MALFORMED = "malformed"  # the request's tensors do not match its manifests


class ErrorCode(StrEnum):
    MALFORMED = "malformed"  # the request broke the protocol
    WRONG_RUN = "wrong_run"  # another run id or protocol version
    WRONG_STAGE = "wrong_stage"  # this node does not serve that stage
    STALE = "stale"  # the iteration or outer step is over
    BUSY = "busy"  # queue full: try another replica
    INTERNAL = "internal"  # this node failed; the sender did nothing wrong


_COPIES = items(choice(StatePart, COPIES), len(COPIES), unique=True)


@dataclass(frozen=True)
class AveragingRequest(Message):
    """NoLoCo: the initiator's phi and theta (same layout), sent in that order beside the message."""

    KIND: ClassVar[str] = "averaging_request"
    run_id: str = field(metadata=checked(RUN))
    stage: int = field(metadata=checked(STAGE))
    outer_step: int = field(metadata=checked(count()))
    phi: tuple[TensorSpec, ...] = field(metadata=checked(manifest_field))
    theta: tuple[TensorSpec, ...] = field(metadata=checked(manifest_field))

    def _check(self) -> None:
        if not self.phi or not same_layout(self.phi, self.theta):
            raise LocalProtocolError("phi and theta: expected the same non-empty list of names and shapes")


@dataclass(frozen=True)
class AveragingReply(Message):
    """NoLoCo: the partner's answer; if accepted, its pre-step phi and theta follow, else nothing does."""

    KIND: ClassVar[str] = "averaging_reply"
    run_id: str = field(metadata=checked(RUN))
    stage: int = field(metadata=checked(STAGE))
    outer_step: int = field(metadata=checked(count()))
    accept: bool = field(metadata=checked(flag))
    reason: str = field(default="", metadata=checked(text(MAX_TEXT)))
    phi: tuple[TensorSpec, ...] = field(default=(), metadata=checked(manifest_field))
    theta: tuple[TensorSpec, ...] = field(default=(), metadata=checked(manifest_field))
    decline: Decline | None = field(default=None, metadata=checked(optional(choice(Decline))))

    def _check(self) -> None:
        if self.accept and (not self.phi or not same_layout(self.phi, self.theta)):
            raise LocalProtocolError("phi and theta: an accepting reply needs the same non-empty layout")
        if self.accept == (self.decline is not None):
            raise LocalProtocolError("decline: a declining reply says why, an accepting one does not")
        if not self.accept and (self.phi or self.theta):
            raise LocalProtocolError("phi and theta: a declining reply carries no tensors")


@dataclass(frozen=True)
class Ack(Message):
    """Success with nothing else to say."""

    KIND: ClassVar[str] = "ack"


@dataclass(frozen=True)
class Pong(Message):
    """The answer to a ping: alive, and serving `stage` (a node that moved keeps its peer id)."""

    KIND: ClassVar[str] = "pong"
    stage: int = field(metadata=checked(STAGE))


@dataclass(frozen=True)
class Error(Message):
    """A request was refused or failed; `reason` is for logs."""

    KIND: ClassVar[str] = "error"
    code: ErrorCode = field(metadata=checked(choice(ErrorCode)))
    reason: str = field(default="", metadata=checked(text(MAX_TEXT)))


@dataclass(frozen=True)
class NodeRecord(Message):
    """What a node publishes on the DHT under `{run}.stage.{k}`, subkey its peer id.

    The protocol version travels in every encoding and `decode` rejects other versions. `loss` is set by
    data nodes only; `grad_norm` (before clipping) feeds CheckFree; `copies` says which CheckFree+ copies
    this node holds; `addrs` the circuit addresses (`.../p2p/RELAY/p2p-circuit`) of the relays through which
    peers that cannot dial it reach it (a node behind a NAT); `site` names its site in an emulated network
    (`join --network`; None: no emulation); `links` its measured costs to the peers it last talked to (the
    planner's link costs); `stood_in` in how many of the last steps a transformer node served microbatches in
    stage 1's and in stage s's place (`protocols.standins`: the evidence for a CheckFree+ copy; None: not
    counted, as on data nodes and in records of older nodes). Decode records with
    `max_bytes=MAX_RECORD_BYTES`.
    """

    KIND: ClassVar[str] = "node_record"
    WIRE_OPTIONAL: ClassVar[frozenset[str]] = frozenset({"stood_in"})  # records of older nodes lack it
    state: NodeState = field(metadata=checked(choice(NodeState)))
    stage: int = field(metadata=checked(STAGE))
    step: int = field(metadata=checked(count()))
    outer_step: int = field(metadata=checked(count()))
    loss: float | None = field(default=None, metadata=checked(optional(number())))
    grad_norm: float | None = field(default=None, metadata=checked(optional(number(0.0))))
    throughput: float = field(default=0.0, metadata=checked(number(0.0)))
    queue_depth: int = field(default=0, metadata=checked(count()))
    copies: tuple[StatePart, ...] = field(default=(), metadata=checked(_COPIES))
    addrs: tuple[str, ...] = field(default=(), metadata=checked(items(text(MAX_NAME, 1), MAX_ADDRS)))
    microbatches_lost: int = field(default=0, metadata=checked(count()))
    recovery: str | None = field(default=None, metadata=checked(optional(text(MAX_ID, 1))))
    recovery_seconds: float | None = field(default=None, metadata=checked(optional(number(0.0))))
    site: str | None = field(default=None, metadata=checked(optional(text(MAX_SITE_CHARS, 1))))
    links: tuple[LinkCost, ...] = field(default=(), metadata=checked(items(nested(LinkCost), MAX_LINK_COSTS)))
    stood_in: tuple[int, int] | None = field(default=None, metadata=checked(optional(items(count(), 2, 2))))


class Rpc(StrEnum):
    """The methods every daemon serves; `REQUESTS` names the message each request carries."""

    FORWARD = "forward"
    BACKWARD = "backward"
    ABORT = "abort"
    ROUTE = "route"
    AVERAGE = "average"
    STATE = "state"
    PING = "ping"
    HELLO = "hello"
    TOKENIZER = "tokenizer"


REQUESTS: Mapping[Rpc, type[Message] | None] = MappingProxyType(
    {
        Rpc.FORWARD: Forward,
        Rpc.BACKWARD: Backward,
        Rpc.ABORT: Abort,
        Rpc.ROUTE: Route,
        Rpc.AVERAGE: AveragingRequest,
        Rpc.STATE: StateRequest,
        Rpc.PING: None,  # no message: the reply is a `Pong`
        Rpc.HELLO: None,  # no message: a node that just came online says so
        Rpc.TOKENIZER: TokenizerRequest,
    }
)

M = TypeVar("M", bound=Message)


def bounded(text: str) -> str:
    """`text` cut to the longest string a message field may carry (reasons from exceptions can be long)."""
    return text[:MAX_TEXT]


def encode(message: Message) -> bytes:
    """The msgpack bytes of a message. Raises LocalProtocolError for non-messages and oversized ones."""
    kind = getattr(type(message), "KIND", None)
    if KINDS.get(kind) is not type(message):
        raise LocalProtocolError(f"cannot encode a {type(message).__name__}: not a protocol message")
    data = msgpack.packb({"v": PROTOCOL_VERSION, "kind": kind, **to_wire(message)}, use_bin_type=True)
    if len(data) > MAX_MESSAGE_BYTES:
        raise LocalProtocolError(f"{kind} message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return data


def decode(data: bytes, expected_type: type[M] | None = None, max_bytes: int = MAX_MESSAGE_BYTES) -> M:
    """The message in `data` from a peer, checked against its schema.

    Raises RemoteProtocolError (never anything else) for anything that is not exactly one well-formed
    message of this protocol version (and of `expected_type`, if given) within `max_bytes`.
    """
    if expected_type is not None and KINDS.get(getattr(expected_type, "KIND", None)) is not expected_type:
        raise LocalProtocolError(f"{expected_type!r} is not a protocol message type")
    if not isinstance(data, bytes | bytearray | memoryview):
        raise RemoteProtocolError(f"expected bytes, got {type(data).__name__}")
    size = memoryview(data).nbytes
    if size == 0:
        raise RemoteProtocolError("empty message")
    if size > max_bytes:
        raise RemoteProtocolError(f"message of {size} bytes exceeds the limit of {max_bytes}")
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=False,
            max_str_len=MAX_TEXT,
            max_bin_len=0,
            max_ext_len=0,
            max_array_len=MAX_TENSORS,
            max_map_len=32,
        )
    except msgpack.ExtraData:
        raise RemoteProtocolError("trailing bytes after the message") from None
    except (ValueError, msgpack.UnpackException) as exc:  # incomplete, invalid, too deep, over a limit
        raise RemoteProtocolError(f"malformed msgpack: {show(str(exc))}") from None
    if not isinstance(obj, dict):
        raise RemoteProtocolError(f"expected a map, got {type(obj).__name__}")
    version, kind = obj.pop("v", None), obj.pop("kind", None)
    if isinstance(version, bool) or not isinstance(version, int):
        raise RemoteProtocolError(f"missing or invalid protocol version {show(version)}")
    if version != PROTOCOL_VERSION:
        raise RemoteProtocolError(f"protocol version {version}, this node speaks {PROTOCOL_VERSION}")
    cls = KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise RemoteProtocolError(f"unknown message kind {show(kind)}")
    if expected_type is not None and cls is not expected_type:
        raise RemoteProtocolError(f"expected a {expected_type.KIND} message, got {kind}")
    try:
        return nested(cls)(obj, kind)
    except LocalProtocolError as exc:
        raise RemoteProtocolError(exc.reason) from None
