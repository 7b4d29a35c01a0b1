"""Who may ask a node for which parts of its state (sans-I/O).

A state transfer is large, so a node serves it only to the peers that recovery (`protocols.checkfree`) sends
to it, as their DHT records describe them:

- `weights` and `optimizer`: a node joining or recovering the same stage (it becomes a replica);
- `weights`: also a node joining or recovering a neighbouring transformer stage (CheckFree averages stages
  k - 1 and k + 1; CheckFree+ copies stage 2 into stage 1 and stage s - 1 into stage s);
- `embedding_copy` / `head_copy` (CheckFree+ only): from a data node, to the nodes of stage 1 / stage s
  that keep the copy (whatever their state: online holders refresh it); from those holders, to a data node
  joining or recovering stage 0; likewise `first_stage_copy` / `last_stage_copy`, from stage 1 / stage s
  to the nodes of stage 2 / stage s-1 that keep it, and from those to a node recovering stage 1 / stage s
  (`protocols.checkfree.copy_places`);
- `weights` of any stage: also an exporter (`swarmnode export`: a record `exporting`, under stage 0), which
  writes the model to files. Never the optimizer or the copies: an exporter needs the model only.
"""

from __future__ import annotations

from collections.abc import Iterable

from protocols.checkfree import copy_places
from protocols.errors import LocalProtocolError
from protocols.messages import NodeState
from protocols.transfers import StatePart

JOINING = frozenset({NodeState.JOINING, NodeState.RECOVERING})


def refusal(
    parts: Iterable[StatePart],
    *,
    stage: int,
    num_stages: int,
    checkfree_plus: bool,
    requester_stage: int,
    requester_state: NodeState,
) -> str | None:
    """Why a node of `stage` refuses `parts` to a requester whose record says it is `requester_state` at
    `requester_stage`, or None to serve them. `num_stages` is s, the number of transformer stages."""
    s = num_stages
    for k in (stage, requester_stage):
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= s:
            raise LocalProtocolError(f"stage {k!r} is not in 0..{s}")
    joining = requester_state in JOINING
    for part in parts:
        if part == StatePart.OPTIMIZER:
            allowed = joining and requester_stage == stage
        elif part == StatePart.WEIGHTS:
            neighbour = min(stage, requester_stage) >= 1 and abs(stage - requester_stage) == 1
            exporter = requester_state == NodeState.EXPORTING
            allowed = exporter or (joining and (requester_stage == stage or neighbour))
        elif (places := copy_places(part, s)) is not None:
            source, holder = places
            holding = requester_state not in (NodeState.LEAVING, NodeState.EXPORTING)
            to_holder = stage == source and requester_stage == holder and holding
            from_holder = stage == holder and requester_stage == source and joining
            allowed = checkfree_plus and (to_holder or from_holder)
        else:
            allowed = False  # an edge copy in a model of one transformer stage
        if not allowed:
            return f"{part} of stage {stage} is not for a node {requester_state} at stage {requester_stage}"
    return None
