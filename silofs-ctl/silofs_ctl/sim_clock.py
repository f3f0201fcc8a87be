"""Simulated time: now, the jobs' pending events, and the level clock.

Owns: the current time, each job's next event (its end, its epoch's end, its LRU
segment's end) as a time in an array, and the level clock: the jobs held at
the link's fair level, whose progress is the integral of that level and whose events are
marks on the integral. Never: decides a rate or a share, or touches cache units and the
link's totals (the simulator applies a level move to those: `relevel` says by how much).

Events: each active job has a slot (SimJob.slot) in two arrays of next-event times, one
in time and one in vclock; a slot holds the job's latest event or inf. A re-rate
overwrites its slot (no stale entries to skip), and the next event is an argmin over the
active jobs' slots, a pass in C. Events due together are taken in (time, seq) order, seq
counting every scheduling (job.seq), as a heap of (time, seq, job) would pop them.

The level clock. A job held at the link's fair level `level` reads level / (1 - hit), so
when the level moves and the division still holds it, nothing about it needs writing
out: its progress is the integral of the level since it was last brought to now
(`vclock`, advanced by level x dt at every tick; SimJob.advance reads it), and its next
event is where vclock reaches a mark (`vtimes`, like `times` but in vclock). A level
move then costs the units such jobs read that are still filling (or, under LRU, growing
to their target), not each job. A job leaves the clock when an event touches it, when a
division stops holding it, when it leaves, and at every re-plan. It runs only without
per-job rate logs: those write every rate out. Under uniform caching a held job's hit
ratio is H / unread, which reading keeps: the simulator decides where the clock runs
(Simulation.uniform_clock).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from operator import attrgetter

import numpy as np

from .sim_job import SimJob

log = logging.getLogger(__name__)

_joined = attrgetter("joined")  # the order of Clock.held (a dict: in the order of enter)
_INF = math.inf


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.seq = 0  # the last event's sequence number (both kinds)
        # Per slot: the job there (None: free) and its next event in time (`times`) or
        # as a vclock mark (`vtimes`), inf where it has none; at most one is finite.
        self.jobs: list[SimJob | None] = []
        self.free: list[int] = []  # free slots, the lowest last
        self.times = np.empty(0)
        self.vtimes = np.empty(0)
        # the level clock runs (set per plan: LRU, or uniform caching under Gavel's
        # vanilla plans; no rate logs)
        self.on = False
        self.level = 0.0  # the fair level the held jobs read at (0: none held)
        self.vclock = 0.0  # the integral of `level` since t=0
        self.held: dict[str, SimJob] = {}
        self.held_units: dict[str, int] = {}  # held jobs per unit
        self.held_k = 0.0  # sum of the held jobs' 1 / (1 - hit)
        self.entries = 0  # jobs put on the level clock (for tests and profiles)
        self.argmins = (-1, -1)  # the slots the last soonest() found (due's hint)

    # ------------------------------------------------------------ slots

    def add(self, job: SimJob) -> None:
        """Give an arriving job a slot (no event yet)."""
        if not self.free:
            size = len(self.jobs)
            grow = max(64, size)
            self.jobs.extend([None] * grow)
            self.times = np.concatenate((self.times, np.full(grow, _INF)))
            self.vtimes = np.concatenate((self.vtimes, np.full(grow, _INF)))
            self.free.extend(range(size + grow - 1, size - 1, -1))
        job.slot = slot = self.free.pop()
        self.jobs[slot] = job

    def remove(self, job: SimJob) -> None:
        """A leaving job's slot back (its events gone)."""
        self.cancel(job)
        slot = job.slot
        self.jobs[slot] = None
        self.free.append(slot)
        job.slot = -1

    def cancel(self, job: SimJob) -> None:
        """The job has no pending event (it waits, or its event was consumed)."""
        job.seq = -1
        job.unwritten = False
        self.times[job.slot] = _INF
        self.vtimes[job.slot] = _INF

    # ------------------------------------------------------------ time and events

    def tick(self, dt: float) -> None:
        """Move time forward by `dt` (the level clock with it)."""
        self.now += dt
        self.vclock += self.level * dt

    def schedule(self, job: SimJob) -> None:
        """A new event for `job` from its rate now (none if it does not read), in place of
        any earlier one. Its LRU boundary is the one the event is computed with."""
        self.seq = seq = self.seq + 1
        job.seq = seq
        job.event_boundary = boundary = job.boundary
        rate = job.rate
        if rate > 0:
            # SimJob.until, written out (this runs at every re-rate)
            until = job.work - job.read
            left = job.size - job.pos
            if left < until:
                until = left
            if boundary < _INF:
                left = boundary * job.size - job.pos
                if left < until:
                    until = left
            self.times[job.slot] = self.now + (until if until > 0.0 else 0.0) / rate
        else:
            self.times[job.slot] = _INF

    def schedule_all(self, jobs: list[SimJob]) -> None:
        """schedule of each of `jobs` in turn (a re-plan re-rates every running job), the
        event times written into the array at once: the same times and seqs."""
        now, seq = self.now, self.seq
        slots: list[int] = []
        times: list[float] = []
        for job in jobs:
            seq += 1
            job.seq = seq
            job.event_boundary = boundary = job.boundary
            rate = job.rate
            if rate > 0:
                # SimJob.until, written out (as in schedule)
                until = job.work - job.read
                left = job.size - job.pos
                if left < until:
                    until = left
                if boundary < _INF:
                    left = boundary * job.size - job.pos
                    if left < until:
                        until = left
                times.append(now + (until if until > 0.0 else 0.0) / rate)
            else:
                times.append(_INF)
            slots.append(job.slot)
        self.seq = seq
        if slots:
            self.times[slots] = times

    def put_events(self, seq: int, slots: list[int], times: list[float]) -> None:
        """The events a caller found in its own pass as schedule_all finds them (the
        seqs up to `seq` given in order, the times of `slots`), written at once."""
        self.seq = seq
        if slots:
            self.times[slots] = times

    def soonest(self) -> float:
        """The time of the next job event (math.inf: none). The slots found are kept in
        `argmins` (of times, of vtimes; -1: not looked for), for due()."""
        times = self.times
        if not len(times):
            self.argmins = (-1, -1)
            return _INF
        slot = int(times.argmin())
        soonest = float(times[slot])
        vslot = -1
        if self.held and self.level > 0:
            vtimes = self.vtimes
            vslot = int(vtimes.argmin())
            mark = float(vtimes[vslot])
            if mark < _INF:
                soonest = min(soonest, self.now + (mark - self.vclock) / self.level)
        self.argmins = (slot, vslot)
        return soonest

    def due(self, argmins: tuple[int, int] = (-1, -1)) -> list[SimJob]:
        """The jobs whose event is now (to rounding), their events consumed: events in
        time first, then those on the level clock, each in (time, seq) order.
        argmins: soonest()'s `argmins`, when no event was written since (the
        simulator's step: only time moved), so the first pass over each array is
        not made again (-1: make it)."""
        due_jobs: list[SimJob] = []
        if not len(self.times):
            return due_jobs
        tol = 1e-9 * max(1.0, self.now)
        jobs = self.jobs
        for marks, at, slot in (
            (self.times, self.now + tol, argmins[0]),
            # (the same tolerance in time)
            (self.vtimes, self.vclock + self.level * tol, argmins[1]),
        ):
            found: list[tuple[float, int, SimJob]] = []
            while True:
                if slot < 0:
                    slot = int(marks.argmin())
                mark = float(marks[slot])
                if not mark <= at:
                    break
                job = jobs[slot]
                found.append((mark, job.seq, job))  # type: ignore[union-attr]
                marks[slot] = _INF
                slot = -1
            if len(found) > 1:
                found.sort(key=_time_seq)
            due_jobs.extend(job for _, _, job in found)
            if not self.held:
                break  # (no marks on the level clock)
        return due_jobs

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
        self.vtimes[job.slot] = self.vclock + job.until(boundary) * (1.0 - hit)
        self.times[job.slot] = _INF

    def enter_all(self, jobs: Iterable[SimJob]) -> list[str]:
        """enter of each of `jobs` in turn (a division's held jobs), their marks written
        into the arrays at once: the same marks, seqs and sums (no enter reads another
        job). Returns the names of those it would not take (not held after)."""
        level, vclock = self.level, self.vclock
        held, held_units = self.held, self.held_units
        entries, seq, held_k = self.entries, self.seq, self.held_k
        slots: list[int] = []
        marks: list[float] = []
        off: list[str] = []
        for job in jobs:
            if job.held:
                continue
            hit = job.hit
            remote = job.remote
            if (
                not hit < 1.0 - 1e-12
                or remote != level
                or not remote > 0.0
                or job.rate != remote / (1.0 - hit)  # (not held back by its GPU share)
            ):
                off.append(job.name)
                continue
            job.held = True
            job.v = vclock
            held[job.name] = job
            entries += 1
            job.joined = entries
            job.held_k = k = 1.0 / (1.0 - hit)
            held_k += k
            unit = job.unit
            held_units[unit] = held_units.get(unit, 0) + 1
            seq += 1
            job.seq = seq
            job.event_boundary = boundary = job.boundary
            # SimJob.until, written out (as in schedule)
            until = job.work - job.read
            left = job.size - job.pos
            if left < until:
                until = left
            if boundary < _INF:
                left = boundary * job.size - job.pos
                if left < until:
                    until = left
            marks.append(vclock + (until if until > 0.0 else 0.0) * (1.0 - hit))
            slots.append(job.slot)
        self.entries, self.seq, self.held_k = entries, seq, held_k
        if slots:
            self.vtimes[slots] = marks
            self.times[slots] = _INF
        return off

    def exit(self, job: SimJob) -> None:
        """Take a job off the level clock: brought to now, its rate and remote written out
        (the inflows and totals held it at them already), its next event in time."""
        job.advance(self.now, self.vclock)
        job.held = False
        self.vtimes[job.slot] = _INF
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

    def dissolve(self, defer: bool = False) -> None:
        """Every held job off the level clock (a re-plan re-rates them all): exit of each
        in the order they joined, the bookkeeping of the held set dropped at once and
        their events written by schedule_all (the same times and seqs: no exit reads
        another job's fields or event).

        defer: each event gets its seq and boundary here, in the same order, but its
        time is left to the caller (SimJob.unwritten; `times` keeps inf there, as a held
        job's slot has): a re-plan re-rates most of them at once or puts them back on
        the level clock, which replaces the event, and writes the time of the others
        from the same fields, which nothing moves before it (no time passes)."""
        held = self.held
        if held:
            jobs = list(held.values())
            now, vclock, level = self.now, self.vclock, self.level
            if defer:
                seq = self.seq
                for job in jobs:
                    job.advance(now, vclock)
                    job.held = False
                    job.remote = level
                    job.rate = level / (1.0 - job.hit)
                    seq += 1
                    job.seq = seq
                    job.event_boundary = job.boundary
                    job.unwritten = True
                self.seq = seq
            else:
                for job in jobs:
                    job.advance(now, vclock)
                    job.held = False
                    job.remote = level
                    job.rate = level / (1.0 - job.hit)
            held.clear()
            self.held_units.clear()
            self.vtimes.fill(_INF)  # (only a held job has a mark on the level clock)
            if not defer:
                self.schedule_all(jobs)
        self.held_k = 0.0


def _time_seq(event: tuple[float, int, SimJob]) -> tuple[float, int]:
    return event[0], event[1]
