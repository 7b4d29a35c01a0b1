"""CheckFree and CheckFree+ recovery (spec/checkfree.md): what to rebuild from, and the rebuild math.

Stages are numbered 0..s: stage 0 is the data stage holding the embedding E and the head E' (final norm,
output projection, loss); stages 1..s hold transformer layers. A stage is *alive* when at least one online
node serves it with trained weights (a node that is itself being rebuilt does not count). With CheckFree+,
nodes of stage 1 may hold a copy of E, nodes of stage s a copy of E', and (edge copies) nodes of stage 2 a
copy of stage 1's weights and nodes of stage s-1 one of stage s's (`copy_places`, `copies_kept`).

`plan_recovery` / `plan_recoveries` decide how each stage is (re)built, an edge stage from the copy its
partner's nodes keep or else from what they report they served in its place (`protocols.standins`);
`average_neighbours`, `copy_partner` and `restore_embeddings` compute the new weights, and `reinit_seed`
seeds a re-initialised stage's fresh ones. State dicts must be keyed by names relative to the stage (the
k-th layer of every stage under the same names), so that neighbours match key by key; stages with
different layouts cannot be averaged or copied and raise LocalProtocolError.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from protocols._arraymap import ArrayMap, check_same_layout, first_non_finite, weighted_sum
from protocols.errors import LocalProtocolError, RemoteProtocolError
from protocols.standins import MIN_STAND_INS, STAND_IN_WINDOW_STEPS
from protocols.transfers import EDGE_COPIES, StatePart

DEFAULT_LR_FACTOR = 1.1
SWAP_MIN_STAGES = 4  # CheckFree+ swaps need the first pair (S1, S2) and the last (S(s-1), Ss) to be apart
SWAP_EVERY = 2  # CheckFree+ swaps one microbatch in this many: the paper's half


def swaps_edge_pairs(num_stages: int, iteration: int, microbatch: int, every: int = SWAP_EVERY) -> bool:
    """Whether CheckFree+ runs this microbatch with its edge pairs swapped.

    Exactly one microbatch in `every` (the paper's every other), shifting by one between iterations (so a
    data node with a single microbatch per iteration swaps one iteration in `every`): every data node, and
    every replica its paths visit, sees both orders evenly, whatever the timing. Swapping fewer (`every` =
    4) was measured in one process (`benchmarks/repro/swap_share.py`, docs/swarm-quality.md). `microbatch`
    numbers the microbatches of the whole iteration across data nodes. Models of fewer than
    `SWAP_MIN_STAGES` transformer stages never swap: there the two pairs share a stage, and swapping both
    would permute most of the network (measured on a 3-stage model: the result then depends on timing; see
    docs/design.md).
    """
    if num_stages < 1 or iteration < 0 or microbatch < 0 or every < 2:
        query = f"{num_stages}, {iteration}, {microbatch}, every {every}"
        raise LocalProtocolError(f"invalid swap query ({query})")
    return num_stages >= SWAP_MIN_STAGES and (iteration + microbatch) % every == every - 1


def swap_partner(stage: int, num_stages: int) -> int | None:
    """The stage that stands in for edge stage `stage` (`protocols.standins.edge_places`): stage 2 for stage
    1, stage s-1 for stage s; None for other stages and for a model of one transformer stage."""
    if num_stages < 2 or stage not in (1, num_stages):
        return None
    return 2 if stage == 1 else num_stages - 1


def swap_edge_pairs(stages: tuple[int, ...], num_stages: int) -> tuple[int, ...]:
    """The positions of a path's stage hops in CheckFree+ order: (1, 2) at its start becomes (2, 1) and
    (s-1, s) at its end becomes (s, s-1), where the path visits them one after the other."""
    order = list(range(len(stages)))
    if len(stages) >= 2 and (stages[0], stages[1]) == (1, 2):
        order[0], order[1] = 1, 0
    if len(stages) >= 2 and (stages[-2], stages[-1]) == (num_stages - 1, num_stages) and num_stages > 2:
        order[-2], order[-1] = order[-1], order[-2]
    return tuple(order)


def copy_places(part: StatePart, num_stages: int) -> tuple[int, int] | None:
    """(the stage a CheckFree+ copy is taken from, the stage whose nodes keep it): E from stage 0 to stage
    1, E' from stage 0 to stage s, stage 1's weights to stage 2 and stage s's to stage s-1. None for a part
    that is no copy, and for the edge copies of a model of one transformer stage (no neighbour)."""
    s = num_stages
    places = {
        StatePart.EMBEDDING_COPY: (0, 1),
        StatePart.HEAD_COPY: (0, s),
        StatePart.FIRST_STAGE_COPY: (1, 2),
        StatePart.LAST_STAGE_COPY: (s, s - 1),
    }.get(part)
    if places is None or (part in EDGE_COPIES and s < 2):
        return None
    return places


def copy_source(part: StatePart, num_stages: int) -> int:
    """The stage a CheckFree+ copy is taken from (`copy_places`); LocalProtocolError for no copy."""
    places = copy_places(part, num_stages)
    if places is None:
        raise LocalProtocolError(f"{part} is no copy a model of {num_stages} transformer stages keeps")
    return places[0]


def copies_kept(stage: int, num_stages: int, edge_copies: bool) -> tuple[StatePart, ...]:
    """The CheckFree+ copies a node of `stage` keeps: E at stage 1, E' at stage s, and with `edge_copies`
    stage 1's weights at stage 2 and stage s's at stage s-1 (so stage 2 keeps both in a 3-stage model)."""
    parts = [StatePart.EMBEDDING_COPY, StatePart.HEAD_COPY]
    if edge_copies:
        parts += [StatePart.FIRST_STAGE_COPY, StatePart.LAST_STAGE_COPY]
    return tuple(
        p for p in parts if (places := copy_places(p, num_stages)) is not None and places[1] == stage
    )


def edge_copy_part(stage: int, num_stages: int) -> StatePart | None:
    """The copy that rebuilds edge stage `stage` (`FIRST_STAGE_COPY` for stage 1, `LAST_STAGE_COPY` for
    stage s), kept by its swap partner's nodes; None for other stages and a model of one transformer stage."""
    if num_stages < 2:
        return None
    return {1: StatePart.FIRST_STAGE_COPY, num_stages: StatePart.LAST_STAGE_COPY}.get(stage)


class Method(StrEnum):
    """How a stage's weights are obtained."""

    REPLICA = "replica"  # a live replica of the stage exists: ordinary state transfer
    # middle stage: gradient-norm weighted average of both neighbours; an edge stage whose swap partner did
    # not serve in its place recently: the same average over its one transformer neighbour, a copy of it
    CHECKFREE = "checkfree"
    CHECKFREE_PLUS_COPY = "checkfree_plus_copy"  # stage 1 / stage s: copy of a partner that stood in for it
    EDGE_COPY = "edge_copy"  # stage 1 / stage s: its own weights, from the copy its swap partner's nodes keep
    EMBEDDING_COPY = "embedding_copy"  # stage 0: E from stage 1's copy, E' from stage s's copy
    REINIT = "reinit"  # nothing to rebuild from: fresh random weights


@dataclass(frozen=True)
class Recovery:
    """The plan for one stage, as data for the daemon to act on.

    `sources`: the stages to fetch from, in the order the method uses them (checkfree: (i-1, i+1);
    checkfree_plus_copy and edge_copy: (partner,); embedding_copy: (holder of E, holder of E'); replica:
    (stage,); reinit: ()). `reset_optimizer`: start Adam from zero moments and step 0. `lr_factor`:
    multiply the learning rate by it after the rebuild. `reason`: one plain sentence for logs and
    `swarmnode status`.
    """

    stage: int
    method: Method
    sources: tuple[int, ...]
    reset_optimizer: bool
    lr_factor: float
    reason: str


def plan_recovery(
    stage: int,
    *,
    num_stages: int,
    alive: Collection[int],
    checkfree_plus: bool,
    stood_in: Mapping[int, int],
    embedding_copy_held: bool,
    head_copy_held: bool,
    lr_factor: float = DEFAULT_LR_FACTOR,
    edge_swaps: bool = True,
    edge_copies_held: Collection[int] = (),
) -> Recovery:
    """How `stage` gets its weights, given which stages are alive.

    `num_stages` is s, the number of transformer stages. `stood_in[e]`, for edge stage e (1 or s): the most
    iterations of the last `STAND_IN_WINDOW_STEPS` steps in which one live, trained node of its swap partner
    (`swap_partner`) reports it served microbatches in e's place (`NodeRecord.stood_in`; missing: 0).
    `embedding_copy_held` / `head_copy_held`: a live node of stage 1 holds a copy of E / of stage s holds a
    copy of E' (only counted while that stage is alive); `edge_copies_held`: the edge stages (1, s) whose
    copy (`edge_copy_part`) a live node of their swap partner keeps. Rebuilt transformer stages reset the
    optimizer and scale the learning rate by `lr_factor`; restored embeddings and edge stages are exact
    copies, so they reset the optimizer (copies carry none) at lr factor 1; reinitialised stages reset it
    at lr factor 1.

    A lost edge stage whose copy a live partner node keeps is that copy (`edge_copy`): its own weights, a
    few steps old, which rebuild it better than any swap (docs/design.md). Otherwise it is a copy of its
    swap partner (`checkfree_plus_copy`) only with CheckFree+ on and a
    partner node that served in its place in at least `MIN_STAND_INS` iterations of that window (by swaps,
    unless the run turned them off (`edge_swaps`), or by paths that skipped the edge stage). Otherwise it
    is CheckFree's average over its one transformer neighbour, which is a copy of that neighbour, and the
    reason says why no partner's copy: the paper ranks a neighbour's copy above fresh weights
    (spec/checkfree.md, ablations); on the 3-stage tiny model it was better for stage 1 and as good for
    stage 3 (docs/design.md).
    """
    s, live = num_stages, set(alive)
    _check_plan_args(num_stages, (stage, *live), lr_factor)
    _check_stood_in(num_stages, checkfree_plus, stood_in)
    _check_edge_copies_held(num_stages, edge_copies_held)
    if not isinstance(edge_swaps, bool):
        raise LocalProtocolError(f"edge_swaps must be a bool, got {edge_swaps!r}")

    def plan(method: Method, sources: tuple[int, ...], reason: str) -> Recovery:
        fresh = method is not Method.REPLICA
        factor = lr_factor if method in (Method.CHECKFREE, Method.CHECKFREE_PLUS_COPY) else 1.0
        return Recovery(stage, method, sources, fresh, float(factor), reason)

    def reinit(why: str) -> Recovery:
        return plan(Method.REINIT, (), f"stage {stage} cannot be rebuilt: {why}; re-initialising it")

    if stage in live:
        return plan(Method.REPLICA, (stage,), f"stage {stage} has a live replica: copy its state")

    if stage == 0:
        problems = []
        for holder, part, held in ((1, "E", embedding_copy_held), (s, "E'", head_copy_held)):
            if holder not in live:
                problems.append(f"stage {holder}, which holds the copy of {part}, is lost too")
            elif not held:
                problems.append(f"no live node of stage {holder} holds a copy of {part}")
        if problems:
            return reinit(" and ".join(problems))
        return plan(
            Method.EMBEDDING_COPY,
            (1, s),
            f"stage 0 restored from the copy of E on stage 1 and the copy of E' on stage {s}",
        )

    if s == 1:
        return reinit("it is the only transformer stage, so it has no neighbour to rebuild from")
    partner = swap_partner(stage, s)
    if partner is not None:
        if partner not in live:
            return reinit(
                f"its only transformer neighbour, stage {partner}, is lost too (two adjacent stages lost)"
            )
        if checkfree_plus and stage in edge_copies_held:
            return plan(
                Method.EDGE_COPY,
                (partner,),
                f"stage {stage} restored from the copy of its weights kept by stage {partner}",
            )
        served = stood_in.get(stage, 0)
        if checkfree_plus and served >= MIN_STAND_INS:
            return plan(
                Method.CHECKFREE_PLUS_COPY,
                (partner,),
                f"stage {stage} rebuilt as a copy of stage {partner}, its CheckFree+ swap partner: a node of "
                f"stage {partner} served microbatches in stage {stage}'s place in {served} of the last "
                f"{STAND_IN_WINDOW_STEPS} steps",
            )
        why = _no_stand_in(stage, partner, s, checkfree_plus, edge_swaps, served)
        return plan(
            Method.CHECKFREE,
            (partner,),
            f"stage {stage} rebuilt as a copy of stage {partner}, its only transformer neighbour (no swap "
            f"partner's copy: {why}; a neighbour's copy recovers at least as well as fresh weights)",
        )

    lost_neighbours = [k for k in (stage - 1, stage + 1) if k not in live]
    if lost_neighbours:
        lost = " and ".join(f"stage {k}" for k in lost_neighbours)
        return reinit(f"its neighbour {lost} is lost too (adjacent stages lost)")
    return plan(
        Method.CHECKFREE,
        (stage - 1, stage + 1),
        f"stage {stage} rebuilt as the gradient-norm weighted average of stages {stage - 1} and {stage + 1}",
    )


def _no_stand_in(
    stage: int, partner: int, num_stages: int, checkfree_plus: bool, edge_swaps: bool, served: int
) -> str:
    """Why a lost edge stage is no copy of itself or of its swap partner, in words."""
    if not checkfree_plus:
        return "CheckFree+ is off"
    why = f"no live node of stage {partner} keeps a copy of it; "
    if served == 0:
        why += f"no live node of stage {partner} served a microbatch in stage {stage}'s place"
        why += f" in the last {STAND_IN_WINDOW_STEPS} steps"
    else:
        why += f"live nodes of stage {partner} served microbatches in stage {stage}'s place in at most"
        why += f" {served} of the last {STAND_IN_WINDOW_STEPS} steps, fewer than {MIN_STAND_INS}"
    if num_stages < SWAP_MIN_STAGES:
        why += f"; a model of {num_stages} transformer stages never swaps"
        why += f" (CheckFree+ swaps need {SWAP_MIN_STAGES})"
    elif not edge_swaps:
        why += "; this run does not swap edge stages (edge swaps off)"
    return why


def plan_recoveries(
    *,
    num_stages: int,
    alive: Collection[int],
    checkfree_plus: bool,
    stood_in: Mapping[int, int],
    embedding_copy_held: bool,
    head_copy_held: bool,
    lr_factor: float = DEFAULT_LR_FACTOR,
    edge_swaps: bool = True,
    edge_copies_held: Collection[int] = (),
) -> dict[int, Recovery]:
    """The plan for every lost stage (stages 0..s not in `alive`), keyed by stage, in stage order."""
    live = set(alive)
    _check_plan_args(num_stages, live, lr_factor)
    plans = {}
    for k in range(num_stages + 1):
        if k not in live:
            plans[k] = plan_recovery(
                k,
                num_stages=num_stages,
                alive=live,
                checkfree_plus=checkfree_plus,
                stood_in=stood_in,
                embedding_copy_held=embedding_copy_held,
                head_copy_held=head_copy_held,
                lr_factor=lr_factor,
                edge_swaps=edge_swaps,
                edge_copies_held=edge_copies_held,
            )
    return plans


def reinit_seed(run_seed: int, stage: int, step: int) -> int:
    """The seed of the fresh weights of `stage` re-initialised at swarm step `step`: a 63-bit hash of the
    run's seed, the stage and the step, so not the run's seed (whose step-0 weights every node of a fresh
    swarm starts from). Replicas re-initialised at the same step draw the same weights."""
    values = (run_seed, stage, step)
    if any(isinstance(v, bool) or not isinstance(v, int) for v in values) or stage < 0 or step < 0:
        raise LocalProtocolError(f"invalid re-initialisation seed query {values!r}")
    digest = hashlib.sha256(f"swarmnode/reinit/{run_seed}/{stage}/{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def average_neighbours(
    previous: ArrayMap,
    following: ArrayMap,
    previous_grad_norm: float | None,
    following_grad_norm: float | None,
) -> dict[str, Any]:
    """CheckFree: W_i = (w_{i-1} W_{i-1} + w_{i+1} W_{i+1}) / (w_{i-1} + w_{i+1}), tensor by tensor.

    The weights w are the neighbours' L2 gradient norms at their last optimizer step, measured BEFORE
    clipping (the value `torch.nn.utils.clip_grad_norm_` returns): after clipping at 1.0 both saturate
    at 1 while gradients are large and the weighting would degenerate to a plain average. A weight of 0
    is allowed (the other neighbour is copied); if a norm is unknown (None) or both are 0 the result is
    the plain average. Negative or non-finite norms, mismatched names or shapes and non-finite weights
    raise LocalProtocolError.
    """
    for label, norm in (("previous", previous_grad_norm), ("following", following_grad_norm)):
        if norm is None:
            continue
        number = isinstance(norm, int | float) and not isinstance(norm, bool)
        if not number or not math.isfinite(norm) or norm < 0:
            raise LocalProtocolError(f"{label} gradient norm must be finite and >= 0, got {norm!r}")
    check_same_layout(previous, [("following stage", following)])
    _check_finite(("previous stage", previous), ("following stage", following))
    if (
        previous_grad_norm is None
        or following_grad_norm is None
        or previous_grad_norm + following_grad_norm == 0
    ):
        weights = [0.5, 0.5]
    else:
        total = previous_grad_norm + following_grad_norm
        weights = [previous_grad_norm / total, following_grad_norm / total]
    return weighted_sum([previous, following], weights)


def copy_partner(partner: ArrayMap) -> dict[str, Any]:
    """Stage 1 (stage s) becomes a copy of stage 2 (stage s-1): its CheckFree+ swap partner, or, where no
    swap ran, its only transformer neighbour (CheckFree's average over one neighbour)."""
    _check_finite(("swap partner", partner))
    return dict(partner)


def restore_embeddings(embedding_copy: ArrayMap, head_copy: ArrayMap) -> dict[str, Any]:
    """CheckFree+: stage 0's state, exactly, from the copy of E (stage 1) and the copy of E' (stage s)."""
    overlap = sorted(set(embedding_copy) & set(head_copy))
    if overlap:
        raise LocalProtocolError(f"the copies of E and E' both hold {overlap[:3]}")
    _check_finite(("copy of E", embedding_copy), ("copy of E'", head_copy))
    return {**embedding_copy, **head_copy}


def replica_lr_factor(donor_lr_factor: float, lr_factor: float = DEFAULT_LR_FACTOR) -> float:
    """The lr factor of a node that copies a live replica: the donor's, which the rules above set to 1 or, on
    a stage rebuilt by CheckFree(+), to `lr_factor`. Any other value is a donor's lie: RemoteProtocolError."""
    for allowed in (1.0, lr_factor):
        if math.isclose(donor_lr_factor, allowed):
            return float(allowed)
    raise RemoteProtocolError(f"donor lr factor {donor_lr_factor!r} is neither 1 nor {lr_factor:g}")


def _check_plan_args(num_stages: int, stages: Collection[int], lr_factor: float) -> None:
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise LocalProtocolError(f"num_stages must be a positive int, got {num_stages!r}")
    if not isinstance(lr_factor, int | float) or not math.isfinite(lr_factor) or lr_factor <= 0:
        raise LocalProtocolError(f"lr_factor must be a finite number > 0, got {lr_factor!r}")
    for k in stages:
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= num_stages:
            raise LocalProtocolError(f"stage {k!r} is not in 0..{num_stages}")


def _check_stood_in(num_stages: int, checkfree_plus: bool, stood_in: Mapping[int, int]) -> None:
    if not isinstance(checkfree_plus, bool):
        raise LocalProtocolError(f"checkfree_plus must be a bool, got {checkfree_plus!r}")
    for edge, served in stood_in.items():
        valid = isinstance(served, int) and not isinstance(served, bool) and served >= 0
        if swap_partner(edge, num_stages) is None or not valid:
            raise LocalProtocolError(
                f"stood_in {edge!r}: {served!r} is no count for an edge stage of {num_stages} stages"
            )


def _check_edge_copies_held(num_stages: int, held: Collection[int]) -> None:
    for edge in held:
        if isinstance(edge, bool) or not isinstance(edge, int) or edge_copy_part(edge, num_stages) is None:
            raise LocalProtocolError(f"edge_copies_held: {edge!r} is no edge stage of {num_stages} stages")


def _check_finite(*labelled: tuple[str, ArrayMap]) -> None:
    for label, tensors in labelled:
        bad = first_non_finite(tensors)
        if bad is not None:
            raise LocalProtocolError(f"{label}: tensor {bad!r} holds NaN or infinity")
