"""The simulator's model of an LRU cache under deep learning's access pattern: every item
once per epoch, in a new random order (not silofs/cache/lru.py, the daemon's real LRU).

Owns the closed forms the simulator uses for the Alluxio baseline, and LruPool: the
pool's holdings over a run (each dataset's steady-state target, found again only when
the running readers change, and what it holds now, growing towards it with what its
readers fetch). Never: moves time, sets rates, or reads anything of a job but its
dataset, rate ceiling, IO cap and epoch position.

One dataset alone in an LRU cache holding a fraction r of it. An item read at position x
(a fraction of the epoch) is read again at position y of the next epoch. In between,
the items after x in this epoch and before y in the next are touched; the two sets are
independent random subsets, so the distinct bytes in between are (1-x) + y - (1-x)y =
1 - x(1-y). The item hits iff that is under r, i.e. x(1-y) > s with s = 1 - r. For x, y
independent and uniform, P(XZ > s) = 1 - s + s ln s: the steady-state hit ratio (it
thrashes: r = 0.5 gives 0.153, not the 0.5 of uniform caching). Conditioned on the
position y, the hit probability is max(0, 1 - s/(1-y)): hits happen early in an epoch
and stop at y = r.

Several datasets in one LRU pool: each dataset holds, at steady state, the distinct
bytes its readers touched within the pool's characteristic time T (Che's approximation),
with T set so the holdings fill the pool. A dataset then behaves like one alone in an LRU
of its holding's size. This is exact for one dataset and an approximation otherwise.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, compress, count, repeat
from operator import add, gt, le, mul, sub, truediv
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .sim_job import SimJob

log = logging.getLogger(__name__)

_ROUNDS = 12  # at most, of the equilibrium's iteration (it stops when rates move < 1%)
# From this many readers the equilibrium is solved as arrays (numpy's per-call cost pays
# for itself; below it, lists): both give the same bits.
_ARRAYS_FROM = 128


def steady_hit_ratio(r: float) -> float:
    """Expected hit ratio of one epoch after the first, LRU holding fraction r."""
    if r >= 1.0:
        return 1.0
    if r <= 0.0:
        return 0.0
    s = 1.0 - r
    return 1.0 - s + s * math.log(s)


def hit_between(r: float, y0: float, y1: float) -> float:
    """Mean hit probability over epoch positions [y0, y1], LRU holding fraction r."""
    if r >= 1.0:
        return 1.0
    if y1 <= y0:
        return hit_at(r, y0)
    s = 1.0 - r
    top = min(y1, r)
    if top <= y0:
        return 0.0
    # integral of 1 - s/(1-y) dy from y0 to top
    hits = (top - y0) - s * math.log((1.0 - y0) / (1.0 - top))
    return max(0.0, hits / (y1 - y0))


def hit_at(r: float, y: float) -> float:
    if r >= 1.0:
        return 1.0
    return max(0.0, 1.0 - (1.0 - r) / (1.0 - y)) if y < 1.0 else 0.0


def distinct_fraction(w: float) -> float:
    """Expected distinct fraction of a dataset one reader touches in a window of w epochs."""
    if w <= 0:
        return 0.0
    if w <= 1.0:
        return w - w**3 / 6.0
    if w >= 2.0:
        return 1.0
    # window [x, x+w) with x uniform: it covers a whole epoch iff x >= 2 - w; otherwise it
    # covers (1-x) of one epoch and x+w-1 of the next, overlapping in expectation by the
    # product. Integrating u = 1 - x over (w-1, 1]:
    inner = w * (2.0 - w) - (w / 2 - 1 / 3 - w * (w - 1) ** 2 / 2 + (w - 1) ** 3 / 3)
    return inner + (w - 1.0)


def holdings_at(
    capacity: float,
    sizes: Mapping[str, float],
    readers: Mapping[str, Sequence[float]],
    guess: float | None = None,
) -> tuple[dict[str, float], float | None]:
    """Steady-state bytes each dataset holds in an LRU pool of `capacity`, and the
    pool's characteristic time T they were found at (None: everything fits).

    readers: dataset -> read rates (bytes/s) of the jobs reading it now.
    guess: T last time, if known: the search starts next to it."""
    active = {k: v for k, v in readers.items() if any(rate > 0 for rate in v)}
    if sum(sizes[k] for k in active) <= capacity:
        return {k: sizes[k] for k in active}, None
    # Per dataset: its size and each reader's rate in dataset sizes per second.
    items = [(k, sizes[k], [rate / sizes[k] for rate in active[k]]) for k in active]
    found: dict[float, list[float]] = {}  # the holdings at each T evaluated

    def held_all(t: float) -> list[float]:
        out = []
        for _, size, per in items:
            untouched = 1.0
            for x in per:
                # distinct_fraction(t * x), inlined: this is the inner loop of the search
                w = t * x
                if w <= 1.0:
                    untouched *= 1.0 - w + w * w * w / 6.0
                elif w >= 2.0:
                    untouched = 0.0  # a whole epoch in the window: held whole
                    break
                else:
                    untouched *= 1.0 - distinct_fraction(w)
            out.append(size * (1.0 - untouched))
        found[t] = out
        return out

    def excess(t: float) -> float:
        return sum(held_all(t)) - capacity

    lo = _fill_time(excess, capacity, guess)
    held = found.get(lo)  # (the search ends at a T it evaluated, but at T = 0)
    if held is None:
        held = held_all(lo)
    return {k: held for (k, _, _), held in zip(items, held, strict=True)}, lo


def _fill_time(excess: Callable[[float], float], capacity: float, guess: float | None) -> float:
    """The pool's characteristic time T: where `excess(T)` (the holdings at T less the
    pool's `capacity`) reaches 0, from below. guess: T last time, if known."""
    # The holdings grow with T: find the T at which they fill the pool, from below so
    # that they never exceed it. Regula falsi with the Illinois fix: a few evaluations
    # where bisection to full precision took a hundred (this runs at every epoch end).
    if guess and guess > 0:
        lo, hi = guess, guess * 1.01
        f_lo = excess(lo)
        if f_lo >= 0:
            hi, f_hi = lo, f_lo
            lo = guess / 1.01
            f_lo = excess(lo)
            while f_lo >= 0:
                hi, f_hi = lo, f_lo
                lo /= 2.0
                f_lo = excess(lo)
        else:
            f_hi = excess(hi)
            while f_hi < 0:
                lo, f_lo = hi, f_hi
                hi *= 2.0
                f_hi = excess(hi)
    else:
        lo, hi = 0.0, 1.0
        f_lo, f_hi = -capacity, excess(hi)
        while f_hi < 0:
            lo, f_lo = hi, f_hi
            hi *= 2.0
            f_hi = excess(hi)
    kept = 0  # which end the last step moved: -1 lo, 1 hi
    for _ in range(200):
        # 1e-10 of the pool: far below anything a hit ratio or a rate can tell apart
        if hi - lo <= 1e-10 * hi or -f_lo <= 1e-10 * capacity:
            break
        mid = hi - f_hi * (hi - lo) / (f_hi - f_lo)
        if not lo < mid < hi:
            mid = (lo + hi) / 2
        f_mid = excess(mid)
        if f_mid < 0:
            lo, f_lo = mid, f_mid
            if kept == -1:
                f_hi /= 2
            kept = -1
        else:
            hi, f_hi = mid, f_mid
            if kept == 1:
                f_lo /= 2
            kept = 1
    return lo


@dataclass(frozen=True)
class LruReader:
    """A running job as the LRU pool sees it: the dataset it reads, its rate when IO does
    not hold it back (GPU share x f*), its IO allocation (None: none) and its rate now."""

    dataset: str
    ceiling: float
    io_cap: float | None
    rate: float


@dataclass(frozen=True)
class Equilibrium:
    """What equilibrium() found: each dataset's holding, the pool's characteristic time
    (None: everything fits) and each reader's rate at that holding (for a warm start)."""

    held: dict[str, float]
    time: float | None
    rates: list[float]


def equilibrium(
    capacity: float,
    sizes: Mapping[str, float],
    readers: Sequence[LruReader],
    link: float,
    guess: float | None = None,
    rounds: int = _ROUNDS,
    start: Sequence[float] | None = None,
) -> Equilibrium:
    """Che holdings at the rates they lead to: a dataset's holding sets its readers'
    steady hit ratio, the hit ratios set their rates (the link shared max-min by what
    they miss), and the rates set the holdings. Iterated from `start` (default: the
    rates now), damped, until the rates move by under 1%.

    Holdings from the rates now alone lag behind a feedback that real LRUs have: found
    by bench/silod_live.py, where a 40 MB dataset read at 20 MB/s when cached came to be
    held whole by the daemon's LRU (hit ratio 0.82), while holdings from its IO-bound
    rate of 5 MB/s kept it at 29 MB (0.29 in the simulator).

    A start near the answer (the last equilibrium's rates when one reader came or went)
    ends after a round or two instead of up to `rounds`."""
    if start is None:
        start = [r.rate if r.rate > 0 else r.ceiling for r in readers]
    datasets = [r.dataset for r in readers]
    ceilings = [r.ceiling for r in readers]
    io_caps = [r.io_cap for r in readers]
    return _solve(len(datasets))(
        capacity, sizes, datasets, ceilings, io_caps, link, guess, rounds, start
    )


def _solve(readers: int) -> Callable[..., Equilibrium]:
    """equilibrium()'s solver for `readers` readers given as parallel lists (each
    reader's dataset, rate ceiling and IO cap): _solve_lists or _solve_arrays, which
    give the same bits (numpy's fixed cost per call is larger below _ARRAYS_FROM)."""
    return _solve_arrays if readers >= _ARRAYS_FROM else _solve_lists


def _solve_lists(
    capacity: float,
    sizes: Mapping[str, float],
    datasets: list[str],
    ceilings: list[float],
    io_caps: list[float | None],
    link: float,
    guess: float | None,
    rounds: int,
    start: Sequence[float],
) -> Equilibrium:
    """The equilibrium with a loop over the readers (the loops in C where they can be)."""
    rates = list(start)
    held: dict[str, float] = {}
    # What does not move from round to round, per reader in order (the loops below are
    # the same arithmetic as one loop over the readers, with their loops in C).
    idle = [i for i, ceiling in enumerate(ceilings) if not ceiling > 0]  # hit taken as 0.0
    capped = [(i, cap) for i, cap in enumerate(io_caps) if cap is not None]
    of_dataset: dict[str, list[int]] = {}  # datasets in order of their first reader
    for i, dataset in enumerate(datasets):
        of_dataset.setdefault(dataset, []).append(i)
    for _ in range(rounds):
        rate_at = rates.__getitem__
        by_dataset = {d: list(map(rate_at, idx)) for d, idx in of_dataset.items()}
        held, guess = holdings_at(capacity, sizes, by_dataset, guess)
        # one steady hit ratio per dataset: its readers share it
        hit_of = {d: steady_hit_ratio(min(1.0, held.get(d, 0.0) / sizes[d])) for d in by_dataset}
        hits = list(map(hit_of.__getitem__, datasets))
        for i in idle:
            hits[i] = 0.0
        needs = list(map(mul, ceilings, map(sub, repeat(1.0), hits)))  # ceiling * (1 - hit)
        for i, cap in capped:
            needs[i] = min(needs[i], cap)
        shares = _water_fill(link, needs)
        new = [
            ceiling if hit >= 1.0 - 1e-12 else min(ceiling, share / (1.0 - hit))
            for ceiling, share, hit in zip(ceilings, shares, hits, strict=True)
        ]
        # every rate moved by at most 1% (abs(a - b) <= 1e-2 * max(b, 1.0))
        bars = map(mul, repeat(1e-2), map(max, rates, repeat(1.0)))
        if all(map(le, map(abs, map(sub, new, rates)), bars)):
            rates = new
            break
        rates = list(map(truediv, map(add, new, rates), repeat(2)))  # damped: (a + b) / 2
    return Equilibrium(held, guess, rates)


def _water_fill(capacity: float, needs: list[float]) -> list[float]:
    """policies.base.water_fill of `needs` keyed by their place, as a list: the same
    order (a stable sort by demand), the same subtractions and level, to the bit."""
    if math.isinf(capacity):
        return list(needs)
    n = len(needs)
    order = sorted(range(n), key=needs.__getitem__)
    values = list(map(needs.__getitem__, order))
    # lefts[i]: what is left for order[i:] once every smaller demand is met
    lefts = list(accumulate(values, sub, initial=capacity))
    first = next(compress(count(), map(gt, values, map(truediv, lefts, range(n, 0, -1)))), n)
    shares = list(needs)
    if first < n:
        fair = lefts[first] / (n - first)
        for i in order[first:]:
            shares[i] = fair
    return shares


def _solve_arrays(
    capacity: float,
    sizes: Mapping[str, float],
    datasets: list[str],
    ceilings: list[float],
    io_caps: list[float | None],
    link: float,
    guess: float | None,
    rounds: int,
    start: Sequence[float],
) -> Equilibrium:
    """The equilibrium as arrays over the readers: each operation is the one _solve_lists does
    for each reader, elementwise (the same IEEE result), and every sum or product that
    spans readers is taken left to right in their order, so the result is the lists'
    to the bit (tests/unit/test_ctl_lru_equilibrium.py compares them)."""
    groups = _Groups(sizes, datasets)
    perm, of_reader, size = groups.perm, groups.of_reader, groups.size
    ceiling = np.array(ceilings, dtype=float)
    idle = ~(ceiling > 0)  # hit taken as 0.0
    capped = np.array([i for i, cap in enumerate(io_caps) if cap is not None], np.intp)
    caps = np.array([cap for cap in io_caps if cap is not None], dtype=float)
    rates = np.array(start, dtype=float)
    held: np.ndarray | None = None
    for _ in range(rounds):
        held, guess = groups.holdings(capacity, rates[perm], guess)
        # one steady hit ratio per dataset (its readers share it); the log in Python,
        # as math.log has it (numpy's may differ in the last bit)
        if held is None:  # every dataset read is held whole; one not read holds nothing
            hit_of = groups.active.astype(float)
        else:
            hit_of = _steady_hit_ratios(held / size)
        hits = hit_of[of_reader]
        hits[idle] = 0.0
        needs = ceiling * (1.0 - hits)
        if capped.size:
            needs[capped] = np.minimum(needs[capped], caps)
        shares = _water_fill_array(link, needs)
        with np.errstate(divide="ignore", invalid="ignore"):  # (hits of 1: not taken)
            new = np.where(hits >= 1.0 - 1e-12, ceiling, np.minimum(ceiling, shares / (1.0 - hits)))
        # every rate moved by at most 1% (abs(a - b) <= 1e-2 * max(b, 1.0))
        # (np.all without its Python layer: a reduction by logical and)
        if np.logical_and.reduce(np.abs(new - rates) <= 1e-2 * np.maximum(rates, 1.0)):
            rates = new
            break
        rates = (new + rates) / 2  # damped
    return Equilibrium(groups.held_dict(held), guess, rates.tolist())


def _water_fill_array(capacity: float, needs: np.ndarray) -> np.ndarray:
    """_water_fill of an array: the same
    order (a stable sort by demand), the same subtractions and level, to the bit."""
    if math.isinf(capacity):
        return needs.copy()
    n = len(needs)
    order = np.argsort(needs, kind="stable")
    values = needs[order]
    # lefts[i]: what is left for order[i:] once every smaller demand is met (subtracted
    # one by one, as an accumulate is)
    lefts = np.subtract.accumulate(np.concatenate(([capacity], values)))
    over = (values > lefts[:n] / np.arange(n, 0, -1)).nonzero()[0]  # (np.flatnonzero's)
    shares = needs.copy()
    if over.size:
        first = int(over[0])
        shares[order[first:]] = lefts[first] / (n - first)
    return shares


class _Groups:
    """Readers grouped by dataset, as arrays: the readers in order of their dataset's
    first reader (`perm`, stable within a dataset), where each dataset's run starts
    (`starts`), its name and size, and each reader's dataset size."""

    def __init__(self, sizes: Mapping[str, float], datasets: Sequence[str]) -> None:
        place: dict[str, int] = {}  # datasets in order of their first reader
        of_reader = [place.setdefault(d, len(place)) for d in datasets]
        self.names = list(place)
        self.of_reader = np.array(of_reader, np.intp)  # each reader's dataset
        self.perm = np.argsort(self.of_reader, kind="stable")
        counts = np.bincount(self.of_reader)
        self.starts = np.zeros(len(counts), np.intp)
        np.cumsum(counts[:-1], out=self.starts[1:])
        self.size = np.array([sizes[d] for d in self.names], dtype=float)
        self.reader_size = np.repeat(self.size, counts)  # in perm order

    def held_dict(self, held: np.ndarray | None) -> dict[str, float]:
        """{dataset: bytes held} of the datasets read now (None: each held whole)."""
        active = self.active
        values = (self.size if held is None else held).tolist()
        return {d: v for d, v, a in zip(self.names, values, active.tolist(), strict=True) if a}

    def holdings(
        self, capacity: float, rates: np.ndarray, guess: float | None
    ) -> tuple[np.ndarray | None, float | None]:
        """holdings_at of the readers' `rates` (in perm order): each dataset's holding
        (None: everything read fits, each held whole) and T. Sets `active`: the datasets
        some reader reads at a rate > 0 (the others hold nothing and are left out)."""
        starts = self.starts
        self.active = active = np.logical_or.reduceat(rates > 0, starts)
        # (sums added one by one in the datasets' order, as sum() of a list adds them;
        # a dataset not read adds 0.0, which moves no bit)
        if _total(np.where(active, self.size, 0.0)) <= capacity:
            return None, None
        per = rates / self.reader_size  # each reader's rate in dataset sizes per second
        size = self.size
        found: dict[float, np.ndarray] = {}  # the holdings at each T evaluated

        def held_all(t: float) -> np.ndarray:
            w = t * per
            # 1 - distinct_fraction(w) for w <= 1, written as distinct_fraction's
            # arithmetic (the same operations in the same order, so the same bits)
            untouched = 1.0 - w + w * w * w / 6.0
            untouched[w >= 2.0] = 0.0  # a whole epoch in the window: held whole
            # (np.flatnonzero without its Python layers: ~188,000 evaluations a run)
            middle = ((w > 1.0) & (w < 2.0)).nonzero()[0]
            if middle.size:
                untouched[middle] = 1.0 - _distinct_between_1_and_2(w[middle])
            # the product per dataset, left to right (a reduction by multiply is)
            out = size * (1.0 - np.multiply.reduceat(untouched, starts))
            found[t] = out
            return out

        def excess(t: float) -> float:
            return _total(held_all(t)) - capacity

        lo = _fill_time(excess, capacity, guess)
        held = found.get(lo)  # (the search ends at a T it evaluated, but at T = 0)
        if held is None:
            held = held_all(lo)
        return held, lo


def _distinct_between_1_and_2(w: np.ndarray) -> np.ndarray:
    """distinct_fraction of windows `w` of one to two epochs, as it computes them: the
    same operations in the same order, and its powers by the C library's pow as Python's
    ** takes them (numpy's own power may round differently)."""
    u = (w - 1).tolist()
    square = np.array(list(map(pow, u, repeat(2.0))))
    cube = np.array(list(map(pow, u, repeat(3.0))))
    inner = w * (2.0 - w) - (w / 2 - 1 / 3 - w * square / 2 + cube / 3)
    return inner + (w - 1.0)


def _steady_hit_ratios(fraction: np.ndarray) -> np.ndarray:
    """steady_hit_ratio(min(1.0, r)) of each r in `fraction`, to the bit (the log is the
    C library's, as math.log takes it; numpy's may round differently)."""
    hit = (fraction >= 1.0).astype(float)
    between = ((fraction > 0.0) & (fraction < 1.0)).nonzero()[0]  # (np.flatnonzero's)
    if between.size:
        s = 1.0 - fraction[between]
        hit[between] = 1.0 - s + s * np.array(list(map(math.log, s.tolist())))
    return hit


def _total(values: np.ndarray) -> float:
    """sum() of the values as a list: added one by one, left to right (np.sum adds
    pairwise, which moves last bits)."""
    return sum(values.tolist())


class LruPool:
    """One LRU over the whole cluster cache, as the simulator runs it (Alluxio).

    Each dataset's steady-state holding (`target`) is the equilibrium of its running
    readers: a function of their datasets, rate ceilings (GPU share x f*) and IO caps
    alone, which only a re-plan moves, so it is found again only when one of those
    changed (not at epoch ends, nor at a re-plan that only queued an arrival), starting
    from the last equilibrium's rates (a reader coming or going then costs a round or
    two, not twelve). Between re-plans a dataset's holding (`resident`) only grows
    towards its target with what its readers fetch.

    A reader's hit ratio in an epoch after its first is the closed form of one dataset
    alone in an LRU of its holding's size, held constant over `segments` pieces of the
    part of the epoch its target holding can hit (it slides from high to 0 there); its
    first epoch is cold but for what the pool held of its dataset when it arrived."""

    def __init__(self, capacity: float, link: float, segments: int) -> None:
        self.capacity = capacity
        self.link = link
        self.segments = segments
        self.resident: dict[str, float] = {}  # bytes of each dataset held
        self.target: dict[str, float] = {}  # steady-state holding
        # Datasets below their target, still growing; a dict for its order (the
        # simulator re-rates their readers in it, and a set's order of str hashes moves
        # with PYTHONHASHSEED).
        self.growing: dict[str, None] = {}
        self.time: float | None = None  # the pool's characteristic time, last
        # What the targets were last found for (each running reader's dataset, rate
        # ceiling and IO cap), and the readers' rates there by job name, to start the
        # next search from.
        self.key: tuple[list[str], list[float], list[float | None]] | None = None
        self.rates: dict[str, float] = {}

    def held(self, dataset: str) -> float:
        """What the pool holds of `dataset` (its units brought to now by the caller)."""
        return min(self.resident.get(dataset, 0.0), self.target.get(dataset, 0.0))

    def add(self, dataset: str, fetched: float) -> None:
        """Its readers fetched `fetched` bytes of `dataset`: held, up to its target."""
        held = self.resident.get(dataset, 0.0) + fetched
        self.resident[dataset] = min(held, self.target.get(dataset, 0.0))

    def retarget(self, running: Iterable[SimJob], sync: Callable[[], None]) -> None:
        """The targets for the jobs running now (in arrival order), if what they depend
        on moved; `sync` first brings every dataset's holding to now (what was fetched
        so far counts against the old targets)."""
        # Parallel lists, one place per reader (not a reader object each: this runs for
        # every running job at every plan).
        datasets: list[str] = []
        ceilings: list[float] = []
        io_caps: list[float | None] = []
        jobs = list(running)
        sizes: dict[str, float] = {}
        for job in jobs:
            spec = job.spec
            datasets.append(spec.dataset)
            ceilings.append(job.share * spec.ideal_io)  # its rate when IO does not hold it back
            io_caps.append(job.io_cap)
            sizes[spec.dataset] = job.size
        key = (datasets, ceilings, io_caps)
        if key == self.key:
            return
        self.key = key
        sync()
        old = self.rates
        names = [job.name for job in jobs]
        start = [
            old.get(name) or (job.rate if job.rate > 0 else ceiling)
            for name, job, ceiling in zip(names, jobs, ceilings, strict=True)
        ]
        found = _solve(len(datasets))(
            self.capacity, sizes, datasets, ceilings, io_caps, self.link, self.time, _ROUNDS, start
        )
        self.target, self.time = found.held, found.time
        self.rates = dict(zip(names, found.rates, strict=True))
        for dataset in list(self.resident):
            self.resident[dataset] = min(self.resident[dataset], self.target.get(dataset, 0.0))
        self.growing = {
            d: None for d, want in self.target.items() if self.resident.get(d, 0.0) < want
        }

    def hit(self, job: SimJob) -> float:
        """The job's hit ratio from its position to its next segment boundary (set in
        job.boundary, a position in its epoch; math.inf: none)."""
        # (held, hit_between and min and max written out, the same arithmetic: this
        # runs for every LRU reader re-rated at every step and plan)
        job.boundary = math.inf
        if job.epochs_done == 0:
            return job.first_hit
        dataset = job.spec.dataset
        resident = self.resident.get(dataset, 0.0)
        target = self.target.get(dataset, 0.0)
        held = job.lru_held = target if target < resident else resident  # self.held
        size = job.size
        r = held / size
        y = job.pos / size
        if r >= 1.0:
            return 1.0
        # The segments are a grid over the part of the epoch the target holding can hit,
        # fixed until the next re-target: a holding still growing towards its target
        # moves the hit ratio at the grid's points, not at ever shorter segments that
        # chase its edge (segments/epoch events at most in the part that can hit).
        top = target / size
        top = top if top < 1.0 else 1.0  # min(1, target / size)
        # Positions within rounding (eps bytes) of a boundary count as on it: an event
        # lands there, and the integral over a vanishing segment is noise.
        eps = job.eps
        if (top - y) * size <= eps:
            return 0.0
        step = top / self.segments
        k = math.floor(y / step + 1e-9) + 1
        end = k * step
        end = end if end < top else top  # min(top, k * step)
        if (end - y) * size <= eps:
            end = (k + 1) * step
            end = end if end < top else top
        job.boundary = end
        if end <= y:
            return hit_at(r, y)
        # hit_between(r, y, end)
        s = 1.0 - r
        last = r if r < end else end  # min(end, r)
        if last <= y:
            return 0.0
        hits = (last - y) - s * math.log((1.0 - y) / (1.0 - last))
        hits /= end - y
        return hits if hits > 0.0 else 0.0  # max(0, hits)
