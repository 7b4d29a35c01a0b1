"""The construction's choice among candidate paths, timed lazily.

A candidate's finish is bounded below cheaply (its forward chain is timed; the head and the backward
passes are counted without waiting), and candidates are timed exactly in the order of that bound, only
as far as the choice needs: the earliest finish, then the candidates within `slack` of the earliest that
fits in memory. The choice is the one an exhaustive ranking by (does not fit, finish, index) makes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Generic, TypeVar

from protocols.errors import LocalProtocolError

T = TypeVar("T")


class Ranking(Generic[T]):
    """Candidates `0..n-1` with lower bounds on their finish, timed on demand by `evaluate` (returning the
    candidate and its finish); `fits` says whether a timed candidate keeps every node within memory."""

    def __init__(
        self,
        bounds: list[float],
        evaluate: Callable[[int], tuple[T, float]],
        fits: Callable[[T], bool],
        margin: float,
        slack: float,
    ) -> None:
        self._order = sorted(range(len(bounds)), key=lambda i: (bounds[i], i))
        self._bounds = bounds
        self._evaluate = evaluate
        self._fits_of = fits
        self._slack = slack
        self._next = 0  # candidates _order[:_next] are timed
        self._timed: dict[int, tuple[T, float]] = {}
        self._fit: dict[int, bool] = {}
        self._removed: set[int] = set()
        best = math.inf
        while self._next < len(self._order) and bounds[self._order[self._next]] < best:
            best = min(best, self._time_next())
        if not self._timed:
            raise LocalProtocolError("no candidate path to choose from")
        self._limit = best * margin  # a fitting path is preferred unless it finishes this much later

    def candidate(self, i: int) -> T:
        return self._timed[i][0]

    def near(self) -> list[int]:
        """The front group of the ranking (fitting within the margin first, then the rest) within `slack`
        of its earliest finish, in rank order; empty once every candidate is removed."""
        while True:
            frontier = self._frontier()
            timed = sorted(
                (finish, i)
                for i, (_, finish) in self._timed.items()
                if i not in self._removed and finish < frontier
            )
            fitting = [(f, i) for f, i in timed if f <= self._limit]
            front = next((f for f, i in fitting if self._fits(i)), None)
            if front is not None:
                top = front * (1.0 + self._slack) + 1e-9
                if top < frontier:
                    return [i for f, i in fitting if f <= top and self._fits(i)]
                self._time_upto(top)
            elif frontier <= self._limit:
                self._time_upto(self._limit)
            elif timed:  # no fitting candidate is left: every one left ranks in the second group
                top = timed[0][0] * (1.0 + self._slack) + 1e-9
                if top < frontier:
                    return [i for f, i in timed if f <= top]
                self._time_upto(top)
            elif self._next < len(self._order):
                self._time_next()
            else:
                return []

    def remove(self, i: int) -> None:
        self._removed.add(i)

    def _fits(self, i: int) -> bool:
        fit = self._fit.get(i)
        if fit is None:
            fit = self._fit[i] = self._fits_of(self._timed[i][0])
        return fit

    def _frontier(self) -> float:
        """Every candidate not yet timed finishes at or after this."""
        return self._bounds[self._order[self._next]] if self._next < len(self._order) else math.inf

    def _time_next(self) -> float:
        i = self._order[self._next]
        self._next += 1
        self._timed[i] = timed = self._evaluate(i)
        return timed[1]

    def _time_upto(self, upto: float) -> None:
        while self._next < len(self._order) and self._bounds[self._order[self._next]] <= upto:
            self._time_next()
