"""The scheduler's view of the swarm for one iteration: stages, compute speeds and link costs."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from protocols.errors import LocalProtocolError


@dataclass(frozen=True)
class SwarmView:
    """Online nodes per stage, their speed and the cost of moving one activation between them.

    Nodes are numbered 0..n-1; the caller maps peer ids to these indices. `stages[0]` holds the data nodes
    (embedding, head and loss), `stages[1:]` the transformer stages, each with one or more replicas.
    `forward_s[v]` is node v's forward time for one microbatch (for a data node: its embedding), and
    `link_s[a][b]` the seconds to send one microbatch's activations (or gradients) from a to b.
    Backward takes `backward_factor` x forward; the head and loss at a data node `head_factor` x forward.
    """

    stages: tuple[tuple[int, ...], ...]
    forward_s: tuple[float, ...]
    link_s: tuple[tuple[float, ...], ...]
    backward_factor: float = 1.5
    head_factor: float = 0.25
    stage_of: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        stages = tuple(tuple(stage) for stage in self.stages)
        forward = tuple(float(f) for f in self.forward_s)
        links = tuple(tuple(float(c) for c in row) for row in self.link_s)
        object.__setattr__(self, "stages", stages)
        object.__setattr__(self, "forward_s", forward)
        object.__setattr__(self, "link_s", links)
        if len(stages) < 2:
            raise LocalProtocolError("a swarm needs stage 0 (data nodes) and at least one transformer stage")
        n = len(forward)
        stage_of = [-1] * n
        for k, stage in enumerate(stages):
            if not stage:
                raise LocalProtocolError(f"stage {k} has no node")
            for node in stage:
                if not isinstance(node, int) or not 0 <= node < n:
                    raise LocalProtocolError(f"stage {k} names node {node!r}; nodes are numbered 0..{n - 1}")
                if stage_of[node] != -1:
                    raise LocalProtocolError(f"node {node} is in stage {stage_of[node]} and stage {k}")
                stage_of[node] = k
        if -1 in stage_of:
            raise LocalProtocolError(f"node {stage_of.index(-1)} belongs to no stage")
        if not all(math.isfinite(f) and f >= 0 for f in forward):
            raise LocalProtocolError("forward times must be finite and non-negative")
        if len(links) != n or any(len(row) != n for row in links):
            raise LocalProtocolError(f"link_s must be a {n}x{n} matrix")
        if not all(math.isfinite(c) and c >= 0 for row in links for c in row):
            raise LocalProtocolError("link costs must be finite and non-negative")
        for name in ("backward_factor", "head_factor"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise LocalProtocolError(f"{name} must be finite and non-negative, got {value!r}")
        object.__setattr__(self, "stage_of", tuple(stage_of))

    @classmethod
    def build(
        cls,
        stages: Sequence[Sequence[int]],
        forward_s: Sequence[float],
        link_cost: Callable[[int, int], float],
    ) -> SwarmView:
        """A view whose link matrix is filled from `link_cost(a, b)` (0 on the diagonal)."""
        n = len(forward_s)
        links = tuple(tuple(0.0 if a == b else link_cost(a, b) for b in range(n)) for a in range(n))
        return cls(tuple(tuple(stage) for stage in stages), tuple(forward_s), links)

    @property
    def n_nodes(self) -> int:
        return len(self.forward_s)

    @property
    def n_stages(self) -> int:
        """Transformer stages (stage 0 not counted)."""
        return len(self.stages) - 1

    @property
    def data_nodes(self) -> tuple[int, ...]:
        return self.stages[0]
