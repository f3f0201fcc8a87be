"""The exact SiloD max-min allocation (Eq. 9) against a generic LP solver.

Eq. 9 is bilinear in (lam, cache), but with mu = 1/lam, xi_j = x_j/lam and
beta_j = b_j/lam it becomes a linear program that knows nothing of the knapsack
structure policies/gavel.py exploits:

    min mu  s.t.  e_j <= xi_j f_j,  xi_j <= mu,  sum_j xi_j g_j <= G mu,
                  e_j * sum_u w_ju (1 - c_u/d_u) <= beta_j,  sum_j beta_j <= B mu,
                  sum_{u in p} c_u <= C_p,  0 <= c_u <= d_u.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from scipy.optimize import linprog
from silofs_ctl.estimator import SiloDEstimator, equal_share_perf, hit_ratio
from silofs_ctl.model import CacheUnit, Cluster, Job
from silofs_ctl.policies.gavel import maxmin, maxmin_level


def random_instance(rng: random.Random) -> tuple[list[Job], Cluster]:
    """Units: MB/s and GB, so the LP is well scaled. Several pools (nodes with their own
    caches), shared datasets, and jobs spread over one or two pools."""
    n_pools = rng.randint(1, 3)
    pools = {f"p{i}": rng.uniform(0, 3000) for i in range(n_pools)}
    datasets = {f"d{i}": rng.uniform(50, 2000) for i in range(rng.randint(1, 5))}
    units: dict[str, CacheUnit] = {}
    jobs = []
    for i in range(rng.randint(1, 8)):
        ds = rng.choice(sorted(datasets))
        where = rng.sample(sorted(pools), k=rng.randint(1, min(2, n_pools)))
        reads = {}
        for pool in where:
            key = f"{pool}|{ds}"
            units[key] = CacheUnit(key, pool, ds, datasets[ds])
            reads[key] = 1.0 / len(where)
        jobs.append(Job(f"j{i}", ds, rng.choice([1, 2, 4, 8]), rng.uniform(2, 2000), reads))
    gpus = {"n0": rng.randint(1, 32)}
    cluster = Cluster(gpus, {"n0": sum(pools.values())}, rng.uniform(1, 3000), pools, units)
    return jobs, cluster


def lp_level(jobs: list[Job], cluster: Cluster, e: dict[str, float]) -> float:
    keys = sorted(cluster.units)
    n, m = len(jobs), len(keys)
    # variables: mu, xi_0..n-1, beta_0..n-1, c_0..m-1
    nv = 1 + 2 * n + m
    xi = lambda j: 1 + j  # noqa: E731
    beta = lambda j: 1 + n + j  # noqa: E731
    cu = lambda u: 1 + 2 * n + u  # noqa: E731
    rows, rhs = [], []

    def add(coefs: dict[int, float], bound: float) -> None:
        row = np.zeros(nv)
        for k, v in coefs.items():
            row[k] += v
        rows.append(row)
        rhs.append(bound)

    for j, job in enumerate(jobs):
        add({xi(j): -job.f_star}, -e[job.name])
        add({xi(j): 1.0, 0: -1.0}, 0.0)
        miss = {
            cu(keys.index(k)): -e[job.name] * w / cluster.units[k].size
            for k, w in job.reads.items()
        }
        add({**miss, beta(j): -1.0}, -e[job.name] * sum(job.reads.values()))
    add({**{xi(j): float(job.gpus) for j, job in enumerate(jobs)}, 0: -cluster.total_gpus}, 0.0)
    add({**{beta(j): 1.0 for j in range(n)}, 0: -cluster.remote_io}, 0.0)
    for pool, cap in cluster.pools.items():
        add({cu(u): 1.0 for u, k in enumerate(keys) if cluster.units[k].pool == pool}, cap)
    bounds = [(0, None)] * (1 + 2 * n) + [(0, cluster.units[k].size) for k in keys]
    cost = np.zeros(nv)
    cost[0] = 1.0
    res = linprog(
        cost,
        A_ub=np.array(rows),
        b_ub=np.array(rhs),
        bounds=bounds,
        method="highs",
        options={"primal_feasibility_tolerance": 1e-10, "dual_feasibility_tolerance": 1e-10},
    )
    assert res.status == 0, res.message
    return 1.0 / res.x[0]


def test_exact_maxmin_matches_lp_on_200_random_instances() -> None:
    rng = random.Random(20230509)
    for _ in range(200):
        jobs, cluster = random_instance(rng)
        e = equal_share_perf(jobs, cluster, SiloDEstimator())
        lam, cache = maxmin_level(jobs, cluster, e)
        expected = lp_level(jobs, cluster, e)
        assert lam == pytest.approx(expected, rel=1e-6)
        # and the allocation behind lam is feasible: it is not just the right number
        for pool, cap in cluster.pools.items():
            assert sum(c for k, c in cache.items() if cluster.units[k].pool == pool) <= cap * (
                1 + 1e-9
            )
        io = sum(lam * e[j.name] * (1 - hit_ratio(j, cache, cluster)) for j in jobs)
        assert io <= cluster.remote_io * (1 + 1e-9)
        gpus = sum(lam * e[j.name] / j.f_star * j.gpus for j in jobs)
        assert gpus <= cluster.total_gpus * (1 + 1e-9)
        # progressive filling never lowers anyone below the Eq. 9 level
        filled = maxmin(jobs, cluster, e)
        assert filled.level == pytest.approx(lam, rel=1e-12)
        for job in jobs:
            assert filled.rates[job.name] >= lam * e[job.name] * (1 - 1e-9)
        assert_feasible(jobs, cluster, filled.rates, filled.cache)


def assert_feasible(jobs: list[Job], cluster: Cluster, rates: dict, cache: dict) -> None:
    for pool, cap in cluster.pools.items():
        assert sum(c for k, c in cache.items() if cluster.units[k].pool == pool) <= cap * (1 + 1e-9)
    for key, held in cache.items():
        assert 0 <= held <= cluster.units[key].size * (1 + 1e-12)
    io = sum(rates[j.name] * (1 - hit_ratio(j, cache, cluster)) for j in jobs)
    assert io <= cluster.remote_io * (1 + 1e-7)
    assert sum(rates[j.name] / j.f_star * j.gpus for j in jobs) <= cluster.total_gpus * (1 + 1e-9)
    assert all(rates[j.name] <= j.f_star * (1 + 1e-9) for j in jobs)


def large_instance(n_jobs: int, seed: int) -> tuple[list[Job], Cluster]:
    """A live-controller-shaped instance: n_jobs jobs, n_jobs/10 datasets, n_jobs/8 nodes
    each its own pool, a tenth of the jobs spread over two nodes; MB/s and GB."""
    rng = random.Random(seed)
    n_pools, n_data = n_jobs // 8, n_jobs // 10
    pools = {f"p{i}": rng.uniform(500, 4000) for i in range(n_pools)}
    sizes = {f"d{i}": rng.uniform(100, 2000) for i in range(n_data)}
    units: dict[str, CacheUnit] = {}
    jobs = []
    for i in range(n_jobs):
        ds = f"d{rng.randrange(n_data)}"
        first = rng.randrange(n_pools)
        where = [f"p{first}"] + ([f"p{(first + 1) % n_pools}"] if rng.random() < 0.1 else [])
        reads = {}
        for pool in where:
            key = f"{pool}|{ds}"
            units[key] = CacheUnit(key, pool, ds, sizes[ds])
            reads[key] = 1.0 / len(where)
        gpus = rng.choice([1, 1, 2, 4, 8])
        jobs.append(Job(f"j{i}", ds, gpus, gpus * rng.uniform(10, 120), reads))
    demand = sum(j.f_star for j in jobs)
    cluster = Cluster({"all": 8 * n_pools}, {"all": sum(pools.values())}, demand / 5, pools, units)
    return jobs, cluster


def sparse_lp_level(jobs: list[Job], cluster: Cluster, e: dict[str, float]) -> float:
    """lp_level's program with a sparse constraint matrix (thousands of variables)."""
    from scipy.sparse import coo_matrix

    keys = sorted(cluster.units)
    index = {k: u for u, k in enumerate(keys)}
    n, m = len(jobs), len(keys)
    nv = 1 + 2 * n + m
    data: list[float] = []
    rows: list[int] = []
    cols: list[int] = []
    rhs: list[float] = []

    def add(coefs: dict[int, float], bound: float) -> None:
        for k, v in coefs.items():
            rows.append(len(rhs))
            cols.append(k)
            data.append(v)
        rhs.append(bound)

    for j, job in enumerate(jobs):
        add({1 + j: -job.f_star}, -e[job.name])
        add({1 + j: 1.0, 0: -1.0}, 0.0)
        miss = {
            1 + 2 * n + index[k]: -e[job.name] * w / cluster.units[k].size
            for k, w in job.reads.items()
        }
        add({**miss, 1 + n + j: -1.0}, -e[job.name] * sum(job.reads.values()))
    add({**{1 + j: float(job.gpus) for j, job in enumerate(jobs)}, 0: -cluster.total_gpus}, 0.0)
    add({**{1 + n + j: 1.0 for j in range(n)}, 0: -cluster.remote_io}, 0.0)
    for pool, cap in cluster.pools.items():
        add({1 + 2 * n + u: 1.0 for u, k in enumerate(keys) if cluster.units[k].pool == pool}, cap)
    a_ub = coo_matrix((data, (rows, cols)), shape=(len(rhs), nv)).tocsr()
    bounds = [(0, None)] * (1 + 2 * n) + [(0, cluster.units[k].size) for k in keys]
    cost = np.zeros(nv)
    cost[0] = 1.0
    res = linprog(
        cost,
        A_ub=a_ub,
        b_ub=np.array(rhs),
        bounds=bounds,
        method="highs",
        options={"primal_feasibility_tolerance": 1e-10, "dual_feasibility_tolerance": 1e-10},
    )
    assert res.status == 0, res.message
    return 1.0 / res.x[0]


def reference_maxmin(jobs: list[Job], cluster: Cluster, e: dict[str, float]) -> dict[str, float]:
    """Progressive filling one round at a time, every round solving the knapsack: the
    plain form of policies/gavel.py's maxmin, before ceiling rounds were taken in bulk."""
    from silofs_ctl.policies.gavel import _binding, _gpu_limit, _io_limit, _Loads

    live = [j for j in jobs if e.get(j.name, 0.0) > 0 and j.f_star > 0]
    fixed = {j.name: 0.0 for j in jobs if j not in live}
    free, lam = list(live), 0.0
    while free:
        loads = _Loads(jobs, fixed, e)
        lam_io = _io_limit(loads, cluster, lam)
        lam_gpu = _gpu_limit(free, fixed, e, jobs, cluster.total_gpus)
        caps = {j.name: j.f_star / e[j.name] for j in free}
        lam = max(lam, min(lam_io, lam_gpu, min(caps.values())))
        frozen = _binding(free, caps, lam, lam_io, lam_gpu, loads, cluster)
        for job in frozen:
            fixed[job.name] = min(job.f_star, lam * e[job.name])
        names = {j.name for j in frozen}
        free = [j for j in free if j.name not in names]
    return fixed


@pytest.mark.slow
@pytest.mark.parametrize("io_scale", [1.0, 0.05])
def test_fast_maxmin_at_1000_jobs_matches_lp_and_round_by_round_filling(io_scale: float) -> None:
    """The bulk ceiling rounds change nothing: the level is the LP's, every job's rate is
    the plain round-by-round loop's, and the allocation is feasible."""
    jobs, cluster = large_instance(1000, seed=12)
    from dataclasses import replace

    cluster = replace(cluster, remote_io=cluster.remote_io * io_scale)
    e = equal_share_perf(jobs, cluster, SiloDEstimator())
    fast = maxmin(jobs, cluster, e)
    assert fast.level == pytest.approx(sparse_lp_level(jobs, cluster, e), rel=1e-6)
    slow = reference_maxmin(jobs, cluster, e)
    assert fast.rates.keys() == slow.keys()
    for name, rate in slow.items():
        assert fast.rates[name] == pytest.approx(rate, rel=1e-12, abs=1e-12)
    assert_feasible(jobs, cluster, fast.rates, fast.cache)


@pytest.mark.parametrize("n_jobs", [16, 300])
def test_fixed_hit_problems_solve_the_same_with_the_one_division_model(
    n_jobs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The problem Gavel's SiloD form solves for the hits now (every job alone on a unit
    that cannot move) has a shortcut for its IO limit; it must give every job the same
    rate, to the last bit, as the general knapsack model does."""
    from silofs_ctl.policies import gavel

    rng = random.Random(n_jobs)
    for _ in range(20):
        jobs, cluster = large_instance(n_jobs, rng.randrange(10**6))
        hits = {j.name: rng.choice([0.0, 1.0, rng.random()]) for j in jobs}
        now_jobs, now_cluster = gavel.with_fixed_hits(jobs, cluster, hits)
        e = equal_share_perf(jobs, cluster, SiloDEstimator())
        assert gavel._FixedHits.applies(now_jobs, now_cluster)
        fast = maxmin(now_jobs, now_cluster, e)
        with monkeypatch.context() as m:
            m.setattr(gavel._FixedHits, "applies", staticmethod(lambda jobs, cluster: False))
            general = maxmin(now_jobs, now_cluster, e)
        assert fast.rates == general.rates
        assert fast.level == general.level


@pytest.mark.parametrize("n_jobs", [16, 300])
def test_fixed_hits_solve_without_building_the_problem_is_the_same_to_the_bit(
    n_jobs: int,
) -> None:
    """maxmin_fixed_hits is maxmin of with_fixed_hits' problem, made without its jobs and
    cluster: every rate, the level and the cache must be the same floats."""
    from silofs_ctl.policies import gavel

    rng = random.Random(n_jobs + 1)
    for _ in range(20):
        jobs, cluster = large_instance(n_jobs, rng.randrange(10**6))
        hits = {j.name: rng.choice([0.0, 1.0, rng.random()]) for j in jobs}
        e = equal_share_perf(jobs, cluster, SiloDEstimator())
        built = maxmin(*gavel.with_fixed_hits(jobs, cluster, hits), e)
        direct = gavel.maxmin_fixed_hits(jobs, cluster, hits, e)
        assert list(direct.rates.items()) == list(built.rates.items())
        assert direct.level == built.level
        assert direct.cache == built.cache


@pytest.mark.parametrize("n_jobs", [8, 40, 300])
def test_the_array_form_of_a_plan_for_the_hits_now_is_the_loops_to_the_bit(
    n_jobs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GavelPolicy's SiloD plan is solved with array operations from ARRAYS_FROM jobs
    on (the steady state when the units share one pool, and the plan for the hits now):
    every share, IO allocation and cached unit must be the same floats, in the same
    order, as the loops give, whether IO, GPUs or the jobs' ceilings bind, with an
    unlimited link, jobs without f* and a spare link to hand out; and with some jobs
    that do not say their hit ratio now (then it is the cache's as filled)."""
    from dataclasses import replace

    from silofs_ctl.policies import gavel

    rng = random.Random(n_jobs + 7)
    for trial in range(24):
        jobs, cluster = large_instance(max(n_jobs, 10), rng.randrange(10**6))
        jobs = jobs[:n_jobs]
        if trial % 3:  # one pool, as the simulator's cluster: the knapsack in arrays
            pool = {"all": sum(cluster.pools.values()) * rng.choice([0.02, 0.3, 1.0, 3.0])}
            units = {k: replace(u, pool="all") for k, u in cluster.units.items()}
            cluster = replace(cluster, pools=pool, units=units)
        link = [cluster.remote_io, cluster.remote_io / 20, cluster.remote_io * 50, math.inf]
        gpus = {"all": rng.choice([8, cluster.total_gpus, 4 * cluster.total_gpus])}
        cluster = replace(cluster, remote_io=link[trial % 4], node_gpus=gpus, cached={})
        views = []
        for job in jobs:
            f_star = 0.0 if rng.random() < 0.05 else job.f_star
            hit = rng.choice([0.0, 1.0, 1.0 - 1e-12, rng.random()])
            if trial % 4 == 1 and rng.random() < 0.2:
                hit = None
            views.append(replace(job, f_star=f_star, hit_now=hit))
        out = []
        for first in (10**9, 0):
            monkeypatch.setattr(gavel, "ARRAYS_FROM", first)
            policy = gavel.GavelPolicy()
            alloc = policy.allocate(views, cluster, SiloDEstimator())
            assert policy._steady is not None
            steady = policy._steady.plan  # its rates and level too, not only its cache
            out.append(
                (
                    list(alloc.gpu_share.items()),
                    list(alloc.io.items()),
                    list(alloc.cache.items()),
                    steady.rates,
                    steady.level,
                )
            )
        assert out[0] == out[1]


@pytest.mark.parametrize("n_jobs", [8, 40, 300])
def test_the_array_form_of_the_vanilla_plan_is_the_loops_to_the_bit(
    n_jobs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gavel's vanilla form without its closed form (the simulator's Alluxio runs) is
    solved with array operations from ARRAYS_FROM jobs on: every share, rate and e, and
    the level, must be the same floats in the same order as the loops give, whether the
    GPUs or the jobs' ceilings bind, with jobs without f*, without GPUs, and many equal
    ceilings (a job's ceiling is a function of its GPU count: ties go by name)."""
    from dataclasses import replace

    from silofs_ctl.estimator import ComputeEstimator
    from silofs_ctl.policies import gavel

    rng = random.Random(n_jobs + 11)
    for trial in range(24):
        jobs, cluster = large_instance(max(n_jobs, 10), rng.randrange(10**6))
        views = []
        for job in jobs[:n_jobs]:
            f_star = 0.0 if rng.random() < 0.05 else job.f_star
            gpus = 0 if rng.random() < 0.03 else job.gpus
            views.append(replace(job, f_star=f_star, gpus=gpus))
        total = max(1, int(sum(j.gpus for j in views) * rng.choice([0.05, 0.4, 0.9, 1.0, 3.0])))
        cluster = replace(cluster, node_gpus={"all": total}, remote_io=[1e3, math.inf][trial % 2])
        out = []
        for first in (10**9, 0):
            monkeypatch.setattr(gavel, "ARRAYS_FROM", first)
            policy = gavel.GavelPolicy(closed_form=False)
            alloc = policy.allocate(views, cluster, ComputeEstimator())
            assert policy._steady is not None
            steady = policy._steady
            out.append(
                (
                    list(alloc.gpu_share.items()),
                    alloc.cache,
                    alloc.io,
                    list(steady.e.items()),
                    sorted(steady.plan.rates.items()),
                    steady.plan.level,
                )
            )
        assert out[0] == out[1]
        assert 0 < sum(share > 0 for _, share in out[0][0])


def test_the_array_form_groups_ceilings_as_the_search_does() -> None:
    """gavel_arrays._groups takes runs of equal ceilings as the groups unless some
    ceiling lies within the tolerance above a smaller one; either way its groups must
    be gavel._groups', levels and ends, with near-ties and equal ceilings mixed in."""
    from silofs_ctl.policies import gavel, gavel_arrays

    rng = random.Random(3)
    near = [1.0, 2.0, 2.0 * (1 + 5e-10), 3.0, 3.0 * (1 + 2e-9)]
    for _ in range(500):
        caps = sorted(rng.choice([*near, rng.uniform(1, 4)]) for _ in range(rng.randint(0, 40)))
        jobs = [Job(f"j{i}", "d", 1, 1.0, {"u": 1.0}) for i in range(len(caps))]
        expected = gavel._groups(jobs, {job.name: cap for job, cap in zip(jobs, caps, strict=True)})
        levels, ends = gavel_arrays._groups(np.array(caps, dtype=float), gavel._TOL)
        assert list(zip(levels.tolist(), ends.tolist(), strict=True)) == expected


def test_ceiling_ties_ranked_by_kept_name_ranks_sort_as_by_the_names() -> None:
    """gavel_arrays.NameRanks, kept over plans whose jobs come and go (new names landing
    between old ones until a gap is used up and every name is numbered again), must
    order ceiling ties exactly as a lexsort of the names themselves does."""
    from silofs_ctl.policies import gavel_arrays

    rng = random.Random(5)
    ranks = gavel_arrays.NameRanks()
    ranks.SPACING = 4  # (gaps run out after two halvings: renumbering is exercised)
    pool = [f"{rng.choice(['resnet50', 'bert', 'vlad', 'b'])}-{rng.randint(0, 999):03d}"
            for _ in range(400)]  # fmt: skip
    active: list[str] = []
    for _ in range(300):
        active = [n for n in active if rng.random() > 0.1] + rng.sample(pool, rng.randint(0, 6))
        if not active:
            continue
        caps = np.array([rng.choice([1.0, 2.0, rng.uniform(1, 3)]) for _ in active])
        live = np.arange(len(active))[rng.random() < 0.5 :]  # (all, or from the second)
        by_name = np.lexsort((np.array(active)[live], caps[live]))
        by_rank = np.lexsort((ranks.of(active)[live], caps[live]))
        assert by_rank.tolist() == by_name.tolist()
    in_order = ranks.of(sorted(set(pool))).tolist()
    assert all(a < b for a, b in zip(in_order, in_order[1:], strict=False))


def test_hits_now_take_the_array_path_only_when_every_one_is_a_float() -> None:
    """gavel_arrays.floats decides whether a plan's hits now are all given (the array
    path) or some job says nothing (None: the general path): a None, or any value the
    array would not hold as a float, must send it to the general path."""
    from silofs_ctl.policies import gavel_arrays

    got = gavel_arrays.floats([0.25, 1, 0.0])
    assert got is not None and got.tolist() == [0.25, 1.0, 0.0]
    assert gavel_arrays.floats([0.25, None, 0.5]) is None
    assert gavel_arrays.floats([None]) is None
    assert gavel_arrays.floats([1, 0]) is None  # (ints alone: the general path, same result)


def test_the_array_form_of_the_equal_cache_is_the_loops_to_the_bit() -> None:
    """gavel_arrays.equal_unit_cache (every job reads one unit, one pool: the
    simulator's cluster) must give each unit the floats estimator._equal_cache adds up
    one reader at a time: units a few readers fill past their size, units they do not,
    a pool that fills nothing and one that fills everything; and reads_of's arrays of
    such jobs (each its own read) must be their reads."""
    from silofs_ctl.estimator import _equal_cache
    from silofs_ctl.policies import gavel, gavel_arrays

    rng = random.Random(11)
    checked = capped = 0
    for trial in range(200):
        n_units = rng.randint(1, 30)
        sizes = {f"u{i}": rng.choice([rng.uniform(1, 3000), 140.0, 1e-3]) for i in range(n_units)}
        units = {key: CacheUnit(key, "all", key, size) for key, size in sizes.items()}
        jobs = [
            Job(f"j{i}", "d", 1, 10.0, {rng.choice(list(units)): rng.choice([1.0, rng.random()])})
            for i in range(rng.randint(1, 300))
        ]
        capacity = rng.choice([0.0, rng.uniform(1, 50_000), 1e9]) if trial % 5 else 0.1 * trial
        cluster = Cluster({"all": 8}, {"all": capacity}, 100.0, {"all": capacity}, units)
        names = [job.name for job in jobs]
        reads = gavel_arrays.reads_of(
            names, [j.f_star for j in jobs], [j.gpus for j in jobs], [j.reads for j in jobs], units
        )
        assert gavel._one_pool(reads.keys, cluster) == capacity
        # (reads_of's one-read-a-job form: each job its own read, its weight its value)
        assert reads.r_job.tolist() == reads.first_read.tolist() == list(range(len(jobs)))
        assert reads.r_w.tolist() == [next(iter(job.reads.values())) for job in jobs]
        assert [reads.keys[u] for u in reads.r_unit.tolist()] == [next(iter(j.reads)) for j in jobs]
        equal = _equal_cache(jobs, cluster)
        got = gavel_arrays.equal_unit_cache(reads, capacity).tolist()
        assert got == [equal[key] for key in reads.keys]
        checked += len(got)
        capped += sum(held == units[key].size for key, held in zip(reads.keys, got, strict=True))
    assert capped and capped < checked  # (both sides of the cap were exercised)
