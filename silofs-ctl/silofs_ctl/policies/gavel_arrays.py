"""Gavel's solve for the hits now (maxmin_fixed_hits) as array operations, for many jobs.

Owns: the progressive filling of the fixed-hits problem (every job reads a unit of its
own whose hit ratio cannot move this plan) over arrays of the jobs, and the same float
arithmetic as gavel._fill on gavel._FixedHits, to the bit. Never: builds the problem,
decides when the array form is worth it (gavel.py does both), or solves the steady state.

Exactness. Elementwise +, -, *, /, min and max of float64 arrays are the IEEE operations
Python's floats make. Sums are not: np.sum adds pairwise. Every sum here that the Python
form makes with `sum(..., 0.0)` or `+=` in a loop is made with np.cumsum, which adds left
to right, over the same terms in the same order (the terms are >= 0, so the Python form's
leading 0.0 + x is x). A running subtraction p - s0 - s1 ... is the cumsum of p, -s0,
-s1, ... (IEEE defines a - b as a + (-b)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

FloatArray = np.ndarray
IndexArray = np.ndarray


def seqsum(terms: FloatArray) -> float:
    """sum(terms, 0.0) as Python adds them, left to right (terms >= 0)."""
    if not len(terms):
        return 0.0
    return float(np.cumsum(terms)[-1])


@dataclass
class JobArrays:
    """What the filling reads per job, fixed while the jobs are (gavel._Start keeps it).

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


def fixed_hits_model(arrays: JobArrays, hits: FloatArray) -> tuple[FloatArray, FloatArray]:
    """(miss, hit) per job: gavel._FixedHits.of_hits' miss list and hits, as arrays."""
    sizes = arrays.sizes
    positive = sizes > 0
    takes = np.minimum(sizes, hits * sizes)
    held = np.where(takes > 0, takes, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        part = held / sizes
    left = 1.0 - part
    miss = np.where(positive, np.where(left > 0.0, left, 0.0), 0.0)
    hit = np.where(positive, np.where(part < 1.0, part, 1.0), 1.0)
    return miss, hit


def _groups(caps: FloatArray, tol: float) -> tuple[FloatArray, IndexArray]:
    """gavel._groups of ascending ceilings: each group's level and end index."""
    n = len(caps)
    nxt = np.searchsorted(caps, caps * (1 + tol), side="right").tolist()
    ends: list[int] = []
    i = 0
    while i < n:
        k = nxt[i]
        if k <= i:  # (bisect_right from i + 1)
            k = i + 1
        ends.append(k)
        i = k
    starts = [0, *ends[:-1]]
    return caps[starts], np.array(ends, dtype=np.intp)


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
    counts = np.diff(ends, prepend=0)
    level_of = np.repeat(levels, counts)
    used = np.cumsum(np.concatenate(([base[0]], g * np.minimum(f, level_of * e) / f)))
    per_lam = np.cumsum(np.concatenate(([base[1]], -(g * e / f))))
    begins = ends - counts
    near = levels * (1 + limits.tol) * (1 + limits.margin)
    ok = used[begins] + per_lam[begins] * near < limits.total_gpus * (1 - limits.margin)
    bad = np.flatnonzero(~ok)
    return int(bad[0]) if len(bad) else len(levels)


def _io_limit(a: float, b: float, start: float, limits: Limits) -> float:
    """gavel._FixedLoads.limit."""
    budget = limits.remote_io
    if math.isinf(budget):
        return math.inf
    if b <= 0.0:
        return math.inf if a <= budget * (1 + limits.tol) else start
    return max(start, (budget - a) / b)


def fill(arrays: JobArrays, miss: FloatArray, hit: FloatArray, limits: Limits) -> FloatArray:
    """Each job's rate: gavel._fill(jobs, cluster, e, _FixedHits(...).loads, start)'s
    rates, in the jobs' order, to the bit."""
    e, f_star = arrays.e, arrays.f_star
    tol = limits.tol
    rate = np.zeros(len(e))
    frozen = arrays.zero.copy()
    slopes = e * miss
    free = arrays.free
    caps = arrays.caps
    levels, ends, top, base = arrays.levels, arrays.ends, arrays.gpu_top, arrays.gpu_base
    lam = 0.0
    while len(free):
        tried: dict[int, tuple[float, float, float]] = {}
        if not math.isinf(limits.remote_io) and top > 0:
            top = _io_rounds(arrays, free, levels, ends, top, lam, rate, frozen, miss, slopes,
                             limits, tried)  # fmt: skip
        taken = 0
        if top:
            taken = int(ends[top - 1])
            group_lam = np.maximum.accumulate(np.maximum(lam, levels[:top]))
            lam = float(group_lam[-1])
            moved = free[:taken]
            level_of = np.repeat(group_lam, np.diff(ends[:top], prepend=0))
            rate[moved] = np.minimum(f_star[moved], level_of * e[moved])
            frozen[moved] = True
            free, caps = free[taken:], caps[taken:]
        if not len(free):
            break
        known = tried.get(top)
        if known is not None:
            _, _, lam_io = known
        else:
            a = seqsum(rate[frozen] * miss[frozen])
            b = seqsum(slopes[~frozen])
            lam_io = _io_limit(a, b, lam, limits)
        if taken:
            base = _gpu_base(arrays, free, rate, frozen)
        used, per_lam = base
        lam_gpu = max(0.0, limits.total_gpus - used) / per_lam if per_lam > 0 else math.inf
        lam = max(lam, min(lam_io, lam_gpu, float(caps[0])))
        near = lam * (1 + tol)
        if lam_gpu <= near:
            stop = np.ones(len(free), dtype=bool)
        else:
            stop = caps <= near
            if lam_io <= near:
                stop |= hit[free] < 1 - tol
            if not stop.any():
                stop[:] = True
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
    return rate


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
    free: IndexArray,
    levels: FloatArray,
    ends: IndexArray,
    top: int,
    lam: float,
    rate: FloatArray,
    frozen: FloatArray,
    miss: FloatArray,
    slopes: FloatArray,
    limits: Limits,
    tried: dict[int, tuple[float, float, float]],
) -> int:
    """gavel._cap_rounds' search for the leading rounds IO allows, among the `top` the
    GPUs allow; each round's (a, b, limit) goes into `tried`."""
    e, f_star = arrays.e, arrays.f_star
    counts = np.diff(ends, prepend=0)
    # per job (jobs' order): the round it is frozen in (-1: before), its rate from then
    first = np.where(frozen, -1, len(levels))
    first[free[: int(ends[-1])]] = np.repeat(np.arange(len(levels)), counts)
    at = rate.copy()
    at[free] = np.minimum(f_star[free], np.repeat(levels, counts) * e[free])
    a_terms = at * miss

    def io_ok(g: int) -> bool:
        start = max(lam, float(levels[g - 1])) if g > 0 else lam
        done = first < g
        a, b = seqsum(a_terms[done]), seqsum(slopes[~done])
        limit = _io_limit(a, b, start, limits)
        tried[g] = (a, b, limit)
        return limit > float(levels[g]) * (1 + limits.tol)

    if not io_ok(top - 1):
        if not io_ok(0):
            return 0
        lo, hi = 1, top - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if io_ok(mid):
                lo = mid + 1
            else:
                hi = mid
        return lo
    return top


def water_fill(capacity: float, demands: FloatArray) -> FloatArray:
    """base.water_fill over an array (the demands' order is the mapping's): the smallest
    demands, ties in order, are met while each is at most an equal split of what is
    left, subtracted one by one; the rest get that split."""
    if math.isinf(capacity):
        return demands.copy()
    n = len(demands)
    order = np.argsort(demands, kind="stable")
    values = demands[order]
    lefts = np.cumsum(np.concatenate(([capacity], -values)))
    over = np.flatnonzero(values > lefts[:n] / np.arange(n, 0, -1))
    if not len(over):
        return demands.copy()
    k = int(over[0])
    out = np.full(n, lefts[k] / (n - k))
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
