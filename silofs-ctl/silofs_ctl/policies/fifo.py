"""First-in first-out: jobs start in submission order, each with all its GPUs.

Owns: the FIFO scheduler in both forms. Vanilla: GPUs only. SiloD form: FIFO has no
performance estimator, so SiloD pairs it with the greedy cache policy of Algorithm 2
(§5.3); remote IO stays unallocated (the link shares it max-min fairly).
Never: preempts a job or lets a later job overtake one that does not fit (no backfill).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..estimator import Estimator
from ..model import Allocation, Cluster, Job
from .base import by_priority, place
from .greedy import greedy_cache

log = logging.getLogger(__name__)


class FifoPolicy:
    name = "fifo"

    def reads(self, estimator: Estimator) -> frozenset[str]:
        """Neither form: the order is by submit time and Algorithm 2 ranks by f*/d."""
        return frozenset()

    def allocate(self, jobs: Sequence[Job], cluster: Cluster, estimator: Estimator) -> Allocation:
        order = by_priority(jobs, lambda j: j.submit)
        alloc = Allocation(placement=place(order, cluster, strict=True))
        running = [j for j in order if j.name in alloc.placement]
        alloc.gpu_share = {j.name: 1.0 for j in running}
        if estimator.io_aware:
            alloc.cache = greedy_cache(running, cluster)
        return alloc
