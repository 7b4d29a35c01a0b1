"""SkipPipe simulator: hand-timed iterations, queueing, priorities, memory and deadlocks."""

from __future__ import annotations

import math

import pytest

from protocols.errors import LocalProtocolError
from protocols.skippipe import SwarmView, simulate

LINK = 0.5


def view(stages: list[list[int]], forward: list[float], link: float = LINK) -> SwarmView:
    return SwarmView.build(stages, forward, lambda a, b: link)


def round_trip(f_data: float, interior: list[float], link: float = LINK) -> float:
    hops = 2 * (len(interior) + 1)
    return 2.5 * f_data + 0.25 * f_data + 2.5 * sum(interior) + hops * link


def test_one_microbatch_takes_the_sum_of_its_tasks_and_hops() -> None:
    v = view([[0], [1], [2]], [0.4, 1.0, 2.0])
    result = simulate({0: (0, 1, 2, 0)}, v, memory=3)
    assert result.iteration_time_s == pytest.approx(round_trip(0.4, [1.0, 2.0]))
    assert result.finish_s[0] == result.iteration_time_s
    assert (result.collisions, result.queueing_s, result.stuck) == (0, 0.0, ())


def test_microbatches_queue_at_a_shared_node() -> None:
    v = view([[0, 1], [2]], [0.0, 0.0, 1.0], link=0.0)
    result = simulate({0: (0, 2, 0), 1: (1, 2, 1)}, v, memory=3)
    # Both reach node 2 at t=0: forwards at 0-1 and 1-2, then backwards (1.5 s each) back to back.
    assert result.finish_s == {0: pytest.approx(3.5), 1: pytest.approx(5.0)}
    assert result.collisions == 3  # the second forward, and the backward that arrives during a forward
    assert result.queueing_s > 0


def test_backward_goes_before_a_waiting_forward() -> None:
    v = view([[0], [1]], [0.1, 1.0], link=0.0)
    paths = {mb: (0, 1, 0) for mb in range(3)}
    finish = simulate(paths, v, memory=3).finish_s
    # Node 1: forwards of 0 (0.1-1.1) and 1 (1.1-2.1); at 2.1 the forward of 2 has waited since 0.3 and
    # the backward of 0 since 1.125, yet the backwards of 0 and then 1 go first.
    assert finish[0] == pytest.approx(2.1 + 1.5 + 0.15)
    assert finish[1] == pytest.approx(2.1 + 3.0 + 0.15)
    assert finish[2] == pytest.approx(5.1 + 1.0 + 0.025 + 1.5 + 0.15)


def test_memory_limits_microbatches_in_flight() -> None:
    v = view([[0], [1]], [0.0, 1.0], link=1.0)
    paths = {0: (0, 1, 0), 1: (0, 1, 0)}
    alone = round_trip(0.0, [1.0], link=1.0)
    assert simulate(paths, v, memory=1).iteration_time_s == pytest.approx(2 * alone)
    assert simulate(paths, v, memory=2).iteration_time_s < 2 * alone


def test_swapped_paths_can_deadlock_on_memory() -> None:
    v = view([[0, 1], [2], [3]], [0.1, 0.1, 1.0, 1.0])
    paths = {0: (0, 2, 3, 0), 1: (1, 3, 2, 1)}  # stages 1,2 and 2,1
    stuck = simulate(paths, v, memory=1)
    assert stuck.stuck == (0, 1) and math.isinf(stuck.iteration_time_s)
    assert simulate(paths, v, memory=2).stuck == ()


def test_no_paths_take_no_time() -> None:
    assert simulate({}, view([[0], [1]], [1.0, 1.0]), memory=1).iteration_time_s == 0.0


@pytest.mark.parametrize(
    ("paths", "memory"),
    [({0: (0, 1, 0)}, 0), ({0: (0, 0)}, 1), ({0: (0, 1, 2)}, 1), ({0: (0, 7, 0)}, 1)],
)
def test_rejects_bad_input(paths: dict, memory: int) -> None:
    with pytest.raises(LocalProtocolError):
        simulate(paths, view([[0], [1], [2]], [1.0, 1.0, 1.0]), memory)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"stages": [[0, 1]], "forward_s": [1, 1], "link_s": [[0, 1], [1, 0]]},
        {"stages": [[0], []], "forward_s": [1], "link_s": [[0]]},
        {"stages": [[0], [0]], "forward_s": [1], "link_s": [[0]]},
        {"stages": [[0], [2]], "forward_s": [1, 1], "link_s": [[0, 1], [1, 0]]},
        {"stages": [[0], [1]], "forward_s": [1, -1], "link_s": [[0, 1], [1, 0]]},
        {"stages": [[0], [1]], "forward_s": [1, 1], "link_s": [[0, 1]]},
        {"stages": [[0], [1]], "forward_s": [1, 1], "link_s": [[0, math.inf], [1, 0]]},
        {"stages": [[0], [1]], "forward_s": [1, 1, 1], "link_s": [[0] * 3] * 3},
    ],
)
def test_swarm_view_rejects_inconsistent_swarms(kwargs: dict) -> None:
    with pytest.raises(LocalProtocolError):
        SwarmView(**kwargs)
