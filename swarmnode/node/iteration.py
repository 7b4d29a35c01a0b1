"""What a data node keeps beside its iteration machine (`protocols.iteration.DataIteration`): the tensors the
machine does not hold, an event to wait on, and the machine's refusals as the `Rejected` a peer is answered
with."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from torch import Tensor

from protocols.hops import Backward, Forward, Route
from protocols.iteration import DataIteration, ForgedReturn, StaleMessage, WrongSender
from protocols.iteration_events import Action, Event
from protocols.messages import ErrorCode
from swarmnode.node.checks import Rejected

logger = logging.getLogger(__name__)


@dataclass
class Running:
    """An iteration of a data node: its machine, each microbatch's target tokens (for the loss at the head),
    and an event set when the machine closes it."""

    machine: DataIteration
    targets: dict[int, Tensor]
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    def take(self, event: Event, message: Forward | Backward | Route) -> tuple[Action, ...]:
        """The machine's actions for a peer's `message` (as `event`), or its refusal raised as `Rejected`."""
        try:
            return self.machine.handle(event)
        except ForgedReturn as error:  # answered as stale, so the sender learns nothing
            logger.warning(
                "a %s for microbatch %d without its nonce: refused", message.KIND, message.microbatch
            )
            raise Rejected(ErrorCode.STALE, error.reason) from None
        except StaleMessage as error:
            raise Rejected(ErrorCode.STALE, error.reason) from None
        except WrongSender as error:
            raise Rejected(ErrorCode.MALFORMED, error.reason) from None


def running(current: Running | None, message: Forward | Backward | Route) -> Running:
    """The iteration a peer's message may be about; refused as stale before the first one."""
    if current is None:
        raise Rejected(ErrorCode.STALE, f"microbatch {message.microbatch} is not pending")
    return current
