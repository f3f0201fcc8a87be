"""Gavel's SiloD plan (gavel.py) as array operations, for the many jobs of a large cluster;
and its vanilla plan where the closed form is not taken (the simulator's LRU).

Owns: the jobs and their reads as arrays; the equal share (estimator.equal_share_perf
with SiloD's estimator, and with ComputeEstimator for the vanilla plan); where
progressive filling starts (gavel._start); the filling (gavel._fill) with either IO
model, the steady state's knapsack over one pool (gavel._Loads) or the hits now
(gavel._FixedHits), or with IO not planned (the vanilla plan); and what
GavelPolicy.allocate makes of the rates (shares, leftover GPUs, IO, leftover link):
the same float arithmetic as those, to the bit. Never: decides when the array form is
used (gavel.py does, and keeps the loops for few jobs and several pools), or reads a Job
(gavel.py hands it columns).

Exactness. Elementwise +, -, *, /, min and max of float64 arrays are the IEEE operations
Python's floats make. Sums are not: np.sum adds pairwise. Every sum here that the Python
form makes with `sum(..., 0.0)` or `+=` in a loop is made with np.add.accumulate (what
np.cumsum calls, without its Python layer), which adds left to right, over the same
terms in the same order (the terms are >= 0, so the Python form's leading 0.0 + x is
x). A running subtraction p - s0 - s1 ... is the cumsum of p, -s0, -s1, ... (IEEE
defines a - b as a + (-b)). np.bincount adds each bin's weights in the order given, as
a loop over the reads adds to a dictionary. Python's min(a, b) and max(a, b) keep a on
ties, which for non-NaN floats other than -0.0 is the same value.
"""

from __future__ import annotations

import logging
import math
from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import chain, count
from operator import getitem, methodcaller

import numpy as np

from ..model import CacheUnit
from .gavel_search import newton_limit, rounds_io_allows

log = logging.getLogger(__name__)

FloatArray = np.ndarray
IndexArray = np.ndarray


def seqsum(terms: FloatArray) -> float:
    """sum(terms, 0.0) as Python adds them, left to right (terms >= 0)."""
    if not len(terms):
        return 0.0
    return float(np.add.accumulate(terms)[-1])


def _counts(ends: IndexArray) -> IndexArray:
    """np.diff(ends, prepend=0) (each group's size from its end index) without numpy's
    Python layer, which cost more than the subtraction: integers, so the same values."""
    counts = ends.copy()
    counts[1:] -= ends[:-1]
    return counts


@dataclass
class JobArrays:
    """What the filling reads per job, fixed while the jobs are (gavel._Steady keeps it).

    Job arrays are in the jobs' order; `free` lists the positions of the jobs that can
    run (e > 0, f* > 0) in ascending ceiling, as gavel._Start.free does."""

    e: FloatArray
    f_star: FloatArray
    gpus: FloatArray
    sizes: FloatArray
    zero: FloatArray  # bool: the jobs fixed at rate 0.0 from the start
    free: IndexArray
    caps: FloatArray  # ceilings f*/e of `free`, in its order
    levels: FloatArray  # the first round's ceiling groups (gavel._groups): levels
    ends: IndexArray  # and end index in `free` of each
    gpu_top: int
    gpu_base: tuple[float, float]


@dataclass
class Limits:
    """The cluster's side of the problem and gavel's tolerances."""

    total_gpus: float
    remote_io: float
    tol: float
    margin: float


def fixed_hits_model(arrays: JobArrays, hits: FloatArray) -> FixedHitsIO:
    """gavel._FixedHits.of_hits as arrays: each job's miss ratio and hit ratio."""
    sizes = arrays.sizes
    positive = sizes > 0
    takes = np.minimum(sizes, hits * sizes)
    held = np.where(takes > 0, takes, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        part = held / sizes
    left = 1.0 - part
    miss = np.where(positive, np.where(left > 0.0, left, 0.0), 0.0)
    hit = np.where(positive, np.where(part < 1.0, part, 1.0), 1.0)
    return FixedHitsIO(miss, hit, arrays.e * miss)


@dataclass
class FixedHitsIO:
    """gavel._FixedHits: a job's remote IO is its rate times a miss ratio fixed for the
    plan, so a round's IO need is a + b * lam."""

    miss: FloatArray
    hit: FloatArray
    slopes: FloatArray  # e * miss

    def loads(self, rate: FloatArray, done: FloatArray) -> FixedHitsLoads:
        """gavel._FixedHits.loads with the jobs in `done` fixed at `rate`."""
        a = seqsum(rate[done] * self.miss[done])
        return FixedHitsLoads(a, seqsum(self.slopes[~done]), self.hit)


@dataclass
class FixedHitsLoads:
    """need(lam) = a + b * lam (gavel._FixedLoads), and the hits the plan holds."""

    a: float
    b: float
    hit: FloatArray

    def limit(self, start: float, limits: Limits) -> float:
        """gavel._FixedLoads.limit."""
        return _line_limit(self.a, self.b, start, limits)

    def hits(self, lam: float) -> FloatArray:
        return self.hit


def _line_limit(a: float, b: float, start: float, limits: Limits) -> float:
    """Largest lam >= start with a + b * lam <= B (gavel._FixedLoads.limit)."""
    budget = limits.remote_io
    if math.isinf(budget):
        return math.inf
    if b <= 0.0:
        return math.inf if a <= budget * (1 + limits.tol) else start
    return max(start, (budget - a) / b)


@dataclass
class KnapsackIO:
    """gavel._Loads for jobs whose units all draw from one pool (the simulator's
    cluster): reads as (job, unit, weight) rows in the jobs' order, units numbered in
    first-read order, and each unit's size (> 0), the order of its key and its key."""

    r_job: IndexArray
    r_unit: IndexArray
    r_w: FloatArray
    e: FloatArray
    sizes: FloatArray
    key_rank: IndexArray
    keys: list[str]
    pool: float

    def loads(self, rate: FloatArray, done: FloatArray) -> KnapsackLoads:
        """_Loads(jobs, {done: rate}, e): per unit, fixed = sum of weight * rate over
        its readers in `done` and slope = sum of weight * e over the others, each in
        the reads' order (bincount adds in order; a 0.0 for a reader of the other kind
        changes nothing), and the units in _Loads' order: those with a fixed reader by
        their first one, then the rest by their first reader."""
        m = len(self.sizes)
        r_unit, r_job = self.r_unit, self.r_job
        d = done[r_job]
        fixed = np.bincount(r_unit, np.where(d, self.r_w * rate[r_job], 0.0), m)
        slope = np.bincount(r_unit, np.where(d, 0.0, self.r_w * self.e[r_job]), m)
        first_fixed = _first_seen(r_unit[d], m)
        seen = np.zeros(m, dtype=bool)
        seen[first_fixed] = True
        rest = _first_seen(r_unit[~d], m)
        rows = np.concatenate((first_fixed, rest[~seen[rest]]))
        return KnapsackLoads(self, fixed, slope, rows)


def _first_seen(units: IndexArray, m: int) -> IndexArray:
    """The distinct values of `units` (each below `m`) in the order they first occur."""
    n = len(units)
    first = np.empty(m, dtype=np.intp)
    first.fill(n)
    np.minimum.at(first, units, np.arange(n))  # each value's first place (n: none)
    found = (first < n).nonzero()[0]
    return found[first[found].argsort()]  # (the places differ: no ties to order)


@dataclass
class KnapsackLoads:
    """A_u(lam) = fixed_u + lam * slope_u (gavel._Loads) over the units in `rows`."""

    io: KnapsackIO
    fixed: FloatArray
    slope: FloatArray
    rows: IndexArray

    def cache(self, lam: float) -> tuple[IndexArray, FloatArray]:
        """gavel._Loads.best_cache at lam: the units cached in rank order (the largest
        load per byte first, then slope per byte, then key) and what each holds, filled
        from the one pool as _fill_ranked does: whole units while one is smaller than
        what is left (subtracted one by one), then what is left."""
        io, rows = self.io, self.rows
        size = io.sizes[rows]
        per = self.slope[rows]
        first = -(self.fixed[rows] + lam * per) / size
        ranked = rows[np.lexsort((io.key_rank[rows], -per / size, first))]
        if not io.pool > 0.0:
            return ranked[:0], size[:0]
        sizes = io.sizes[ranked]
        lefts = np.add.accumulate(np.concatenate(([io.pool], -sizes)))
        last = (sizes >= lefts[:-1]).nonzero()[0]
        if not len(last):
            return ranked, sizes
        k = int(last[0])
        takes = sizes[: k + 1].copy()
        takes[k] = lefts[k]
        return ranked[: k + 1], takes

    def held(self, lam: float) -> FloatArray:
        """Bytes each unit holds under cache(lam) (0.0 for the others)."""
        units, takes = self.cache(lam)
        held = np.zeros(len(self.io.sizes))
        held[units] = takes
        return held

    def limit(self, start: float, limits: Limits) -> float:
        """gavel._Loads.limit: Newton's method on the concave need(lam)."""
        rows, sizes = self.rows, self.io.sizes[self.rows]
        fixed, slope = self.fixed[rows], self.slope[rows]

        def line(lam: float) -> tuple[float, float]:
            left = 1.0 - self.held(lam)[rows] / sizes
            miss = np.where(left > 0.0, left, 0.0)
            return seqsum(fixed * miss), seqsum(slope * miss)

        return newton_limit(line, start, limits.remote_io, limits.tol, 4 * len(rows) + 16)

    def hits(self, lam: float) -> FloatArray:
        """Each job's hit ratio under cache(lam): min(1, sum of weight * min(1, c/d))."""
        io = self.io
        part = self.held(lam) / io.sizes
        part = np.where(part < 1.0, part, 1.0)
        hit = np.bincount(io.r_job, io.r_w * part[io.r_unit], len(io.e))
        return np.where(hit < 1.0, hit, 1.0)


def _groups(caps: FloatArray, tol: float) -> tuple[FloatArray, IndexArray]:
    """gavel._groups of ascending ceilings: each group's level and end index."""
    n = len(caps)
    if not n:
        return caps, np.zeros(0, dtype=np.intp)
    moved = (caps[1:] != caps[:-1]).nonzero()[0] + 1  # where a larger ceiling starts
    if not (caps[moved] <= caps[moved - 1] * (1 + tol)).any():
        # No ceiling lies within tol above a smaller one: each group is a run of equal
        # ceilings (what the search from its first member finds).
        return caps[np.concatenate(([0], moved))], np.concatenate((moved, [n]))
    nxt = np.searchsorted(caps, caps * (1 + tol), side="right").tolist()
    found: list[int] = []
    i = 0
    while i < n:
        k = nxt[i]
        if k <= i:  # (bisect_right from i + 1)
            k = i + 1
        found.append(k)
        i = k
    return caps[[0, *found[:-1]]], np.array(found, dtype=np.intp)


def _gpu_rounds(
    arrays: JobArrays,
    free: IndexArray,
    levels: FloatArray,
    ends: IndexArray,
    base: tuple[float, float],
    limits: Limits,
) -> int:
    """gavel._gpu_rounds: how many leading groups the GPUs allow, with the running sums
    of its loop made as cumsums over the jobs in `free` order."""
    if not len(levels):
        return 0
    e, f, g = arrays.e[free], arrays.f_star[free], arrays.gpus[free]
    counts = _counts(ends)
    level_of = levels.repeat(counts)
    used = np.add.accumulate(np.concatenate(([base[0]], g * np.minimum(f, level_of * e) / f)))
    per_lam = np.add.accumulate(np.concatenate(([base[1]], -(g * e / f))))
    begins = ends - counts
    near = levels * (1 + limits.tol) * (1 + limits.margin)
    ok = used[begins] + per_lam[begins] * near < limits.total_gpus * (1 - limits.margin)
    bad = (~ok).nonzero()[0]
    return int(bad[0]) if len(bad) else len(levels)


class UnplannedIO:
    """The vanilla form's IO (gavel._fill with no IO model): not planned, so it never
    binds. fill() is then given limits with an infinite link, which skips the IO
    search as gavel._cap_rounds does without a model."""

    def loads(self, rate: FloatArray, done: FloatArray) -> UnplannedIO:
        return self

    def limit(self, start: float, limits: Limits) -> float:
        return math.inf

    def hits(self, lam: float) -> FloatArray:
        # (_binding reads hits only when IO binds, which it never does here)
        raise AssertionError("unplanned IO has no hit ratios")


IOModel = FixedHitsIO | KnapsackIO | UnplannedIO
Loads = FixedHitsLoads | KnapsackLoads | UnplannedIO


@dataclass
class Filled:
    """What progressive filling ends with: every job's rate (jobs' order), the level of
    its first round (gavel.MaxMin.level) and the IO loads with every job fixed."""

    rate: FloatArray
    level: float


def fill(arrays: JobArrays, io: IOModel, limits: Limits) -> Filled:
    """gavel._fill(jobs, cluster, e, io, start) as array operations: each job's rate,
    to the bit."""
    e, f_star = arrays.e, arrays.f_star
    tol = limits.tol
    rate = np.zeros(len(e))
    frozen = arrays.zero.copy()
    free, caps = arrays.free, arrays.caps
    levels, ends, top, base = arrays.levels, arrays.ends, arrays.gpu_top, arrays.gpu_base
    lam, first = 0.0, math.nan
    while len(free):
        tried: dict[int, tuple[Loads, float]] = {}
        if not math.isinf(limits.remote_io) and top > 0:
            top = _io_rounds(arrays, io, free, levels, ends, top, lam, rate, frozen, limits,
                             tried)  # fmt: skip
        if top:
            # the rounds where only the jobs' ceilings bind, at their levels
            taken = int(ends[top - 1])
            group_lam = np.maximum.accumulate(np.maximum(lam, levels[:top]))
            first = float(group_lam[0]) if math.isnan(first) else first
            lam = float(group_lam[-1])
            moved = free[:taken]
            level_of = group_lam.repeat(_counts(ends[:top]))
            rate[moved] = np.minimum(f_star[moved], level_of * e[moved])
            frozen[moved] = True
            free, caps = free[taken:], caps[taken:]
            if not len(free):
                break
            base = _gpu_base(arrays, free, rate, frozen)
        known = tried.get(top)
        if known is not None:
            loads, lam_io = known
        else:
            loads = io.loads(rate, frozen)
            lam_io = loads.limit(lam, limits)
        used, per_lam = base
        lam_gpu = max(0.0, limits.total_gpus - used) / per_lam if per_lam > 0 else math.inf
        lam = max(lam, min(lam_io, lam_gpu, float(caps[0])))
        first = lam if math.isnan(first) else first
        stop = _binding(caps, lam, lam_io, lam_gpu, loads, free, tol)
        moved = free[stop]
        rate[moved] = np.minimum(f_star[moved], lam * e[moved])
        frozen[moved] = True
        if stop.all():
            break
        keep = ~stop
        free, caps = free[keep], caps[keep]
        levels, ends = _groups(caps, tol)
        base = _gpu_base(arrays, free, rate, frozen)
        top = _gpu_rounds(arrays, free, levels, ends, base, limits)
    return Filled(rate, 0.0 if math.isnan(first) else first)


def _binding(
    caps: FloatArray,
    lam: float,
    lam_io: float,
    lam_gpu: float,
    loads: Loads,
    free: IndexArray,
    tol: float,
) -> FloatArray:
    """gavel._binding as a mask over `free`: all of them if GPUs ran out; those at
    their own ceiling; and, if IO ran out, those that still miss the cache."""
    near = lam * (1 + tol)
    if lam_gpu <= near:
        return np.ones(len(free), dtype=bool)
    stop = caps <= near
    if lam_io <= near:
        stop |= loads.hits(lam)[free] < 1 - tol
    if not stop.any():
        stop[:] = True
    return stop


def _gpu_base(
    arrays: JobArrays, free: IndexArray, rate: FloatArray, frozen: FloatArray
) -> tuple[float, float]:
    """gavel._gpu_base: the GPUs the frozen jobs hold (jobs' order), and the free jobs'
    GPUs per unit of level (`free` order)."""
    f_star, gpus = arrays.f_star, arrays.gpus
    held = frozen & (f_star > 0)
    used = seqsum(gpus[held] * rate[held] / f_star[held])
    return used, seqsum(gpus[free] * arrays.e[free] / f_star[free])


def _io_rounds(
    arrays: JobArrays,
    io: IOModel,
    free: IndexArray,
    levels: FloatArray,
    ends: IndexArray,
    top: int,
    lam: float,
    rate: FloatArray,
    frozen: FloatArray,
    limits: Limits,
    tried: dict[int, tuple[Loads, float]],
) -> int:
    """gavel._cap_rounds' search for the leading rounds IO allows, among the `top` the
    GPUs allow; each round's loads and limit go into `tried`."""
    e, f_star = arrays.e, arrays.f_star
    counts = _counts(ends)
    # per job (jobs' order): the round it is frozen in (-1: before), its rate from then
    first = np.where(frozen, -1, len(levels))
    first[free[: int(ends[-1])]] = np.arange(len(levels)).repeat(counts)
    at = rate.copy()
    at[free] = np.minimum(f_star[free], levels.repeat(counts) * e[free])

    def io_ok(g: int) -> bool:
        start = max(lam, float(levels[g - 1])) if g > 0 else lam
        loads = io.loads(at, first < g)
        limit = loads.limit(start, limits)
        tried[g] = (loads, limit)
        return limit > float(levels[g]) * (1 + limits.tol)

    return rounds_io_allows(io_ok, top)


def water_fill(capacity: float, demands: FloatArray) -> FloatArray:
    """base.water_fill over an array (the demands' order is the mapping's): the smallest
    demands, ties in order, are met while each is at most an equal split of what is
    left, subtracted one by one; the rest get that split."""
    if math.isinf(capacity):
        return demands.copy()
    n = len(demands)
    order = demands.argsort(kind="stable")
    values = demands[order]
    lefts = np.add.accumulate(np.concatenate(([capacity], -values)))
    over = (values > lefts[:n] / np.arange(n, 0, -1)).nonzero()[0]
    if not len(over):
        return demands.copy()
    k = int(over[0])
    out = np.empty(n)
    out.fill(lefts[k] / (n - k))
    out[order[:k]] = values[:k]
    return out


def gpu_shares(arrays: JobArrays, rate: FloatArray, total_gpus: float) -> FloatArray:
    """Each job's GPU share, min(1, rate / f*) (0.0 without f*), with the GPU time that
    leaves idle handed out as gavel.spread_leftover_gpus does."""
    f_star, gpus = arrays.f_star, arrays.gpus
    with np.errstate(divide="ignore", invalid="ignore"):
        share = rate / f_star
    share = np.where(f_star > 0, np.where(share < 1.0, share, 1.0), 0.0)
    used = seqsum(share * gpus)
    extra = water_fill(max(0.0, total_gpus - used), (1.0 - share) * gpus)
    with np.errstate(divide="ignore", invalid="ignore"):
        spread = share + extra / gpus
    spread = np.where(spread < 1.0, spread, 1.0)
    return np.where(gpus > 0, spread, share)


def leftover_io(io: FloatArray, ceiling: FloatArray, remote_io: float) -> FloatArray | None:
    """base.spread_leftover_io over arrays: each job's IO with the link's unallocated
    part handed out max-min fairly up to its ceiling; None if none is left (then the
    IO stays as it is)."""
    if math.isinf(remote_io):
        return np.full(len(io), math.inf)
    spare = max(0.0, remote_io - seqsum(io))
    if spare == 0.0:
        return None
    room = ceiling - io
    return io + water_fill(spare, np.where(room > 0.0, room, 0.0))


@dataclass
class Reads:
    """Jobs and what they read as arrays: per job (jobs' order) its name, f*, GPUs and
    first read; per read (jobs' order, each job's reads in order) its job, unit and
    weight; per unit (first-read order) its key and size."""

    names: list[str]
    f_star: FloatArray
    gpus: FloatArray
    r_job: IndexArray
    r_unit: IndexArray
    r_w: FloatArray
    keys: list[str]
    unit_size: FloatArray
    first_read: IndexArray


def reads_of(
    names: list[str], f_star: list[float], gpus: list[int], reads: list[Mapping[str, float]],
    units: Mapping[str, CacheUnit],
) -> Reads:  # fmt: skip
    """Reads of the jobs given by their columns; units: the cluster's, by key."""
    counts = list(map(len, reads))
    keys = list(chain.from_iterable(reads))
    n = len(names)
    if len(keys) == n and counts.count(1) == n:
        # every job reads one unit (the simulator's jobs): its weight is the value at
        # its key, each job is its own read and the first of its reads
        weights = list(map(getitem, reads, keys))
        r_job = np.arange(n)
        first_read = np.arange(n)
    else:
        weights = list(chain.from_iterable(map(methodcaller("values"), reads)))
        lens = np.array(counts, dtype=np.intp)
        r_job = np.repeat(np.arange(n), lens)
        first_read = np.cumsum(lens) - lens
    keys_seen = list(dict.fromkeys(keys))
    where = dict(zip(keys_seen, count()))
    return Reads(
        names=names,
        f_star=np.array(f_star, dtype=float),
        gpus=np.array(gpus, dtype=float),
        r_job=r_job,
        r_unit=np.array(list(map(where.__getitem__, keys)), dtype=np.intp),
        r_w=np.array(weights, dtype=float),
        keys=keys_seen,
        unit_size=np.array([units[key].size for key in keys_seen], dtype=float),
        first_read=first_read,
    )


def equal_share_perf(
    reads: Reads, total_gpus: float, remote_io: float, unit_cache: FloatArray
) -> FloatArray:
    """estimator.equal_share_perf with SiloD's estimator, per job: Eq. 4 at the equal
    share (GPUs, IO and `unit_cache`, each unit's equal cache), or share * f* where that
    gives nothing. The same operations: a job's hit ratio adds its reads in order."""
    n = len(reads.names)
    gpus, f_star = reads.gpus, reads.f_star
    per_job = total_gpus / n
    with np.errstate(divide="ignore", invalid="ignore"):
        share = per_job / gpus
        part = unit_cache / reads.unit_size
    share = np.where(gpus > 0, np.where(share < 1.0, share, 1.0), 1.0)
    part = np.where(reads.unit_size <= 0, 1.0, np.where(part < 1.0, part, 1.0))
    hit = np.bincount(reads.r_job, reads.r_w * part[reads.r_unit], n)
    miss = 1.0 - np.where(hit < 1.0, hit, 1.0)
    full = share * f_star
    value = full
    io = remote_io / n
    if not math.isinf(io):
        with np.errstate(divide="ignore", invalid="ignore"):
            fed = io / miss
        value = np.where(miss <= 0.0, full, np.where(fed < full, fed, full))
    return np.where(value > 0, value, full)


def equal_unit_cache(reads: Reads, capacity: float) -> FloatArray:
    """estimator._equal_cache (EqualShare.cache) per unit (keys' order) when every job
    reads one unit and every unit draws from one pool of `capacity`: each of a unit's
    m readers adds capacity / n (n: the jobs) up to the unit's size, one by one. The
    partial sums only grow (a share is >= 0), so the loop's min(size, held) at each
    addition is min(size, the m-th sum); the sums are an np.add.accumulate of the
    share, the same additions in the same order."""
    n = len(reads.names)
    counts = np.bincount(reads.r_unit, minlength=len(reads.keys))
    share = capacity / n
    sums = np.add.accumulate(np.full(int(counts.max()), share))
    held = sums[counts - 1]
    size = reads.unit_size
    return np.where(held < size, held, size)


def job_arrays(
    reads: Reads, e: FloatArray, limits: Limits, ranks: NameRanks | None = None
) -> JobArrays:
    """gavel._start as arrays: the jobs that never run, the others in ascending ceiling
    (ties by name), the first round's ceiling groups and how many the GPUs allow."""
    sizes = reads.unit_size[reads.r_unit[reads.first_read]]
    return _start(reads.names, reads.f_star, reads.gpus, sizes, e, limits, ranks)


class NameRanks:
    """An integer per job name, ordered as the names are (str's <, by code point), kept
    over a policy's plans: a plan's ceiling ties go by name, and a str array of ~1,000
    names and numpy's sort of it cost ~200 us at every arrival and completion, where
    looking the ranks up costs ~30. Ranks are spaced out so that a new name (one per
    arrival) usually takes the middle of its neighbours' gap; when a gap is used up,
    every name is numbered again. Equal names have one rank, so a lexsort by rank is
    the lexsort by name, to the permutation."""

    SPACING = 1 << 32

    def __init__(self) -> None:
        self._sorted: list[str] = []  # every name seen, in order
        self._rank: dict[str, int] = {}

    def of(self, names: list[str]) -> IndexArray:
        """Each name's rank, in the order of `names`."""
        rank = self._rank
        # (int64 given, not inferred from ~1,000 Python ints: 2.5x faster; a name not
        # seen is a None, which int64 refuses)
        try:
            return np.array(list(map(rank.get, names)), dtype=np.int64)
        except TypeError:
            for name in names:
                if name not in rank:
                    self._add(name)
        return np.array(list(map(rank.__getitem__, names)), dtype=np.int64)

    def _add(self, name: str) -> None:
        known, rank = self._sorted, self._rank
        i = bisect_left(known, name)
        lo = rank[known[i - 1]] if i else 0
        hi = rank[known[i]] if i < len(known) else lo + 2 * self.SPACING
        known.insert(i, name)
        if hi - lo < 2:  # no integer between: number every name again (in place)
            rank.clear()
            spaced = range(self.SPACING, (len(known) + 1) * self.SPACING, self.SPACING)
            rank.update(zip(known, spaced, strict=True))
            return
        rank[name] = (lo + hi) // 2


def _start(
    names: list[str], f_star: FloatArray, gpus: FloatArray, sizes: FloatArray, e: FloatArray,
    limits: Limits, ranks: NameRanks | None = None,
) -> JobArrays:  # fmt: skip
    """job_arrays of the jobs' columns; sizes: each job's first read's unit size (read
    only by the plan for the hits now); ranks: kept by the caller over its plans."""
    live = ((e > 0) & (f_star > 0)).nonzero()[0]
    caps = f_star[live] / e[live]
    order = caps.argsort(kind="stable")
    if (caps[order][1:] == caps[order][:-1]).any():
        # equal ceilings go by name (numpy orders str as Python does, by code point);
        # with `ranks`, by integers in the names' order (the same permutation: lexsort
        # is stable, and equal names get equal ranks), without a str array of them
        if ranks is not None:
            order = np.lexsort((ranks.of(names)[live], caps))
        else:
            order = np.lexsort((np.array(names)[live], caps))
    free, caps = live[order], caps[order]
    zero = np.ones(len(e), dtype=bool)
    zero[live] = False
    levels, ends = _groups(caps, limits.tol)
    arrays = JobArrays(
        e=e, f_star=f_star, gpus=gpus, sizes=sizes,
        zero=zero, free=free, caps=caps, levels=levels, ends=ends, gpu_top=0, gpu_base=(0.0, 0.0),
    )  # fmt: skip
    arrays.gpu_base = _gpu_base(arrays, free, np.zeros(len(e)), zero)
    arrays.gpu_top = _gpu_rounds(arrays, free, levels, ends, arrays.gpu_base, limits)
    return arrays


def floats(values: list[float | None]) -> FloatArray | None:
    """`values` as a float array, or None if some value is not a number (None gives
    an array of objects; so do other objects, and ints alone give ints: the caller
    then takes its general path)."""
    out = np.array(values)
    return out if out.dtype == np.float64 else None


def solve_hits_now(
    arrays: JobArrays, hit_now: list[float] | FloatArray, limits: Limits
) -> tuple[list[float], list[float]]:
    """Each job's GPU share and IO (jobs' order) as GavelPolicy.allocate makes them from
    the hits now: maxmin_fixed_hits' rates, min(1, rate / f*) with the idle GPUs
    spread, rate * (1 - hit now) with the idle link spread up to share * f*."""
    hit = np.array(hit_now, dtype=float)
    rate = fill(arrays, fixed_hits_model(arrays, hit), limits).rate
    share = gpu_shares(arrays, rate, limits.total_gpus)
    io = rate * (1.0 - hit)
    extra = leftover_io(io, share * arrays.f_star, limits.remote_io)
    return share.tolist(), (io if extra is None else extra).tolist()


@dataclass
class Steady:
    """The steady-state solve: e per job, the jobs' arrays, and (when the knapsack is
    solved here) each job's rate, the level and the cache as (key, bytes) in order."""

    e: FloatArray
    arrays: JobArrays
    rates: FloatArray | None = None
    level: float = 0.0
    cache: list[tuple[str, float]] | None = None


def steady_state(
    reads: Reads, unit_cache: list[float] | FloatArray, pool: float | None, limits: Limits,
    ranks: NameRanks | None = None,
) -> Steady:  # fmt: skip
    """equal_share_perf, _start and (with `pool`, the capacity of the one pool every
    unit draws from) gavel.maxmin; unit_cache: each unit's equal cache (keys' order)."""
    e = equal_share_perf(reads, limits.total_gpus, limits.remote_io, np.asarray(unit_cache))
    arrays = job_arrays(reads, e, limits, ranks)
    if pool is None:
        return Steady(e, arrays)
    keys = reads.keys
    rank = np.empty(len(keys), dtype=np.intp)
    rank[sorted(range(len(keys)), key=keys.__getitem__)] = np.arange(len(keys))
    io = KnapsackIO(reads.r_job, reads.r_unit, reads.r_w, e, reads.unit_size, rank, keys, pool)
    filled = fill(arrays, io, limits)
    units, takes = io.loads(filled.rate, np.ones(len(e), dtype=bool)).cache(0.0)
    cache = list(zip(map(keys.__getitem__, units.tolist()), takes.tolist(), strict=True))
    return Steady(e, arrays, filled.rate, filled.level, cache)


@dataclass
class Vanilla:
    """The vanilla form's plan (maxmin with no IO model, from e = equal_share_perf with
    ComputeEstimator): e, each job's rate and GPU share (min(1, rate / f*), 0.0 without
    f*), in the jobs' order, and the level of its first round."""

    e: FloatArray
    rates: FloatArray
    shares: list[float]
    level: float


def vanilla(
    names: list[str], f_star: list[float], gpus: list[int], limits: Limits,
    ranks: NameRanks | None = None,
) -> Vanilla:  # fmt: skip
    """estimator.equal_share_perf (ComputeEstimator), gavel._start, gavel.maxmin with
    io_aware False and GavelPolicy.allocate's shares from its rates, to the bit. The
    link in `limits` is not read (IO is not planned)."""
    n = len(names)
    f = np.array(f_star, dtype=float)
    g = np.array(gpus, dtype=float)
    # e: min(1, (G / n) / gpus) * f* (1.0 * f* without GPUs)
    per_job = limits.total_gpus / n if n else 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        share = per_job / g
    e = np.where(g > 0, np.where(share < 1.0, share, 1.0), 1.0) * f
    unplanned = Limits(limits.total_gpus, math.inf, limits.tol, limits.margin)
    arrays = _start(names, f, g, np.zeros(0), e, unplanned, ranks)
    filled = fill(arrays, UnplannedIO(), unplanned)
    rate = filled.rate
    with np.errstate(divide="ignore", invalid="ignore"):
        share = rate / f
    share = np.where(f > 0, np.where(share < 1.0, share, 1.0), 0.0)
    return Vanilla(e, rate, share.tolist(), filled.level)
