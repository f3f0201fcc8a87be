"""Algorithm 2 of SiloD (EuroSys '23, §5.3): greedy cache allocation by cache efficiency.

Owns: the cache policy SiloD offers schedulers that have no performance estimator (FIFO).
Datasets are ranked by dataset-level cache efficiency, the sum of f*/d over the jobs
reading them (§6), and cached whole, most efficient first, until the cache is full; the
last one admitted may get only part of its size (line 4: min(size, totalCache)).
Never: touches GPUs or remote IO; those stay with the scheduler and the link.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..estimator import Estimator, unit_efficiency
from ..model import Allocation, Cluster, Job
from .base import fill_units

log = logging.getLogger(__name__)


def greedy_cache(jobs: Sequence[Job], cluster: Cluster) -> dict[str, float]:
    """Cache bytes per unit: most cache-efficient units first, each up to its size."""
    eff = unit_efficiency(jobs, cluster)
    order = sorted(eff, key=lambda key: (-eff[key], key))
    return fill_units(order, cluster)


class GreedyPolicy:
    """Algorithm 2 on its own: every given job runs as placed; only cache is decided.

    For a live cluster whose scheduler is not ours: the controller learns which jobs run
    and where, and this policy only divides the cache. Remote IO is left unallocated.
    """

    name = "greedy"

    def reads(self, estimator: Estimator) -> frozenset[str]:
        """Nothing that moves: placements are given, the cache is ranked by f*/d."""
        return frozenset()

    def allocate(self, jobs: Sequence[Job], cluster: Cluster, estimator: Estimator) -> Allocation:
        alloc = Allocation()
        for job in jobs:
            alloc.gpu_share[job.name] = 1.0
            if job.placement:
                alloc.placement[job.name] = dict(job.placement)
        alloc.cache = greedy_cache(jobs, cluster)
        return alloc
