"""The live controller: watch jobs and node daemons, compute allocations, push them.

Owns: the controller's config and jobs file, the view of the cluster it builds from the
daemons' GET /v1/status, measured rates (a job's f* when none is given, its hit ratio
now), turning a policy's Allocation into per-node PUTs, and the loop that re-plans when
the set of jobs changes or every interval. Never: schedules GPUs (jobs are started by
whatever runs them; their GPUs and nodes are facts here), talks to a daemon except
through NodeClient, or lets one node's failure stop the others.

Each node keeps its own cache, so a cache unit is a (node, dataset) pair drawing from that
node's budget. A job on several nodes reads an equal share through each; its IO
allocation is split evenly across its nodes (papers/silod.md §6).
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .estimator import SiloDEstimator
from .model import Allocation, CacheUnit, Cluster, Job
from .policies import FifoPolicy, GavelPolicy, GreedyPolicy, Policy, SjfPolicy
from .tomlcheck import Checker, ConfigError, load_toml

log = logging.getLogger(__name__)

POLICIES: dict[str, type[Policy]] = {
    "gavel": GavelPolicy,
    "sjf": SjfPolicy,
    "fifo": FifoPolicy,
    "greedy": GreedyPolicy,
}
CONFIG_KEYS = {"policy", "remote_io", "interval", "poll", "timeout", "jobs_file", "nodes"}
NODE_KEYS = {"name", "socket", "gpus", "cache"}
JOB_KEYS = {"name", "dataset", "gpus", "ideal_io", "nodes", "dataset_size", "epochs"}
# A job's measured rate counts as its f* only over a window at least this long.
MIN_MEASURE_S = 5.0


# ------------------------------------------------------------------ configuration


@dataclass(frozen=True)
class NodeConfig:
    name: str
    socket: str
    gpus: int = 0  # 0: as many as the jobs seen on it use
    cache: int | None = None  # budget to divide; None: the daemon's own cache size


@dataclass(frozen=True)
class ControllerConfig:
    policy: str
    remote_io: float
    nodes: tuple[NodeConfig, ...]
    jobs_file: str | None = None
    interval: float = 30.0
    poll: float = 2.0
    timeout: float = 5.0


@dataclass(frozen=True)
class JobEntry:
    """One job as the jobs file describes it; every field but name and dataset optional."""

    name: str
    dataset: str
    gpus: int = 1
    ideal_io: float | None = None
    nodes: tuple[str, ...] = ()
    dataset_size: int | None = None
    epochs: float | None = None


def load_controller_config(path: str) -> ControllerConfig:
    text = _read(path)
    data = load_toml(text, path)
    ck = Checker(path, text)
    ck.check_keys(data, CONFIG_KEYS, ())
    policy = data.get("policy", "gavel")
    if policy not in POLICIES:
        raise ck.fail(("policy",), f"unknown policy {policy!r} (try {', '.join(POLICIES)})")
    remote_io = ck.rate(ck.need(data, "remote_io", ()), ("remote_io",), "remote_io")
    nodes = _config_nodes(ck, data.get("nodes"))
    jobs_file = data.get("jobs_file")
    if jobs_file is not None and not isinstance(jobs_file, str):
        raise ck.fail(("jobs_file",), "jobs_file must be a path")
    if jobs_file:
        jobs_file = str(Path(path).parent / jobs_file)  # relative to the config
    return ControllerConfig(
        policy=policy,
        remote_io=remote_io,
        nodes=nodes,
        jobs_file=jobs_file,
        interval=_positive(ck, data, "interval", 30.0),
        poll=_positive(ck, data, "poll", 2.0),
        timeout=_positive(ck, data, "timeout", 5.0),
    )


def _positive(ck: Checker, data: Mapping[str, Any], key: str, default: float) -> float:
    value = ck.duration(data.get(key, default), (key,), key)
    if value <= 0:
        raise ck.fail((key,), f"{key} must be positive")
    return value


def _config_nodes(ck: Checker, raw: Any) -> tuple[NodeConfig, ...]:
    if not isinstance(raw, list) or not raw:
        raise ck.fail((), "the config needs at least one [[nodes]] table")
    nodes = []
    for i, table in enumerate(raw):
        where = ("nodes", i)
        ck.check_keys(table, NODE_KEYS, where)
        name, socket = ck.need(table, "name", where), ck.need(table, "socket", where)
        for key, value in (("name", name), ("socket", socket)):
            if not isinstance(value, str) or not value:
                raise ck.fail(where + (key,), f"{key} must be a non-empty string")
        if any(n.name == name for n in nodes):
            raise ck.fail(where + ("name",), f"node name {name!r} used twice")
        gpus = 0
        if "gpus" in table:
            gpus = int(ck.number(table["gpus"], where + ("gpus",), "gpus", integer=True))
        cache = ck.size(table["cache"], where + ("cache",), "cache") if "cache" in table else None
        nodes.append(NodeConfig(name, socket, gpus, cache))
    return tuple(nodes)


def load_jobs_file(path: str) -> list[JobEntry]:
    text = _read(path)
    data = load_toml(text, path)
    ck = Checker(path, text)
    ck.check_keys(data, {"jobs"}, ())
    raw = data.get("jobs", [])
    if not isinstance(raw, list):
        raise ck.fail(("jobs",), "jobs must be [[jobs]] tables")
    entries: list[JobEntry] = []
    for i, table in enumerate(raw):
        entry = _job_entry(ck, table, ("jobs", i))
        if any(e.name == entry.name for e in entries):
            raise ck.fail(("jobs", i, "name"), f"job name {entry.name!r} used twice")
        entries.append(entry)
    return entries


def _job_entry(ck: Checker, table: dict, where: tuple) -> JobEntry:
    ck.check_keys(table, JOB_KEYS, where)
    name, dataset = ck.need(table, "name", where), ck.need(table, "dataset", where)
    for key, value in (("name", name), ("dataset", dataset)):
        if not isinstance(value, str) or not value:
            raise ck.fail(where + (key,), f"{key} must be a non-empty string")
    nodes = table.get("nodes", [])
    if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
        raise ck.fail(where + ("nodes",), "nodes must be a list of node names")
    ideal = None
    if "ideal_io" in table:
        ideal = ck.rate(table["ideal_io"], where + ("ideal_io",), "ideal_io")
        if ideal <= 0 or math.isinf(ideal):
            raise ck.fail(where + ("ideal_io",), "ideal_io must be a positive, finite rate")
    return JobEntry(
        name=name,
        dataset=dataset,
        gpus=int(ck.number(table.get("gpus", 1), where + ("gpus",), "gpus", integer=True)),
        ideal_io=ideal,
        nodes=tuple(nodes),
        dataset_size=(
            ck.size(table["dataset_size"], where + ("dataset_size",), "dataset_size")
            if "dataset_size" in table
            else None
        ),
        epochs=(
            float(ck.number(table["epochs"], where + ("epochs",), "epochs", integer=False))
            if "epochs" in table
            else None
        ),
    )


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None


# ------------------------------------------------------------------------ nodes


class NodeClient(Protocol):
    """What the controller needs from one node daemon (silofs/control/client.py)."""

    def status(self) -> dict: ...

    def put_cache(self, dataset: str, nbytes: int) -> None: ...

    def put_io(self, job: str, rate: int | None) -> None: ...


class NodeError(Exception):
    """A node did not answer (unreachable) or refused one request; one line."""

    def __init__(self, message: str, unreachable: bool = True) -> None:
        super().__init__(message)
        self.unreachable = unreachable


class SocketNode:
    """NodeClient over a daemon's Unix control socket."""

    def __init__(self, socket_path: str, timeout: float) -> None:
        from silofs.control.client import ControlClient

        self.client = ControlClient(socket_path, timeout=timeout)

    def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        from silofs.control.client import ControlError

        try:
            return self.client.request(method, path, body)
        except ControlError as exc:
            raise NodeError(str(exc), unreachable=exc.status is None) from None

    def status(self) -> dict:
        answer = self._call("GET", "/v1/status")
        if not isinstance(answer, dict):
            raise NodeError("GET /v1/status did not return a JSON object")
        return answer

    def put_cache(self, dataset: str, nbytes: int) -> None:
        from silofs.control.client import quote_segment

        self._call("PUT", f"/v1/datasets/{quote_segment(dataset)}/cache", {"bytes": nbytes})

    def put_io(self, job: str, rate: int | None) -> None:
        from silofs.control.client import quote_segment

        self._call("PUT", f"/v1/jobs/{quote_segment(job)}/io", {"bytes_per_s": rate})

    def close(self) -> None:
        self.client.close()


# ------------------------------------------------------------------ observation


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
    hit_now: float | None = None  # measured over the last poll window
    effective_cache: float | None = None  # cached bytes that can serve this epoch


@dataclass
class NodeSeen:
    name: str
    cache_size: float | None
    datasets: dict[str, DatasetSeen]
    jobs: dict[str, JobSeen]


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
    for j in status.get("jobs") or []:
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
            effective_cache=_opt_float(j.get("effective_cache")),
        )
    return NodeSeen(node, _opt_float(info.get("cache_size")), datasets, jobs)


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass
class RateTracker:
    """Rates from successive counters, and each job's best unthrottled throughput.

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
                free = job.allocation is None
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
        self.samples[key] = (now, job.bytes_read, job.hit_bytes)


# ----------------------------------------------------------------------- planning


@dataclass
class JobPlan:
    name: str
    dataset: str
    nodes: tuple[str, ...]
    f_star: float | None
    io: float | None  # total bytes/s; None: unthrottled
    note: str = ""


@dataclass
class Plan:
    """What to push: cache bytes per (node, dataset URI), IO per (node, job)."""

    cache: dict[str, dict[str, int]]
    io: dict[str, dict[str, int | None]]
    jobs: list[JobPlan]


def unit_key(node: str, dataset: str) -> str:
    return f"{node}|{dataset}"


def plan_allocations(
    config: ControllerConfig,
    entries: Sequence[JobEntry],
    seen: Mapping[str, NodeSeen],
    ideal: Mapping[str, float],
) -> Plan:
    """Run the policy on the cluster as observed and turn its decision into pushes."""
    jobs, cluster, unknown = build_problem(config, entries, seen, ideal)
    alloc = POLICIES[config.policy]().allocate(jobs, cluster, SiloDEstimator())
    return to_plan(config, jobs, unknown, cluster, alloc, seen)


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
    where: dict[str, list[str]] = {}
    dataset_of: dict[str, str] = {}
    for node in seen.values():
        for job in node.jobs.values():
            where.setdefault(job.name, []).append(node.name)
            dataset_of.setdefault(job.name, job.dataset)
    for entry in entries:
        for node in entry.nodes:
            if node in {n.name for n in config.nodes} and node not in where.get(entry.name, []):
                where.setdefault(entry.name, []).append(node)
        if entry.name in where:
            dataset_of[entry.name] = _canonical(entry.dataset, seen) or dataset_of.get(
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
        size = _dataset_size(dataset, entry, seen)
        if f_star is None or size is None:
            why = (
                "f* not known yet: unthrottled until measured"
                if f_star is None
                else ("dataset size not known")
            )
            unknown.append(JobPlan(name, dataset, nodes, f_star, None, why))
            continue
        reads = {}
        for node in nodes:
            key = unit_key(node, dataset)
            units[key] = CacheUnit(key, node, dataset, size)
            reads[key] = 1.0 / len(nodes)
        jobs.append(_job(name, dataset, entry, f_star, reads, nodes, seen, size))
    return jobs, _cluster(config, jobs, units, seen), unknown


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
    reports = [seen[n].jobs[name] for n in nodes if n in seen and name in seen[n].jobs]
    done = sum(r.bytes_read for r in reports)
    remaining = max(0.0, entry.epochs * size - done) if entry and entry.epochs else math.inf
    hits = [_hit_now(r, size) for r in reports]
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


def _hit_now(report: JobSeen, size: float) -> float | None:
    """The job's hit ratio this epoch on one node: its effective cache over the dataset
    (uniform caching; what was cached when the epoch began, §6), else as measured."""
    if report.effective_cache is not None and size > 0:
        return min(1.0, report.effective_cache / size)
    return report.hit_now


def _cluster(
    config: ControllerConfig,
    jobs: Sequence[Job],
    units: dict[str, CacheUnit],
    seen: Mapping[str, NodeSeen],
) -> Cluster:
    # The jobs already run, so every node has at least the GPUs its jobs hold.
    used: dict[str, int] = {}
    for job in jobs:
        for node, n in (job.placement or {}).items():
            used[node] = used.get(node, 0) + n
    gpus = {n.name: max(n.gpus, used.get(n.name, 0)) for n in config.nodes}
    pools = {n.name: float(_budget(n, seen)) for n in config.nodes}
    cached = {}
    for key, unit in units.items():
        node = seen.get(unit.pool)
        ds = node.datasets.get(unit.dataset) if node else None
        cached[key] = ds.cached if ds else 0.0
    return Cluster(gpus, dict(pools), config.remote_io, pools, units, cached)


def _budget(node: NodeConfig, seen: Mapping[str, NodeSeen]) -> float:
    if node.cache is not None:
        return node.cache
    status = seen.get(node.name)
    if status is None or status.cache_size is None:
        return 0.0
    return status.cache_size


def _canonical(dataset: str, seen: Mapping[str, NodeSeen]) -> str | None:
    """A dataset named by URI or by a daemon's short name -> its canonical URI."""
    for node in seen.values():
        for ds in node.datasets.values():
            if dataset in (ds.uri, ds.name):
                return ds.uri
    return None


def _dataset_size(
    dataset: str, entry: JobEntry | None, seen: Mapping[str, NodeSeen]
) -> float | None:
    if entry and entry.dataset_size:
        return float(entry.dataset_size)
    for node in seen.values():
        ds = node.datasets.get(dataset)
        if ds and ds.size > 0:
            return ds.size
    return None


def to_plan(
    config: ControllerConfig,
    jobs: Sequence[Job],
    unknown: Sequence[JobPlan],
    cluster: Cluster,
    alloc: Allocation,
    seen: Mapping[str, NodeSeen],
) -> Plan:
    cache: dict[str, dict[str, int]] = {n.name: {} for n in config.nodes}
    for key, unit in cluster.units.items():
        cache[unit.pool][unit.dataset] = int(alloc.cache.get(key, 0.0))
    _keep_idle(cache, cluster, seen)
    io: dict[str, dict[str, int | None]] = {n.name: {} for n in config.nodes}
    plans = []
    for job in jobs:
        total = alloc.io.get(job.name)
        nodes = tuple(sorted({cluster.units[k].pool for k in job.reads}))
        for node in nodes:
            io[node][job.name] = _split(total, len(nodes))
        plans.append(JobPlan(job.name, job.dataset, nodes, job.f_star, total))
    for job in unknown:
        for node in job.nodes:
            io.setdefault(node, {})[job.name] = None
        plans.append(job)
    return Plan(cache, io, sorted(plans, key=lambda p: p.name))


def _split(total: float | None, parts: int) -> int | None:
    """A distributed job's IO divided evenly across its nodes; None stays unthrottled."""
    if total is None or math.isinf(total):
        return None
    return int(total / parts)


def _keep_idle(
    cache: dict[str, dict[str, int]], cluster: Cluster, seen: Mapping[str, NodeSeen]
) -> None:
    """Datasets no running job reads keep what they have cached while their node has
    room (a job may come back to them), and are squeezed to 0 when it has not."""
    for node, status in seen.items():
        if node not in cache:
            continue
        room = cluster.pools.get(node, 0.0) - sum(cache[node].values())
        idle = [d for d in status.datasets.values() if d.uri not in cache[node]]
        for ds in sorted(idle, key=lambda d: (-d.cached, d.uri)):
            keep = int(max(0.0, min(ds.cached, room)))
            cache[node][ds.uri] = keep
            room -= keep


# ------------------------------------------------------------------------ pushing


@dataclass
class PushReport:
    pushed: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    unreachable: set[str] = field(default_factory=set)


# What each node last accepted from us: node -> {("cache" | "io", name): value}.
Pushed = dict[str, dict[tuple[str, str], int | None]]


def push_plan(
    plan: Plan,
    clients: Mapping[str, NodeClient],
    seen: Mapping[str, NodeSeen],
    pool: ThreadPoolExecutor,
    pushed: Pushed | None = None,
) -> PushReport:
    """Send each node what differs from what it reports; nodes in parallel, a failing
    node only loses its own updates (the next round retries it)."""
    report = PushReport()
    memory = pushed if pushed is not None else {}
    futures = {
        node: pool.submit(_push_node, clients[node], plan, seen[node], memory.setdefault(node, {}))
        for node in clients
        if node in seen and (plan.cache.get(node) or plan.io.get(node))
    }
    for node, future in futures.items():
        try:
            count, refused = future.result()
        except NodeError as exc:
            report.failed[node] = str(exc)
            report.unreachable.add(node)
            continue
        report.pushed += count
        if refused:
            more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
            report.failed[node] = refused[0] + more
    return report


def _push_node(
    client: NodeClient, plan: Plan, status: NodeSeen, memory: dict[tuple[str, str], int | None]
) -> tuple[int, list[str]]:
    """(updates pushed, refusals). Pushes what differs from what the node reports or, for
    what it does not report (a job with no mount there yet), from what it last accepted.
    An unreachable node raises and ends its round; a refused update is reported and the
    node's other updates still go out."""
    node = status.name
    updates: list[tuple[str, str, int | None]] = []
    for dataset, nbytes in sorted(plan.cache.get(node, {}).items()):
        held = status.datasets.get(dataset)
        current = held.allocation if held else memory.get(("cache", dataset), -1)
        if current is None or int(current) != nbytes:
            updates.append(("cache", dataset, nbytes))
    for job, rate in sorted(plan.io.get(node, {}).items()):
        seen_job = status.jobs.get(job)
        current = seen_job.allocation if seen_job else memory.get(("io", job), -1)
        if current != (None if rate is None else float(rate)):
            updates.append(("io", job, rate))
    count, refused = 0, []
    for kind, name, value in updates:
        try:
            if kind == "cache":
                client.put_cache(name, int(value or 0))
            else:
                client.put_io(name, value)
        except NodeError as exc:
            if exc.unreachable:
                raise
            refused.append(f"{name}: {exc}")
            continue
        memory[(kind, name)] = value
        count += 1
    return count, refused


# --------------------------------------------------------------------------- loop


ClientFactory = Callable[[NodeConfig], NodeClient]


def socket_clients(config: ControllerConfig) -> ClientFactory:
    return lambda node: SocketNode(node.socket, config.timeout)


class Controller:
    """Poll, plan when something changed or the interval passed, push."""

    def __init__(self, config: ControllerConfig, factory: ClientFactory | None = None) -> None:
        self.config = config
        factory = factory or socket_clients(config)
        self.clients = {n.name: factory(n) for n in config.nodes}
        self.rates = RateTracker()
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(config.nodes)))
        self.down: dict[str, str] = {}  # unreachable nodes, and why
        self.refused: dict[str, str] = {}  # nodes that refused an update last round
        self.pushed: Pushed = {}
        self.entries: list[JobEntry] = []
        # (mtime, size) of the jobs file as last read; None: missing; "" : never looked
        self.jobs_stamp: tuple | str | None = ""
        self.signature: str | None = None
        self.next_round = 0.0
        self.stop = threading.Event()

    def observe(self) -> dict[str, NodeSeen]:
        """Every node's status, fetched in parallel; nodes that fail are skipped."""
        futures = {name: self.pool.submit(c.status) for name, c in self.clients.items()}
        seen: dict[str, NodeSeen] = {}
        for name, future in futures.items():
            try:
                seen[name] = parse_status(name, future.result())
            except (NodeError, KeyError, TypeError, ValueError) as exc:
                self._node_down(name, str(exc))
                continue
            if name in self.down:
                log.warning("node %s is back", name)
                del self.down[name]
        self.rates.update(seen, time.monotonic())
        return seen

    def _node_down(self, name: str, why: str) -> None:
        if self.down.get(name) != why:
            log.warning("node %s: %s (will retry)", name, why)
        self.down[name] = why
        self.pushed.pop(name, None)  # it may come back without them: push all again

    def reload_jobs(self) -> bool:
        """Re-read the jobs file if it changed; a broken file keeps the last good one."""
        path = self.config.jobs_file
        if not path:
            return False
        try:
            st = Path(path).stat()
            stamp: tuple | None = (st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = None
        if stamp == self.jobs_stamp:
            return False
        self.jobs_stamp = stamp
        if stamp is None:
            log.warning("jobs file %s is missing; using jobs seen on the nodes only", path)
            self.entries = []
            return True
        try:
            self.entries = load_jobs_file(path)
        except ConfigError as exc:
            log.error("%s (keeping the previous jobs)", exc)
            return False
        log.info("jobs file: %d jobs", len(self.entries))
        return True

    def round(self, *, dry_run: bool = False, force: bool = False) -> Plan | None:
        """One poll; plans and pushes if the job set changed, the interval passed, or
        `force`. Returns the plan when it planned."""
        self.reload_jobs()
        seen = self.observe()
        signature = _signature(self.entries, seen, self.rates.ideal)
        now = time.monotonic()
        if not force and signature == self.signature and now < self.next_round:
            return None
        plan = plan_allocations(self.config, self.entries, seen, self.rates.ideal)
        self.signature, self.next_round = signature, now + self.config.interval
        if dry_run:
            return plan
        report = push_plan(plan, self.clients, seen, self.pool, self.pushed)
        self.refused = {}
        for node, why in report.failed.items():
            if node not in report.unreachable:
                log.warning("node %s refused: %s", node, why)
                self.refused[node] = why
            else:
                self._node_down(node, why)
        if report.failed:
            self.next_round = now  # retry what did not land at the next poll
        # (a node that is down is polled every time anyway; it coming back re-plans)
        if report.pushed:
            log.info("pushed %d allocation changes", report.pushed)
        return plan

    @property
    def not_updated(self) -> dict[str, str]:
        """Nodes whose allocations may not be what the last plan says."""
        return {**self.refused, **self.down}

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.round()
            except Exception:  # one bad round must not end a long-running controller
                log.exception("controller round failed; retrying next poll")
            self.stop.wait(self.config.poll)

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        for client in self.clients.values():
            closer = getattr(client, "close", None)
            if closer:
                closer()


def _signature(
    entries: Iterable[JobEntry], seen: Mapping[str, NodeSeen], ideal: Mapping[str, float]
) -> str:
    """Changes when the set of jobs (or what is known of them) changes."""
    parts = sorted(repr(e) for e in entries)
    parts += sorted(f"{n}:{j.name}:{j.dataset}" for n, s in seen.items() for j in s.jobs.values())
    parts += sorted(f"up:{n}" for n in seen)
    parts += sorted(f"ideal:{k}" for k in ideal)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()
