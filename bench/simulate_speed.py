"""Time `silofs-ctl simulate` on month-long traces of a 400-GPU cluster.

Owns: two generated traces (bench/silod_scenarios.py's generator, scaled up) and the
wall time of simulating each under every scheduler x cache pair:

- month: 4 weeks, 50 nodes x 8 GPUs, about 4,000 jobs of 0.5-24 h (a light load);
- heavy: the same cluster and span, jobs of 0.5-96 h, so the GPU-hours asked for are
  at least 0.85 of what the cluster has (printed as the offered load).

Never: changes what the simulator does, or judges its results (the tests do). Prints a
table: trace, pair, wall and CPU seconds (CPU time is the figure to compare on a busy
machine), steps (events simulated), plans (policy runs: a re-plan that keeps the last
plan because nothing the policy reads moved is not one), and the average JCT so that
two runs can be compared for sameness as well as speed. --jobs scales the span with
the count at the same load: --jobs 1000 is a 1-week trace, --jobs 2000 a 2-week one.

    python bench/simulate_speed.py                    # both traces, every pair
    python bench/simulate_speed.py --traces heavy --pairs gavel:silod
    python bench/simulate_speed.py --jobs 400         # a tenth of the size, quickly
    python bench/simulate_speed.py --profile gavel:silod --traces month
    python bench/simulate_speed.py --git-rev HEAD~3 --timeout 300  # before (HEAD~3) and after

With --git-rev, each pair also runs against that revision's silofs-ctl (unpacked with
`git archive` into a temp dir by tests/support/baseline.py), one subprocess per pair
and trace so that --timeout can stop a pair that takes too long (shown as ">N"); the
table then shows both CPU times and the speed-up, and both average JCTs (sameness).
--check (with --git-rev) also compares the two runs job by job: the largest relative
difference of a finish time ("finish rel"), and whether average JCT and average fairness
agree to 6 significant digits; a pair that does not is marked DIFFERS.

    python bench/simulate_speed.py --jobs 400 --git-rev HEAD~3 --check
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import math
import pstats
import subprocess
import sys
import time
from pathlib import Path

import common  # noqa: F401 - this checkout first on sys.path
from silod_scenarios import TraceShape, generate_trace
from silofs_ctl.scenario import Scenario, parse_scenario
from silofs_ctl.simulator import CACHE_CHOICES, Simulation

from tests.support import baseline

SCHEDULERS = ("fifo", "sjf", "gavel")
# 400 GPUs; cache and remote IO per GPU as in trace-300 (16 nodes, 250GB each, 1GB/s).
CLUSTER = {"nodes": 50, "gpus_per_node": 8, "cache_per_node": "250GB", "remote_io": "3GB/s"}
TRACES = {
    "month": TraceShape(**CLUSTER, days=28, min_hours=0.5, max_hours=24),
    "heavy": TraceShape(**CLUSTER, days=28, min_hours=0.5, max_hours=96),
}


def trace(name: str, jobs: int, seed: int) -> Scenario:
    shape = TRACES[name]
    # keep the load: a smaller trace spans proportionally less time
    shape = TraceShape(**{**vars(shape), "days": shape.days * jobs / 4000})
    return parse_scenario(generate_trace(jobs, seed, shape), f"{name}-{jobs}")


def offered_load(scenario: Scenario) -> float:
    """GPU-hours the jobs ask for at their ideal rate over what the cluster has between
    the first and the last arrival."""
    asked = sum(j.gpus * j.epochs * j.dataset_size / j.ideal_io for j in scenario.jobs)
    span = max(j.submit for j in scenario.jobs) - min(j.submit for j in scenario.jobs)
    return asked / (scenario.total_gpus * span) if span > 0 else math.inf


def run_pair(scenario: Scenario, pair: str, profile: bool) -> dict:
    scheduler, cache = pair.split(":")
    sim = Simulation(scenario, scheduler, cache)
    prof = cProfile.Profile() if profile else None
    started, cpu = time.perf_counter(), time.process_time()
    if prof:
        prof.enable()
    result = sim.run()
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    return {
        "wall": time.perf_counter() - started,
        "cpu": time.process_time() - cpu,
        "steps": getattr(sim, "steps", None),
        "plans": getattr(sim, "plans", None),
        "avg_jct_h": result.avg_jct / 3600,
        "avg_fairness": result.avg_fairness,
        "finishes": {j.name: j.finish for j in result.jobs},
    }


def sameness(new: dict, old: dict) -> tuple[float, bool]:
    """The largest relative difference of a job's finish time between two runs, and
    whether average JCT and fairness agree to 6 significant digits (and the same jobs
    finished)."""
    worst = 0.0
    same = new["finishes"].keys() == old["finishes"].keys()
    for name, finish in new["finishes"].items():
        other = old["finishes"].get(name)
        if finish is None or other is None:
            same = same and finish is other
            continue
        worst = max(worst, abs(finish - other) / max(abs(other), 1e-300))
    for key in ("avg_jct_h", "avg_fairness"):
        same = same and f"{new[key]:.6g}" == f"{old[key]:.6g}"
    return worst, same


def run_before(tree: Path, name: str, pair: str, args: argparse.Namespace) -> dict | None:
    """One pair on one trace against the other revision; None if it passed --timeout."""
    cmd = [__file__, "--json", "--traces", name, "--pairs", pair]
    cmd += ["--jobs", str(args.jobs), "--seed", str(args.seed)]
    try:
        done = baseline.run(
            tree, cmd, check=True, capture_output=True, text=True, timeout=args.timeout
        )
    except subprocess.TimeoutExpired:
        return None
    return json.loads(done.stdout)[0]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", nargs="+", choices=sorted(TRACES), default=list(TRACES))
    parser.add_argument(
        "--pairs",
        nargs="+",
        metavar="SCHEDULER:CACHE",
        default=[f"{s}:{c}" for s in SCHEDULERS for c in CACHE_CHOICES],
    )
    parser.add_argument("--jobs", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--profile", metavar="SCHEDULER:CACHE", help="cProfile one pair")
    baseline.add_argument(parser, "silofs-ctl (before)")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="wall seconds for one pair of --git-rev"
    )
    parser.add_argument(
        "--check", action="store_true", help="with --git-rev: compare every job's finish"
    )
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # for --git-rev
    args = parser.parse_args(argv)
    if args.profile:
        args.pairs = [args.profile]
    if args.json:
        rows = []
        for name in args.traces:
            scenario = trace(name, args.jobs, args.seed)
            rows += [run_pair(scenario, pair, False) for pair in args.pairs]
        print(json.dumps(rows))
        return 0
    with contextlib.ExitStack() as stack:
        tree = stack.enter_context(baseline.baseline_tree(args.git_rev)) if args.git_rev else None
        return compare(args, tree)


def compare(args: argparse.Namespace, tree: Path | None) -> int:
    head = (
        f"{'trace':8} {'pair':16} {'wall':>8} {'cpu':>8} {'steps':>9} {'plans':>7} {'avg JCT':>9}"
    )
    if tree is not None:
        head += f" {'before cpu':>11} {'speed-up':>8} {'before JCT':>10}"
        if args.check:
            head += f" {'finish rel':>10}"
    print(head)
    worst = 0.0
    for name in args.traces:
        scenario = trace(name, args.jobs, args.seed)
        print(
            f"# {name}: {len(scenario.jobs)} jobs, {scenario.total_gpus} GPUs, "
            f"offered load {offered_load(scenario):.2f}",
            flush=True,
        )
        for pair in args.pairs:
            row = run_pair(scenario, pair, bool(args.profile))
            worst = max(worst, row["cpu"])
            line = (
                f"{name:8} {pair:16} {row['wall']:7.1f}s {row['cpu']:7.1f}s "
                f"{row['steps'] if row['steps'] is not None else '-':>9} "
                f"{row['plans'] if row['plans'] is not None else '-':>7} "
                f"{row['avg_jct_h']:8.2f}h"
            )
            if tree is not None:
                old = run_before(tree, name, pair, args)
                if old is None:
                    over = f">{args.timeout:.0f}s wall"
                    line += f" {over:>11} {'-':>8} {'-':>10}"
                else:
                    line += (
                        f" {old['cpu']:10.1f}s {old['cpu'] / max(row['cpu'], 1e-9):7.1f}x "
                        f"{old['avg_jct_h']:9.2f}h"
                    )
                    if args.check:
                        rel, same = sameness(row, old)
                        line += f" {rel:10.1e}" + ("" if same else " DIFFERS")
            print(line, flush=True)
    print(f"slowest pair: {worst:.1f}s CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
