"""Evidence for CheckFree+ copies: the iterations in which a node served in an edge stage's place, recently.

CheckFree+ rebuilds a lost stage 1 (stage s) as a copy of its swap partner, stage 2 (stage s-1), because the
partner trained in its place: S2 right after the embeddings, S(s-1) right before the de-embedding. A path
puts the partner there when the edge pair is swapped (`protocols.checkfree.swaps_edge_pairs`) and also when
the path skips the edge stage (SkipPipe) or routes around it; not when the path skips the partner, not
before a partner rebuilt since has served, and never where no swap is scheduled and nothing is skipped.
So a node notes, for each microbatch whose backward pass it completed, whether it served it there
(`edge_places`), keeps the iterations in which it did over the last `STAND_IN_WINDOW_STEPS` steps of the swarm
clock (`StandIns`), and publishes how many there were in its record (`NodeRecord.stood_in`).

Why iterations, not microbatches: when a stage dies, the microbatches in flight are re-routed past it, so its
partner serves a burst of them in its place, as many as the swarm has in flight (every data node's
microbatches), but within one or two iterations (a run that skips nothing then waits for the stage). The
schedule's swaps, and a skipping run's paths, put the partner in place iteration after iteration.

Window and threshold: the schedule swaps every other microbatch, alternating across iterations, so a data
node with a single microbatch per iteration puts one microbatch in each edge place every two iterations,
and a partner stage of R replicas gives each replica one every 2R iterations. Over `STAND_IN_WINDOW_STEPS` =
50 steps (also the papers' NoLoCo outer period H, over which replicas drift apart before they average) a
replica then stands in during 50 / 2R iterations: `MIN_STAND_INS` = 4 holds up to 6 replicas in that
slowest configuration, and is above the one or two iterations of a failure's re-routed burst. A partner
rebuilt since starts from 0 and qualifies after 4 such iterations (8 at one microbatch per iteration).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from protocols.errors import LocalProtocolError

STAND_IN_WINDOW_STEPS = 50  # steps of the swarm clock a node's stand-in count covers
MIN_STAND_INS = 4  # iterations in which one partner node served in the lost stage's place, for a copy of it


def edge_places(stages: Sequence[int], hop: int, num_stages: int) -> tuple[bool, bool]:
    """Whether the node at `hop` of a path through `stages` (stage 0, the data node, at both ends) served
    that microbatch in stage 1's place and in stage s's place: stage 2 right after the embeddings stands in
    for stage 1, stage s-1 right before the de-embedding for stage s (with s = 3, stage 2 alone on a path
    stands in for both). Models of one transformer stage have no swap partner."""
    valid = all(isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= num_stages for k in stages)
    if (
        isinstance(num_stages, bool)
        or not isinstance(num_stages, int)
        or num_stages < 1
        or not valid
        or isinstance(hop, bool)
        or not isinstance(hop, int)
        or not 0 < hop < len(stages) - 1
        or stages[hop] == 0
    ):
        raise LocalProtocolError(
            f"hop {hop!r} of {tuple(stages)!r} is no transformer hop of a model of {num_stages!r} stages"
        )
    if num_stages < 2:
        return False, False
    first = stages[hop] == 2 and stages[hop - 1] == 0
    last = stages[hop] == num_stages - 1 and stages[hop + 1] == 0
    return first, last


@dataclass(frozen=True)
class StandIns:
    """The iterations in which one node served at least one microbatch in stage 1's place (`first`) and in
    stage s's place (`last`), ascending, none more than `STAND_IN_WINDOW_STEPS` behind the latest clock
    `add` saw."""

    first: tuple[int, ...] = ()
    last: tuple[int, ...] = ()

    def add(self, iteration: int, places: tuple[bool, bool], clock: int) -> StandIns:
        """This tally with a microbatch of `iteration` served in the `places` (`edge_places`), at swarm clock
        `clock`; iterations that fell out of the window are dropped."""
        if iteration < 0 or clock < 0:
            raise LocalProtocolError(f"invalid stand-in at iteration {iteration}, clock {clock}")
        horizon = max(clock, iteration) - STAND_IN_WINDOW_STEPS

        def kept(iterations: tuple[int, ...], served: bool) -> tuple[int, ...]:
            return tuple(sorted({i for i in iterations if i > horizon} | ({iteration} if served else set())))

        return StandIns(kept(self.first, places[0]), kept(self.last, places[1]))

    def recent(self, clock: int) -> tuple[int, int]:
        """How many iterations of the window ending at swarm clock `clock` (those after `clock -
        STAND_IN_WINDOW_STEPS`) had a microbatch served here in stage 1's place, and in stage s's place."""
        if clock < 0:
            raise LocalProtocolError(f"invalid clock {clock}")
        horizon = clock - STAND_IN_WINDOW_STEPS
        return sum(i > horizon for i in self.first), sum(i > horizon for i in self.last)
