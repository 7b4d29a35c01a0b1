"""A daemon's membership (`protocols.membership`), driven in memory: choosing and claiming a stage, leaving a
claim to a rival, spotting a lost stage and moving there, with the races the daemon's history has fixed."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping

import pytest

from protocols.errors import LocalProtocolError
from protocols.membership import (
    SETTLE_STORES,
    Claim,
    ClaimPhase,
    Look,
    Looked,
    Member,
    Move,
    Probe,
    Probed,
    Rebalance,
    RebalancePhase,
    RebuildWait,
    StageClaim,
    Take,
    Viewed,
    Wait,
    WaitUpdate,
    choose_stage,
    leaves_claim,
    settle_seconds,
    stages_to_wait_for,
)
from protocols.messages import NodeState

SETTLE_S = 0.5
TTL_S = 4.0


def online(*names: str, throughput: float = 0.0) -> tuple[Member, ...]:
    return tuple(Member(name, NodeState.ONLINE, 100.0, throughput) for name in names)


def claim(name: str, expires: float, state: NodeState = NodeState.JOINING) -> Member:
    return Member(name, state, expires)


# ---- choosing a stage and leaving a claim ------------------------------------------------------------------


def test_auto_takes_an_empty_stage_first_then_the_least_replicated() -> None:
    live: dict[int, tuple[Member, ...]] = {0: online("d"), 1: online("a"), 2: (), 3: online("c")}
    assert choose_stage(live) == 2
    live[2] = online("b", "b2")
    assert choose_stage(live) in (1, 3)
    live[1] = online("a", "a2", throughput=10.0)
    assert choose_stage(live) == 3
    assert choose_stage({0: (), 1: online("a")}) == 0
    with pytest.raises(LocalProtocolError):
        choose_stage({})
    with pytest.raises(LocalProtocolError):
        choose_stage({0: online("d")})


def test_a_claim_is_left_to_an_older_or_committed_rival() -> None:
    assert not leaves_claim("b", [claim("b", 10.0)])
    # both saw each other at the same age: the lower id keeps the stage, the other leaves
    assert leaves_claim("b", [claim("a", 10.0), claim("b", 10.0)])
    assert not leaves_claim("a", [claim("a", 10.0), claim("b", 10.0)])
    # "a" claimed after "b" (b's first look missed it, so b kept the stage): a leaves despite its lower id
    assert leaves_claim("a", [claim("a", 11.0), claim("b", 10.0)])
    assert not leaves_claim("b", [claim("a", 11.0), claim("b", 10.0)])
    # a rival already rebuilding or serving the stage keeps it, however young its record
    assert leaves_claim("a", [claim("a", 10.0), claim("z", 99.0, NodeState.RECOVERING)])
    assert leaves_claim("a", [claim("a", 10.0), claim("z", 99.0, NodeState.ONLINE)])
    # my own claim is not visible (its store failed): no rival saw it, so I leave
    assert leaves_claim("a", [claim("z", 99.0)])


def view(**stages: tuple[Member, ...]) -> dict[int, tuple[Member, ...]]:
    """A live view of stages 0..3 (`s1=...`), empty where not given."""
    return {k: stages.get(f"s{k}", ()) for k in range(4)}


def test_a_stage_with_nodes_is_taken_at_once() -> None:
    machine = StageClaim(me="j", stages=3, settle_s=SETTLE_S)
    assert machine.start() == (Look(0.0),)
    live = view(s0=online("d"), s1=online("a"), s2=online("b", "b2"), s3=online("c"))
    assert machine.handle(Looked(live)) == (Take(1),)
    assert machine.phase is ClaimPhase.TAKEN and machine.stage == 1
    with pytest.raises(LocalProtocolError):
        machine.handle(Looked(live))


def test_an_empty_stage_is_claimed_then_kept_when_no_rival_shows() -> None:
    machine = StageClaim(me="j", stages=3, settle_s=SETTLE_S)
    live = view(s0=online("d"), s1=online("a"), s3=online("c"))
    assert machine.handle(Looked(live)) == (Claim(2), Look(SETTLE_S))
    assert machine.phase is ClaimPhase.CLAIMING
    assert machine.handle(Looked({**live, 2: (claim("j", 4.0),)})) == (Take(2),)


def test_a_claim_left_to_a_rival_sends_the_node_to_another_empty_stage() -> None:
    machine = StageClaim(me="b", stages=3, settle_s=SETTLE_S)
    live = view(s0=online("d"), s3=online("c"))
    assert machine.handle(Looked(live)) == (Claim(1), Look(SETTLE_S))
    rivals = {**live, 1: (claim("a", 4.0), claim("b", 4.0))}
    assert machine.handle(Looked(rivals)) == (Claim(2), Look(SETTLE_S))
    assert machine.left == {1}
    assert machine.handle(Looked({**rivals, 2: (claim("b", 5.0),)})) == (Take(2),)


def test_a_claim_whose_store_failed_is_left() -> None:
    machine = StageClaim(me="a", stages=3, settle_s=SETTLE_S)
    live = view(s0=online("d"), s2=online("b"), s3=online("c"))
    assert machine.handle(Looked(live)) == (Claim(1), Look(SETTLE_S))
    # nobody saw my claim, but "z" claimed stage 1: "z" keeps it, and every stage has one node: share one
    assert machine.handle(Looked({**live, 1: (claim("z", 9.0),)})) == (Take(1),)


def test_a_rival_rebuilding_the_stage_keeps_it_though_its_record_is_younger() -> None:
    """The stage rebuilt twice: a node that kept its claim announces `recovering` while it builds (`Take`),
    republished every period; a claim made meanwhile is left to it, however young its record looks."""
    machine = StageClaim(me="a", stages=3, settle_s=SETTLE_S)
    live = view(s0=online("d"), s2=online("b"), s3=online("c"))
    assert machine.handle(Looked(live)) == (Claim(1), Look(SETTLE_S))
    building = (claim("a", 4.0), claim("z", 60.0, NodeState.RECOVERING))
    assert machine.handle(Looked({**live, 1: building})) == (Take(2),)


def test_a_node_that_left_every_empty_stage_shares_one() -> None:
    machine = StageClaim(me="z", stages=1, settle_s=SETTLE_S)
    assert machine.handle(Looked({0: (), 1: ()})) == (Claim(0), Look(SETTLE_S))
    lost_0 = {0: (claim("a", 1.0), claim("z", 2.0)), 1: ()}
    assert machine.handle(Looked(lost_0)) == (Claim(1), Look(SETTLE_S))
    # stage 0's claimant vanished meanwhile: a stage left stays left (its rival builds it)
    assert machine.handle(Looked({0: (), 1: (claim("b", 1.0), claim("z", 2.0))})) == (Take(1),)
    assert machine.left == {0, 1}


def test_a_view_of_other_stages_is_refused() -> None:
    machine = StageClaim(me="a", stages=3, settle_s=SETTLE_S)
    with pytest.raises(LocalProtocolError):
        machine.handle(Looked({0: (), 1: ()}))
    with pytest.raises(LocalProtocolError):
        StageClaim(me="a", stages=0, settle_s=SETTLE_S)
    with pytest.raises(LocalProtocolError):
        StageClaim(me="a", stages=3, settle_s=float("nan"))


class Dht:
    """Records as the DHT holds them: each joiner's latest claim, with its expiry."""

    def __init__(self, served: Mapping[int, tuple[Member, ...]]) -> None:
        self.records = dict(served)
        self.claims: dict[str, tuple[int, float]] = {}

    def publish(self, peer: str, stage: int, now: float) -> None:
        self.claims[peer] = (stage, now + TTL_S)

    def view(self) -> dict[int, tuple[Member, ...]]:
        live = dict(self.records)
        for peer, (stage, expires) in sorted(self.claims.items()):
            live[stage] = (*live[stage], claim(peer, expires))
        return live


def run_joiners(dht: Dht, starts: Mapping[str, float]) -> dict[str, int]:
    """Joiners that first look at `starts[name]`, each carrying out its machine's actions: the joiners due
    at one moment all read the same records, then store their claims (stored at the same moment)."""
    machines = {name: StageClaim(me=name, stages=3, settle_s=SETTLE_S) for name in starts}
    looks = {name: start for name, start in starts.items()}
    taken: dict[str, int] = {}
    while looks:
        now = min(looks.values())
        due = sorted(name for name, at in looks.items() if at == now)
        live = dht.view()
        for name in due:
            del looks[name]
            for action in machines[name].handle(Looked(live)):
                if isinstance(action, Take):
                    taken[name] = action.stage
                elif isinstance(action, Claim):
                    dht.publish(name, action.stage, now)
                else:
                    looks[name] = now + action.after_s
    return taken


def test_two_joiners_claiming_the_same_empty_stage_at_once_split() -> None:
    """Both look before either claims, so both claim stage 1; one settle later both see both claims of the
    same age: the lower id keeps stage 1, the other leaves it and claims stage 2."""
    served = {0: online("d"), 1: (), 2: (), 3: online("c")}
    assert run_joiners(Dht(served), {"a": 0.0, "b": 0.0}) == {"a": 1, "b": 2}


def test_a_joiner_whose_look_missed_an_older_claim_leaves_despite_its_lower_id() -> None:
    """ "b" claims stage 1 first; "a" looked before b's claim was stored, claims stage 1 a moment later and
    sees b's claim as older: a leaves, b (the higher id) keeps stage 1."""
    served = {0: online("d"), 1: (), 2: (), 3: online("c")}
    dht = Dht(served)
    a = StageClaim(me="a", stages=3, settle_s=SETTLE_S)
    b = StageClaim(me="b", stages=3, settle_s=SETTLE_S)
    assert b.handle(Looked(dht.view())) == (Claim(1), Look(SETTLE_S))
    assert a.handle(Looked(dht.view())) == (Claim(1), Look(SETTLE_S))  # b's claim not stored yet
    dht.publish("b", 1, now=0.0)
    dht.publish("a", 1, now=0.1)
    assert b.handle(Looked(dht.view())) == (Take(1),)
    assert a.handle(Looked(dht.view())) == (Claim(2), Look(SETTLE_S))


# ---- moving to a lost stage --------------------------------------------------------------------------------


def seen(**stages: tuple[str, ...]) -> Viewed:
    """A view's online nodes of stages 1..3 (`s1=("a",)`)."""
    return Viewed({k: frozenset(stages.get(f"s{k}", ())) for k in range(1, 4)})


def answers(**stages: tuple[str, ...]) -> Probed:
    return Probed({int(k[1:]): frozenset(peers) for k, peers in stages.items()})


def rebalance(me: str = "b1", seed: int = 0) -> Rebalance:
    return Rebalance(me=me, stage=2, stages=3, max_delay_s=2.5, rng=random.Random(seed))


def confirm_lost(machine: Rebalance) -> tuple[Wait | Probe | Move, ...]:
    """Stage 3 served, then silent on both looks; the answers for stage 2 are the caller's to give."""
    assert machine.handle(seen(s1=("a",), s2=("b1", "b2"), s3=("c",))) == (Probe((1, 3)),)
    [wait] = machine.handle(answers(s1=("a",), s3=()))
    assert isinstance(wait, Wait) and 0.0 <= wait.seconds <= 2.5
    assert machine.phase is RebalancePhase.WAITING
    return machine.handle(seen(s1=("a",), s2=("b1", "b2"), s3=("c",)))


def test_the_lowest_replica_moves_to_a_stage_lost_on_two_looks() -> None:
    machine = rebalance()
    assert confirm_lost(machine) == (Probe((1, 3, 2)),)
    assert machine.handle(answers(s1=("a",), s3=(), s2=("b2",))) == (Move(3),)
    assert machine.phase is RebalancePhase.MOVED
    assert machine.handle(seen(s1=("a",))) == ()


def test_two_replicas_never_both_leave() -> None:
    """Both replicas of stage 2 see stage 3 lost: only the lower peer id moves, the other keeps stage 2."""
    moves = {}
    for me, other in (("b1", "b2"), ("b2", "b1")):
        machine = rebalance(me)
        assert confirm_lost(machine) == (Probe((1, 3, 2)),)
        moves[me] = machine.handle(answers(s1=("a",), s3=(), s2=(other,)))
    assert moves == {"b1": (Move(3),), "b2": ()}


def test_the_only_replica_of_a_stage_stays() -> None:
    machine = rebalance()
    confirm_lost(machine)
    assert machine.handle(answers(s1=("a",), s3=(), s2=())) == ()
    assert machine.phase is RebalancePhase.IDLE


def test_a_stage_back_on_the_second_look_is_not_moved_to() -> None:
    machine = rebalance()
    confirm_lost(machine)
    assert machine.handle(answers(s1=("a",), s3=("c2",), s2=("b2",))) == ()
    assert machine.phase is RebalancePhase.IDLE


def test_a_stage_never_served_is_not_lost() -> None:
    """A swarm still forming: stage 3 has had no node this one saw, so a spare does not move there."""
    machine = rebalance()
    assert machine.handle(seen(s2=("b1", "b2"))) == ()
    assert machine.handle(seen(s1=("a",), s2=("b1", "b2"))) == (Probe((1,)),)
    assert machine.handle(answers(s1=("a",))) == ()
    assert machine.served == {1}


def test_the_random_delay_comes_from_the_rng_given() -> None:
    delays = set()
    for seed in (0, 0, 1):
        machine = rebalance(seed=seed)
        machine.handle(seen(s1=("a",), s2=("b1", "b2"), s3=("c",)))
        [wait] = machine.handle(answers(s1=("a",), s3=()))
        assert isinstance(wait, Wait)
        delays.add(wait.seconds)
    assert len(delays) == 2


def test_a_failed_probe_is_started_over_and_stray_answers_are_refused() -> None:
    machine = rebalance()
    with pytest.raises(LocalProtocolError):
        machine.handle(answers(s3=()))  # no probe out
    assert machine.handle(seen(s1=("a",), s3=("c",))) == (Probe((1, 3)),)
    assert machine.handle(seen(s1=("a",), s3=("c",))) == (Probe((1, 3)),)  # the first probe never answered
    with pytest.raises(LocalProtocolError):
        machine.handle(answers(s1=("a",)))  # stage 3 probed, not answered
    with pytest.raises(LocalProtocolError):
        Rebalance(me="a", stage=0, stages=3, max_delay_s=1.0, rng=random.Random(0))


# ---- a data node's wait for a lost stage's rebuild ---------------------------------------------------------


def test_a_run_that_skips_nothing_waits_for_every_lost_stage() -> None:
    assert stages_to_wait_for({1, 3}, stages=3, skip_ratio=0.0) == [2]
    assert stages_to_wait_for(set(), stages=3, skip_ratio=0.0) == [1, 2, 3]
    assert stages_to_wait_for({1, 3}, stages=3, skip_ratio=0.25) == []  # its paths skip past it


def test_the_wait_for_a_rebuild_is_bounded_and_starts_again_for_a_later_loss() -> None:
    wait = RebuildWait(limit_s=60.0)
    assert wait.update([2], now=100.0) == WaitUpdate(True, began=True)
    assert wait.update([2], now=159.0) == WaitUpdate(True)
    assert wait.update([2], now=160.0) == WaitUpdate(False)  # nobody rebuilt it: train past it
    assert wait.update([], now=161.0) == WaitUpdate(False, ended_after_s=61.0)
    assert wait.update([], now=162.0) == WaitUpdate(False)
    assert wait.update([3], now=200.0) == WaitUpdate(True, began=True)  # a later loss waits its own time
    assert wait.update([3], now=259.5).waits
    with pytest.raises(LocalProtocolError, match="limit_s"):
        RebuildWait(limit_s=math.inf)


def test_a_claim_settles_for_several_stores_and_at_least_the_floor() -> None:
    assert settle_seconds(0.1, 0.0) == 0.1
    assert settle_seconds(0.1, 0.02) == 0.1  # a quick store on loopback: the floor
    # a slow store: a rival's may be as slow
    assert settle_seconds(0.1, 0.5) == pytest.approx(SETTLE_STORES * 0.5)
    assert settle_seconds(0.0, 0.0) == 0.0
    for bad in ((-0.1, 0.0), (0.1, -1.0), (math.nan, 0.0), (0.1, math.inf)):
        with pytest.raises(LocalProtocolError):
            settle_seconds(*bad)
