"""Time `silofs-ctl simulate` on month-long traces of a 400-GPU cluster.

Owns: two generated traces (bench/silod_scenarios.py's generator, scaled up) and the
wall time of simulating each under every scheduler x cache pair:

- month: 4 weeks, 50 nodes x 8 GPUs, about 4,000 jobs of 0.5-24 h (a light load);
- heavy: the same cluster and span, jobs of 0.5-96 h, so the GPU-hours asked for are
  at least 0.85 of what the cluster has (printed as the offered load).

Never: changes what the simulator does, or checks its results (the tests do). Prints a
table: trace, pair, wall and CPU seconds (CPU time is the figure to compare on a busy
machine), steps (events simulated), plans (policy runs), and the average JCT so that
two runs can be compared for sameness as well as speed.

    python bench/simulate_speed.py                    # both traces, every pair
    python bench/simulate_speed.py --traces heavy --pairs gavel:silod
    python bench/simulate_speed.py --jobs 400         # a tenth of the size, quickly
    python bench/simulate_speed.py --profile gavel:silod --traces month
    PYTHONPATH=/tmp/old/silofs-ctl python bench/simulate_speed.py   # another checkout (before)
"""

from __future__ import annotations

import argparse
import cProfile
import math
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from silod_scenarios import TraceShape, generate_trace  # noqa: E402
from silofs_ctl.scenario import Scenario, parse_scenario  # noqa: E402
from silofs_ctl.simulator import CACHE_CHOICES, Simulation  # noqa: E402

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
    args = parser.parse_args(argv)
    if args.profile:
        args.pairs = [args.profile]
    print(
        f"{'trace':8} {'pair':16} {'wall':>8} {'cpu':>8} {'steps':>9} {'plans':>7} {'avg JCT':>9}"
    )
    worst = 0.0
    for name in args.traces:
        scenario = trace(name, args.jobs, args.seed)
        print(
            f"# {name}: {len(scenario.jobs)} jobs, {scenario.total_gpus} GPUs, "
            f"offered load {offered_load(scenario):.2f}",
            flush=True,
        )
        for pair in args.pairs:
            scheduler, cache = pair.split(":")
            sim = Simulation(scenario, scheduler, cache)
            prof = cProfile.Profile() if args.profile else None
            started, cpu = time.perf_counter(), time.process_time()
            if prof:
                prof.enable()
            result = sim.run()
            if prof:
                prof.disable()
            wall = time.perf_counter() - started
            cpu = time.process_time() - cpu
            worst = max(worst, cpu)
            print(
                f"{name:8} {pair:16} {wall:7.1f}s {cpu:7.1f}s {getattr(sim, 'steps', '-'):>9} "
                f"{getattr(sim, 'plans', '-'):>7} "
                f"{result.avg_jct / 3600:8.2f}h",
                flush=True,
            )
            if prof:
                pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    print(f"slowest pair: {worst:.1f}s CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
