"""Counting the microbatches a node serves in an edge stage's place (`protocols.standins`), and the record
field that publishes the count."""

from __future__ import annotations

import msgpack
import pytest

from protocols.checkfree import SWAP_MIN_STAGES, swap_edge_pairs, swaps_edge_pairs
from protocols.errors import LocalProtocolError, RemoteProtocolError
from protocols.messages import MAX_RECORD_BYTES, NodeRecord, NodeState, decode, encode
from protocols.standins import STAND_IN_WINDOW_STEPS, StandIns, edge_places


def places(stages: tuple[int, ...], s: int) -> list[tuple[int, int]]:
    """`edge_places` of every transformer hop of a path (stage 0 at both ends), as 0 / 1."""
    return [tuple(map(int, edge_places(stages, hop, s))) for hop in range(1, len(stages) - 1)]  # type: ignore[misc]


@pytest.mark.parametrize(
    ("stages", "s", "expected"),
    [
        # in stage order nobody stands in
        ((0, 1, 2, 3, 4, 0), 4, [(0, 0)] * 4),
        # both pairs swapped: stage 2 right after the embeddings, stage 3 right before the de-embedding
        ((0, 2, 1, 4, 3, 0), 4, [(1, 0), (0, 0), (0, 0), (0, 1)]),
        ((0, 2, 1, 3, 4, 6, 5, 0), 6, [(1, 0), (0, 0), (0, 0), (0, 0), (0, 0), (0, 1)]),
        # stage 1 skipped: stage 2 serves in its place all the same
        ((0, 2, 3, 4, 0), 4, [(1, 0), (0, 0), (0, 0)]),
        # the partner skipped: stage 3 right after the embeddings is nobody's swap partner
        ((0, 1, 3, 4, 0), 4, [(0, 0)] * 3),
        ((0, 3, 4, 0), 4, [(0, 0), (0, 0)]),
        # three stages: stage 2 is the partner of both edges
        ((0, 2, 0), 3, [(1, 1)]),
        ((0, 1, 2, 0), 3, [(0, 0), (0, 1)]),
        # two stages: each is the other's partner
        ((0, 2, 1, 0), 2, [(1, 0), (0, 1)]),
        ((0, 1, 2, 0), 2, [(0, 0), (0, 0)]),
        # one stage: no partner
        ((0, 1, 0), 1, [(0, 0)]),
    ],
)
def test_edge_places_of_a_path(stages: tuple[int, ...], s: int, expected: list[tuple[int, int]]) -> None:
    assert places(stages, s) == expected


@pytest.mark.parametrize(
    ("stages", "hop", "s"),
    [
        ((0, 2, 0), 0, 3),  # the data node's own hop
        ((0, 2, 0), 2, 3),
        ((0, 2, 0), 3, 3),
        ((0, 0, 0), 1, 3),
        ((0, 5, 0), 1, 3),  # no such stage
        ((0, True, 0), 1, 3),
        ((0, 2, 0), 1, 0),
        ((0, 2, 0), True, 3),
    ],
)
def test_edge_places_rejects_what_is_no_transformer_hop(stages: tuple, hop: int, s: int) -> None:
    with pytest.raises(LocalProtocolError):
        edge_places(stages, hop, s)


@pytest.mark.parametrize("s", range(1, 9))
def test_the_swap_schedule_puts_the_partners_in_place_on_half_of_the_microbatches(s: int) -> None:
    """Paths in stage order, reordered where `swaps_edge_pairs` says so (as `node.planning` does): with 4
    stages or more each partner serves in its edge's place on exactly the swapped microbatches, in every
    iteration of three microbatches, or every other iteration of one; below, never (such models never swap,
    and these paths skip nothing)."""
    hops = tuple(range(1, s + 1))
    for microbatches, share in ((3, 1), (1, 2)):
        first = last = swapped = 0
        tally = StandIns()
        for iteration in range(STAND_IN_WINDOW_STEPS):
            for microbatch in range(microbatches):
                order = hops
                if swaps_edge_pairs(s, iteration, microbatch):
                    swapped += 1
                    order = tuple(hops[i] for i in swap_edge_pairs(hops, s))
                path = (0, *order, 0)
                for hop in range(1, len(path) - 1):
                    f, la = edge_places(path, hop, s)
                    first, last = first + f, last + la
                    tally = tally.add(iteration, (f, la), iteration)
        swaps = s >= SWAP_MIN_STAGES
        assert swapped == (STAND_IN_WINDOW_STEPS * microbatches // 2 if swaps else 0)
        assert (first, last) == (swapped, swapped)
        iterations = STAND_IN_WINDOW_STEPS // share if swaps else 0
        assert tally.recent(STAND_IN_WINDOW_STEPS - 1) == (iterations, iterations)


def test_stand_ins_count_iterations_over_the_window_of_the_swarm_clock() -> None:
    tally = StandIns()
    for iteration in range(100):
        for _ in range(3):  # several microbatches of one iteration count once
            tally = tally.add(iteration, (True, iteration % 2 == 1), iteration)
    assert tally.recent(99) == (STAND_IN_WINDOW_STEPS, STAND_IN_WINDOW_STEPS // 2)
    assert len(tally.first) == STAND_IN_WINDOW_STEPS  # what fell out of the window is dropped
    later = 99 + STAND_IN_WINDOW_STEPS // 2  # the window is the iterations after clock - window
    recent = range(later - STAND_IN_WINDOW_STEPS + 1, 100)
    assert tally.recent(later) == (len(recent), sum(i % 2 for i in recent))
    assert tally.recent(99 + STAND_IN_WINDOW_STEPS) == (0, 0)  # stale: nothing recent
    assert StandIns().add(8, (False, False), 8) == StandIns()  # nothing served in a place adds nothing
    assert StandIns().recent(0) == (0, 0)  # a node that just joined has served nothing in the places


def test_a_failure_burst_is_one_iteration() -> None:
    """The microbatches re-routed past a dying stage 1 all come from the iterations in flight."""
    tally = StandIns()
    for _ in range(16):  # every data node's microbatches of iteration 30
        tally = tally.add(30, edge_places((0, 2, 3, 0), 1, 3), 30)
    assert tally.recent(31) == (1, 0)


@pytest.mark.parametrize(("iteration", "clock"), [(-1, 0), (0, -1)])
def test_stand_ins_reject_negative_input(iteration: int, clock: int) -> None:
    with pytest.raises(LocalProtocolError):
        StandIns().add(iteration, (True, False), clock)
    with pytest.raises(LocalProtocolError):
        StandIns().recent(-1)


# ---- the record field -------------------------------------------------------------------------------------


def test_records_carry_the_stand_in_counts() -> None:
    record = NodeRecord(NodeState.ONLINE, 2, 40, 3, stood_in=[12, 0])
    assert record.stood_in == (12, 0)
    assert decode(encode(record), NodeRecord, max_bytes=MAX_RECORD_BYTES) == record
    assert NodeRecord(NodeState.ONLINE, 2, 40, 3).stood_in is None  # not counted


def test_records_of_older_nodes_without_the_field_are_accepted() -> None:
    fields = msgpack.unpackb(encode(NodeRecord(NodeState.ONLINE, 3, 40, 3, throughput=2.0)))
    del fields["stood_in"]
    old = decode(msgpack.packb(fields), NodeRecord, max_bytes=MAX_RECORD_BYTES)
    assert old.stood_in is None and old.throughput == 2.0
    del fields["step"]  # the other fields stay required
    with pytest.raises(RemoteProtocolError, match="missing fields step"):
        decode(msgpack.packb(fields), NodeRecord)


@pytest.mark.parametrize("value", [[1], [1, 2, 3], [-1, 0], [True, 0], [1.5, 0], "12"])
def test_malformed_stand_in_counts_are_rejected(value: object) -> None:
    with pytest.raises(LocalProtocolError, match="stood_in"):
        NodeRecord(NodeState.ONLINE, 2, 40, 3, stood_in=value)  # type: ignore[arg-type]
    fields = msgpack.unpackb(encode(NodeRecord(NodeState.ONLINE, 2, 40, 3)))
    with pytest.raises(RemoteProtocolError, match="stood_in"):
        decode(msgpack.packb({**fields, "stood_in": value}), NodeRecord)
