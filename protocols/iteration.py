"""A data node's iteration as a machine: its microbatches from launch until each is done or lost, sans-I/O.

Like `noloco.PairingRound` and `stepbook.StepBook`, the data node reports events to `DataIteration.handle`
and carries out the actions it returns (`protocols.iteration_events`). Time comes in inside the events;
nonces are drawn by the caller; nothing here touches tensors or sockets.

A microbatch moves PLANNED -> SENT -> RETURNED -> BACKWARD -> GRADIENT -> DONE (an evaluation's ends at
RETURNED -> DONE, when its loss is known), or to LOST from any state but DONE. A lost microbatch is dropped
and aborted along the whole path it is known to take, whoever reported the loss: a node further down the
path may take aborts only from the peers it knows. The iteration closes when every microbatch is done or
lost, or at its deadline (what is pending then is lost); from then on every message about it is stale, and
no late work touches the gradients (`awaits_loss` and `may_apply` say no).

While it waits, the data node pings the peers on the paths of pending microbatches (`Tick` -> `Ping`). A
peer silent for `dead_grace_s` (every ping since the first it missed; at once if it could not even be
reached) is dead: it is suspected (`Suspect`), so the next plans go around it, and a microbatch whose path
still holds it was held by it and is lost. A peer that answers again within the grace was only slow (a
loaded machine, a NoLoCo round), neither suspected nor dead. (Suspected at its first missed ping, a live
replica left the next plan, its data node sent half the microbatches for that step, and the run's outcome
followed the machine's load.) A microbatch re-routed around a peer no longer has it on its path
(`RouteNotice`), and comes back; the peers a re-route left out are suspected too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from protocols.errors import LocalProtocolError, RemoteProtocolError
from protocols.iteration_events import (
    AbortPath,
    AbortReceived,
    Action,
    ApplyGradient,
    BackwardFailed,
    Closed,
    ComputeLoss,
    Drop,
    Event,
    GradientApplied,
    GradientReturned,
    HeadFailed,
    IterationOutcome,
    LossComputed,
    PeersChecked,
    Ping,
    Returned,
    RouteNotice,
    Send,
    SendGradient,
    Sent,
    Start,
    Suspect,
    Tick,
    Unsent,
)

DEAD_GRACE_S = 2.0  # how long a microbatch may stay pending after a peer on its path was found dead


class MicrobatchState(StrEnum):
    """Where one microbatch of a data node's iteration is."""

    PLANNED = "planned"  # being embedded and sent to its first hop
    SENT = "sent"  # its first hop took it: its activations travel the path
    RETURNED = "returned"  # its activations came back: the head computes the loss
    BACKWARD = "backward"  # its loss is known and its gradient travels back along the path
    GRADIENT = "gradient"  # its gradient came back: the backward pass through the embedding runs
    DONE = "done"  # its gradient reached the embedding (an evaluation's: its loss is known)
    LOST = "lost"  # given up: unreachable, aborted, held by a dead peer, failed, or pending at the deadline


FINAL = frozenset({MicrobatchState.DONE, MicrobatchState.LOST})
OUTBOUND = frozenset({MicrobatchState.PLANNED, MicrobatchState.SENT})  # activations not back yet


class StaleMessage(RemoteProtocolError):
    """A message about a microbatch that is not pending here in the state it needs (late, duplicate, of
    another iteration or data node): refused as stale, never a reason to ban the sender."""


class ForgedReturn(StaleMessage):
    """A message without the microbatch's nonce, so not from its path: answered as stale (the sender learns
    nothing), worth a warning in the log."""


class WrongSender(RemoteProtocolError):
    """A peer sent what only another may send (a gradient of a microbatch it was never sent, a route notice
    for a hop it is not): malformed; the sender may be banned."""


@dataclass
class _Microbatch:
    path: tuple[str, ...]
    nonce: int
    state: MicrobatchState = MicrobatchState.PLANNED
    routed_at: int = 0  # the hop of the latest route notice taken (notices may arrive out of order)
    tries: set[str] = field(default_factory=set)  # every first-hop peer tried: one of them sends the gradient
    loss: float | None = None

    @property
    def watched(self) -> bool:
        """Pending on its path's peers: a dead one there dooms it (a gradient already back needs none)."""
        return self.state not in FINAL and self.state is not MicrobatchState.GRADIENT


class DataIteration:
    """One iteration (a tick of the swarm clock, or a validation pass) of the data node `me`."""

    def __init__(
        self,
        *,
        me: str,
        number: int,
        paths: Mapping[int, tuple[str, ...]],
        nonces: Mapping[int, int],
        timeout_s: float,
        evaluation: bool = False,
        dead_grace_s: float = DEAD_GRACE_S,
    ) -> None:
        """`paths`: each microbatch's planned path, from `me` back to `me`; `nonces`: each one's random
        nonce (positive), which every message about it must carry."""
        if not paths or set(paths) != set(nonces):
            raise LocalProtocolError("an iteration needs microbatches, each with a path and a nonce")
        for index, path in paths.items():
            if len(path) < 2 or path[0] != me or path[-1] != me:
                raise LocalProtocolError(f"microbatch {index}: path {path!r} does not start and end at {me}")
            nonce = nonces[index]
            if isinstance(nonce, bool) or not isinstance(nonce, int) or nonce < 1:
                raise LocalProtocolError(f"microbatch {index}: nonce must be a positive int, got {nonce!r}")
        for name, value in (("timeout_s", timeout_s), ("dead_grace_s", dead_grace_s)):
            if not math.isfinite(value) or value <= 0:
                raise LocalProtocolError(f"{name} must be positive, got {value!r}")
        self.me = me
        self.number = number
        self.evaluation = evaluation
        self.timeout_s = timeout_s
        self.dead_grace_s = dead_grace_s
        self.deadline: float | None = None  # set by `Start`
        self.outcome: IterationOutcome | None = None  # set on closing; never changes after
        self._microbatches = {i: _Microbatch(tuple(paths[i]), nonces[i]) for i in sorted(paths)}
        self._silent_since: dict[str, float] = {}  # peer -> when it first missed a ping (unanswered since)
        self._suspected: set[str] = set()  # the peers found dead
        self._reroutes = 0

    # ---- questions ---------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self.outcome is not None

    def state(self, microbatch: int) -> MicrobatchState:
        return self._get(microbatch).state

    def path(self, microbatch: int) -> tuple[str, ...]:
        """The path the microbatch is known to take (planned, then as sent, re-routed or returned)."""
        return self._get(microbatch).path

    def tries(self, microbatch: int) -> set[str]:
        """The set the router records its tries of the first hop in (before each try)."""
        return self._get(microbatch).tries

    def awaits_loss(self, microbatch: int) -> bool:
        """Whether the head should still compute this microbatch's loss (asked on the compute thread)."""
        return self._in(microbatch, MicrobatchState.RETURNED)

    def may_apply(self, microbatch: int) -> bool:
        """Whether this microbatch's gradient may still go into this iteration's step (asked on the compute
        thread, right before the backward pass through the embedding)."""
        return self._in(microbatch, MicrobatchState.GRADIENT)

    def may_abort(self, peer: str, origin: str, iteration: int, microbatch: int) -> bool:
        """An abort from a peer on the microbatch's path or tried as its first hop; for a microbatch this
        iteration does not have, anyone's (it changes nothing)."""
        mb = self._microbatches.get(microbatch) if (origin, iteration) == (self.me, self.number) else None
        return mb is None or peer in mb.path or peer in mb.tries

    # ---- events ------------------------------------------------------------------------------------------

    def handle(self, event: Event) -> tuple[Action, ...]:
        """Apply one event; the actions to carry out, in order. Raises StaleMessage or WrongSender for a
        peer's message to refuse, LocalProtocolError for an event this side should not have produced."""
        if isinstance(event, Start):
            return self._start(event.now)
        if isinstance(event, Returned | RouteNotice | GradientReturned):
            actions = self._message(event)
        elif self.deadline is None:
            raise LocalProtocolError(f"{type(event).__name__} before iteration {self.number} started")
        elif self.closed:
            return ()  # late: a closed iteration changes no more
        elif isinstance(event, Tick):
            return self._tick(event.now)
        elif isinstance(event, PeersChecked):
            actions = self._checked(event.now, event.silent, event.unreachable)
        elif isinstance(event, AbortReceived):
            ours = (event.origin, event.iteration) == (self.me, self.number)
            actions = self._lose(event.microbatch, event.reason) if ours else ()
        else:
            actions = self._progress(event)
        if not self.closed and all(mb.state in FINAL for mb in self._microbatches.values()):
            actions += (self._close(timed_out=False),)
        return actions

    def _start(self, now: float) -> tuple[Action, ...]:
        if self.deadline is not None:
            raise LocalProtocolError(f"iteration {self.number} started twice")
        self.deadline = now + self.timeout_s
        return tuple(Send(i, mb.path, mb.nonce) for i, mb in self._microbatches.items())

    def _progress(
        self, event: Sent | Unsent | LossComputed | HeadFailed | BackwardFailed | GradientApplied
    ) -> tuple[Action, ...]:
        """This node's own work on a microbatch; ignored once the microbatch moved on (lost meanwhile)."""
        mb = self._get(event.microbatch)
        if isinstance(event, Sent) and mb.state is MicrobatchState.PLANNED:
            mb.state = MicrobatchState.SENT
            if not mb.routed_at:  # a route notice that came first knows the path better
                mb.path = tuple(event.path)
        elif isinstance(event, Unsent) and mb.state is MicrobatchState.PLANNED:
            return self._lose(event.microbatch, "first hop unreachable")
        elif isinstance(event, LossComputed) and mb.state is MicrobatchState.RETURNED:
            mb.loss = event.loss
            if self.evaluation:
                mb.state = MicrobatchState.DONE
                return ()
            mb.state = MicrobatchState.BACKWARD
            return (SendGradient(event.microbatch),)
        elif isinstance(event, HeadFailed) and mb.state is MicrobatchState.RETURNED:
            return self._lose(event.microbatch, event.reason)
        elif isinstance(event, BackwardFailed) and mb.state is MicrobatchState.BACKWARD:
            return self._lose(event.microbatch, "backward hop unreachable")
        elif isinstance(event, GradientApplied) and mb.state is MicrobatchState.GRADIENT:
            mb.state = MicrobatchState.DONE
        return ()

    def _message(self, event: Returned | RouteNotice | GradientReturned) -> tuple[Action, ...]:
        """A peer's message about a microbatch: checked, then taken."""
        if isinstance(event, RouteNotice) and not (
            0 < event.hop < len(event.path) and event.path[event.hop] == event.peer
        ):
            raise WrongSender(f"{event.peer[-8:]} is not hop {event.hop} of the path it reports")
        mb = self._microbatches.get(event.microbatch)
        pending = f"microbatch {event.microbatch} of iteration {event.iteration} is not pending"
        if event.origin != self.me or event.iteration != self.number or self.closed or mb is None:
            raise StaleMessage(pending)
        if mb.state in FINAL or self.deadline is None:
            raise StaleMessage(pending)
        if event.nonce != mb.nonce:
            raise ForgedReturn(pending)
        if isinstance(event, RouteNotice):
            if event.hop > mb.routed_at and mb.state in OUTBOUND:
                gone = [peer for peer in mb.path[event.hop + 1 : -1] if peer not in event.path]
                mb.path, mb.routed_at = tuple(event.path), event.hop
                self._reroutes += 1
                return tuple(Suspect(peer) for peer in dict.fromkeys(gone))  # plan around them a while
            return ()
        if isinstance(event, Returned):
            if mb.state not in OUTBOUND:
                raise StaleMessage(f"microbatch {event.microbatch} came back already")
            # the peers its path lost on the way: a Route notice may come after the activations
            gone = [peer for peer in mb.path[mb.routed_at + 1 : -1] if peer not in event.path]
            mb.state, mb.path = MicrobatchState.RETURNED, tuple(event.path)
            return (ComputeLoss(event.microbatch), *(Suspect(peer) for peer in dict.fromkeys(gone)))
        if event.peer not in mb.tries:
            raise WrongSender(f"{event.peer[-8:]} was not sent microbatch {event.microbatch}")
        if mb.state is not MicrobatchState.BACKWARD:
            raise StaleMessage(f"microbatch {event.microbatch} awaits no gradient")
        mb.state = MicrobatchState.GRADIENT
        return (ApplyGradient(event.microbatch),)

    def _tick(self, now: float) -> tuple[Action, ...]:
        if self.deadline is not None and now > self.deadline:
            pending = [i for i, mb in self._microbatches.items() if mb.state not in FINAL]
            actions = tuple(a for i in pending for a in self._lose(i, "iteration timed out"))
            return (*actions, self._close(timed_out=True))
        peers = {p for mb in self._microbatches.values() if mb.watched for p in mb.path}
        peers -= {self.me, *self._suspected}
        return (Ping(tuple(sorted(peers))),) if peers else ()

    def _checked(self, now: float, silent: frozenset[str], unreachable: frozenset[str]) -> tuple[Action, ...]:
        """Peers silent since their first missed ping are dead once that is `dead_grace_s` ago; the grace
        waits for a peer that is only slow to answer again, or for a re-route around it. An unreachable peer
        is gone: dead at once (waiting for the re-route of a microbatch through it cost the swarm up to 2 s
        after each kill, and with one replica of the stage a re-route only skips the stage). The dead are
        suspected, and the microbatches they hold are lost."""
        for peer in [p for p in self._silent_since if p not in silent and p not in self._suspected]:
            del self._silent_since[peer]  # it answered: only slow
        for peer in silent - {self.me}:
            since = self._silent_since.get(peer, now)
            self._silent_since[peer] = min(since, now - self.dead_grace_s) if peer in unreachable else since
        dead = {peer for peer, since in self._silent_since.items() if now - since >= self.dead_grace_s}
        actions: list[Action] = [Suspect(peer) for peer in sorted(dead - self._suspected)]
        self._suspected |= dead
        for index, mb in self._microbatches.items():
            held_by = sorted(dead & set(mb.path))
            if held_by and mb.watched:
                actions += self._lose(index, f"peer {held_by[0][-8:]} is dead")
        return tuple(actions)

    def _lose(self, microbatch: int, reason: str) -> tuple[Action, ...]:
        mb = self._microbatches.get(microbatch)
        if mb is None or mb.state in FINAL:
            return ()
        mb.state = MicrobatchState.LOST
        return (Drop(microbatch, reason), AbortPath(microbatch, mb.path, reason))

    def _close(self, timed_out: bool) -> Closed:
        done = [mb for mb in self._microbatches.values() if mb.state is MicrobatchState.DONE]
        losses = tuple(mb.loss for mb in done if mb.loss is not None)
        lost = sum(mb.state is MicrobatchState.LOST for mb in self._microbatches.values())
        self.outcome = IterationOutcome(losses, lost, timed_out, self._reroutes)
        return Closed(self.outcome)

    def _in(self, microbatch: int, state: MicrobatchState) -> bool:
        mb = self._microbatches.get(microbatch)
        return not self.closed and mb is not None and mb.state is state

    def _get(self, microbatch: int) -> _Microbatch:
        mb = self._microbatches.get(microbatch)
        if mb is None:
            raise LocalProtocolError(f"iteration {self.number} has no microbatch {microbatch}")
        return mb
