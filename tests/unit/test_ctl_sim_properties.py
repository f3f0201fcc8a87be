"""Properties every simulation must keep, checked at every step and on `--json`'s output,
over generated scenarios x every scheduler x every cache.

What a reader of the results would check, and the simulator's state allows between two
steps (after a plan or a re-rate, before the step's time passes):

- a running job has arrived; the GPUs in use (GPUs x share) are at most the cluster's,
  a node's placed GPUs at most the node's;
- uniform caching: a unit holds at most its allocation and its dataset; a pool's
  holdings and allocations add up to at most the pool;
- LRU: the holdings and the steady-state targets add up to at most the cache;
- the running jobs' remote IO is at most the link; a job not held at the link's level
  reads at most its GPU share of f*.

And on the results (`SimResult.to_dict()`, what `--json` prints):

- submit <= start <= finish, and JCT >= the job's ideal duration (epochs x size / f*);
- hit ratios in [0, 1], one per epoch begun (ceil(epochs)), and remote bytes the work
  times the miss ratio;
- the timeline in time order, its remote IO at most the link, and its integrals the
  jobs' remote bytes and the work.

Tolerances are rounding: 1e-6 relative plus a byte. A dataset under a megabyte is left
out of the per-epoch and integral checks: the simulator ends an epoch within a byte of
its end (SimJob.eps), which for a dataset of a few bytes is most of it. Every violation
found was a defect (test_ctl_simulator: an eleventh epoch for `epochs = 10`).
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from silofs_ctl.scenario import Scenario, parse_scenario
from silofs_ctl.simulator import CACHE_CHOICES, Simulation

SCHEDULERS = ("fifo", "sjf", "gavel")
PAIRS = [(s, c) for s in SCHEDULERS for c in CACHE_CHOICES]
REL = 1e-6
TINY = 10**6  # bytes: datasets below are out of the per-epoch and integral checks


def _over(value: float, bound: float) -> bool:
    return value > bound * (1 + REL) + 1.0


class CheckedSimulation(Simulation):
    """A Simulation that checks its state before every step's time passes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.violations: list[str] = []

    def _bad(self, what: str) -> None:
        if len(self.violations) < 10:
            self.violations.append(f"t={self.clock.now:.6g}: {what}")

    def _step(self) -> float:
        self._check_jobs()
        if self.units.lru:
            self._check_lru()
        else:
            self._check_units()
        if _over(self.total_remote, self.scenario.remote_io):
            self._bad(f"remote IO {self.total_remote:.6g} > link {self.scenario.remote_io:.6g}")
        return super()._step()

    def _check_jobs(self) -> None:
        now, running = self.clock.now, self.running.values()
        used = 0.0
        placed: dict[str, int] = {}
        for job in running:
            if job.spec.submit > now + 1e-9:  # (the arrivals' tolerance: Simulation)
                self._bad(f"{job.name} runs before its submit {job.spec.submit}")
            if not 0 < job.share <= 1:
                self._bad(f"{job.name} runs with a GPU share of {job.share}")
            used += job.spec.gpus * job.share
            for node, gpus in (job.placement or {}).items():
                placed[node] = placed.get(node, 0) + gpus
            if not job.held and _over(job.rate, job.share * job.ideal_io):
                self._bad(f"{job.name} reads {job.rate:.6g} > share x f* {job.ideal_io:.6g}")
        if used > self.scenario.total_gpus * (1 + REL):
            self._bad(f"{used} GPUs in use > {self.scenario.total_gpus}")
        for node in self.scenario.nodes:
            if placed.get(node.name, 0) > node.gpus:
                self._bad(f"node {node.name}: {placed[node.name]} GPUs placed > {node.gpus}")

    def _check_units(self) -> None:
        units, now = self.units, self.clock.now
        held: dict[str, float] = {}
        allocated: dict[str, float] = {}
        for key, unit in self.cluster.units.items():
            has = units.filled_now(key, now)
            held[unit.pool] = held.get(unit.pool, 0.0) + has
            allocated[unit.pool] = allocated.get(unit.pool, 0.0) + units.allocated[key]
            if _over(has, min(unit.size, units.allocated[key])):
                self._bad(f"unit {key} holds {has:.6g} > allocation {units.allocated[key]:.6g}")
        for pool, capacity in self.cluster.pools.items():
            if _over(held.get(pool, 0.0), capacity):
                self._bad(f"pool {pool} holds {held[pool]:.6g} > {capacity:.6g}")
            if _over(allocated.get(pool, 0.0), capacity):
                self._bad(f"pool {pool} allocated {allocated[pool]:.6g} > {capacity:.6g}")

    def _check_lru(self) -> None:
        pool = self.pool
        held = sum(pool.held(d) for d in pool.resident)
        if _over(held, pool.capacity):
            self._bad(f"LRU holds {held:.6g} > {pool.capacity:.6g}")
        if _over(sum(pool.target.values()), pool.capacity):
            self._bad(f"LRU targets {sum(pool.target.values()):.6g} > {pool.capacity:.6g}")


def result_violations(scenario: Scenario, out: dict[str, Any]) -> list[str]:
    """What is wrong with a run's `--json` output (SimResult.to_dict())."""
    bad: list[str] = []
    specs = {j.name: j for j in scenario.jobs}
    for job in out["jobs"]:
        spec, name = specs[job["name"]], job["name"]
        if job["finish_s"] is None:
            bad.append(f"{name} did not finish")
            continue
        if not spec.submit <= job["start_s"] <= job["finish_s"]:
            bad.append(f"{name}: submit {spec.submit}, start {job['start_s']}, finish ...")
        # (less what epochs ending within a byte of their end may leave unread)
        work = spec.epochs * spec.dataset_size
        eps = max(1.0, spec.dataset_size * 1e-12)  # SimJob.eps
        ideal = max(0.0, work - math.ceil(spec.epochs) * eps) / spec.ideal_io
        if job["jct_s"] < ideal * (1 - REL):
            bad.append(f"{name}: JCT {job['jct_s']:.6g} < its ideal duration {ideal:.6g}")
        ratios = [job["hit_ratio"], *job["epoch_hit_ratios"]]
        if not all(0 <= r <= 1 + REL for r in ratios):
            bad.append(f"{name}: hit ratios {ratios} outside [0, 1]")
        if abs(job["remote_bytes"] - work * (1 - job["hit_ratio"])) > REL * work + 1:
            bad.append(f"{name}: {job['remote_bytes']:.6g} remote bytes of {work:.6g} read")
        if spec.dataset_size >= TINY and len(job["epoch_hit_ratios"]) != math.ceil(spec.epochs):
            bad.append(f"{name}: {len(job['epoch_hit_ratios'])} epochs of {spec.epochs}")
    timeline = out["timeline"]
    times = [p["t_s"] for p in timeline]
    if times != sorted(times):
        bad.append("the timeline is not in time order")
    remote = rate = 0.0
    ends = [*times[1:], out["simulated_s"]]
    for point, end in zip(timeline, ends, strict=True):
        if _over(point["remote_bytes_per_s"], scenario.remote_io):
            bad.append(f"remote IO {point['remote_bytes_per_s']:.6g} > link at {point['t_s']}")
        remote += point["remote_bytes_per_s"] * (end - point["t_s"])
        rate += point["throughput_bytes_per_s"] * (end - point["t_s"])
    if min(j.dataset_size for j in scenario.jobs) >= TINY:
        fetched = sum(j["remote_bytes"] for j in out["jobs"])
        work = sum(j.epochs * j.dataset_size for j in scenario.jobs)
        if abs(remote - fetched) > 1e-4 * fetched + 1:
            bad.append(f"the timeline's remote IO adds up to {remote:.6g}, not {fetched:.6g}")
        if abs(rate - work) > 1e-4 * work + 1:
            bad.append(f"the timeline's throughput adds up to {rate:.6g}, not {work:.6g}")
    for point in out["fairness_timeline"]:
        if not (0 <= point["worst"] <= point["average"] + REL and math.isfinite(point["average"])):
            bad.append(f"fairness point {point}")
    return bad


def violations(text: str, scheduler: str, cache: str, interval: float = 600.0) -> list[str]:
    scenario = parse_scenario(text)
    sim = CheckedSimulation(scenario, scheduler, cache, interval)
    result = sim.run()
    return sim.violations + result_violations(scenario, result.to_dict())


def contended(seed: int, jobs: int = 30, per_node: bool = False) -> str:
    """Jobs arriving over a day on 16 GPUs, 1 TB of cache and a 300 MB/s link, four
    datasets from 50 GB to 800 GB: queues, shared datasets and a full link."""
    rng = random.Random(seed)
    lines = [
        "[cluster]",
        'remote_io = "300MB/s"',
        f'cache = "{"per-node" if per_node else "cluster"}"',
        "[[cluster.nodes]]",
        "count = 2",
        "gpus = 8",
        'cache = "500GB"',
    ]
    sizes = {"a": "50GB", "b": "200GB", "c": "400GB", "d": "800GB"}
    declared: set[str] = set()
    for i in range(jobs):
        dataset = rng.choice(sorted(sizes))
        lines += [
            "[[jobs]]",
            f'name = "j{i}"',
            f"submit = {rng.uniform(0, 86400):.0f}",
            f"gpus = {rng.choice([1, 1, 2, 4, 8])}",
            f'dataset = "{dataset}"',
            f'ideal_io = "{rng.choice([50, 100, 200, 400])}MB/s"',
            f"epochs = {rng.choice([1, 2, 3, 0.5, 2.5, 5])}",
        ]
        if dataset not in declared:
            declared.add(dataset)
            lines.append(f'dataset_size = "{sizes[dataset]}"')
    return "\n".join(lines) + "\n"


def odd(seed: int) -> str:
    """A small scenario with extremes: a link from 1 MB/s to unlimited, caches from 0
    to a terabyte, datasets from a byte to 300 GB, fractional epochs down to 0.01,
    jobs arriving at once or not."""
    rng = random.Random(seed)
    link = rng.choice(["unlimited", "1MB/s", "10MB/s", "100MB/s", "10GB/s"])
    lines = ["[cluster]", f'remote_io = "{link}"']
    if rng.random() < 0.3:
        lines.append('cache = "per-node"')
    most = 0
    for _ in range(rng.randint(1, 3)):
        gpus = rng.choice([1, 2, 4, 8])
        most = max(most, gpus)
        cache = rng.choice([0, 1, 10**6, 10**9, 10**11, 10**12])
        lines += ["[[cluster.nodes]]", f"gpus = {gpus}", f"cache = {cache}"]
    sizes: dict[str, int] = {}
    for i in range(rng.randint(1, 10)):
        dataset = f"d{rng.randrange(3)}"
        lines += [
            "[[jobs]]",
            f'name = "j{i}"',
            f"submit = {rng.choice([0, 0, rng.randint(0, 100), round(rng.uniform(0, 5000), 3)])}",
            f"gpus = {rng.randint(1, most)}",
            f'dataset = "{dataset}"',
            f'ideal_io = "{rng.choice([1, 10, 100, 500, 2000])}MB/s"',
            f"epochs = {rng.choice([1, 2, 3, 0.5, 0.01, 1.7, 10])}",
        ]
        if dataset not in sizes:
            sizes[dataset] = rng.choice([1, 1000, 10**6, 10**9, 10**10, 10**11, 3 * 10**11])
            lines.append(f"dataset_size = {sizes[dataset]}")
    return "\n".join(lines) + "\n"


def _pairs(text: str) -> list[tuple[str, str]]:
    per_node = 'cache = "per-node"' in text  # (alluxio refuses per-node caches)
    return [(s, c) for s, c in PAIRS if not (per_node and c == "alluxio")]


@pytest.mark.parametrize("per_node", [False, True])
@pytest.mark.parametrize("seed", [1, 2])
def test_contended_runs_keep_every_property(seed: int, per_node: bool) -> None:
    text = contended(seed, per_node=per_node)
    found = {f"{s}+{c}": v for s, c in _pairs(text) if (v := violations(text, s, c))}
    assert found == {}


def _odd_violations(seeds: range, interval: float) -> dict[str, list[str]]:
    found = {}
    for seed in seeds:
        text = odd(seed)
        for s, c in _pairs(text):
            if v := violations(text, s, c, interval):
                found[f"odd({seed}) {s}+{c}"] = v
    return found


def test_odd_scenarios_keep_every_property() -> None:
    assert _odd_violations(range(12), 600.0) == {}


@pytest.mark.slow
@pytest.mark.parametrize("interval", [60.0, 600.0])
def test_more_odd_scenarios_keep_every_property(interval: float) -> None:
    """(odd(12) at 60 s found a job that started before its submit time)"""
    assert _odd_violations(range(40), interval) == {}


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3, 11))
def test_more_contended_runs_keep_every_property(seed: int) -> None:
    text = contended(seed, jobs=80, per_node=seed % 2 == 1)
    found = {f"{s}+{c}": v for s, c in _pairs(text) if (v := violations(text, s, c))}
    assert found == {}


def test_the_checker_finds_what_it_checks() -> None:
    """A checker that cannot fail checks nothing: a link taken over, a JCT under the
    ideal duration, a missing epoch are each found."""
    text = contended(1, jobs=4)
    scenario = parse_scenario(text)
    out = Simulation(scenario, "fifo", "silod").run().to_dict()
    assert result_violations(scenario, out) == []
    out["timeline"][0]["remote_bytes_per_s"] = scenario.remote_io * 2
    job = out["jobs"][0]
    job["jct_s"] /= 1000
    job["epoch_hit_ratios"].append(0.5)
    found = result_violations(scenario, out)
    assert any("> link" in v for v in found)
    assert any("< its ideal duration" in v for v in found)
    assert any("epochs of" in v for v in found)

    class Greedy(CheckedSimulation):
        def _step(self) -> float:
            self.total_remote = scenario.remote_io * 1.5
            return super()._step()

    sim = Greedy(scenario, "fifo", "silod")
    sim.run()
    assert any("> link" in v for v in sim.violations)
