"""bench/plan_changes.py: its counters read the run and change nothing in it."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

from silofs_ctl.scenario import load_scenario
from silofs_ctl.simulator import simulate

_ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("plan_changes", _ROOT / "bench" / "plan_changes.py")
assert _spec is not None and _spec.loader is not None
plan_changes = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("plan_changes", plan_changes)  # its dataclasses look it up
sys.path.insert(0, str(_ROOT / "bench"))  # (it imports bench/common.py) only meanwhile
try:
    _spec.loader.exec_module(plan_changes)
finally:
    sys.path.remove(str(_ROOT / "bench"))


def test_counts_every_plan_and_leaves_the_run_as_it_was() -> None:
    scenario = load_scenario(_ROOT / "configs" / "scenarios" / "trace-300.toml")
    scenario = replace(scenario, jobs=scenario.jobs[:60])
    sim = plan_changes.CountingSimulation(scenario, "gavel", "silod")
    counted = sim.run()
    plain = simulate(scenario, "gavel", "silod")
    assert [j.finish for j in counted.jobs] == [j.finish for j in plain.jobs]
    plans = sim.counted.plans
    assert len(plans) == sim.plans > 0
    assert any(p.jobs_moved for p in plans) and not all(p.jobs_moved for p in plans)
    for p in plans:
        assert p.same_all <= p.same_share <= p.active and p.running <= p.active
    # the first plan has no plan before it: nobody kept anything
    assert plans[0].same_share == 0
    assert 0 <= sim.counted.same_hit <= sim.counted.rerated and sim.counted.rerated > 0
    lines = plan_changes.summary(sim.counted)
    assert any("after an arrival or completion" in line for line in lines)
