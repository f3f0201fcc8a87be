"""`silofs-ctl simulate` with one cache across the nodes vs a cache per node.

configs/scenarios/one-cache.toml: one 250 GB dataset read by three one-GPU jobs on three
nodes of 100 GB of cache each. One cache across the nodes holds the dataset once (300 GB
together): from the second epoch every job hits it all, and the link carries about one
dataset. Per-node caches hold a copy per node, 100 GB each at most: every job hits 0.4,
and the link carries each job's misses (3 x (250 + 3 x 150) GB = 2,100 GB).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from silofs_ctl.scenario import ScenarioError, load_scenario, parse_scenario
from silofs_ctl.simulator import SimulationError, simulate

SCENARIO = Path(__file__).resolve().parents[2] / "configs/scenarios/one-cache.toml"
GB = 10**9
D = 250 * GB


def per_node() -> str:
    text = SCENARIO.read_text()
    assert 'cache = "cluster"' in text
    return text.replace('cache = "cluster"', 'cache = "per-node"')


def remote(result) -> float:
    return sum(j.remote_bytes for j in result.jobs)


@pytest.mark.parametrize("scheduler", ["fifo", "sjf", "gavel"])
def test_one_cache_across_the_nodes_holds_a_dataset_read_on_three_nodes_once(
    scheduler: str,
) -> None:
    scenario = load_scenario(SCENARIO)
    assert not scenario.per_node
    result = simulate(scenario, scheduler, "silod")
    for job in result.jobs:
        assert job.epoch_hit_ratios[1:] == pytest.approx([1.0] * 3)
    assert remote(result) <= 1.1 * D


@pytest.mark.parametrize("scheduler", ["fifo", "sjf", "gavel"])
def test_per_node_caches_hold_a_copy_per_node(scheduler: str) -> None:
    scenario = parse_scenario(per_node(), "per-node.toml")
    assert scenario.per_node
    result = simulate(scenario, scheduler, "silod")
    for job in result.jobs:
        assert job.epoch_hit_ratios[1:] == pytest.approx([0.4] * 3)
    # the first epoch misses everything, then each job misses 60% of three epochs
    assert remote(result) == pytest.approx(3 * (D + 3 * 0.6 * D), rel=1e-6)
    cluster = simulate(load_scenario(SCENARIO), scheduler, "silod")
    assert cluster.avg_jct < result.avg_jct
    # the JSON says which it was: two results side by side are not mistaken
    assert result.to_dict()["node_caches"] == "per-node"
    assert cluster.to_dict()["node_caches"] == "cluster"


def test_per_node_caches_bound_each_copy_by_its_jobs_share_of_a_node() -> None:
    # Quiver caches whole datasets: 250 GB fits the cluster's 300 GB, no node's 100 GB.
    assert remote(simulate(load_scenario(SCENARIO), "fifo", "quiver")) <= 1.1 * D
    alone = simulate(parse_scenario(per_node(), "per-node.toml"), "fifo", "quiver")
    assert remote(alone) == pytest.approx(3 * 4 * D, rel=1e-6)


def test_coordl_is_per_job_either_way() -> None:
    shared = simulate(load_scenario(SCENARIO), "fifo", "coordl")
    alone = simulate(parse_scenario(per_node(), "per-node.toml"), "fifo", "coordl")
    assert remote(shared) == pytest.approx(remote(alone))


def test_alluxio_is_one_lru_across_the_nodes_and_refuses_per_node_caches() -> None:
    with pytest.raises(SimulationError, match="per-node"):
        simulate(parse_scenario(per_node(), "per-node.toml"), "fifo", "alluxio")


def test_an_unknown_cache_kind_is_refused_naming_its_line() -> None:
    text = SCENARIO.read_text().replace('cache = "cluster"', 'cache = "shared"')
    line = next(i for i, x in enumerate(text.splitlines(), 1) if x == 'cache = "shared"')
    with pytest.raises(ScenarioError, match=f'one-cache.toml:{line}: .*"cluster" or "per-node"'):
        parse_scenario(text, "one-cache.toml")
