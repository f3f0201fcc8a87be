"""What the controller sees: node statuses parsed, and rates measured from their counters.

Owns: the fields the controller reads from GET /v1/status (docs/CONTROLLER.md), the
per-node view of datasets, jobs, job registrations (a Slurm prolog's) and the cluster
the node is a member of (its name, weights and cache shares), and
RateTracker (a job's throughput and hit ratio over a poll window, and its best
unthrottled rate, its f* when none is given).
Never: talks to a node (the loop fetches statuses and hands them here), plans or pushes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

# A job's measured rate counts as its f* only over a window at least this long.
MIN_MEASURE_S = 5.0
# ... and only while its IO allocation did not hold it back: null, or its remote fetches
# under this fraction of it (a token bucket lets a job that needs more reach its rate,
# so one well under it is limited by its GPUs or its own pipeline, not by IO).
UNLIMITED_BELOW = 0.8


@dataclass
class DatasetSeen:
    uri: str
    name: str
    size: float
    cached: float
    allocation: float | None


@dataclass
class JobSeen:
    """A job as one node reports it; rates per node, None when not measured yet."""

    name: str
    dataset: str
    allocation: float | None
    bytes_read: float
    hit_bytes: float
    throughput: float | None = None
    remote_rate: float | None = None  # remote bytes/s fetched lately
    hit_now: float | None = None  # measured over the last poll window
    effective_cache: float | None = None  # cached bytes that can serve this epoch


@dataclass
class Registration:
    """What a cluster scheduler's prolog told one node of a job (PUT /v1/jobs/{job})."""

    name: str
    gpus: int
    datasets: tuple[str, ...]
    ideal_io: float | None = None
    epochs: float | None = None
    scheduler_id: str | None = None


@dataclass
class ClusterSeen:
    """The cluster a node is a member of, as that node reports it (status "cluster").

    A member holds `weight / total_weight` of every dataset's cluster-wide share (its
    part); `shares` is the cluster-wide table it holds (URI -> bytes, None: the dataset
    is back in the shared pool), at `version`; `cached` the bytes of each dataset this
    node holds, datasets it only holds for other members included."""

    name: str
    address: str
    version: int
    weight: float
    total_weight: float
    members: tuple[str, ...] = ()  # every configured member's address
    shares: dict[str, int | None] = field(default_factory=dict)
    cached: dict[str, float] = field(default_factory=dict)

    @property
    def scale(self) -> float:
        """The cluster's caches over this member's part of them (1 / its fraction)."""
        return self.total_weight / self.weight if self.weight > 0 else 1.0


@dataclass
class NodeSeen:
    name: str
    cache_size: float | None
    datasets: dict[str, DatasetSeen]
    jobs: dict[str, JobSeen]
    registrations: dict[str, Registration] = field(default_factory=dict)
    cluster: ClusterSeen | None = None  # None: the node caches alone


def parse_status(node: str, status: Mapping[str, Any]) -> NodeSeen:
    """The fields the controller uses from GET /v1/status (docs/CONTROLLER.md)."""
    info = status.get("node") or {}
    datasets = {}
    for d in status.get("datasets") or []:
        uri = str(d.get("uri") or d.get("name"))
        datasets[uri] = DatasetSeen(
            uri=uri,
            name=str(d.get("name") or uri),
            size=float(d.get("size") or 0),
            cached=float(d.get("cached_bytes") or 0),
            allocation=_opt_float(d.get("cache_allocation")),
        )
    jobs = {}
    registrations = {}
    for j in status.get("jobs") or []:
        reg = _registration(j)
        if reg is not None:
            registrations[reg.name] = reg
        names = j.get("datasets") or ([j["dataset"]] if j.get("dataset") else [])
        if not names:
            continue  # a job with no mount yet reads nothing
        read = float(j.get("bytes_read") or 0)
        jobs[str(j["name"])] = JobSeen(
            name=str(j["name"]),
            dataset=str(names[0]),
            allocation=_opt_float(j.get("io_allocation")),
            bytes_read=read,
            hit_bytes=float(j.get("hit_ratio") or 0) * read,
            throughput=_opt_float(j.get("throughput")),
            remote_rate=_opt_float(j.get("remote_bytes_per_s")),
            effective_cache=_opt_float(j.get("effective_cache")),
        )
    return NodeSeen(
        node,
        _opt_float(info.get("cache_size")),
        datasets,
        jobs,
        registrations,
        _cluster(status.get("cluster")),
    )


def _cluster(view: Any) -> ClusterSeen | None:
    """The node's cluster view, or None (it stands alone, or a view we cannot use: then
    the node is planned as standing alone)."""
    if not isinstance(view, Mapping) or not view.get("name"):
        return None
    members = [m for m in view.get("members") or [] if isinstance(m, Mapping)]
    weights = [float(m.get("weight") or 0.0) for m in members]
    mine = [float(m.get("weight") or 0.0) for m in members if m.get("self")]
    if not mine or mine[0] <= 0 or sum(weights) <= 0:
        return None
    raw = view.get("shares") if isinstance(view.get("shares"), Mapping) else {}
    shares = {str(k): None if v is None else int(v) for k, v in raw.items()}
    cached = {
        str(d["uri"]): float(d.get("cached_bytes") or 0)
        for d in view.get("datasets") or []
        if isinstance(d, Mapping) and d.get("uri")
    }
    return ClusterSeen(
        name=str(view["name"]),
        address=str(view.get("address") or ""),
        version=int(view.get("allocations_version") or 0),
        weight=mine[0],
        total_weight=sum(weights),
        members=tuple(str(m.get("address") or "") for m in members),
        shares=shares,
        cached=cached,
    )


def _registration(job: Mapping[str, Any]) -> Registration | None:
    """A job's registration from status, or None (none, or not one we can use)."""
    reg = job.get("registration")
    if not isinstance(reg, Mapping):
        return None
    datasets = tuple(str(d) for d in reg.get("datasets") or [] if d)
    gpus = reg.get("gpus")
    if not datasets or not isinstance(gpus, int) or isinstance(gpus, bool):
        return None
    return Registration(
        name=str(job["name"]),
        gpus=gpus,
        datasets=datasets,
        ideal_io=_opt_float(reg.get("ideal_io")),
        epochs=_opt_float(reg.get("epochs")),
        scheduler_id=str(reg["scheduler_id"]) if reg.get("scheduler_id") else None,
    )


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass
class RateTracker:
    """Rates from successive counters, and each job's best throughput while its IO
    allocation did not limit it (on every node it runs on): its f* when none is given.

    Status may give "throughput" directly; otherwise it is the change in bytes_read over
    the window since the previous sample (at least MIN_MEASURE_S long). hit_now is the
    hit ratio of the bytes read in that window: the per-job effective hit ratio.
    """

    samples: dict[tuple[str, str], tuple[float, float, float]] = field(default_factory=dict)
    ideal: dict[str, float] = field(default_factory=dict)

    def update(self, seen: Mapping[str, NodeSeen], now: float) -> None:
        totals: dict[str, float] = {}
        unthrottled: dict[str, bool] = {}
        for node in seen.values():
            for job in node.jobs.values():
                self._measure(node.name, job, now)
                if job.throughput is not None:
                    totals[job.name] = totals.get(job.name, 0.0) + job.throughput
                free = _not_limited(job)
                unthrottled[job.name] = unthrottled.get(job.name, True) and free
        for name, rate in totals.items():
            if unthrottled.get(name) and rate > 0:
                self.ideal[name] = max(self.ideal.get(name, 0.0), rate)

    def _measure(self, node: str, job: JobSeen, now: float) -> None:
        key = (node, job.name)
        before = self.samples.get(key)
        if before is None or job.bytes_read < before[1]:  # first sample, or counters reset
            self.samples[key] = (now, job.bytes_read, job.hit_bytes)
            return
        elapsed = now - before[0]
        if elapsed < MIN_MEASURE_S:
            return
        read = job.bytes_read - before[1]
        if job.throughput is None:
            job.throughput = read / elapsed
        if read > 0:
            job.hit_now = min(1.0, max(0.0, (job.hit_bytes - before[2]) / read))
            if job.remote_rate is None:
                job.remote_rate = (read - (job.hit_bytes - before[2])) / elapsed
        self.samples[key] = (now, job.bytes_read, job.hit_bytes)


def _not_limited(job: JobSeen) -> bool:
    """Is the job's throughput its own (no IO allocation, or fetching well under it)?"""
    if job.allocation is None:
        return True
    remote = job.remote_rate
    if remote is None and job.throughput is not None:
        # every byte read may have been fetched: an upper bound on its remote rate
        hit = job.hit_now or 0.0
        remote = job.throughput * (1.0 - hit)
    return remote is not None and remote < UNLIMITED_BELOW * job.allocation
