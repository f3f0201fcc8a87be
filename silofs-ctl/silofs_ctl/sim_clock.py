"""Simulated time: now, the jobs' pending events, and the level clock.

Owns: the current time, each job's next event (its end, its epoch's end, its LRU
segment's end) in a heap keyed by time, and the level clock: the jobs held at
the link's fair level, whose progress is the integral of that level and whose events are
marks on the integral. Never: decides a rate or a share, or touches cache units and the
link's totals (the simulator applies a level move to those: `relevel` says by how much).

Events: (time, seq, job); an entry is stale unless seq is the job's latest (job.seq), so
a job that is re-rated pushes a new entry and the old one is skipped when it surfaces.

The level clock. A job held at the link's fair level `level` reads level / (1 - hit), so
when the level moves and the division still holds it, nothing about it needs writing
out: its progress is the integral of the level since it was last brought to now
(`vclock`, advanced by level x dt at every tick; SimJob.advance reads it), and its next
event is where vclock reaches a mark (`vevents`, like `events` but in vclock). A level
move then costs the units such jobs read that are still filling (or, under LRU, growing
to their target), not each job. A job leaves the clock when an event touches it, when a
division stops holding it, when it leaves, and at every re-plan. It runs only without
per-job rate logs: those write every rate out. Under uniform caching a held job's hit
ratio is H / unread, which reading keeps: the simulator decides where the clock runs
(Simulation.uniform_clock).
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Iterable
from operator import attrgetter

from .sim_job import SimJob

log = logging.getLogger(__name__)

_joined = attrgetter("joined")  # the order of Clock.held (a dict: in the order of enter)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.seq = 0  # the last event's sequence number (both heaps)
        self.events: list[tuple[float, int, SimJob]] = []
        # the level clock runs (set per plan: LRU, or uniform caching under Gavel's
        # vanilla plans; no rate logs)
        self.on = False
        self.level = 0.0  # the fair level the held jobs read at (0: none held)
        self.vclock = 0.0  # the integral of `level` since t=0
        self.vevents: list[tuple[float, int, SimJob]] = []  # (vclock mark, seq, job)
        self.held: dict[str, SimJob] = {}
        self.held_units: dict[str, int] = {}  # held jobs per unit
        self.held_k = 0.0  # sum of the held jobs' 1 / (1 - hit)
        self.entries = 0  # jobs put on the level clock (for tests and profiles)

    # ------------------------------------------------------------ time and events

    def tick(self, dt: float) -> None:
        """Move time forward by `dt` (the level clock with it)."""
        self.now += dt
        self.vclock += self.level * dt

    def schedule(self, job: SimJob) -> None:
        """A new event for `job` from its rate now (none if it does not read): earlier
        ones go stale. Its LRU boundary is the one the event is computed with."""
        self.seq = seq = self.seq + 1
        job.seq = seq
        job.event_boundary = boundary = job.boundary
        rate = job.rate
        if rate > 0:
            heapq.heappush(self.events, (self.now + job.until(boundary) / rate, seq, job))

    def soonest(self) -> float:
        """The time of the next job event (math.inf: none)."""
        soonest = math.inf
        events = self.events
        while events and events[0][1] != events[0][2].seq:
            heapq.heappop(events)  # stale
        if events:
            soonest = events[0][0]
        vevents = self.vevents
        while vevents and vevents[0][1] != vevents[0][2].seq:
            heapq.heappop(vevents)  # stale
        if vevents and self.level > 0:
            soonest = min(soonest, self.now + (vevents[0][0] - self.vclock) / self.level)
        return soonest

    def due(self) -> list[SimJob]:
        """The jobs whose event is now (to rounding), taken off the heaps: events in
        time first, then those on the level clock."""
        due_jobs = []
        tol = 1e-9 * max(1.0, self.now)
        for events, at in (
            (self.events, self.now + tol),
            (self.vevents, self.vclock + self.level * tol),  # (the same tolerance in time)
        ):
            while events and events[0][0] <= at:
                _, seq, job = heapq.heappop(events)
                if seq == job.seq:
                    due_jobs.append(job)
        return due_jobs

    def compact(self, running: int) -> None:
        """Drop stale events once they outnumber the live ones by far."""
        if len(self.events) > 4 * running + 1024:
            self.events = [e for e in self.events if e[1] == e[2].seq]
            heapq.heapify(self.events)

    # ------------------------------------------------------------ the level clock

    def enter(self, job: SimJob) -> None:
        """Put a running job (brought to now, its remote the level) on the level clock, if
        it may go: its rate is then level / (1 - hit) while it is held."""
        hit = job.hit
        if (
            job.held
            or not hit < 1.0 - 1e-12
            or job.remote != self.level
            or not job.remote > 0.0
            or job.rate != job.remote / (1.0 - hit)  # (not held back by its GPU share)
        ):
            return
        job.held = True
        job.v = self.vclock
        self.held[job.name] = job
        self.entries += 1
        job.joined = self.entries
        job.held_k = k = 1.0 / (1.0 - hit)
        self.held_k += k
        self.held_units[job.unit] = self.held_units.get(job.unit, 0) + 1
        self.seq += 1
        job.seq = self.seq
        job.event_boundary = boundary = job.boundary
        mark = self.vclock + job.until(boundary) * (1.0 - hit)
        heapq.heappush(self.vevents, (mark, self.seq, job))

    def exit(self, job: SimJob) -> None:
        """Take a job off the level clock: brought to now, its rate and remote written out
        (the inflows and totals held it at them already), its next event in time."""
        job.advance(self.now, self.vclock)
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
        job.remote = remote = self.level
        job.rate = remote / (1.0 - job.hit)
        self.schedule(job)

    def relevel(self, fair: float | None, leaving: Iterable[SimJob]) -> float:
        """A new division of the link: the held jobs it does not hold (`leaving`; with
        `fair` None, every one) leave at the old level, in the order they joined; the
        others move to the new level `fair`. Returns the step of the level when jobs
        stay held (0 when none do), which the caller adds to the inflows of held_units
        and to the totals."""
        held = self.held
        if held:
            if fair is None:
                leaving = list(held.values())
            else:
                leaving = sorted(leaving, key=_joined)
            for job in leaving:
                self.exit(job)
        new = fair if fair is not None else 0.0
        step = new - self.level if held else 0.0
        self.level = new
        return step

    def dissolve(self) -> None:
        """Every held job off the level clock (a re-plan re-rates them all)."""
        for job in list(self.held.values()):
            self.exit(job)
        self.vevents = []
        self.held_k = 0.0
