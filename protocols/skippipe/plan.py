"""The scheduler's output: one path per microbatch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from protocols.errors import LocalProtocolError
from protocols.skippipe.simulator import simulate
from protocols.skippipe.swarm import SwarmView

Paths = dict[int, tuple[int, ...]]  # microbatch id -> node ids, as planners build them


@dataclass(frozen=True)
class Plan:
    """Paths for one iteration and the simulator's expected iteration time.

    `paths[mb]` lists node ids in visit order, starting and ending at the microbatch's data node, for
    example `(d, n1, n2, n3, d)`. Microbatch ids are `i * m + j` for the i-th data node of stage 0 and its
    j-th microbatch (`m` microbatches per data node); a data node launches its microbatches in id order.
    """

    paths: Mapping[int, tuple[int, ...]]
    iteration_time_s: float
    collisions: int = 0

    def __post_init__(self) -> None:
        frozen = {int(mb): tuple(path) for mb, path in sorted(self.paths.items())}
        object.__setattr__(self, "paths", MappingProxyType(frozen))

    @classmethod
    def simulated(cls, paths: Mapping[int, tuple[int, ...]], view: SwarmView, memory: int) -> Plan:
        """A plan for `paths` timed by the simulator; LocalProtocolError if they deadlock on memory."""
        result = simulate(paths, view, memory)
        if result.stuck:
            raise LocalProtocolError(
                f"microbatches {list(result.stuck)} deadlock with {memory} memory slots per node"
            )
        return cls(paths, result.iteration_time_s, result.collisions)

    def as_dict(self) -> dict[str, list[int]]:
        """JSON-ready paths: microbatch id (as a string) -> node ids."""
        return {str(mb): list(path) for mb, path in self.paths.items()}
