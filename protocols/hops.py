"""A microbatch's messages along its path, sans-I/O: forward and backward hops, giving it up, and the
notice of a re-routed path to its data node."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from protocols._message import MAX_ID, MAX_TEXT, RUN, STAGE, Message
from protocols._schema import checked, count, flag, items, text
from protocols.errors import LocalProtocolError
from protocols.manifest import TensorSpec, manifest_field

MAX_PATH = 64  # hops of one microbatch path
MAX_NONCE = 2**63 - 1  # a microbatch's nonce: random, issued by its data node
MAX_VISITS = 4096  # microbatches of one iteration planned through one node
MAX_COHORT = 63  # data nodes a forward names (`_Hop.senders`: one bit each in a msgpack int)


@dataclass(frozen=True)
class _Hop(Message):
    """One hop of a microbatch along `path` (written by its data node, `path[0]`). `nonce` is a random
    number the data node issues per microbatch; every hop carries it on, and the data node takes the
    microbatch back (forward, backward, route notice) only with it, so a peer never sent the microbatch
    cannot forge its return."""

    run_id: str = field(metadata=checked(RUN))
    iteration: int = field(metadata=checked(count()))
    microbatch: int = field(metadata=checked(count()))
    path: tuple[str, ...] = field(metadata=checked(items(text(MAX_ID, 1), MAX_PATH, 1)))
    hop: int = field(metadata=checked(count(MAX_PATH - 1)))
    stages: tuple[int, ...] = field(metadata=checked(items(STAGE, MAX_PATH, 1)))
    visits: tuple[int, ...] = field(default=(), metadata=checked(items(count(MAX_VISITS), MAX_PATH)))
    tensors: tuple[TensorSpec, ...] = field(default=(), metadata=checked(manifest_field))
    evaluate: bool = field(default=False, metadata=checked(flag))
    nonce: int = field(default=0, metadata=checked(count(MAX_NONCE)))

    def _check(self) -> None:
        if self.hop >= len(self.path):
            raise LocalProtocolError(f"hop: {self.hop} is past the end of a path of {len(self.path)} peers")
        if len(self.stages) != len(self.path):
            raise LocalProtocolError(
                f"stages: {len(self.stages)} entries for a path of {len(self.path)} peers"
            )
        if self.visits and len(self.visits) != len(self.path):
            raise LocalProtocolError(
                f"visits: {len(self.visits)} entries for a path of {len(self.path)} peers"
            )


@dataclass(frozen=True)
class Forward(_Hop):
    """Activations of one microbatch, sent to `path[hop]`, which runs its layers and passes them on.

    `cohort` (sorted) are the iteration's data nodes and `senders[i]` those whose work the plan sends
    through `path[i]` in this iteration, bit j standing for `cohort[j]` (0, or both empty: not known), so a
    stage node knows whose work to wait for before it steps (`StepBook.take`).

    `weights_of` (evaluations only): the tick whose weights the validation pass measures, the data node's
    next one; a stage node runs it once it has stepped every older tick, so what a validation at step N
    measures does not depend on whether another data node's work of that tick was done before it came."""

    KIND: ClassVar[str] = "forward"
    cohort: tuple[str, ...] = field(default=(), metadata=checked(items(text(MAX_ID, 1), MAX_COHORT)))
    senders: tuple[int, ...] = field(default=(), metadata=checked(items(count(2**MAX_COHORT - 1), MAX_PATH)))
    weights_of: int = field(default=0, metadata=checked(count()))

    def senders_here(self) -> frozenset[str] | None:
        """The data nodes whose work the plan sends through `path[hop]` in this iteration, or None."""
        mask = self.senders[self.hop] if self.senders else 0
        return frozenset(peer for j, peer in enumerate(self.cohort) if mask >> j & 1) if mask else None

    def _check(self) -> None:
        super()._check()
        if self.weights_of and not self.evaluate:
            raise LocalProtocolError("weights_of: only a validation pass measures the weights of a tick")
        if list(self.cohort) != sorted(set(self.cohort)):
            raise LocalProtocolError("cohort: not sorted, or a data node named twice")
        if not self.senders:
            return
        if len(self.senders) != len(self.path):
            raise LocalProtocolError(
                f"senders: {len(self.senders)} entries for a path of {len(self.path)} peers"
            )
        if any(mask >> len(self.cohort) for mask in self.senders):
            raise LocalProtocolError(f"senders: a bit beyond the cohort of {len(self.cohort)} data nodes")
        origin = self.cohort.index(self.path[0]) if self.path[0] in self.cohort else None
        if origin is None or any(mask and not mask >> origin & 1 for mask in self.senders):
            raise LocalProtocolError("senders: a hop that does not name the data node whose path it is")


@dataclass(frozen=True)
class Backward(_Hop):
    """Gradients of one microbatch retracing `path` in reverse, sent to `path[hop]`."""

    KIND: ClassVar[str] = "backward"


@dataclass(frozen=True)
class Abort(Message):
    """Give up one microbatch of one iteration (a hop failed or timed out); drop what it holds."""

    KIND: ClassVar[str] = "abort"
    run_id: str = field(metadata=checked(RUN))
    origin: str = field(metadata=checked(text(MAX_ID, 1)))
    iteration: int = field(metadata=checked(count()))
    microbatch: int = field(metadata=checked(count()))
    reason: str = field(metadata=checked(text(MAX_TEXT)))


@dataclass(frozen=True)
class Route(Message):
    """Tell a microbatch's data node (`path[0]`) the path it really takes: the sender, `path[hop]`, re-routed
    the hop after it around a dead or refusing node, or skipped that stage. The data node then watches the
    peers the microbatch really visits, not the ones it planned."""

    KIND: ClassVar[str] = "route"
    run_id: str = field(metadata=checked(RUN))
    iteration: int = field(metadata=checked(count()))
    microbatch: int = field(metadata=checked(count()))
    path: tuple[str, ...] = field(metadata=checked(items(text(MAX_ID, 1), MAX_PATH, 3)))
    hop: int = field(metadata=checked(count(MAX_PATH - 1, 1)))
    nonce: int = field(default=0, metadata=checked(count(MAX_NONCE)))

    def _check(self) -> None:
        if self.hop >= len(self.path) - 1:
            raise LocalProtocolError(
                f"hop: {self.hop} is not a stage node of a path of {len(self.path)} peers"
            )
        if self.path[0] != self.path[-1]:
            raise LocalProtocolError("path: does not return to the data node it starts from")
