"""What a CheckFree+ copy must hold (`pieces.copy_layout`), and the check a holder runs on each refresh."""

from __future__ import annotations

import pytest
import torch

from protocols.transfers import COPIES, EDGE_COPIES, StatePart
from swarmnode.node import state
from swarmnode.pieces import build_piece, copy_layout
from swarmnode.presets import get_preset


@pytest.mark.parametrize("n_stages", [1, 2, 3, 6])
def test_the_layout_of_every_copy_is_what_its_source_sends(n_stages: int) -> None:
    config = get_preset("tiny").model
    data = build_piece(config, 0, n_stages)
    sent = {
        StatePart.EMBEDDING_COPY: state.piece_copy(data, StatePart.EMBEDDING_COPY),
        StatePart.HEAD_COPY: state.piece_copy(data, StatePart.HEAD_COPY),
        StatePart.FIRST_STAGE_COPY: state.weights(build_piece(config, 1, n_stages)),
        StatePart.LAST_STAGE_COPY: state.weights(build_piece(config, n_stages, n_stages)),
    }
    for part in COPIES:
        if n_stages == 1 and part in EDGE_COPIES:
            continue  # no edge copies without a neighbour
        state.layout_check(copy_layout(config, part, n_stages), str(part))(None, sent[part])


@pytest.mark.parametrize("part", [StatePart.EMBEDDING_COPY, StatePart.HEAD_COPY])
def test_a_data_node_copies_only_the_half_of_its_piece_it_serves(part: StatePart) -> None:
    piece = build_piece(get_preset("tiny").model, 0, 3)
    copied = state.piece_copy(piece, part)
    split = state.split_piece_copy(state.weights(piece), part)
    assert set(copied) == set(split) and all(torch.equal(copied[n], t) for n, t in split.items())
    params = {p.data_ptr() for p in piece.parameters()}
    assert not params & {t.data_ptr() for t in copied.values()}  # a copy: the next step changes nothing in it
    others = sum(p.numel() for p in piece.parameters()) - sum(t.numel() for t in copied.values())
    assert others > 0  # the other half of the piece was left out


def test_a_copy_of_another_layout_or_not_finite_is_refused() -> None:
    config = get_preset("tiny").model
    check = state.layout_check(copy_layout(config, StatePart.FIRST_STAGE_COPY, 6), "first_stage_copy")
    good = state.weights(build_piece(config, 1, 6))
    name = next(iter(good))
    for bad, why in (
        ({**good, name: torch.full_like(good[name], float("nan"))}, "not a finite floating-point tensor"),
        ({**good, name: good[name][:1]}, "shape"),
        ({k: v for k, v in good.items() if k != name}, name),
        (state.weights(build_piece(config, 1, 3)), "layers.1"),  # two layers: another layout
    ):
        with pytest.raises(state.StateMismatch, match=why):
            check(None, bad)
    check(None, good)
