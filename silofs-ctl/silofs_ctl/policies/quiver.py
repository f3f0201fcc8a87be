"""Quiver baseline ("Quiver: An Informed Storage Cache for Deep Learning", FAST '20,
§5.3): whole datasets, greedy by benefit over cost.

Owns: Quiver's benefit-aware placement as SiloD compares against it. A job's benefit is
its speed-up from caching, t_miss / t_hit, measured by Quiver's probing; here it is the
ratio of its GPU-bound rate to the rate it gets reading remotely with a fair share of
the link. A dataset's benefit is the sum over its jobs of speed-up times GPUs; a job
whose speed-up is under 5% does not count (Quiver turns caching off for it). Datasets go
in descending benefit / size, each cached whole or not at all.
Never: caches part of a dataset. Quiver's co-operative "chunk" mode relies on
substitutable hits (a job reads whatever is cached), which silofs does not do.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from ..model import Allocation, Cluster, Job

log = logging.getLogger(__name__)

_NO_BENEFIT = 1.05


def speedup(job: Job, share: float, fair_io: float) -> float:
    """t_miss / t_hit with a fair share of remote IO."""
    rate = share * job.f_star
    if rate <= 0:
        return 1.0
    if fair_io <= 0:
        return math.inf
    return rate / min(rate, fair_io)


class QuiverCache:
    name = "quiver"
    reads: frozenset[str] = frozenset()  # benefit is of GPU shares, f* and a fair share of the link

    def fill_cache(self, jobs: Sequence[Job], cluster: Cluster, alloc: Allocation) -> None:
        running = [j for j in jobs if alloc.gpu_share.get(j.name, 0.0) > 0]
        fair = cluster.remote_io / len(running) if running else cluster.remote_io
        benefit: dict[str, float] = {}
        for job in running:
            gain = speedup(job, alloc.gpu_share[job.name], fair)
            if gain < _NO_BENEFIT:
                continue
            for key, weight in job.reads.items():
                benefit[key] = benefit.get(key, 0.0) + gain * job.gpus * weight
        left = dict(cluster.pools)
        cache: dict[str, float] = {}
        for key in sorted(benefit, key=lambda k: (-benefit[k] / cluster.units[k].size, k)):
            unit = cluster.units[key]
            if unit.size <= left[unit.pool]:
                cache[key] = unit.size
                left[unit.pool] -= unit.size
        alloc.cache = cache
