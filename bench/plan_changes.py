"""Count, at every plan of a simulation, how many jobs the plan changed.

Owns: one run of `silofs-ctl simulate TRACE --scheduler S --cache C` with counters
around each plan and each step's re-rate: per plan the active and running jobs, and how
many kept their GPU share, and their share, hit ratio and IO cap, since the plan before
(split into plans after an arrival or a completion and plans of the same jobs); per
step, the jobs re-rated and how many kept their hit ratio. Never: changes what the
simulator does (the counters read the jobs after the simulator's own code ran), or
times anything (bench/simulate_speed.py does).

Whether a plan could redo only the jobs that changed (a dirty set) is a question of
these counts: docs/CONTROLLER.md ("Run time") has the answer for Gavel's pairs.

    python bench/plan_changes.py TRACE --pair gavel:silod
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import common  # noqa: F401 - this checkout first on sys.path
from silofs_ctl.model import Allocation
from silofs_ctl.scenario import load_scenario
from silofs_ctl.sim_job import SimJob
from silofs_ctl.simulator import Simulation


@dataclass
class PlanCount:
    active: int
    running: int
    same_share: int  # jobs whose GPU share is the last plan's
    same_all: int  # ... and their hit ratio and IO cap too
    jobs_moved: bool  # the plan follows an arrival or a completion


@dataclass
class Counted:
    plans: list[PlanCount] = field(default_factory=list)
    rerated: int = 0  # jobs a step re-rated
    same_hit: int = 0  # of them, those whose hit ratio did not move


class CountingSimulation(Simulation):
    """Simulation with counters after _apply and around _rerate (nothing else)."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.counted = Counted()
        self._last: dict[str, tuple[float, float, float | None]] = {}
        self._moved = False

    def _reschedule(self) -> None:
        self._moved = self.jobs_moved
        super()._reschedule()

    def _apply(self, alloc: Allocation) -> None:
        super()._apply(alloc)
        now = {j.name: (j.share, j.hit, j.io_cap) for j in self.active.values()}
        last = self._last
        same_share = sum(1 for n, v in now.items() if n in last and last[n][0] == v[0])
        same_all = sum(1 for n, v in now.items() if last.get(n) == v)
        count = PlanCount(len(now), len(self.running), same_share, same_all, self._moved)
        self.counted.plans.append(count)
        self._last = now

    def _rerate(self, jobs: list[SimJob]) -> None:
        hits = [j.hit for j in jobs]
        super()._rerate(jobs)
        self.counted.rerated += len(jobs)
        self.counted.same_hit += sum(1 for j, h in zip(jobs, hits, strict=True) if j.hit == h)


def summary(counted: Counted) -> list[str]:
    lines = []
    for label, moved in (("after an arrival or completion", True), ("of the same jobs", False)):
        plans = [p for p in counted.plans if p.jobs_moved is moved]
        if not plans:
            continue

        def mean(attr: str, plans: list[PlanCount] = plans) -> float:
            return statistics.fmean(getattr(p, attr) for p in plans)

        lines.append(
            f"{len(plans):6d} plans {label}: active {mean('active'):.0f}, running"
            f" {mean('running'):.0f}, same GPU share {mean('same_share'):.0f},"
            f" same share, hit and IO cap {mean('same_all'):.0f}"
        )
    if counted.rerated:
        kept = counted.same_hit / counted.rerated
        lines.append(f"steps re-rated {counted.rerated} jobs, {kept:.1%} of them kept their hit")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--pair", default="gavel:silod", help="SCHEDULER:CACHE")
    args = parser.parse_args()
    scheduler, cache = args.pair.split(":")
    sim = CountingSimulation(load_scenario(args.trace), scheduler, cache)
    sim.run()
    print(f"{args.trace.stem} {args.pair}: {sim.steps} steps, {sim.plans} plans")
    for line in summary(sim.counted):
        print(" ", line)


if __name__ == "__main__":
    main()
