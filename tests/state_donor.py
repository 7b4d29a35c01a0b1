"""A real tiny stage that serves its state (`serving.Donor`) without a daemon: for tests of `StateServer`.

    donor = TinyDonor.build(stage=1, recovering=("joiner-a",))
    server = StateServer(donor)   # inside a running event loop, after `donor.compute.start()`

Its piece, optimizer and compute queue are the real ones a daemon builds; its view of the swarm is a fixed
`SwarmRead` (the peers named there are recovering its stage); `refresh_swarm_read` only counts the reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from torch import nn

from protocols.messages import NodeRecord, NodeState
from protocols.transfers import StatePart
from swarmnode.node import state
from swarmnode.node.compute import ComputeQueue
from swarmnode.node.planning import SwarmRead
from swarmnode.optim import Schedule, StageOptimizer
from swarmnode.pieces import build_piece
from swarmnode.presets import get_preset
from swarmnode.records import PeerRecord
from swarmnode.runspec import RunSpec


@dataclass
class Outer:
    """NoLoCo's state as `serving.OuterState` reads it (the real `OuterLoop` needs a transport)."""

    phi: state.TensorMap
    outer_step: int = 0
    delta: state.TensorMap | None = None


@dataclass
class TinyDonor:
    spec: RunSpec
    stage: int
    piece: nn.Module
    optimizer: StageOptimizer
    outer: Outer
    swarm_read: SwarmRead
    compute: ComputeQueue = field(default_factory=ComputeQueue)
    state: NodeState = NodeState.ONLINE
    copies: dict[StatePart, state.TensorMap] = field(default_factory=dict)
    reads: int = 0  # fresh reads of the DHT asked for

    @classmethod
    def build(cls, stage: int, recovering: tuple[str, ...], **changes: object) -> TinyDonor:
        """Stage `stage` of a two-stage tiny run; `recovering` are peers whose records say they recover it."""
        spec = replace(RunSpec(run_id="unit", stages=2, preset="tiny"), **changes)
        model = replace(get_preset(spec.preset).model, vocab_size=spec.vocab_size)
        piece = build_piece(model, stage, spec.stages, spec.seed)
        optimizer = StageOptimizer(piece, Schedule(spec.lr, spec.warmup_steps, spec.total_steps), 1.0)
        record = NodeRecord(NodeState.RECOVERING, stage, 0, 0)
        view = SwarmRead({stage: [PeerRecord(peer, record, 1e12) for peer in recovering]})
        return cls(spec, stage, piece, optimizer, Outer(state.weights(piece)), view)

    async def refresh_swarm_read(self) -> None:
        self.reads += 1
