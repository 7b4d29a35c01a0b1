"""What a node accepts from its peers: decoded messages of its run, and hop tensors from the right sender.

Everything here raises `Rejected`; the node's request wrapper turns that into an `Error` reply, and for
malformed input or another run's messages, a logged ban of the sender.
"""

from __future__ import annotations

from typing import TypeVar

from torch import Tensor

from protocols.errors import RemoteProtocolError
from protocols.messages import Backward, ErrorCode, Forward, Message, decode
from swarmnode.node.worker import check_activations

M = TypeVar("M", bound=Message)

BANNED_FOR = frozenset({ErrorCode.MALFORMED, ErrorCode.WRONG_RUN})  # refusals that also ban the sender


class Rejected(Exception):
    """A peer's request is refused; `code` and `reason` go back to it and into the log."""

    def __init__(self, code: ErrorCode, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


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
