"""What a plan's per-job work costs with the jobs' fields in objects or in arrays.

Owns: a microbenchmark of `_rerate_plan`'s per-job arithmetic and event write (rate
from the GPU share, hit ratio and link share; the time of the next event into the
clock's array) over N jobs, done three ways: the loop over SimJob objects the
simulator runs today; numpy over arrays the fields live in; and numpy over fields
gathered from the objects and written back. Prints CPU microseconds per job and plan
(best of several repeats). Never: runs a simulation, or stands for a whole plan (the
views, _apply and the policy make more passes of the same kind).

    python bench/job_fields.py [--jobs 530]
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections.abc import Callable
from operator import attrgetter

import common  # noqa: F401 - this checkout first on sys.path
import numpy as np
from silofs_ctl.scenario import JobSpec
from silofs_ctl.sim_clock import Clock
from silofs_ctl.sim_job import SimJob

FIELDS = ("hit", "share", "read", "pos", "work", "size", "rate", "remote")


def jobs_on(clock: Clock, n: int) -> list[SimJob]:
    rng = random.Random(1)
    jobs = []
    for i in range(n):
        spec = JobSpec(
            name=f"j{i}", dataset=f"d{i % 20}", dataset_size=10**11, gpus=1,
            ideal_io=rng.uniform(1e8, 1e9), epochs=5, submit=0.0,
        )  # fmt: skip
        job = SimJob.of(spec, private=False)
        job.share, job.hit = rng.uniform(0.1, 1.0), rng.uniform(0.0, 0.9)
        job.read = job.pos = rng.uniform(0.0, 1e11)
        clock.add(job)
        jobs.append(job)
    return jobs


def ways(n: int) -> dict[str, Callable[[float], None]]:
    clock = Clock()
    jobs = jobs_on(clock, n)
    rng = random.Random(2)
    demand = {j.name: rng.uniform(1e6, 1e8) for j in jobs}
    fair, held = 5e7, {j.name for j in jobs[::3]}

    def objects(k: float) -> None:  # today's loop (k moves every rate)
        for job in jobs:
            hit, gpu_rate, name = job.hit, job.share * job.spec.ideal_io, job.name
            remote = fair if name in held else demand[name]
            rate = remote / (1.0 - hit)
            rate = (rate if rate < gpu_rate else gpu_rate) * k
            if rate != job.rate or remote != job.remote or job.seq < 0:
                job.rate, job.remote = rate, remote
                clock.schedule(job)

    ideal = np.array([j.spec.ideal_io for j in jobs])
    wanted = np.array([demand[j.name] for j in jobs])
    is_held = np.array([j.name in held for j in jobs])
    slots, times = np.array([j.slot for j in jobs]), clock.times
    kept = {f: np.array([getattr(j, f) for j in jobs]) for f in FIELDS}

    def arrays(k: float, a: dict[str, np.ndarray] = kept) -> None:
        gpu_rate = a["share"] * ideal
        remote = np.where(is_held, fair, wanted)
        rate = remote / (1.0 - a["hit"])
        rate = np.where(rate < gpu_rate, rate, gpu_rate) * k
        changed = (rate != a["rate"]) | (remote != a["remote"])
        a["rate"], a["remote"] = rate, remote
        until = np.maximum(np.minimum(a["work"] - a["read"], a["size"] - a["pos"]), 0.0)
        times[slots[changed]] = clock.now + until[changed] / rate[changed]

    getters = {f: attrgetter(f) for f in FIELDS}

    def gathered(k: float) -> None:
        a = {f: np.fromiter(map(get, jobs), float, n) for f, get in getters.items()}
        arrays(k, a)
        for job, rate, remote in zip(jobs, a["rate"].tolist(), a["remote"].tolist(), strict=True):
            job.rate, job.remote = rate, remote

    return {
        "loop over SimJob objects": objects,
        "numpy, fields in arrays": arrays,
        "numpy, gathered and written back": gathered,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=530)
    parser.add_argument("--plans", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    results = {}
    for name, way in ways(args.jobs).items():
        best = math.inf
        for _ in range(args.repeats):
            start = time.process_time()
            for i in range(args.plans):
                way(1.0 + i * 1e-9)
            best = min(best, time.process_time() - start)
        results[name] = best / args.plans / args.jobs * 1e6
    base = results["loop over SimJob objects"]
    for name, us in results.items():
        print(f"{name:34s} {us:6.3f} us per job and plan ({base / us:5.1f}x)")


if __name__ == "__main__":
    main()
