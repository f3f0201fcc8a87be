"""Alluxio baseline: one LRU cache shared by every job, with no allocations at all.

Owns: only the marker that the cache is a single LRU pool; what LRU does under
random-once-per-epoch access (it thrashes) is modelled by the simulator (simulator.py,
sim_lru.py, docs/CONTROLLER.md). Never: allocates cache or IO.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..model import Allocation, Cluster, Job

log = logging.getLogger(__name__)


class AlluxioCache:
    name = "alluxio"
    reads: frozenset[str] = frozenset()  # it allocates nothing

    def fill_cache(self, jobs: Sequence[Job], cluster: Cluster, alloc: Allocation) -> None:
        alloc.cache = {}
        alloc.lru = True
