"""The simulated remote link: its max-min fair division among the running jobs' demands.

Owns: each running job's remote demand (its rate ceiling x miss ratio, capped by its IO
allocation), kept in the order water-filling takes them, and the outcome of the last
division (contended or not, the water level, the jobs held at it and the bound they were
held from, which says which jobs a new division can have moved across the level). Never:
sets a job's rate or reads a job; the simulator applies the shares.

A division is policies.base.water_fill_capped: smallest demand first, each gets its demand
while that is at most an equal split of what is left, and the first that is not, and
every larger one, get that split (the fair level). Sorting every demand at every step
would cost O(n log n); the order is kept instead, each demand moved by bisection when it
changes, and the demands in that order are kept in a numpy array (the link's only copy
of them as a division reads them), so a division is one or two numpy passes over a
stretch of it, from the first demand that moved to a little past the last first held
one (then on to the end if need be), what is left of the link kept in a second array:
the same arithmetic, the same shares, level and held jobs to the bit
(tests/unit/test_ctl_simulator.py checks this).
"""

from __future__ import annotations

import logging
import math
from bisect import bisect_left, bisect_right
from operator import itemgetter

import numpy as np

log = logging.getLogger(__name__)

# How far past the last division's first held place (or the lowest moved demand) a
# division's first numpy pass goes (Link._first_from; then a second to the end).
_PAST = 64


class Link:
    """The link of `capacity` bytes/s (math.inf: unlimited) and the demands on it."""

    def __init__(self, capacity: float) -> None:
        self.capacity = capacity
        self.demand: dict[str, float] = {}  # running jobs' capped demands, in plan order
        # The demands in the order a division takes them: (demand, position in
        # self.demand, name) ascending (a stable sort by demand); None: to be made again
        # from self.demand (a job came or left).
        self.order: list[tuple[float, int, str]] | None = None
        # The demands of self.order, in its order: the link's one copy of them as the
        # division reads them (numpy: a division is a pass in C over a stretch of it,
        # not a list copied into an array each time).
        self.values = np.empty(0)
        # The last division's running remainders (lefts[i]: the link less the demands
        # before position i; the first `valid` found), its first held position, and the
        # first position whose demand moved since (len(order): none).
        self.lefts = np.empty(1)
        self.valid = 0
        self.splits = np.empty(0)  # splits[i]: n - i, how many share what is left at i
        self.first = 0
        self.stale = 0
        self.pos: dict[str, int] = {}  # name -> position in self.demand
        self.names: list[str] = []  # the names of self.demand when pos was made
        self.contended = False  # demands exceeded the link at the last division
        self.level = math.inf  # that division's largest share when contended
        self.capped: set[str] = set()  # the jobs it held below their demand
        self.fair: float | None = None  # the level they were held at (None: nobody)
        # (demand, position) of the first job that division held (None: nobody): it held
        # exactly the jobs whose own pair was at least this, then.
        self.bound: tuple[float, int] | None = None
        # Jobs whose demand moved since that division without a new one, with their pair
        # at it: only they and the jobs between two divisions' bounds can change sides.
        self.drift: dict[str, tuple[float, int]] = {}

    def reset(self, demand: dict[str, float]) -> None:
        """New demands for every running job (a re-plan); the order is made again."""
        self.demand = demand
        self.order = None

    def drop(self, name: str) -> None:
        """A job left."""
        self.demand.pop(name, None)
        self.order = None

    def build(self) -> None:
        """self.order made from self.demand: sorted by demand, ties in the dict's order."""
        names = list(self.demand)
        n = len(names)
        if names != self.names:  # (a re-plan of the same running jobs keeps their order)
            self.names = names
            self.pos = dict(zip(names, range(n), strict=True))
        # Keyed by the demand alone (float keys compare fastest) and stable: ties stay in
        # position order, as sorting the whole (demand, position, name) tuples gives.
        self.order = order = sorted(
            zip(self.demand.values(), range(n), names, strict=True), key=itemgetter(0)
        )
        self.values = np.fromiter(map(itemgetter(0), order), float, n)
        if len(self.splits) != n:
            self.splits = np.arange(n, 0, -1, dtype=float)
            self.lefts = np.empty(n + 1)
        self.valid = 0
        self.stale = 0

    def move(self, name: str, old: float | None, new: float) -> None:
        """Keep self.order in step with one demand moving from `old` (None: new)."""
        order = self.order
        if order is None:
            return
        pos = self.pos.get(name)
        if old is None or pos is None:
            self.order = None  # a new name: its place in the dict's order is the last
            return
        if name not in self.drift:
            self.drift[name] = (old, pos)
        values = self.values
        at = bisect_left(order, (old, pos))
        del order[at]
        item = (new, pos, name)
        to = bisect_right(order, item)  # (insort's place)
        order.insert(to, item)
        # values as order: the one at `at` out, `new` in at `to` (numpy copies
        # overlapping slices as if through a buffer)
        if to > at:
            values[at:to] = values[at + 1 : to + 1]
        elif to < at:
            values[to + 1 : at + 1] = values[to:at]
            at = to
        values[to] = new
        if at < self.stale:
            self.stale = at

    def divide(self) -> tuple[int, float | None, float]:
        """water_fill_capped(capacity, demand) from the kept order: the position in
        self.order of the first demand held below itself (len(order): none), the fair
        level (None: nobody held) and the largest share (0 without demands). Demands
        before that position get themselves, the others the fair level."""
        if self.order is None:
            self.build()
        n = len(self.order)  # type: ignore[arg-type]
        values = self.values
        link = self.capacity
        if math.isinf(link):
            return n, None, float(values[-1]) if n else 0.0
        # Only the demands from `stale` on moved since the last division: what is left
        # before them, and whether they were held, stand (the same subtractions, in the
        # same order, give the same bits). What is left is found only as far as the
        # search for the first held demand needs it: the demands held at the level get
        # the level whatever they are.
        lefts, stale = self.lefts, self.stale
        if not self.valid or lefts[0] != link:  # (new demands, or a new capacity)
            stale = 0
            lefts[0] = link
            self.valid = 1
        if self.valid > stale + 1:
            self.valid = stale + 1  # (lefts[stale] is of the demands before it alone)
        first = self.first
        if first >= stale:
            first = self._first_from(stale)
        # (else the first held is before every moved demand: it stands)
        self.first, self.stale = first, n
        if first == n:
            return n, None, float(values[-1]) if n else 0.0
        fair = float(lefts[first]) / (n - first)
        if first > 0:
            below = float(values[first - 1])
            return first, fair, below if below > fair else fair
        return first, fair, fair

    def _first_from(self, start: int) -> int:
        """The first place from `start` on whose demand exceeds an equal split of what is
        left for it and the larger ones (len(order): none), in at most two numpy passes:
        to a little past the last division's first held place (where this search most
        likely ends: Alluxio's thrashing readers move demands ~150 places below it),
        then to the end. What is left is found on the way (`valid`: how many of
        `lefts` are). np.subtract.accumulate subtracts one by one in order, as the
        loop `left -= demand` does, and float / float (n - i is exact) and > are
        IEEE's in numpy as in Python: the remainders and the place found are the same
        bits as water_fill_capped's."""
        values, lefts, splits = self.values, self.lefts, self.splits
        n = len(values)
        if start >= n:
            return n
        stop = self.first + _PAST
        if stop < start + _PAST:
            stop = start + _PAST
        while True:
            if stop > n:
                stop = n
            valid = self.valid  # lefts[valid - 1] is found, valid - 1 <= start
            if valid < stop:  # lefts[valid:stop], on from lefts[valid - 1]
                found = lefts[valid - 1 : stop]
                found[1:] = values[valid - 1 : stop - 1]
                np.subtract.accumulate(found, out=found)
                self.valid = stop
            over = values[start:stop] > lefts[start:stop] / splits[start:stop]
            at = int(over.argmax())
            if over[at]:
                return start + at
            if stop == n:
                return n
            start, stop = stop, n

    def held_from(self, first: int) -> list[str]:
        """The names a division held at the level: those from position `first` on."""
        assert self.order is not None
        return list(map(itemgetter(2), self.order[first:]))

    def record(
        self, first: int, fair: float | None, capped: set[str] | None = None
    ) -> tuple[float, int] | None:
        """Record a division (divide's `first` and `fair`) as the last one: its bound,
        and the jobs it held (`capped` when the caller knows them, else found)."""
        bound = self.bound_at(first) if fair is not None else None
        self.capped = capped if capped is not None else set(self.held_from(first))
        self.fair, self.bound, self.drift = fair, bound, {}
        return bound

    def bound_at(self, first: int) -> tuple[float, int]:
        """(demand, position) of the first job held at the level: a job is held iff its
        own (demand, position) is at least this."""
        assert self.order is not None
        demand, pos, _ = self.order[first]
        return demand, pos

    def key(self, name: str) -> tuple[float, int]:
        """A job's place in the order a division takes the demands."""
        return self.demand[name], self.pos[name]

    def flips(self, bound: tuple[float, int] | None, moved: set[str]) -> set[str]:
        """The jobs not in `moved` that a division with `bound` holds and the last did
        not, or the other way round. A job whose demand has not moved since the last
        division was held by it iff its pair was at least that division's bound, so
        only the jobs between the two bounds, and those that drifted, can differ."""
        order = self.order
        assert order is not None
        old = self.bound
        at = len(order) if old is None else bisect_left(order, old)
        new = len(order) if bound is None else bisect_left(order, bound)
        lo, hi = (at, new) if at < new else (new, at)
        names = set(map(itemgetter(2), order[lo:hi]))
        names.update(self.drift)
        names -= moved
        demand, pos, capped = self.demand, self.pos, self.capped
        return {
            name
            for name in names
            if name in demand
            and (bound is not None and (demand[name], pos[name]) >= bound) != (name in capped)
        }

    def over(self) -> bool:
        """Do the demands exceed the link?"""
        return sum(self.demand.values()) > self.capacity
