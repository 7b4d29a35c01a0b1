"""SkipPipe path scheduling, sans-I/O.

Describe the swarm with a `SwarmView` and the path constraints with `PathRules`, then call
`schedule(view, rules, seed)` for a collision-aware `Plan`: one path per microbatch, from its data node
through a subset of the transformer stages and back. `simulate` times any set of paths, `validate_plan`
lists every broken constraint, `mix_replicas` deals a plan's replicas out anew (the live swarm's
NoLoCo mixing), and the baselines (`full_pipeline_plan`, `skips_without_collision_awareness`,
`skippipe_without_collision_avoidance`, all in `METHODS`) give the comparison points.
"""

from protocols.skippipe.baselines import (
    METHODS,
    full_pipeline_plan,
    skippipe_without_collision_avoidance,
    skips_without_collision_awareness,
)
from protocols.skippipe.plan import Plan
from protocols.skippipe.rules import PathRules, Violation, validate_plan
from protocols.skippipe.scenario import Scenario, scenario_from_dict
from protocols.skippipe.scheduler import schedule
from protocols.skippipe.sequences import is_checkfree_plus
from protocols.skippipe.simulator import SimResult, simulate
from protocols.skippipe.spread import mix_replicas
from protocols.skippipe.swarm import SwarmView

__all__ = [
    "METHODS",
    "PathRules",
    "Plan",
    "Scenario",
    "SimResult",
    "SwarmView",
    "Violation",
    "full_pipeline_plan",
    "is_checkfree_plus",
    "mix_replicas",
    "scenario_from_dict",
    "schedule",
    "simulate",
    "skippipe_without_collision_avoidance",
    "skips_without_collision_awareness",
    "validate_plan",
]
