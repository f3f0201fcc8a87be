"""The performance estimator of SiloD (EuroSys '23) §4, Eq. 1-5, and the equal share (Eq. 8-9).

Owns: the closed-form throughput of a job given its GPU share, the cache of the units it
reads and its remote IO; cache efficiency f*/d at job and at dataset level (§6, "Dataset
sharing": a dataset's cache is charged once and helps every job reading it); and the
equal division of a cluster that Gavel's max-min fairness normalises by.
Never: allocates resources or talks to daemons.

Two estimators share one interface so one policy module can run in both forms:
SiloDEstimator (cache- and IO-aware, Eq. 4) and ComputeEstimator (the vanilla baselines'
perf(j, R), which only sees GPUs).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Protocol

from .model import Cluster, Job

log = logging.getLogger(__name__)


def silod_perf(f_star: float, io: float, hit: float) -> float:
    """Eq. 4 with hit ratio c/d: min(f*, b / (1 - c/d)); a fully cached job needs no IO."""
    miss = 1.0 - hit
    if miss <= 0.0:
        return f_star
    if math.isinf(io):
        return f_star
    return min(f_star, io / miss)


def remote_demand(rate: float, hit: float) -> float:
    """Eq. 2: remote bytes/s a job reading at `rate` needs with hit ratio `hit`."""
    return rate * max(0.0, 1.0 - hit)


def cache_efficiency(job: Job, cluster: Cluster) -> float:
    """Eq. 5: remote bytes/s saved per cached byte at ideal speed, f*/d."""
    size = _dataset_size(job, cluster)
    return job.f_star / size if size > 0 else math.inf


def unit_efficiency(jobs: Sequence[Job], cluster: Cluster) -> dict[str, float]:
    """Cache efficiency per unit: the sum over the jobs reading it (§6, dataset sharing)."""
    eff: dict[str, float] = {}
    for job in jobs:
        for key, weight in job.reads.items():
            size = cluster.units[key].size
            gain = job.f_star * weight / size if size > 0 else math.inf
            eff[key] = eff.get(key, 0.0) + gain
    return eff


def hit_ratio(job: Job, cache: Mapping[str, float], cluster: Cluster) -> float:
    """Expected hit ratio under uniform caching: the read-weighted c/d of the job's units."""
    hit = 0.0
    for key, weight in job.reads.items():
        size = cluster.units[key].size
        held = cache.get(key, 0.0)
        hit += weight * (1.0 if size <= 0 else min(1.0, held / size))
    return min(1.0, hit)


def _dataset_size(job: Job, cluster: Cluster) -> float:
    key = next(iter(job.reads))
    return cluster.units[key].size


class Estimator(Protocol):
    """perf(j, R) of Algorithm 1: bytes/s of job j given its share of every resource."""

    io_aware: bool

    def perf(
        self, job: Job, share: float, cache: Mapping[str, float], io: float, cluster: Cluster
    ) -> float: ...


class SiloDEstimator:
    """SiloDPerf (Eq. 4): the GPU-bound rate share*f*, capped by what IO and cache feed."""

    io_aware = True

    def perf(
        self, job: Job, share: float, cache: Mapping[str, float], io: float, cluster: Cluster
    ) -> float:
        return silod_perf(share * job.f_star, io, hit_ratio(job, cache, cluster))


class ComputeEstimator:
    """The vanilla schedulers' perf(j, R): it sees GPUs only, so IO never limits a job."""

    io_aware = False

    def perf(
        self, job: Job, share: float, cache: Mapping[str, float], io: float, cluster: Cluster
    ) -> float:
        return share * job.f_star


@dataclass
class EqualShare:
    """R^equal of Eq. 8: every job gets 1/n of the GPUs, of the remote IO and of the cache
    of each pool it reads from; a unit holds the shares of all jobs reading it (capped at
    the dataset), so jobs sharing a dataset pool their shares."""

    gpu_share: dict[str, float]
    cache: dict[str, float]
    io: float


def equal_share(jobs: Sequence[Job], cluster: Cluster) -> EqualShare:
    n = len(jobs)
    if n == 0:
        return EqualShare({}, {}, cluster.remote_io)
    gpus = cluster.total_gpus / n
    shares = {j.name: min(1.0, gpus / j.gpus) if j.gpus > 0 else 1.0 for j in jobs}
    return EqualShare(shares, _equal_cache(jobs, cluster), cluster.remote_io / n)


def _equal_cache(jobs: Sequence[Job], cluster: Cluster) -> dict[str, float]:
    """EqualShare.cache for `jobs`: each reader of a unit adds its pool's per-reader
    share, up to the dataset. The additions to one unit are all the same amount, so
    only how many readers each unit has matters (counted in C; the additions are still
    made one by one, in the same float steps)."""
    units = cluster.units
    reads = [job.reads for job in jobs]
    counts = Counter(chain.from_iterable(reads))  # readers per unit, in first-read order
    readers: dict[str, int] = {}
    if set(map(len, reads)) == {1}:  # the usual case: a job reads one unit
        for key, m in counts.items():
            pool = units[key].pool
            readers[pool] = readers.get(pool, 0) + m
    else:
        for job_reads in reads:
            for pool in {units[k].pool for k in job_reads}:
                readers[pool] = readers.get(pool, 0) + 1
    per_reader = {pool: cluster.pools.get(pool, 0.0) / m for pool, m in readers.items()}
    cache: dict[str, float] = {}
    for key, m in counts.items():
        unit = units[key]
        size, add = unit.size, per_reader[unit.pool]
        held = 0.0
        for _ in range(m):
            held += add
            if not held < size:  # min(size, held), which then stays at size
                held = size
                break
        cache[key] = held
    return cache


def equal_share_perf(
    jobs: Sequence[Job], cluster: Cluster, estimator: Estimator
) -> dict[str, float]:
    """perf(j, R^equal) per job: the denominators of Eq. 8 (vanilla) and Eq. 9 (SiloD).

    When the equal share gives a job nothing (no remote IO at all and its data not
    cached), fall back to its compute-only rate so the ratio stays defined.
    """
    if type(estimator) is ComputeEstimator:
        # perf is share * f* alone: the equal cache and IO are not needed
        n = len(jobs)
        gpus = cluster.total_gpus / n if n else 0.0
        return {j.name: (min(1.0, gpus / j.gpus) if j.gpus > 0 else 1.0) * j.f_star for j in jobs}
    out: dict[str, float] = {}
    if type(estimator) is SiloDEstimator and jobs:
        # equal_share and SiloDEstimator.perf inlined, with each unit's c/d found once:
        # the same arithmetic as silod_perf(share * f*, io, hit_ratio(...)) per job
        n = len(jobs)
        gpus = cluster.total_gpus / n
        units, cache, io = cluster.units, _equal_cache(jobs, cluster), cluster.remote_io / n
        io_inf = math.isinf(io)
        held: dict[str, float] = {}  # per unit: min(1, c/d), or 1 for an empty dataset
        for job in jobs:
            share = 1.0
            if job.gpus > 0:
                share = gpus / job.gpus
                if not share < 1.0:  # min(1, gpus / job.gpus)
                    share = 1.0
            hit = 0.0
            for key, weight in job.reads.items():
                part = held.get(key)
                if part is None:
                    size = units[key].size
                    part = held[key] = 1.0 if size <= 0 else min(1.0, cache.get(key, 0.0) / size)
                hit += weight * part
            miss = 1.0 - min(1.0, hit)
            value = f = share * job.f_star
            if not miss <= 0.0 and not io_inf:
                value = min(f, io / miss)
            out[job.name] = value if value > 0 else share * job.f_star
        return out
    eq = equal_share(jobs, cluster)
    for job in jobs:
        share = eq.gpu_share[job.name]
        value = estimator.perf(job, share, eq.cache, eq.io, cluster)
        out[job.name] = value if value > 0 else share * job.f_star
    return out
