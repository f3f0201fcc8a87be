"""A flow-level, event-driven simulator of a GPU cluster reading through a cache from remote IO.

Owns: time, job progress, cache contents and the remote link of a simulated cluster, and
the metrics (JCT, makespan, fairness, hit ratios, a throughput/IO timeline). Policies
decide; this module only applies their decisions. Never: reads files, prints, or lets a
policy see anything but model.Job / model.Cluster.

Model (docs/CONTROLLER.md has the details):
- A job reads its dataset once per epoch in a fresh random order, at
  min(GPU share * f*, what its remote IO feeds given its hit ratio).
- Uniform caching with delayed effectiveness: a job only hits items that were cached and
  that it has not read yet this epoch. Per job we track H, the cached bytes it has not
  read this epoch; reading keeps H/unread constant (the order is random), items it
  fetches itself were already read (no effect until its next epoch), items another job
  on the same dataset fetches are unread by this one with probability
  (unread - H) / (not cached). At an epoch start H is the whole cached amount.
- LRU (Alluxio): sim_lru.py; hit ratio is 0 in a job's first epoch and the closed form after.
- The remote link is divided max-min fairly among jobs' remote demands, each capped by
  its IO allocation when the policy made one.
- Rates are constant between events: arrivals, completions, epoch ends, a cache unit
  becoming full, LRU segment ends; and a bounded step while a shared unit is filling
  (another job's fetches raise this one's hit ratio continuously).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace

from . import sim_lru
from .estimator import ComputeEstimator, Estimator, SiloDEstimator, equal_share_perf
from .model import POOL, Allocation, CacheUnit, Cluster, Job
from .policies import CACHES, SCHEDULERS
from .policies.base import CachePolicy, Policy, water_fill
from .scenario import JobSpec, Scenario

log = logging.getLogger(__name__)

CACHE_CHOICES = ("silod", *CACHES)
_LRU_SEGMENTS = 8  # rate changes per epoch while an LRU hit ratio slides from high to 0
_SHARED_FILL_STEP = 0.02  # max fraction of a dataset filled per step while jobs share it
_MAX_STEPS = 5_000_000
_REPLAN_HIT_CHANGE = 0.005  # a job's hit ratio moving this much at an epoch start re-plans


class SimulationError(Exception):
    """The scenario cannot run to completion (e.g. jobs that can never progress)."""


@dataclass
class JobResult:
    name: str
    submit: float
    start: float | None
    finish: float | None
    bytes_read: float
    hit_bytes: float
    remote_bytes: float
    fairness: float
    epoch_hit_ratios: list[float]

    @property
    def jct(self) -> float | None:
        return None if self.finish is None else self.finish - self.submit

    @property
    def hit_ratio(self) -> float:
        return self.hit_bytes / self.bytes_read if self.bytes_read > 0 else 0.0


@dataclass
class SimResult:
    scenario: str
    scheduler: str
    cache: str
    jobs: list[JobResult]
    # (time, total data throughput, remote IO) from each instant to the next
    timeline: list[tuple[float, float, float]] = field(default_factory=list)
    # Stopped (Ctrl-C) before every job finished: JCT and makespan are of the finished
    # jobs, an unfinished job's fairness is of the work it did so far.
    interrupted: bool = False
    until: float = 0.0  # simulated time reached

    @property
    def finished(self) -> list[JobResult]:
        return [j for j in self.jobs if j.finish is not None]

    @property
    def avg_jct(self) -> float:
        done = self.finished
        return sum(j.jct or 0.0 for j in done) / len(done) if done else math.nan

    @property
    def makespan(self) -> float:
        done = self.finished
        if not done:
            return math.nan
        return max(j.finish or 0.0 for j in done) - min(j.submit for j in self.jobs)

    @property
    def avg_fairness(self) -> float:
        return sum(j.fairness for j in self.jobs) / len(self.jobs)

    def to_dict(self) -> dict:
        return {
            "scenario": self.scenario,
            "scheduler": self.scheduler,
            "cache": self.cache,
            "avg_jct_s": self.avg_jct,
            "makespan_s": self.makespan,
            "avg_fairness": self.avg_fairness,
            "interrupted": self.interrupted,
            "simulated_s": self.until,
            "jobs": [
                {
                    "name": j.name,
                    "submit_s": j.submit,
                    "start_s": j.start,
                    "finish_s": j.finish,
                    "jct_s": j.jct,
                    "hit_ratio": j.hit_ratio,
                    "remote_bytes": j.remote_bytes,
                    "fairness": j.fairness,
                }
                for j in self.jobs
            ],
        }


@dataclass
class _Job:
    spec: JobSpec
    unit: str
    size: float
    work: float
    read: float = 0.0
    pos: float = 0.0  # bytes read in the current epoch
    epochs_done: int = 0
    effective: float = 0.0  # H: cached bytes not yet read this epoch (uniform caching)
    first_hit: float = 0.0  # LRU: hit ratio of the first epoch, fixed when it starts
    start: float | None = None
    finish: float | None = None
    hit_bytes: float = 0.0
    remote_bytes: float = 0.0
    epoch_hits: float = 0.0
    epoch_hit_ratios: list[float] = field(default_factory=list)
    equal_integral: float = 0.0  # integral of the equal-share rate over its life
    equal_rate: float = 0.0
    share: float = 0.0
    io_cap: float | None = None
    placement: dict[str, int] | None = None
    hit: float = 0.0
    rate: float = 0.0
    remote: float = 0.0
    boundary: float = math.inf  # LRU: epoch position where the current hit ratio ends
    # Fixed for the job's life; plain attributes because the event loop reads them for
    # every active job at every step.
    name: str = field(init=False)
    eps: float = field(init=False)  # bytes that count as nothing left (rounding)

    def __post_init__(self) -> None:
        self.name = self.spec.name
        self.eps = max(1.0, self.size * 1e-12)

    @property
    def unread(self) -> float:
        return max(0.0, self.size - self.pos)

    def tol(self) -> float:
        return self.eps


class Simulation:
    """One run of a scenario with a scheduler and a cache system."""

    def __init__(
        self, scenario: Scenario, scheduler: str, cache: str, interval: float = 600.0
    ) -> None:
        if scheduler not in SCHEDULERS:
            raise SimulationError(f"unknown scheduler {scheduler!r} (try {', '.join(SCHEDULERS)})")
        if cache not in CACHE_CHOICES:
            raise SimulationError(f"unknown cache {cache!r} (try {', '.join(CACHE_CHOICES)})")
        self.scenario = scenario
        self.scheduler_name, self.cache_name = scheduler, cache
        self.policy: Policy = SCHEDULERS[scheduler]()
        self.cache_policy: CachePolicy | None = None if cache == "silod" else CACHES[cache]()
        self.estimator: Estimator = SiloDEstimator() if cache == "silod" else ComputeEstimator()
        self.cluster = _cluster(scenario, private=cache == "coordl")
        # Fairness is judged against the same reference for every policy pair.
        self.reference = _cluster(scenario, private=False)
        self.now = 0.0
        self.pending = sorted(
            (_job_state(spec, private=cache == "coordl") for spec in scenario.jobs),
            key=lambda j: (j.spec.submit, j.name),
        )
        self.all = list(self.pending)
        self.active: list[_Job] = []
        self.running: list[_Job] = []  # active jobs with GPUs, in `active` order
        self.running_units: dict[str, list[_Job]] = {}  # the same by unit
        self._readers: dict[str, list[_Job]] | None = None  # by unit; None: rebuild
        self.filled: dict[str, float] = {key: 0.0 for key in self.cluster.units}
        self.allocated: dict[str, float] = {key: 0.0 for key in self.cluster.units}
        self.in_use: set[str] = set()  # units allocated or holding bytes (see _apply)
        self.equal_for: tuple[str, ...] | None = None  # the jobs equal_rate is for
        self.lru = False
        self.resident: dict[str, float] = {}  # LRU: bytes of each dataset held
        self.target: dict[str, float] = {}  # LRU: steady-state holding
        self.lru_time: float | None = None  # LRU: the pool's characteristic time, last
        self.timeline: list[tuple[float, float, float]] = []
        self.dirty = True
        # While a cache fills, its effective size changes: re-plan every `interval`, as
        # the live controller does, and whenever a unit becomes full.
        self.interval = interval
        self.next_plan = math.inf
        self.steps = 0  # events simulated
        self.plans = 0  # policy runs
        # Set by request_stop (e.g. from a SIGINT handler); run() ends after the current
        # step, so the partial results are of a consistent state.
        self.stop_requested = False
        self.soonest_job_event = math.inf  # from now, set by _rates
        self.totals = (0.0, 0.0)  # total data rate and remote rate, set by _rates

    def request_stop(self) -> None:
        self.stop_requested = True

    # ------------------------------------------------------------------ driver

    def run(self) -> SimResult:
        self._arrivals()
        while (self.pending or self.active) and not self.stop_requested:
            if self.dirty:
                self._reschedule()
            self._rates()
            dt = self._step()
            self._record()
            self._advance(dt)
            self._boundaries()
            self.steps += 1
            if self.steps > _MAX_STEPS:
                raise SimulationError(f"gave up after {_MAX_STEPS} steps at t={self.now:.0f}s")
        return self._result()

    def _step(self) -> float:
        """Time to the next event: the soonest job event (_rates found it), arrival,
        re-plan, or a unit filling up."""
        candidates = [self.pending[0].spec.submit - self.now] if self.pending else []
        candidates.append(self.next_plan - self.now)
        candidates.append(self.soonest_job_event)
        candidates.extend(self._fill_steps())
        finite = [max(0.0, c) for c in candidates if c < math.inf]
        if not finite:
            stuck = ", ".join(j.name for j in self.active)
            raise SimulationError(f"jobs can make no progress at t={self.now:.0f}s: {stuck}")
        return min(finite)

    def _fill_steps(self) -> list[float]:
        out = []
        everyone = self._unit_readers()
        for key, fetching in self.running_units.items():  # only running jobs fetch
            readers = everyone[key]
            inflow = sum(j.remote for j in fetching)
            if inflow <= 0:
                continue
            size = self.cluster.units[key].size
            if self.lru:
                dataset = self.cluster.units[key].dataset
                room = self.target.get(dataset, 0.0) - self.resident.get(dataset, 0.0)
            else:
                room = min(self.allocated[key], size) - self.filled[key]
            if room > 0:
                out.append(room / inflow)
                if len(readers) > 1:
                    out.append(_SHARED_FILL_STEP * size / inflow)
        return out

    def _unit_readers(self) -> dict[str, list[_Job]]:
        """Active jobs by the unit they read, in `active` order. Kept until the active set
        changes (arrivals and completions reset it), as every step needs it twice."""
        if self._readers is None:
            out: dict[str, list[_Job]] = {}
            for job in self.active:
                out.setdefault(job.unit, []).append(job)
            self._readers = out
        return self._readers

    # -------------------------------------------------------------- decisions

    def _reschedule(self) -> None:
        self.plans += 1
        views = [self._view(job) for job in self.active]
        cluster = replace(self.cluster, cached=None if self.lru else dict(self.filled))
        alloc = self.policy.allocate(views, cluster, self.estimator)
        if self.cache_policy is not None:
            self.cache_policy.fill_cache(views, cluster, alloc)
        self._apply(alloc)
        # (after _apply: LRU targets are set with the rates of the step that ended)
        for job in self.active:
            if job.share <= 0:
                job.rate = job.remote = 0.0
        self.running = [job for job in self.active if job.share > 0]
        self.running_units = {}
        for job in self.running:
            self.running_units.setdefault(job.unit, []).append(job)
        self.next_plan = self.now + self.interval if self._filling() else math.inf
        # The equal share depends on the set of active jobs only: most re-plans (a cache
        # filling, an epoch starting) keep it.
        names = tuple(j.name for j in self.active)
        if names != self.equal_for:
            equal = equal_share_perf(
                [self._reference_view(j) for j in self.active], self.reference, SiloDEstimator()
            )
            for job in self.active:
                job.equal_rate = equal[job.name]
            self.equal_for = names
        self.dirty = False

    def _filling(self) -> bool:
        """Is some read unit still below its allocation (so the plan will change)?"""
        if self.lru:
            return False
        return any(
            self.filled[j.unit] < min(self.allocated[j.unit], j.size) - j.tol() for j in self.active
        )

    def _view(self, job: _Job) -> Job:
        return Job(
            name=job.name,
            dataset=job.spec.dataset,
            gpus=job.spec.gpus,
            f_star=job.spec.ideal_io,
            reads={job.unit: 1.0},
            remaining=max(0.0, job.work - job.read),
            submit=job.spec.submit,
            placement=job.placement if job.share > 0 else None,
            hit_now=None if self.lru else self._hit(job),
        )

    def _reference_view(self, job: _Job) -> Job:
        view = self._view(job)
        return Job(view.name, view.dataset, view.gpus, view.f_star, {job.spec.dataset: 1.0})

    def _apply(self, alloc: Allocation) -> None:
        for job in self.active:
            job.share = min(1.0, alloc.gpu_share.get(job.name, 0.0))
            job.placement = alloc.placement.get(job.name)
            job.io_cap = alloc.io.get(job.name)
            if job.share > 0 and job.start is None:
                job.start = self.now
        self.lru = alloc.lru
        if self.lru:
            self._lru_targets()
            return
        readers = self._unit_readers()
        # Units neither allocated nor holding anything, and not in the new allocation,
        # stay as they are: only the others are visited (CoorDL has a unit per job of
        # the whole trace, most of them long finished or not yet arrived).
        for key in self.in_use | alloc.cache.keys():
            want = max(0.0, alloc.cache.get(key, 0.0))
            self.allocated[key] = want
            if self.filled[key] > want:
                self._evict(key, want, readers.get(key, []))
        self.in_use = {k for k in self.in_use | alloc.cache.keys() if self._used(k)}

    def _used(self, key: str) -> bool:
        return self.allocated[key] > 0 or self.filled[key] > 0

    def _evict(self, key: str, keep: float, readers: list[_Job]) -> None:
        """Shrinking evicts random cached items: every reader loses the same fraction."""
        held = self.filled[key]
        for job in readers:
            job.effective *= keep / held if held > 0 else 0.0
        self.filled[key] = keep

    def _lru_targets(self) -> None:
        rates: dict[str, list[float]] = {}
        sizes: dict[str, float] = {}
        for job in self.active:
            rate = job.rate if job.rate > 0 else job.share * job.spec.ideal_io
            rates.setdefault(job.spec.dataset, []).append(rate)
            sizes[job.spec.dataset] = job.size
        self.target, self.lru_time = sim_lru.holdings_at(
            self.cluster.total_cache, sizes, rates, self.lru_time
        )
        for dataset in list(self.resident):
            self.resident[dataset] = min(self.resident[dataset], self.target.get(dataset, 0.0))

    # ------------------------------------------------------------------ rates

    def _rates(self) -> None:
        # Jobs without GPUs (waiting, preempted) have no rate and fetch nothing
        # (_reschedule zeroed them); a zero demand changes no one's max-min share, so
        # they are left out.
        demands: dict[str, float] = {}
        for job in self.running:
            job.hit = self._hit(job)
            need = job.share * job.spec.ideal_io * (1.0 - job.hit)
            demands[job.name] = need if job.io_cap is None else min(need, job.io_cap)
        shares = water_fill(self.scenario.remote_io, demands)
        # One pass sets the rates and, while at it, finds the soonest job event (its end,
        # its epoch's end, the end of its LRU segment) and the totals _record keeps:
        # the event loop's cost is passes over the active jobs.
        soonest = math.inf
        total_rate = total_remote = 0.0
        for job in self.running:
            gpu_rate = job.share * job.spec.ideal_io
            if job.hit >= 1.0 - 1e-12:
                job.rate, job.remote = gpu_rate, 0.0
            else:
                job.remote = shares[job.name]
                job.rate = min(gpu_rate, job.remote / (1.0 - job.hit))
            rate = job.rate
            total_rate += rate
            total_remote += job.remote
            if rate > 0:
                soonest = min(
                    soonest,
                    (job.work - job.read) / rate,
                    max(0.0, job.size - job.pos) / rate,
                    (job.boundary * job.size - job.pos) / rate
                    if job.boundary < math.inf
                    else math.inf,
                )
        self.soonest_job_event = soonest
        self.totals = (total_rate, total_remote)

    def _hit(self, job: _Job) -> float:
        job.boundary = math.inf
        if not self.lru:
            unread = max(0.0, job.size - job.pos)
            if unread <= job.eps:
                return min(1.0, self.filled[job.unit] / job.size)
            return min(1.0, job.effective / unread)
        if job.epochs_done == 0:
            return job.first_hit
        held = min(self.resident.get(job.spec.dataset, 0.0), self.target.get(job.spec.dataset, 0.0))
        r = held / job.size
        y = job.pos / job.size
        if r >= 1.0:
            return 1.0
        if y >= r:
            return 0.0
        step = r / _LRU_SEGMENTS
        job.boundary = min(r, (math.floor(y / step + 1e-9) + 1) * step)
        return sim_lru.hit_between(r, y, job.boundary)

    # ------------------------------------------------------------------- time

    def _advance(self, dt: float) -> None:
        inflow: dict[str, list[tuple[_Job, float]]] = {}
        for job in self.active:  # waiting counts: fairness is over the job's lifetime
            job.equal_integral += job.equal_rate * dt
        for job in self.running:
            if job.rate <= 0:
                continue
            got = job.rate * dt
            unread = max(0.0, job.size - job.pos)
            if not self.lru and unread > 0:
                job.effective *= max(0.0, unread - got) / unread  # H/unread stays constant
            job.read += got
            job.pos += got
            job.hit_bytes += got * job.hit
            job.epoch_hits += got * job.hit
            job.remote_bytes += job.remote * dt
            if job.remote > 0 or self.lru:  # fetching nothing fills nothing
                inflow.setdefault(job.unit, []).append((job, job.remote * dt))
        if self.lru:
            self._lru_fill(inflow)
        else:
            self._uniform_fill(inflow)
        self.now += dt

    def _uniform_fill(self, inflow: dict[str, list[tuple[_Job, float]]]) -> None:
        readers = self._unit_readers()
        for key, fetched in inflow.items():
            size = self.cluster.units[key].size
            room = max(0.0, min(self.allocated[key], size) - self.filled[key])
            if room <= 0:
                continue
            total = sum(b for _, b in fetched)
            if total <= 0:
                continue
            admit = min(total, room)
            uncached = max(size - self.filled[key], 1e-9)
            by_job = {job.name: admit * b / total for job, b in fetched}
            for other in readers.get(key, []):
                # what others admitted is new to `other` unless it already read it
                new = admit - by_job.get(other.name, 0.0)
                if new > 0:
                    frac = max(0.0, other.unread - other.effective) / uncached
                    other.effective = min(other.unread, other.effective + new * min(1.0, frac))
            self.filled[key] += admit
            if self.filled[key] >= min(self.allocated[key], size) - max(1.0, size * 1e-12):
                self.dirty = True  # full: what the policy planned with has changed

    def _lru_fill(self, inflow: dict[str, list[tuple[_Job, float]]]) -> None:
        for key, fetched in inflow.items():
            dataset = self.cluster.units[key].dataset
            held = self.resident.get(dataset, 0.0) + sum(b for _, b in fetched)
            self.resident[dataset] = min(held, self.target.get(dataset, 0.0))

    def _boundaries(self) -> None:
        for job in list(self.active):
            if job.work - job.read <= job.eps:
                self._close_epoch(job)
                job.finish = self.now
                self.active.remove(job)
                self._readers = None
                self.dirty = True
            elif job.size - job.pos <= job.eps:  # unread <= eps
                self._close_epoch(job)
                job.pos = 0.0
                job.epochs_done += 1
                job.effective = self.filled[job.unit] if not self.lru else 0.0
                if self.lru:
                    self._lru_targets()
                elif abs(self._hit(job) - job.hit) > _REPLAN_HIT_CHANGE:
                    self.dirty = True  # what it fetched last epoch is effective now
        if self.now >= self.next_plan - 1e-9:
            self.dirty = True
        self._arrivals()

    def _close_epoch(self, job: _Job) -> None:
        if job.pos > 0:
            job.epoch_hit_ratios.append(job.epoch_hits / job.pos)
        job.epoch_hits = 0.0

    def _arrivals(self) -> None:
        while self.pending and self.pending[0].spec.submit <= self.now + 1e-9:
            job = self.pending.pop(0)
            # everything cached is unread by a new job: effective from its first epoch
            job.effective = self.filled[job.unit]
            held = self.resident.get(job.spec.dataset, 0.0)
            job.first_hit = min(1.0, held / job.size)
            self.active.append(job)
            self._readers = None
            self.dirty = True

    # ---------------------------------------------------------------- results

    def _record(self) -> None:
        point = (self.now, *self.totals)
        if self.timeline and self.timeline[-1][1:] == point[1:]:
            return
        self.timeline.append(point)

    def _result(self) -> SimResult:
        jobs = [
            JobResult(
                name=j.name,
                submit=j.spec.submit,
                start=j.start,
                finish=j.finish,
                bytes_read=j.read,
                hit_bytes=j.hit_bytes,
                remote_bytes=j.remote_bytes,
                fairness=(j.work if j.finish is not None else j.read) / j.equal_integral
                if j.equal_integral > 0
                else 1.0,
                epoch_hit_ratios=j.epoch_hit_ratios,
            )
            for j in sorted(self.all, key=lambda j: (j.spec.submit, j.name))
        ]
        self.timeline.append((self.now, 0.0, 0.0))
        return SimResult(
            self.scenario.name,
            self.scheduler_name,
            self.cache_name,
            jobs,
            self.timeline,
            interrupted=bool(self.pending or self.active),
            until=self.now,
        )


def _cluster(scenario: Scenario, *, private: bool) -> Cluster:
    node_gpus = {n.name: n.gpus for n in scenario.nodes}
    node_cache = {n.name: float(n.cache) for n in scenario.nodes}
    if not private:
        sizes = {ds: float(size) for ds, size in scenario.datasets.items()}
        return Cluster.pooled(node_gpus, node_cache, scenario.remote_io, sizes)
    units = {
        f"job:{j.name}": CacheUnit(f"job:{j.name}", POOL, j.dataset, float(j.dataset_size))
        for j in scenario.jobs
    }
    pools = {POOL: float(sum(node_cache.values()))}
    return Cluster(node_gpus, node_cache, scenario.remote_io, pools, units)


def _job_state(spec: JobSpec, *, private: bool) -> _Job:
    unit = f"job:{spec.name}" if private else spec.dataset
    size = float(spec.dataset_size)
    return _Job(spec=spec, unit=unit, size=size, work=spec.epochs * size)


def simulate(scenario: Scenario, scheduler: str, cache: str, interval: float = 600.0) -> SimResult:
    """Run `scenario` to completion under a scheduler and a cache system."""
    return Simulation(scenario, scheduler, cache, interval).run()
