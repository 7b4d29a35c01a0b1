"""What goes into and comes out of a data node's iteration machine (`protocols.iteration.DataIteration`).

Events are what the data node reports: its own progress (a microbatch sent, the loss computed, the clock)
and what peers said (activations or a gradient back, a route notice, an abort, the answers to pings).
Actions are what it carries out: embed and send, compute the loss, send or apply a gradient, drop a
microbatch and abort it along its path, ping and suspect peers, close the iteration. All frozen values.
"""

from __future__ import annotations

from dataclasses import dataclass

# ---- events ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Start:
    """The iteration starts at `now`: its deadline is `now + timeout_s`."""

    now: float


@dataclass(frozen=True)
class Sent:
    """The first hop took the microbatch, along `path` (the router may have re-routed that hop)."""

    microbatch: int
    path: tuple[str, ...]


@dataclass(frozen=True)
class Unsent:
    """No replica of the first hop took the microbatch."""

    microbatch: int


@dataclass(frozen=True)
class Returned:
    """Activations came back to the data node (a forward at a path's last hop) along `path`."""

    origin: str
    iteration: int
    microbatch: int
    nonce: int
    path: tuple[str, ...]


@dataclass(frozen=True)
class RouteNotice:
    """`peer` says it is hop `hop` of `path` and re-routed the hop after it: the microbatch takes `path`."""

    peer: str
    origin: str
    iteration: int
    microbatch: int
    nonce: int
    path: tuple[str, ...]
    hop: int


@dataclass(frozen=True)
class LossComputed:
    """The head computed the microbatch's loss (training: and the gradient that goes back now)."""

    microbatch: int
    loss: float


@dataclass(frozen=True)
class HeadFailed:
    """The head could not compute the loss or its gradient (a float16 overflow)."""

    microbatch: int
    reason: str


@dataclass(frozen=True)
class BackwardFailed:
    """The gradient could not be sent back to the last stage of the path."""

    microbatch: int


@dataclass(frozen=True)
class GradientReturned:
    """`peer` sent the microbatch's gradient back to the embedding."""

    peer: str
    origin: str
    iteration: int
    microbatch: int
    nonce: int


@dataclass(frozen=True)
class GradientApplied:
    """The backward pass through the embedding ran: the microbatch's gradient is in this iteration's step."""

    microbatch: int


@dataclass(frozen=True)
class AbortReceived:
    """A peer that may abort the microbatch (`DataIteration.may_abort`) gave it up."""

    origin: str
    iteration: int
    microbatch: int
    reason: str


@dataclass(frozen=True)
class Tick:
    """The clock: past the deadline the iteration closes; before it, the pending paths' peers are pinged."""

    now: float


@dataclass(frozen=True)
class PeersChecked:
    """The answers to a `Ping` sent at `now`: `silent` are the peers that did not answer, `unreachable` those
    of them that could not even be reached (refused, no such peer: gone, not slow)."""

    now: float
    silent: frozenset[str]
    unreachable: frozenset[str] = frozenset()


Event = (
    Start
    | Sent
    | Unsent
    | Returned
    | RouteNotice
    | LossComputed
    | HeadFailed
    | BackwardFailed
    | GradientReturned
    | GradientApplied
    | AbortReceived
    | Tick
    | PeersChecked
)


# ---- actions ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    """Embed the microbatch and send it to its first hop, with its nonce; report `Sent` or `Unsent`."""

    microbatch: int
    path: tuple[str, ...]
    nonce: int


@dataclass(frozen=True)
class ComputeLoss:
    """Compute the loss of the returned activations (training: and their gradient); report `LossComputed`
    or `HeadFailed`."""

    microbatch: int


@dataclass(frozen=True)
class SendGradient:
    """Send the head's gradient back along the path the activations came; report `BackwardFailed` if not."""

    microbatch: int


@dataclass(frozen=True)
class ApplyGradient:
    """Run the backward pass through the embedding if `may_apply` still says so; report `GradientApplied`."""

    microbatch: int


@dataclass(frozen=True)
class Drop:
    """The microbatch is lost: drop what is held of it."""

    microbatch: int
    reason: str


@dataclass(frozen=True)
class AbortPath:
    """Tell every node of `path` (but this one) to drop the microbatch."""

    microbatch: int
    path: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Ping:
    """Ask whether `peers` are alive; report `PeersChecked`."""

    peers: tuple[str, ...]


@dataclass(frozen=True)
class Suspect:
    """`peer` did not answer: plan and route around it for a while."""

    peer: str


@dataclass(frozen=True)
class IterationOutcome:
    """How an iteration ended: the losses of the microbatches done (in microbatch order), how many were lost,
    whether the deadline closed it, and how many route notices changed a path."""

    losses: tuple[float, ...]
    lost: int
    timed_out: bool
    reroutes: int


@dataclass(frozen=True)
class Closed:
    """The iteration is over: step (or discard) with `outcome`; every later message about it is stale."""

    outcome: IterationOutcome


Action = Send | ComputeLoss | SendGradient | ApplyGradient | Drop | AbortPath | Ping | Suspect | Closed
