"""SiloD's estimator and policies against cases computed by hand from the paper's formulas."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from silofs_ctl.estimator import (
    ComputeEstimator,
    SiloDEstimator,
    cache_efficiency,
    equal_share_perf,
    silod_perf,
    unit_efficiency,
)
from silofs_ctl.model import Allocation, Cluster, Job
from silofs_ctl.policies import (
    AlluxioCache,
    CoordlCache,
    FifoPolicy,
    GavelPolicy,
    GreedyPolicy,
    QuiverCache,
    SjfPolicy,
)
from silofs_ctl.policies.base import water_fill, water_fill_capped
from silofs_ctl.policies.gavel import maxmin_level
from silofs_ctl.policies.greedy import greedy_cache
from silofs_ctl.policies.sjf import silod_choice

MB, GB, TB = 1e6, 1e9, 1e12


def job(name: str, dataset: str, f_star: float, gpus: int = 1, **kw: object) -> Job:
    return Job(name, dataset, gpus, f_star, {dataset: 1.0}, **kw)


def cluster(gpus: int, cache: float, io: float, datasets: dict[str, float]) -> Cluster:
    return Cluster.pooled({"n0": gpus}, {"n0": cache}, io, datasets)


# ------------------------------------------------------------------ estimator


def test_eq4_io_bound_and_compute_bound() -> None:
    # ResNet-50 (f* = 114 MB/s) with half its data cached and 50 MB/s of remote IO:
    # b / (1 - c/d) = 50 / 0.5 = 100 < 114, so IO-bound at 100 MB/s.
    assert silod_perf(114 * MB, 50 * MB, 0.5) == pytest.approx(100 * MB)
    # with 60 MB/s it would feed 120 > f*: compute-bound at f*
    assert silod_perf(114 * MB, 60 * MB, 0.5) == pytest.approx(114 * MB)
    # fully cached needs no remote IO at all
    assert silod_perf(114 * MB, 0.0, 1.0) == pytest.approx(114 * MB)
    assert silod_perf(114 * MB, 0.0, 0.0) == 0.0


def test_eq5_cache_efficiency_matches_the_papers_numbers() -> None:
    # §2.2: ResNet-50 on ImageNet-1k saves 114 MB/s with 143 GB (~0.8 MB/s per GB);
    # BERT on web search saves 2 MB/s with 20,971 GB (9.5e-5 MB/s per GB).
    c = cluster(2, 1 * TB, 50 * MB, {"imagenet-1k": 143 * GB, "websearch": 20971 * GB})
    resnet = cache_efficiency(job("r", "imagenet-1k", 114 * MB), c)
    bert = cache_efficiency(job("b", "websearch", 2 * MB), c)
    assert resnet * GB / MB == pytest.approx(0.797, abs=1e-3)
    assert bert * GB / MB == pytest.approx(9.54e-5, rel=1e-2)


def test_dataset_sharing_sums_efficiency_and_charges_cache_once() -> None:
    # §6: two jobs on ImageNet-1k use 143 GB of cache, not 286 GB.
    c = cluster(4, 300 * GB, 50 * MB, {"imagenet-1k": 143 * GB, "other": 200 * GB})
    jobs = [
        job("a", "imagenet-1k", 114 * MB),
        job("b", "imagenet-1k", 114 * MB),
        job("c", "other", 150 * MB),
    ]
    eff = unit_efficiency(jobs, c)
    assert eff["imagenet-1k"] == pytest.approx(2 * 114 * MB / (143 * GB))
    cache = greedy_cache(jobs, c)
    # the shared dataset saves 228 MB/s per 143 GB, the other 150 per 200 GB: first, whole;
    # the other gets what is left (Algorithm 2 line 4)
    assert cache == {"imagenet-1k": 143 * GB, "other": pytest.approx(157 * GB)}


def test_equal_share_is_the_silod_perf_of_an_even_split() -> None:
    # Figure 4: 2 GPUs, 1.4 TB cache, 100 MB/s; two jobs on different 1.36 TB datasets.
    # Equal share: 1 GPU, 0.7 TB, 50 MB/s each: 50 / (1 - 0.7/1.36) = 103.03 MB/s.
    c = cluster(2, 1.4 * TB, 100 * MB, {"a": 1.36 * TB, "b": 1.36 * TB})
    jobs = [job("j0", "a", 114 * MB), job("j1", "b", 114 * MB)]
    e = equal_share_perf(jobs, c, SiloDEstimator())
    assert e["j0"] == pytest.approx(50 * MB / (1 - 0.7 / 1.36))
    assert equal_share_perf(jobs, c, ComputeEstimator())["j0"] == pytest.approx(114 * MB)


# ------------------------------------------------------------------- Gavel


def figure4() -> tuple[list[Job], Cluster]:
    c = cluster(2, 1.4 * TB, 100 * MB, {"a": 1.36 * TB, "b": 1.36 * TB})
    return [job("j0", "a", 114 * MB), job("j1", "b", 114 * MB)], c


def test_eq9_level_by_hand_on_figure4() -> None:
    # lam* = B / H with H = e * (2 - 1.4/1.36) (any split of the cache between two units of
    # equal efficiency), e = 103.03 MB/s: lam* = 100 / (103.03 * 0.9706) = 1.0000.
    jobs, c = figure4()
    e = equal_share_perf(jobs, c, SiloDEstimator())
    lam, cache = maxmin_level(jobs, c, e)
    assert lam == pytest.approx(100 * MB / (e["j0"] * (2 - 1.4 / 1.36)))
    assert lam == pytest.approx(1.0, abs=1e-3)
    assert sum(cache.values()) == pytest.approx(1.4 * TB)


def test_silod_gavel_lifts_the_worst_job_and_then_the_cached_one() -> None:
    # Both reach the equal-share 103 MB/s; the fully cached job then rises to f* = 114
    # without costing the other anything (it needs no IO).
    jobs, c = figure4()
    alloc = GavelPolicy().allocate(jobs, c, SiloDEstimator())
    rates = {j.name: alloc.gpu_share[j.name] * j.f_star for j in jobs}
    cached = max(alloc.cache, key=lambda k: alloc.cache[k])
    fast = "j0" if cached == "a" else "j1"
    slow = "j1" if fast == "j0" else "j0"
    assert alloc.cache[cached] == pytest.approx(1.36 * TB)
    assert rates[fast] == pytest.approx(114 * MB)
    assert alloc.io[fast] == pytest.approx(0.0, abs=1)
    # the slow one gets all the IO and 0.04 TB of cache: 100 / (1 - 0.04/1.36) = 103.03
    assert alloc.io[slow] == pytest.approx(100 * MB)
    assert silod_perf(114 * MB, alloc.io[slow], 0.04 / 1.36) == pytest.approx(103.03 * MB, rel=1e-3)


def test_silod_gavel_gives_io_to_a_job_whose_cache_is_not_filled_yet() -> None:
    # Regression: planning IO with the allocation gave the fully-allocated job 0 IO, so
    # its empty cache could never fill. With nothing cached, both need all their reads.
    jobs, c = figure4()
    empty = replace(c, cached={"a": 0.0, "b": 0.0})
    alloc = GavelPolicy().allocate(jobs, empty, SiloDEstimator())
    assert alloc.io["j0"] == pytest.approx(50 * MB)
    assert alloc.io["j1"] == pytest.approx(50 * MB)
    # a job that measures its hits per epoch (delayed effectiveness) is believed
    filled = [replace(jobs[0], hit_now=0.0), jobs[1]]
    alloc = GavelPolicy().allocate(filled, replace(c, cached={"a": 1.36 * TB}), SiloDEstimator())
    assert alloc.io["j0"] > 40 * MB


def test_vanilla_gavel_is_gpu_max_min_and_leaves_storage_alone() -> None:
    # 4 GPUs; jobs of 4, 2 and 1 GPUs, equal normalised shares: x = 4/3 / g capped at 1.
    # perf/perf_equal is the same for all: x_j * g_j / (4/3) -> lam = 4 / sum(g_j x_eq_j)
    c = cluster(4, 1 * TB, 100 * MB, {"d": 1 * TB})
    jobs = [
        job("big", "d", 400 * MB, gpus=4),
        job("mid", "d", 200 * MB, gpus=2),
        job("one", "d", 100 * MB, gpus=1),
    ]
    alloc = GavelPolicy().allocate(jobs, c, ComputeEstimator())
    assert alloc.cache == {} and alloc.io == {}
    # equal share in GPUs: 4/3 each -> x_eq = 1/3, 2/3, 1. Level lam with
    # sum x_eq*g*lam = (4/3+4/3+1)*lam = 4 -> lam = 12/11; "one" caps at 1 first
    # (its x_eq is already 1), then big and mid share the rest: (4/3+4/3) lam' = 3.
    assert alloc.gpu_share["one"] == pytest.approx(1.0)
    assert alloc.gpu_share["big"] == pytest.approx(1 / 3 * 9 / 8)
    assert alloc.gpu_share["mid"] == pytest.approx(2 / 3 * 9 / 8)
    assert sum(alloc.gpu_share[j.name] * j.gpus for j in jobs) == pytest.approx(4.0)


# --------------------------------------------------------------------- SJF


def eq7_brute_force(j: Job, c: Cluster, readers: int) -> float:
    """min over a grid of (cache, IO) of Eq. 7, straight from the formula."""
    d = c.units[j.dataset].size
    pool = c.total_cache
    best = math.inf
    for i in range(101):
        cache = min(d, pool) * i / 100
        # IO on a grid, plus the demand f*(1 - c/d) where perf stops growing with IO
        for io in [j.f_star * k / 100 for k in range(201)] + [j.f_star * (1 - cache / d)]:
            if io <= 0 and cache < d:
                continue
            perf = silod_perf(j.f_star, io, cache / d)
            cost = j.gpus / c.total_gpus + cache / (readers * pool) + io / c.remote_io
            best = min(best, cost * j.remaining / perf)
    return best


@pytest.mark.parametrize(
    "f_star,size,io",
    [
        (114 * MB, 143 * GB, 200 * MB),
        (2 * MB, 20 * TB, 200 * MB),
        (300 * MB, 1.3 * TB, 50 * MB),
        (50 * MB, 500 * GB, 1000 * MB),
    ],
)
def test_eq7_closed_form_matches_brute_force(f_star: float, size: float, io: float) -> None:
    c = cluster(8, 1 * TB, io, {"d": size})
    j = job("j", "d", f_star, gpus=2, remaining=10 * TB)
    choice = silod_choice(j, c, {"d": 1})
    assert choice.score == pytest.approx(eq7_brute_force(j, c, 1), rel=1e-9)


def test_silod_sjf_runs_the_cache_efficient_job_first() -> None:
    # §5.1: two ResNet-50 jobs, same GPUs and steps; ImageNet-1k (143 GB) vs ImageNet-22k
    # (1.3 TB). Vanilla SJF sees a tie; SiloD's Eq. 7 prefers the 1k job.
    c = cluster(1, 200 * GB, 50 * MB, {"in22k": 1.3 * TB, "in1k": 143 * GB})
    jobs = [
        job("a-22k", "in22k", 114 * MB, remaining=5 * TB, submit=0),
        job("b-1k", "in1k", 114 * MB, remaining=5 * TB, submit=1),
    ]
    vanilla = SjfPolicy().allocate(jobs, c, ComputeEstimator())
    silod = SjfPolicy().allocate(jobs, c, SiloDEstimator())
    assert vanilla.running() == ["a-22k"]  # tie, broken by submit time
    assert silod.running() == ["b-1k"]
    assert silod.cache["in1k"] == pytest.approx(143 * GB)
    assert silod.io["b-1k"] == pytest.approx(50 * MB)  # nothing cached yet: all it can get


def test_sjf_backfills_and_shorter_remaining_work_goes_first() -> None:
    c = cluster(4, 1 * TB, 100 * MB, {"d": 1 * TB})
    jobs = [
        job("long", "d", 100 * MB, gpus=2, remaining=10 * TB),
        job("wide", "d", 100 * MB, gpus=4, remaining=1 * TB),
        job("short", "d", 100 * MB, gpus=2, remaining=1 * TB),
    ]
    alloc = SjfPolicy().allocate(jobs, c, ComputeEstimator())
    # scores W/f*g/G: short 0.5e4, wide 1e4, long 5e4 -> short runs, wide does not fit,
    # long backfills the 2 free GPUs
    assert sorted(alloc.running()) == ["long", "short"]


# -------------------------------------------------------------------- FIFO


def test_fifo_blocks_behind_the_head_job_and_silod_form_adds_algorithm2() -> None:
    c = cluster(4, 150 * GB, 100 * MB, {"small": 100 * GB, "big": 1 * TB})
    jobs = [
        job("first", "big", 10 * MB, gpus=2, submit=0),
        job("wide", "small", 100 * MB, gpus=4, submit=1),
        job("late", "small", 100 * MB, gpus=1, submit=2),
    ]
    vanilla = FifoPolicy().allocate(jobs, c, ComputeEstimator())
    assert vanilla.running() == ["first"] and vanilla.cache == {}
    silod = FifoPolicy().allocate(jobs, c, SiloDEstimator())
    assert silod.running() == ["first"]
    assert silod.cache == {"big": pytest.approx(150 * GB)}  # only running jobs' data
    assert silod.io == {}  # remote IO stays with the link (max-min fair)


def test_greedy_policy_caches_most_efficient_first_last_one_partially() -> None:
    c = cluster(8, 1 * TB, 100 * MB, {"x": 400 * GB, "y": 800 * GB, "z": 100 * GB})
    jobs = [job("jx", "x", 100 * MB), job("jy", "y", 400 * MB), job("jz", "z", 10 * MB)]
    # efficiencies: y 0.5, x 0.25, z 0.1 MB/s per GB -> y whole, x gets the 200 GB left
    alloc = GreedyPolicy().allocate(jobs, c, SiloDEstimator())
    assert alloc.cache == {"y": pytest.approx(800 * GB), "x": pytest.approx(200 * GB)}


# -------------------------------------------------------------- baselines


def running(jobs: list[Job]) -> Allocation:
    return Allocation(
        gpu_share={j.name: 1.0 for j in jobs}, placement={j.name: {"n0": j.gpus} for j in jobs}
    )


def test_quiver_caches_whole_datasets_by_benefit_over_size() -> None:
    # Figure 4: benefit/cost ties; Quiver caches one dataset whole and nothing of the
    # other (1.36 TB does not fit in the 0.04 TB left).
    jobs, c = figure4()
    alloc = running(jobs)
    QuiverCache().fill_cache(jobs, c, alloc)
    assert alloc.cache == {"a": pytest.approx(1.36 * TB)}
    # a job whose speed-up is under 5% does not count: with 1 GB/s of fair share
    # neither job is IO-bound, so nothing is cached
    alloc = running(jobs)
    QuiverCache().fill_cache(jobs, replace(c, remote_io=2000 * MB), alloc)
    assert alloc.cache == {}


def test_quiver_figure4_worst_job_matches_the_paper() -> None:
    # Quiver: job-1 reads remotely with the link to itself: 50 MB/s over a 0.04 TB-less
    # dataset is ~52 MB/s in the paper (50 MB/s per job; see figure4.toml).
    assert silod_perf(114 * MB, 50 * MB, 0.04 / 1.36) == pytest.approx(51.5 * MB, rel=1e-2)


def test_coordl_static_share_follows_gpus_on_the_node() -> None:
    c = Cluster.pooled(
        {"n0": 8, "n1": 8}, {"n0": 800 * GB, "n1": 800 * GB}, 100 * MB, {"a": 1 * TB, "b": 50 * GB}
    )
    jobs = [job("a", "a", 100 * MB, gpus=2), job("b", "b", 100 * MB, gpus=4)]
    alloc = Allocation(
        gpu_share={"a": 1.0, "b": 1.0}, placement={"a": {"n0": 2}, "b": {"n0": 2, "n1": 2}}
    )
    CoordlCache().fill_cache(jobs, c, alloc)
    assert alloc.cache["a"] == pytest.approx(200 * GB)  # 2/8 of node n0's disk
    assert alloc.cache["b"] == pytest.approx(50 * GB)  # 400 GB of disk, but d = 50 GB


def test_coordl_time_shared_jobs_never_hold_more_than_the_disks() -> None:
    # Gavel time-shares: 3 jobs asking 8 + 8 + 4 GPUs on a 16-GPU cluster have no
    # placement. Each used to get its GPUs' slice of all disks (1 TB, 1 TB, 0.5 TB of a
    # 2 TB cluster); now they divide the 2 TB by the GPUs they ask for. (A unit per
    # job, as the simulator gives CoorDL.)
    c = Cluster.pooled(
        {"n0": 8, "n1": 8}, {"n0": 1 * TB, "n1": 1 * TB}, 100 * MB, dict.fromkeys("xyz", 5 * TB)
    )
    jobs = [job("x", "x", 100 * MB, gpus=8), job("y", "y", 100 * MB, gpus=8)]
    jobs.append(job("z", "z", 100 * MB, gpus=4))
    alloc = Allocation(gpu_share={"x": 0.4, "y": 0.4, "z": 0.4})
    CoordlCache().fill_cache(jobs, c, alloc)
    assert sum(alloc.cache.values()) == pytest.approx(2 * TB)
    assert alloc.cache["x"] == pytest.approx(0.8 * TB)
    assert alloc.cache["z"] == pytest.approx(0.4 * TB)
    # Asking for no more GPUs than there are, each keeps its GPUs' slice.
    alloc = Allocation(gpu_share={"x": 1.0, "y": 0.0, "z": 1.0})
    CoordlCache().fill_cache(jobs, c, alloc)
    assert alloc.cache == {"x": pytest.approx(1 * TB), "z": pytest.approx(0.5 * TB)}


def test_alluxio_only_marks_lru() -> None:
    jobs, c = figure4()
    alloc = running(jobs)
    AlluxioCache().fill_cache(jobs, c, alloc)
    assert alloc.lru and alloc.cache == {}


def test_water_fill_is_max_min_fair() -> None:
    assert water_fill(100, {"a": 10, "b": 60, "c": 60}) == {"a": 10, "b": 45, "c": 45}
    assert water_fill(100, {"a": 10, "b": 20}) == {"a": 10, "b": 20}
    assert water_fill(math.inf, {"a": 10}) == {"a": 10}


@pytest.mark.parametrize("seed", range(20))
def test_water_fill_divides_as_water_fill_capped_to_the_bit(seed: int) -> None:
    """water_fill takes only the met demands from a heap; the division, its float steps
    and its order must be water_fill_capped's (ties, zero demands, every capacity from
    nothing to more than all of them)."""
    rng = random.Random(seed)
    n = rng.randint(0, 60)
    pool = [0.0, 1.0, 2.5, 7.0]  # a few repeated values: ties in the order of the keys
    demands = {
        f"j{i}": rng.choice(pool) if rng.random() < 0.3 else rng.uniform(0, 10) for i in range(n)
    }
    total = sum(demands.values())
    for capacity in (0.0, total * rng.random(), total * rng.random() / 20, total, total * 2):
        got = water_fill(capacity, demands)
        want = water_fill_capped(capacity, demands)[0]
        assert list(got.items()) == list(want.items())
        assert all(
            math.copysign(1, a) == math.copysign(1, b)
            for a, b in zip(got.values(), want.values(), strict=True)
        )


@pytest.mark.parametrize("jobs_count", [1, 3, 12, 40])
@pytest.mark.parametrize("seed", range(5))
def test_vanilla_gavel_closed_form_is_maxmin_to_rounding(jobs_count: int, seed: int) -> None:
    # vanilla_shares (by GPU count) against maxmin's progressive filling, with fewer and
    # more jobs than GPUs, jobs of no ideal rate and of no GPUs among them
    import random

    rng = random.Random(seed)
    c = cluster(16, 1 * TB, 100 * MB, {"d": 1 * TB})
    jobs = [
        job(f"j{i}", "d", rng.choice([0.0, 50 * MB, 300 * MB]), gpus=rng.choice([0, 1, 2, 4, 8]))
        for i in range(jobs_count)
    ]
    closed = GavelPolicy().allocate(jobs, c, ComputeEstimator()).gpu_share
    plain = GavelPolicy(closed_form=False).allocate(jobs, c, ComputeEstimator()).gpu_share
    assert list(closed) == list(plain)
    for name, share in plain.items():
        assert closed[name] == pytest.approx(share, rel=1e-12, abs=1e-15)


def test_gavel_takes_a_job_with_no_ideal_rate_without_dividing_by_zero() -> None:
    # f* == 0 (a job that has not been measured yet, or a scenario that says 0): it can use
    # no GPU time at any level, so it takes none and the others share the cluster.
    c = cluster(4, 1 * TB, 100 * MB, {"d": 1 * TB, "e": 1 * TB})
    jobs = [job("idle", "d", 0.0, gpus=2), job("busy", "e", 100 * MB, gpus=2)]
    for estimator in (SiloDEstimator(), ComputeEstimator()):
        e = equal_share_perf(jobs, c, estimator)
        lam, _ = maxmin_level(jobs, c, e, io_aware=estimator.io_aware)
        assert math.isfinite(lam) and lam >= 0
        alloc = GavelPolicy().allocate(jobs, c, estimator)
        # the SiloD form may hand it GPU time left idle, never time `busy` could use
        assert alloc.gpu_share["busy"] == pytest.approx(1.0)
        assert math.isfinite(alloc.gpu_share["idle"])
    assert GavelPolicy().allocate(jobs, c, ComputeEstimator()).gpu_share["idle"] == 0.0


# ------------------------------------------------------- what a plan depends on


def _busy_instance(seed: int) -> tuple[list[Job], Cluster]:
    """More jobs than GPUs and cache, shared datasets, some jobs placed: every policy
    has choices to make."""
    import random

    rng = random.Random(seed)
    sizes = {f"d{i}": rng.uniform(100, 900) * GB for i in range(4)}
    nodes = {f"n{i}": 4 for i in range(3)}
    cl = Cluster.pooled(nodes, {n: 400 * GB for n in nodes}, rng.uniform(50, 500) * MB, sizes)
    jobs = []
    for i in range(12):
        ds = rng.choice(sorted(sizes))
        placement = {"n0": 1} if i == 0 else None
        jobs.append(
            job(f"j{i}", ds, rng.uniform(20, 400) * MB, rng.choice([1, 2, 4]), submit=float(i))
        )
        jobs[-1] = replace(jobs[-1], placement=placement, remaining=rng.uniform(1, 50) * TB)
    return jobs, cl


def _moved(jobs: list[Job], cl: Cluster, what: str, seed: int) -> tuple[list[Job], Cluster]:
    import random

    rng = random.Random(seed)
    if what == "remaining":
        return [replace(j, remaining=rng.uniform(1, 50) * TB) for j in jobs], cl
    cached = {key: rng.uniform(0, unit.size) for key, unit in cl.units.items()}
    return [replace(j, hit_now=rng.random()) for j in jobs], replace(cl, cached=cached)


@pytest.mark.parametrize("policy", [FifoPolicy, SjfPolicy, GavelPolicy, GreedyPolicy])
@pytest.mark.parametrize("estimator", [ComputeEstimator, SiloDEstimator])
@pytest.mark.parametrize("cache", [None, CoordlCache, QuiverCache, AlluxioCache])
def test_a_plan_depends_on_no_moving_input_its_policy_does_not_declare(
    policy: type, estimator: type, cache: type | None
) -> None:
    """Policy.reads is what lets the simulator keep a plan instead of re-running it: moving
    any input a policy and its cache system do not name must not change their plan."""
    pol, est = policy(), estimator()
    reads = pol.reads(est) | (cache.reads if cache else frozenset())

    def plan(jobs: list[Job], cl: Cluster) -> Allocation:
        alloc = pol.allocate(jobs, cl, est)
        if cache is not None:
            cache().fill_cache(jobs, cl, alloc)
        return alloc

    for seed in range(5):
        jobs, cl = _busy_instance(seed)
        before = plan(jobs, cl)
        for what in {"remaining", "hits"} - reads:
            assert plan(*_moved(jobs, cl, what, seed + 100)) == before, what
    # and the declarations are not empty where the plan does depend on them
    assert ("remaining" in pol.reads(est)) == (policy is SjfPolicy)
    assert ("hits" in pol.reads(est)) == (est.io_aware and policy in (SjfPolicy, GavelPolicy))


@pytest.mark.parametrize("seed", range(6))
def test_fixed_hits_round_loads_equal_the_loads_of_each_round(seed: int) -> None:
    # _cap_rounds' binary search asks for the IO loads with the first g rounds frozen;
    # _FixedHits.round_loads must give what loads() gives for that dictionary, to the bit
    import random

    from silofs_ctl.policies.gavel import _FixedHits, _frozen_loads, with_fixed_hits

    rng = random.Random(seed)
    jobs, cl = _busy_instance(seed)
    hits = {j.name: rng.choice([0.0, 1.0, rng.random()]) for j in jobs}
    now_jobs, now_cl = with_fixed_hits(jobs, cl, hits)
    e = {j.name: rng.uniform(1, 300) * MB for j in now_jobs}
    model = _FixedHits(now_jobs, e, now_cl)
    fixed = {j.name: rng.uniform(0, 200) * MB for j in now_jobs if rng.random() < 0.3}
    free = [j for j in now_jobs if j.name not in fixed]
    groups, end, level = [], 0, 0.1
    while end < len(free):
        end = min(len(free), end + rng.randint(1, 3))
        level *= rng.uniform(1.0, 2.0)
        groups.append((level, end))
    fast = model.round_loads(fixed, free, groups)
    for g in range(len(groups) + 1):
        general = _frozen_loads(model.loads, fixed, free, groups, e, g)
        assert (fast(g).a, fast(g).b) == (general.a, general.b)
        assert fast(g).limit(now_cl, 0.5) == general.limit(now_cl, 0.5)


def test_gavel_keeps_its_steady_plan_only_for_the_same_jobs() -> None:
    # One GavelPolicy re-plans as a fresh one would when a job's reads (a new mapping),
    # its f* or its GPUs move, and when the reads are equal mappings but new objects.
    c = cluster(4, 1 * TB, 100 * MB, {"a": 800 * GB, "b": 600 * GB, "c": 90 * GB})
    plans = [
        [job("j0", "a", 114 * MB), job("j1", "b", 60 * MB, gpus=2)],
        [job("j0", "a", 114 * MB), replace(job("j1", "c", 60 * MB, gpus=2), dataset="b")],
        [job("j0", "a", 30 * MB), replace(job("j1", "c", 60 * MB, gpus=2), dataset="b")],
        [job("j0", "a", 30 * MB), replace(job("j1", "c", 60 * MB, gpus=3), dataset="b")],
        [job("j0", "a", 30 * MB), replace(job("j1", "c", 60 * MB, gpus=3), dataset="b")],
    ]
    kept = GavelPolicy()
    for jobs in plans:
        got = kept.allocate(jobs, c, SiloDEstimator())
        want = GavelPolicy().allocate(jobs, c, SiloDEstimator())
        assert (got.gpu_share, got.cache, got.io) == (want.gpu_share, want.cache, want.io)
