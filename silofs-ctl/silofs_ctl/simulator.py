"""A flow-level, event-driven simulator of a GPU cluster reading through a cache from remote IO.

Owns: the run of a scenario under a scheduler and a cache system: when the policy plans,
how its plan becomes each job's hit ratio, rate and remote IO, and what happens at each
event (arrivals, epoch ends, completions, a cache unit becoming full). Policies decide;
this module only applies their decisions. Never: reads files, prints, or lets a policy
see anything but model.Job / model.Cluster.

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

The parts, each in its own module:
- sim_job.SimJob: one job's state, and advance(), the one progress step every loop uses;
- sim_clock.Clock: time, the jobs' pending events, and the level clock (jobs held at the
  link's level);
- sim_link.Link: the link's max-min division, demands kept in water-filling order;
- sim_units.Units: each cache unit's allocation, fill and inflow (uniform caching);
- sim_lru.LruPool: the LRU pool's holdings (Alluxio);
- sim_results: the results, the timelines, and the fairness reference.

The loop is incremental: a job is brought up to date only when something about it
changes or is read, and a step only re-rates the jobs its event touched (plus, when the
link is contended, the jobs whose max-min share moved). A re-plan brings everything up
to date and re-rates every active job.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import fields, replace
from operator import attrgetter

from .estimator import ComputeEstimator, Estimator, SiloDEstimator
from .model import POOL, Allocation, CacheUnit, Cluster, Job
from .policies import CACHES, SCHEDULERS
from .policies.base import HITS, REMAINING, CachePolicy, Policy
from .policies.gavel import GavelPolicy
from .scenario import Scenario
from .sim_clock import Clock
from .sim_job import SimJob
from .sim_link import Link
from .sim_lru import LruPool
from .sim_results import JobResult, Recorder, SimResult, equal_rates
from .sim_units import Units

log = logging.getLogger(__name__)

CACHE_CHOICES = ("silod", *CACHES)
_LRU_SEGMENTS = 8  # rate changes per epoch while an LRU hit ratio slides from high to 0
_MAX_STEPS = 5_000_000
_REPLAN_HIT_CHANGE = 0.005  # a job's hit ratio moving this much at an epoch start re-plans
_INF = math.inf  # (a module global reads faster than math.inf in the per-job loops)

__all__ = ["CACHE_CHOICES", "JobResult", "SimResult", "Simulation", "SimulationError", "simulate"]


class SimulationError(Exception):
    """The scenario cannot run to completion (e.g. jobs that can never progress)."""


class Simulation:
    """One run of a scenario with a scheduler and a cache system."""

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
        # The level clock (sim_clock.Clock) carries the jobs held at the link's level
        # under LRU always, and under uniform caching where it pays and nothing a plan
        # reads can see it: Gavel moves every running job's share at every plan, so the
        # level moves at most steps with hundreds of jobs held at it (Quiver: 1.7x less
        # CPU), and a plan reading nothing that moved keeps the last one. With a unit
        # per job (private) a level move still visits each held job's filling unit, so
        # it saves nothing there. It sums the held jobs' progress in another order (to
        # rounding; shared fills and event times carry that to ~1e-6 of a finish), so
        # FIFO and SJF, and plans that read hits, keep writing every rate out and their
        # results to the bit.
        self.uniform_clock = (
            isinstance(self.policy, GavelPolicy) and not self.plan_reads and not private
        )
        per_node = scenario.per_node and cache != "coordl"  # CoorDL's are per job anyway
        self.cluster = _cluster(scenario, private=private, per_node=per_node)
        # Fairness is judged against the same reference for every policy pair.
        self.reference = _cluster(scenario, private=False)
        self.pending = sorted(
            (SimJob.of(spec, private=private) for spec in scenario.jobs),
            key=lambda j: (j.spec.submit, j.name),
        )
        self.pending.reverse()  # popped from the end: soonest submission last
        self.all = list(reversed(self.pending))
        self.active: dict[str, SimJob] = {}  # in arrival order
        self.running: dict[str, SimJob] = {}  # active jobs with GPUs
        # Active jobs by the unit they read, in arrival order (a unit without one has no
        # entry), and active jobs per dataset: kept as jobs arrive and leave.
        self.readers: dict[str, list[SimJob]] = {}
        self.dataset_readers: dict[str, int] = {}
        self.clock = Clock()
        self.link = Link(scenario.remote_io)
        self.pool = LruPool(self.cluster.total_cache, scenario.remote_io, lru_segments)
        self.units = Units(self.cluster.units, self.pool)
        self.recorder = Recorder(job_rates)
        self.total_rate = self.total_remote = 0.0  # the running jobs' rates and remotes
        self.equal_for: tuple[str, ...] | None = None  # the jobs equal_rate is for
        self.dirty = True  # re-plan at the next step (units.full also asks for one)
        # While a cache fills, its effective size changes: re-plan every `interval`, as
        # the live controller does, and whenever a unit becomes full.
        self.interval = interval
        self.next_plan = math.inf
        self.steps = 0  # events simulated
        self.timer_steps = 0  # of them, steps that moved the clock to the re-plan timer
        self.plans = 0  # policy runs
        self.kept_plans = 0  # re-plans that kept the last plan (nothing it reads moved)
        # Set by request_stop (e.g. from a SIGINT handler); run() ends after the current
        # step, so the partial results are of a consistent state.
        self.stop_requested = False
        self.touched: dict[str, SimJob] = {}  # jobs whose rate an event may have changed
        # Jobs the link holds at its level that are not on the level clock (it would not
        # take them): a move of the level re-rates them one by one.
        self.held_off: set[str] = set()
        # The last plan's views hold every active job's uniform hit ratio at the plan
        # (_hit_views): _apply takes them instead of finding them again.
        self.view_hits = False

    def request_stop(self) -> None:
        self.stop_requested = True

    # ------------------------------------------------------------------ driver

    def run(self) -> SimResult:
        clock, units, recorder = self.clock, self.units, self.recorder
        self._arrivals()
        while (self.pending or self.active) and not self.stop_requested:
            if self.dirty or units.full:
                self._reschedule()
            elif self.touched:
                self._rerate(list(self.touched.values()))
            self.touched = {}
            dt = self._step()
            if dt > 0 and clock.now + dt >= self.next_plan - 1e-9:
                self.timer_steps += 1
            recorder.totals(clock.now, self.total_rate, self.total_remote)
            clock.tick(dt)
            self._shared_fill()
            self._boundaries()
            self.steps += 1
            # The limit is for a run that does not end (a stall at one instant). A step
            # to the re-plan timer, asked for every `interval` while caches fill, moves
            # the clock and is an interval after the last (a plan moves the timer on):
            # not counted (a 6 TB fill at 1 MB/s with --interval 1 is 6,000,000 of them).
            if self.steps - self.timer_steps > _MAX_STEPS:
                raise SimulationError(f"gave up after {self.steps} steps at t={clock.now:.0f}s")
        return self._result()

    def _step(self) -> float:
        """Time to the next event: a job's, an arrival, a re-plan, a unit filling up, or
        the bounded step of a dataset several jobs fill."""
        now, units = self.clock.now, self.units
        soonest = min(self.next_plan, self.clock.soonest())
        if self.pending:
            soonest = min(soonest, self.pending[-1].spec.submit)
        soonest -= now
        if not units.lru and units.filling:
            soonest = units.until_change(now, soonest)
        if soonest == math.inf:
            stuck = ", ".join(self.active)
            raise SimulationError(f"jobs can make no progress at t={now:.0f}s: {stuck}")
        return max(0.0, soonest)

    def _clean(self) -> None:
        """What asked for a re-plan is answered."""
        self.dirty = False
        self.units.full = False

    # -------------------------------------------------------------- decisions

    def _reschedule(self) -> None:
        clock, units = self.clock, self.units
        if not self.jobs_moved and not self.plan_reads:
            # The same jobs, and nothing the policy reads has moved (a unit filled, an
            # epoch start moved a hit ratio): its plan would be the last one, so it
            # stands. The jobs an event touched are re-rated as at any other step.
            self.kept_plans += 1
            self._clean()
            self._rerate(list(self.touched.values()))
            # The re-plan timer still runs: its steps bound shared fills (_shared_fill)
            # as they did when the policy ran, so the run is the same either way.
            self.next_plan = clock.now + self.interval if self._filling() else math.inf
            return
        self.plans += 1
        self.jobs_moved = False
        clock.dissolve(defer=True)  # (their event times: _rerate_plan)
        units.sync_all(clock.now)
        active = list(self.active.values())
        views = self._plan_views(active)
        cluster = replace(self.cluster, cached=None if units.lru else dict(units.filled))
        alloc = self.policy.allocate(views, cluster, self.estimator)
        if self.cache_policy is not None:
            self.cache_policy.fill_cache(views, cluster, alloc)
        self._apply(alloc)  # sets self.running, and the running jobs' hits and demands
        # The equal share depends on the set of active jobs only: most re-plans (a cache
        # filling, an epoch starting) keep it.
        names = tuple(self.active)
        if names != self.equal_for:
            equal_rates(self.reference, self.dataset_readers, active)
            self.equal_for = names
        self._clean()
        worst, total = self._rerate_plan(active)
        self.next_plan = clock.now + self.interval if self._filling() else math.inf
        if active:
            self.recorder.fairness_timeline.append((clock.now, worst, total / len(active)))

    def _plan_views(self, active: list[SimJob]) -> list[Job]:
        """Every active job brought to now (a re-plan re-rates them all), and its view for
        the policy: the kept one where it still holds, else a new one (_view)."""
        now, vclock, reads = self.clock.now, self.clock.vclock, self.plan_reads
        # A waiting job's kept view still holds when the plan does not read hits (its
        # remaining work does not move).
        with_hits = HITS in reads and not self.units.lru
        with_remaining = REMAINING in reads
        self.view_hits = with_hits
        if with_hits:
            return self._hit_views(active, with_remaining)
        views = []
        for job in active:
            job.advance(now, vclock)
            view = job.view
            if view is None:
                view = self._view(job)
            elif not reads:
                if view.placement != (job.placement if job.share > 0 else None):
                    view = self._view(job)
            elif job.share > 0 or with_hits:
                view = self._view(job)
            elif not (
                view.remaining == (max(0.0, job.work - job.read) if with_remaining else math.inf)
                and view.placement is None
                and view.hit_now is None
            ):
                view = self._view(job)
            views.append(view)
        return views

    def _hit_views(self, active: list[SimJob], with_remaining: bool) -> list[Job]:
        """_plan_views for a plan that reads uniform hit ratios: every job's view holds its
        hit ratio now (_hit, written out), so each is compared with its kept one and
        made anew (_view) only where it moved."""
        now, vclock, units = self.clock.now, self.clock.vclock, self.units
        views = []
        append = views.append
        for job in active:
            pos, size = job.pos, job.size
            effective = job.effective
            dt = now - job.t
            if dt > 0:
                if job.held:  # (dissolved before a plan: never, but advance knows how)
                    job.advance(now, vclock)
                    pos, effective = job.pos, job.effective
                else:
                    # SimJob.advance written out (every active job, every plan): the
                    # same operations in the same order, the fields it writes that are
                    # read below kept in locals (pos, effective)
                    job.t = now
                    job.equal_integral += job.equal_rate * dt
                    rate = job.rate
                    if rate > 0:
                        read = rate * dt
                        if effective > 0.0:
                            unread = size - pos
                            if unread > 0:
                                left = unread - read
                                left = left if left > 0.0 else 0.0
                                job.effective = effective = effective * (left / unread)
                        job.read += read
                        job.pos = pos = pos + read
                        hits = read * job.hit
                        job.hit_bytes += hits
                        job.epoch_hits += hits
                        job.remote_bytes += job.remote * dt
            job.boundary = _INF
            unread = size - pos
            if unread > job.eps:
                hit = effective / unread
            else:
                hit = units.filled_now(job.unit, now) / size
            if not hit < 1.0:
                hit = 1.0
            view = job.view
            placement = job.placement if job.share > 0 else None
            remaining = max(0.0, job.work - job.read) if with_remaining else _INF
            if (
                view is None
                or view.hit_now != hit
                or view.placement != placement
                or view.remaining != remaining
            ):
                # as _view makes it, with the hit ratio found above (it finds the same):
                # _new_view written out (some 200 jobs a plan)
                spec = job.spec
                view = _new_object(Job)
                _set_name(view, job.name)
                _set_dataset(view, spec.dataset)
                _set_gpus(view, spec.gpus)
                _set_f_star(view, spec.ideal_io)
                _set_reads(view, job.reads)
                _set_remaining(view, remaining)
                _set_submit(view, spec.submit)
                _set_placement(view, placement)
                _set_hit_now(view, hit)
                job.view = view
            append(view)
        return views

    def _filling(self) -> bool:
        """Is some read unit still below its allocation (so the plan will change)?"""
        units = self.units
        if units.lru:
            return False
        # A unit its readers are filling is usually one: look at its readers first (the
        # answer is the same; the scan of every job would reach them later).
        readers = self.readers
        for key in units.filling:
            if units.below_allocation(readers.get(key, ())):
                return True
        return units.below_allocation(self.active.values())

    def _view(self, job: SimJob) -> Job:
        """The job as the policy sees it. What the plan does not read (Policy.reads) is
        left out: remaining work and the hit ratio now are found only for a plan that
        reads them. The last view is kept and given again while it is equal (a waiting
        job's stays so), or made once when the plan reads neither: views are frozen."""
        reads = self.plan_reads
        placement = job.placement if job.share > 0 else None
        view = job.view
        if not reads:
            if view is None or view.placement != placement:
                view = job.view = _new_view(job, math.inf, placement, None)
            return view
        remaining = max(0.0, job.work - job.read) if REMAINING in reads else math.inf
        hit_now = None if self.units.lru or HITS not in reads else self._hit(job)
        if (
            view is not None
            and view.remaining == remaining
            and view.hit_now == hit_now
            and view.placement == placement
        ):
            return view
        view = job.view = _new_view(job, remaining, placement, hit_now)
        return view

    def _apply(self, alloc: Allocation) -> None:
        """The plan's shares, placements, IO caps and cache; and each running job's hit
        ratio and capped demand (the link's, in arrival order), which _rerate_plan divides
        the link by. Every job is up to date (_plan_views)."""
        units = self.units
        units.lru = lru = alloc.lru
        if not lru:
            units.allocate(alloc.cache, self.readers)  # first: evictions move hits
        gpu_share, placement, io = alloc.gpu_share, alloc.placement, alloc.io
        now = self.clock.now
        self.running = running = {}
        demand: dict[str, float] = {}
        # Each view was made (or kept, being equal) with the job's hit ratio at this
        # plan, brought to now, by _hit's arithmetic; only an eviction since (above)
        # moved some: those units' readers are found again. Their hit ratios and
        # demands are then found in the same pass (each job's alone, so in any order).
        view_hits = self.view_hits and not lru
        evicted = units.evicted if view_hits else ()
        # A policy that plans every active job gives its shares (and IO) in the views'
        # order, the active jobs' (gavel): then each job's is the next value, not a
        # lookup by name (two of ~1,100 per plan); else looked up as before.
        active = self.active
        names = list(active)
        if len(gpu_share) == len(names) and list(gpu_share) == names:
            shares: Iterable[float] = gpu_share.values()
        else:
            shares = [gpu_share.get(name, 0.0) for name in names]
        if len(io) == len(names) and list(io) == names:
            caps: Iterable[float | None] = io.values()
        else:
            caps = [io.get(name) for name in names]
        for job, share, cap in zip(active.values(), shares, caps, strict=True):
            name = job.name
            job.share = share = share if share < 1.0 else 1.0  # min(1, share)
            job.placement = placement.get(name) if placement else None
            job.io_cap = cap
            if share <= 0:  # waiting or preempted: no rate, fetches nothing
                job.rate = job.remote = 0.0
                if job.seq >= 0:  # (-1: it has no event already)
                    self.clock.cancel(job)
                continue
            if job.start is None:
                # not before its arrival: the clock may reach `submit` an ulp short, and
                # _arrivals admits it there (its tolerance)
                submit = job.spec.submit
                job.start = now if now > submit else submit
            running[name] = job
            if view_hits:
                hit = job.view.hit_now  # type: ignore[union-attr]
                if hit is None or job.unit in evicted:
                    hit = self._hit(job)
                job.hit = hit
                need = share * job.ideal_io * (1.0 - hit)
                demand[name] = need if cap is None or not cap < need else cap
        if lru:
            # (the holdings move with the running readers; a reader's hit with them)
            pool = self.pool
            pool.retarget(running.values(), lambda: units.sync_all(now))
            # _hit under LRU, written out, and the demand in the same pass (a sync moves
            # only its dataset's holding, which no demand reads)
            growing, pool_hit = pool.growing, pool.hit
            for job in running.values():
                if job.epochs_done and job.unit in growing:
                    units.sync(job.unit, now)
                job.hit = hit = pool_hit(job)
                need = job.share * job.ideal_io * (1.0 - hit)
                cap = job.io_cap
                demand[job.name] = need if cap is None or not cap < need else cap
        elif not view_hits:
            self._uniform_hits(running.values())
        if not view_hits and not lru:
            for job in running.values():
                need = job.share * job.ideal_io * (1.0 - job.hit)
                cap = job.io_cap
                demand[job.name] = need if cap is None or not cap < need else cap
        self.link.reset(demand)

    def _lru_grow(self) -> None:
        """Datasets whose holding still grows towards its target: their readers' hit
        ratios moved since they were last rated (an epoch end looks; a reader also looks
        at each of its own events)."""
        units, pool, now, touched = self.units, self.pool, self.clock.now, self.touched
        for dataset in list(pool.growing):
            if units.inflow.get(dataset, 0.0) <= 0:
                continue  # nothing fetched into it now: its holding stays
            units.sync(dataset, now)
            if pool.resident.get(dataset, 0.0) >= pool.target.get(dataset, 0.0):
                pool.growing.pop(dataset, None)
            # (under LRU a job's unit is its dataset: its readers all find this holding)
            held = pool.held(dataset)
            for other in self.readers.get(dataset, ()):
                if other.share > 0 and other.epochs_done > 0 and other.lru_held != held:
                    touched[other.name] = other

    # ------------------------------------------------------------------ rates

    def _hit(self, job: SimJob) -> float:
        """The job's hit ratio now (under LRU: to its next segment boundary). (min and
        max written out: this runs for every running job at every re-plan.)"""
        units = self.units
        if units.lru:
            if job.epochs_done and job.unit in self.pool.growing:
                units.sync(job.unit, self.clock.now)
            return self.pool.hit(job)
        job.boundary = math.inf
        unread = job.size - job.pos
        if unread > job.eps:
            hit = job.effective / unread
        else:  # at an epoch's end: what the next one will find
            hit = units.filled_now(job.unit, self.clock.now) / job.size
        return hit if hit < 1.0 else 1.0

    def _uniform_hits(self, jobs: Iterable[SimJob]) -> None:
        """_hit of each running one of `jobs` under uniform caching, set as its hit
        ratio (the loop of a re-plan and of a step's re-rates, without a call per job)."""
        units, now = self.units, self.clock.now
        for job in jobs:
            if job.share <= 0:
                continue
            job.boundary = math.inf
            unread = job.size - job.pos
            if unread > job.eps:
                hit = job.effective / unread
            else:  # at an epoch's end: what the next one will find
                hit = units.filled_now(job.unit, now) / job.size
            job.hit = hit if hit < 1.0 else 1.0

    def _rerate(self, jobs: list[SimJob]) -> None:
        """New rates for `jobs` (brought up to date here), and for any other running job
        whose max-min share of the link moves with their demands."""
        clock, link = self.clock, self.link
        now, vclock, demand = clock.now, clock.vclock, link.demand
        level = link.level
        # Stays True while every demand that moved was and is at or above the water level.
        held = link.contended
        units = self.units
        lru = units.lru
        pool = self.pool
        growing, pool_hit = pool.growing, pool.hit  # (nothing here replaces them)
        # One pass: each job brought to now (most are already: a shared fill did it)
        # and off the level clock, then its hit ratio and demand, which read only the
        # job and its unit (no other job's progress or event; exit moves no inflow).
        for job in jobs:
            if job.held:
                clock.exit(job)  # its hit ratio may move: re-rated as any other
            elif job.t < now:  # (advance does nothing otherwise)
                job.advance(now, vclock)
            share = job.share
            if share <= 0:
                continue
            if lru:  # _hit under LRU, written out (a step re-rates ~4 jobs, ~800,000 steps)
                if job.epochs_done and job.unit in growing:
                    units.sync(job.unit, now)
                job.hit = hit = pool_hit(job)
            else:  # _hit under uniform caching, written out (_uniform_hits)
                job.boundary = _INF
                size = job.size
                unread = size - job.pos
                if unread > job.eps:
                    hit = job.effective / unread
                else:  # at an epoch's end: what the next one will find
                    hit = units.filled_now(job.unit, now) / size
                if not hit < 1.0:
                    hit = 1.0
                job.hit = hit
            need = share * job.ideal_io * (1.0 - hit)
            cap = job.io_cap
            if cap is not None and cap < need:
                need = cap  # min(need, cap)
            name = job.name
            old = demand.get(name)
            if held:
                was = -1.0 if old is None else old
                held = was == need or (need >= level and was >= level)
            demand[name] = need
            if old != need:
                link.move(name, old, need)
        if held:
            # Demands above the level get the level whatever they are, and the ones below
            # it did not move: a division would give the same level and the same shares
            # (thrashing LRU readers held at the level, and the epoch ends of readers that
            # hit everything, change this way).
            if clock.on:
                for job in jobs:
                    if job.share > 0:
                        self._set_rate(job, min(level, demand[job.name]))
                        if job.name in link.capped:
                            clock.enter(job)
                            if not job.held:
                                self.held_off.add(job.name)
            else:
                self._set_rates(jobs, level)
            return
        contended = link.over()
        if contended or link.contended:
            self._redivide(jobs, contended)
        else:
            # Every demand is met (a division would give each its demand).
            link.level = math.inf
            if clock.on:
                self._relevel(None, [])
            self._set_rates(jobs, _INF)  # (each its demand)
            link.record(len(demand), None, set())
            self.held_off = set()
        link.contended = contended

    def _redivide(self, jobs: list[SimJob], contended: bool) -> None:
        """The link is (or was) shared out below some demands: `jobs`' demands moving can
        move everyone's share. Jobs whose share stays keep their rate untouched, and only
        the jobs that may have changed sides of the level are looked at (Link.flips): a
        job held at the level before and after either is on the level clock, which
        moves it, or is re-rated here."""
        clock, link, running = self.clock, self.link, self.running
        first, fair, top = link.divide()
        bound = link.bound_at(first) if fair is not None else None
        link.level = top if contended else math.inf
        changed = {job.name for job in jobs}
        flips = link.flips(bound, changed)
        was_capped = link.capped
        leaving = [name for name in flips if name in was_capped]
        if clock.on:
            self._relevel(fair, [running[name] for name in leaving if running[name].held])
        demand, key = link.demand, link.key
        # each running one of `jobs` its demand, or fair where held at the level
        self._set_rates(jobs, _INF, bound, fair if fair is not None else 0.0)
        # Any other job's demand did not move, so unless it is held below its demand now
        # or was at the last division, its share is that same demand; and one held at
        # both, at the same fair level, keeps that level.
        kept = [  # held at both, off the level clock
            name
            for name in self.held_off
            if name in was_capped and name not in flips and name not in changed
        ]
        if fair is not None and fair == link.fair:
            self._rerate_others(sorted(flips), bound, fair, changed)  # sorted: a fixed order
        else:  # the ones held now (at fair), then the ones held before
            joining = [name for name in flips if name not in was_capped]
            if clock.on:
                now_held = sorted(joining + kept, key=key)
            else:
                now_held = link.held_from(first)
            self._rerate_others(now_held, bound, fair, changed, held=True)
            drift = link.drift  # (the demands at the last division, where they moved)
            before = sorted(leaving, key=lambda name: drift.get(name) or key(name))
            self._rerate_others(before, bound, fair, changed)
        capped = was_capped
        capped.symmetric_difference_update(flips)
        for name in changed:
            if name in demand and bound is not None and key(name) >= bound:
                capped.add(name)
            else:
                capped.discard(name)
        if clock.on:
            moved = [name for name in changed if name in capped]
            self._enter([*moved, *(name for name in flips if name in capped), *kept])
        link.record(first, fair, capped)

    def _enter(self, names: list[str]) -> None:
        """The running jobs `names`, held at the level, on the level clock in the
        division's order where they may go; the others are kept in `held_off`."""
        running = self.running
        names = sorted(names, key=self.link.key)
        self.held_off = set(self.clock.enter_all([running[name] for name in names]))

    def _relevel(self, fair: float | None, leaving: list[SimJob]) -> None:
        """The level clock follows a new division (`leaving`: the held jobs it does not
        hold); the inflows of the units its held jobs read, and the totals, move with
        the level."""
        clock, units = self.clock, self.units
        step = clock.relevel(fair, leaving)
        if step:
            now = clock.now
            # Only a unit still filling (uniform) or a dataset still growing to its
            # target (LRU) reads its inflow before the next plan sums the inflows anew:
            # one at its cap or target stays there whatever it is fed (Units.add_inflow,
            # LruPool.add). The others' inflows are left as they are (each unit's sum is
            # apart from the others').
            held_units = clock.held_units
            # (a filling unit that a sync finds full leaves `filling`: a copy is walked)
            growing = self.pool.growing if units.lru else list(units.filling)
            if len(growing) < len(held_units):
                for unit in growing:
                    count = held_units.get(unit)
                    if count is not None:
                        units.add_inflow(unit, count * step, now)
            else:
                for unit, count in held_units.items():
                    if unit in growing:
                        units.add_inflow(unit, count * step, now)
            self.total_remote += step * len(clock.held)
            self.total_rate += step * clock.held_k

    def _rerate_others(
        self,
        others: Iterable[str],
        bound: tuple[float, int] | None,
        fair: float | None,
        changed: set[str],
        held: bool = False,
    ) -> None:
        """Each job in `others` whose link share moved, brought to now and given it (a
        level change moves every job held at the level). held: every one of `others`
        is known to be held at the level (the capped of this division), so its share is
        fair without comparing it with the bound."""
        now, vclock = self.clock.now, self.clock.vclock
        running, demand, pos = self.running, self.link.demand, self.link.pos
        for name in others:
            if name in changed:
                continue
            if held:
                share = fair
            else:
                share = demand.get(name)  # (None: it left)
                if share is None:
                    continue
                if bound is not None and (share, pos[name]) >= bound:
                    share = fair  # held at the level
            job = running[name]
            # On the level clock there is nothing to write out; a job that hits
            # everything fetches nothing whatever its share.
            if job.held or share == job.remote or not job.hit < 1.0 - 1e-12:
                continue
            job.advance(now, vclock)
            self._set_rate(job, share)  # type: ignore[arg-type]

    def _rerate_plan(self, active: list[SimJob]) -> tuple[float, float]:
        """Every running job's rate after a re-plan, where every job and unit is up to
        date: the link divided among the demands _apply found, and the inflows and
        totals (which steps keep by differences) summed anew in the same pass over
        `active` (every active job, in arrival order), with the fairness point: returns
        its worst and its sum of rate / equal-share rate. min and max are written out
        (x if x < y else y is min(y, x) to the bit)."""
        clock, link, units, recorder = self.clock, self.link, self.units, self.recorder
        now, lru, demand = clock.now, units.lru, link.demand
        contended = link.over()
        first, fair, top = link.divide()
        capped = link.held_from(first)
        held = set(capped)  # the demands from `first` on are held at the level
        link.level = top if contended else math.inf
        unit_t, growing = units.unit_t, self.pool.growing
        log_rates = recorder.job_rates is not None
        inflow: dict[str, float] = {}
        # The events of the running jobs whose rate or remote moved, found in this pass
        # (Clock.schedule_all's arithmetic and seqs, in the same order) and written into
        # the clock's array at once after it: a second pass over ~600 jobs cost more.
        # A job the level clock will take (Clock.enter_all below: the same test) gets
        # its event there, a mark and a seq that replace any made here, so none is
        # made here (the seqs skipped leave every other event's order as it was); one
        # the plan's Clock.dissolve left unwritten whose rate did not move gets the
        # time of the event dissolve gave it.
        seq = clock.seq
        slots: list[int] = []
        times: list[float] = []
        on = (lru or self.uniform_clock) and not log_rates  # (clock.on below)
        total_rate = total_remote = 0.0
        worst, total = math.inf, 0.0
        timed = False  # the job in hand needs its event's time (below)
        boundary = _INF
        for job in active:
            share = job.share
            if not share > 0:  # waiting: no rate (the fairness point only)
                rate = job.rate
                equal_rate = job.equal_rate
                ratio = rate / equal_rate if equal_rate > 0 else 1.0
                if ratio < worst:
                    worst = ratio
                total += ratio
                continue
            # _set_rate, but for the sums (below)
            hit = job.hit
            gpu_rate = share * job.ideal_io
            enters = False
            if hit >= 1.0 - 1e-12:
                rate, remote = gpu_rate, 0.0
            else:
                name = job.name
                if name in held:
                    remote = fair
                    enters = on
                else:
                    remote = demand[name]
                rate = remote / (1.0 - hit)
                if not rate < gpu_rate:
                    rate = gpu_rate
                if enters:  # Clock.enter_all's test (level: fair, hit below 1)
                    enters = remote > 0.0 and rate == remote / (1.0 - hit)
            old_rate, old_remote = job.rate, job.remote
            if (
                rate != old_rate
                or remote != old_remote
                or job.seq < 0
                or job.boundary != job.event_boundary
            ):  # else progress is linear: its pending event is still right
                if remote != old_remote and (not lru or job.unit in growing):
                    # Units.sync of a unit already brought to now: only its clock
                    unit_t[job.unit] = now
                if log_rates:
                    recorder.rate(job.name, now, rate)
                job.rate, job.remote = rate, remote
                job.unwritten = False
                if not enters:  # (else its event is enter_all's): a new event
                    seq += 1
                    job.seq = seq
                    job.event_boundary = boundary = job.boundary
                    timed = True
            else:
                rate, remote = old_rate, old_remote  # (equal: the fields' own)
                if job.unwritten:
                    job.unwritten = False
                    # the event dissolve gave it (its seq and boundary), timed here
                    if not enters:
                        boundary = job.event_boundary
                        timed = True
            if timed:  # Clock.schedule's time, written out (SimJob.until in it)
                timed = False
                size, pos = job.size, job.pos
                until = job.work - job.read
                left = size - pos
                if left < until:
                    until = left
                if boundary < _INF:
                    left = boundary * size - pos
                    if left < until:
                        until = left
                if rate > 0:
                    times.append(now + (until if until > 0.0 else 0.0) / rate)
                else:
                    times.append(_INF)
                slots.append(job.slot)
            # the sums and the fairness point (job.rate and job.remote are rate and
            # remote now)
            equal_rate = job.equal_rate
            ratio = rate / equal_rate if equal_rate > 0 else 1.0
            if ratio < worst:
                worst = ratio
            total += ratio
            total_rate += rate
            total_remote += remote
            if remote > 0:
                unit = job.unit
                inflow[unit] = inflow.get(unit, 0.0) + remote
        clock.put_events(seq, slots, times)
        if log_rates:  # (after every running job's, as the pass after the rates did)
            for job in active:
                if job.share <= 0:
                    recorder.rate(job.name, now, 0.0)
        units.reset_inflow(inflow)
        self.total_rate, self.total_remote = total_rate, total_remote
        link.record(first, fair, held)
        link.contended = contended
        # (the held jobs were let go before the plan: _reschedule)
        clock.on = (lru or self.uniform_clock) and not log_rates
        clock.level = fair if fair is not None else 0.0
        self.held_off = set()
        if clock.on:
            running = self.running
            self.held_off.update(clock.enter_all([running[name] for name in capped]))
        return worst, total

    def _set_rate(self, job: SimJob, share: float) -> None:
        """Give a running job (up to date) its link share; its rate and next event follow.
        (min and max written out, as in _rerate_plan.)"""
        gpu_rate = job.share * job.ideal_io
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
            self.units.move_inflow(job.unit, remote, old_remote, self.clock.now)
        self.total_rate += rate - job.rate
        self.total_remote += remote - old_remote
        clock = self.clock
        if self.recorder.job_rates is not None:
            self.recorder.rate(job.name, clock.now, rate)
        job.rate, job.remote = rate, remote
        # Clock.schedule, written out (a step re-rates ~90 jobs under Gavel with SiloD)
        clock.seq = seq = clock.seq + 1
        job.seq = seq
        job.event_boundary = boundary = job.boundary
        if rate > 0:
            until = job.work - job.read
            left = job.size - job.pos
            if left < until:
                until = left
            if boundary < _INF:
                left = boundary * job.size - job.pos
                if left < until:
                    until = left
            clock.times[job.slot] = clock.now + (until if until > 0.0 else 0.0) / rate
        else:
            clock.times[job.slot] = _INF

    def _set_rates(
        self,
        jobs: list[SimJob],
        level: float,
        bound: tuple[float, int] | None = None,
        fair: float = 0.0,
    ) -> None:
        """_set_rate(job, share) of each running one of `jobs` in turn, written out (a
        step's re-rate under SiloD gives ~150 jobs their share): the same operations in
        the same order, the totals added to one by one. Its share is min(level, its
        demand), or with `bound` its demand, or `fair` where (demand, position) is at
        least `bound` (held at the level of a division)."""
        clock, units, demand, pos = self.clock, self.units, self.link.demand, self.link.pos
        now, times = clock.now, clock.times
        log_rates = self.recorder.job_rates is not None
        total_rate, total_remote, seq = self.total_rate, self.total_remote, clock.seq
        for job in jobs:
            if job.share <= 0:
                continue
            name = job.name
            share = demand[name]
            if bound is not None:
                if (share, pos[name]) >= bound:
                    share = fair  # held at the level
            elif not share < level:  # min(level, share)
                share = level
            gpu_rate = job.share * job.ideal_io
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
                    continue  # progress is linear: its pending event is still right
            if remote != old_remote:
                units.move_inflow(job.unit, remote, old_remote, now)
            total_rate += rate - job.rate
            total_remote += remote - old_remote
            if log_rates:
                self.recorder.rate(name, now, rate)
            job.rate, job.remote = rate, remote
            seq += 1
            job.seq = seq
            job.event_boundary = boundary = job.boundary
            if rate > 0:
                until = job.work - job.read
                left = job.size - job.pos
                if left < until:
                    until = left
                if boundary < _INF:
                    left = boundary * job.size - job.pos
                    if left < until:
                        until = left
                times[job.slot] = now + (until if until > 0.0 else 0.0) / rate
            else:
                times[job.slot] = _INF
        self.total_rate, self.total_remote, clock.seq = total_rate, total_remote, seq

    # ------------------------------------------------------------------- events

    def _shared_fill(self) -> None:
        """Units several active jobs read, filling: what one reader fetches raises the
        others' hits (the bounded steps of Units.until_change keep that change small
        per step). (min and max written out: x if x < y else y is min(y, x) to the bit,
        and the fetched bytes are summed in the readers' order, as sum() adds.)"""
        units, readers, touched = self.units, self.readers, self.touched
        now, vclock = self.clock.now, self.clock.vclock
        filled = units.filled
        for key in units.shared_filling():
            group = readers[key]
            fetched = []  # per reader, what it fetched since it was last brought to now
            total = 0.0
            for job in group:
                rate, remote = job.rate, job.remote
                if job.held:
                    got = vclock - job.v if remote > 0 and rate > 0 else 0.0
                    if remote > 0 and rate > 0:
                        total += got
                    fetched.append(got)
                    job.advance(now, vclock)
                    continue
                dt = now - job.t
                got = 0.0
                if remote > 0 and rate > 0:
                    got = remote * dt
                    total += got
                fetched.append(got)
                if rate <= 0.0:
                    job.advance(now, vclock)
                    continue
                # SimJob.advance at a written-out rate, written out (a step brings
                # every reader of every shared filling unit to now): the same
                # operations in the same order (rate, remote and dt read once)
                if dt <= 0:
                    continue
                job.t = now
                job.equal_integral += job.equal_rate * dt
                read = rate * dt
                effective = job.effective
                if effective > 0.0:
                    unread = job.size - job.pos
                    if unread > 0:
                        left = unread - read
                        job.effective = effective * ((left if left > 0.0 else 0.0) / unread)
                job.read += read
                job.pos += read
                hits = read * job.hit
                job.hit_bytes += hits
                job.epoch_hits += hits
                job.remote_bytes += remote * dt
            before = filled[key]
            units.sync(key, now)
            admit = filled[key] - before
            if admit <= 0 or total <= 0:
                continue
            uncached = units.units[key].size - before
            if 1e-9 > uncached:
                uncached = 1e-9
            for other, got in zip(group, fetched, strict=True):
                # what others admitted is new to `other` unless it already read it
                new = admit - admit * got / total
                if new > 0:
                    unread = other.size - other.pos
                    if not unread > 0.0:
                        unread = 0.0
                    effective = other.effective
                    frac = unread - effective
                    frac = (frac if frac > 0.0 else 0.0) / uncached
                    more = effective + new * (frac if frac < 1.0 else 1.0)
                    other.effective = more if more < unread else unread
                if other.share > 0:
                    touched[other.name] = other

    def _boundaries(self) -> None:
        """The jobs whose event is due: finished, or at an epoch's end; then the units
        that became full, the re-plan timer, and the arrivals."""
        clock, units = self.clock, self.units
        now = clock.now
        # Nothing wrote an event since _step's soonest() (a shared fill only brings
        # jobs to now): the slots it found are still each array's first.
        for job in clock.due(clock.argmins):
            job.seq = -1  # consumed (Clock.due): the next rate sets the next one
            job.advance(now, clock.vclock)
            self.touched[job.name] = job
            if _at_end(job, job.work - job.read, now, clock.vclock) or (
                # its last epoch ended (each may end up to eps short: what is left of
                # the work then is rounding, not an epoch more)
                job.epochs_done + 1 >= job.spec.epochs
                and _at_end(job, job.size - job.pos, now, clock.vclock)
            ):
                job.close_epoch()
                job.finish = now
                self._leave(job)
            elif _at_end(job, job.size - job.pos, now, clock.vclock):  # nothing unread
                job.close_epoch()
                job.pos = 0.0
                job.epochs_done += 1
                units.sync(job.unit, now)
                job.effective = units.filled[job.unit] if not units.lru else 0.0
                if units.lru:
                    # the targets stand until a re-plan; holdings still growing move hits
                    self._lru_grow()
                elif abs(self._hit(job) - job.hit) > _REPLAN_HIT_CHANGE:
                    self.dirty = True  # what it fetched last epoch is effective now
        if not units.lru and units.filling:
            units.sync_full(now)  # a full unit re-plans
        if now >= self.next_plan - 1e-9:
            self.dirty = True
        self._arrivals()

    def _leave(self, job: SimJob) -> None:
        clock = self.clock
        if job.held:
            clock.exit(job)
        self.units.leave(job.unit, job.remote, clock.now)
        self.total_rate -= job.rate
        self.total_remote -= job.remote
        if job.rate > 0:
            self.recorder.rate(job.name, clock.now, 0.0)
        job.rate = job.remote = 0.0
        clock.remove(job)
        del self.active[job.name]
        self.running.pop(job.name, None)
        self.link.drop(job.name)
        self.touched.pop(job.name, None)
        group = self.readers[job.unit]
        del group[next(i for i, other in enumerate(group) if other is job)]  # (not ==)
        self.units.readers(job.unit, len(group))
        if not group:
            del self.readers[job.unit]
        dataset = job.spec.dataset
        self.dataset_readers[dataset] -= 1
        if not self.dataset_readers[dataset]:
            del self.dataset_readers[dataset]
        self.dirty = self.jobs_moved = True

    def _arrivals(self) -> None:
        now, units = self.clock.now, self.units
        while self.pending and self.pending[-1].spec.submit <= now + 1e-9:
            job = self.pending.pop()
            job.t = now
            self.clock.add(job)
            # everything cached is unread by a new job: effective from its first epoch
            job.effective = units.filled_now(job.unit, now)
            if units.lru:
                units.sync(job.unit, now)
            held = self.pool.resident.get(job.spec.dataset, 0.0)
            job.first_hit = min(1.0, held / job.size)
            self.active[job.name] = job
            group = self.readers.setdefault(job.unit, [])
            group.append(job)
            units.readers(job.unit, len(group))
            dataset = job.spec.dataset
            self.dataset_readers[dataset] = self.dataset_readers.get(dataset, 0) + 1
            self.dirty = self.jobs_moved = True

    def _result(self) -> SimResult:
        clock = self.clock
        clock.dissolve()
        self.units.sync_all(clock.now)
        for job in self.active.values():
            job.advance(clock.now, clock.vclock)
        if self.recorder.job_rates is not None:
            for job in self.active.values():
                self.recorder.rate(job.name, clock.now, 0.0)
        return self.recorder.result(
            self.scenario.name,
            self.scheduler_name,
            self.cache_name,
            self.all,
            clock.now,
            interrupted=bool(self.pending or self.active),
            node_caches=self.scenario.node_caches,
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


# A plan makes a view anew for every job whose hit ratio moved (some 200 a plan on the
# 4-week traces). Job is a frozen dataclass, whose __init__ sets each field through
# object.__setattr__; setting its slots through their descriptors makes the same object
# (every field set, nothing else run) in half the time. Each setter is taken by its
# field's name; the check below fails at import if Job gains or loses a field.
_VIEW_FIELDS = (
    "name", "dataset", "gpus", "f_star", "reads", "remaining", "submit", "placement", "hit_now"
)  # fmt: skip
if {f.name for f in fields(Job)} != set(_VIEW_FIELDS):
    raise ImportError(f"model.Job's fields are not {_VIEW_FIELDS}: _new_view must set them")
(
    _set_name, _set_dataset, _set_gpus, _set_f_star, _set_reads, _set_remaining,
    _set_submit, _set_placement, _set_hit_now,
) = (slot.__set__ for slot in attrgetter(*_VIEW_FIELDS)(Job))  # fmt: skip
_new_object = object.__new__


def _new_view(
    job: SimJob, remaining: float, placement: Mapping[str, int] | None, hit_now: float | None
) -> Job:
    """The job as a policy sees it, with what the plan reads (math.inf, None: not read):
    Job(name, dataset, gpus, f*, reads, remaining, submit, placement, hit_now)."""
    spec = job.spec
    view = _new_object(Job)
    _set_name(view, job.name)
    _set_dataset(view, spec.dataset)
    _set_gpus(view, spec.gpus)
    _set_f_star(view, spec.ideal_io)
    _set_reads(view, job.reads)
    _set_remaining(view, remaining)
    _set_submit(view, spec.submit)
    _set_placement(view, placement)
    _set_hit_now(view, hit_now)
    return view


def _at_end(job: SimJob, left: float, now: float, vclock: float) -> bool:
    """Is `left` (bytes to the job's end or its epoch's) nothing? At most `eps`, or less
    than the job reads in the smallest step the clock can take at `now` (`now` + the
    time to read it rounds to `now`): the job's event would be due again at once with
    nothing read, and the run would stall at `now` for ever. Late in a long run (a
    clock of ~2e7 s steps by ~4e-9 s) a job at ~1 GB/s reads more than `eps` per step."""
    if left <= job.eps:
        return True
    rate = job.rate
    if rate > 0.0 and now + left / rate <= now:
        return True
    return job.held and vclock + left * (1.0 - job.hit) <= vclock


def simulate(scenario: Scenario, scheduler: str, cache: str, interval: float = 600.0) -> SimResult:
    """Run `scenario` to completion under a scheduler and a cache system."""
    return Simulation(scenario, scheduler, cache, interval).run()
