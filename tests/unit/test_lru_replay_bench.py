"""bench/lru_replay.py: it records a run's equilibria as they were found, replays them to
the same bits, and tells a solver that finds otherwise."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from silofs_ctl import sim_lru

_ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("lru_replay", _ROOT / "bench" / "lru_replay.py")
assert _spec is not None and _spec.loader is not None
lru_replay = importlib.util.module_from_spec(_spec)
sys.path.insert(0, str(_ROOT / "bench"))  # (it imports bench/common.py) only meanwhile
try:
    _spec.loader.exec_module(lru_replay)
finally:
    sys.path.remove(str(_ROOT / "bench"))

_TRACE = _ROOT / "configs" / "scenarios" / "cache-efficiency.toml"


def test_records_every_equilibrium_and_replays_it_to_the_bit() -> None:
    calls = lru_replay.record(_TRACE, "gavel", 1)
    assert len(calls) >= 5
    assert sim_lru._solve is not None and sim_lru._solve.__name__ == "_solve"  # put back
    cpu, differ = lru_replay.replay(calls, [sim_lru, sim_lru], 2)
    assert differ == [0, 0]
    assert all(c > 0 for c in cpu)
    # --every 2: every other one
    assert len(lru_replay.record(_TRACE, "gavel", 2)) == len(calls) // 2


def test_a_solver_that_finds_another_last_bit_is_told() -> None:
    calls = lru_replay.record(_TRACE, "gavel", 1)

    def off_by_a_bit(readers: int) -> Any:
        solve = sim_lru._solve(readers)

        def solved(*args: Any) -> Any:
            found = solve(*args)
            rates = [r * (1 + 2**-52) for r in found.rates]
            return replace(found, rates=rates)

        return solved

    moved = any(rate != 0.0 for _, (_, _, rates) in calls for rate in rates)
    assert moved
    cpu, differ = lru_replay.replay(calls, [sim_lru, SimpleNamespace(_solve=off_by_a_bit)], 1)
    assert differ[0] == 0 and differ[1] > 0
