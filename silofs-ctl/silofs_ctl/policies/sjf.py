"""Multi-resource shortest-job-first (Eq. 6, and Eq. 7 in SiloD form).

Owns: the SJF score and the allocation it implies. A job's score is the least, over the
resources it could be given, of (sum_t R_t / total_t) * remaining bytes / perf; jobs run
in ascending score, each with all its GPUs, and a smaller job may use GPUs a larger one
cannot (backfill). Scores use the remaining work, so a newly arrived short job preempts.

The minimisation of Eq. 7 has a closed form. For a given cache, IO beyond the demand
f*(1 - c/d) only adds cost and less only slows the job by the same factor as it saves
IO cost, so b = f*(1 - c/d) and the job runs at f*. The score is then linear in each
cached fraction phi_u of a unit (weight w_u, size d_u, pool capacity C_p, shared by m_u
jobs, which split its cost: §6 charges a dataset's cache once):

    score = W / f* * ( g/G + sum_u phi_u d_u / (m_u C_p) + f* (1 - sum_u w_u phi_u) / B )

so each unit is cached as fully as its pool allows if d_u / (m_u C_p) < f* w_u / B (its
cache efficiency beats the cluster's ratio of IO to cache), and not at all otherwise.
Never: places jobs across time-shared GPUs (that is Gavel's model).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..estimator import Estimator, hit_ratio, unit_efficiency
from ..model import Allocation, Cluster, Job
from .base import (
    HITS,
    REMAINING,
    by_priority,
    current_hits,
    fill_units,
    place,
    spread_leftover_io,
)

log = logging.getLogger(__name__)


@dataclass
class Choice:
    """The score-minimising resources for one job (Eq. 7)."""

    score: float
    units: list[str]


def vanilla_score(job: Job, cluster: Cluster, total_gpus: int | None = None) -> float:
    """Eq. 6 with GPUs as the only resource and perf = f*. total_gpus: the cluster's,
    when the caller has it (summing the nodes per job is O(jobs x nodes))."""
    total = cluster.total_gpus if total_gpus is None else total_gpus
    return job.remaining / job.f_star * job.gpus / total


def silod_choice(
    job: Job, cluster: Cluster, readers: dict[str, int], total_gpus: int | None = None
) -> Choice:
    """Eq. 7 minimised in closed form (see the module docstring)."""
    b_total = cluster.remote_io
    cost = job.gpus / (cluster.total_gpus if total_gpus is None else total_gpus)
    miss = 1.0
    units = []
    for key, weight in job.reads.items():
        unit = cluster.units[key]
        pool = cluster.pools.get(unit.pool, 0.0)
        if pool <= 0 or math.isinf(b_total) or unit.size <= 0:
            continue
        phi = min(1.0, pool / unit.size)
        cache_cost = phi * unit.size / (readers[key] * pool)
        io_saved = job.f_star * weight * phi / b_total
        if cache_cost < io_saved:
            cost += cache_cost
            miss -= weight * phi
            units.append(key)
    if not math.isinf(b_total) and b_total > 0:
        cost += job.f_star * max(0.0, miss) / b_total
    elif b_total <= 0 and miss > 0:
        cost = math.inf  # no remote IO and not cached: it can never finish
    return Choice(job.remaining / job.f_star * cost, units)


class SjfPolicy:
    name = "sjf"

    def reads(self, estimator: Estimator) -> frozenset[str]:
        """Scores are of the remaining work; the SiloD form's IO is for the hits now."""
        return frozenset({REMAINING, HITS}) if estimator.io_aware else frozenset({REMAINING})

    def allocate(self, jobs: Sequence[Job], cluster: Cluster, estimator: Estimator) -> Allocation:
        total = cluster.total_gpus
        if estimator.io_aware:
            readers: dict[str, int] = {}
            for job in jobs:
                for key in job.reads:
                    readers[key] = readers.get(key, 0) + 1
            choices = {j.name: silod_choice(j, cluster, readers, total) for j in jobs}
            order = by_priority(jobs, lambda j: choices[j.name].score)
        else:
            # by_priority with vanilla_score, written out (one call per job, not three)
            order = sorted(
                jobs, key=lambda j: (j.remaining / j.f_star * j.gpus / total, j.submit, j.name)
            )
        alloc = Allocation(placement=place(order, cluster, strict=False))
        running = [j for j in order if j.name in alloc.placement]
        alloc.gpu_share = {j.name: 1.0 for j in running}
        if estimator.io_aware:
            self._storage(
                running, cluster, alloc, [u for j in running for u in choices[j.name].units]
            )
        return alloc

    def _storage(
        self, running: list[Job], cluster: Cluster, alloc: Allocation, wanted: list[str]
    ) -> None:
        """Cache the units the scores chose (most urgent job first), then fill what is
        left by cache efficiency; IO to each job's demand in score order."""
        cache = fill_units(dict.fromkeys(wanted), cluster)
        eff = unit_efficiency(running, cluster)
        alloc.cache = fill_units(sorted(eff, key=lambda k: (-eff[k], k)), cluster, cache)
        left = cluster.remote_io
        # IO for the hit ratios as they are now (delayed effectiveness, filling)
        hits = current_hits(running, cluster, alloc.cache) or {
            j.name: hit_ratio(j, alloc.cache, cluster) for j in running
        }
        for job in running:
            need = job.f_star * (1.0 - hits[job.name])
            alloc.io[job.name] = min(need, left)
            left -= alloc.io[job.name]
        spread_leftover_io(alloc, running, cluster, {j.name: j.f_star for j in running})
