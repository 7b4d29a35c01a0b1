"""SkipPipe's path constraints 1-6 and a validator that lists every broken one.

1. Stage 0 is never skipped: a path starts at a data node and returns to the same one, and every data node
   starts exactly `microbatches_per_data_node` microbatches.
2. Fixed length: every path visits the same number of transformer stages (set by `skip_ratio`), and only
   nodes of transformer stages between its two ends.
3. A path visits each stage at most once.
4. Order: going back below the highest stage reached so far (a swap) is allowed only to the adjacent stage,
   at most `max_swaps` times with total distance `max_swap_distance`; a forward jump past the highest
   stage reached so far spans at most `max_forward_jump` stages (stage 0 counts as reached).
5. Balanced coverage: the transformer stages' visit counts differ by at most one.
6. Memory: no node holds more than `memory` microbatches at once, so the plan must complete under that
   limit (checked by simulation: a memory deadlock breaks it).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from protocols.errors import LocalProtocolError
from protocols.skippipe.plan import Plan
from protocols.skippipe.simulator import simulate
from protocols.skippipe.swarm import SwarmView


@dataclass(frozen=True)
class PathRules:
    """The knobs of constraints 1-6 and CheckFree+.

    `skip_ratio` is (stages left out) / (transformer stages); 0 visits every stage. With
    `checkfree_plus_share` > 0 about that share of the microbatches swap the first two and the last two
    transformer stages (E, S2, S1, S3.., Ss, S(s-1), E'). `replica_mixing` is the share of (data node,
    replicated stage) pairs for which the scheduler draws, each iteration, a replica the data node must
    reach (so no data node stays pinned to one replica); 0 lets it always take the fastest.
    """

    microbatches_per_data_node: int
    skip_ratio: float = 0.0
    max_swaps: int = 2
    max_swap_distance: int = 2
    max_forward_jump: int = 4
    memory: int = 3
    checkfree_plus_share: float = 0.0
    replica_mixing: float = 0.25

    def __post_init__(self) -> None:
        if self.microbatches_per_data_node < 1:
            raise LocalProtocolError("microbatches_per_data_node must be at least 1")
        if not 0.0 <= self.skip_ratio < 1.0:
            raise LocalProtocolError(f"skip_ratio must lie in [0, 1), got {self.skip_ratio!r}")
        if self.max_swaps < 0 or self.max_swap_distance < 0:
            raise LocalProtocolError("max_swaps and max_swap_distance must be non-negative")
        if self.max_forward_jump < 1:
            raise LocalProtocolError("max_forward_jump must be at least 1")
        if self.memory < 1:
            raise LocalProtocolError("memory must be at least 1 microbatch")
        for name in ("checkfree_plus_share", "replica_mixing"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise LocalProtocolError(f"{name} must lie in [0, 1], got {getattr(self, name)!r}")

    @classmethod
    def visiting(cls, visited_stages: int, total_stages: int, **knobs: Any) -> PathRules:
        """Rules whose paths visit `visited_stages` of `total_stages` stages, both counting stage 0."""
        if not 2 <= visited_stages <= total_stages:
            raise LocalProtocolError(
                f"cannot visit {visited_stages} of {total_stages} stages (stage 0 included)"
            )
        skipped = total_stages - visited_stages
        return cls(skip_ratio=skipped / (total_stages - 1), **knobs)

    def stages_per_path(self, n_stages: int) -> int:
        """Transformer stages each path visits, out of `n_stages`."""
        return max(1, n_stages - round(self.skip_ratio * n_stages))


@dataclass(frozen=True)
class Violation:
    """One broken constraint: its number (1-6), the microbatch (None: the plan as a whole) and why."""

    rule: int
    microbatch: int | None
    reason: str


def order_violations(stages: Sequence[int], rules: PathRules) -> list[str]:
    """Reasons why this stage order breaks rule 4 (empty when it is fine)."""
    reasons = []
    frontier = swaps = distance = 0
    for stage in stages:
        if stage < frontier:
            swaps += 1
            distance += frontier - stage
            if frontier - stage > 1:
                reasons.append(f"swap back from stage {frontier} to {stage} is not adjacent")
        elif stage - frontier > rules.max_forward_jump:
            reasons.append(f"jump from stage {frontier} to {stage} exceeds {rules.max_forward_jump}")
        frontier = max(frontier, stage)
    if swaps > rules.max_swaps:
        reasons.append(f"{swaps} swaps exceed {rules.max_swaps}")
    if distance > rules.max_swap_distance:
        reasons.append(f"total swap distance {distance} exceeds {rules.max_swap_distance}")
    return reasons


def validate_plan(
    plan: Plan | Mapping[int, Sequence[int]], view: SwarmView, rules: PathRules
) -> list[Violation]:
    """Every violation of rules 1-6 by `plan` (a Plan or its paths), in rule then microbatch order."""
    paths = plan.paths if isinstance(plan, Plan) else plan
    found: list[Violation] = []
    started: Counter[int] = Counter()
    visits: defaultdict[int, list[int]] = defaultdict(list)
    simulable = True
    k = rules.stages_per_path(view.n_stages)
    data_nodes = set(view.data_nodes)
    for mb in sorted(paths):
        path = tuple(paths[mb])

        def broke(rule: int, reason: str, mb: int = mb) -> None:
            found.append(Violation(rule, mb, reason))

        if len(path) < 2 or path[0] not in data_nodes or path[-1] != path[0]:
            broke(1, f"path {path} does not leave from and return to one data node")
            simulable = False
        else:
            started[path[0]] += 1
        interior = path[1:-1]
        unknown = [v for v in interior if not (isinstance(v, int) and 0 <= v < view.n_nodes)]
        if unknown:
            broke(2, f"nodes {unknown} are not in the swarm")
            simulable = False
            continue
        if any(v in data_nodes for v in interior):
            broke(1, "stage 0 is visited in the middle of the path")
        if len(interior) != k or not interior:
            broke(2, f"visits {len(interior)} transformer stages, every path visits {k}")
            simulable = simulable and bool(interior)
        stages = [view.stage_of[v] for v in interior if view.stage_of[v] != 0]
        repeated = sorted(s for s, n in Counter(stages).items() if n > 1)
        if repeated:
            broke(3, f"visits stages {repeated} more than once")
        for reason in order_violations(stages, rules):
            broke(4, reason)
        for stage in stages:
            visits[stage].append(mb)
    m = rules.microbatches_per_data_node
    for data in view.data_nodes:
        if started[data] != m:
            found.append(Violation(1, None, f"data node {data} starts {started[data]} microbatches, not {m}"))
    found += _coverage_violations(visits, view, rules, k)
    if simulable and paths:
        for mb in simulate(paths, view, rules.memory).stuck:
            found.append(
                Violation(6, mb, f"cannot finish: a memory deadlock with {rules.memory} slots per node")
            )
    return sorted(found, key=lambda v: (v.rule, -1 if v.microbatch is None else v.microbatch))


def _coverage_violations(
    visits: Mapping[int, list[int]], view: SwarmView, rules: PathRules, k: int
) -> list[Violation]:
    expected = len(view.data_nodes) * rules.microbatches_per_data_node * k
    low, high = expected // view.n_stages, math.ceil(expected / view.n_stages)
    found = []
    for stage in range(1, view.n_stages + 1):
        mbs = sorted(visits.get(stage, []))
        if len(mbs) < low:
            found.append(Violation(5, None, f"stage {stage} gets {len(mbs)} visits, fewer than {low}"))
        for mb in mbs[high:]:
            found.append(Violation(5, mb, f"stage {stage} is over its quota of {high} visits"))
    return found
