"""Replay a simulation's LRU equilibria through this checkout's sim_lru and another revision's.

Owns: recording the equilibria of `silofs-ctl simulate TRACE --scheduler S --cache
alluxio` (every Nth call of `sim_lru._solve`'s solver: its inputs and what it found),
and replaying them through two trees' solvers in one process, alternating call by call
(and which of the two goes first): the thread CPU per call of each, the speed-up, and
whether every holding, T and rate is the run's to the bit (in the same order). Never:
times the simulator around the equilibrium (bench/simulate_speed.py does).

A change to the LRU model's solver that must keep a run the same to the bit is checked
here on thousands of recorded calls in a minute, where a whole run of a 4-week trace
takes minutes and its CPU moves with the host's load by more than the equilibrium's
share of it; the two sides alternate, so a busy host slows both alike.

    python bench/lru_replay.py TRACE --every 10 --git-rev main
    python bench/lru_replay.py TRACE --every 10 --save /tmp/lru-calls.pickle
    python bench/lru_replay.py --load /tmp/lru-calls.pickle --git-rev main
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import pickle
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import common  # noqa: F401 - this checkout first on sys.path
from plan_replay import _package
from silofs_ctl import sim_lru
from silofs_ctl.scenario import parse_scenario
from silofs_ctl.simulator import Simulation

from tests.support import baseline

Call = tuple[tuple[Any, ...], tuple[list[tuple[str, float]], float | None, list[float]]]


def _copy(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The solver's arguments as they were at the call (the caller's lists are its own)."""
    return tuple(
        dict(a) if isinstance(a, dict) else list(a) if isinstance(a, list) else a for a in args
    )


def record(path: Path, scheduler: str, every: int) -> list[Call]:
    """Every `every`th equilibrium of a whole run: (solver arguments, what it found)."""
    calls: list[Call] = []
    seen = [0]
    pick = sim_lru._solve

    def recording(readers: int) -> Any:
        solve = pick(readers)

        def recorded(*args: Any) -> Any:
            found = solve(*args)
            seen[0] += 1
            if seen[0] % every == 0:
                calls.append((_copy(args), (list(found.held.items()), found.time, found.rates)))
            return found

        return recorded

    sim_lru._solve = recording  # type: ignore[assignment]
    try:
        Simulation(parse_scenario(path.read_text(), path.stem), scheduler, "alluxio").run()
    finally:
        sim_lru._solve = pick  # type: ignore[assignment]
    print(f"{path.stem} {scheduler}:alluxio: {seen[0]} equilibria, {len(calls)} recorded")
    return calls


def replay(calls: list[Call], modules: list[Any], repeats: int) -> tuple[list[float], list[int]]:
    """Every call through every module's solver `repeats` times, alternating which goes
    first: the thread CPU of each, and how many of its results differ from the run's."""
    cpu = [0.0] * len(modules)
    differ = [0] * len(modules)
    clock = time.thread_time
    for repeat in range(repeats):
        for i, (args, (held, found_time, rates)) in enumerate(calls):
            order = range(len(modules)) if (i + repeat) % 2 == 0 else reversed(range(len(modules)))
            for k in order:
                solve = modules[k]._solve(len(args[2]))  # (args[2]: each reader's dataset)
                start = clock()
                found = solve(*args)
                cpu[k] += clock() - start
                if (list(found.held.items()), found.time, found.rates) != (held, found_time, rates):
                    differ[k] += 1
    return cpu, differ


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", nargs="?", type=Path, help="a scenario TOML file")
    parser.add_argument("--scheduler", default="gavel", help="fifo, sjf or gavel")
    parser.add_argument("--every", type=int, default=10, help="record every Nth equilibrium")
    parser.add_argument("--repeats", type=int, default=3, help="replays of the calls")
    parser.add_argument("--save", type=Path, help="keep the recording in this file")
    parser.add_argument("--load", type=Path, help="replay a recording kept with --save")
    baseline.add_argument(parser, "silofs-ctl sim_lru (before)")
    args = parser.parse_args()
    if args.load is not None:
        with args.load.open("rb") as f:
            calls = pickle.load(f)
    elif args.trace is not None:
        calls = record(args.trace, args.scheduler, max(1, args.every))
    else:
        parser.error("give a TRACE or --load")
    if args.save is not None:
        with args.save.open("wb") as f:
            pickle.dump(calls, f, protocol=pickle.HIGHEST_PROTOCOL)
    if not calls:
        raise SystemExit("no equilibria recorded")
    with contextlib.ExitStack() as stack:
        modules, labels = [sim_lru], ["this tree"]
        if args.git_rev:
            tree = stack.enter_context(baseline.baseline_tree(args.git_rev))
            _package(tree, "silofs_ctl_before")
            modules.insert(0, importlib.import_module("silofs_ctl_before.sim_lru"))
            labels.insert(0, args.git_rev)
        cpu, differ = replay(calls, modules, max(1, args.repeats))
    readers = statistics.mean(len(call[0][2]) for call in calls)
    n = len(calls) * max(1, args.repeats)
    print(f"{len(calls)} calls x {max(1, args.repeats)}, {readers:.0f} readers on average")
    for label, c, d in zip(labels, cpu, differ, strict=True):
        print(f"{label:>12}: {1e6 * c / n:9.1f} us a call, {d} results not the run's")
    if len(modules) > 1 and cpu[1] > 0:
        print(f"speed-up: {cpu[0] / cpu[1]:.3f}x")
    if any(differ):
        sys.exit(1)


if __name__ == "__main__":
    main()
