"""Planning: the cluster as observed -> a policy's problem -> what to push to each node.

Owns: building the policy's jobs and per-node cache units from the jobs file and the
node statuses, running the policy with SiloD's estimator, and turning its Allocation
into per-node cache bytes and per-node job IO (a distributed job's IO split evenly over
its nodes); and the order of a cluster scheduler's queue by SJF-SiloD's score (Eq. 7),
which the controller may feed back to it as priority. Never: talks to a node or to the
scheduler, keeps state between rounds, or schedules GPUs (jobs and their placement are
facts here).

A node that caches alone makes a cache unit per (node, dataset), drawing from that
node's budget. Nodes that report the same cluster (status "cluster": one cache across
its members) make one unit per (cluster, dataset), drawing from the cluster's pool: a
dataset read on k of its nodes is cached once, not k times, and its hit ratio is c/d
with c cluster-wide. A job on several nodes reads an equal share through each node's
unit (the same unit for nodes of one cluster); its IO allocation is split evenly across
its nodes (SiloD, EuroSys '23, §6). A cluster's cache is pushed as each dataset's
cluster-wide share, to one member, which passes the table on to the others.
"""

from __future__ import annotations

import logging
import math
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from urllib.parse import unquote

from .controller_config import POLICIES, ControllerConfig, JobEntry, NodeConfig
from .estimator import SiloDEstimator, hit_ratio
from .model import Allocation, CacheUnit, Cluster, Job
from .observe import ClusterSeen, JobSeen, NodeSeen
from .policies.base import current_hits, water_fill
from .policies.sjf import silod_choice
from .slurm import SlurmJob

log = logging.getLogger(__name__)


@dataclass
class JobPlan:
    name: str
    dataset: str
    nodes: tuple[str, ...]
    f_star: float | None
    io: float | None  # total bytes/s; None: unthrottled
    note: str = ""


@dataclass
class QueuedPlan:
    """A job waiting in the scheduler's queue, in SJF-SiloD order."""

    job: SlurmJob
    dataset: str
    score: float | None  # Eq. 7 (lower runs first); None: no f* or dataset size
    note: str = ""
    new_priority: int | None = None  # what the controller sets (or would): None, none


@dataclass
class ClusterPlan:
    """A cluster of the controller's nodes: one cache pool, shares pushed to one member.

    The daemons keep one table of shares per cluster, merged entry by entry, and a member
    given a share passes the table on to the others. Every change goes to `via` (the
    first answering member by name), one at a time, and reaches the others from it: one
    push per change, not one per member."""

    name: str
    members: tuple[str, ...]  # the controller's nodes in it that answered
    pool: float  # bytes the cluster-wide shares may add up to
    via: str


@dataclass
class Plan:
    """What to push: cache bytes per (node, dataset URI), IO per (node, job); and the
    scheduler's queue in SJF-SiloD order (first should run first).

    For a node in a cluster, `cache` holds each dataset's cluster-wide share (the same on
    every member); only the cluster's `via` member is sent it (`clusters`)."""

    cache: dict[str, dict[str, int]]
    io: dict[str, dict[str, int | None]]
    jobs: list[JobPlan]
    queue: list[QueuedPlan] = field(default_factory=list)
    clusters: dict[str, ClusterPlan] = field(default_factory=dict)

    def cluster_of(self, node: str) -> ClusterPlan | None:
        return next((c for c in self.clusters.values() if node in c.members), None)


def unit_key(node: str, dataset: str) -> str:
    return f"{node}|{dataset}"


CLUSTER_PREFIX = "cluster:"


def cluster_pool(name: str) -> str:
    """The pool (and unit key prefix) of a cluster's cache."""
    return CLUSTER_PREFIX + name


def cache_pools(config: ControllerConfig, seen: Mapping[str, NodeSeen]) -> dict[str, list[str]]:
    """Each cache pool -> the controller's nodes that draw from it: a node that caches
    alone (or does not answer) is its own pool; answering nodes that report one
    cluster name, and whose member lists overlap, share that cluster's pool. (Lists
    that overlap but differ are a member list being replaced; two clusters that happen
    to share a name have none in common and stay two pools, "NAME" and "NAME~2".)"""
    pools: dict[str, list[str]] = {}
    groups: dict[str, list[tuple[set[str], list[str]]]] = {}
    for node in config.nodes:
        status = seen.get(node.name)
        c = status.cluster if status is not None else None
        if c is None:
            pools[node.name] = [node.name]
            continue
        mine = set(c.members) | {c.address}
        joined = [g for g in groups.setdefault(c.name, []) if g[0] & mine]
        for g in joined:
            groups[c.name].remove(g)
        merged = (mine.union(*(g[0] for g in joined)), [n for g in joined for n in g[1]])
        merged[1].append(node.name)
        groups[c.name].append(merged)
    for name, found in groups.items():
        found.sort(key=lambda g: min(g[1]))
        for i, (_, nodes) in enumerate(found):
            label = name if i == 0 else f"{name}~{i + 1}"
            pools[cluster_pool(label)] = sorted(nodes)
    return pools


def _pool_of(pools: Mapping[str, list[str]]) -> dict[str, str]:
    return {node: pool for pool, nodes in pools.items() for node in nodes}


def plan_allocations(
    config: ControllerConfig,
    entries: Sequence[JobEntry],
    seen: Mapping[str, NodeSeen],
    ideal: Mapping[str, float],
    queue: Sequence[SlurmJob] = (),
) -> Plan:
    """Run the policy on the cluster as observed and turn its decision into pushes;
    order `queue` (pending jobs of the cluster scheduler) by SJF-SiloD's score.

    The link total holds under every policy. Jobs whose f* is not known yet are outside
    the policy's problem: they are set aside an equal per-job share of the link (the
    policy divides the rest), and they share, max-min, what the policy leaves
    unallocated together with the jobs it gives no IO to (FIFO and greedy give none).
    """
    jobs, cluster, unknown = build_problem(config, entries, seen, ideal)
    reserve = 0.0
    if unknown and not math.isinf(config.remote_io):
        reserve = config.remote_io * len(unknown) / (len(unknown) + len(jobs))
    policy_view = replace(cluster, remote_io=config.remote_io - reserve)
    alloc = POLICIES[config.policy]().allocate(jobs, policy_view, SiloDEstimator())
    left_io = share_the_rest(alloc, jobs, unknown, cluster)
    index = _DatasetIndex(seen)
    queued = [_queued_dataset(q, index) for q in queue]
    plan = to_plan(config, jobs, unknown, cluster, alloc, seen, left_io, set(queued))
    plan.queue = order_queue(queue, queued, jobs, cluster, index)
    return plan


def _queued_dataset(job: SlurmJob, index: _DatasetIndex) -> str:
    first = job.datasets[0] if job.datasets else ""
    return index.canonical(first) or first


def order_queue(
    queue: Sequence[SlurmJob],
    datasets: Sequence[str],
    running: Sequence[Job],
    cluster: Cluster,
    index: _DatasetIndex,
) -> list[QueuedPlan]:
    """Pending jobs in ascending SJF-SiloD score (Eq. 7, policies/sjf.py), computed as
    the simulator does, on the cluster as one pool (a queued job has no node yet): all
    GPUs, all nodes' cache, the link; a dataset's cache cost is split among the jobs,
    running and queued, that read it. Remaining work is epochs x dataset size.

    A job without f* or whose dataset no daemon has listed yet cannot be scored: those
    follow the scored ones in the scheduler's own order (priority, then submission).
    A job with f* but no epochs scores as endless (SJF's remaining work is unknown)."""
    sizes = {ds: index.size(ds) for ds in datasets}
    readers: dict[str, int] = {}
    for job in running:
        readers[job.dataset] = readers.get(job.dataset, 0) + 1
    for ds in datasets:
        readers[ds] = readers.get(ds, 0) + 1
    known = {ds: size for ds, size in sizes.items() if size}
    pooled = Cluster.pooled(cluster.node_gpus, cluster.pools, cluster.remote_io, known)
    total_gpus = max(1, cluster.total_gpus)
    out = []
    for job, ds in zip(queue, datasets, strict=True):
        size = sizes.get(ds)
        if not job.ideal_io or not size:
            why = "no f* (silofs.ideal_io)" if not job.ideal_io else "dataset size not known"
            out.append(QueuedPlan(job, ds, None, why))
            continue
        remaining = job.epochs * size if job.epochs else math.inf
        sjob = Job(job.name, ds, job.gpus, job.ideal_io, {ds: 1.0}, remaining, job.submit)
        score = silod_choice(sjob, pooled, readers, total_gpus).score
        out.append(QueuedPlan(job, ds, score, "" if job.epochs else "no epochs: endless"))
    return sorted(
        out,
        key=lambda q: (
            q.score is None,
            q.score if q.score is not None else 0.0,
            -q.job.priority if q.score is None else 0,
            q.job.submit,
            int(q.job.id),
        ),
    )


def share_the_rest(
    alloc: Allocation, jobs: Sequence[Job], unknown: Sequence[JobPlan], cluster: Cluster
) -> dict[str, float]:
    """Divide the link the policy left unallocated among the jobs it gave no IO (added
    to `alloc.io`) and the jobs it did not plan (returned, by name), max-min fairly.

    A planned job is first given up to its demand now, f* (1 - hit ratio now), then up
    to f* (it can never fetch faster; a cache still filling or not yet effective hits
    less than planned); a job whose f* is unknown has no such bound. With no limit on
    the link (remote_io infinite) nothing is throttled.
    """
    left_jobs = [j for j in jobs if j.name not in alloc.io]
    if math.isinf(cluster.remote_io):
        alloc.io.update({j.name: math.inf for j in left_jobs})
        return {j.name: math.inf for j in unknown}
    left = max(0.0, cluster.remote_io - sum(alloc.io.values()))
    hits = current_hits(left_jobs, cluster, alloc.cache) or {
        j.name: hit_ratio(j, alloc.cache, cluster) for j in left_jobs
    }
    demand = {j.name: j.f_star * (1.0 - hits[j.name]) for j in left_jobs}
    demand.update({j.name: math.inf for j in unknown})
    got = water_fill(left, demand)
    left -= sum(got.values())
    room = {j.name: max(0.0, j.f_star - got[j.name]) for j in left_jobs}
    for name, more in water_fill(max(0.0, left), room).items():
        got[name] += more
    alloc.io.update({j.name: got[j.name] for j in left_jobs})
    return {j.name: got[j.name] for j in unknown}


def build_problem(
    config: ControllerConfig,
    entries: Sequence[JobEntry],
    seen: Mapping[str, NodeSeen],
    ideal: Mapping[str, float],
) -> tuple[list[Job], Cluster, list[JobPlan]]:
    """Jobs (with f* known) and the cluster of per-node caches they read through.

    Returns also the running jobs whose f* is unknown: they get no allocation (they run
    unthrottled until measured) and are not part of the policy's problem.
    """
    by_name = {e.name: e for e in entries}
    configured = {n.name for n in config.nodes}
    pools = cache_pools(config, seen)
    pool_of = _pool_of(pools)
    index = _DatasetIndex(seen)
    where: dict[str, list[str]] = {}
    dataset_of: dict[str, str] = {}
    for node in seen.values():
        for job in node.jobs.values():
            where.setdefault(job.name, []).append(node.name)
            dataset_of.setdefault(job.name, job.dataset)
    for entry in entries:
        for node in entry.nodes:
            if node in configured and node not in where.get(entry.name, []):
                where.setdefault(entry.name, []).append(node)
        if entry.name in where:
            dataset_of[entry.name] = index.canonical(entry.dataset) or dataset_of.get(
                entry.name, entry.dataset
            )
    units: dict[str, CacheUnit] = {}
    jobs: list[Job] = []
    unknown: list[JobPlan] = []
    for name in sorted(where):
        entry = by_name.get(name)
        dataset = dataset_of[name]
        nodes = tuple(sorted(where[name]))
        f_star = entry.ideal_io if entry and entry.ideal_io else ideal.get(name)
        size = float(entry.dataset_size) if entry and entry.dataset_size else index.size(dataset)
        if f_star is None or size is None:
            why = (
                "f* not known yet: shares what the policy leaves until measured"
                if f_star is None
                else ("dataset size not known")
            )
            unknown.append(JobPlan(name, dataset, nodes, f_star, None, why))
            continue
        reads: dict[str, float] = {}
        for node in nodes:
            pool = pool_of.get(node, node)
            key = unit_key(pool, dataset)
            units[key] = CacheUnit(key, pool, dataset, size)
            reads[key] = reads.get(key, 0.0) + 1.0 / len(nodes)
        jobs.append(_job(name, dataset, entry, f_star, reads, nodes, seen, size))
    return jobs, _cluster(config, jobs, units, seen, pools), unknown


def _job(
    name: str,
    dataset: str,
    entry: JobEntry | None,
    f_star: float,
    reads: dict[str, float],
    nodes: tuple[str, ...],
    seen: Mapping[str, NodeSeen],
    size: float,
) -> Job:
    gpus = entry.gpus if entry else 1
    reports = [(seen[n], seen[n].jobs[name]) for n in nodes if n in seen and name in seen[n].jobs]
    done = sum(r.bytes_read for _, r in reports)
    remaining = max(0.0, entry.epochs * size - done) if entry and entry.epochs else math.inf
    hits = [_hit_now(r, size, node.cluster) for node, r in reports]
    hits = [h for h in hits if h is not None]
    hit_now = sum(hits) / len(hits) if hits and len(hits) == len(nodes) else None
    per_node = max(1, gpus // len(nodes))
    return Job(
        name=name,
        dataset=dataset,
        gpus=gpus,
        f_star=f_star,
        reads=reads,
        remaining=remaining,
        placement={n: per_node for n in nodes},
        hit_now=hit_now,
    )


def _hit_now(report: JobSeen, size: float, cluster: ClusterSeen | None = None) -> float | None:
    """The job's hit ratio this epoch on one node: its effective cache over the dataset
    (uniform caching; what was cached when the epoch began, §6), else as measured.

    A node in a cluster reports the effective cache it holds itself, its part of the
    cluster's (chunks are placed on members by weight): scaled up to the cluster's."""
    if report.effective_cache is not None and size > 0:
        scale = cluster.scale if cluster is not None else 1.0
        return min(1.0, report.effective_cache * scale / size)
    return report.hit_now


def _cluster(
    config: ControllerConfig,
    jobs: Sequence[Job],
    units: dict[str, CacheUnit],
    seen: Mapping[str, NodeSeen],
    pools: Mapping[str, list[str]],
) -> Cluster:
    # The jobs already run, so every node has at least the GPUs its jobs hold.
    used: dict[str, int] = {}
    for job in jobs:
        for node, n in (job.placement or {}).items():
            used[node] = used.get(node, 0) + n
    gpus = {n.name: max(n.gpus, used.get(n.name, 0)) for n in config.nodes}
    budgets = {n.name: float(_budget(n, seen)) for n in config.nodes}
    capacity = {
        pool: budgets[nodes[0]] if pool == nodes[0] else _cluster_capacity(nodes, budgets, seen)
        for pool, nodes in pools.items()
    }
    cached = {
        key: cached_in(pools.get(unit.pool, [unit.pool]), unit.dataset, seen)
        for key, unit in units.items()
    }
    return Cluster(gpus, budgets, config.remote_io, capacity, units, cached)


def _cluster_capacity(
    members: Sequence[str], budgets: Mapping[str, float], seen: Mapping[str, NodeSeen]
) -> float:
    """What a cluster's shares may add up to: each member holds its part of every share
    (weight / the configured members' weights), so the member whose budget its part
    fills first bounds them all. When weights follow cache sizes, this is the sum of
    the members' caches. A member's allocations of its own (made before it joined,
    outside any share) still take room in its cache."""
    bound = math.inf
    for node in members:
        status = seen[node]
        assert status.cluster is not None
        local = sum(
            d.allocation or 0.0
            for uri, d in status.datasets.items()
            if uri not in status.cluster.shares
        )
        bound = min(bound, max(0.0, budgets[node] - local) * status.cluster.scale)
    return 0.0 if math.isinf(bound) else bound


def cached_in(nodes: Sequence[str], uri: str, seen: Mapping[str, NodeSeen]) -> float:
    """Bytes of a dataset the nodes of one pool hold now (a cluster's: added up over its
    members, what each holds only for other members included)."""
    total = 0.0
    for node in nodes:
        status = seen.get(node)
        if status is None:
            continue
        ds = status.datasets.get(uri)
        held = ds.cached if ds else 0.0
        if status.cluster is not None:
            held = max(held, status.cluster.cached.get(uri, 0.0))
        total += held
    return total


def _budget(node: NodeConfig, seen: Mapping[str, NodeSeen]) -> float:
    """The cache a node's plan divides: `cache` in the config, but never more than the
    daemon's cache size when it reports one (the daemon refuses allocations past it: a
    config of 2 TB on a 1 TB node planned a dataset 2 TB, refused at every poll, and the
    dataset had no allocation at all). A node that does not answer: the config's."""
    status = seen.get(node.name)
    size = status.cache_size if status is not None else None
    if node.cache is not None:
        return node.cache if size is None else min(node.cache, size)
    return 0.0 if size is None else size


class _DatasetIndex:
    """The datasets the nodes report, indexed once per plan (a lookup per job that scans
    every node would make planning O(jobs x nodes)).

    Lookups answer what a scan of the nodes in order would: the first dataset whose URI
    or short name matches, and the first positive size reported for a URI.
    """

    def __init__(self, seen: Mapping[str, NodeSeen]) -> None:
        self.uris: dict[str, str] = {}
        self.loose: dict[str, str] = {}
        self.sizes: dict[str, float] = {}
        for node in seen.values():
            for key, ds in node.datasets.items():
                self.uris.setdefault(ds.uri, ds.uri)
                self.uris.setdefault(ds.name, ds.uri)
                self.loose.setdefault(_loose(ds.uri), ds.uri)
                if ds.size > 0:
                    self.sizes.setdefault(key, ds.size)

    def canonical(self, dataset: str) -> str | None:
        """A dataset named by URI or by a daemon's short name -> its canonical URI; a
        URI as a user writes it (a bare path, no trailing slash) matches too."""
        return self.uris.get(dataset) or self.loose.get(_loose(dataset))

    def size(self, dataset: str) -> float | None:
        return self.sizes.get(dataset)


def _loose(uri: str) -> str:
    """A URI without what writers vary: the file:// of a bare path, "." and ".." and
    doubled or trailing slashes. (The daemon's parsing, silofs/uri.py, is on the other
    side of the layout rule; this only has to match what it made canonical.)"""
    if uri.startswith("/"):
        uri = "file://" + uri.replace("%", "%25")  # a path is literal, a URI's is encoded
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return uri
    scheme = scheme.lower()
    # Percent-decoded as the daemon decodes a URI's path, and "%" written back as the
    # canonical URI writes it: s3://b/my%20data is the daemon's s3://b/my data/, and the
    # directory /x/%41 its file:///x/%2541/ (compared as written, neither matched).
    rest = unquote(rest).replace("%", "%25")
    if scheme == "file":
        rest = posixpath.normpath(rest)
    return f"{scheme}://{rest.rstrip('/')}"


def to_plan(
    config: ControllerConfig,
    jobs: Sequence[Job],
    unknown: Sequence[JobPlan],
    cluster: Cluster,
    alloc: Allocation,
    seen: Mapping[str, NodeSeen],
    unknown_io: Mapping[str, float] | None = None,
    queued: set[str] | None = None,
) -> Plan:
    """Per-node pushes: cache per dataset, IO per job split evenly over its nodes. A job
    missing from alloc.io (or from unknown_io, for jobs the policy did not plan) is left
    unthrottled (null). Every member of a cluster is planned its cluster-wide shares."""
    pools = cache_pools(config, seen)
    cache: dict[str, dict[str, int]] = {n.name: {} for n in config.nodes}
    for key, unit in cluster.units.items():
        for node in pools.get(unit.pool, [unit.pool]):
            cache[node][unit.dataset] = int(alloc.cache.get(key, 0.0))
    _keep_idle(cache, cluster, seen, queued or set(), pools)
    io: dict[str, dict[str, int | None]] = {n.name: {} for n in config.nodes}
    plans = []
    for job in jobs:
        total = alloc.io.get(job.name)
        nodes = tuple(sorted(job.placement or ()))
        for node in nodes:
            io[node][job.name] = _split(total, len(nodes))
        plans.append(JobPlan(job.name, job.dataset, nodes, job.f_star, total))
    for job in unknown:
        total = (unknown_io or {}).get(job.name)
        for node in job.nodes:
            io.setdefault(node, {})[job.name] = _split(total, len(job.nodes))
        plans.append(replace(job, io=total))
    clusters = {}
    for pool, nodes in pools.items():
        if pool != nodes[0]:  # a cluster's (a node's own pool is keyed by its name)
            label = pool.removeprefix(CLUSTER_PREFIX)
            clusters[label] = ClusterPlan(label, tuple(nodes), cluster.pools[pool], nodes[0])
    return Plan(cache, io, sorted(plans, key=lambda p: p.name), clusters=clusters)


def _split(total: float | None, parts: int) -> int | None:
    """A distributed job's IO divided evenly across its nodes; None stays unthrottled."""
    if total is None or math.isinf(total):
        return None
    return int(total / parts)


def _keep_idle(
    cache: dict[str, dict[str, int]],
    cluster: Cluster,
    seen: Mapping[str, NodeSeen],
    queued: set[str],
    pools: Mapping[str, list[str]],
) -> None:
    """Datasets no running job reads keep what they have cached while their pool has
    room (a job may come back to them), and are squeezed to 0 when it has not; those a
    queued job will read are kept first (its data, cached, is worth more than data
    nobody asked for). A cluster's idle datasets are those any member lists or holds a
    share of, each kept (on every member) up to what the cluster holds of it."""
    for pool, nodes in pools.items():
        nodes = [n for n in nodes if n in seen and n in cache]
        if not nodes:
            continue
        room = cluster.pools.get(pool, 0.0) - sum(cache[nodes[0]].values())
        uris: set[str] = set()
        for node in nodes:
            status = seen[node]
            uris.update(status.datasets)
            if status.cluster is not None:
                uris.update(status.cluster.shares)
                uris.update(status.cluster.cached)
        held = {u: cached_in(nodes, u, seen) for u in uris if u not in cache[nodes[0]]}
        for uri in sorted(held, key=lambda u: (u not in queued, -held[u], u)):
            keep = int(max(0.0, min(held[uri], room)))
            for node in nodes:
                cache[node][uri] = keep
            room -= keep
