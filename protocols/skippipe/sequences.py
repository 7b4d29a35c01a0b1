"""Which stage orders paths may take, and a balanced choice of stage sets for one iteration (rules 2-5).

Every order of `k` distinct stages that rule 4 allows is a candidate. With CheckFree+ on, its paths swap
both edge pairs, `(2, 1, .., s, s-1)`, and the other paths swap neither edge pair (so the share is exact);
where no order swaps both pairs (fewer than 4 stages per path or in the model, except the 2-stage
`(2, 1)`), CheckFree+ paths alternate between swapping the first pair and swapping the last pair; with
one stage per path there is nothing to swap and no path is CheckFree+.

Large spaces (more than `_MAX_SETS` stage sets) keep each set in stage order plus its edge swaps only, and
the balance fill scores a seeded sample of the sets per path: enough for CheckFree+ and coverage, without
enumerating tens of thousands of orders.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from protocols.errors import LocalProtocolError
from protocols.skippipe.rules import PathRules, order_violations

Order = tuple[int, ...]
# per kind: its stage sets, the same for look-ups, and the stages every one of them holds
_Pool = tuple[tuple[frozenset[int], ...], Mapping[frozenset[int], object], frozenset[int]]
_ATTEMPTS = 8
_MAX_SETS = 400  # stage sets beyond which only edge swaps are enumerated
_SAMPLE = 256  # stage sets scored per path when filling from a larger choice


def is_checkfree_plus(order: Sequence[int], n_stages: int) -> bool:
    """Whether a stage order swaps the first pair `(2, 1)` or the last pair `(s, s-1)`."""
    return _edge_swaps(order, n_stages) != (False, False)


def _edge_swaps(order: Sequence[int], n_stages: int) -> tuple[bool, bool]:
    if n_stages < 2 or len(order) < 2:
        return (False, False)
    return (tuple(order[:2]) == (2, 1), tuple(order[-2:]) == (n_stages, n_stages - 1))


@dataclass(frozen=True)
class SequenceSpace:
    """The allowed stage orders, by kind: kind 0 is an ordinary path, kinds 1.. are CheckFree+ paths."""

    n_stages: int
    rules: PathRules
    kinds: tuple[frozenset[Order], ...]
    by_set: tuple[dict[frozenset[int], tuple[Order, ...]], ...] = field(init=False, repr=False, compare=False)
    pools: tuple[_Pool, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        grouped = []
        for orders in self.kinds:
            sets: dict[frozenset[int], list[Order]] = defaultdict(list)
            for order in sorted(orders):
                sets[frozenset(order)].append(order)
            grouped.append({stages: tuple(sets[stages]) for stages in sorted(sets, key=sorted)})
        object.__setattr__(self, "by_set", tuple(grouped))
        pools = [
            (tuple(sets), sets, frozenset.intersection(*sets) if sets else frozenset()) for sets in grouped
        ]
        object.__setattr__(self, "pools", tuple(pools))

    @classmethod
    def of(cls, n_stages: int, rules: PathRules) -> SequenceSpace:
        """Every allowed order, or, where there are more than `_MAX_SETS` stage sets (16 stages with 12 per
        path have 60,276 orders), each set in stage order plus its orders that swap edge pairs only."""
        k = rules.stages_per_path(n_stages)
        if math.comb(n_stages, k) > _MAX_SETS:
            orders = list(_edge_orders(n_stages, k, rules))
        else:
            orders = list(_orders(n_stages, k, rules))
        reached = {stage for order in orders for stage in order}
        unreachable = sorted(set(range(1, n_stages + 1)) - reached)
        if unreachable:
            raise LocalProtocolError(
                f"stages {unreachable} are unreachable with {k} stages per path and forward jumps of at most "
                f"{rules.max_forward_jump}"
            )
        if rules.checkfree_plus_share == 0:
            return cls(n_stages, rules, (frozenset(orders),))
        by_swaps = defaultdict(set)
        for order in orders:
            by_swaps[_edge_swaps(order, n_stages)].add(order)
        plain = frozenset(by_swaps[(False, False)])
        if by_swaps[(True, True)]:
            return cls(n_stages, rules, (plain, frozenset(by_swaps[(True, True)])))
        edge = tuple(
            frozenset(by_swaps[swaps]) for swaps in ((True, False), (False, True)) if by_swaps[swaps]
        )
        return cls(n_stages, rules, (plain, *edge))

    @property
    def k(self) -> int:
        """Transformer stages per path."""
        return self.rules.stages_per_path(self.n_stages)

    def kind_of(self, order: Order) -> int | None:
        """The kind whose orders include `order`, None if no kind does."""
        return next((kind for kind, orders in enumerate(self.kinds) if order in orders), None)

    def balanced(self, n_microbatches: int, rng: random.Random) -> list[tuple[int, frozenset[int]]]:
        """A kind and a stage set for each of `n_microbatches` paths, with balanced stage visits (rule 5).

        `round(share * n)` paths are CheckFree+ (alternating between CheckFree+ kinds), fewer only where
        balanced coverage cannot be kept with that many.
        """
        target = round(self.rules.checkfree_plus_share * n_microbatches) if len(self.kinds) > 1 else 0
        zero = [0] * (self.n_stages + 1)
        for count in range(target, -1, -1):
            kinds = [1 + i % (len(self.kinds) - 1) for i in range(count)] + [0] * (n_microbatches - count)
            for _ in range(_ATTEMPTS):
                sets = self.fill(kinds, zero, n_microbatches, rng)
                if sets is not None:
                    return list(zip(kinds, sets, strict=True))
        raise LocalProtocolError(
            f"no balanced set of {n_microbatches} paths over {self.n_stages} stages found"
        )

    def fill(
        self, kinds: Sequence[int], counts: Sequence[int], n_microbatches: int, rng: random.Random
    ) -> list[frozenset[int]] | None:
        """Stage sets for paths of these kinds that bring the stage visit `counts` (index 0 unused) of an
        iteration of `n_microbatches` into balance, or None if this greedy attempt finds none."""
        low, extra = divmod(n_microbatches * self.k, self.n_stages)
        return _fill([self.pools[kind] for kind in kinds], list(counts), low, extra, rng)


def _orders(n_stages: int, k: int, rules: PathRules) -> Iterator[Order]:
    """Depth-first: every order of k distinct stages that rule 4 allows."""

    def extend(prefix: Order, frontier: int, swaps: int, distance: int) -> Iterator[Order]:
        if len(prefix) == k:
            yield prefix
            return
        for stage in range(1, n_stages + 1):
            if stage in prefix:
                continue
            if stage < frontier:
                if frontier - stage == 1 and swaps < rules.max_swaps and distance < rules.max_swap_distance:
                    yield from extend((*prefix, stage), frontier, swaps + 1, distance + 1)
            elif stage - frontier <= rules.max_forward_jump:
                yield from extend((*prefix, stage), stage, swaps, distance)

    yield from extend((), 0, 0, 0)


def _edge_orders(n_stages: int, k: int, rules: PathRules) -> Iterator[Order]:
    """For each set of k stages that rule 4 allows in stage order: that order, and the same with the
    first pair `(1, 2)`, the last pair `(s-1, s)` or both swapped, where the set holds them and rule 4
    allows it."""
    for chosen in itertools.combinations(range(1, n_stages + 1), k):
        if order_violations(chosen, rules):
            continue
        yield chosen
        front = chosen[:2] == (1, 2)
        back = chosen[-2:] == (n_stages - 1, n_stages) and k >= (4 if front else 2)
        for swap_front, swap_back in ((True, False), (False, True), (True, True)):
            if (swap_front and not front) or (swap_back and not back):
                continue
            order = list(chosen)
            if swap_front:
                order[0], order[1] = order[1], order[0]
            if swap_back:
                order[-1], order[-2] = order[-2], order[-1]
            if not order_violations(order, rules):
                yield tuple(order)


def _fill(
    candidates: list[_Pool], counts: list[int], low: int, extra: int, rng: random.Random
) -> list[frozenset[int]] | None:
    """Per path (most constrained first) the allowed stage set whose stages need visits most, such that
    every stage ends with `low` or `low + 1` visits and at most `extra` stages with `low + 1`."""
    n_stages = len(counts) - 1
    if any(c > low + 1 for c in counts[1:]) or sum(1 for c in counts[1:] if c == low + 1) > extra:
        return None
    chosen: list[frozenset[int] | None] = [None] * len(candidates)
    order = sorted(range(len(candidates)), key=lambda i: (len(candidates[i][0]), rng.random()))
    for done, i in enumerate(order):
        left_after = len(candidates) - done - 1
        at_high = sum(1 for c in counts if c == low + 1)
        # every stage short of more visits than the paths after this one can bring must be in this set
        short = {j for j in range(1, n_stages + 1) if low - counts[j] > left_after}
        hopeless = any(low - counts[j] - 1 > left_after for j in short)  # even with this path
        best, best_score = None, -1.0
        for stages in _choice(candidates[i], counts, rng):
            raised = sum(1 for stage in stages if counts[stage] == low)
            if any(counts[stage] > low for stage in stages) or at_high + raised > extra:
                continue
            if hopeless or not short.issubset(stages):
                continue
            score = sum(low + 1 - counts[stage] for stage in stages) + rng.random() * 0.5
            if score > best_score:
                best, best_score = stages, score
        if best is None:
            return None
        for stage in best:
            counts[stage] += 1
        chosen[i] = best
    if any(c < low for c in counts[1:]):
        return None
    return [stages for stages in chosen if stages is not None]


def _choice(pool: _Pool, counts: list[int], rng: random.Random) -> Sequence[frozenset[int]]:
    """The pool's sets, or where it has more than `_SAMPLE`, a seeded sample of them plus the set made of
    the kind's required stages and the stages that need visits most (scoring every set of a large space
    for every path is too slow)."""
    sets, allowed, required = pool
    if len(sets) <= _SAMPLE:
        return sets
    k = len(sets[0])
    others = sorted(set(range(1, len(counts))) - required, key=lambda stage: (counts[stage], rng.random()))
    neediest = required | frozenset(others[: k - len(required)])
    return [neediest, *rng.sample(sets, _SAMPLE)] if neediest in allowed else rng.sample(sets, _SAMPLE)
