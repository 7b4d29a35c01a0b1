"""NoLoCo outer step and pairing (spec/noloco.md), sans-I/O.

Every `inner_steps` optimizer steps a replica pairs with one random replica of its own stage and applies

    delta_i = alpha * delta_i + beta * (theta_bar - phi_bar) - gamma * (phi_i - phi_bar)
    phi_i   = phi_i + delta_i,   theta_i = phi_i

over its group G (itself plus at most one partner). Tensor maps are mappings name -> array-like (torch
tensors, numpy arrays); nothing here imports either.

Pairing: all replicas of a stage derive the same seed from (run, stage, outer step) with `pairing_seed`
and order the replicas they see by a hash of (seed, peer id): consecutive entries of that random order are
pairs, so equal views give every node the same uniform random perfect matching, and an odd node out is
alone. The lower peer id of a pair initiates the exchange. `PairingRound` is one node's side of it: it
says whom to contact, whether to accept a request, and turns a complete exchange into a paired outcome;
a decline, a failure, a timeout, or a partial, non-finite or out-of-bounds exchange (`protocols.bounds`)
becomes the lone-replica step (group {i}), so the outer step never blocks training and never mixes partial
or poisoned values.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from protocols._arraymap import (
    ArrayMap,
    check_same_layout,
    first_non_finite,
    layout_mismatch,
)
from protocols.bounds import drift_problem
from protocols.errors import LocalProtocolError
from protocols.messages import Decline


@dataclass(frozen=True)
class OuterConfig:
    """NoLoCo outer-loop settings; the defaults are the paper's. `gamma=None` ties gamma to beta."""

    alpha: float = 0.5
    beta: float = 0.7
    gamma: float | None = None
    inner_steps: int = 50
    group_size: int = 2

    def __post_init__(self) -> None:
        for name, value in (("alpha", self.alpha), ("beta", self.beta), ("gamma", self.outer_gamma)):
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if not number or not math.isfinite(value) or value < 0:
                raise LocalProtocolError(f"{name} must be a finite number >= 0, got {value!r}")
        if not isinstance(self.inner_steps, int) or self.inner_steps < 1:
            raise LocalProtocolError(f"inner_steps must be a positive int, got {self.inner_steps!r}")
        if self.group_size not in (1, 2):
            raise LocalProtocolError(f"group_size must be 1 (never pair) or 2, got {self.group_size!r}")

    @classmethod
    def diloco_baseline(cls) -> OuterConfig:
        """The paper's DiLoCo baseline settings (use with `diloco_outer_step`)."""
        return cls(alpha=0.3, beta=0.7, inner_steps=100)

    @property
    def outer_gamma(self) -> float:
        """The gamma in use: `gamma`, or `beta` when tied."""
        return self.beta if self.gamma is None else self.gamma

    def due(self, step: int, last: int) -> int | None:
        """The outer step due at clock `step` (the schedule position, counted from 1) after outer step
        `last`, or None. Outer step k falls due once the clock has reached k * inner_steps; the clock may
        jump past that boundary (a replica that saw no microbatch for a while), and the step is still due."""
        outer = self.outer_step_of(step)
        return outer if outer > last else None

    def outer_step_of(self, step: int) -> int:
        """The outer step whose boundary clock `step` has reached (0 before the first)."""
        return step // self.inner_steps


@dataclass(frozen=True)
class OuterResult:
    """The new slow weights and momentum; the caller also sets theta_i (the model) to `phi`."""

    phi: dict[str, Any]
    delta: dict[str, Any]


def noloco_outer_step(
    config: OuterConfig,
    phi: ArrayMap,
    theta: ArrayMap,
    delta: ArrayMap | None,
    partner_phis: Sequence[ArrayMap] = (),
    partner_thetas: Sequence[ArrayMap] = (),
) -> OuterResult:
    """One NoLoCo outer step of replica i over the group {i} + partners.

    `delta=None` means a zero momentum buffer (the first outer step). With no partners this is the
    lone-replica lookahead step. Raises LocalProtocolError on mismatched names or shapes.
    """
    if len(partner_phis) != len(partner_thetas):
        raise LocalProtocolError(
            f"{len(partner_phis)} partner phi maps but {len(partner_thetas)} partner theta maps"
        )
    labelled = [("theta", theta)]
    labelled += [(f"partner {k} phi", m) for k, m in enumerate(partner_phis)]
    labelled += [(f"partner {k} theta", m) for k, m in enumerate(partner_thetas)]
    if delta is not None:
        labelled.append(("delta", delta))
    check_same_layout(phi, labelled)

    share = 1.0 / (1 + len(partner_phis))
    new_phi, new_delta = {}, {}
    for name, own in phi.items():  # name by name, so temporaries stay one tensor large
        phi_bar = _mean([own, *(p[name] for p in partner_phis)], share)
        theta_bar = _mean([theta[name], *(t[name] for t in partner_thetas)], share)
        step = (theta_bar - phi_bar) * config.beta - (own - phi_bar) * config.outer_gamma
        if delta is not None:
            step = step + delta[name] * config.alpha
        new_delta[name] = step
        new_phi[name] = own + step
    return OuterResult(phi=new_phi, delta=new_delta)


def _mean(values: list[Any], share: float) -> Any:
    total = values[0]
    for value in values[1:]:
        total = total + value
    return total * share


def diloco_outer_step(
    config: OuterConfig, phi: ArrayMap, delta: ArrayMap | None, thetas: Sequence[ArrayMap]
) -> OuterResult:
    """The DiLoCo heavy-ball outer step: NoLoCo with G = all replicas, which share `phi`.

    `thetas` holds every replica's fast weights (this one's included). With equal phi across the group
    the gamma term vanishes: delta = alpha * delta + beta * (mean(thetas) - phi); phi += delta.
    """
    if not thetas:
        raise LocalProtocolError("diloco_outer_step needs at least one replica's theta")
    others = thetas[1:]
    return noloco_outer_step(config, phi, thetas[0], delta, [phi] * len(others), others)


def pairing_seed(run_id: str, stage: int, outer_step: int) -> int:
    """A seed every replica of `stage` derives alike for `outer_step`, and that changes every outer step."""
    digest = hashlib.sha256(f"noloco/{run_id}/{stage}/{outer_step}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def match_replicas(replicas: Iterable[str], seed: int, group_size: int = 2) -> tuple[tuple[str, ...], ...]:
    """A random partition of the replicas into groups of `group_size` (one may be smaller), sorted.

    The order is a hash of (seed, peer id), so it depends only on the set of peers and the seed: equal
    views and seeds give equal matchings on every node, whatever order the views list peers in.
    """
    if group_size < 1:
        raise LocalProtocolError(f"group_size must be positive, got {group_size}")
    order = sorted(set(replicas), key=lambda peer: (hashlib.sha256(f"{seed}/{peer}".encode()).digest(), peer))
    return tuple(sorted(tuple(sorted(order[i : i + group_size])) for i in range(0, len(order), group_size)))


def find_partner(me: str, replicas: Iterable[str], seed: int, group_size: int = 2) -> str | None:
    """My partner in this outer step's matching (I am added to the view if missing), or None if alone."""
    if group_size not in (1, 2):
        raise LocalProtocolError(f"pairing supports groups of 1 or 2, got {group_size}")
    groups = match_replicas({*replicas, me}, seed, group_size)
    mine = next(group for group in groups if me in group)
    return next((peer for peer in mine if peer != me), None)


class Phase(StrEnum):
    """Where one node's pairing round stands."""

    WAITING = "waiting"
    PAIRED = "paired"
    ALONE = "alone"


@dataclass(frozen=True)
class Outcome:
    """How a round ended. Pass `partner_phis`/`partner_thetas` (empty when alone) to `noloco_outer_step`."""

    phase: Phase
    partner: str | None
    reason: str
    partner_phis: tuple[ArrayMap, ...] = ()
    partner_thetas: tuple[ArrayMap, ...] = ()


def exchange_problem(sender: str, phi: ArrayMap, theta: ArrayMap, own_phi: ArrayMap) -> str | None:
    """Why a partner's phi and theta cannot be averaged with `own_phi`, in words, or None if they can: they
    must be complete (`own_phi`'s names and shapes), finite and within `bounds.MAX_DRIFT` of `own_phi`."""
    for label, tensors in (("phi", phi), ("theta", theta)):
        problem = layout_mismatch(own_phi, tensors)
        if problem is not None:
            return f"partial or mismatched exchange with {sender} ({label}: {problem})"
        bad = first_non_finite(tensors)
        if bad is not None:
            return f"non-finite {label} {bad!r} from {sender}"
    far = drift_problem(own_phi, (("phi", phi), ("theta", theta)))
    return None if far is None else f"out-of-bounds exchange with {sender}: {far}"


class PairingRound:
    """One replica's side of the pairing for one outer step, like h11's Connection: events in, no I/O.

    The caller owns the network and the clock. If `initiator`, it sends its phi and theta to `partner`;
    otherwise it waits for the partner's request and asks `decline` before replying with its own
    (pre-step) phi and theta. Either way it hands the partner's tensors to `deliver`, reports transport
    failures and declines to `fail`, and calls `tick` with the time so a silent partner times out. Once
    `outcome` is set it never changes. A request for an outer step this node has not reached yet may be
    parked by the caller until its own round starts; a paired responder whose reply is lost steps with
    the pair while the initiator steps alone, which is harmless: each replica updates only itself.
    """

    def __init__(
        self,
        *,
        outer_step: int,
        me: str,
        replicas: Iterable[str],
        seed: int,
        now: float,
        timeout_s: float,
        group_size: int = 2,
    ) -> None:
        if not math.isfinite(timeout_s) or timeout_s <= 0:
            raise LocalProtocolError(f"timeout_s must be positive, got {timeout_s!r}")
        self.outer_step = outer_step
        self.me = me
        self.partner = find_partner(me, replicas, seed, group_size)
        self.deadline = now + timeout_s
        self.outcome: Outcome | None = None
        if self.partner is None:
            self.outcome = Outcome(Phase.ALONE, None, "no partner in this outer step's matching")

    @property
    def initiator(self) -> bool:
        """Whether this node sends the request (the lower peer id of the pair does)."""
        return self.partner is not None and self.me < self.partner

    @property
    def phase(self) -> Phase:
        return Phase.WAITING if self.outcome is None else self.outcome.phase

    def decline(self, sender: str, outer_step: int) -> tuple[Decline, str] | None:
        """None to accept an averaging request from `sender`, else why to decline it (and in words)."""
        if outer_step > self.outer_step:
            return Decline.NOT_REACHED, f"outer step {outer_step} not reached, at {self.outer_step}"
        if outer_step != self.outer_step:
            return (
                Decline.OTHER_OUTER_STEP,
                f"request for outer step {outer_step}, this node is at outer step {self.outer_step}",
            )
        if self.outcome is not None:
            return Decline.FINISHED, f"outer step {self.outer_step} already finished ({self.outcome.phase})"
        if sender != self.partner:
            return Decline.NOT_PARTNER, f"{sender} is not this node's partner in outer step {self.outer_step}"
        if self.initiator:
            return Decline.INITIATOR, f"{self.me} initiates this pair's exchange; {sender} should wait for it"
        return None

    def deliver(self, sender: str, phi: ArrayMap, theta: ArrayMap, own_phi: ArrayMap) -> Outcome:
        """The partner's phi and theta arrived. Complete, finite and within `bounds.MAX_DRIFT` of `own_phi`:
        paired; anything else: alone.

        Late deliveries after the round ended are ignored (the old outcome is returned).
        """
        return self.deliver_checked(sender, phi, theta, exchange_problem(sender, phi, theta, own_phi))

    def deliver_checked(self, sender: str, phi: ArrayMap, theta: ArrayMap, problem: str | None) -> Outcome:
        """`deliver`, with `exchange_problem`'s verdict on the tensors already found (by a caller that ran it
        off its event loop: it reads every value twice): None pairs, a problem ends the round alone."""
        if self.outcome is not None:
            return self.outcome
        if sender != self.partner:
            raise LocalProtocolError(f"deliver from {sender}, but the partner is {self.partner}")
        if problem is not None:
            return self._alone(problem)
        self.outcome = Outcome(Phase.PAIRED, sender, f"paired with {sender}", (phi,), (theta,))
        return self.outcome

    def fail(self, reason: str) -> Outcome:
        """The exchange failed (partner vanished, declined, RPC error): step alone. No-op once ended."""
        if self.outcome is not None:
            return self.outcome
        return self._alone(f"exchange with {self.partner} failed: {reason}")

    def tick(self, now: float) -> Outcome | None:
        """Advance the clock: past the deadline a waiting round ends alone. Returns the outcome, if any."""
        if self.outcome is None and now >= self.deadline:
            self._alone(f"timed out waiting for {self.partner}")
        return self.outcome

    def _alone(self, reason: str) -> Outcome:
        self.outcome = Outcome(Phase.ALONE, None, reason)
        return self.outcome
