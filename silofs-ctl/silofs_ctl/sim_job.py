"""One simulated job: its counters, its current rates, and the step that brings it to now.

Owns: SimJob, a job's state between events (bytes read, epoch position, the cached bytes
it has not read this epoch, its GPU share, hit ratio, rate and remote IO, its pending
event), and SimJob.advance, the one progress step every loop of the simulator uses.
Never: decides a rate, reads another job, or touches a cache unit or the link.

Between two events a job's rate, remote IO and hit ratio are constant, so its progress
is linear; bringing it to now over many steps at once is the same arithmetic as doing it
step by step. A job held at the link's fair level on the level clock (sim_clock.Clock)
reads at level / (1 - hit) while the level moves, so its progress is the integral of the
level (the clock's `vclock`) since it was last brought to now; its H shrinks with what
it read as at any rate (H / unread stays, so its hit ratio does).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from .model import Job
from .scenario import JobSpec

log = logging.getLogger(__name__)


# slots: the event loop reads and writes these fields for every active job at every
# re-plan, and slot access is the cheaper one; eq=False: a job is itself alone (it is
# found in lists by identity, and hashes as itself).
@dataclass(slots=True, eq=False)
class SimJob:
    spec: JobSpec
    unit: str  # the cache unit it reads through
    size: float  # its dataset's bytes
    work: float  # bytes it reads in all (epochs x size)
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
    share: float = 0.0  # of its GPUs
    io_cap: float | None = None
    placement: dict[str, int] | None = None
    hit: float = 0.0
    rate: float = 0.0
    remote: float = 0.0
    boundary: float = math.inf  # LRU: epoch position where the current hit ratio ends
    t: float = 0.0  # when the fields above were last brought to now (advance)
    seq: int = -1  # its latest event's sequence number (Clock.schedule); -1: none
    slot: int = -1  # its place in the clock's event arrays while active (Clock.add)
    event_boundary: float = math.inf  # the LRU boundary that event was computed with
    lru_held: float = -1.0  # LRU: the dataset's holding its hit ratio was computed with
    view: Job | None = None  # its policy view, kept while the plan reads nothing new
    # Held at the link's level on the level clock: its rate and remote are then
    # level / (1 - hit) and level, not the fields above, and it read
    # (vclock - v) / (1 - hit) bytes since t.
    held: bool = False
    v: float = 0.0
    held_k: float = 0.0  # 1 / (1 - hit) when it joined (what Clock.held_k sums)
    joined: int = 0  # when it last joined the level clock (Clock.entries then)
    # Its latest event has its seq and boundary but its time is not yet in the clock's
    # array (Clock.dissolve with defer: the re-plan that follows writes it, or replaces
    # the event, or cancels it).
    unwritten: bool = False
    # Fixed for the job's life; plain attributes because the event loop reads them for
    # every active job at every step.
    name: str = field(init=False)
    eps: float = field(init=False)  # bytes that count as nothing left (rounding)
    reads: dict[str, float] = field(init=False)  # its views' Job.reads (never changed)
    ideal_io: float = field(init=False)  # spec.ideal_io, f* (every re-rate reads it)

    def __post_init__(self) -> None:
        self.name = self.spec.name
        self.eps = max(1.0, self.size * 1e-12)
        self.reads = {self.unit: 1.0}
        self.ideal_io = self.spec.ideal_io

    @classmethod
    def of(cls, spec: JobSpec, *, private: bool) -> SimJob:
        """The job of `spec`; private: it reads through a cache unit of its own (CoorDL)."""
        unit = f"job:{spec.name}" if private else spec.dataset
        size = float(spec.dataset_size)
        return cls(spec=spec, unit=unit, size=size, work=spec.epochs * size)

    @property
    def unread(self) -> float:
        return max(0.0, self.size - self.pos)

    def advance(self, now: float, vclock: float) -> None:
        """Bring the job to `now`: it read at a constant rate since `t` (on the level
        clock: at level / (1 - hit), `vclock - v` remote bytes since then).

        Reading keeps H / unread constant (the order is random): what it has not read of
        the cache shrinks with what it has not read at all. Waiting counts towards its
        equal-share integral: fairness is over its life."""
        dt = now - self.t
        if dt <= 0:
            return
        self.t = now
        self.equal_integral += self.equal_rate * dt
        if self.held:
            fetched = vclock - self.v
            self.v = vclock
            got = fetched / (1.0 - self.hit)
        else:
            rate = self.rate
            if rate <= 0:
                return
            got = rate * dt
            fetched = self.remote * dt
        if self.effective > 0.0:  # (0 under LRU, and it stays 0)
            unread = self.size - self.pos
            if unread > 0:
                left = unread - got
                self.effective *= (left if left > 0.0 else 0.0) / unread  # max(0, left)
        self.read += got
        self.pos += got
        hits = got * self.hit
        self.hit_bytes += hits
        self.epoch_hits += hits
        self.remote_bytes += fetched

    def until(self, boundary: float) -> float:
        """Bytes to its next event: its end, its epoch's, its LRU segment's (`boundary`,
        a position in the epoch)."""
        until = self.work - self.read
        left = self.size - self.pos
        if left < until:
            until = left
        if boundary < math.inf:
            left = boundary * self.size - self.pos
            if left < until:
                until = left
        return until if until > 0.0 else 0.0

    def close_epoch(self) -> None:
        """Record the hit ratio of the epoch read so far."""
        if self.pos > 0:
            self.epoch_hit_ratios.append(self.epoch_hits / self.pos)
        self.epoch_hits = 0.0
