"""Which peers a data node plans with: records remembered for a grace period after their last read."""

from __future__ import annotations

import math

import pytest

from protocols.errors import LocalProtocolError
from protocols.sightings import Sightings


def test_a_peer_missing_from_one_read_is_remembered_until_the_grace_ends() -> None:
    sightings = Sightings(grace_s=8.0)
    sightings.observe([("a", 1, True), ("b", 2, True)], now=0.0)
    sightings.observe([("a", 1, True)], now=1.0)  # b's record expired before its republish
    assert sightings.present(5.0) == {("a", 1), ("b", 2)}
    assert sightings.present(8.5) == {("a", 1)}
    sightings.observe([("a", 1, True), ("b", 2, True)], now=8.6)  # back: remembered afresh
    assert sightings.present(16.0) == {("a", 1), ("b", 2)}


def test_a_record_in_another_state_forgets_the_peer_at_once() -> None:
    sightings = Sightings(grace_s=8.0)
    sightings.observe([("a", 1, True), ("b", 1, True)], now=0.0)
    sightings.observe([("a", 1, False)], now=1.0)  # a is leaving (or recovering); b only missing
    assert sightings.present(1.0) == {("b", 1)}


def test_a_peer_seen_under_another_stage_only_has_moved() -> None:
    sightings = Sightings(grace_s=8.0)
    sightings.observe([("a", 1, True)], now=0.0)
    sightings.observe([("a", 2, True)], now=1.0)
    assert sightings.present(1.0) == {("a", 2)}
    sightings.observe([("a", 2, True), ("a", 3, True)], now=2.0)  # both records live for a moment
    assert sightings.present(2.0) == {("a", 2), ("a", 3)}


def test_forgotten_peers_do_not_come_back_without_a_read() -> None:
    sightings = Sightings(grace_s=2.0)
    sightings.observe([("a", 1, True)], now=0.0)
    sightings.observe([], now=3.0)
    assert sightings.present(3.0) == set()
    assert sightings.present(0.5) == set()  # forgotten, not merely out of the window


def test_a_forgotten_peer_counts_again_from_the_next_read_that_shows_it() -> None:
    sightings = Sightings(grace_s=8.0)
    sightings.observe([("a", 1, True), ("b", 1, True)], now=0.0)
    sightings.forget(["a"])  # calls to it failed
    assert sightings.present(1.0) == {("b", 1)}
    sightings.observe([("a", 1, True)], now=2.0)
    assert ("a", 1) in sightings.present(2.0)


@pytest.mark.parametrize("grace", [-1.0, math.nan, math.inf])
def test_bad_grace_is_refused(grace: float) -> None:
    with pytest.raises(LocalProtocolError, match="grace_s"):
        Sightings(grace)
