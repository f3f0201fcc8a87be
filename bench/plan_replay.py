"""Replay a simulation's plans through this checkout's policy and another revision's.

Owns: recording the inputs of a run of consecutive plans of `silofs-ctl simulate TRACE
--scheduler S --cache C` (plans LO..HI-1: the jobs as the policy sees them, and the
cluster), and replaying them through two policies in one process, alternating plan by
plan (and which of the two goes first): the CPU time per plan of each, the speed-up,
split into plans that follow an arrival or a completion (the set of jobs moved) and
plans of the same jobs, and whether every allocation is the same to the bit (every
value, in the same order). Each side's policy, cache policy and estimator are made by
its own tree's Simulation, as a run would make them. Never: judges allocations
otherwise, or times the simulator around the policy (bench/simulate_speed.py does).

A change to a policy that must keep a run the same to the bit is checked here on
thousands of plans in a minute, where a whole run of a 4-week trace takes minutes;
the timing of the two sides is CPU time, alternated, so a busy host slows both alike.

    python bench/plan_replay.py TRACE --plans 9000:10000 --git-rev main
    python bench/plan_replay.py TRACE --plans 9000:10000 --save /tmp/plans.pickle
    python bench/plan_replay.py --load /tmp/plans.pickle --git-rev main
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import pickle
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import common  # noqa: F401 - this checkout first on sys.path
from silofs_ctl.scenario import parse_scenario
from silofs_ctl.simulator import Simulation

from tests.support import baseline

FIELDS = ("gpu_share", "placement", "cache", "io")


@dataclass
class Recording:
    """The plans LO.. of one run: the trace's text, the pair, each plan's inputs."""

    trace: str
    name: str
    pair: str
    first: int
    plans: list[tuple[list[Any], Any]] = field(default_factory=list)


class _Enough(Exception):
    """The last plan asked for is recorded: the run stops there."""


def record(path: Path, pair: str, first: int, end: int) -> Recording:
    text = path.read_text()
    scheduler, cache = pair.split(":")
    sim = Simulation(parse_scenario(text, path.stem), scheduler, cache)
    rec = Recording(text, path.stem, pair, first)
    allocate, seen = sim.policy.allocate, [0]

    def recorded(jobs, cluster, estimator):  # type: ignore[no-untyped-def]
        i = seen[0]
        seen[0] += 1
        if i >= end:
            raise _Enough
        if i >= first:
            rec.plans.append((list(jobs), cluster))
        return allocate(jobs, cluster, estimator)

    sim.policy.allocate = recorded  # type: ignore[method-assign]
    with contextlib.suppress(_Enough):
        sim.run()
    if not rec.plans:
        raise SystemExit(f"the run has {seen[0]} plans: none from plan {first} on")
    return rec


def _package(tree: Path, alias: str) -> ModuleType:
    """`tree`'s silofs_ctl, imported as `alias` beside this checkout's (its modules
    import each other relatively, so they all come from `tree`)."""
    root = tree / "silofs-ctl" / "silofs_ctl"
    spec = importlib.util.spec_from_file_location(
        alias, root / "__init__.py", submodule_search_locations=[str(root)]
    )
    if spec is None or spec.loader is None:
        raise SystemExit(f"no silofs_ctl in {tree}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[alias] = module
    spec.loader.exec_module(module)
    return module


class Side:
    """One tree's policy, cache policy and estimator, made as its Simulation makes them."""

    def __init__(self, rec: Recording, package: str) -> None:
        scenario = importlib.import_module(f"{package}.scenario")
        simulator = importlib.import_module(f"{package}.simulator")
        scheduler, cache = rec.pair.split(":")
        sim = simulator.Simulation(scenario.parse_scenario(rec.trace, rec.name), scheduler, cache)
        self.policy, self.cache_policy, self.estimator = (
            sim.policy,
            sim.cache_policy,
            sim.estimator,
        )
        self.cpu: list[float] = []

    def plan(self, jobs: list[Any], cluster: Any) -> tuple:
        start = time.process_time()
        alloc = self.policy.allocate(jobs, cluster, self.estimator)
        if self.cache_policy is not None:
            self.cache_policy.fill_cache(jobs, cluster, alloc)
        self.cpu.append(time.process_time() - start)
        return (*(list(getattr(alloc, f).items()) for f in FIELDS), alloc.lru)


def replay(rec: Recording, sides: list[Side]) -> tuple[list[bool], list[int]]:
    """Every plan through every side, alternating which goes first; per plan: did the
    set of jobs move since the last plan, and which sides' allocations differ from the
    first side's."""
    moved: list[bool] = []
    differ = [0] * len(sides)
    last: list[str] | None = None
    for i, (jobs, cluster) in enumerate(rec.plans):
        names = [job.name for job in jobs]
        moved.append(names != last)
        last = names
        order = sides if i % 2 == 0 else sides[::-1]
        out = {id(side): side.plan(jobs, cluster) for side in order}
        for k, side in enumerate(sides):
            if out[id(side)] != out[id(sides[0])]:
                differ[k] += 1
    return moved, differ


def report(rec: Recording, sides: list[Side], labels: list[str], moved: list[bool]) -> None:
    jobs = statistics.mean(len(jobs) for jobs, _ in rec.plans)
    last = rec.first + len(rec.plans) - 1
    print(f"{rec.name} {rec.pair}: plans {rec.first}-{last}, {jobs:.0f} active jobs on average")
    width = max(22, *(len(label) + 10 for label in labels))
    head = f"{'plans':<10}{'count':>7}"
    head += "".join(f"{label + ' ms/plan':>{width}}" for label in labels)
    print(head + (f"{'speed-up':>10}" if len(sides) > 1 else ""))
    kinds = [("jobs moved", True), ("same jobs", False), ("all", None)]
    for title, kind in kinds:
        picked = [i for i, m in enumerate(moved) if kind is None or m == kind]
        if not picked:
            continue
        cpu = [sum(side.cpu[i] for i in picked) for side in sides]
        row = f"{title:<10}{len(picked):>7}" + "".join(
            f"{1000 * c / len(picked):>{width}.3f}" for c in cpu
        )
        if len(sides) > 1:
            row += f"{cpu[0] / cpu[1]:>9.2f}x" if cpu[1] > 0 else f"{'-':>10}"
        print(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", nargs="?", type=Path, help="a scenario TOML file")
    parser.add_argument("--pair", default="gavel:silod", help="scheduler:cache")
    parser.add_argument("--plans", default="0:1000", help="LO:HI, the plans to record")
    parser.add_argument("--save", type=Path, help="keep the recording in this file")
    parser.add_argument("--load", type=Path, help="replay a recording kept with --save")
    baseline.add_argument(parser, "silofs-ctl policies (before)")
    args = parser.parse_args()
    if args.load is not None:
        with args.load.open("rb") as f:
            rec = Recording(**pickle.load(f))
    elif args.trace is not None:
        lo, _, hi = args.plans.partition(":")
        rec = record(args.trace, args.pair, int(lo), int(hi))
    else:
        parser.error("give a TRACE or --load")
    if args.save is not None:
        with args.save.open("wb") as f:
            pickle.dump(vars(rec), f, protocol=pickle.HIGHEST_PROTOCOL)
    with contextlib.ExitStack() as stack:
        sides, labels = [Side(rec, "silofs_ctl")], ["this tree"]
        if args.git_rev:
            tree = stack.enter_context(baseline.baseline_tree(args.git_rev))
            _package(tree, "silofs_ctl_before")
            sides.insert(0, Side(rec, "silofs_ctl_before"))
            labels.insert(0, args.git_rev)
        moved, differ = replay(rec, sides)
    report(rec, sides, labels, moved)
    if len(sides) > 1:
        same = len(rec.plans) - differ[1]
        print(f"allocations the same to the bit: {same} of {len(rec.plans)} plans")
        if differ[1]:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
