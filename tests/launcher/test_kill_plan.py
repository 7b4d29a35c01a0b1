"""Failure injection: `--kill STAGE@STEP` parsing, planned kills by step, seeded random kills by time."""

from __future__ import annotations

import math

import pytest

from swarmnode.launcher.kill_plan import Kill, KillPlan, RandomKills, StageKill, parse_stage_kill


@pytest.mark.parametrize(("text", "expected"), [("2@50", StageKill(2, 50)), (" 0@1 ", StageKill(0, 1))])
def test_parse_stage_kill(text: str, expected: StageKill) -> None:
    assert parse_stage_kill(text) == expected
    assert parse_stage_kill(str(expected)) == expected


@pytest.mark.parametrize("text", ["9@x", "2", "@5", "2@", "-1@5", "2@-5", "2@5@6", "a@b", "2@0", "1.5@3"])
def test_parse_stage_kill_rejects(text: str) -> None:
    with pytest.raises(ValueError, match=r"STAGE@STEP|at least 1"):
        parse_stage_kill(text)


def test_planned_kills_fire_once_when_the_step_is_reached() -> None:
    plan = KillPlan(
        [StageKill(2, 10), StageKill(1, 5), StageKill(3, 10)], RandomKills(0.0, [1, 2, 3], seed=0)
    )
    assert plan.due(now=0.0, step=0) == []
    assert plan.due(now=1.0, step=4) == []
    assert plan.due(now=2.0, step=7) == [Kill(1, whole_stage=True)]  # the step jumped past 5
    assert plan.due(now=3.0, step=7) == []
    assert plan.due(now=4.0, step=10) == [Kill(2, whole_stage=True), Kill(3, whole_stage=True)]
    assert plan.due(now=5.0, step=50) == []
    assert Kill(2, whole_stage=True).cause == "planned"
    assert Kill(2, whole_stage=False).cause == "random"


def _timeline(rate: float, seed: int, minutes: float, step_s: float = 1.0) -> list[tuple[float, int]]:
    kills = RandomKills(rate, [1, 2, 3], seed)
    kills.start(100.0)
    timeline = []
    now = 100.0
    while now < 100.0 + minutes * 60:
        now += step_s
        timeline += [(now, stage) for stage in kills.due(now)]
    return timeline


def test_random_kills_are_seeded() -> None:
    first = _timeline(0.5, seed=7, minutes=30)
    assert first == _timeline(0.5, seed=7, minutes=30)
    assert first != _timeline(0.5, seed=8, minutes=30)
    assert {stage for _, stage in first} == {1, 2, 3}


def test_random_kills_do_not_depend_on_how_often_they_are_polled() -> None:
    fine = [stage for _, stage in _timeline(0.5, seed=3, minutes=20, step_s=0.5)]
    coarse = [stage for _, stage in _timeline(0.5, seed=3, minutes=20, step_s=60.0)]
    assert sorted(fine) == sorted(coarse)


def test_random_kill_rate_is_a_probability_per_stage_per_minute() -> None:
    rate, minutes = 0.5, 2000
    timeline = _timeline(rate, seed=1, minutes=minutes, step_s=30.0)
    per_stage = len(timeline) / 3
    expected = (
        -math.log(1 - rate) * minutes
    )  # Poisson intensity that fails a stage within a minute w.p. `rate`
    assert abs(per_stage - expected) < 4 * math.sqrt(expected)


def test_random_kills_wait_for_training_and_zero_rate_never_fires() -> None:
    plan = KillPlan([], RandomKills(0.99, [1, 2], seed=0))
    assert plan.due(now=0.0, step=0) == [] and not plan.random_kills.started
    assert plan.due(now=10_000.0, step=0) == []  # no clock before the first step
    plan.due(now=10_000.0, step=1)
    assert plan.random_kills.started
    assert all(kill == Kill(kill.stage, whole_stage=False) for kill in plan.due(now=20_000.0, step=2))
    quiet = KillPlan([], RandomKills(0.0, [1, 2], seed=0))
    quiet.due(now=0.0, step=1)
    assert quiet.due(now=1e9, step=100) == []


def test_random_victims_are_seeded() -> None:
    nodes = ["a", "b", "c", "d"]
    picks = [RandomKills(0.1, [1], seed=5).choose(nodes) for _ in range(3)]
    assert len(set(picks)) == 1
    chooser = RandomKills(0.1, [1], seed=5)
    assert {chooser.choose(nodes) for _ in range(50)} == set(nodes)


@pytest.mark.parametrize("rate", [-0.1, 1.0, 2.0])
def test_random_kills_reject_rates_outside_0_1(rate: float) -> None:
    with pytest.raises(ValueError, match="per stage per minute"):
        RandomKills(rate, [1], seed=0)
