"""Gavel's max-min fairness (Eq. 8) and its SiloD form (Eq. 9), solved exactly.

Owns: the max-min fair division of GPUs, cache and remote IO among jobs, normalised by
each job's throughput under the equal division. Never: places jobs on nodes (Gavel
time-shares GPUs, so a share is a fraction of time on the requested GPUs).

The exact solution (docs/CONTROLLER.md has the derivation). Give every job the rate
t_j = lam * e_j, where e_j = perf(j, R^equal). A job needs GPU share t_j / f*_j and remote
IO t_j * miss_j. For a fixed lam the IO the cluster needs is

    need(lam) = min over cache c of  sum_u A_u(lam) * (1 - c_u / d_u),
    A_u(lam) = sum over jobs j reading unit u of (weight_ju * t_j),

a fractional knapsack per pool: cache units by A_u / d_u, highest first. With no job
frozen A_u = lam * E_u, so the order is lam-independent and need(lam) = lam * H with
H = sum_u E_u (1 - c*_u / d_u): the Eq. 9 optimum is the closed form

    lam* = min( B / H,  G / sum_j (e_j g_j / f*_j),  min_j f*_j / e_j ).

Eq. 9 only lifts the worst job. So that spare resources are not left idle, filling goes
on the usual progressive way (Gavel's water filling): jobs held by their own ceiling
(f*_j) or by IO they cannot get are frozen, and the rest rise together. Once some jobs
are frozen need(lam) is concave and piecewise linear; Newton's method from a feasible
lam reaches its root exactly, one linear piece per step.
"""

from __future__ import annotations

import logging
import math
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from heapq import heapify, heappop
from itertools import chain, compress, count, repeat
from operator import attrgetter, is_, itemgetter, mul, not_, sub, truediv
from typing import TYPE_CHECKING

from ..estimator import (
    ComputeEstimator,
    Estimator,
    SiloDEstimator,
    _equal_cache,
    equal_share_perf,
    hit_ratio,
)
from ..model import Allocation, CacheUnit, Cluster, Job
from .base import HITS, current_hits, fill_units, spread_leftover_io, water_fill
from .gavel_search import newton_limit, rounds_io_allows

if TYPE_CHECKING:  # (gavel_arrays imports numpy: only a plan of many jobs needs it)
    from . import gavel_arrays as ga

log = logging.getLogger(__name__)

_TOL = 1e-9  # relative: two levels this close are the same binding constraint


@dataclass
class MaxMin:
    """Rates (bytes/s) per job and the cache per unit that feeds them with least IO."""

    level: float
    rates: Mapping[str, float]
    cache: dict[str, float]


class _ByName(Mapping[str, float]):
    """name -> value over columns in the jobs' order (a list or a float array), made a
    dict when first read: Gavel's array forms keep e and the steady rates only for the
    loops' path and the tests, and made two dicts of ~1,000 jobs (and two lists of
    their floats) at every arrival and completion that a run never read."""

    __slots__ = ("_names", "_values", "_dict")

    def __init__(self, names: list[str], values: Sequence[float]) -> None:
        self._names, self._values = names, values
        self._dict: dict[str, float] | None = None

    def _made(self) -> dict[str, float]:
        made = self._dict
        if made is None:
            values = self._values
            if not isinstance(values, list):  # (an array: its floats, as tolist gives)
                values = values.tolist()  # type: ignore[attr-defined]
            made = self._dict = dict(zip(self._names, values, strict=True))
        return made

    def __getitem__(self, name: str) -> float:
        return self._made()[name]

    def get(self, name: str, default: float | None = None) -> float | None:  # type: ignore[override]
        return self._made().get(name, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._made())

    def __len__(self) -> int:
        return len(self._names)


class _Loads:
    """A_u(lam) = fixed_u + lam * slope_u for every cache unit."""

    def __init__(
        self,
        jobs: Sequence[Job],
        fixed: Mapping[str, float],
        e: Mapping[str, float],
        reads: Sequence[tuple[str, str, float]] | None = None,
    ) -> None:
        """reads: (job, unit, weight) of every job's reads in the jobs' order, when the
        caller has it (maxmin builds loads many times over the same jobs)."""
        loads: dict[str, float] = {}
        slopes: dict[str, float] = {}
        self.fixed, self.slope = loads, slopes
        if reads is None:
            reads = _reads(jobs)
        rate_of, fixed_get, slope_get = fixed.get, loads.get, slopes.get
        for name, key, weight in reads:
            rate = rate_of(name)
            if rate is not None:  # (name in fixed)
                loads[key] = fixed_get(key, 0.0) + weight * rate
            else:
                slopes[key] = slope_get(key, 0.0) + weight * e[name]
        # In the jobs' order, not a set's: the knapsack and the loads sum over these
        # dicts in order, and a hash-seeded order made runs differ in their last bits
        # (and, at ties, in Gavel's progressive filling: trace-300's gavel:silod moved
        # 18.6-19.1 h in average JCT from run to run).
        for key in (*loads, *slopes):
            loads.setdefault(key, 0.0)
            slopes.setdefault(key, 0.0)
        self.one_per_pool: bool | None = None  # see best_cache
        self.rows: list[tuple[str, float, float, float]] | None = None  # see _rows

    def best_cache(self, lam: float, cluster: Cluster) -> dict[str, float]:
        """The knapsack at lam. Ties go to the larger slope, so the returned cache is
        also optimal just right of lam (the piece Newton's method must follow)."""

        if self.one_per_pool is None:
            pools_used = _units_per_pool(cluster)
            self.one_per_pool = all(pools_used[cluster.units[k].pool] == 1 for k in self.fixed)
        if self.one_per_pool:
            # Every unit alone in its pool (the problem as it stands now, with_fixed_hits):
            # no order to choose, each holds what its pool does.
            return fill_units(self.fixed, cluster)

        # (-load / size, -slope / size, key): the largest load per byte first
        ranks = [
            (-(load + lam * per) / size, -per / size, key)
            for key, size, load, per in self._rows(cluster)
        ]
        # Only the first few units fit (the pools run out): a heap gives them in sorted
        # order (the ranks are distinct: keys are) without sorting the rest.
        heapify(ranks)
        return _fill_ranked(map(heappop, repeat(ranks, len(ranks))), cluster)

    def _rows(self, cluster: Cluster) -> list[tuple[str, float, float, float]]:
        """(key, size, fixed, slope) of every unit, in the loads' order (found once)."""
        rows = self.rows
        if rows is None:
            units, slope = cluster.units, self.slope
            rows = self.rows = [
                (key, units[key].size, load, slope[key]) for key, load in self.fixed.items()
            ]
        return rows

    def io_line(self, cache: Mapping[str, float], cluster: Cluster) -> tuple[float, float]:
        """(a, b) with IO needed = a + b * lam for this cache. (A unit the cache leaves
        out misses everything: 1.0 - 0.0 / size is 1.0, and x * 1.0 is x, to the bit.)"""
        a = b = 0.0
        get = cache.get
        for key, size, load, per in self._rows(cluster):
            held = get(key)
            if held is None:
                if size > 0:
                    a += load
                    b += per
                else:
                    a += load * 0.0
                    b += per * 0.0
                continue
            miss = max(0.0, 1.0 - held / size) if size > 0 else 0.0
            a += load * miss
            b += per * miss
        return a, b

    def limit(self, cluster: Cluster, start: float) -> float:
        """Largest lam >= start with need(lam) <= B, by Newton's method on the concave
        piecewise-linear need(lam); each step's line lies above need, so every iterate is
        feasible, and a repeated line means the root is reached."""
        return newton_limit(
            lambda lam: self.io_line(self.best_cache(lam, cluster), cluster),
            start,
            cluster.remote_io,
            _TOL,
            4 * len(self.fixed) + 16,
        )

    @staticmethod
    def hit(job: Job, cache: Mapping[str, float], cluster: Cluster) -> float:
        """The job's hit ratio under `cache` (a best_cache)."""
        return hit_ratio(job, cache, cluster)


class _FixedHits:
    """The IO side of with_fixed_hits' problem: every job reads a unit of its own (weight
    1), alone in a pool that holds the job's hit ratio now. The cache cannot move, so a
    job's remote IO is its rate times a miss ratio fixed for the plan, and a round's IO
    limit is one division. It computes what _Loads does for such a problem (the same
    products, summed in the same order: the terms _Loads adds for the other jobs are
    exact zeros) without a dictionary per unit, since the simulator solves this at
    every re-plan."""

    def __init__(self, jobs: Sequence[Job], e: Mapping[str, float], cluster: Cluster) -> None:
        keys = [next(iter(job.reads)) for job in jobs]
        self._cache = fill_units(keys, cluster)
        self.names = [job.name for job in jobs]
        self.e = e
        self._slopes: list[float] | None = None
        self.miss: list[float] = []
        self.hits: dict[str, float] = {}
        for job, key in zip(jobs, keys, strict=True):
            size = cluster.units[key].size
            held = self._cache.get(key, 0.0)
            self.miss.append(max(0.0, 1.0 - held / size) if size > 0 else 0.0)
            hit = 0.0 + (1.0 if size <= 0 else min(1.0, held / size))  # hit_ratio's sum
            self.hits[job.name] = min(1.0, hit)

    @classmethod
    def of_hits(
        cls,
        jobs: Sequence[Job],
        cluster: Cluster,
        hits: Mapping[str, float],
        e: Mapping[str, float],
        sizes: Sequence[float] | None = None,
    ) -> _FixedHits:
        """The model of with_fixed_hits(jobs, cluster, hits) built from `jobs` directly,
        without its jobs and cluster: the same arithmetic as __init__ on them (fill_units
        gives each unit min(size - 0.0, its pool), since it is alone in its pool).
        sizes: each job's dataset size (_job_sizes), when the caller has them."""
        self = cls.__new__(cls)
        self.names = names = list(map(_NAME, jobs))
        self.e = e
        self._slopes = None
        if sizes is None:
            sizes = _job_sizes(jobs, cluster)
        # A unit holds take = min(size - 0.0, hit * size) if that is > 0 (as 0.0 + take,
        # which is take), else nothing; size - 0.0 is size, to the bit.
        takes = map(min, sizes, map(mul, map(hits.__getitem__, names), sizes))
        self.held = held = [take if take > 0 else 0.0 for take in takes]
        self._cache = None
        miss: list[float] = []
        out: dict[str, float] = {}
        self.miss, self.hits = miss, out
        for name, size, have in zip(names, sizes, held, strict=True):
            if size > 0:
                # max(0.0, 1.0 - c/d); and min(1.0, 0.0 + min(1.0, c/d)), where c/d >= 0
                # (so 0.0 + x is x, and the outer min changes nothing)
                part = have / size
                left = 1.0 - part
                miss.append(left if left > 0.0 else 0.0)
                out[name] = part if part < 1.0 else 1.0
            else:
                miss.append(0.0)
                out[name] = 1.0 if size <= 0 else min(1.0, have / size)
        return self

    @property
    def cache(self) -> dict[str, float]:
        """The fixed cache (unit now:NAME -> bytes held), made when first asked for:
        a plan reads its rates and hits, not this."""
        cache = self._cache
        if cache is None:
            cache = self._cache = {
                f"now:{name}": have
                for name, have in zip(self.names, self.held, strict=True)
                if have > 0
            }
        return cache

    @staticmethod
    def applies(jobs: Sequence[Job], cluster: Cluster) -> bool:
        """Does every job read one unit (weight 1) that nobody else reads, alone in its
        pool?"""
        per_pool: dict[str, int] = {}
        for unit in cluster.units.values():
            per_pool[unit.pool] = per_pool.get(unit.pool, 0) + 1
        seen: set[str] = set()
        for job in jobs:
            if len(job.reads) != 1:
                return False
            [(key, weight)] = job.reads.items()
            if weight != 1.0 or key in seen or per_pool[cluster.units[key].pool] != 1:
                return False
            seen.add(key)
        return True

    def loads(self, fixed: Mapping[str, float]) -> _FixedLoads:
        # The loop's sums (in the jobs' order, from 0.0) with the loop in C: a over the
        # frozen jobs' rate * miss, b over the free jobs' e * miss.
        names, miss = self.names, self.miss
        frozen = list(map(fixed.__contains__, names))
        rates = map(fixed.__getitem__, compress(names, frozen))
        a = sum(map(mul, rates, compress(miss, frozen)), 0.0)
        b = sum(compress(self.slopes(), map(not_, frozen)), 0.0)
        return _FixedLoads(a, b, self)

    def slopes(self) -> list[float]:
        """e * miss per job, in loads' order (found once)."""
        per = self._slopes
        if per is None:
            per = self._slopes = list(map(mul, map(self.e.__getitem__, self.names), self.miss))
        return per

    def round_loads(
        self,
        fixed: Mapping[str, float],
        free: Sequence[Job],
        groups: Sequence[tuple[float, int]],
        start: _Start | None = None,
    ) -> Callable[[int], _FixedLoads]:
        """g -> loads(fixed with groups[:g] of `free` frozen at their levels), as
        _cap_rounds' binary search asks for it: the same products summed in the same
        order, without a dictionary of frozen jobs per step. start: fixed, free and
        groups are where `start` begins (filling's first call), whose rounds and rates
        per job are then kept in it: they do not depend on the hits."""
        if start is not None:
            terms = start.round_terms
            if terms is None:
                terms = start.round_terms = self._round_terms(fixed, free, groups)
        else:
            terms = self._round_terms(fixed, free, groups)
        firsts, rates = terms
        a_terms = list(map(mul, rates, self.miss))
        b_terms = self.slopes()  # (a frozen job's b term is never read)

        def loads(g: int) -> _FixedLoads:
            a = sum(compress(a_terms, map(g.__gt__, firsts)), 0.0)
            b = sum(compress(b_terms, map(g.__le__, firsts)), 0.0)
            return _FixedLoads(a, b, self)

        return loads

    def _round_terms(
        self,
        fixed: Mapping[str, float],
        free: Sequence[Job],
        groups: Sequence[tuple[float, int]],
    ) -> tuple[list[int], list[float]]:
        """Per job in loads' order: the first round it is frozen in (-1: frozen before,
        len(groups): in neither), and its rate from then on (0.0 if never frozen)."""
        # Each pass is in C: a free job of group g is frozen at min(f*, level_g * e), the
        # plain rounds' rate.
        e, names = self.e, self.names
        ends = list(map(_END, groups))
        counts = list(map(sub, ends, [0, *ends]))  # each group's size
        free = free[: sum(counts)]
        free_names = list(map(_NAME, free))
        levels = chain.from_iterable(map(repeat, map(_LEVEL, groups), counts))
        frozen = map(min, map(_F_STAR, free), map(mul, levels, map(e.__getitem__, free_names)))
        rate_of = dict(zip(free_names, frozen, strict=True))
        rate_of.update(fixed)
        rounds = chain.from_iterable(map(repeat, count(), counts))
        first_of = dict(zip(free_names, rounds, strict=True))
        first_of.update(dict.fromkeys(fixed, -1))
        firsts = list(map(first_of.get, names, repeat(len(groups))))
        return firsts, list(map(rate_of.get, names, repeat(0.0)))


class _FixedLoads:
    """need(lam) = a + b * lam for _FixedHits, with what _Loads offers the rounds."""

    def __init__(self, a: float, b: float, model: _FixedHits) -> None:
        self.a, self.b, self.model = a, b, model

    def limit(self, cluster: Cluster, start: float) -> float:
        """_Loads.limit with a cache that never moves: its Newton's method takes one
        step, max(start, (B - a) / b), and the next confirms it."""
        budget = cluster.remote_io
        if math.isinf(budget):
            return math.inf
        a, b = self.a, self.b
        if b <= 0.0:
            return math.inf if a <= budget * (1 + _TOL) else start
        return max(start, (budget - a) / b)

    def best_cache(self, lam: float, cluster: Cluster) -> dict[str, float]:
        return self.model.cache

    def hit(self, job: Job, cache: Mapping[str, float], cluster: Cluster) -> float:
        return self.model.hits[job.name]


_POOL_COUNTS: list[tuple[Mapping[str, CacheUnit], dict[str, int]]] = []


def _units_per_pool(cluster: Cluster) -> dict[str, int]:
    """pool -> how many units draw from it; kept for the last units mapping seen (a
    plan's clusters share the scenario's, and every _Loads asks)."""
    units = cluster.units
    if _POOL_COUNTS and _POOL_COUNTS[0][0] is units:
        return _POOL_COUNTS[0][1]
    counts: dict[str, int] = {}
    for unit in units.values():
        counts[unit.pool] = counts.get(unit.pool, 0) + 1
    _POOL_COUNTS[:] = [(units, counts)]
    return counts


def _fill_ranked(ranks: Iterable[tuple[float, float, str]], cluster: Cluster) -> dict[str, float]:
    """fill_units in the order of `ranks`' keys (each once, nothing held before): the
    same floats, and it stops once every pool is used up (a pool at 0.0 gives nothing
    more: each take is at most what is left, so what is left never drops below 0.0)."""
    cache: dict[str, float] = {}
    left = dict(cluster.pools)
    units = cluster.units
    open_pools = sum(1 for v in left.values() if v > 0.0)
    for _, _, key in ranks:
        if not open_pools:
            break
        unit = units[key]
        pool = unit.pool
        have = left[pool]
        take = min(unit.size - 0.0, have)
        if take > 0:
            cache[key] = 0.0 + take
            left[pool] = have = have - take
            if not have > 0.0:
                open_pools -= 1
    return cache


def _reads(jobs: Sequence[Job]) -> list[tuple[str, str, float]]:
    return [(job.name, key, weight) for job in jobs for key, weight in job.reads.items()]


def _io_model(
    jobs: Sequence[Job], cluster: Cluster, e: Mapping[str, float]
) -> Callable[[Mapping[str, float]], _Loads | _FixedLoads]:
    """The IO loads of a round, given the jobs frozen so far (name -> rate)."""
    if _FixedHits.applies(jobs, cluster):
        return _FixedHits(jobs, e, cluster).loads
    reads = _reads(jobs)
    return lambda fixed: _Loads(jobs, fixed, e, reads)


def _io_limit(loads: _Loads | _FixedLoads, cluster: Cluster, start: float) -> float:
    """Largest lam >= start with need(lam) <= B (see _Loads.limit)."""
    return loads.limit(cluster, start)


def _gpus_held(fixed: Mapping[str, float], jobs: Sequence[Job]) -> float:
    """The GPUs the jobs whose rates are fixed hold at those rates."""
    # A job with no ideal rate (f* == 0) runs at rate 0 at any level and so holds no GPU
    # time; leaving it out is also what keeps the division defined.
    held = [j for j in jobs if j.name in fixed and j.f_star > 0]
    return _gpus_at(held, map(fixed.__getitem__, map(_NAME, held)))


def _gpus_at(jobs: Sequence[Job], rates: Iterable[float]) -> float:
    """sum of gpus * rate / f* over `jobs` with their `rates`, in order (in C)."""
    gpu_rates = map(mul, map(_GPUS, jobs), rates)
    return sum(map(truediv, gpu_rates, map(_F_STAR, jobs)), 0.0)


def _gpu_limit(
    free: Sequence[Job],
    fixed: Mapping[str, float],
    e: Mapping[str, float],
    jobs: Sequence[Job],
    total_gpus: float,
    base: tuple[float, float] | None = None,
) -> float:
    """The level at which GPUs run out. base: (used, per_lam) for these free and fixed
    jobs (_gpu_base), when the caller has it."""
    if base is not None:
        used, per_lam = base
    else:
        used = _gpus_held(fixed, jobs)
        live = [j for j in free if j.f_star > 0]
        per_lam = _gpus_at(live, map(e.__getitem__, map(_NAME, live)))
    return max(0.0, total_gpus - used) / per_lam if per_lam > 0 else math.inf


_NAME = attrgetter("name")
_F_STAR = attrgetter("f_star")
_GPUS = attrgetter("gpus")
_READS = attrgetter("reads")
_HIT_NOW = attrgetter("hit_now")
_LEVEL = itemgetter(0)
_END = itemgetter(1)


def _freeze(
    fixed: dict[str, float], jobs: Iterable[Job], lam: float, e: Mapping[str, float]
) -> None:
    """fixed[j.name] = min(j.f_star, lam * e[j.name]) for each job, in order."""
    names = list(map(_NAME, jobs))
    fixed.update(
        zip(
            names,
            map(min, map(_F_STAR, jobs), map(mul, repeat(lam), map(e.__getitem__, names))),
            strict=True,
        )
    )


def maxmin_level(
    jobs: Sequence[Job], cluster: Cluster, e: Mapping[str, float], io_aware: bool = True
) -> tuple[float, dict[str, float]]:
    """The Eq. 9 optimum in closed form: (lam*, cache*). Every job gets lam* * e_j."""
    loads = _Loads(jobs, {}, e)
    cache = loads.best_cache(1.0, cluster) if io_aware else {}
    _, h = loads.io_line(cache, cluster)
    io = cluster.remote_io / h if io_aware and h > 0 else math.inf
    gpu = _gpu_limit(jobs, {}, e, jobs, cluster.total_gpus)
    cap = min((j.f_star / e[j.name] for j in jobs if e[j.name] > 0), default=math.inf)
    return min(io, gpu, cap), cache


def maxmin(
    jobs: Sequence[Job],
    cluster: Cluster,
    e: Mapping[str, float],
    io_aware: bool = True,
    start: _Start | None = None,
) -> MaxMin:
    """Progressive filling whose first round is exactly the Eq. 9 optimum.

    Each round raises the free jobs together to the first binding limit and freezes the
    jobs it binds. Most rounds only reach the next job's own ceiling (f*_j / e_j); they
    are taken in bulk (_cap_rounds) with the same outcome, so the number of full rounds,
    each of which solves the cache knapsack, is the number of times IO or GPUs bind.
    """
    io = _io_model(jobs, cluster, e) if io_aware else None
    return _fill(jobs, cluster, e, io, start)


def maxmin_fixed_hits(
    jobs: Sequence[Job],
    cluster: Cluster,
    hits: Mapping[str, float],
    e: Mapping[str, float],
    start: _Start | None = None,
    with_cache: bool = True,
) -> MaxMin:
    """maxmin(*with_fixed_hits(jobs, cluster, hits), e), to the last bit, without making
    that problem's jobs and cluster: only its IO model differs from `jobs` on `cluster`
    (the rounds read names, GPUs, f* and the cluster's GPUs and link, which are the
    same). with_cache False: the plan's cache (a unit per job, named after it) is left
    empty, for a caller that reads only the rates."""
    sizes = None
    if start is not None:
        sizes = start.sizes
        if sizes is None:
            sizes = start.sizes = _job_sizes(jobs, cluster)
    model = _FixedHits.of_hits(jobs, cluster, hits, e, sizes)
    return _fill(jobs, cluster, e, model.loads, start, with_cache)


def _job_sizes(jobs: Sequence[Job], cluster: Cluster) -> list[float]:
    """The size of the unit each job reads first (its dataset's), in the jobs' order."""
    units = cluster.units
    return [units[next(iter(job.reads))].size for job in jobs]


@dataclass
class _Start:
    """What progressive filling starts from, which depends on the jobs (names, GPUs, f*),
    e and the cluster's GPUs alone, not on the IO model: the jobs that never run (fixed
    at 0.0), each free job's ceiling, the free jobs in ascending ceiling, and the first
    round's ceiling groups with how many of them GPUs allow (_cap_rounds' first call).
    Gavel's two solves of a plan share it, and so do plans of the same jobs (with the
    jobs' dataset sizes, which the fixed-hits solve reads)."""

    zero: list[str]
    caps: dict[str, float]
    free: list[Job]
    groups: list[tuple[float, int]]
    gpu_top: int
    gpu_base: tuple[float, float]  # _gpu_base at the start: the first round's GPU limit
    sizes: list[float] | None = None  # _job_sizes, found by the first fixed-hits solve
    # _FixedHits._round_terms of the first round, found by the first fixed-hits solve
    round_terms: tuple[list[int], list[float]] | None = None


def _start(jobs: Sequence[Job], cluster: Cluster, e: Mapping[str, float]) -> _Start:
    zero: list[str] = []
    caps: dict[str, float] = {}
    live: list[tuple[float, str, Job]] = []
    for job in jobs:
        rate = e.get(job.name, 0.0)
        if rate > 0 and job.f_star > 0:
            caps[job.name] = cap = job.f_star / rate
            live.append((cap, job.name, job))
        else:
            zero.append(job.name)
    # Free jobs in ascending ceiling: a round's own-ceiling freezes are then a prefix.
    # (Names are unique, so the sort never compares two jobs.)
    free = [job for _, _, job in sorted(live)]
    groups = _groups(free, caps)
    base = _gpu_base(free, dict.fromkeys(zero, 0.0), e, jobs)
    gpu_top = _gpu_rounds(free, {}, e, jobs, cluster, groups, base)
    return _Start(zero, caps, free, groups, gpu_top, base)


def _fill(
    jobs: Sequence[Job],
    cluster: Cluster,
    e: Mapping[str, float],
    io: Callable[[Mapping[str, float]], _Loads | _FixedLoads] | None,
    start: _Start | None = None,
    with_cache: bool = True,
) -> MaxMin:
    """maxmin's progressive filling with the IO model `io` (None: IO is not planned),
    from `start` (_start(jobs, cluster, e), when the caller has it)."""
    if start is None:
        start = _start(jobs, cluster, e)
    fixed = dict.fromkeys(start.zero, 0.0)
    caps, free = start.caps, start.free
    first_round: _Start | None = start
    lam = 0.0
    first = None
    while free:
        rounds, tried, gpus = _cap_rounds(free, lam, caps, fixed, e, jobs, cluster, io, first_round)
        first_round = None  # (only the first call starts where _start did)
        taken = 0
        for level, group in rounds:
            lam = max(lam, level)
            first = lam if first is None else first
            _freeze(fixed, group, lam, e)
            taken += len(group)
        if taken:
            free = free[taken:]
        if not free:
            break
        # (the IO loads only matter when IO is planned: _binding reads them only when
        # IO binds.) The binary search may have solved this very round already: the
        # same loads, the same start, so the same limit.
        known = tried.get(len(rounds))
        if known is not None:
            loads, lam_io = known
        else:
            loads = io(fixed) if io is not None else None
            lam_io = loads.limit(cluster, lam) if loads is not None else math.inf
        # (the GPUs the fixed jobs hold and the free ones' per unit of level are the
        # ones _cap_rounds started from, unless it froze some)
        gpus = gpus if not rounds else None
        lam_gpu = _gpu_limit(free, fixed, e, jobs, cluster.total_gpus, gpus)
        lam = max(lam, min(lam_io, lam_gpu, caps[free[0].name]))
        first = lam if first is None else first
        frozen = _binding(free, caps, lam, lam_io, lam_gpu, loads, cluster)
        _freeze(fixed, frozen, lam, e)
        if len(frozen) == len(free):  # (frozen is a subset of free)
            break
        gone = set(map(_NAME, frozen))
        free = list(compress(free, map(not_, map(gone.__contains__, map(_NAME, free)))))
    model = getattr(io, "__self__", None)
    if isinstance(model, _FixedHits):
        # (what best_cache gives at any loads: the cache cannot move)
        cache = model.cache if with_cache else {}
    else:
        cache = io(fixed).best_cache(0.0, cluster) if io is not None else {}
    return MaxMin(first or 0.0, fixed, cache)


# A bulk round must be one the plain loop would also take as a pure ceiling round. GPU
# use is summed in another order than _gpu_limit does, so near a tie with the GPU limit
# the round is left to the plain loop (exact either way, only slower).
_MARGIN = 1e-9


def _cap_rounds(
    free: Sequence[Job],
    lam: float,
    caps: Mapping[str, float],
    fixed: Mapping[str, float],
    e: Mapping[str, float],
    jobs: Sequence[Job],
    cluster: Cluster,
    io: Callable[[Mapping[str, float]], _Loads | _FixedLoads] | None,
    known: _Start | None = None,
) -> tuple[
    list[tuple[float, list[Job]]],
    dict[int, tuple[_Loads | _FixedLoads, float]],
    tuple[float, float],
]:
    """The leading rounds of progressive filling in which neither GPUs nor IO bind, each
    as (level, the jobs frozen at their ceiling), for `free` in ascending ceiling.

    Round g (level L_g, the least free ceiling) only freezes its ceiling group when the
    GPU and IO limits lie above L_g (1 + _TOL), given rounds 0..g-1 done. Both GPU use
    and IO need (the knapsack) only grow with every job's rate, and every job's rate at
    round g is at least its rate at round g-1, so that holds for a prefix of rounds:
    binary search finds it, GPUs with prefix sums, IO with O(log rounds) solutions of
    the same _io_limit the plain round would compute.

    Also returns the rounds whose IO loads and limit it solved (g -> (loads, limit)):
    those of round len(rounds) are what the plain loop computes next; and _gpu_base of
    `free` and `fixed`, which it starts from.
    """
    tried: dict[int, tuple[_Loads | _FixedLoads, float]] = {}
    if known is not None:
        groups, top, base = known.groups, known.gpu_top, known.gpu_base
    else:
        groups = _groups(free, caps)
        base = _gpu_base(free, fixed, e, jobs)
        top = _gpu_rounds(free, fixed, e, jobs, cluster, groups, base)
    if io is not None and not math.isinf(cluster.remote_io) and top > 0:
        model = getattr(io, "__self__", None)
        if isinstance(model, _FixedHits):
            round_loads = model.round_loads(fixed, free, groups, known)
        else:
            round_loads = partial(_frozen_loads, io, fixed, free, groups, e)

        def io_ok(g: int) -> bool:
            """Round g's IO limit, computed as the plain loop would, is above its level."""
            start = max(lam, groups[g - 1][0]) if g > 0 else lam
            loads = round_loads(g)
            limit = loads.limit(cluster, start)
            tried[g] = (loads, limit)
            return limit > groups[g][0] * (1 + _TOL)

        top = rounds_io_allows(io_ok, top)
    out = []
    begin = 0
    for level, end in groups[:top]:
        out.append((level, free[begin:end]))
        begin = end
    return out, tried, base


def _groups(free: Sequence[Job], caps: Mapping[str, float]) -> list[tuple[float, int]]:
    """The ceiling groups of `free` (ascending ceiling): (level, end index in free)."""
    groups: list[tuple[float, int]] = []
    ceilings = [caps[job.name] for job in free]  # ascending
    i = 0
    while i < len(free):
        level = ceilings[i]
        # the first k > i whose ceiling is above level * (1 + _TOL)
        k = bisect_right(ceilings, level * (1 + _TOL), i + 1)
        groups.append((level, k))
        i = k
    return groups


def _gpu_rounds(
    free: Sequence[Job],
    fixed: Mapping[str, float],
    e: Mapping[str, float],
    jobs: Sequence[Job],
    cluster: Cluster,
    groups: Sequence[tuple[float, int]],
    base: tuple[float, float] | None = None,
) -> int:
    """How many of the leading ceiling groups GPUs allow (_cap_rounds). base: _gpu_base
    of the same jobs, when the caller has it."""
    # GPUs: with groups < g frozen at their level, used(g) + per_lam(g) * lam.
    used0, per_lam = base if base is not None else _gpu_base(free, fixed, e, jobs)
    gpu_ok: list[bool] = []
    used, start = used0, 0
    gpu_bar = cluster.total_gpus * (1 - _MARGIN)
    for level, end in groups:
        near = level * (1 + _TOL) * (1 + _MARGIN)
        gpu_ok.append(used + per_lam * near < gpu_bar)
        if not gpu_ok[-1]:
            break
        for job in free[start:end]:
            used += job.gpus * min(job.f_star, level * e[job.name]) / job.f_star
            per_lam -= job.gpus * e[job.name] / job.f_star
        start = end
    return len(gpu_ok) if all(gpu_ok) else len(gpu_ok) - 1  # rounds 0..top-1 GPU-free


def _gpu_base(
    free: Sequence[Job], fixed: Mapping[str, float], e: Mapping[str, float], jobs: Sequence[Job]
) -> tuple[float, float]:
    """The GPUs the fixed jobs hold, and the free jobs' GPUs per unit of level (every
    free job has f* > 0): what _gpu_limit divides, before any round."""
    return _gpus_held(fixed, jobs), _gpus_at(free, map(e.__getitem__, map(_NAME, free)))


def _frozen_loads(
    io: Callable[[Mapping[str, float]], _Loads | _FixedLoads],
    fixed: Mapping[str, float],
    free: Sequence[Job],
    groups: Sequence[tuple[float, int]],
    e: Mapping[str, float],
    g: int,
) -> _Loads | _FixedLoads:
    """The IO loads with groups[:g] of `free` frozen at their levels, as the plain
    rounds would have frozen them."""
    frozen = dict(fixed)
    begin = 0
    for level, end in groups[:g]:
        for job in free[begin:end]:
            frozen[job.name] = min(job.f_star, level * e[job.name])
        begin = end
    return io(frozen)


def _binding(
    free: Sequence[Job],
    caps: Mapping[str, float],
    lam: float,
    lam_io: float,
    lam_gpu: float,
    loads: _Loads | _FixedLoads | None,
    cluster: Cluster,
) -> list[Job]:
    """The jobs that cannot rise above lam: all of them if GPUs ran out; those at their
    own ceiling; and, if IO ran out, those that still miss the cache."""
    near = lam * (1 + _TOL)
    if lam_gpu <= near:
        return list(free)
    frozen = [j for j in free if caps[j.name] <= near]
    if lam_io <= near and loads is not None:
        held = {j.name for j in frozen}
        bar = 1 - _TOL
        if isinstance(loads, _FixedLoads):  # (its hit is a lookup: done here per job)
            hits = loads.model.hits
            frozen += [j for j in free if j.name not in held and hits[j.name] < bar]
        else:
            part = _unit_hits(loads.best_cache(lam, cluster), cluster)
            frozen += [j for j in free if j.name not in held and _hit(j, part) < bar]
    return frozen or list(free)


def _unit_hits(cache: Mapping[str, float], cluster: Cluster) -> Callable[[str], float]:
    """key -> min(1, c/d) of the unit under `cache` (1 for an empty one), found once."""
    units, held = cluster.units, cache.get
    found: dict[str, float] = {}

    def part(key: str) -> float:
        value = found.get(key)
        if value is None:
            size = units[key].size
            value = found[key] = 1.0 if size <= 0 else min(1.0, held(key, 0.0) / size)
        return value

    return part


def _hit(job: Job, part: Callable[[str], float]) -> float:
    """hit_ratio(job, cache, cluster) with part from _unit_hits(cache, cluster)."""
    hit = 0.0
    for key, weight in job.reads.items():
        hit += weight * part(key)
    return min(1.0, hit)


def with_fixed_hits(
    jobs: Sequence[Job], cluster: Cluster, hits: Mapping[str, float]
) -> tuple[list[Job], Cluster]:
    """The problem as it stands now, when cache cannot change: each job reads a private
    unit alone in a pool that holds exactly its current hit ratio of the data."""
    units: dict[str, CacheUnit] = {}
    pools: dict[str, float] = {}
    fixed = []
    for job in jobs:
        key = f"now:{job.name}"
        size = cluster.units[next(iter(job.reads))].size
        units[key] = CacheUnit(key, key, job.dataset, size)
        pools[key] = hits[job.name] * size
        # (Job(...), not dataclasses.replace: this runs for every job at every re-plan)
        fixed.append(
            Job(job.name, job.dataset, job.gpus, job.f_star, {key: 1.0}, job.remaining,
                job.submit, job.placement, None)
        )  # fmt: skip
    return fixed, replace(cluster, units=units, pools=pools, cached=None)


class GavelPolicy:
    """Max-min fairness over perf(j, R) / perf(j, R^equal) (Eq. 8, or Eq. 9 with SiloD).

    The cache allocation is the steady-state optimum. GPU shares and IO are the max-min
    optimum for each job's hit ratio now (Job.hit_now, else the cache as filled), which
    converge to the steady state as the cache fills and its items become effective; the
    caller re-runs the policy while they do. Planning IO with the steady state instead
    would starve exactly the jobs whose cache is being filled.

    The vanilla form's shares come from vanilla_shares (closed form), or with
    closed_form False from maxmin itself: the same to rounding, but the simulator's LRU
    equilibrium (sim_lru.equilibrium stops when rates move under 1%) turns a last-bit
    change of a share into a visible one of a finish, so under LRU it keeps maxmin's.
    """

    name = "gavel"

    def __init__(self, closed_form: bool = True) -> None:
        self.closed_form = closed_form
        # The last steady-state solve (equal shares and the max-min plan) and what it was
        # of: it depends on the jobs and the cluster's resources alone, not on the hits
        # now, so re-plans between two arrivals or completions reuse it.
        # With it, where filling starts (_Start): the fixed-hits solve of every plan of
        # those jobs starts there too (the views differ, not their names, GPUs, f*).
        self._steady: _Steady | None = None
        # The jobs' names ranked in order, for the array forms' ceiling ties (made on
        # the first plan solved as arrays: gavel_arrays imports numpy)
        self._ranks: ga.NameRanks | None = None

    def reads(self, estimator: Estimator) -> frozenset[str]:
        """The vanilla form divides GPUs among the jobs by their equal shares alone; the
        SiloD form's shares and IO are for the hits now."""
        return frozenset({HITS}) if estimator.io_aware else frozenset()

    def allocate(self, jobs: Sequence[Job], cluster: Cluster, estimator: Estimator) -> Allocation:
        if self.closed_form and type(estimator) is ComputeEstimator:
            return Allocation(cache={}, gpu_share=vanilla_shares(jobs, cluster.total_gpus))
        # (the jobs' names, taken once: the steady plan's check and the array forms
        # read them; a list of ~1,100 made per use cost ~1% of a run)
        names = list(map(_NAME, jobs))
        steady = self._steady_plan(jobs, names, cluster, estimator)
        if steady.shares is not None:  # (the vanilla form, solved as arrays)
            return Allocation(cache={}, gpu_share=dict(zip(names, steady.shares, strict=True)))
        e, plan, start = steady.e, steady.plan, steady.start
        alloc = Allocation(cache=dict(plan.cache) if estimator.io_aware else {})
        if estimator.io_aware and steady.arrays is not None:
            from . import gavel_arrays as ga

            # (what current_hits gives when every job says: no None among them, which
            # would make the array one of objects; a check in C, where `None in` a
            # list of ~1,000 floats compared each of them)
            hit_now = ga.floats(list(map(_HIT_NOW, jobs)))
            if hit_now is not None:
                _fixed_hits_tail(alloc, names, cluster, hit_now, steady.arrays)
                return alloc
        hits = current_hits(jobs, cluster, plan.cache) if estimator.io_aware else None
        if hits is not None and steady.arrays is not None:
            _fixed_hits_tail(alloc, names, cluster, list(map(hits.__getitem__, names)),
                             steady.arrays)  # fmt: skip
            return alloc
        if hits is not None:
            # (the plan's cache is the steady one above: this solve's is not read)
            plan = maxmin_fixed_hits(jobs, cluster, hits, e, start, with_cache=False)
        rates, gpu_share = plan.rates, alloc.gpu_share
        for job in jobs:
            share = 0.0
            if job.f_star > 0:
                share = rates.get(job.name, 0.0) / job.f_star
                if not share < 1.0:  # min(1, rate / f*)
                    share = 1.0
            gpu_share[job.name] = share
        if not estimator.io_aware:
            return alloc
        spread_leftover_gpus(alloc, jobs, cluster)
        if hits is None:
            hits = {j.name: hit_ratio(j, plan.cache, cluster) for j in jobs}
        # io: rate * (1 - hit now); ceiling: share * f* (each pass in C, in the jobs' order)
        misses = map(sub, repeat(1.0), map(hits.__getitem__, names))
        io = map(mul, map(plan.rates.get, names, repeat(0.0)), misses)
        alloc.io.update(zip(names, io, strict=True))
        shares = map(alloc.gpu_share.__getitem__, names)
        ceiling = dict(zip(names, map(mul, shares, map(_F_STAR, jobs)), strict=True))
        spread_leftover_io(alloc, jobs, cluster, ceiling)
        return alloc

    def _steady_plan(
        self, jobs: Sequence[Job], names: list[str], cluster: Cluster, estimator: Estimator
    ) -> _Steady:
        """equal_share_perf and maxmin of the jobs as they are (what they read, f*,
        GPUs) on the cluster's resources, and where that filling started, kept while
        those stay the same."""
        last = self._steady
        if last is not None and _same_jobs(last.jobs, jobs, names):
            seen = last.cluster
            if (
                last.estimator is type(estimator)
                and seen.remote_io == cluster.remote_io
                and seen.total_gpus == cluster.total_gpus
                and (seen.units is cluster.units or seen.units == cluster.units)
                and (seen.pools is cluster.pools or seen.pools == cluster.pools)
            ):
                return last
        start: _Start | None = None
        arrays: ga.JobArrays | None = None
        shares: list[float] | None = None
        seen_jobs = _JobsSeen.of(jobs, names)
        if len(jobs) >= ARRAYS_FROM and self._ranks is None:
            from . import gavel_arrays as ga

            self._ranks = ga.NameRanks()
        if type(estimator) is SiloDEstimator and len(jobs) >= ARRAYS_FROM:
            e, plan, arrays = _steady_arrays(jobs, seen_jobs, cluster, self._ranks)
        elif type(estimator) is ComputeEstimator and len(jobs) >= ARRAYS_FROM:
            e, plan, shares = _vanilla_arrays(seen_jobs, cluster, self._ranks)
        else:
            e = equal_share_perf(jobs, cluster, estimator)
            start = _start(jobs, cluster, e)
            plan = maxmin(jobs, cluster, e, io_aware=estimator.io_aware, start=start)
        self._steady = _Steady(seen_jobs, type(estimator), cluster, e, plan, start, arrays,
                               shares)  # fmt: skip
        return self._steady


# From how many jobs a SiloD plan is solved as array operations (gavel_arrays). Each
# plan then pays some 250 us of numpy calls whatever its size; the loops cost about 6 us
# a job. On instances like tests/unit/test_ctl_maxmin_lp.py's large_instance (one pool,
# a third of the plans of new jobs) the two cross at about 70 jobs: below, the loops.
# The vanilla form without its closed form (the simulator's LRU) takes the same bar.
ARRAYS_FROM = 80


def _fixed_hits_tail(
    alloc: Allocation,
    names: list[str],
    cluster: Cluster,
    hit_now: list[float] | ga.FloatArray,
    arrays: ga.JobArrays,
) -> None:
    """What GavelPolicy.allocate does with the hits now (`hit_now`, in the jobs' order
    as floats:
    maxmin_fixed_hits, the shares, spread_leftover_gpus, the IO and spread_leftover_io),
    as array operations: the same floats in the same order (gavel_arrays says how)."""
    from . import gavel_arrays as ga

    shares, io = ga.solve_hits_now(arrays, hit_now, _limits(cluster))
    alloc.gpu_share.update(zip(names, shares, strict=True))
    alloc.io.update(zip(names, io, strict=True))


def _limits(cluster: Cluster) -> ga.Limits:
    from . import gavel_arrays as ga

    return ga.Limits(cluster.total_gpus, cluster.remote_io, _TOL, _MARGIN)


def _steady_arrays(
    jobs: Sequence[Job], seen: _JobsSeen, cluster: Cluster, ranks: ga.NameRanks | None = None
) -> tuple[Mapping[str, float], MaxMin, ga.JobArrays]:
    """equal_share_perf (SiloD's estimator), _start and maxmin as array operations
    (gavel_arrays): the same e, the same rates (in the jobs' order) and level, and the
    same cache in the same order; and the jobs as the plans for the hits now read them.
    With several pools the knapsack is _Loads' (gavel_arrays fills one pool). `seen`:
    the jobs' columns (what the plan is kept by), read here rather than taken again."""
    from . import gavel_arrays as ga

    names = seen.names
    reads = ga.reads_of(names, seen.f_stars, seen.gpus, seen.reads, cluster.units)
    pool = _one_pool(reads.keys, cluster)
    if pool is not None and len(reads.r_job) == len(names):  # (one read a job)
        unit_cache: list[float] | ga.FloatArray = ga.equal_unit_cache(reads, pool)
    else:
        equal = _equal_cache(jobs, cluster)
        unit_cache = [equal.get(key, 0.0) for key in reads.keys]
    steady = ga.steady_state(reads, unit_cache, pool, _limits(cluster), ranks)
    e = _ByName(names, steady.e)
    if steady.rates is None:
        return e, maxmin(jobs, cluster, e), steady.arrays
    rates = _ByName(names, steady.rates)
    return e, MaxMin(steady.level, rates, dict(steady.cache)), steady.arrays


def _vanilla_arrays(
    seen: _JobsSeen, cluster: Cluster, ranks: ga.NameRanks | None = None
) -> tuple[Mapping[str, float], MaxMin, list[float]]:
    """equal_share_perf (ComputeEstimator), _start and maxmin with io_aware False as
    array operations (gavel_arrays.vanilla): the same e, rates and level, and the GPU
    shares allocate makes of the rates (min(1, rate / f*)), in the jobs' order."""
    from . import gavel_arrays as ga

    names = seen.names
    plan = ga.vanilla(names, seen.f_stars, seen.gpus, _limits(cluster), ranks)
    rates = _ByName(names, plan.rates)
    return _ByName(names, plan.e), MaxMin(plan.level, rates, {}), plan.shares


def _one_pool(keys: Sequence[str], cluster: Cluster) -> float | None:
    """The capacity of the cluster's pool when it has one and the units `keys` draw
    from it and hold data (gavel_arrays' knapsack), else None."""
    if len(cluster.pools) != 1:
        return None
    [(pool, capacity)] = cluster.pools.items()
    units = cluster.units
    if all(units[key].pool == pool and units[key].size > 0 for key in keys):
        return capacity
    return None


@dataclass
class _JobsSeen:
    """What the steady plan depends on per job, in the jobs' order: names, f*, GPUs, and
    what each reads (the mappings themselves: a job's reads are taken to be the same
    while they are the same mapping, and compared item by item, in order, otherwise)."""

    names: list[str]
    f_stars: list[float]
    gpus: list[int]
    reads: list[Mapping[str, float]]

    @classmethod
    def of(cls, jobs: Sequence[Job], names: list[str]) -> _JobsSeen:
        """`names`: the jobs' names, in their order (the caller has them)."""
        return cls(
            names,
            list(map(_F_STAR, jobs)),
            list(map(_GPUS, jobs)),
            list(map(_READS, jobs)),
        )


def _same_jobs(seen: _JobsSeen, jobs: Sequence[Job], names: list[str]) -> bool:
    """Are `jobs` (named `names`) the jobs `seen` was taken of, as far as the steady plan
    reads them? (It is compared at every re-plan: one attribute at a time, each pass in
    C.)"""
    if len(jobs) != len(seen.names) or names != seen.names:
        return False
    if list(map(_F_STAR, jobs)) != seen.f_stars or list(map(_GPUS, jobs)) != seen.gpus:
        return False
    reads = list(map(_READS, jobs))
    if all(map(is_, reads, seen.reads)):
        return True
    return all(
        a is b or tuple(a.items()) == tuple(b.items())
        for a, b in zip(reads, seen.reads, strict=True)
    )


@dataclass
class _Steady:
    """GavelPolicy's last steady-state solve and what it was of."""

    jobs: _JobsSeen
    estimator: type
    cluster: Cluster
    e: Mapping[str, float]
    plan: MaxMin
    start: _Start | None  # (None: solved as array operations, which start from arrays)
    arrays: ga.JobArrays | None = None  # the jobs as gavel_arrays reads them, when it does
    # The vanilla form's GPU shares in the jobs' order, when solved as arrays (they
    # depend on the steady plan's rates alone)
    shares: list[float] | None = None


def vanilla_shares(jobs: Sequence[Job], total_gpus: float) -> dict[str, float]:
    """The vanilla form's GPU shares (ComputeEstimator): maxmin(jobs, cluster, e,
    io_aware=False) with e its equal shares, in closed form (the same to rounding).

    There e_j = x_j f*_j with x_j = min(1, (G/n) / g_j), so a job's share at level lam is
    min(1, lam x_j), a function of its GPU count alone: progressive filling runs over the
    GPU counts, smallest first (the lowest ceilings 1 / x), each count either reaching
    share 1 before the GPUs run out or sharing the level they run out at. A job with
    f* == 0 (or no equal share) takes no GPU time."""
    n = len(jobs)
    per_job = total_gpus / n if n else 0.0
    counts: dict[int, int] = {}
    for job in jobs:
        if job.f_star > 0 and (job.gpus <= 0 or per_job > 0):
            counts[job.gpus] = counts.get(job.gpus, 0) + 1
    x = {g: 1.0 if g <= 0 or not per_job / g < 1.0 else per_job / g for g in counts}
    used = 0.0  # GPUs of the counts at share 1
    per_lam = sum(m * g * x[g] for g, m in counts.items())  # GPUs per unit of level
    level = math.inf
    for g in sorted(counts, key=lambda g: (1.0 / x[g], g)):
        if per_lam > 0 and used + per_lam / x[g] >= total_gpus:
            level = max(0.0, total_gpus - used) / per_lam  # GPUs run out first
            break
        used += counts[g] * g
        per_lam -= counts[g] * g * x[g]
    share = {g: 1.0 if not level * x[g] < 1.0 else level * x[g] for g in counts}
    return {
        job.name: share[job.gpus] if job.f_star > 0 and job.gpus in share else 0.0 for job in jobs
    }


def spread_leftover_gpus(alloc: Allocation, jobs: Sequence[Job], cluster: Cluster) -> None:
    """Hand GPU time the max-min plan leaves idle to the jobs, max-min fairly in GPUs.

    Nobody's planned rate drops, so the Eq. 9 level is kept; but a job whose hits turn
    out better than planned (another job filling a shared dataset, an epoch starting)
    can then use all of its IO allocation instead of idling at its planned rate.
    """
    # The same products and sums as a loop over the jobs would make, each pass in C.
    gpu_share = alloc.gpu_share
    names = list(map(_NAME, jobs))
    gpus = list(map(_GPUS, jobs))
    shares = list(map(gpu_share.__getitem__, names))
    used = sum(map(mul, shares, gpus), 0.0)
    room = dict(zip(names, map(mul, map(sub, repeat(1.0), shares), gpus), strict=True))
    extra = water_fill(max(0.0, cluster.total_gpus - used), room)
    for name, n, share in zip(names, gpus, shares, strict=True):
        if n > 0:
            share += extra[name] / n
            gpu_share[name] = share if share < 1.0 else 1.0  # min(1.0, share)
