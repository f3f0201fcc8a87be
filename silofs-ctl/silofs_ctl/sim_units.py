"""The simulated cluster cache: each unit's allocation and fill, and what flows into it.

Owns: per cache unit, the bytes allocated and held (uniform caching), the remote bytes/s
its running readers fetch into it (`inflow`) and when its fill was last brought to now;
the units still filling, when each will be full, and which of them several jobs read;
and, under LRU, handing what is fetched to the LRU pool (sim_lru.LruPool). Never: reads
jobs' progress, sets rates, or decides allocations.

Fills are lazy: between two updates a unit's inflow is constant, so what it holds now is
min(cap, held + inflow x dt), written back only when something reads or changes it. A
uniform unit admits up to its allocation and then admits nothing (a unit that becomes
full sets `full`: what the policy planned with has changed); an LRU dataset's holding
grows up to its steady-state target.

Fill events. While a filling unit's inflow and cap stay, the moment it reaches its cap
(which bounds the simulator's steps) and the moment it reaches `full_at` (from which it
counts as full) are fixed; both are kept per unit in two arrays (`t_cap`, `t_full`:
numpy from 64 units, lists below), so a step costs a min or a comparison over them in
C, not a visit of every filling unit (CoorDL runs some 500 of them at once). A unit's
entries stand while it is filling and are set to infinity when it stops (one found
stale where a search meets it is dropped there). A unit whose
inflow or cap moves has its entries written anew when they are next read (once per step
however many of its readers were re-rated; after a plan, all of them at once as array
operations, the same IEEE arithmetic as one at a time). Bringing a unit's fill to now
(sync) moves neither moment, so it writes nothing. Among equal moments the one written
first is taken (`ev_seq`). The moments only choose which units to look at: the step to
a unit's cap and whether it is full are found from its fill now, as a visit of every
unit would find them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from itertools import repeat

import numpy as np

from .model import CacheUnit
from .sim_job import SimJob
from .sim_lru import LruPool

log = logging.getLogger(__name__)

# The most of a dataset filled per step while several jobs read it: what one fetches
# raises the others' hits continuously, and a step holds their rates constant.
SHARED_FILL_STEP = 0.02
# From this many units the fill events are numpy arrays (a search is a call in C over
# them); below, lists (numpy's fixed cost per call is more than a scan of a few). From
# this many entries written at once they are written as array operations.
_ARRAYS_FROM_UNITS = 64
_ARRAYS_FROM = 32


class Units:
    def __init__(self, units: Mapping[str, CacheUnit], pool: LruPool) -> None:
        self.units = units
        self.pool = pool
        self.lru = False  # the cache is the LRU pool (set per plan)
        self.filled: dict[str, float] = dict.fromkeys(units, 0.0)
        self.allocated: dict[str, float] = dict.fromkeys(units, 0.0)
        # What a uniform unit may hold (its allocation, at most its dataset), and the
        # fill at which it counts as full (that, less rounding): found as the
        # allocation moves, read at every step.
        self.cap: dict[str, float] = {}
        self.full_at: dict[str, float] = {}
        # Each unit's size, and what less than its cap counts as full (rounding): fixed.
        self.size_tol: dict[str, tuple[float, float]] = {}
        for key, unit in units.items():
            size = unit.size
            tol = size * 1e-12
            self.size_tol[key] = (size, tol if tol > 1.0 else 1.0)  # max(1, size * 1e-12)
            self._cap(key)
        self.in_use: set[str] = set()  # units allocated or holding bytes (see allocate)
        # Units that had room (below full_at) at the last allocation, some of which may
        # have filled since: between two allocations a unit's full_at stays and its fill
        # only grows, so a unit without room stays so (below_allocation prunes them).
        self.roomy: set[str] = set()
        self.inflow: dict[str, float] = {}  # remote bytes/s its running readers fetch
        self.unit_t: dict[str, float] = {}  # when its fill was last brought to now
        # Units with inflow and room: they bound steps. A dict for its order: the
        # simulator visits them in turn and sums rates in that order, and a set's order
        # (of str hashes) would change with PYTHONHASHSEED, and with it the last bits.
        self.filling: dict[str, None] = {}
        self.fill_pos: dict[str, int] = {}  # a filling unit's place in that order
        self.fill_count = 0  # units that started filling (the next place)
        # Filling units whose inflow or cap moved since their events were written:
        # written anew when the events are next read (a step moves a shared unit's
        # inflow once per reader it re-rates). A dict for its order, as `filling`.
        self.unpushed: dict[str, None] = {}
        # The fill events, by the unit's place in `keys`: when it reaches its cap, when
        # it reaches full_at (math.inf: none), and the order they were written in.
        self.keys = list(units)
        self.index = {key: i for i, key in enumerate(self.keys)}
        n = len(self.keys)
        self.arrays = n >= _ARRAYS_FROM_UNITS
        self.t_cap: np.ndarray | list[float]
        self.t_full: np.ndarray | list[float]
        self.ev_seq: np.ndarray | list[int]
        if self.arrays:
            self.t_cap, self.t_full = np.full(n, math.inf), np.full(n, math.inf)
            self.ev_seq = np.zeros(n, np.int64)
        else:
            self.t_cap, self.t_full, self.ev_seq = [math.inf] * n, [math.inf] * n, [0] * n
        self.seq = 0  # the last fill event's sequence number
        self.shared: set[str] = set()  # units at least two active jobs read
        self.moved: set[str] = set()  # units whose cap or fill a plan moved (allocate)
        # Units the last allocation shrank below what they held: their readers' H (and
        # so hit ratios) moved; every other unit's readers kept theirs.
        self.evicted: set[str] = set()
        self.full = False  # a unit became full since the flag was last cleared

    def _cap(self, key: str) -> None:
        size, tol = self.size_tol[key]
        want = self.allocated[key]
        self.cap[key] = cap = size if size < want else want  # min(want, size)
        self.full_at[key] = cap - tol

    def _start_filling(self, key: str) -> None:
        """Unit `key` (brought to now, with inflow and room) is filling; its fill events
        are due again (its inflow or cap moved)."""
        if key not in self.filling:
            self.filling[key] = None
            self.fill_pos[key] = self.fill_count
            self.fill_count += 1
        self.unpushed[key] = None

    def _push(self) -> None:
        """The fill events of the units in `unpushed` still filling, written anew."""
        filling = self.filling
        keys = [key for key in self.unpushed if key in filling]
        self.unpushed = {}
        if self.arrays and len(keys) >= _ARRAYS_FROM:
            self._schedule_all(keys)
            return
        for key in keys:
            self._schedule(key)

    def _schedule(self, key: str) -> None:
        """Write filling unit `key`'s two moments from its fill and inflow now."""
        self.seq = seq = self.seq + 1
        i = self.index[key]
        inflow, held, start = self.inflow[key], self.filled[key], self.unit_t[key]
        self.t_cap[i] = start + (self.cap[key] - held) / inflow
        self.t_full[i] = start + (self.full_at[key] - held) / inflow
        self.ev_seq[i] = seq

    def _schedule_all(self, keys: list[str]) -> None:
        """_schedule of each of `keys` in turn, as array operations (elementwise, so the
        same IEEE results)."""
        n = len(keys)
        idx = np.fromiter(map(self.index.__getitem__, keys), np.intp, n)
        inflow = np.fromiter(map(self.inflow.__getitem__, keys), float, n)
        held = np.fromiter(map(self.filled.__getitem__, keys), float, n)
        start = np.fromiter(map(self.unit_t.__getitem__, keys), float, n)
        cap = np.fromiter(map(self.cap.__getitem__, keys), float, n)
        full_at = np.fromiter(map(self.full_at.__getitem__, keys), float, n)
        self.t_cap[idx] = start + (cap - held) / inflow
        self.t_full[idx] = start + (full_at - held) / inflow
        self.ev_seq[idx] = np.arange(self.seq + 1, self.seq + 1 + n)
        self.seq += n

    def _drop(self, i: int) -> None:
        """Unit `keys[i]` is no longer filling: its (stale) events are dropped."""
        self.t_cap[i] = math.inf
        self.t_full[i] = math.inf

    def _stop_filling(self, key: str) -> None:
        """Unit `key` is no longer filling (if it was): its events go with it, so that
        a search for the soonest does not meet them."""
        if self.filling.pop(key, 0) is None:
            self._drop(self.index[key])

    def _soonest_cap(self) -> str | None:
        """The filling unit whose cap event is soonest (the first written among equals),
        its stale rivals dropped on the way; None: no unit is filling."""
        t_cap, keys, filling = self.t_cap, self.keys, self.filling
        if not keys:
            return None
        while True:
            i, tied = self._first_min(t_cap)
            when = t_cap[i]
            if when == math.inf:
                return None
            if tied:
                if self.arrays:
                    ties = (t_cap == when).nonzero()[0].tolist()  # type: ignore[operator]
                else:
                    ties = [j for j, t in enumerate(t_cap) if t == when]
                for j in ties:
                    if keys[j] not in filling:
                        self._drop(j)
                live = [j for j in ties if keys[j] in filling]
                if not live:
                    continue
                i = min(live, key=self.ev_seq.__getitem__)
            key = keys[i]
            if key in filling:
                return key
            self._drop(i)

    def _first_min(self, t: np.ndarray | list[float]) -> tuple[int, bool]:
        """Where `t` is least (the first place), and whether another place ties."""
        if self.arrays:
            i = int(t.argmin())  # type: ignore[union-attr]
            return i, len(t) - 1 - int(t[::-1].argmin()) != i  # type: ignore[index]
        least = min(t)
        return t.index(least), t.count(least) > 1  # type: ignore[union-attr]

    def _due(self, late: float) -> list[int]:
        """The places whose full moment is at most `late`."""
        t_full = self.t_full
        if self.arrays:
            if np.minimum.reduce(t_full) > late:  # (.min(), without its Python layer)
                return []
            return (t_full <= late).nonzero()[0].tolist()  # type: ignore[operator]
        if min(t_full, default=math.inf) > late:
            return []
        return [i for i, t in enumerate(t_full) if t <= late]

    def filled_now(self, key: str, now: float) -> float:
        """What unit `key` holds at `now`, without bringing it up to date."""
        inflow = self.inflow.get(key, 0.0)
        held = self.filled[key]
        if inflow <= 0:
            return held
        cap = self.cap[key]
        grown = held + inflow * (now - self.unit_t[key])
        if not grown < cap:
            grown = cap
        return grown if grown > held else held  # max(held, min(cap, grown))

    def room(self, key: str) -> bool:
        """Can uniform unit `key` still admit bytes?"""
        return self.filled[key] < self.full_at[key]

    def sync(self, key: str, now: float) -> None:
        """Bring a unit's fill to `now`: its readers fetched at a constant total rate since
        it was last brought up to date."""
        inflow = self.inflow.get(key, 0.0)
        last = self.unit_t.get(key, now)
        self.unit_t[key] = now
        if inflow <= 0 or now <= last:
            return
        fetched = inflow * (now - last)
        if self.lru:
            self.pool.add(self.units[key].dataset, fetched)
            return
        cap = self.cap[key]
        held = self.filled[key]
        if held >= cap:
            return
        held += fetched
        self.filled[key] = held = held if held < cap else cap  # min(cap, held)
        if held >= self.full_at[key]:
            self.full = True  # what the policy planned with has changed
            self._stop_filling(key)

    def sync_all(self, now: float) -> None:
        """Every unit with an inflow brought to `now`."""
        if self.lru:
            for key in list(self.inflow):
                self.sync(key, now)
            return
        # (sync of each, written out: this visits every unit with an inflow at every
        # plan)
        unit_t, filled, cap, full_at, filling = (
            self.unit_t, self.filled, self.cap, self.full_at, self.filling
        )  # fmt: skip
        for key, inflow in self.inflow.items():
            if inflow > 0:
                held, top = filled[key], cap[key]
                if held < top:
                    last = unit_t.get(key, now)
                    unit_t[key] = now
                    if now <= last:
                        continue
                    held += inflow * (now - last)
                    filled[key] = held = held if held < top else top  # min(cap, held)
                    if held >= full_at[key]:
                        self.full = True  # what the policy planned with has changed
                        if filling.pop(key, 0) is None:
                            self._drop(self.index[key])
                    continue
            unit_t[key] = now  # (all sync would do: it holds what it will hold)

    def move_inflow(self, key: str, new: float, old: float, now: float) -> None:
        """A reader of unit `key` now fetches `new` bytes/s instead of `old`."""
        lru = self.lru
        if not lru or key in self.pool.growing:
            # (an LRU dataset at its target stays there until a re-target, which brings
            # every unit up to date first: nothing to add up)
            self.sync(key, now)
        inflow = self.inflow.get(key, 0.0) + new - old
        self.inflow[key] = inflow = inflow if inflow > 1e-9 else 0.0
        if not lru and inflow > 0 and self.room(key):
            self._start_filling(key)
        else:
            self._stop_filling(key)

    def leave(self, key: str, remote: float, now: float) -> None:
        """A reader of unit `key` that fetched `remote` bytes/s left."""
        self.sync(key, now)
        inflow = self.inflow.get(key, 0.0) - remote
        self.inflow[key] = inflow = inflow if inflow > 1e-9 else 0.0
        if inflow <= 0:
            self._stop_filling(key)
        elif key in self.filling:
            self.unpushed[key] = None

    def add_inflow(self, key: str, step: float, now: float) -> None:
        """`step` more bytes/s into `key` (the level clock's held readers moving; the
        caller moves only units still filling or LRU datasets still growing)."""
        if self.lru:
            if key in self.pool.growing:
                self.sync(key, now)
        elif key in self.filling:
            self.sync(key, now)
            self.unpushed[key] = None  # (its fill events move with its inflow)
        inflow = self.inflow.get(key, 0.0) + step
        self.inflow[key] = inflow if inflow > 1e-9 else 0.0

    def reset_inflow(self, inflow: dict[str, float]) -> None:
        """The inflows summed anew at a re-plan (every unit was brought to now first);
        the units still filling follow from them, and the fill events of those whose
        inflow or cap moved (the others' stand: a sync moves neither moment)."""
        old, was_filling, moved = self.inflow, self.filling, self.moved
        self.inflow = inflow
        self.moved = set()
        if self.lru:
            self.filling, self.fill_pos, self.unpushed = {}, {}, {}
            n = len(self.keys)
            self.t_cap[:] = [math.inf] * n
            self.t_full[:] = [math.inf] * n
            return
        filled, full_at = self.filled, self.full_at
        self.filling = filling = {key: None for key in inflow if filled[key] < full_at[key]}
        stopped = [self.index[key] for key in was_filling if key not in filling]
        if stopped and self.arrays:
            self.t_cap[stopped] = math.inf
            self.t_full[stopped] = math.inf
        else:
            for i in stopped:
                self._drop(i)
        self.fill_pos = dict(zip(self.filling, range(len(self.filling)), strict=True))
        self.fill_count = len(self.filling)
        for key in self.filling:
            if key in moved or key not in was_filling or old.get(key) != inflow[key]:
                self.unpushed[key] = None

    def allocate(self, cache: Mapping[str, float], readers: Mapping[str, list[SimJob]]) -> None:
        """Each uniform unit's allocation from a plan; a unit holding more than it is
        given now evicts random cached items, so each reader loses the same fraction of
        what it has not read yet."""
        # Units neither allocated nor holding anything, and not in the new allocation,
        # stay as they are: only the others are visited (CoorDL has a unit per job of
        # the whole trace, most of them long finished or not yet arrived).
        # (_cap written out: a plan of Gavel moves every running job's unit, and each
        # arrival shrinks every CoorDL job's slice, so half of them evict)
        in_use: set[str] = set()
        roomy: set[str] = set()
        self.evicted = set()
        self._allocate(cache.items(), readers, in_use, roomy)
        self._allocate(zip(self.in_use - cache.keys(), repeat(0.0)), readers, in_use, roomy)
        self.in_use, self.roomy = in_use, roomy
        # (reset_inflow, which always follows, pushes the fill events of `moved` anew)

    def _allocate(
        self,
        wants: Iterable[tuple[str, float]],
        readers: Mapping[str, list[SimJob]],
        in_use: set[str],
        roomy: set[str],
    ) -> None:
        """allocate's work for units `wants` (unit, bytes): into `in_use` the units
        allocated or holding bytes, into `roomy` those of them with room."""
        allocated, filled, cap_of, full_of = self.allocated, self.filled, self.cap, self.full_at
        size_tol, moved_add, in_use_add, roomy_add = (
            self.size_tol, self.moved.add, in_use.add, roomy.add
        )  # fmt: skip
        for key, want in wants:
            want = want if want > 0.0 else 0.0  # max(0, want)
            if allocated[key] != want:
                allocated[key] = want
                size, tol = size_tol[key]
                cap_of[key] = cap = size if size < want else want  # min(want, size)
                full_of[key] = full = cap - tol
                moved_add(key)
            else:
                full = full_of[key]
            held = filled[key]
            if held > want:  # (so held > 0)
                scale = want / held
                for job in readers.get(key, ()):
                    job.effective *= scale
                filled[key] = held = want
                moved_add(key)
                self.evicted.add(key)
            if want > 0 or held > 0:
                in_use_add(key)
                if held < full:
                    roomy_add(key)

    def below_allocation(self, jobs: Iterable[SimJob]) -> bool:
        """Is a unit some of `jobs` read still below its allocation?"""
        # A job's unit is below its allocation, less the job's rounding, exactly when
        # it has room (its size is the unit's, its eps the unit's tol): only units that
        # had room at the last allocation can, and one found without is dropped from
        # them (it stays so until the next), so that once none has, none is looked at.
        roomy = self.roomy
        if not roomy:
            return False
        filled, allocated = self.filled, self.allocated
        for job in jobs:
            key = job.unit
            if key in roomy:
                want, size = allocated[key], job.size
                if filled[key] < (size if size < want else want) - job.eps:
                    return True
                roomy.discard(key)
        return False

    def readers(self, key: str, count: int) -> None:
        """Unit `key` now has `count` active readers."""
        if count > 1:
            self.shared.add(key)
        else:
            self.shared.discard(key)

    def shared_filling(self) -> list[str]:
        """The filling units several active jobs read, in the order of `filling`."""
        filling, shared = self.filling, self.shared
        if len(shared) < len(filling):
            keys = [key for key in shared if key in filling]
            keys.sort(key=self.fill_pos.__getitem__)
            return keys
        return [key for key in filling if key in shared]

    def until_change(self, now: float, limit: float) -> float:
        """Seconds from `now` (at most `limit`) until a filling unit is full, or has taken
        `SHARED_FILL_STEP` of its dataset while several jobs read it (each reader's hits
        move with what the others fetch)."""
        soonest = limit
        if self.unpushed:
            self._push()
        key = self._soonest_cap()
        if key is not None:
            until = self._until_cap(key, now)
            if until is not None:
                if until < soonest:
                    soonest = until
            else:  # (the soonest has reached its cap already: look at every unit)
                for key in self.filling:
                    until = self._until_cap(key, now)
                    if until is not None and until < soonest:
                        soonest = until
        inflows, size_of = self.inflow, self.units
        for key in self.shared_filling():
            if self.cap[key] - self.filled_now(key, now) > 0:
                until = SHARED_FILL_STEP * size_of[key].size / inflows[key]
                if until < soonest:
                    soonest = until
        return soonest

    def _until_cap(self, key: str, now: float) -> float | None:
        """Seconds from `now` until filling unit `key` reaches its cap (None: it has)."""
        room = self.cap[key] - self.filled_now(key, now)
        return room / self.inflow[key] if room > 0 else None

    def sync_full(self, now: float) -> None:
        """Bring the filling units that are full by `now` up to date (which sets `full`)."""
        # The moment to full_at is rounded: look a little past now, and decide by the fill.
        late = now + 1e-9 * (now if now > 1.0 else 1.0)
        if self.unpushed:
            self._push()
        keys, filling, full_at = self.keys, self.filling, self.full_at
        for i in self._due(late):
            key = keys[i]
            if key in filling and self.filled_now(key, now) >= full_at[key]:
                self.sync(key, now)  # (which ends its filling)
            if key not in filling:
                self._drop(i)
