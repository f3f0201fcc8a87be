"""The one interface every policy implements, and the small tools they share.

Owns: the Policy and CachePolicy protocols, gang placement of jobs on nodes, max-min fair
division of a capacity (water-filling), handing out left-over remote IO, and the uniform
per-pool fill of cache units in a priority order. Never: reads scenarios, simulates time,
or talks to daemons.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from heapq import heapify, heappop
from itertools import accumulate, compress, count
from operator import gt, itemgetter, sub, truediv
from typing import Protocol

from ..estimator import Estimator, hit_ratio
from ..model import Allocation, Cluster, Job

log = logging.getLogger(__name__)


# What a plan may read that moves while the set of jobs stays the same (Policy.reads).
# Everything else a policy sees is fixed for a job's life (name, dataset, GPUs, f*, the
# units it reads, submit time), fixed for the cluster (nodes, pools, units, the link), or
# its own last output (a running job's placement, which the same inputs reproduce:
# running jobs keep their nodes, so placing the same jobs in the same order again gives
# the same spots). A caller that re-plans the same jobs when none of a policy's reads
# moved may keep the last allocation instead of running it again: same inputs, same plan.
REMAINING = "remaining"  # Job.remaining: bytes left (SJF's scores)
HITS = "hits"  # Job.hit_now and Cluster.cached: the cache as it is now, not as allocated
PLAN_INPUTS = frozenset({REMAINING, HITS})


class Policy(Protocol):
    """(jobs, cluster, estimator) -> allocation of GPUs, cache per unit, IO per job.

    With a ComputeEstimator a policy runs in its vanilla form: it decides GPUs only and
    leaves cache and remote IO alone. With a SiloDEstimator it decides all three.
    `reads(estimator)` names which of PLAN_INPUTS the allocation depends on in that form
    (tests/unit/test_ctl_policies.py checks each claim by moving the others).
    """

    name: str

    def allocate(
        self, jobs: Sequence[Job], cluster: Cluster, estimator: Estimator
    ) -> Allocation: ...

    def reads(self, estimator: Estimator) -> frozenset[str]: ...


class CachePolicy(Protocol):
    """A cache system that is not co-designed with the scheduler (the baselines).

    It sees which jobs the scheduler runs and fills in `alloc.cache` (or sets lru).
    `reads` names which of PLAN_INPUTS it depends on besides the scheduler's output.
    """

    name: str
    reads: frozenset[str]

    def fill_cache(self, jobs: Sequence[Job], cluster: Cluster, alloc: Allocation) -> None: ...


def current_hits(
    jobs: Sequence[Job], cluster: Cluster, cache: Mapping[str, float]
) -> dict[str, float] | None:
    """Each job's hit ratio now, or None when nothing says the present differs from the
    plan (no fill level, no per-job measurement): then plan with the allocation."""
    if cluster.cached is None and all(j.hit_now is None for j in jobs):
        return None
    filled = cluster.effective(cache)
    return {
        j.name: j.hit_now if j.hit_now is not None else hit_ratio(j, filled, cluster) for j in jobs
    }


def water_fill(capacity: float, demands: Mapping[str, float]) -> dict[str, float]:
    """Max-min fair division of `capacity` among `demands` (each gets at most its demand).

    water_fill_capped's division, to the bit, without sorting every demand: the
    smallest are taken from a heap (ties in the demands' order, as the stable sort
    does) only while each is met, what is left is subtracted one by one in the same
    order, and every demand after them gets the same split of it. A plan's leftover
    GPUs meet a few dozen of a thousand jobs' room: the rest is never ordered."""
    if math.isinf(capacity):
        return dict(demands)
    n = len(demands)
    heap = list(zip(demands.values(), count()))
    heapify(heap)
    met: list[int] = []
    left = capacity
    while heap:
        value = heap[0][0]
        if value > left / (n - len(met)):
            break
        met.append(heappop(heap)[1])
        left -= value
    if len(met) == n:
        return dict(demands)
    out = dict.fromkeys(demands, left / (n - len(met)))
    names = list(map(list(demands).__getitem__, met))
    out.update(zip(names, map(demands.__getitem__, names), strict=True))
    return out


def water_fill_capped(
    capacity: float, demands: Mapping[str, float]
) -> tuple[dict[str, float], list[str], float | None]:
    """water_fill, the names held below their demand, and the fair level they all get
    (None: nobody is held). Every other name gets exactly its demand, which lets a
    caller that re-divides after a few demands moved look only at the capped ones.

    Smallest demand first, each gets its demand while it is at most an equal split of
    what is left (capacity minus the smaller demands, subtracted one by one); the first
    that is not, and every larger one, get that split. The loop is in C (accumulate,
    map): the simulator divides the link this way at most of its steps."""
    out = dict.fromkeys(demands, 0.0)
    pending = sorted(demands.items(), key=itemgetter(1))
    n = len(pending)
    if math.isinf(capacity):
        out.update(pending)
        return out, [], None
    values = list(map(itemgetter(1), pending))
    # lefts[i]: what is left for pending[i:] once every smaller demand is met
    lefts = list(accumulate(values, sub, initial=capacity))
    first = next(compress(count(), map(gt, values, map(truediv, lefts, range(n, 0, -1)))), n)
    out.update(pending[:first])
    if first == n:
        return out, [], None
    fair = lefts[first] / (n - first)
    capped = list(map(itemgetter(0), pending[first:]))
    out.update(dict.fromkeys(capped, fair))
    return out, capped, fair


def spread_leftover_io(
    alloc: Allocation, jobs: Sequence[Job], cluster: Cluster, ceiling: Mapping[str, float]
) -> None:
    """Give remote IO no job was allocated to the allocated jobs, max-min fairly, each up
    to `ceiling` (its GPU-bound rate: the most it could ever fetch).

    Steady state does not need it (allocations already cover the demand at the planned
    hit ratio), but a cache that is still filling, or whose new items are not effective
    until the next epoch, hits less than planned; spare link capacity then shortens that.
    """
    if math.isinf(cluster.remote_io):
        for job in jobs:
            if job.name in alloc.io:
                alloc.io[job.name] = math.inf
        return
    spare = max(0.0, cluster.remote_io - sum(alloc.io.values()))
    if spare == 0.0:
        # The link is all allocated (as it is whenever IO binds the plan): every job's
        # share of nothing is 0.0, and an allocation (>= 0) plus 0.0 is itself.
        return
    room = {
        j.name: max(0.0, ceiling[j.name] - alloc.io[j.name]) for j in jobs if j.name in alloc.io
    }
    extra = water_fill(spare, room)
    for name, add in extra.items():
        alloc.io[name] += add


def fill_units(
    order: Iterable[str], cluster: Cluster, already: Mapping[str, float] | None = None
) -> dict[str, float]:
    """Fill cache units in `order`, each up to its dataset size, from its own pool."""
    cache = dict(already or {})
    left = dict(cluster.pools)
    for key, held in cache.items():
        left[cluster.units[key].pool] -= held
    for key in order:
        unit = cluster.units[key]
        take = min(unit.size - cache.get(key, 0.0), left[unit.pool])
        if take > 0:
            cache[key] = cache.get(key, 0.0) + take
            left[unit.pool] -= take
    return cache


def place(jobs: Sequence[Job], cluster: Cluster, *, strict: bool) -> dict[str, dict[str, int]]:
    """Gang placement in the given order: a job gets all its GPUs or none.

    A running job keeps the nodes it has (moving it would throw away node-local state).
    Others go best-fit on one node, else spread over the emptiest nodes. With strict
    (FIFO), the first job that does not fit blocks every later one; otherwise later,
    smaller jobs may fill the gap (backfilling).
    """
    free = dict(cluster.node_gpus)
    left = sum(free.values())  # _fit finds nothing for more GPUs than this: skip it
    out: dict[str, dict[str, int]] = {}
    for job in jobs:
        spot = (_keep(job, free) if job.placement else None) or (
            _fit(job.gpus, free) if job.gpus <= left else None
        )
        if spot is None:
            if strict:
                break
            continue
        for node, n in spot.items():
            free[node] -= n
            left -= n
        out[job.name] = spot
    return out


def _keep(job: Job, free: Mapping[str, int]) -> dict[str, int] | None:
    if not job.placement:
        return None
    if all(free.get(node, 0) >= n for node, n in job.placement.items()):
        return dict(job.placement)
    return None


def _fit(gpus: int, free: Mapping[str, int]) -> dict[str, int] | None:
    single = [node for node, n in free.items() if n >= gpus]
    if single:
        best = min(single, key=lambda node: free[node])
        return {best: gpus}
    if sum(free.values()) < gpus:
        return None
    spot: dict[str, int] = {}
    need = gpus
    for node in sorted(free, key=lambda node: -free[node]):
        take = min(need, free[node])
        if take > 0:
            spot[node] = take
            need -= take
        if need == 0:
            break
    return spot


def by_priority(jobs: Sequence[Job], key: Callable[[Job], float]) -> list[Job]:
    """Jobs sorted by `key`, ties broken by submit time then name (deterministic)."""
    return sorted(jobs, key=lambda j: (key(j), j.submit, j.name))
