"""What a node accepts from its peers: decoded messages of its run, and hop tensors from the right sender.

Everything here raises `Rejected`; the node's request wrapper (`guarded`) turns that into an `Error` reply,
and for malformed input or another run's messages, a logged ban of the sender.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from hivemind.p2p import PeerID
from torch import Tensor

from protocols.errors import RemoteProtocolError
from protocols.hops import Backward, Forward
from protocols.messages import REQUESTS, Error, ErrorCode, Message, Rpc, bounded, decode, encode
from swarmnode.node.events import emit
from swarmnode.node.worker import check_activations
from swarmnode.transport import Reply, Transport

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
Answer = tuple[bytes, list[Tensor]] | Reply
Handler = Callable[[str, Any, list[Tensor]], Awaitable[Answer]]
Served = Callable[[PeerID, bytes, list[Tensor]], Awaitable[Answer]]

BANNED_FOR = frozenset({ErrorCode.MALFORMED, ErrorCode.WRONG_RUN})  # refusals that also ban the sender


class Rejected(Exception):
    """A peer's request is refused; `code` and `reason` go back to it and into the log."""

    def __init__(self, code: ErrorCode, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class RejectionCounter(Protocol):
    """Where refusals are counted (`node.metrics.DaemonMetrics`)."""

    def rejected(self, reason: str, banned: bool) -> None: ...


def guarded(
    rpc: Rpc,
    handler: Handler,
    run_id: str,
    transport: Transport,
    ban_seconds: float,
    counter: RejectionCounter | None = None,
) -> Served:
    """`handler` wrapped for the transport: the request decoded once, as the message `rpc` carries
    (`REQUESTS`), and handed to it with the sender's peer id; a `Rejected` request is answered with an
    `Error`, counted, and for malformed input or another run's messages its sender is banned for
    `ban_seconds`, logged and reported (a `rejected` event)."""
    kind = REQUESTS[rpc]

    async def serve(peer: PeerID, meta: bytes, tensors: list[Tensor]) -> Answer:
        try:
            message = None if kind is None else decode_from_peer(meta, kind, run_id)
            return await handler(str(peer), message, tensors)
        except Rejected as rejected:
            banned = rejected.code in BANNED_FOR
            if counter is not None:
                counter.rejected(str(rejected.code), banned=banned)
            if banned:
                transport.ban(peer, ban_seconds)
                reason = rejected.reason
                logger.warning("rejected %s from %s and banned it: %s", rejected.code, str(peer)[-8:], reason)
                emit("rejected", peer_id=str(peer), code=str(rejected.code), reason=reason)
            return encode(Error(rejected.code, bounded(rejected.reason))), []

    return serve


def decode_from_peer(meta: bytes, kind: type[M], run_id: str) -> M:
    """`meta` decoded as `kind`, refused if malformed or of another run."""
    try:
        message = decode(meta, kind)
    except RemoteProtocolError as error:
        raise Rejected(ErrorCode.MALFORMED, error.reason) from None
    other_run = getattr(message, "run_id", run_id)
    if other_run != run_id:
        raise Rejected(ErrorCode.WRONG_RUN, f"run {other_run!r} is not {run_id!r}")
    return message


def hop_tensor(
    me: str,
    stage: int,
    peer: str,
    message: Forward | Backward,
    tensors: list[Tensor],
    shape: tuple[int, int, int],
) -> Tensor:
    """The one hidden-state tensor of a hop addressed to this node (`me`, serving `stage`), sent by the node
    before it on the path (forward) or after it (backward); `shape` bounds (batch, seq, dim)."""
    if message.path[message.hop] != me or message.stages[message.hop] != stage:
        raise Rejected(ErrorCode.WRONG_STAGE, f"hop {message.hop} is not this node (stage {stage})")
    sender_hop = message.hop - 1 if isinstance(message, Forward) else message.hop + 1
    if not 0 <= sender_hop < len(message.path) or message.path[sender_hop] != peer:
        raise Rejected(ErrorCode.MALFORMED, f"{peer[-8:]} is not hop {sender_hop} of this microbatch's path")
    if len(tensors) != 1:
        raise Rejected(ErrorCode.MALFORMED, f"expected one tensor, got {len(tensors)}")
    problem = check_activations(tensors[0], *shape)
    if problem is not None:
        raise Rejected(ErrorCode.MALFORMED, problem)
    return tensors[0]
