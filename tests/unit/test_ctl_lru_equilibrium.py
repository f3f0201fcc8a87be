"""The simulator's LRU holdings at the rates they lead to (sim_lru.equilibrium).

Owns: the check that the Alluxio model's holdings are a fixed point of holdings -> hit
ratios -> rates -> holdings, that its two forms (lists, arrays) give the same bits, and
the live case that showed the lag (bench/silod_live.py:
a small dataset read fast once cached came to be held whole by the daemon's one LRU,
while holdings from its IO-bound rate kept it a little over half cached).
"""

from __future__ import annotations

import math
import random

import pytest
from silofs_ctl import sim_lru
from silofs_ctl.policies.base import water_fill
from silofs_ctl.sim_lru import LruReader, equilibrium, holdings_at, steady_hit_ratio

MB = 1e6
SIZES = {"small": 40 * MB, "big-1": 200 * MB, "big-2": 150 * MB}
# All three are IO-bound now, each at a third of a 15 MB/s link.
READERS = [
    LruReader("small", 20 * MB, None, 5 * MB),
    LruReader("big-1", 8 * MB, None, 5 * MB),
    LruReader("big-2", 6 * MB, None, 5 * MB),
]


def test_holdings_from_the_rates_now_lag_and_the_equilibrium_does_not() -> None:
    now, _ = holdings_at(125 * MB, SIZES, {r.dataset: [r.rate] for r in READERS})
    assert now["small"] < 0.9 * SIZES["small"]  # held partly: read at 5 MB/s
    held = equilibrium(125 * MB, SIZES, READERS, 15 * MB).held
    # Held whole, the small dataset is read at its 20 MB/s, every 2 s: it stays held.
    assert held["small"] >= 0.99 * SIZES["small"]
    assert sum(held.values()) <= 125 * MB * (1 + 1e-6)


def test_the_equilibrium_is_a_fixed_point() -> None:
    held = equilibrium(125 * MB, SIZES, READERS, 15 * MB).held
    hits = [steady_hit_ratio(min(1.0, held[r.dataset] / SIZES[r.dataset])) for r in READERS]
    shares = water_fill(
        15 * MB, {r.dataset: r.ceiling * (1 - h) for r, h in zip(READERS, hits, strict=True)}
    )
    rates = {
        r.dataset: r.ceiling if h >= 1 - 1e-12 else min(r.ceiling, shares[r.dataset] / (1 - h))
        for r, h in zip(READERS, hits, strict=True)
    }
    again, _ = holdings_at(125 * MB, SIZES, {k: [v] for k, v in rates.items()})
    for k in SIZES:
        assert abs(again[k] - held[k]) <= 0.01 * SIZES[k], (k, again[k], held[k])


def test_io_caps_and_idle_readers_are_respected() -> None:
    # A reader capped at 1 MB/s cannot speed up however much it holds; one without GPUs
    # (ceiling 0) reads nothing and holds nothing.
    readers = [
        LruReader("small", 20 * MB, 1 * MB, 1 * MB),
        LruReader("big-1", 8 * MB, None, 5 * MB),
        LruReader("big-2", 0.0, None, 0.0),
    ]
    held = equilibrium(100 * MB, SIZES, readers, 15 * MB).held
    assert "big-2" not in held or held["big-2"] == 0
    assert sum(held.values()) <= 100 * MB * (1 + 1e-6)


def _random_readers(rng: random.Random, n: int) -> tuple:
    """A pool, its datasets and n readers of them: some idle, some IO-capped, some
    starting from rate 0; windows of every branch of distinct_fraction at some T."""
    sizes = {f"d{k}": rng.uniform(1e9, 5e12) for k in range(rng.randint(1, 40))}
    names = list(sizes)
    datasets = [rng.choice(names) for _ in range(n)]
    ceilings = [rng.choice([0.0, 1e9, rng.uniform(1e6, 3e9)]) for _ in range(n)]
    caps = [rng.choice([None, None, 5e8, rng.uniform(1e6, 1e9)]) for _ in range(n)]
    start = [rng.choice([0.0, 1e9, rng.uniform(1e5, 3e9)]) for _ in range(n)]
    capacity = rng.choice([rng.uniform(1e11, 2e13), rng.uniform(1e9, 1e11), 1e15])
    link = rng.choice([math.inf, rng.uniform(1e8, 4e9)])
    guess = rng.choice([None, rng.uniform(1.0, 1e5)])
    return capacity, sizes, datasets, ceilings, caps, link, guess, 12, start


@pytest.mark.parametrize("seed", range(4))
def test_the_equilibrium_as_arrays_is_the_lists_to_the_bit(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(40):
        args = _random_readers(rng, rng.choice([1, 3, 40, 300]))
        lists = sim_lru._solve_lists(*args)
        arrays = sim_lru._solve_arrays(*args)
        assert list(arrays.held.items()) == list(lists.held.items())
        assert arrays.time == lists.time
        assert arrays.rates == lists.rates
        assert all(type(rate) is float for rate in arrays.rates)
