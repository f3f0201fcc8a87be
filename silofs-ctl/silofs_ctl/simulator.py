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

The loop is incremental (Simulation's docstring): a step costs the jobs its event
touches, not every active job; a re-plan costs every active job.
"""

from __future__ import annotations

import heapq
import logging
import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from itertools import accumulate, compress, count
from operator import gt, itemgetter, sub, truediv

from . import sim_lru
from .estimator import ComputeEstimator, Estimator, SiloDEstimator
from .model import POOL, Allocation, CacheUnit, Cluster, Job
from .policies import CACHES, SCHEDULERS
from .policies.base import HITS, REMAINING, CachePolicy, Policy
from .policies.gavel import GavelPolicy
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
    gpus: int = 0
    dataset: str = ""

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
    # (time, worst, average) over the active jobs of rate / equal-share rate, at each plan
    fairness_timeline: list[tuple[float, float, float]] = field(default_factory=list)
    # per job, (time, rate) at each change; only when asked for (Simulation(job_rates=True))
    job_rates: dict[str, list[tuple[float, float]]] | None = None

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

    @property
    def worst(self) -> JobResult | None:
        """The job with the lowest fairness ratio (what Eq. 9 lifts)."""
        return min(self.jobs, key=lambda j: j.fairness, default=None)

    def to_dict(self) -> dict:
        worst = self.worst
        return {
            "scenario": self.scenario,
            "scheduler": self.scheduler,
            "cache": self.cache,
            "avg_jct_s": _finite(self.avg_jct),
            "makespan_s": _finite(self.makespan),
            "avg_fairness": self.avg_fairness,
            "worst_fairness": worst.fairness if worst else None,
            "worst_job": worst.name if worst else None,
            "interrupted": self.interrupted,
            "simulated_s": self.until,
            "jobs": [
                {
                    "name": j.name,
                    "gpus": j.gpus,
                    "dataset": j.dataset,
                    "submit_s": j.submit,
                    "start_s": j.start,
                    "finish_s": j.finish,
                    "jct_s": j.jct,
                    "hit_ratio": j.hit_ratio,
                    "epoch_hit_ratios": j.epoch_hit_ratios,
                    "remote_bytes": j.remote_bytes,
                    "fairness": j.fairness,
                }
                for j in self.jobs
            ],
            # the cluster from each instant to the next: total data rate and remote IO
            "timeline": [
                {"t_s": t, "throughput_bytes_per_s": rate, "remote_bytes_per_s": remote}
                for t, rate, remote in self.timeline
            ],
            # at each plan, rate / equal-share rate over the jobs present: worst and mean
            "fairness_timeline": [
                {"t_s": t, "worst": worst_ratio, "average": mean}
                for t, worst_ratio, mean in self.fairness_timeline
            ],
        }


def _finite(x: float) -> float | None:
    """JSON has no NaN: an average of nothing is null."""
    return None if math.isnan(x) else x


# slots: the event loop reads and writes these fields for every active job at every
# re-plan, and slot access is the cheaper one; eq=False: a job is itself alone (it is
# found in lists by identity, and hashes as itself).
@dataclass(slots=True, eq=False)
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
    t: float = 0.0  # when the fields above were last brought up to date (_sync)
    seq: int = -1  # its latest event in Simulation.events; -1: none
    event_boundary: float = math.inf  # the LRU boundary that event was computed with
    lru_held: float = -1.0  # LRU: the dataset's holding its hit ratio was computed with
    view: Job | None = None  # its policy view, kept while the plan reads nothing (_view)
    # Held at the link's level on the level clock (Simulation.held): its rate and remote
    # are then level / (1 - hit) and level, not the fields above, and it read
    # (vclock - v) / (1 - hit) bytes since t.
    held: bool = False
    v: float = 0.0
    held_k: float = 0.0  # 1 / (1 - hit) when it joined (what held_k sums)
    # Fixed for the job's life; plain attributes because the event loop reads them for
    # every active job at every step.
    name: str = field(init=False)
    eps: float = field(init=False)  # bytes that count as nothing left (rounding)
    reads: dict[str, float] = field(init=False)  # its views' Job.reads (never changed)

    def __post_init__(self) -> None:
        self.name = self.spec.name
        self.eps = max(1.0, self.size * 1e-12)
        self.reads = {self.unit: 1.0}

    @property
    def unread(self) -> float:
        return max(0.0, self.size - self.pos)

    def tol(self) -> float:
        return self.eps


class Simulation:
    """One run of a scenario with a scheduler and a cache system.

    The event loop is incremental: a job's progress is brought up to date (_sync) only
    when something about it changes or is read, and a step only recomputes the rates of
    the jobs an event touched (plus, when the link is contended, the jobs whose max-min
    share moved). Between two updates a job's rate, remote IO and hit ratio are constant,
    so bringing it up to date over many steps at once is the same arithmetic as doing it
    step by step. A re-plan brings everything up to date and recomputes every rate.

    Under LRU (and without per-job rate logs) the jobs held at the link's fair level are
    on a level clock (self.held, _held_enter): a move of the level that keeps them held
    costs the units they read, not each of them; their progress is the integral of the
    level since they were last brought to now (the same to rounding as adding rate x dt
    at each move) and their events are marks on that integral (self.vevents).
    """

    def __init__(
        self,
        scenario: Scenario,
        scheduler: str,
        cache: str,
        interval: float = 600.0,
        *,
        lru_segments: int = _LRU_SEGMENTS,
        job_rates: bool = False,
    ) -> None:
        if scheduler not in SCHEDULERS:
            raise SimulationError(f"unknown scheduler {scheduler!r} (try {', '.join(SCHEDULERS)})")
        if cache not in CACHE_CHOICES:
            raise SimulationError(f"unknown cache {cache!r} (try {', '.join(CACHE_CHOICES)})")
        if lru_segments < 1:
            raise SimulationError("lru_segments must be at least 1")
        self.scenario = scenario
        self.scheduler_name, self.cache_name = scheduler, cache
        self.policy: Policy = SCHEDULERS[scheduler]()
        if isinstance(self.policy, GavelPolicy) and cache == "alluxio":
            self.policy.closed_form = False  # (see GavelPolicy)
        self.cache_policy: CachePolicy | None = None if cache == "silod" else CACHES[cache]()
        self.estimator: Estimator = SiloDEstimator() if cache == "silod" else ComputeEstimator()
        # What the policies' plan depends on besides the set of jobs (policies/base.py
        # PLAN_INPUTS): with none of it, re-planning the same jobs gives the same plan.
        self.plan_reads = self.policy.reads(self.estimator) | (
            self.cache_policy.reads if self.cache_policy is not None else frozenset()
        )
        self.jobs_moved = True  # a job arrived or left since the policy last ran
        if scenario.per_node and cache == "alluxio":
            raise SimulationError("alluxio is one LRU across the nodes, not per-node caches")
        # Per-node caches: a dataset is held once per reader, not once (_cluster).
        private = cache == "coordl" or scenario.per_node
        per_node = scenario.per_node and cache != "coordl"  # CoorDL's are per job anyway
        self.cluster = _cluster(scenario, private=private, per_node=per_node)
        # Fairness is judged against the same reference for every policy pair.
        self.reference = _cluster(scenario, private=False)
        self.now = 0.0
        self.pending = sorted(
            (_job_state(spec, private=private) for spec in scenario.jobs),
            key=lambda j: (j.spec.submit, j.name),
        )
        self.pending.reverse()  # popped from the end: soonest submission last
        self.all = list(reversed(self.pending))
        self.active: dict[str, _Job] = {}  # in arrival order
        self.running: dict[str, _Job] = {}  # active jobs with GPUs
        # Active jobs by the unit they read, in arrival order (a unit without one has no
        # entry): kept as jobs arrive and leave.
        self.readers: dict[str, list[_Job]] = {}
        self.dataset_readers: dict[str, int] = {}  # active jobs per dataset
        self.filled: dict[str, float] = {key: 0.0 for key in self.cluster.units}
        self.allocated: dict[str, float] = {key: 0.0 for key in self.cluster.units}
        self.in_use: set[str] = set()  # units allocated or holding bytes (see _apply)
        # Per unit: remote bytes/s its running readers fetch into it, and when `filled`
        # (or, under LRU, `resident`) was last brought up to date with it.
        self.inflow: dict[str, float] = {}
        self.unit_t: dict[str, float] = {}
        self.filling: set[str] = set()  # units with inflow and room: they bound steps
        self.equal_for: tuple[str, ...] | None = None  # the jobs equal_rate is for
        self.lru = False
        self.lru_segments = lru_segments
        self.resident: dict[str, float] = {}  # LRU: bytes of each dataset held
        self.target: dict[str, float] = {}  # LRU: steady-state holding
        self.lru_time: float | None = None  # LRU: the pool's characteristic time, last
        # LRU: what the holdings were last found for (each running reader's dataset, rate
        # ceiling and IO cap: nothing else moves them), and the readers' rates there by
        # job name, to start the next search from (see _lru_targets).
        self.lru_key: tuple[tuple[str, float, float | None], ...] | None = None
        self.lru_rates: dict[str, float] = {}
        # LRU: datasets whose holding is below its target, still growing with inflow
        self.growing: set[str] = set()
        self.timeline: list[tuple[float, float, float]] = []
        # (time, worst, average) of rate / equal-share rate over the active jobs, at plans
        self.fairness_timeline: list[tuple[float, float, float]] = []
        self.job_rates: dict[str, list[tuple[float, float]]] | None = {} if job_rates else None
        self.dirty = True
        # While a cache fills, its effective size changes: re-plan every `interval`, as
        # the live controller does, and whenever a unit becomes full.
        self.interval = interval
        self.next_plan = math.inf
        self.steps = 0  # events simulated
        self.plans = 0  # policy runs
        self.kept_plans = 0  # re-plans that kept the last plan (nothing it reads moved)
        # Set by request_stop (e.g. from a SIGINT handler); run() ends after the current
        # step, so the partial results are of a consistent state.
        self.stop_requested = False
        # Job events (its end, its epoch's end, its LRU segment's end) as (time, seq, job);
        # an entry is stale unless seq is the job's latest.
        self.events: list[tuple[float, int, _Job]] = []
        self.seq = 0
        self.touched: dict[str, _Job] = {}  # jobs whose rate an event may have changed
        self.demand: dict[str, float] = {}  # running jobs' remote demand, capped
        # The demands in the order water_fill_capped sorts them, kept as they move:
        # (demand, position in self.demand, name) ascending (a stable sort by demand);
        # None: to be made again from self.demand (see _wf_build, _wf_divide).
        self.wf: list[tuple[float, int, str]] | None = None
        self.wf_values: list[float] = []  # the demands of self.wf, in its order
        self.wf_pos: dict[str, int] = {}
        self.contended = False  # demands exceeded the link at the last water fill
        # The water level of that fill when contended: the share of every demand above it.
        self.level = math.inf
        self.capped: list[str] = []  # the jobs held below their demand by that fill
        self.fair: float | None = None  # the level they were held at
        self.total_rate = self.total_remote = 0.0
        # The level clock (LRU pools, without per-job rate logs): the jobs held at the
        # link's level whose division did not move them out are not re-rated when the
        # level moves; each reads level / (1 - hit), so its progress is the integral of
        # the level since it was last brought to now (vclock, the integral since t=0),
        # and its next event is where vclock reaches a mark (vevents, like events but in
        # vclock). hfair is their remote (the fair level they are held at); the inflows
        # and the totals count them at it. Re-plans let them all go first.
        self.clocked = False  # set per plan: self.lru and no job_rates
        self.held: dict[str, _Job] = {}
        self.held_units: dict[str, int] = {}  # held jobs per unit
        self.held_k = 0.0  # sum of their 1 / (1 - hit)
        self.hfair = 0.0
        self.vclock = 0.0
        self.vevents: list[tuple[float, int, _Job]] = []
        self.clock_entries = 0  # jobs put on the level clock (for tests and profiles)

    def request_stop(self) -> None:
        self.stop_requested = True

    # ------------------------------------------------------------------ driver

    def run(self) -> SimResult:
        self._arrivals()
        while (self.pending or self.active) and not self.stop_requested:
            if self.dirty:
                self._reschedule()
            elif self.touched:
                self._rerate(list(self.touched.values()))
            self.touched = {}
            dt = self._step()
            self._record()
            self.now += dt
            self.vclock += self.hfair * dt
            self._shared_fill()
            self._boundaries()
            self.steps += 1
            if self.steps > _MAX_STEPS:
                raise SimulationError(f"gave up after {_MAX_STEPS} steps at t={self.now:.0f}s")
        return self._result()

    def _step(self) -> float:
        """Time to the next event: a job's, an arrival, a re-plan, a unit filling up, or
        the bounded step of a dataset several jobs fill."""
        soonest = self.next_plan
        if self.pending:
            soonest = min(soonest, self.pending[-1].spec.submit)
        events = self.events
        while events and events[0][1] != events[0][2].seq:
            heapq.heappop(events)  # stale
        if events:
            soonest = min(soonest, events[0][0])
        vevents = self.vevents
        while vevents and vevents[0][1] != vevents[0][2].seq:
            heapq.heappop(vevents)  # stale
        if vevents and self.hfair > 0:
            soonest = min(soonest, self.now + (vevents[0][0] - self.vclock) / self.hfair)
        soonest -= self.now
        if not self.lru and self.filling:
            readers = self._unit_readers()
            now, inflows, filled, allocated = self.now, self.inflow, self.filled, self.allocated
            units, unit_t = self.cluster.units, self.unit_t
            for key in self.filling:  # (min, max and _filled_now written out)
                inflow = inflows[key]
                size = units[key].size
                cap = allocated[key]
                if size < cap:
                    cap = size
                held = filled[key]
                if inflow > 0:
                    grown = held + inflow * (now - unit_t[key])
                    if not grown < cap:
                        grown = cap
                    if grown > held:
                        held = grown
                room = cap - held
                if room > 0:
                    until = room / inflow
                    if until < soonest:
                        soonest = until
                    if len(readers.get(key, ())) > 1:
                        until = _SHARED_FILL_STEP * size / inflow
                        if until < soonest:
                            soonest = until
        if soonest == math.inf:
            stuck = ", ".join(self.active)
            raise SimulationError(f"jobs can make no progress at t={self.now:.0f}s: {stuck}")
        return max(0.0, soonest)

    def _unit_readers(self) -> dict[str, list[_Job]]:
        """Active jobs by the unit they read, in arrival order."""
        return self.readers

    # ------------------------------------------------------ bringing up to date

    def _sync(self, job: _Job) -> None:
        """Bring `job` to now: it read at a constant rate since job.t."""
        dt = self.now - job.t
        if dt <= 0:
            return
        job.t = self.now
        job.equal_integral += job.equal_rate * dt  # waiting counts: fairness is over its life
        if job.held:  # (LRU: no H to keep)
            fetched = self.vclock - job.v
            job.v = self.vclock
            got = fetched / (1.0 - job.hit)
            job.read += got
            job.pos += got
            job.hit_bytes += got * job.hit
            job.epoch_hits += got * job.hit
            job.remote_bytes += fetched
            return
        rate = job.rate
        if rate <= 0:
            return
        got = rate * dt
        unread = job.size - job.pos
        if not self.lru and unread > 0:
            job.effective *= max(0.0, unread - got) / unread  # H/unread stays constant
        job.read += got
        job.pos += got
        job.hit_bytes += got * job.hit
        job.epoch_hits += got * job.hit
        job.remote_bytes += job.remote * dt

    def _filled_now(self, key: str) -> float:
        """What unit `key` holds now, without bringing it up to date."""
        inflow = self.inflow.get(key, 0.0)
        held = self.filled[key]
        if inflow <= 0:
            return held
        cap = min(self.allocated[key], self.cluster.units[key].size)
        return max(held, min(cap, held + inflow * (self.now - self.unit_t[key])))

    def _sync_unit(self, key: str) -> None:
        """Bring a unit's fill to now: its readers fetched at a constant total rate since
        unit_t. A uniform unit admits up to its allocation (becoming full re-plans); an
        LRU dataset's holding grows up to its steady-state target."""
        inflow = self.inflow.get(key, 0.0)
        last = self.unit_t.get(key, self.now)
        self.unit_t[key] = self.now
        if inflow <= 0 or self.now <= last:
            return
        fetched = inflow * (self.now - last)
        if self.lru:
            dataset = self.cluster.units[key].dataset
            held = self.resident.get(dataset, 0.0) + fetched
            self.resident[dataset] = min(held, self.target.get(dataset, 0.0))
            return
        size = self.cluster.units[key].size
        cap = min(self.allocated[key], size)
        if self.filled[key] >= cap:
            return
        self.filled[key] = min(cap, self.filled[key] + fetched)
        if self.filled[key] >= cap - max(1.0, size * 1e-12):
            self.dirty = True  # full: what the policy planned with has changed
            self.filling.discard(key)

    def _sync_all(self) -> None:
        """_sync_unit of every unit and _sync of every active job, inlined: the same
        arithmetic in the same order. (A re-plan brings its jobs to now in _plan_views.)"""
        self._sync_units()
        now, lru = self.now, self.lru
        for job in self.active.values():
            dt = now - job.t
            if dt <= 0:
                continue
            job.t = now
            job.equal_integral += job.equal_rate * dt
            rate = job.rate
            if rate <= 0:
                continue
            got = rate * dt
            unread = job.size - job.pos
            if not lru and unread > 0:
                left = unread - got
                job.effective *= (left if left > 0.0 else 0.0) / unread  # max(0, left)
            job.read += got
            job.pos += got
            hits = got * job.hit
            job.hit_bytes += hits
            job.epoch_hits += hits
            job.remote_bytes += job.remote * dt

    def _sync_units(self) -> None:
        """_sync_unit of every unit with an inflow, inlined."""
        now = self.now
        if self.lru:
            for key in list(self.inflow):
                self._sync_unit(key)
        else:
            unit_t, filled, allocated = self.unit_t, self.filled, self.allocated
            units = self.cluster.units
            for key, inflow in self.inflow.items():
                last = unit_t.get(key, now)
                unit_t[key] = now
                if inflow <= 0 or now <= last:
                    continue
                size = units[key].size
                cap = allocated[key]
                if size < cap:
                    cap = size
                held = filled[key]
                if held >= cap:
                    continue
                held += inflow * (now - last)
                filled[key] = held = held if held < cap else cap  # min(cap, held)
                tol = size * 1e-12
                if held >= cap - (tol if tol > 1.0 else 1.0):
                    self.dirty = True  # full: what the policy planned with has changed
                    self.filling.discard(key)

    # -------------------------------------------------------------- decisions

    def _reschedule(self) -> None:
        if not self.jobs_moved and not self.plan_reads:
            # The same jobs, and nothing the policy reads has moved (a unit filled, an
            # epoch start moved a hit ratio): its plan would be the last one, so it
            # stands. The jobs an event touched are re-rated as at any other step.
            self.kept_plans += 1
            self.dirty = False
            self._rerate(list(self.touched.values()))
            # The re-plan timer still runs: its steps bound shared fills (_shared_fill)
            # as they did when the policy ran, so the run is the same either way.
            self.next_plan = self.now + self.interval if self._filling() else math.inf
            return
        self.plans += 1
        self.jobs_moved = False
        self._held_dissolve()
        self._sync_units()
        active = list(self.active.values())
        views = self._plan_views(active)
        cluster = replace(self.cluster, cached=None if self.lru else dict(self.filled))
        alloc = self.policy.allocate(views, cluster, self.estimator)
        if self.cache_policy is not None:
            self.cache_policy.fill_cache(views, cluster, alloc)
        self._apply(alloc)  # sets self.running, and the running jobs' hits and demands
        # The equal share depends on the set of active jobs only: most re-plans (a cache
        # filling, an epoch starting) keep it.
        names = tuple(self.active)
        if names != self.equal_for:
            self._equal_rates(active)
            self.equal_for = names
        self.dirty = False
        # Jobs whose rate stays keep their event; the sums kept by adding differences
        # are recomputed exactly below.
        # The sums, the inflows and the fairness point come out of the same pass.
        worst, total = self._rerate_plan(active)
        inflow = self.inflow
        if self.lru:
            self.filling = set()
        else:  # _room, inlined
            units, filled, allocated = self.cluster.units, self.filled, self.allocated
            self.filling = set()
            for key in inflow:
                size = units[key].size
                want = allocated[key]
                tol = size * 1e-12
                if filled[key] < (size if size < want else want) - (tol if tol > 1.0 else 1.0):
                    self.filling.add(key)
        if len(self.events) > 4 * len(self.running) + 1024:  # drop stale entries
            self.events = [e for e in self.events if e[1] == e[2].seq]
            heapq.heapify(self.events)
        self.next_plan = self.now + self.interval if self._filling() else math.inf
        if active:
            self.fairness_timeline.append((self.now, worst, total / len(active)))

    def _plan_views(self, active: list[_Job]) -> list[Job]:
        """Every active job brought to now (_sync, inlined: a re-plan re-rates them all),
        and its view for the policy (_view, whose kept views are looked up here)."""
        now, lru, reads = self.now, self.lru, self.plan_reads
        # A waiting job's kept view still holds when the plan does not read hits (its
        # remaining work does not move).
        with_hits = HITS in reads and not lru
        with_remaining = REMAINING in reads
        views = []
        for job in active:
            dt = now - job.t
            if dt > 0:
                job.t = now
                job.equal_integral += job.equal_rate * dt
                rate = job.rate
                if rate > 0:
                    got = rate * dt
                    unread = job.size - job.pos
                    if not lru and unread > 0:
                        left = unread - got
                        job.effective *= (left if left > 0.0 else 0.0) / unread
                    job.read += got
                    job.pos += got
                    hits = got * job.hit
                    job.hit_bytes += hits
                    job.epoch_hits += hits
                    job.remote_bytes += job.remote * dt
            view = job.view
            if not reads:
                if view is None or view.placement != (job.placement if job.share > 0 else None):
                    view = self._view(job)
            elif view is not None and job.share <= 0 and not with_hits:
                if with_remaining:
                    remaining = job.work - job.read
                    remaining = remaining if remaining > 0.0 else 0.0  # max(0, ...)
                else:
                    remaining = math.inf
                if not (
                    view.remaining == remaining and view.placement is None and view.hit_now is None
                ):
                    view = self._view(job)
            else:
                view = self._view(job)
            views.append(view)
        return views

    def _filling(self) -> bool:
        """Is some read unit still below its allocation (so the plan will change)?"""
        if self.lru:
            return False
        filled, allocated = self.filled, self.allocated
        if self.filling:
            # A unit its readers are filling is usually one: look at its readers first
            # (the answer is the same; the scan below would reach them later).
            readers = self._unit_readers()
            for key in self.filling:
                for job in readers.get(key, ()):
                    want, size = allocated[key], job.size
                    if filled[key] < (size if size < want else want) - job.eps:
                        return True
        for job in self.active.values():
            want, size = allocated[job.unit], job.size
            if filled[job.unit] < (size if size < want else want) - job.eps:  # j.tol()
                return True
        return False

    def _view(self, job: _Job) -> Job:
        """The job as the policy sees it. What the plan does not read (Policy.reads) is
        left out: remaining work and the hit ratio now are found only for a plan that
        reads them. The last view is kept and given again while it is equal (a waiting
        job's stays so), or made once when the plan reads neither: views are frozen."""
        spec = job.spec
        reads = self.plan_reads
        placement = job.placement if job.share > 0 else None
        view = job.view
        if not reads:
            if view is None or view.placement != placement:
                view = job.view = Job(
                    job.name, spec.dataset, spec.gpus, spec.ideal_io, job.reads,
                    submit=spec.submit, placement=placement,
                )  # fmt: skip
            return view
        remaining = max(0.0, job.work - job.read) if REMAINING in reads else math.inf
        hit_now = None if self.lru or HITS not in reads else self._hit(job)
        if (
            view is not None
            and view.remaining == remaining
            and view.hit_now == hit_now
            and view.placement == placement
        ):
            return view
        view = job.view = Job(
            job.name,
            spec.dataset,
            spec.gpus,
            spec.ideal_io,
            job.reads,
            remaining,
            spec.submit,
            placement,
            hit_now,
        )
        return view

    def _equal_rates(self, active: list[_Job]) -> None:
        """Each active job's equal-share rate: equal_share_perf of its reference view on
        the reference cluster with SiloD's estimator, in closed form for that cluster (one
        pool; a unit per dataset, read whole). The equal cache of a dataset is its readers'
        per-reader shares added up, m * share here (equal_share_perf adds them one by one:
        the same to rounding); a job's rate then follows from its dataset and GPUs."""
        ref = self.reference
        n = len(active)
        if not n:
            return
        gpus = ref.total_gpus / n
        per_reader = ref.pools.get(POOL, 0.0) / n
        io = ref.remote_io / n
        io_inf = math.isinf(io)
        units = ref.units
        miss: dict[str, float] = {}  # per dataset, 1 - min(1, c/d) (0: an empty dataset)
        for dataset, m in self.dataset_readers.items():
            size = units[dataset].size
            held = m * per_reader
            miss[dataset] = 0.0 if size <= 0 or not held < size else 1.0 - held / size
        for job in active:
            spec = job.spec
            share = 1.0
            if spec.gpus > 0:
                share = gpus / spec.gpus
                if not share < 1.0:  # min(1, gpus / job.gpus)
                    share = 1.0
            value = f = share * spec.ideal_io
            part = miss[spec.dataset]
            if part > 0.0 and not io_inf:
                value = io / part
                if not value < f:
                    value = f
            job.equal_rate = value if value > 0 else f

    def _room(self, key: str) -> bool:
        """Can unit `key` still admit bytes (uniform caching)?"""
        size = self.cluster.units[key].size
        return self.filled[key] < min(self.allocated[key], size) - max(1.0, size * 1e-12)

    def _apply(self, alloc: Allocation) -> None:
        """The plan's shares, placements, IO caps and cache; and each running job's hit
        ratio and capped demand (self.demand, in arrival order), which _rerate_plan
        divides the link by. Every job is up to date (_plan_views)."""
        self.lru = lru = alloc.lru
        if not lru:
            self._allocate_units(alloc.cache)  # first: evictions move hits
        gpu_share, placement, io = alloc.gpu_share, alloc.placement, alloc.io
        now = self.now
        self.running = running = {}
        self.demand = demand = {}
        inf = math.inf
        for job in self.active.values():
            name = job.name
            share = gpu_share.get(name, 0.0)
            job.share = share = share if share < 1.0 else 1.0  # min(1, share)
            job.placement = placement.get(name)
            job.io_cap = cap = io.get(name)
            if share <= 0:  # waiting or preempted: no rate, fetches nothing
                job.rate = job.remote = 0.0
                job.seq = -1  # its events are stale
                continue
            if job.start is None:
                job.start = now
            running[name] = job
            if lru:
                continue  # (hits once the LRU targets are found, below)
            # _hit, uniform caching (min and max written out)
            job.boundary = inf
            unread = job.size - job.pos
            if not unread > 0.0:
                unread = 0.0
            if unread <= job.eps:
                hit = self._filled_now(job.unit) / job.size
            else:
                hit = job.effective / unread
            if not hit < 1.0:
                hit = 1.0
            job.hit = hit
            need = share * job.spec.ideal_io * (1.0 - hit)
            demand[name] = need if cap is None or not cap < need else cap
        if lru:
            self._lru_targets()
            for job in running.values():
                job.hit = hit = self._hit(job)
                need = job.share * job.spec.ideal_io * (1.0 - hit)
                cap = job.io_cap
                demand[job.name] = need if cap is None or not cap < need else cap

    def _allocate_units(self, cache: dict[str, float]) -> None:
        """Each unit's allocation from the plan; a unit holding more than it is given
        now evicts (uniform caching)."""
        # Units neither allocated nor holding anything, and not in the new allocation,
        # stay as they are: only the others are visited (CoorDL has a unit per job of
        # the whole trace, most of them long finished or not yet arrived).
        allocated, filled = self.allocated, self.filled
        keys = self.in_use | cache.keys()
        for key in keys:
            want = cache.get(key, 0.0)
            want = want if want > 0.0 else 0.0  # max(0, want)
            allocated[key] = want
            if filled[key] > want:
                self._evict(key, want, self.readers.get(key, []))
        self.in_use = {k for k in keys if allocated[k] > 0 or filled[k] > 0}

    def _evict(self, key: str, keep: float, readers: list[_Job]) -> None:
        """Shrinking evicts random cached items: every reader loses the same fraction."""
        held = self.filled[key]
        for job in readers:
            job.effective *= keep / held if held > 0 else 0.0
        self.filled[key] = keep

    def _lru_targets(self) -> None:
        """The pool's steady-state holdings (at a re-plan: only GPU shares and IO caps
        move them).

        They are the holdings at the rates they lead to (sim_lru.equilibrium), a function
        of the running readers' datasets, rate ceilings and IO caps alone, so they are
        found again only when one of those changed: not at epoch ends (the rates within
        an epoch slide with the LRU hit profile, the equilibrium does not), nor when a
        re-plan only queued an arrival. The search starts from the last equilibrium's
        rates, so a reader coming or going costs a round or two, not twelve."""
        readers: list[sim_lru.LruReader] = []
        names: list[str] = []
        sizes: dict[str, float] = {}
        for job in self.active.values():
            if job.share <= 0:
                continue  # waiting: reads nothing, holds nothing
            gpu_rate = job.share * job.spec.ideal_io
            readers.append(sim_lru.LruReader(job.spec.dataset, gpu_rate, job.io_cap, job.rate))
            names.append(job.name)
            sizes[job.spec.dataset] = job.size
        key = tuple((r.dataset, r.ceiling, r.io_cap) for r in readers)
        if key == self.lru_key:
            return
        self.lru_key = key
        for unit in list(self.inflow):
            self._sync_unit(unit)  # what was fetched so far counts against the old targets
        old = self.lru_rates
        start = [
            old.get(name) or (r.rate if r.rate > 0 else r.ceiling)
            for name, r in zip(names, readers, strict=True)
        ]
        found = sim_lru.equilibrium(
            self.cluster.total_cache,
            sizes,
            readers,
            self.scenario.remote_io,
            self.lru_time,
            start=start,
        )
        self.target, self.lru_time = found.held, found.time
        self.lru_rates = dict(zip(names, found.rates, strict=True))
        for dataset in list(self.resident):
            self.resident[dataset] = min(self.resident[dataset], self.target.get(dataset, 0.0))
        self.growing = {d for d, want in self.target.items() if self.resident.get(d, 0.0) < want}

    def _lru_grow(self) -> None:
        """Datasets whose holding still grows towards its target: their readers' hit
        ratios moved since they were last rated (an epoch end looks, as the re-target at
        every epoch end did; a reader also looks at each of its own events)."""
        readers = self._unit_readers()
        for dataset in list(self.growing):
            if self.inflow.get(dataset, 0.0) <= 0:
                continue  # nothing fetched into it now: its holding stays
            self._sync_unit(dataset)
            if self.resident.get(dataset, 0.0) >= self.target.get(dataset, 0.0):
                self.growing.discard(dataset)
            for other in readers.get(dataset, ()):
                if other.share > 0 and other.epochs_done > 0:
                    if other.lru_held != self._lru_held(other):
                        self.touched[other.name] = other

    # ------------------------------------------------------------------ rates

    def _rerate(self, jobs: list[_Job], everyone: bool = False) -> None:
        """New rates for `jobs` (brought up to date here), and for any other running job
        whose max-min share of the link moves with their demands."""
        level = self.level
        # Stays True while every demand that moved was and is at or above the water level.
        held = self.contended and not everyone
        for job in jobs:
            self._sync(job)
            if job.held:
                self._held_exit(job)  # its hit ratio may move: re-rated as any other
            if job.share <= 0:
                continue
            job.hit = self._hit(job)
            need = job.share * job.spec.ideal_io * (1.0 - job.hit)
            need = need if job.io_cap is None else min(need, job.io_cap)
            old = self.demand.get(job.name)
            if held:
                was = -1.0 if old is None else old
                held = was == need or (need >= level and was >= level)
            self.demand[job.name] = need
            if old != need:
                self._wf_move(job.name, old, need)
        if held:
            # Demands above the level get the level whatever they are, and the ones below
            # it did not move: water_fill would give the same level and the same shares
            # (thrashing LRU readers held at the level, and the epoch ends of readers that
            # hit everything, change this way).
            for job in jobs:
                if job.share > 0:
                    self._set_rate(job, min(level, self.demand[job.name]))
                    if self.clocked and job.name in self.capped:
                        self._held_enter(job)
            return
        link = self.scenario.remote_io
        contended = sum(self.demand.values()) > link
        if contended or self.contended or everyone:
            # The link is (or was) shared out below some demands: a demand moving can
            # move everyone's share. Jobs whose share stays keep their rate untouched.
            first, fair, top = self._wf_divide(link)
            wf, demand = self.wf, self.demand
            assert wf is not None
            capped = list(map(itemgetter(2), wf[first:]))
            bound = wf[first][:2] if fair is not None else None
            self.level = top if contended else math.inf
            if self.clocked:
                self._held_level(fair, capped)
            pos = self.wf_pos
            for job in jobs:
                if job.share > 0:
                    share = demand[job.name]
                    if bound is not None and (share, pos[job.name]) >= bound:
                        share = fair  # held at the level
                    self._set_rate(job, share)
            if not everyone:
                # Any other job's demand did not move, so unless it is held below its
                # demand now or was at the last division, its share is that same demand;
                # and one held at both, at the same fair level, keeps that level.
                changed = {job.name for job in jobs}
                if fair is not None and fair == self.fair:
                    now, was = set(capped), set(self.capped)
                    others = sorted((now - was) | (was - now))  # sorted: a fixed order
                    self._rerate_others(others, bound, fair, changed)
                else:  # the ones held now (at fair), then the ones held before
                    self._rerate_others(capped, bound, fair, changed, held=True)
                    self._rerate_others(self.capped, bound, fair, changed)
            if self.clocked:
                running = self.running
                for name in capped:
                    self._held_enter(running[name])
            self.capped, self.fair = capped, fair
        else:
            # Every demand is met (water_fill would give each its demand).
            self.level = math.inf
            if self.clocked:
                self._held_level(None, [])
            for job in jobs:
                if job.share > 0:
                    self._set_rate(job, self.demand[job.name])
            self.capped, self.fair = [], None
        self.contended = contended

    # ------------------------------------------------------------ level clock

    def _held_enter(self, job: _Job) -> None:
        """Put a running job (brought to now, its remote the fair level hfair) on the
        level clock, if it may go: its rate is then hfair / (1 - hit) while it is held."""
        hit = job.hit
        if (
            job.held
            or not hit < 1.0 - 1e-12
            or job.remote != self.hfair
            or not job.remote > 0.0
            or job.rate != job.remote / (1.0 - hit)  # (not held back by its GPU share)
        ):
            return
        job.held = True
        job.v = self.vclock
        self.held[job.name] = job
        self.clock_entries += 1
        job.held_k = k = 1.0 / (1.0 - hit)
        self.held_k += k
        self.held_units[job.unit] = self.held_units.get(job.unit, 0) + 1
        self.seq += 1
        job.seq = self.seq
        job.event_boundary = boundary = job.boundary
        heapq.heappush(
            self.vevents, (self.vclock + self._until(job, boundary) * (1.0 - hit), self.seq, job)
        )

    def _held_exit(self, job: _Job) -> None:
        """Take a job off the level clock: brought to now, its rate and remote written out
        (and counted so in the inflows and totals, which held it at them already), with
        its next event in time."""
        self._sync(job)
        job.held = False
        del self.held[job.name]
        self.held_k -= job.held_k
        count = self.held_units[job.unit] - 1
        if count:
            self.held_units[job.unit] = count
        else:
            del self.held_units[job.unit]
        if not self.held:
            self.held_k = 0.0  # (no rounding left over)
        job.remote = remote = self.hfair
        job.rate = rate = remote / (1.0 - job.hit)
        self.seq += 1
        job.seq = self.seq
        job.event_boundary = boundary = job.boundary
        if rate > 0:
            until = self._until(job, boundary)
            heapq.heappush(self.events, (self.now + until / rate, self.seq, job))

    def _held_level(self, fair: float | None, capped: list[str]) -> None:
        """A new division of the link: the held jobs it does not hold (not in `capped`)
        leave the clock at the old level; the others, and the inflows and totals that
        count them, move to the new level `fair`."""
        held = self.held
        if held:
            if fair is None:
                for job in list(held.values()):
                    self._held_exit(job)
            else:
                keep = set(capped)
                for job in [j for name, j in held.items() if name not in keep]:
                    self._held_exit(job)
        step = (fair if fair is not None else 0.0) - self.hfair
        if held and step:
            inflows, growing = self.inflow, self.growing
            for unit, count in self.held_units.items():
                if unit in growing:
                    self._sync_unit(unit)
                inflow = inflows.get(unit, 0.0) + count * step
                inflows[unit] = inflow if inflow > 1e-9 else 0.0
            self.total_remote += step * len(held)
            self.total_rate += step * self.held_k
        self.hfair = fair if fair is not None else 0.0

    def _held_dissolve(self) -> None:
        """Every held job off the level clock (a re-plan re-rates them all)."""
        for job in list(self.held.values()):
            self._held_exit(job)
        self.vevents = []
        self.held_k = 0.0

    def _until(self, job: _Job, boundary: float) -> float:
        """Bytes to the job's next event: its end, its epoch's, its LRU segment's."""
        until = job.work - job.read
        left = job.size - job.pos
        if left < until:
            until = left
        if boundary < math.inf:
            left = boundary * job.size - job.pos
            if left < until:
                until = left
        return until if until > 0.0 else 0.0

    def _wf_build(self) -> None:
        """self.wf made from self.demand: sorted by demand, ties in the dict's order."""
        names = list(self.demand)
        self.wf_pos = dict(zip(names, range(len(names)), strict=True))
        # Keyed by the demand alone (float keys compare fastest) and stable: ties stay in
        # position order, as sorting the whole (demand, position, name) tuples gives.
        self.wf = wf = sorted(
            zip(self.demand.values(), range(len(names)), names, strict=True), key=itemgetter(0)
        )
        self.wf_values = list(map(itemgetter(0), wf))

    def _wf_move(self, name: str, old: float | None, new: float) -> None:
        """Keep self.wf in step with one demand moving from `old` (None: new)."""
        wf = self.wf
        if wf is None:
            return
        pos = self.wf_pos.get(name)
        if old is None or pos is None:
            self.wf = None  # a new name: its place in the dict's order is the last
            return
        values = self.wf_values
        at = bisect_left(wf, (old, pos))
        del wf[at], values[at]
        item = (new, pos, name)
        at = bisect_right(wf, item)  # (insort's place)
        wf.insert(at, item)
        values.insert(at, new)

    def _wf_divide(self, link: float) -> tuple[int, float | None, float]:
        """water_fill_capped(link, self.demand) from the kept order: the position in
        self.wf of the first demand held below itself (len(self.wf): none), the fair level
        (None: nobody held) and the largest share (0 without demands). Demands before
        that position get themselves, the others the fair level. The same arithmetic:
        what is left, smallest demand first, subtracted one by one."""
        if self.wf is None:
            self._wf_build()
        wf = self.wf
        assert wf is not None
        n = len(wf)
        values = self.wf_values
        if math.isinf(link):
            return n, None, values[-1] if n else 0.0
        lefts = list(accumulate(values, sub, initial=link))
        first = next(compress(count(), map(gt, values, map(truediv, lefts, range(n, 0, -1)))), n)
        if first == n:
            return n, None, values[-1] if n else 0.0
        fair = lefts[first] / (n - first)
        top = values[first - 1] if first > 0 and values[first - 1] > fair else fair
        return first, fair, top

    def _rerate_others(
        self,
        others: Iterable[str],
        bound: tuple[float, int] | None,
        fair: float | None,
        changed: set[str],
        held: bool = False,
    ) -> None:
        """_sync and _set_rate, inlined, for each job in `others` whose link share moved
        (a level change moves every job held at the level: _rerate's hot loop). The same
        arithmetic in the same order; a share that moved always moves the job's remote,
        so _set_rate's keep-the-event case cannot arise. held: every one of `others` is
        known to be held at the level (the capped of this division), so its share is
        fair without comparing it with the bound."""
        now, lru = self.now, self.lru
        running, growing, filling = self.running, self.growing, self.filling
        inflows, events, log_rates = self.inflow, self.events, self.job_rates is not None
        total_rate, total_remote, seq = self.total_rate, self.total_remote, self.seq
        push = heapq.heappush
        demand, pos = self.demand, self.wf_pos
        for name in others:
            if held:  # (every one of `others` is held at the level)
                if name in changed:
                    continue
                share = fair
            else:
                share = demand.get(name)  # (None: it left)
                if share is None or name in changed:
                    continue
                if bound is not None and (share, pos[name]) >= bound:
                    share = fair  # held at the level
            job = running[name]
            if job.held:
                continue  # on the level clock: nothing to write out
            hit = job.hit
            if share == job.remote or not hit < 1.0 - 1e-12:
                continue
            dt = now - job.t  # _sync
            if dt > 0:
                job.t = now
                job.equal_integral += job.equal_rate * dt
                rate = job.rate
                if rate > 0:
                    got = rate * dt
                    unread = job.size - job.pos
                    if not lru and unread > 0:
                        left = unread - got
                        job.effective *= (left if left > 0.0 else 0.0) / unread
                    job.read += got
                    job.pos += got
                    got *= hit
                    job.hit_bytes += got
                    job.epoch_hits += got
                    job.remote_bytes += job.remote * dt
            gpu_rate = job.share * job.spec.ideal_io  # _set_rate
            rate = share / (1.0 - hit)
            if not rate < gpu_rate:
                rate = gpu_rate
            old_remote = job.remote
            key = job.unit
            if not lru or key in growing:
                self._sync_unit(key)
            inflow = inflows.get(key, 0.0) + share - old_remote
            inflows[key] = inflow = inflow if inflow > 1e-9 else 0.0
            if lru:
                pass  # (an LRU pool's units are never in filling: nothing to discard)
            elif inflow > 0 and self._room(key):
                filling.add(key)
            else:
                filling.discard(key)
            total_rate += rate - job.rate
            total_remote += share - old_remote
            if log_rates:
                self._log_rate(job, rate)
            job.rate, job.remote = rate, share
            seq += 1
            job.seq = seq
            job.event_boundary = boundary = job.boundary
            if rate > 0:
                push(events, (now + self._until(job, boundary) / rate, seq, job))
        self.total_rate, self.total_remote, self.seq = total_rate, total_remote, seq

    def _rerate_plan(self, active: list[_Job]) -> tuple[float, float]:
        """_rerate(running, everyone=True) for a re-plan, where every job and unit is up
        to date: the same rates, events and clocks, without the inflows and totals
        _set_rate keeps by differences, which the same pass over `active` (every active
        job, in arrival order) sums anew, with the fairness point: returns its worst
        and its sum of rate / equal-share rate. min and max are written out (x if x < y
        else y is min(y, x) to the bit)."""
        now = self.now
        lru = self.lru
        demand = self.demand  # (found by _apply)
        link = self.scenario.remote_io
        contended = sum(demand.values()) > link
        self._wf_build()
        first, fair, top = self._wf_divide(link)
        wf = self.wf
        assert wf is not None
        capped = list(map(itemgetter(2), wf[first:]))
        # the demands from `first` on are held at the level: those of `capped`
        held = set(capped)
        self.level = top if contended else math.inf
        unit_t, growing = self.unit_t, self.growing
        events, log_rates = self.events, self.job_rates is not None
        push = heapq.heappush
        seq = self.seq
        inflow: dict[str, float] = {}
        total_rate = total_remote = 0.0
        worst, total = math.inf, 0.0
        for job in active:
            if job.share > 0:
                # _set_rate, but for the sums (below)
                hit = job.hit
                gpu_rate = job.share * job.spec.ideal_io
                if hit >= 1.0 - 1e-12:
                    rate, remote = gpu_rate, 0.0
                else:
                    name = job.name
                    remote = fair if name in held else demand[name]
                    rate = remote / (1.0 - hit)
                    if not rate < gpu_rate:
                        rate = gpu_rate
                if (
                    rate != job.rate
                    or remote != job.remote
                    or job.seq < 0
                    or job.boundary != job.event_boundary
                ):  # else progress is linear: its pending event is still right
                    if remote != job.remote and (not lru or job.unit in growing):
                        # _sync_unit of a unit already brought to now: only its clock
                        unit_t[job.unit] = now
                    if log_rates:
                        self._log_rate(job, rate)
                    job.rate, job.remote = rate, remote
                    seq += 1
                    job.seq = seq
                    job.event_boundary = boundary = job.boundary
                    if rate > 0:
                        push(events, (now + self._until(job, boundary) / rate, seq, job))
            # the sums and the fairness point
            rate = job.rate
            equal_rate = job.equal_rate
            ratio = rate / equal_rate if equal_rate > 0 else 1.0
            if ratio < worst:
                worst = ratio
            total += ratio
            if job.share <= 0:
                continue
            total_rate += rate
            remote = job.remote
            total_remote += remote
            if remote > 0:
                inflow[job.unit] = inflow.get(job.unit, 0.0) + remote
        if log_rates:  # (after every running job's, as the pass after the rates did)
            for job in active:
                if job.share <= 0:
                    self._log_rate(job, 0.0)
        self.seq = seq
        self.inflow = inflow
        self.total_rate, self.total_remote = total_rate, total_remote
        self.capped, self.fair = capped, fair
        self.contended = contended
        # (the held jobs were let go before the plan: _reschedule)
        self.clocked = lru and not log_rates
        self.hfair = fair if fair is not None else 0.0
        if self.clocked:
            running = self.running
            for name in capped:
                self._held_enter(running[name])
        return worst, total

    def _set_rate(self, job: _Job, share: float) -> None:
        """Give a running job (up to date) its link share; its rate and next event follow.
        (min and max written out, as in _rerate_plan.)"""
        gpu_rate = job.share * job.spec.ideal_io
        hit = job.hit
        if hit >= 1.0 - 1e-12:
            rate, remote = gpu_rate, 0.0
        else:
            remote = share
            rate = remote / (1.0 - hit)
            if not rate < gpu_rate:
                rate = gpu_rate
        old_remote = job.remote
        if rate == job.rate and remote == old_remote and job.seq >= 0:
            if job.boundary == job.event_boundary:
                return  # progress is linear: its pending event is still right
        if remote != old_remote:
            key = job.unit
            lru = self.lru
            if not lru or key in self.growing:
                # (an LRU dataset at its target stays there until a re-target, which
                # brings every unit up to date first: nothing to add up)
                self._sync_unit(key)
            inflow = self.inflow.get(key, 0.0) + remote - old_remote
            self.inflow[key] = inflow = inflow if inflow > 1e-9 else 0.0
            if not lru and inflow > 0 and self._room(key):
                self.filling.add(key)
            else:
                self.filling.discard(key)
        self.total_rate += rate - job.rate
        self.total_remote += remote - old_remote
        if self.job_rates is not None:
            self._log_rate(job, rate)
        job.rate, job.remote = rate, remote
        self.seq += 1
        job.seq = self.seq
        job.event_boundary = boundary = job.boundary
        if rate > 0:
            until = self._until(job, boundary)
            heapq.heappush(self.events, (self.now + until / rate, self.seq, job))

    def _log_rate(self, job: _Job, rate: float) -> None:
        if self.job_rates is None:
            return
        points = self.job_rates.setdefault(job.name, [])
        if points and points[-1][1] == rate:
            return
        if points and points[-1][0] == self.now:
            points[-1] = (self.now, rate)  # changed twice at one instant: the last counts
        else:
            points.append((self.now, rate))

    def _lru_held(self, job: _Job) -> float:
        """What the LRU holds of the job's dataset (units brought up to date by the caller)."""
        dataset = job.spec.dataset
        return min(self.resident.get(dataset, 0.0), self.target.get(dataset, 0.0))

    def _hit(self, job: _Job) -> float:
        job.boundary = math.inf
        if not self.lru:
            unread = max(0.0, job.size - job.pos)
            if unread <= job.eps:
                return min(1.0, self._filled_now(job.unit) / job.size)
            return min(1.0, job.effective / unread)
        if job.epochs_done == 0:
            return job.first_hit
        if job.unit in self.growing:
            self._sync_unit(job.unit)
        held = job.lru_held = self._lru_held(job)
        r = held / job.size
        y = job.pos / job.size
        if r >= 1.0:
            return 1.0
        # Positions within rounding (eps bytes) of a boundary count as on it: an event
        # lands there, and the integral over a vanishing segment is noise.
        if (r - y) * job.size <= job.eps:
            return 0.0
        step = r / self.lru_segments
        k = math.floor(y / step + 1e-9) + 1
        job.boundary = min(r, k * step)
        if (job.boundary - y) * job.size <= job.eps:
            job.boundary = min(r, (k + 1) * step)
        return sim_lru.hit_between(r, y, job.boundary)

    # ------------------------------------------------------------------- time

    def _shared_fill(self) -> None:
        """Units several active jobs read, filling: what one reader fetches raises the
        others' hits (the bounded steps of _step keep that change small per step)."""
        readers = self._unit_readers()
        for key in [k for k in self.filling if len(readers.get(k, ())) > 1]:
            group = readers[key]
            fetched = {
                j.name: j.remote * (self.now - j.t) for j in group if j.remote > 0 and j.rate > 0
            }
            for job in group:
                self._sync(job)
            before = self.filled[key]
            self._sync_unit(key)
            admit = self.filled[key] - before
            total = sum(fetched.values())
            if admit <= 0 or total <= 0:
                continue
            size = self.cluster.units[key].size
            uncached = max(size - before, 1e-9)
            for other in group:
                # what others admitted is new to `other` unless it already read it
                new = admit - admit * fetched.get(other.name, 0.0) / total
                if new > 0:
                    frac = max(0.0, other.unread - other.effective) / uncached
                    other.effective = min(other.unread, other.effective + new * min(1.0, frac))
                if other.share > 0:
                    self.touched[other.name] = other

    def _boundaries(self) -> None:
        due_jobs = []
        tol = 1e-9 * max(1.0, self.now)
        for events, due in (
            (self.events, self.now + tol),
            (self.vevents, self.vclock + self.hfair * tol),  # (the same tolerance in time)
        ):
            while events and events[0][0] <= due:
                _, seq, job = heapq.heappop(events)
                if seq == job.seq:
                    due_jobs.append(job)
        for job in due_jobs:
            job.seq = -1  # consumed: _set_rate pushes the next one
            self._sync(job)
            self.touched[job.name] = job
            if job.work - job.read <= job.eps:
                self._close_epoch(job)
                job.finish = self.now
                self._leave(job)
            elif job.size - job.pos <= job.eps:  # unread <= eps
                self._close_epoch(job)
                job.pos = 0.0
                job.epochs_done += 1
                self._sync_unit(job.unit)
                job.effective = self.filled[job.unit] if not self.lru else 0.0
                if self.lru:
                    # the targets stand until a re-plan; holdings still growing move hits
                    self._lru_grow()
                elif abs(self._hit(job) - job.hit) > _REPLAN_HIT_CHANGE:
                    self.dirty = True  # what it fetched last epoch is effective now
        if not self.lru and self.filling:
            now, inflows, filled, allocated = self.now, self.inflow, self.filled, self.allocated
            units, unit_t = self.cluster.units, self.unit_t
            for key in list(self.filling):  # (min, max and _filled_now written out)
                inflow = inflows.get(key, 0.0)
                size = units[key].size
                cap = allocated[key]
                if size < cap:
                    cap = size
                held = filled[key]
                if inflow > 0:
                    grown = held + inflow * (now - unit_t[key])
                    if not grown < cap:
                        grown = cap
                    if grown > held:
                        held = grown
                tol = size * 1e-12
                if held >= cap - (tol if tol > 1.0 else 1.0):
                    self._sync_unit(key)  # full: re-plans
        if self.now >= self.next_plan - 1e-9:
            self.dirty = True
        self._arrivals()

    def _leave(self, job: _Job) -> None:
        if job.held:
            self._held_exit(job)
        self._sync_unit(job.unit)
        inflow = self.inflow.get(job.unit, 0.0) - job.remote
        self.inflow[job.unit] = inflow if inflow > 1e-9 else 0.0
        if self.inflow[job.unit] <= 0:
            self.filling.discard(job.unit)
        self.total_rate -= job.rate
        self.total_remote -= job.remote
        if job.rate > 0:
            self._log_rate(job, 0.0)
        job.rate = job.remote = 0.0
        job.seq = -1
        del self.active[job.name]
        self.running.pop(job.name, None)
        self.demand.pop(job.name, None)
        self.wf = None
        self.touched.pop(job.name, None)
        group = self.readers[job.unit]
        del group[next(i for i, other in enumerate(group) if other is job)]  # (not ==)
        if not group:
            del self.readers[job.unit]
        dataset = job.spec.dataset
        self.dataset_readers[dataset] -= 1
        if not self.dataset_readers[dataset]:
            del self.dataset_readers[dataset]
        self.dirty = self.jobs_moved = True

    def _close_epoch(self, job: _Job) -> None:
        if job.pos > 0:
            job.epoch_hit_ratios.append(job.epoch_hits / job.pos)
        job.epoch_hits = 0.0

    def _arrivals(self) -> None:
        while self.pending and self.pending[-1].spec.submit <= self.now + 1e-9:
            job = self.pending.pop()
            job.t = self.now
            # everything cached is unread by a new job: effective from its first epoch
            job.effective = self._filled_now(job.unit)
            if self.lru:
                self._sync_unit(job.unit)
            held = self.resident.get(job.spec.dataset, 0.0)
            job.first_hit = min(1.0, held / job.size)
            self.active[job.name] = job
            self.readers.setdefault(job.unit, []).append(job)
            dataset = job.spec.dataset
            self.dataset_readers[dataset] = self.dataset_readers.get(dataset, 0) + 1
            self.dirty = self.jobs_moved = True

    # ---------------------------------------------------------------- results

    def _record(self) -> None:
        rate, remote = self.total_rate, self.total_remote
        if abs(rate) < 1e-6:
            rate = 0.0
        if abs(remote) < 1e-6:
            remote = 0.0
        if self.timeline:
            _, last_rate, last_remote = self.timeline[-1]
            # the totals are kept by adding differences: equal up to rounding is equal
            if math.isclose(rate, last_rate, rel_tol=1e-9, abs_tol=1e-6) and math.isclose(
                remote, last_remote, rel_tol=1e-9, abs_tol=1e-6
            ):
                return
        self.timeline.append((self.now, rate, remote))

    def _result(self) -> SimResult:
        self._held_dissolve()
        self._sync_all()
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
                gpus=j.spec.gpus,
                dataset=j.spec.dataset,
            )
            for j in sorted(self.all, key=lambda j: (j.spec.submit, j.name))
        ]
        self.timeline.append((self.now, 0.0, 0.0))
        if self.job_rates is not None:
            for job in self.active.values():
                self._log_rate(job, 0.0)
        return SimResult(
            self.scenario.name,
            self.scheduler_name,
            self.cache_name,
            jobs,
            self.timeline,
            interrupted=bool(self.pending or self.active),
            until=self.now,
            fairness_timeline=self.fairness_timeline,
            job_rates=self.job_rates,
        )


def _cluster(scenario: Scenario, *, private: bool, per_node: bool = False) -> Cluster:
    """The policies' cluster: a unit per dataset in one pool of every node's cache (one
    cache across the nodes), or with `private` a unit per job (CoorDL's own cache).

    `per_node` (nodes caching alone): a unit per job too, in a pool of its own of the
    nodes' cache per GPU times its GPUs. The flow model does not follow which node
    serves which reads, so a dataset read by k jobs is held k times and each copy is
    bounded by its job's GPU share of a node's cache: exact when each job runs on nodes
    of its own (one copy per node), more copies than nodes would hold when jobs of a
    dataset share a node, one copy where a job spread over m nodes holds m."""
    node_gpus = {n.name: n.gpus for n in scenario.nodes}
    node_cache = {n.name: float(n.cache) for n in scenario.nodes}
    if not private:
        sizes = {ds: float(size) for ds, size in scenario.datasets.items()}
        return Cluster.pooled(node_gpus, node_cache, scenario.remote_io, sizes)
    total = float(sum(node_cache.values()))
    per_gpu = total / max(1, sum(node_gpus.values()))
    units, pools = {}, {}
    for j in scenario.jobs:
        key = f"job:{j.name}"
        pool = key if per_node else POOL
        units[key] = CacheUnit(key, pool, j.dataset, float(j.dataset_size))
        pools[pool] = per_gpu * j.gpus if per_node else total
    return Cluster(node_gpus, node_cache, scenario.remote_io, pools, units)


def _job_state(spec: JobSpec, *, private: bool) -> _Job:
    unit = f"job:{spec.name}" if private else spec.dataset
    size = float(spec.dataset_size)
    return _Job(spec=spec, unit=unit, size=size, work=spec.epochs * size)


def simulate(scenario: Scenario, scheduler: str, cache: str, interval: float = 600.0) -> SimResult:
    """Run `scenario` to completion under a scheduler and a cache system."""
    return Simulation(scenario, scheduler, cache, interval).run()
