"""SkipPipe path rules: the validator names every broken rule 1-6 and the microbatch that broke it."""

from __future__ import annotations

import pytest

from protocols.errors import LocalProtocolError
from protocols.skippipe import PathRules, Plan, SwarmView, validate_plan
from protocols.skippipe.rules import order_violations

# Data nodes 0 and 1; stages 1..5 are the single nodes 2..6 (node = stage + 1).
VIEW = SwarmView.build([[0, 1], [2], [3], [4], [5], [6]], [0.1] * 7, lambda a, b: 0.2)
RULES = PathRules(microbatches_per_data_node=5, skip_ratio=0.4, memory=10)  # 3 of 5 stages per path
SETS = [(1, 2, 3), (1, 4, 5), (2, 3, 4), (1, 2, 5), (3, 4, 5)]  # each stage 3 times


def path(data: int, *stages: int) -> tuple[int, ...]:
    return (data, *(stage + 1 for stage in stages), data)


def valid_paths() -> dict[int, tuple[int, ...]]:
    return {mb: path(mb // 5, *SETS[mb % 5]) for mb in range(10)}


def broken(paths: dict[int, tuple[int, ...]], rules: PathRules = RULES) -> set[tuple[int, int | None]]:
    return {(v.rule, v.microbatch) for v in validate_plan(paths, VIEW, rules)}


def test_a_valid_plan_has_no_violations() -> None:
    assert validate_plan(valid_paths(), VIEW, RULES) == []
    assert validate_plan(Plan(valid_paths(), 1.0), VIEW, RULES) == []


def test_rule_1_paths_leave_and_return_to_one_data_node() -> None:
    paths = valid_paths()
    paths[0] = (0, 2, 3, 4, 1)  # returns to another data node
    paths[1] = (3, 2, 3, 4, 3)  # starts at a transformer node
    paths[2] = (0, 2, 1, 4, 0)  # passes a data node
    assert {(1, 0), (1, 1), (1, 2)} <= broken(paths)
    moved = valid_paths() | {9: path(0, 3, 4, 5)}  # data node 0 starts 6 microbatches, data node 1 four
    assert [(v.rule, v.microbatch) for v in validate_plan(moved, VIEW, RULES)] == [(1, None), (1, None)]


def test_rule_2_fixed_path_length() -> None:
    paths = valid_paths()
    paths[3] = path(0, 1, 2)
    paths[4] = path(0, 1, 2, 3, 4)
    paths[5] = (1, 2, 99, 4, 1)
    found = broken(paths)
    assert {(2, 3), (2, 4), (2, 5)} <= found


def test_rule_3_each_stage_once() -> None:
    paths = valid_paths()
    paths[6] = path(1, 1, 2, 1)
    assert (3, 6) in broken(paths)


@pytest.mark.parametrize(
    ("stages", "rules"),
    [
        ((3, 1, 2), RULES),  # a swap back by 2
        ((5, 1, 2), RULES),  # a jump of 5 stages
        ((2, 1, 3), PathRules(microbatches_per_data_node=5, skip_ratio=0.4, memory=10, max_swaps=0)),
        ((2, 1, 3), PathRules(microbatches_per_data_node=5, skip_ratio=0.4, memory=10, max_forward_jump=1)),
    ],
)
def test_rule_4_swaps_and_jumps(stages: tuple[int, ...], rules: PathRules) -> None:
    paths = valid_paths()
    paths[7] = path(1, *stages)
    assert (4, 7) in broken(paths, rules)


def test_rule_4_limits_count_and_distance() -> None:
    rules = PathRules(microbatches_per_data_node=1, skip_ratio=0.0)
    assert order_violations((2, 1, 3, 5, 4), rules) == []
    assert order_violations((2, 1, 4, 3, 5), PathRules(microbatches_per_data_node=1, max_swaps=1))
    assert order_violations((2, 1, 4, 3), PathRules(microbatches_per_data_node=1, max_swap_distance=1))


def test_rule_5_balanced_coverage() -> None:
    paths = valid_paths()
    paths[8] = path(1, 1, 2, 3)  # was (1, 2, 5): stage 3 over, stage 5 under its share
    found = validate_plan(paths, VIEW, RULES)
    # The visits past the quota are named by microbatch (the highest ids), the shortfall by stage.
    assert [(v.rule, v.microbatch) for v in found] == [(5, None), (5, 9)]
    assert "stage 5" in found[0].reason and "stage 3" in found[1].reason


def test_rule_6_memory_deadlock() -> None:
    view = SwarmView.build([[0, 1], [2], [3]], [0.1, 0.1, 1.0, 1.0], lambda a, b: 0.5)
    rules = PathRules(microbatches_per_data_node=1, memory=1)
    found = validate_plan({0: (0, 2, 3, 0), 1: (1, 3, 2, 1)}, view, rules)
    assert [(v.rule, v.microbatch) for v in found] == [(6, 0), (6, 1)]
    assert "deadlock" in found[0].reason


def test_every_broken_rule_is_listed_in_order() -> None:
    paths = valid_paths()
    paths[0] = path(0, 1, 1, 2)  # rules 3 and 5
    paths[1] = path(0, 4, 1, 2)  # rule 4 (and 5)
    paths[2] = path(0, 1)  # rule 2 (and 5)
    found = validate_plan(paths, VIEW, RULES)
    assert {v.rule for v in found} == {2, 3, 4, 5}
    assert found == sorted(found, key=lambda v: (v.rule, -1 if v.microbatch is None else v.microbatch))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"microbatches_per_data_node": 0},
        {"skip_ratio": 1.0},
        {"skip_ratio": -0.1},
        {"max_swaps": -1},
        {"max_forward_jump": 0},
        {"memory": 0},
        {"checkfree_plus_share": 1.5},
    ],
)
def test_path_rules_reject_bad_values(kwargs: dict) -> None:
    with pytest.raises(LocalProtocolError):
        PathRules(**{"microbatches_per_data_node": 1, **kwargs})


def test_stages_per_path_follow_the_skip_ratio() -> None:
    assert PathRules.visiting(4, 6, microbatches_per_data_node=6).stages_per_path(5) == 3
    assert PathRules(microbatches_per_data_node=1).stages_per_path(5) == 5
    assert PathRules(microbatches_per_data_node=1, skip_ratio=0.9).stages_per_path(2) == 1
    with pytest.raises(LocalProtocolError):
        PathRules.visiting(1, 6, microbatches_per_data_node=1)
