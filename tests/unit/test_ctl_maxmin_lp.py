"""The exact SiloD max-min allocation (Eq. 9) against a generic LP solver.

Eq. 9 is bilinear in (lam, cache), but with mu = 1/lam, xi_j = x_j/lam and
beta_j = b_j/lam it becomes a linear program that knows nothing of the knapsack
structure policies/gavel.py exploits:

    min mu  s.t.  e_j <= xi_j f_j,  xi_j <= mu,  sum_j xi_j g_j <= G mu,
                  e_j * sum_u w_ju (1 - c_u/d_u) <= beta_j,  sum_j beta_j <= B mu,
                  sum_{u in p} c_u <= C_p,  0 <= c_u <= d_u.
"""

from __future__ import annotations

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
