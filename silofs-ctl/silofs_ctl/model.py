"""The vocabulary every policy speaks: jobs, cache units, the cluster, an allocation.

Owns plain data types only. Units are bytes and bytes per second, as floats (rates and
fluid shares are not integral). Never computes an allocation and never does I/O.

A *cache unit* is one independently allocated piece of cache: a dataset in the pooled
cluster cache of the simulator, a (node, dataset) pair on a live cluster whose nodes keep
separate caches, or one job's private cache (the CoorDL baseline). Each unit draws from
one *pool* (a cache capacity). A job names the units its reads go through and what
fraction of its reads each serves (a job spread evenly over two nodes reads half through
each node's unit); the fractions sum to 1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

# The name of the single pool of a pooled cluster cache.
POOL = "cluster"

# The frozen records below have slots: the simulator makes and reads them for every job
# at every re-plan (views, units), and slot access is the cheaper one.


@dataclass(frozen=True, slots=True)
class CacheUnit:
    """A dataset's cache in one pool; `size` is the dataset's size d in bytes."""

    key: str
    pool: str
    dataset: str
    size: float


@dataclass(frozen=True, slots=True)
class Job:
    """What a policy knows about one job.

    f_star is the job's data rate (bytes/s) with its requested GPUs when IO is not the
    bottleneck (perf in Algorithm 1, converted to bytes/s as the paper does).
    """

    name: str
    dataset: str
    gpus: int
    f_star: float
    reads: Mapping[str, float]
    remaining: float = math.inf
    submit: float = 0.0
    # Where the job runs now, node -> GPUs (None: not placed, or placement not modelled).
    placement: Mapping[str, int] | None = None
    # Fraction of its reads that hit the cache right now. Not c/d: items cached during
    # this epoch help only from the next (§6 "Delayed effectiveness"), which the
    # data manager sees per job. None: take the cache as filled (Cluster.cached).
    hit_now: float | None = None


@dataclass(frozen=True, slots=True)
class Cluster:
    """Resources the policies divide. remote_io may be math.inf (no egress limit)."""

    node_gpus: Mapping[str, int]
    node_cache: Mapping[str, float]
    remote_io: float
    pools: Mapping[str, float]
    units: Mapping[str, CacheUnit]
    # Bytes cached now per unit (None: assume allocations take effect at once). A cache
    # only fills from its readers' remote fetches, so IO must be planned with what is
    # there now, not with the allocation: a job whose data is allocated but not yet
    # cached and which gets no IO would never fill it.
    cached: Mapping[str, float] | None = None

    def effective(self, cache: Mapping[str, float]) -> dict[str, float]:
        """The part of an allocation that is filled already."""
        if self.cached is None:
            return dict(cache)
        return {k: min(v, self.cached.get(k, 0.0)) for k, v in cache.items()}

    @classmethod
    def pooled(
        cls,
        node_gpus: Mapping[str, int],
        node_cache: Mapping[str, float],
        remote_io: float,
        datasets: Mapping[str, float],
    ) -> Cluster:
        """One cluster-wide cache pool (the paper's distributed cache); a unit per dataset,
        keyed by the dataset's name."""
        units = {name: CacheUnit(name, POOL, name, size) for name, size in datasets.items()}
        pools = {POOL: float(sum(node_cache.values()))}
        return cls(dict(node_gpus), dict(node_cache), remote_io, pools, units)

    @property
    def total_gpus(self) -> int:
        return sum(self.node_gpus.values())

    @property
    def total_cache(self) -> float:
        return sum(self.pools.values())


@dataclass
class Allocation:
    """A policy's decision.

    gpu_share: fraction (0..1) of its requested GPUs each job gets; a time share for Gavel,
    0 or 1 for the gang-scheduled FIFO and SJF. A missing job gets 0.
    cache: bytes per cache unit; a missing unit gets 0.
    io: remote bytes/s per job. A job missing from io is not throttled by the policy and
    shares what the allocated jobs leave of the link max-min fairly with the others.
    lru: the cache is one LRU pool, not allocations (the Alluxio baseline).
    """

    gpu_share: dict[str, float] = field(default_factory=dict)
    placement: dict[str, dict[str, int]] = field(default_factory=dict)
    cache: dict[str, float] = field(default_factory=dict)
    io: dict[str, float] = field(default_factory=dict)
    lru: bool = False

    def running(self) -> list[str]:
        return [name for name, share in self.gpu_share.items() if share > 0]
