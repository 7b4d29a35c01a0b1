"""A data node's bookkeeping of one iteration: its microbatches, where each is, when the iteration is done.

Plain state, changed by `node.driver.DataNode` on its event loop; nothing here does I/O.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field

from torch import Tensor

from protocols.messages import MAX_NONCE, Backward, ErrorCode, Forward, Route
from swarmnode.node.checks import Rejected
from swarmnode.node.planning import PlannedMicrobatch


@dataclass
class Microbatch:
    """One microbatch of an iteration, from its launch until its gradient is back (`done`) or it is lost."""

    planned: PlannedMicrobatch
    targets: Tensor
    path: tuple[str, ...] = ()
    nonce: int = field(default_factory=lambda: 1 + secrets.randbelow(MAX_NONCE))  # unguessable
    loss: float | None = None
    done: bool = False
    returned: bool = False  # its activations came back (a second copy, from a timed-out hop, is refused)
    routed_at: int = 0  # the hop of the latest re-route reported (`Route`); notices may arrive out of order
    first_hops: set[str] = field(default_factory=set)  # every stage-1 peer it was sent to: one sends its grad


@dataclass
class Iteration:
    """One iteration of a data node (a tick of the swarm clock, or a validation pass)."""

    number: int
    microbatches: dict[int, Microbatch] = field(default_factory=dict)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    evaluation: bool = False
    closed: bool = False  # the data node has stopped waiting: late work must not touch the gradients

    def check(self) -> None:
        if all(mb.done for mb in self.microbatches.values()):
            self.finished.set()


def stale(message: Forward | Backward | Route) -> Rejected:
    """The refusal of a message for a microbatch that is not pending here (or not with that nonce)."""
    return Rejected(
        ErrorCode.STALE, f"microbatch {message.microbatch} of iteration {message.iteration} is not pending"
    )
