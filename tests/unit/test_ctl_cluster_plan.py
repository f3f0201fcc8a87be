"""The controller's plan when nodes form a cluster: one cache pool per dataset.

In-process fake daemons answer like clustered ones: a cache PUT sets the dataset's
cluster-wide share in the one table the members hold alike (the daemon passes it on to
the others; here they share it), status lists it under "cluster". Checked: what is
planned and what is pushed, to which node, for clustered, standalone, mixed and
two-cluster nodes, and that a second round pushes nothing.
"""

from __future__ import annotations

import pytest
from silofs_ctl.controller_cmd import render_plan
from silofs_ctl.controller_config import ControllerConfig, JobEntry, NodeConfig
from silofs_ctl.observe import parse_status
from silofs_ctl.plan import build_problem

from tests.unit.test_ctl_controller import IMAGENET, MB, TB, WIKI, FakeNode, controller

GB = 10**9


class Shares:
    """The table of cache shares one cluster's members hold alike."""

    def __init__(self) -> None:
        self.version = 0
        self.shares: dict[str, int | None] = {}


class FakeMember(FakeNode):
    """A clustered daemon: a cache PUT is the dataset's cluster-wide share."""

    def __init__(
        self, name: str, cache_size: int, cluster: str, table: Shares, weight: float = 1.0
    ) -> None:
        super().__init__(name, cache_size)
        self.cluster, self.table, self.weight = cluster, table, weight
        self.members: list[FakeMember] = []
        self.held: dict[str, int] = {}  # bytes it holds per dataset, as a home

    def status(self) -> dict:
        out = super().status()
        out["cluster"] = {
            "name": self.cluster,
            "address": f"tls://{self.name}:7470",
            "members": [
                {"address": f"tls://{m.name}:7470", "weight": m.weight, "self": m is self}
                for m in self.members
            ],
            "allocations_version": self.table.version,
            "shares": dict(self.table.shares),
            "datasets": [{"uri": u, "cached_bytes": b} for u, b in self.held.items()],
        }
        return out

    def put_cache(self, dataset: str, nbytes: int) -> None:
        self._check()
        self.puts.append(("cache", dataset, nbytes))
        self.table.shares[dataset] = nbytes
        self.table.version += 1


def cluster_of(*members: FakeMember) -> None:
    for m in members:
        m.members = list(members)


def cfg(*names: str, cache: int = 1 * TB, policy: str = "gavel") -> ControllerConfig:
    nodes = tuple(NodeConfig(n, f"/run/{n}.sock", gpus=4, cache=cache) for n in names)
    return ControllerConfig(policy=policy, remote_io=100 * MB, nodes=nodes)


ENTRIES = [
    JobEntry("dist", IMAGENET, gpus=8, ideal_io=912 * MB),
    JobEntry("local", WIKI, gpus=1, ideal_io=20 * MB),
]


def datasets_and_jobs(nodes: dict[str, FakeNode]) -> None:
    """imagenet (1.3 TB) read by "dist" on n1 and n2; wiki (100 GB) by "local" on n1."""
    for name in ("n1", "n2"):
        nodes[name].add_dataset(IMAGENET, 1300 * GB)
        nodes[name].add_job("dist", IMAGENET)
    nodes["n1"].add_dataset(WIKI, 100 * GB)
    nodes["n1"].add_job("local", WIKI)


def clustered(*names: str, weights: tuple[float, ...] | None = None) -> dict[str, FakeNode]:
    table = Shares()
    weights = weights or tuple(1.0 for _ in names)
    members = [FakeMember(n, 1 * TB, "c", table, w) for n, w in zip(names, weights, strict=True)]
    cluster_of(*members)
    return {m.name: m for m in members}


def cache_puts(node: FakeNode) -> list[tuple]:
    return [p for p in node.puts if p[0] == "cache"]


def test_standalone_nodes_cache_a_dataset_read_on_two_nodes_twice() -> None:
    nodes = {n: FakeNode(n, 1 * TB) for n in ("n1", "n2")}
    datasets_and_jobs(nodes)
    plan = controller(nodes, cfg("n1", "n2"), ENTRIES).round(force=True)
    assert plan is not None and plan.clusters == {}
    # k copies: imagenet is allocated on each node out of that node's own terabyte
    on_n1 = nodes["n1"].datasets[IMAGENET]["cache_allocation"]
    on_n2 = nodes["n2"].datasets[IMAGENET]["cache_allocation"]
    assert on_n1 > 0 and on_n2 > 0
    assert on_n1 + nodes["n1"].datasets[WIKI]["cache_allocation"] <= 1 * TB
    assert on_n2 <= 1 * TB < 1300 * GB  # neither node can hold it whole


def test_a_cluster_caches_a_dataset_once_in_the_pool_of_its_members() -> None:
    nodes = clustered("n1", "n2")
    datasets_and_jobs(nodes)
    ctl = controller(nodes, cfg("n1", "n2"), ENTRIES)
    plan = ctl.round(force=True)
    assert plan is not None
    c = plan.clusters["c"]
    assert (c.members, c.via, c.pool) == (("n1", "n2"), "n1", 2 * TB)
    # one copy of each dataset in the pooled 2 TB: both fit whole
    want = {IMAGENET: 1300 * GB, WIKI: 100 * GB}
    assert plan.cache["n1"] == plan.cache["n2"] == want
    # pushed once, to the via member; the other gets only its job's IO
    assert sorted(cache_puts(nodes["n1"])) == sorted(("cache", u, b) for u, b in want.items())
    assert cache_puts(nodes["n2"]) == []
    assert nodes["n2"].jobs["dist"]["io_allocation"] == nodes["n1"].jobs["dist"]["io_allocation"]
    # every member's status now shows the cluster-wide shares; nothing more to push
    for node in nodes.values():
        assert node.status()["cluster"]["shares"] == want
    before = [len(n.puts) for n in nodes.values()]
    ctl.round(force=True)
    assert [len(n.puts) for n in nodes.values()] == before


def test_one_unit_per_dataset_in_the_cluster_and_a_job_reads_it_whole() -> None:
    nodes = clustered("n1", "n2")
    datasets_and_jobs(nodes)
    seen = {n: parse_status(n, node.status()) for n, node in nodes.items()}
    jobs, cluster, _ = build_problem(cfg("n1", "n2"), ENTRIES, seen, {})
    dist = next(j for j in jobs if j.name == "dist")
    assert dist.reads == {f"cluster:c|{IMAGENET}": 1.0}
    assert dist.placement == {"n1": 4, "n2": 4}
    assert set(cluster.pools) == {"cluster:c"}
    assert cluster.node_cache == {"n1": 1 * TB, "n2": 1 * TB}


def test_the_cluster_hit_ratio_counts_what_every_member_holds() -> None:
    nodes = clustered("n1", "n2")
    datasets_and_jobs(nodes)
    for name in ("n1", "n2"):
        nodes[name].held[IMAGENET] = 300 * GB  # each home holds its half of 600 GB
        # each node's effective cache is what it holds itself
        nodes[name].jobs["dist"]["effective_cache"] = 300 * GB
    seen = {n: parse_status(n, node.status()) for n, node in nodes.items()}
    jobs, cluster, _ = build_problem(cfg("n1", "n2"), ENTRIES, seen, {})
    dist = next(j for j in jobs if j.name == "dist")
    assert cluster.cached[f"cluster:c|{IMAGENET}"] == 600 * GB
    assert dist.hit_now == pytest.approx(600 / 1300)


def test_unequal_weights_the_member_whose_part_fills_first_bounds_the_pool() -> None:
    # n2 holds 3/4 of every share in 1 TB: shares may add up to 4/3 TB, not 2 TB
    nodes = clustered("n1", "n2", weights=(1.0, 3.0))
    datasets_and_jobs(nodes)
    plan = controller(nodes, cfg("n1", "n2"), ENTRIES).round(force=True)
    assert plan is not None
    assert plan.clusters["c"].pool == pytest.approx(4 / 3 * TB)
    assert sum(plan.cache["n1"].values()) <= 4 / 3 * TB + 2
    assert sum(plan.cache["n1"].values()) * 3 / 4 <= 1 * TB + 2


def test_a_members_allocation_of_its_own_takes_room_from_the_pool() -> None:
    nodes = clustered("n1", "n2")
    datasets_and_jobs(nodes)
    nodes["n2"].add_dataset("s3://data/old/", 10 * GB)
    nodes["n2"].datasets["s3://data/old/"]["cache_allocation"] = 500 * GB  # pre-cluster
    plan = controller(nodes, cfg("n1", "n2"), ENTRIES).round(force=True)
    assert plan is not None
    assert plan.clusters["c"].pool == pytest.approx(1 * TB)  # n2's 500 GB left, x2


def test_when_the_via_member_is_down_the_next_one_gets_the_shares() -> None:
    nodes = clustered("n1", "n2", "n3")
    datasets_and_jobs(nodes)
    nodes["n1"].down = True
    plan = controller(nodes, cfg("n1", "n2", "n3"), ENTRIES).round(force=True)
    assert plan is not None
    c = plan.clusters["c"]
    assert (c.members, c.via) == (("n2", "n3"), "n2")
    assert cache_puts(nodes["n2"]) and not cache_puts(nodes["n3"])
    # shares count the down member's weight: the pool is 3 x the smallest part's room
    assert c.pool == 3 * TB


def test_mixed_a_job_on_a_clustered_and_a_standalone_node_reads_half_through_each() -> None:
    nodes = clustered("n1", "n2")
    nodes["n3"] = FakeNode("n3", 1 * TB)
    datasets_and_jobs(nodes)
    nodes["n3"].add_dataset(IMAGENET, 1300 * GB)
    nodes["n3"].add_job("dist", IMAGENET)
    seen = {n: parse_status(n, node.status()) for n, node in nodes.items()}
    config = cfg("n1", "n2", "n3")
    jobs, cluster, _ = build_problem(config, ENTRIES, seen, {})
    dist = next(j for j in jobs if j.name == "dist")
    assert dist.reads == pytest.approx({f"cluster:c|{IMAGENET}": 2 / 3, f"n3|{IMAGENET}": 1 / 3})
    assert cluster.pools == {"cluster:c": 2 * TB, "n3": 1 * TB}
    plan = controller(nodes, config, ENTRIES).round(force=True)
    assert plan is not None
    # the standalone node gets its own allocation; the cluster's goes to n1 only
    assert nodes["n3"].datasets[IMAGENET]["cache_allocation"] == plan.cache["n3"][IMAGENET]
    assert cache_puts(nodes["n1"]) and not cache_puts(nodes["n2"])
    rates = {n: nodes[n].jobs["dist"]["io_allocation"] for n in ("n1", "n2", "n3")}
    assert len(set(rates.values())) == 1  # IO still split evenly over its 3 nodes


def two_clusters(a_name: str, b_name: str) -> tuple[Shares, Shares, list[FakeMember]]:
    """n1, n2 in cluster `a_name`, n3, n4 in `b_name`, each its own shares table; every
    node has IMAGENET open."""
    a, b = Shares(), Shares()
    m = [FakeMember("n1", TB, a_name, a), FakeMember("n2", TB, a_name, a)]
    m += [FakeMember("n3", TB, b_name, b), FakeMember("n4", TB, b_name, b)]
    cluster_of(m[0], m[1])
    cluster_of(m[2], m[3])
    for x in m:
        x.add_dataset(IMAGENET, 1300 * GB)
    return a, b, m


def test_two_clusters_are_two_pools_each_pushed_through_its_own_member() -> None:
    a, b, m = two_clusters("a", "b")
    nodes = {x.name: x for x in m}
    for x in m[:2]:
        x.add_job("dist", IMAGENET)
    for x in m[2:]:
        x.add_job("other", IMAGENET)
    entries = [*ENTRIES[:1], JobEntry("other", IMAGENET, gpus=8, ideal_io=500 * MB)]
    plan = controller(nodes, cfg("n1", "n2", "n3", "n4"), entries).round(force=True)
    assert plan is not None
    assert {c.name: (c.via, c.pool) for c in plan.clusters.values()} == {
        "a": ("n1", 2 * TB),
        "b": ("n3", 2 * TB),
    }
    # one copy per cluster: the same dataset read in each is cached in each
    assert a.shares == b.shares == {IMAGENET: 1300 * GB}
    assert not cache_puts(nodes["n2"]) and not cache_puts(nodes["n4"])


def test_idle_datasets_in_a_cluster_keep_what_its_members_hold() -> None:
    nodes = clustered("n1", "n2")
    datasets_and_jobs(nodes)
    # nobody reads "old" any more; the cluster holds 40 GB of it, on n2 only, where it
    # is not even open (held for a member)
    nodes["n2"].held["s3://data/old/"] = 40 * GB
    plan = controller(nodes, cfg("n1", "n2"), ENTRIES).round(force=True)
    assert plan is not None
    assert plan.cache["n1"]["s3://data/old/"] == plan.cache["n2"]["s3://data/old/"] == 40 * GB


def test_the_table_lists_a_clusters_shares_once() -> None:
    nodes = clustered("n1", "n2")
    datasets_and_jobs(nodes)
    plan = controller(nodes, cfg("n1", "n2"), ENTRIES).round(dry_run=True, force=True)
    assert plan is not None
    text = render_plan(plan, {})
    assert sum(1 for line in text.splitlines() if IMAGENET in line) == 1
    assert any(line.startswith("c ") and IMAGENET in line for line in text.splitlines())
    assert "cluster c: one cache over n1, n2" in text and "pushed to n1" in text


def test_two_clusters_that_share_a_name_but_no_member_stay_two_pools() -> None:
    a, b, m = two_clusters("c", "c")
    nodes = {x.name: x for x in m}
    for x in m:
        x.add_job("dist", IMAGENET)
    plan = controller(nodes, cfg("n1", "n2", "n3", "n4"), ENTRIES[:1]).round(force=True)
    assert plan is not None
    assert {c.name: (c.members, c.via) for c in plan.clusters.values()} == {
        "c": (("n1", "n2"), "n1"),
        "c~2": (("n3", "n4"), "n3"),
    }
    # each got the shares through its own member
    assert a.shares and b.shares and not cache_puts(nodes["n2"]) and not cache_puts(nodes["n4"])


def test_a_member_list_being_replaced_keeps_one_pool() -> None:
    nodes = clustered("n1", "n2", "n3")
    datasets_and_jobs(nodes)
    # n3 has taken a new list with n1, n3 and a new member; n1 and n2 still the old one
    n3 = nodes["n3"]
    assert isinstance(n3, FakeMember)
    n3.members = [nodes["n1"], n3, FakeMember("n9", TB, "c", n3.table)]  # type: ignore[list-item]
    plan = controller(nodes, cfg("n1", "n2", "n3"), ENTRIES).round(force=True)
    assert plan is not None
    assert [c.members for c in plan.clusters.values()] == [("n1", "n2", "n3")]
