"""Time the controller's allocation step for every policy on synthetic clusters.

Owns: a reproducible synthetic live cluster (J jobs, J/10 datasets, J/8 nodes of 8 GPUs,
as the controller sees it after a poll), the timing of plan_allocations per policy split
into its stages (build_problem; the policy's allocate and sharing the rest of the link;
to_plan) in CPU seconds (the figures hold on a busy machine), the table and the
fitted exponent of time in J (least-squares slope of log time over log J). With
--git-rev it also runs the same clusters against another revision's silofs-ctl, in a
subprocess (tests/support/baseline.py: a `git archive` copy, or a checkout's directory),
so before and after come from one run on one machine. Never: changes what a policy decides,
or checks correctness (tests/unit/test_ctl_maxmin_lp.py does).

    python bench/policies.py                         # 100, 1k, 10k jobs; every policy
    python bench/policies.py --sizes 100 1000 --policies gavel
    python bench/policies.py --git-rev HEAD~3        # before (that rev) and after (here)
    python bench/policies.py --profile gavel --sizes 1000   # cProfile one run, top 25
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import pstats
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common  # noqa: F401 - this checkout first on sys.path

from tests.support import baseline

POLICY_NAMES = ("gavel", "sjf", "fifo", "greedy")
MB, GB = 10**6, 10**9


def _api() -> Any:
    """The controller's planning API, wherever this revision keeps it (before the split of
    controller.py everything lived there)."""
    import types

    try:
        from silofs_ctl import controller_config, observe, plan

        ns = {**vars(controller_config), **vars(observe), **vars(plan)}
    except ImportError:
        from silofs_ctl import controller

        ns = dict(vars(controller))
    return types.SimpleNamespace(**ns)


@dataclass
class Timing:
    policy: str
    jobs: int
    build: float
    allocate: float
    to_plan: float

    @property
    def total(self) -> float:
        return self.build + self.allocate + self.to_plan


def synthetic(api: Any, n_jobs: int, seed: int = 1) -> tuple[Any, list, dict, dict]:
    """(config, jobs-file entries, node statuses, measured f*) for n_jobs jobs.

    Datasets are 100GB-2TB (log-uniform), nodes have 8 GPUs and 4TB of cache each, jobs
    take 1-8 GPUs at 10-120MB/s per GPU, one in ten is spread over two nodes, and the
    remote link carries a fifth of what all jobs would read uncached. Caches are partly
    filled, and each job reports the effective cache of its current epoch, so the policies
    plan for "now" as they do live. Half the jobs give f* in the jobs file; the rest have
    it measured.
    """
    rng = random.Random(seed)
    n_nodes, n_datasets = max(1, n_jobs // 8), max(1, n_jobs // 10)
    nodes = tuple(
        api.NodeConfig(f"node-{i:05d}", f"/run/n{i}.sock", gpus=8, cache=4000 * GB)
        for i in range(n_nodes)
    )
    sizes = {
        f"s3://bench/ds-{d:05d}/": float(int(math.exp(rng.uniform(math.log(100), math.log(2000)))))
        * GB
        for d in range(n_datasets)
    }
    uris = list(sizes)
    seen = {n.name: api.NodeSeen(n.name, float(n.cache), datasets={}, jobs={}) for n in nodes}
    entries, ideal, demand = [], {}, 0.0
    for j in range(n_jobs):
        name = f"job-{j:06d}"
        uri = rng.choice(uris)
        gpus = rng.choice((1, 1, 2, 4, 8))
        f_star = gpus * rng.uniform(10, 120) * MB
        demand += f_star
        first = rng.randrange(n_nodes)
        where = [nodes[first].name]
        if rng.random() < 0.1 and n_nodes > 1:
            where.append(nodes[(first + 1) % n_nodes].name)
        for node in where:
            status = seen[node]
            if uri not in status.datasets:
                cached = sizes[uri] * rng.uniform(0, 0.5)
                status.datasets[uri] = api.DatasetSeen(uri, uri, sizes[uri], cached, cached)
            held = status.datasets[uri].cached
            status.jobs[name] = api.JobSeen(
                name, uri, allocation=None, bytes_read=0.0, hit_bytes=0.0,
                effective_cache=held * rng.uniform(0.5, 1.0),
            )  # fmt: skip
        given = j % 2 == 0
        entries.append(
            api.JobEntry(
                name,
                uri,
                gpus=gpus,
                ideal_io=f_star if given else None,
                nodes=tuple(where),
                epochs=rng.uniform(1, 90),
            )  # fmt: skip
        )
        if not given:
            ideal[name] = f_star
    config = api.ControllerConfig(policy="gavel", remote_io=demand / 5, nodes=nodes)
    return config, entries, seen, ideal


def time_policy(api: Any, policy: str, n_jobs: int, profile: bool = False) -> Timing:
    from dataclasses import replace

    from silofs_ctl.estimator import SiloDEstimator

    config, entries, seen, ideal = synthetic(api, n_jobs)
    config = replace(config, policy=policy)
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    t0 = time.process_time()
    jobs, cluster, unknown = api.build_problem(config, entries, seen, ideal)
    t1 = time.process_time()
    alloc = api.POLICIES[policy]().allocate(jobs, cluster, SiloDEstimator())
    extra = []
    if hasattr(api, "share_the_rest"):  # the link's rest shared after the policy
        extra = [api.share_the_rest(alloc, jobs, unknown, cluster)]
    t2 = time.process_time()
    api.to_plan(config, jobs, unknown, cluster, alloc, seen, *extra)
    t3 = time.process_time()
    if prof:
        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
    return Timing(policy, n_jobs, t1 - t0, t2 - t1, t3 - t2)


def slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of log(time) over log(jobs): 1 is linear, 2 quadratic."""
    pts = [(math.log(n), math.log(max(t, 1e-6))) for n, t in points]
    if len(pts) < 2:
        return math.nan
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    var = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / var if var > 0 else math.nan


def measure(policies: list[str], sizes: list[int], budget: float) -> list[Timing]:
    """Time every policy at every size; a policy whose last run took more than `budget`
    seconds skips the larger sizes (the old Gavel at 10k jobs takes minutes)."""
    api = _api()
    out = []
    for policy in policies:
        for n in sizes:
            t = time_policy(api, policy, n)
            out.append(t)
            print(
                f"  {policy:7} {n:>7} jobs {t.total:9.3f}s",
                file=sys.stderr,
                flush=True,
            )
            if t.total > budget:
                break
    return out


def run_rev(rev: str, policies: list[str], sizes: list[int], budget: float) -> list[Timing]:
    """This script against `rev`'s silofs-ctl (tests/support/baseline.py), in a subprocess."""
    cmd = [__file__, "--json", "--budget", str(budget)]
    cmd += ["--sizes", *map(str, sizes), "--policies", *policies]
    print(f"{baseline.describe(rev)}:", file=sys.stderr, flush=True)
    with baseline.baseline_tree(rev) as tree:
        done = baseline.run(tree, cmd, check=True, capture_output=True, text=True)
    sys.stderr.write(done.stderr)
    return [Timing(**row) for row in json.loads(done.stdout)]


def table(label: str, timings: list[Timing]) -> str:
    rows = [
        f"{label}",
        f"{'policy':8} {'jobs':>7} {'build':>9} {'allocate':>9} {'to_plan':>9} {'total':>9}",
    ]
    for t in timings:
        rows.append(
            f"{t.policy:8} {t.jobs:>7} {t.build:8.3f}s {t.allocate:8.3f}s "
            f"{t.to_plan:8.3f}s {t.total:8.3f}s"
        )
    rows.append("fitted exponent (log-log slope of total time over jobs):")
    for policy in dict.fromkeys(t.policy for t in timings):
        pts = [(t.jobs, t.total) for t in timings if t.policy == policy]
        rows.append(f"  {policy:8} {slope(pts):5.2f}   over {', '.join(str(n) for n, _ in pts)}")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--policies", nargs="+", default=list(POLICY_NAMES))
    baseline.add_argument(parser, "silofs-ctl (before)")
    parser.add_argument(
        "--budget",
        type=float,
        default=600.0,
        help="skip a policy's larger sizes once one run took longer than this (s)",
    )
    parser.add_argument("--profile", metavar="POLICY", help="cProfile one policy, print top 25")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.profile:
        for n in args.sizes:
            t = time_policy(_api(), args.profile, n, profile=True)
            print(table("profiled", [t]))
        return 0
    before = run_rev(args.git_rev, args.policies, args.sizes, args.budget) if args.git_rev else []
    import silofs_ctl

    print(f"this tree ({Path(silofs_ctl.__file__).parent}):", file=sys.stderr, flush=True)
    after = measure(args.policies, args.sizes, args.budget)
    if args.json:
        print(json.dumps([vars(t) for t in after]))
        return 0
    if before:
        print(table(f"before: {baseline.describe(args.git_rev)}", before))
        print()
    print(table("after: this tree" if before else "this tree", after))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
