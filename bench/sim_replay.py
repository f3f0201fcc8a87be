"""Replay a stretch of a simulation from a checkpoint: its CPU time, or its instructions.

Owns: running `silofs-ctl simulate TRACE --scheduler S --cache C` up to a plan count,
the Simulation there pickled (the checkpoint), and replaying a number of iterations of
Simulation.run's loop from it: the process CPU of each of --repeats replays (min and
median), or with --valgrind the instructions callgrind counts for the replay (a run
replaying 0 iterations is subtracted: loading Python and the checkpoint), which is the
same on a busy host as on a quiet one. The replay is Simulation.run itself, stopped
after the iterations asked for, so it is the code a run runs. Never: changes what the
simulator does, or compares results (the --json of whole runs is compared for that).

A change to the simulator's or a policy's per-job code that should cut a few percent
is lost in a whole run's CPU on a shared host (5-8% apart from one run to the next);
instructions are exact to ~0.2% (PYTHONHASHSEED is fixed for them: a random seed
moves set and dict orders, and the count with them). With --git-rev the same is
measured with that revision's silofs-ctl first (its own checkpoint, made the same way).

    python bench/sim_replay.py TRACE --pair gavel:silod --plans 8000 --iters 300
    python bench/sim_replay.py TRACE --plans 8000 --iters 300 --valgrind --git-rev main
"""

from __future__ import annotations

import argparse
import copy
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import common  # noqa: F401 - this checkout first on sys.path
from silofs_ctl.scenario import load_scenario
from silofs_ctl.simulator import Simulation

from tests.support import baseline


class _Enough(Exception):
    """The iterations asked for are done: the run stops there (no results made)."""


def _stop_after(sim: Simulation, done: Callable[[], bool]) -> None:
    """Stop `sim`'s run after the loop iteration at whose end `done()` holds."""
    boundaries = sim._boundaries

    def counted() -> None:
        boundaries()
        if done():
            raise _Enough

    sim._boundaries = counted  # type: ignore[method-assign]


def _run(sim: Simulation) -> None:
    try:
        sim.run()
    except _Enough:
        pass
    del sim._boundaries  # (the class's again: the instance's wrapper is not pickled)


def checkpoint(trace: Path, pair: str, plans: int) -> Simulation:
    """The run of `pair` on `trace` at the end of the loop iteration that made its
    `plans`-th plan."""
    scheduler, cache = pair.split(":")
    sim = Simulation(load_scenario(trace), scheduler, cache)
    _stop_after(sim, lambda: sim.plans >= plans)
    _run(sim)
    return sim


def replay(sim: Simulation, iters: int) -> float:
    """Process CPU seconds of `iters` iterations of `sim`'s loop (sim moves on)."""
    count = [0]

    def done() -> bool:
        count[0] += 1
        return count[0] >= iters

    if iters <= 0:
        return 0.0
    _stop_after(sim, done)
    start = time.process_time()
    _run(sim)
    return time.process_time() - start


def instructions(saved: Path, iters: int) -> int:
    """Callgrind's instruction count of this script replaying `iters` iterations from
    the checkpoint `saved` (hash seed 0)."""
    env = dict(os.environ, PYTHONHASHSEED="0")
    res = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
         __file__, "--load", str(saved), "--iters", str(iters)],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    found = re.search(r"Collected\s*:\s*([\d,]+)", res.stderr)
    if found is None:
        raise SystemExit(f"no count from callgrind: {res.stderr[-400:]}")
    return int(found.group(1).replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, nargs="?")
    parser.add_argument("--pair", default="gavel:silod", help="scheduler:cache")
    parser.add_argument("--plans", type=int, default=8000, help="checkpoint at this plan")
    parser.add_argument("--iters", type=int, default=300, help="loop iterations replayed")
    parser.add_argument("--repeats", type=int, default=5, help="replays timed (CPU)")
    parser.add_argument("--valgrind", action="store_true", help="count instructions instead")
    parser.add_argument("--load", type=Path, help=argparse.SUPPRESS)  # (--valgrind's child)
    baseline.add_argument(parser, "silofs-ctl")
    args = parser.parse_args()
    sys.setrecursionlimit(100_000)  # (pickling the jobs' views and plans nests deeply)
    if args.load is not None:  # a child under valgrind: replay, nothing printed
        with args.load.open("rb") as f:
            replay(pickle.load(f), args.iters)
        return
    if args.trace is None:
        parser.error("a trace is needed")
    if args.git_rev:
        baseline.run_self_first(args.git_rev, __file__)
    start = time.process_time()
    sim = checkpoint(args.trace, args.pair, args.plans)
    print(
        f"{args.trace.stem} {args.pair}: checkpoint at plan {sim.plans}, step {sim.steps}, "
        f"{len(sim.active)} active jobs, t={sim.clock.now:.0f}s "
        f"({time.process_time() - start:.1f} s of CPU)",
        flush=True,
    )
    if args.valgrind:
        if shutil.which("valgrind") is None:
            raise SystemExit("--valgrind: valgrind is not installed")
        with tempfile.TemporaryDirectory(prefix="sim-replay-") as tmp:
            saved = Path(tmp) / "checkpoint.pickle"
            with saved.open("wb") as f:
                pickle.dump(sim, f)
            base = instructions(saved, 0)
            total = instructions(saved, args.iters)
        print(f"replay of {args.iters} iterations: {(total - base) / 1e6:,.1f}M instructions")
        return
    times = []
    for _ in range(args.repeats):
        run = copy.deepcopy(sim)
        plans = run.plans
        times.append(replay(run, args.iters))
    print(
        f"replay of {args.iters} iterations ({run.plans - plans} plans): CPU min "
        f"{min(times) * 1e3:.1f} ms, median {statistics.median(times) * 1e3:.1f} ms "
        f"over {args.repeats}"
    )


if __name__ == "__main__":
    main()
