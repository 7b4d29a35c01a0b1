"""Who may ask a node for which parts of its state (protocols.access)."""

from __future__ import annotations

import pytest

from protocols.access import refusal
from protocols.errors import LocalProtocolError
from protocols.messages import NodeState
from protocols.transfers import StatePart

W, OPT, E, H = StatePart.WEIGHTS, StatePart.OPTIMIZER, StatePart.EMBEDDING_COPY, StatePart.HEAD_COPY
FIRST, LAST = StatePart.FIRST_STAGE_COPY, StatePart.LAST_STAGE_COPY
J, R, ON, L = NodeState.JOINING, NodeState.RECOVERING, NodeState.ONLINE, NodeState.LEAVING
X = NodeState.EXPORTING


def allowed(parts: tuple[StatePart, ...], stage: int, who: int, state: NodeState, plus: bool = True) -> bool:
    reason = refusal(
        parts, stage=stage, num_stages=4, checkfree_plus=plus, requester_stage=who, requester_state=state
    )
    return reason is None


def test_a_replica_copy_goes_to_a_joiner_of_the_same_stage_only() -> None:
    assert allowed((W, OPT), 2, 2, R) and allowed((W, OPT), 2, 2, J) and allowed((W, OPT), 0, 0, R)
    assert not allowed((W, OPT), 2, 2, ON)  # an online replica has its own state
    assert not allowed((W, OPT), 2, 3, R)  # a neighbour gets weights, not the optimizer
    assert not allowed((OPT,), 2, 1, R)


def test_weights_go_to_a_recovering_neighbouring_transformer_stage() -> None:
    assert allowed((W,), 2, 1, R) and allowed((W,), 2, 3, R) and allowed((W,), 1, 2, J)
    assert not allowed((W,), 2, 4, R)  # not a neighbour
    assert not allowed((W,), 1, 0, R) and not allowed((W,), 0, 1, R)  # the data stage is nobody's neighbour
    assert not allowed((W,), 2, 3, ON) and not allowed((W,), 2, 3, L)


def test_copies_go_to_their_holders_and_back_to_a_recovering_data_node() -> None:
    assert allowed((E,), 0, 1, ON) and allowed((E,), 0, 1, R) and allowed((H,), 0, 4, ON)
    assert not allowed((E,), 0, 4, ON) and not allowed((H,), 0, 1, ON) and not allowed((E,), 0, 1, L)
    assert allowed((E,), 1, 0, R) and allowed((H,), 4, 0, J)
    assert not allowed((E,), 1, 0, ON) and not allowed((H,), 1, 0, R)
    assert not allowed((E,), 0, 1, ON, plus=False)  # no copies without CheckFree+


def test_edge_copies_go_from_the_edge_stage_to_its_partner_and_back_to_a_recovering_edge_node() -> None:
    assert allowed((FIRST,), 1, 2, ON) and allowed((FIRST,), 1, 2, R) and allowed((LAST,), 4, 3, ON)
    assert allowed((FIRST,), 2, 1, R) and allowed((LAST,), 3, 4, J)
    assert not allowed((FIRST,), 2, 1, ON)  # an online stage-1 node has its own weights
    assert (
        not allowed((FIRST,), 1, 3, ON) and not allowed((LAST,), 1, 2, ON) and not allowed((LAST,), 3, 2, R)
    )
    assert not allowed((FIRST,), 1, 2, L) and not allowed((FIRST,), 1, 2, X)
    assert not allowed((FIRST,), 1, 2, ON, plus=False)
    one = refusal((FIRST,), stage=1, num_stages=1, checkfree_plus=True, requester_stage=1, requester_state=R)
    assert one == "first_stage_copy of stage 1 is not for a node recovering at stage 1"  # no neighbour


def test_an_exporter_gets_the_weights_of_every_stage_and_nothing_else() -> None:
    assert all(allowed((W,), stage, 0, X) for stage in range(5))
    assert not allowed((W, OPT), 2, 0, X) and not allowed((OPT,), 0, 0, X)
    assert not allowed((E,), 0, 1, X) and not allowed((H,), 4, 0, X)


def test_every_part_must_be_allowed_and_the_reason_names_it() -> None:
    reason = refusal(
        (W, OPT), stage=2, num_stages=4, checkfree_plus=True, requester_stage=3, requester_state=R
    )
    assert reason == "optimizer of stage 2 is not for a node recovering at stage 3"
    with pytest.raises(LocalProtocolError):
        refusal((W,), stage=5, num_stages=4, checkfree_plus=True, requester_stage=1, requester_state=R)
