"""The local swarm behind `swarmnode up`: process supervision, failure injection, live display, report.

Modules by purpose: `procs` (children in their own process groups), `kill_plan` (kills by step and at random),
`record` and `report` (figures, report.json, loss.png), `display` (progress lines), `observe` (DHT snapshots
from a child process), `config` (settings and child command lines), `nodes` (the daemons as tracked),
`local_swarm` (the supervisor) and `result` (a run's outcome, and the report written at its end). The daemons'
JSON lines are read with `swarmnode.event_schema`, which their emitter checks them against.
"""

from swarmnode.launcher.config import FAIL_RATE_UNIT, STALL_TIMEOUT_S, SwarmConfig
from swarmnode.launcher.kill_plan import KillPlan, RandomKills, StageKill, parse_stage_kill
from swarmnode.launcher.local_swarm import LocalSwarm
from swarmnode.launcher.result import RunOutcome, SwarmResult

__all__ = [
    "FAIL_RATE_UNIT",
    "STALL_TIMEOUT_S",
    "KillPlan",
    "LocalSwarm",
    "RandomKills",
    "RunOutcome",
    "StageKill",
    "SwarmConfig",
    "SwarmResult",
    "parse_stage_kill",
]
