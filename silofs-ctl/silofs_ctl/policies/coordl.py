"""CoorDL baseline: each job caches its own copy of its data in its own nodes' disks.

Owns: the static per-job cache of CoorDL as SiloD describes it ("SiloD: A Co-design of
Caching and Scheduling for Deep Learning Clusters", EuroSys '23, §2.1, §8): uniform caching,
but a job's cache is fixed by where it runs, the share of a node's disk that goes with
the GPUs it holds there, and is never shared with another job, even on the same dataset.
Never: moves cache between jobs according to benefit; that is what it lacks.

The simulator gives every job a private cache unit ("job:NAME") when this baseline runs.
A job time-shared by Gavel has no placement: the time-shared jobs divide the disks (what
placed jobs leave) in proportion to the GPUs they request, each at most its GPUs' slice,
so that together they never hold more than the disks do.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..model import Allocation, Cluster, Job

log = logging.getLogger(__name__)


def static_share(job: Job, cluster: Cluster, placement: dict[str, int] | None) -> float:
    """Bytes of disk that come with the job's GPUs."""
    if placement:
        return sum(
            cluster.node_cache[node] * n / cluster.node_gpus[node]
            for node, n in placement.items()
            if cluster.node_gpus[node] > 0
        )
    total = cluster.total_gpus
    return cluster.total_cache * job.gpus / total if total > 0 else 0.0


class CoordlCache:
    name = "coordl"
    reads: frozenset[str] = frozenset()  # a job's cache follows its GPUs and placement

    def fill_cache(self, jobs: Sequence[Job], cluster: Cluster, alloc: Allocation) -> None:
        gpu_share, placements = alloc.gpu_share, alloc.placement
        node_cache, node_gpus = cluster.node_cache, cluster.node_gpus
        # The jobs with GPUs in order, and each one's disk (None: time-shared, running
        # without a placement, whose slices follow from what the placed ones take).
        running: list[Job] = []
        shares: list[float | None] = []
        shared: list[Job] = []
        placed_total = 0.0
        for job in jobs:
            if gpu_share.get(job.name, 0.0) <= 0:
                continue
            placement = placements.get(job.name)
            if not placement:
                shared.append(job)
                share = None
            elif len(placement) == 1:
                # static_share of a job on one node (its sum of one term, 0.0 + x, is x)
                [(node, n)] = placement.items()
                gpus = node_gpus[node]
                share = node_cache[node] * n / gpus if gpus > 0 else 0.0
                placed_total += share
            else:
                share = static_share(job, cluster, placement)
                placed_total += share
            running.append(job)
            shares.append(share)
        slices = iter(time_shared_slices(shared, cluster, placed_total))
        cache: dict[str, float] = {}
        units = cluster.units
        for job, share in zip(running, shares, strict=True):
            if share is None:
                share = next(slices, None)
                if share is None:  # (no GPUs in the cluster: no slices)
                    continue
            for key, weight in job.reads.items():
                size = units[key].size
                held = cache.get(key, 0.0) + share * weight
                cache[key] = held if held < size else size  # min(size, held)
        alloc.cache = cache


def time_shared_slices(jobs: Sequence[Job], cluster: Cluster, placed: float = 0.0) -> list[float]:
    """Each time-shared job's disk, in order: its GPUs' slice of all disks, unless the
    jobs together request more GPUs than the cluster has; then what placed jobs leave
    (`placed` bytes taken) is divided in proportion to the GPUs each requests. (A
    time-shared job runs a fraction of the time on its GPUs, but a static cache cannot
    follow that fraction.) Empty when the cluster has no GPUs."""
    total_gpus, total_cache = cluster.total_gpus, cluster.total_cache
    if total_gpus <= 0 or not jobs:
        return []
    gpus = [job.gpus for job in jobs]
    asked = sum(gpus)
    left = max(0.0, total_cache - placed)
    # (one slice per GPU count: the jobs asking as many GPUs get the same bytes)
    if total_cache * asked / total_gpus > left:
        slice_of = {g: left * g / asked for g in set(gpus)}
    else:
        slice_of = {g: total_cache * g / total_gpus for g in set(gpus)}
    return list(map(slice_of.__getitem__, gpus))
