"""Standby nodes (`protocols.standby`), driven in memory: when a standby claims a lost stage, which stage of
several, the claim race between two standbys (one winner, the other stands by again), a stage that only
looked lost, and a replacement's claim left alone."""

from __future__ import annotations

import math

import pytest

from protocols.errors import LocalProtocolError
from protocols.membership import Claim, Member, Take
from protocols.messages import NodeState, decode, encode
from protocols.standby import Standby, StandbyPhase, StandbyRecord, Watch, Watched, Withdraw

WATCH_S, SETTLE_S, PATIENCE_S = 0.25, 0.5, 2.0


def standby(me: str, stages: int = 3) -> Standby:
    return Standby(me=me, stages=stages, watch_s=WATCH_S, settle_s=SETTLE_S, patience_s=PATIENCE_S)


def online(*names: str) -> tuple[Member, ...]:
    return tuple(Member(name, NodeState.ONLINE, 100.0) for name in names)


def claim(name: str, expires: float, state: NodeState = NodeState.JOINING) -> Member:
    return Member(name, state, expires)


def look(
    now: float, standbys: tuple[str, ...] = (), trained: bool = False, **stages: tuple[Member, ...]
) -> Watched:
    """A look at a 3-stage swarm: every stage k served by node nk unless named (`s2=()`: stage 2 empty)."""
    live = {k: online(f"n{k}") for k in range(4)}
    live.update({int(k[1:]): v for k, v in stages.items()})
    return Watched(live, frozenset(standbys), trained, now)


WATCHING = (Watch(WATCH_S, fresh=False),)


def test_a_stage_seen_served_then_empty_is_claimed_and_taken_after_the_settle() -> None:
    machine = standby("s")
    assert machine.start() == (Watch(0.0, fresh=True),)
    assert machine.handle(look(0.0, ("s",))) == WATCHING
    assert machine.handle(look(0.25, ("s",), s2=())) == (Claim(2), Watch(SETTLE_S, fresh=True))
    assert machine.phase is StandbyPhase.CLAIMING
    assert machine.handle(look(0.75, ("s",), s2=(claim("s", 4.75),))) == (Take(2),)
    assert machine.phase is StandbyPhase.TAKEN and machine.stage == 2
    with pytest.raises(LocalProtocolError, match="taken already"):
        machine.handle(look(1.0))


def test_a_forming_swarm_is_left_alone_until_it_has_trained() -> None:
    machine = standby("s")
    for now in (0.0, 0.25, 0.5):  # stages 2 and 3 never served yet: still starting, not lost
        assert machine.handle(look(now, s2=(), s3=())) == WATCHING
    assert machine.handle(look(0.75, trained=True, s2=(), s3=())) == (Claim(2), Watch(SETTLE_S, True))


def test_a_live_claim_or_rebuild_of_the_stage_is_left_alone() -> None:
    machine = standby("s")
    machine.handle(look(0.0))
    for member in (claim("r", 4.0), claim("r", 4.0, NodeState.RECOVERING)):  # a `--stage auto` replacement
        assert machine.handle(look(0.25, s2=(member,))) == WATCHING
    assert machine.lost_since == {}


def test_two_standbys_racing_for_one_stage_end_with_one_winner() -> None:
    """Neither saw the other's standby record (both rank first): both claim stage 2; one settle later each
    sees both claims, the older one (a's) keeps it, b withdraws and stands by, and stays standing by."""
    a, b = standby("a-standby"), standby("b-standby")
    for machine in (a, b):
        machine.handle(look(0.0))
        assert machine.handle(look(0.25, s2=())) == (Claim(2), Watch(SETTLE_S, True))
    both = (claim("a-standby", 4.25), claim("b-standby", 4.26))
    assert a.handle(look(0.75, s2=both)) == (Take(2),)
    assert b.handle(look(0.75, s2=both)) == (Withdraw(2), Watch(WATCH_S, False))
    assert b.phase is StandbyPhase.WATCHING and b.stage is None
    rebuilding = (claim("a-standby", 5.0, NodeState.RECOVERING), claim("b-standby", 4.26))
    assert b.handle(look(1.0, s2=rebuilding)) == WATCHING
    assert b.handle(look(1.25, s2=online("a-standby"))) == WATCHING


def test_the_lower_id_wins_a_tie_and_a_rival_already_building_wins_outright() -> None:
    a, b = standby("a"), standby("b")
    for machine in (a, b):
        machine.handle(look(0.0))
        machine.handle(look(0.25, s2=()))
    tie = (claim("a", 4.25), claim("b", 4.25))
    assert a.handle(look(0.75, s2=tie)) == (Take(2),)
    assert b.handle(look(0.75, s2=tie))[0] == Withdraw(2)
    c = standby("c")
    c.handle(look(0.0))
    c.handle(look(0.25, s2=()))
    older_but_building = (claim("c", 4.0), claim("z", 4.6, NodeState.RECOVERING))
    assert c.handle(look(0.75, s2=older_but_building))[0] == Withdraw(2)


def test_a_stage_that_only_looked_lost_is_withdrawn_from() -> None:
    """A ping that failed on a loaded machine: at the settle look the node answers again."""
    machine = standby("s")
    machine.handle(look(0.0))
    machine.handle(look(0.25, s2=()))
    assert machine.handle(look(0.75, s2=(*online("n2"), claim("s", 4.25)))) == (
        Withdraw(2),
        Watch(WATCH_S, False),
    )
    # its own claim, until it expires, is no node of the stage: a real loss later is still seen
    assert machine.handle(look(1.0, s2=(claim("s", 4.25),))) == (Claim(2), Watch(SETTLE_S, True))


def test_standbys_split_lost_stages_by_rank() -> None:
    ranks = ("a", "b", "c")
    claims = {}
    for me in ranks:
        machine = standby(me)
        machine.handle(look(0.0, ranks))
        claims[me] = machine.handle(look(0.25, ranks, s1=(), s3=()))
    assert claims["a"][0] == Claim(1) and claims["b"][0] == Claim(3)
    assert claims["c"] == WATCHING  # outranked for both: it waits


def test_an_outranked_standby_claims_a_stage_still_lost_after_its_patience() -> None:
    """Its better-ranked peer died (its standby record outlives it) or is slow: the stage stays lost."""
    machine = standby("z")
    machine.handle(look(0.0, ("a", "z")))
    assert machine.handle(look(0.25, ("a", "z"), s2=())) == WATCHING
    assert machine.handle(look(0.25 + PATIENCE_S / 2, ("a", "z"), s2=())) == WATCHING
    assert machine.handle(look(0.25 + PATIENCE_S, ("a", "z"), s2=())) == (Claim(2), Watch(SETTLE_S, True))
    # a stage found again after it was served meanwhile starts its patience over
    other = standby("z")
    other.handle(look(0.0, ("a", "z")))
    other.handle(look(0.25, ("a", "z"), s2=()))
    other.handle(look(1.0, ("a", "z")))
    assert other.handle(look(2.5, ("a", "z"), s2=())) == WATCHING
    assert other.lost_since == {2: 2.5}


def test_data_stages_are_never_taken() -> None:
    machine = standby("s")
    machine.handle(look(0.0))
    assert machine.handle(look(0.25, trained=True, s0=())) == WATCHING


def test_bad_inputs_are_refused() -> None:
    for kwargs in ({"stages": 0}, {"watch_s": -1.0}, {"settle_s": math.nan}, {"patience_s": math.inf}):
        with pytest.raises(LocalProtocolError):
            Standby(**{"me": "s", "stages": 3, "watch_s": 0.1, "settle_s": 0.1, "patience_s": 1.0, **kwargs})
    machine = standby("s")
    with pytest.raises(LocalProtocolError, match=r"not 0\.\.3"):
        machine.handle(Watched({0: (), 1: ()}, frozenset(), False, 0.0))
    machine.handle(look(1.0))
    with pytest.raises(LocalProtocolError, match="after one at"):
        machine.handle(look(0.5))


def test_the_standby_record_round_trips_and_checks_its_fields() -> None:
    for record in (StandbyRecord(), StandbyRecord(taken=2, site="eu")):
        assert decode(encode(record), StandbyRecord) == record
    with pytest.raises(LocalProtocolError):
        StandbyRecord(taken=-1)
