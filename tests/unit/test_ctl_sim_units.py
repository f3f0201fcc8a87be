"""sim_units.Units' fill events against a visit of every filling unit.

The simulator's steps are bounded by the soonest moment a filling unit reaches its cap
(or takes its shared-fill step), and a unit that reaches full_at re-plans. Units keeps
those moments in arrays; these tests drive it through random allocations, inflow moves,
readers leaving and steps, and check at every step that the arrays give what looking at
every filling unit gives: the same step to the bit, and the same units full.
"""

from __future__ import annotations

import math
import random

import pytest
from silofs_ctl.model import CacheUnit
from silofs_ctl.sim_lru import LruPool
from silofs_ctl.sim_units import SHARED_FILL_STEP, Units

GB = 1e9


def scan_until(units: Units, now: float, limit: float) -> float:
    """The step bound from a visit of every filling unit."""
    soonest = limit
    for key in units.filling:
        inflow = units.inflow[key]
        room = units.cap[key] - units.filled_now(key, now)
        if room > 0:
            soonest = min(soonest, room / inflow)
            if key in units.shared:
                soonest = min(soonest, SHARED_FILL_STEP * units.units[key].size / inflow)
    return soonest


def make(n: int) -> Units:
    cache = {
        f"u{i}": CacheUnit(f"u{i}", "pool", f"d{i}", float(GB * (1 + i % 7))) for i in range(n)
    }
    return Units(cache, LruPool(1e15, 1e9, 8))


def plan(units: Units, rnd: random.Random, now: float) -> None:
    """A re-plan: new allocations and inflows summed anew (every unit brought to now)."""
    units.sync_all(now)
    alloc = {key: rnd.choice([0.0, rnd.uniform(0, 1.2) * u.size]) for key, u in units.units.items()}
    units.allocate(alloc, {})
    inflow = {}
    for key in units.units:
        if rnd.random() < 0.7:
            inflow[key] = rnd.uniform(1e6, 5e8)
            units.unit_t[key] = now
    units.reset_inflow(inflow)


@pytest.mark.parametrize("n", [40, 80])  # (fill events in lists, and in numpy arrays)
@pytest.mark.parametrize("seed", range(6))
def test_fill_events_give_the_step_and_the_full_units_a_scan_gives(seed: int, n: int) -> None:
    rnd = random.Random(seed)
    units = make(n)
    assert units.arrays == (n >= 64)
    now = 0.0
    plan(units, rnd, now)
    fulls = 0
    for _ in range(3000):
        action = rnd.random()
        key = f"u{rnd.randrange(n)}"
        if action < 0.05:
            plan(units, rnd, now)
        elif action < 0.45:
            old = units.inflow.get(key, 0.0) / 2
            units.move_inflow(key, rnd.uniform(0, 3e8), old, now)
        elif action < 0.55:
            units.leave(key, units.inflow.get(key, 0.0) * rnd.choice([0.5, 1.0]), now)
        elif action < 0.6:
            units.readers(key, rnd.choice([1, 2, 3]))
        limit = rnd.choice([math.inf, rnd.uniform(1, 1e4)])
        expected = scan_until(units, now, limit)
        step = units.until_change(now, limit)
        assert step == expected
        if step == math.inf:
            step = rnd.uniform(1, 100)
        now += step if rnd.random() < 0.8 else step * rnd.uniform(0, 1)
        will_be_full = {k for k in units.filling if units.filled_now(k, now) >= units.full_at[k]}
        units.full = False
        units.sync_full(now)
        assert will_be_full.isdisjoint(units.filling)
        assert units.full == bool(will_be_full)
        for k in units.filling:  # the others are still below full_at
            assert units.filled_now(k, now) < units.full_at[k]
        fulls += len(will_be_full)
    assert fulls > 100  # (the test did fill units)


def test_shared_filling_keeps_the_order_units_started_filling() -> None:
    units = make(6)
    units.allocate({key: u.size for key, u in units.units.items()}, {})
    for key in ("u3", "u1", "u5", "u0"):
        units.move_inflow(key, 1e8, 0.0, 0.0)
    for key in ("u0", "u5", "u3"):
        units.readers(key, 2)
    assert units.shared_filling() == ["u3", "u5", "u0"]
    units.readers("u5", 1)
    assert units.shared_filling() == ["u3", "u0"]
