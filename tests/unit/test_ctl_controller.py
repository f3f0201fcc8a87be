"""The controller against in-process fake nodes: planning, splitting, pushing, failures."""

from __future__ import annotations

import contextlib
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from click.testing import CliRunner
from silofs_ctl import job_cmd
from silofs_ctl.cli import main
from silofs_ctl.controller import Controller
from silofs_ctl.controller_cmd import render_plan
from silofs_ctl.controller_config import (
    ControllerConfig,
    JobEntry,
    NodeConfig,
    load_controller_config,
    load_jobs_file,
)
from silofs_ctl.nodes import NodeError
from silofs_ctl.observe import NodeSeen, RateTracker, parse_status
from silofs_ctl.plan import Plan, plan_allocations
from silofs_ctl.push import PushReport, push_plan
from silofs_ctl.tomlcheck import ConfigError

from silofs.units import format_rate

MB, GB, TB = 10**6, 10**9, 10**12
IMAGENET = "s3://data/imagenet/"
WIKI = "s3://data/wiki/"


class FakeNode:
    """Answers like a daemon: status reflects what was PUT; can be taken down."""

    def __init__(self, name: str, cache_size: int) -> None:
        self.name = name
        self.cache_size = cache_size
        self.datasets: dict[str, dict] = {}
        self.jobs: dict[str, dict] = {}
        self.puts: list[tuple] = []
        self.down = False

    def add_dataset(self, uri: str, size: int, cached: int = 0) -> None:
        short = uri.rstrip("/").rsplit("/", 1)[-1]
        self.datasets[uri] = {
            "name": short,
            "uri": uri,
            "size": size,
            "cached_bytes": cached,
            "cache_allocation": None,
            "hit_ratio": 0.0,
        }

    def add_job(self, name: str, uri: str, **fields: object) -> None:
        self.jobs[name] = {
            "name": name,
            "datasets": [uri],
            "io_allocation": None,
            "bytes_read": 0,
            "hit_ratio": 0.0,
            **fields,
        }

    def _check(self) -> None:
        if self.down:
            raise NodeError(f"cannot reach the silofs daemon at /run/{self.name}.sock")

    def status(self) -> dict:
        self._check()
        return {
            "node": {"cache_size": self.cache_size},
            "datasets": list(self.datasets.values()),
            "jobs": list(self.jobs.values()),
        }

    def put_cache(self, dataset: str, nbytes: int) -> None:
        self._check()
        self.puts.append(("cache", dataset, nbytes))
        self.datasets.setdefault(
            dataset, {"uri": dataset, "name": dataset, "size": 0, "cached_bytes": 0}
        )["cache_allocation"] = nbytes

    def put_io(self, job: str, rate: int | None) -> None:
        self._check()
        self.puts.append(("io", job, rate))
        if job in self.jobs:
            self.jobs[job]["io_allocation"] = rate


def config(policy: str = "gavel", io: float = 100 * MB, **kw: object) -> ControllerConfig:
    nodes = (
        NodeConfig("n1", "/run/n1.sock", gpus=4, cache=1 * TB),
        NodeConfig("n2", "/run/n2.sock", gpus=4, cache=1 * TB),
    )
    return ControllerConfig(policy=policy, remote_io=io, nodes=nodes, **kw)


def two_nodes() -> dict[str, FakeNode]:
    n1, n2 = FakeNode("n1", 1 * TB), FakeNode("n2", 1 * TB)
    for node in (n1, n2):
        node.add_dataset(IMAGENET, 1300 * GB)
        node.add_job("dist", IMAGENET)  # one job on both nodes
    n1.add_dataset(WIKI, 100 * GB)
    n1.add_job("local", WIKI)
    return {"n1": n1, "n2": n2}


def controller(
    nodes: dict[str, FakeNode], cfg: ControllerConfig, entries: list[JobEntry]
) -> Controller:
    ctl = Controller(cfg, factory=lambda node: nodes[node.name])
    ctl.entries = entries
    return ctl


ENTRIES = [
    JobEntry("dist", IMAGENET, gpus=8, ideal_io=912 * MB),
    JobEntry("local", "wiki", gpus=1, ideal_io=20 * MB),
]


def test_distributed_job_io_is_split_evenly_and_each_node_gets_its_datasets() -> None:
    nodes = two_nodes()
    ctl = controller(nodes, config(), ENTRIES)
    plan = ctl.round(force=True)
    assert plan is not None
    dist = next(j for j in plan.jobs if j.name == "dist")
    assert dist.nodes == ("n1", "n2")
    # both jobs read remotely now (nothing cached): the link is fully allocated, and
    # the distributed job's share is split evenly over its two nodes
    n1_io = nodes["n1"].jobs["dist"]["io_allocation"]
    n2_io = nodes["n2"].jobs["dist"]["io_allocation"]
    assert n1_io == n2_io == int(dist.io / 2)
    local_io = nodes["n1"].jobs["local"]["io_allocation"]
    assert local_io + n1_io + n2_io == pytest.approx(100 * MB, abs=2)
    # a short name in the jobs file resolves to the daemon's canonical URI
    assert nodes["n1"].datasets[WIKI]["cache_allocation"] == 100 * GB
    for node in nodes.values():
        cached = node.datasets[IMAGENET]["cache_allocation"]
        assert 0 < cached <= 1 * TB
        assert sum(d["cache_allocation"] for d in node.datasets.values()) <= 1 * TB
    # nothing changed: the next round pushes nothing
    before = [len(n.puts) for n in nodes.values()]
    ctl.round(force=True)
    assert [len(n.puts) for n in nodes.values()] == before


def test_a_node_that_is_down_does_not_stop_the_others_and_is_retried() -> None:
    nodes = two_nodes()
    nodes["n2"].down = True
    ctl = controller(nodes, config(), ENTRIES)
    ctl.round(force=True)
    assert "n2" in ctl.down and "cannot reach" in ctl.down["n2"]
    assert nodes["n1"].jobs["local"]["io_allocation"] is not None
    assert nodes["n2"].puts == []
    nodes["n2"].down = False
    # coming back changes the set of reachable nodes: the next poll re-plans by itself
    assert ctl.round() is not None
    assert "n2" not in ctl.down
    assert nodes["n2"].jobs["dist"]["io_allocation"] is not None


def test_a_job_the_node_does_not_list_is_pushed_once_not_every_round() -> None:
    # A job named in the jobs file for a node where it has no mount yet: the daemon
    # accepts its IO allocation but does not list it in its status.
    nodes = two_nodes()
    entries = [
        *ENTRIES,
        JobEntry("queued", WIKI, ideal_io=10 * MB, nodes=("n2",), dataset_size=100 * GB),
    ]
    ctl = controller(nodes, config(), entries)
    ctl.round(force=True)
    assert [p for p in nodes["n2"].puts if p[1] == "queued"] != []
    before = len(nodes["n2"].puts)
    ctl.round(force=True)
    assert len(nodes["n2"].puts) == before
    # after the node was unreachable it may have lost it: pushed again
    nodes["n2"].down = True
    ctl.round(force=True)
    nodes["n2"].down = False
    ctl.round()
    assert len([p for p in nodes["n2"].puts if p[1] == "queued"]) == 2


def test_a_node_failing_during_the_push_only_loses_its_own_updates() -> None:
    nodes = two_nodes()

    def flaky(dataset: str, nbytes: int) -> None:
        raise NodeError("the silofs daemon at /run/n2.sock did not answer")

    nodes["n2"].put_cache = flaky  # type: ignore[method-assign]
    ctl = controller(nodes, config(), ENTRIES)
    ctl.round(force=True)
    assert "did not answer" in ctl.not_updated["n2"]
    assert nodes["n1"].datasets[IMAGENET]["cache_allocation"] is not None


def test_a_refused_update_does_not_hold_back_the_nodes_other_updates() -> None:
    nodes = two_nodes()

    def refuse(dataset: str, nbytes: int) -> None:
        raise NodeError("no such dataset", unreachable=False)

    nodes["n1"].put_cache = refuse  # type: ignore[method-assign]
    ctl = controller(nodes, config(), ENTRIES)
    ctl.round(force=True)
    assert "no such dataset" in ctl.refused["n1"] and "n1" not in ctl.down
    assert nodes["n1"].jobs["local"]["io_allocation"] is not None
    assert nodes["n1"].jobs["dist"]["io_allocation"] is not None
    # what did not land is retried at the very next poll, not an interval later
    del nodes["n1"].put_cache
    assert ctl.round() is not None
    assert nodes["n1"].datasets[IMAGENET]["cache_allocation"] is not None
    assert ctl.not_updated == {}


def test_measured_throughput_replaces_a_missing_ideal_rate() -> None:
    nodes = two_nodes()
    entries = [JobEntry("dist", IMAGENET, gpus=8, ideal_io=912 * MB)]  # "local" has no f*
    ctl = controller(nodes, config(), entries)
    plan = ctl.round(force=True)
    assert plan is not None
    local = next(j for j in plan.jobs if j.name == "local")
    # out of the policy's problem, it gets its per-job share of the link set aside
    assert local.f_star is None and "shares what the policy leaves" in local.note
    assert local.io == pytest.approx(50 * MB, abs=2)
    assert nodes["n1"].jobs["local"]["io_allocation"] == int(local.io)
    # at its allocation, 45 MB/s says nothing of its f* (IO may be what holds it back)
    nodes["n1"].jobs["local"].update(throughput=45 * MB, remote_bytes_per_s=45 * MB)
    plan = ctl.round(force=True)
    assert plan is not None
    assert next(j for j in plan.jobs if j.name == "local").f_star is None
    # fetching 30 MB/s, well under its 50: that is its own speed, so its f*
    nodes["n1"].jobs["local"].update(throughput=30 * MB, remote_bytes_per_s=30 * MB)
    plan = ctl.round()
    assert plan is not None
    local = next(j for j in plan.jobs if j.name == "local")
    assert local.f_star == pytest.approx(30 * MB)
    assert nodes["n1"].jobs["local"]["io_allocation"] is not None


def test_jobs_without_f_star_share_the_rest_max_min_under_every_policy() -> None:
    nodes = two_nodes()
    nodes["n2"].add_dataset(WIKI, 100 * GB)
    nodes["n2"].add_job("new-a", WIKI)
    nodes["n2"].add_job("new-b", WIKI)
    seen = {name: parse_status(name, node.status()) for name, node in nodes.items()}
    for policy in ("gavel", "sjf", "fifo", "greedy"):
        plan = plan_allocations(config(policy, io=100 * MB), ENTRIES, seen, {})
        io = {p.name: p.io for p in plan.jobs}
        assert None not in io.values(), (policy, io)
        assert sum(io.values()) <= 100 * MB + 4, (policy, io)
        # the two unknown jobs are alike: equal shares, at least their set-aside 2/4
        assert io["new-a"] == pytest.approx(io["new-b"], abs=1), policy
        assert io["new-a"] + io["new-b"] >= 50 * MB - 2, (policy, io)


@pytest.mark.parametrize("policy", ["fifo", "greedy"])
def test_fifo_and_greedy_enforce_the_link_max_min_by_demand(policy: str) -> None:
    # FIFO and greedy allocate no IO: every job shares the link, up to what it can use.
    # "local" needs 20 MB/s and gets it; "dist" needs 912 and gets the remaining 80.
    nodes = two_nodes()
    seen = {name: parse_status(name, node.status()) for name, node in nodes.items()}
    plan = plan_allocations(config(policy, io=100 * MB), ENTRIES, seen, {})
    io = {p.name: p.io for p in plan.jobs}
    assert io["local"] == pytest.approx(20 * MB, abs=1)
    assert io["dist"] == pytest.approx(80 * MB, abs=1)
    assert plan.io["n1"]["dist"] == plan.io["n2"]["dist"] == int(io["dist"] / 2)
    # with no limit on the link nothing is throttled
    unlimited = plan_allocations(config(policy, io=math.inf), ENTRIES, seen, {})
    assert all(r is None for node in unlimited.io.values() for r in node.values())


def test_rate_tracker_counts_a_throttled_job_that_fetches_well_under_its_allocation() -> None:
    def status(rate: float, remote: float | None, alloc: float | None) -> dict:
        job = {"name": "j", "datasets": [WIKI], "io_allocation": alloc, "throughput": rate}
        if remote is not None:
            job["remote_bytes_per_s"] = remote
        return {"jobs": [job]}

    tracker = RateTracker()
    tracker.update({"n1": parse_status("n1", status(40 * MB, 40 * MB, 50 * MB))}, now=0.0)
    assert "j" not in tracker.ideal  # 80% of its allocation: maybe IO-bound
    tracker.update({"n1": parse_status("n1", status(70 * MB, 30 * MB, 50 * MB))}, now=10.0)
    assert tracker.ideal["j"] == pytest.approx(70 * MB)  # mostly hits, IO to spare
    # no remote rate reported: its throughput bounds it (all of it may be fetched)
    tracker.update({"n1": parse_status("n1", status(90 * MB, None, 100 * MB))}, now=20.0)
    assert tracker.ideal["j"] == pytest.approx(70 * MB)
    tracker.update({"n1": parse_status("n1", status(75 * MB, None, 100 * MB))}, now=30.0)
    assert tracker.ideal["j"] == pytest.approx(75 * MB)


def test_rate_tracker_measures_from_counters_when_status_has_no_rates() -> None:
    tracker = RateTracker()
    status = {
        "jobs": [
            {
                "name": "j",
                "datasets": [WIKI],
                "io_allocation": None,
                "bytes_read": 1000 * MB,
                "hit_ratio": 0.0,
            }
        ]
    }
    tracker.update({"n1": parse_status("n1", status)}, now=100.0)
    status["jobs"][0].update(bytes_read=1600 * MB, hit_ratio=0.25)  # 400 MB hit of 1600
    seen = {"n1": parse_status("n1", status)}
    tracker.update(seen, now=110.0)
    job = seen["n1"].jobs["j"]
    assert job.throughput == pytest.approx(60 * MB)  # 600 MB in 10 s
    assert job.hit_now == pytest.approx(400 / 600)  # the window's hits, not lifetime
    assert tracker.ideal["j"] == pytest.approx(60 * MB)
    # throttled, a lower rate does not lower the estimate
    status["jobs"][0].update(bytes_read=1700 * MB, io_allocation=5 * MB)
    tracker.update({"n1": parse_status("n1", status)}, now=120.0)
    assert tracker.ideal["j"] == pytest.approx(60 * MB)


def test_effective_cache_drives_the_io_plan() -> None:
    # Both nodes hold all of ImageNet, but "dist" began its epoch before it was cached:
    # its effective cache is 0, so it still needs IO for every read this epoch.
    nodes = two_nodes()
    for node in nodes.values():
        node.datasets[IMAGENET]["cached_bytes"] = 1300 * GB
        node.jobs["dist"]["effective_cache"] = 0
    cfg = config(io=100 * MB)
    seen = {name: parse_status(name, node.status()) for name, node in nodes.items()}
    cold = plan_allocations(cfg, ENTRIES, seen, {})
    for node in nodes.values():
        node.jobs["dist"]["effective_cache"] = 1300 * GB
    seen = {name: parse_status(name, node.status()) for name, node in nodes.items()}
    warm = plan_allocations(cfg, ENTRIES, seen, {})
    cold_io = {p.name: p.io for p in cold.jobs}
    warm_io = {p.name: p.io for p in warm.jobs}
    # cold: dist needs the link for every read, so the small job is squeezed below its
    # 20 MB/s; warm: dist needs no IO at all, and the small job gets all it can use
    assert cold_io["dist"] > 80 * MB and cold_io["local"] < 19 * MB
    assert warm_io["local"] == pytest.approx(20 * MB, abs=2)


def test_plan_without_any_node_reachable_uses_the_jobs_file() -> None:
    entries = [
        JobEntry("a", IMAGENET, gpus=1, ideal_io=114 * MB, nodes=("n1",), dataset_size=1300 * GB)
    ]
    plan = plan_allocations(config(), entries, {}, {})
    assert plan.cache["n1"] == {IMAGENET: 1 * TB}
    assert plan.io["n1"]["a"] == pytest.approx(100 * MB, abs=1)


@pytest.mark.parametrize(
    ("daemons", "written"),
    [
        ("s3://data/my data/", "s3://data/my%20data"),  # the daemon decodes %20
        ("file:///srv/%2541/", "/srv/%41"),  # a directory named %41, written as a path
        ("file:///srv/%2541/", "file:///srv/%2541"),
        ("s3://data/imagenet/", "S3://data/imagenet"),  # the daemon lowers the scheme
    ],
)
def test_a_jobs_file_dataset_matches_the_daemons_uri_as_the_daemon_parses_it(
    daemons: str, written: str
) -> None:
    """The jobs file's dataset was compared to the daemons' canonical URIs as written:
    s3://data/my%20data is the daemon's s3://data/my data/, and found no size (the job
    was out of the plan: "dataset size not known") and no cached bytes."""
    node = FakeNode("n1", 1 * TB)
    node.add_dataset(daemons, 500 * GB)  # mounted by a job that is not running yet
    seen = {"n1": parse_status("n1", node.status())}
    entries = [JobEntry("a", written, gpus=1, ideal_io=114 * MB, nodes=("n1",))]
    plan = plan_allocations(config(), entries, seen, {})
    (job,) = plan.jobs
    assert (job.dataset, job.note) == (daemons, "")
    assert plan.cache["n1"] == {daemons: 500 * GB}


def test_idle_datasets_keep_their_cache_while_there_is_room() -> None:
    nodes = two_nodes()
    nodes["n2"].add_dataset("s3://data/old/", 500 * GB, cached=300 * GB)
    seen = {name: parse_status(name, node.status()) for name, node in nodes.items()}
    plan = plan_allocations(config(), ENTRIES, seen, {})
    room = 1 * TB - plan.cache["n2"][IMAGENET]
    assert plan.cache["n2"]["s3://data/old/"] == min(300 * GB, room)


@pytest.mark.parametrize("policy", ["gavel", "sjf", "fifo", "greedy"])
def test_every_policy_plans_within_each_node_budget(policy: str) -> None:
    nodes = two_nodes()
    seen = {name: parse_status(name, node.status()) for name, node in nodes.items()}
    plan = plan_allocations(config(policy), ENTRIES, seen, {})
    for node in ("n1", "n2"):
        assert sum(plan.cache[node].values()) <= 1 * TB
    io = [r for node in plan.io.values() for r in node.values()]
    assert None not in io  # the link total holds under every policy
    assert sum(io) <= 100 * MB + 2


def test_dry_run_table_lists_nodes_jobs_and_splits() -> None:
    nodes = two_nodes()
    ctl = controller(nodes, config(), ENTRIES)
    plan = ctl.round(dry_run=True, force=True)
    assert plan is not None
    assert all(n.puts == [] for n in nodes.values())  # a dry run pushes nothing
    table = render_plan(plan, {"n3": "cannot reach"})
    assert IMAGENET in table and "dist" in table and "n1,n2" in table
    assert "node n3 not updated: cannot reach" in table


# ------------------------------------------------------------------ files


CONFIG = """\
policy = "gavel"
remote_io = "1GB/s"
interval = "30s"
jobs_file = "jobs.toml"

[[nodes]]
name = "n1"
socket = "{sock1}"
gpus = 8
cache = "1TiB"

[[nodes]]
name = "n2"
socket = "{sock2}"
"""

JOBS = """\
[[jobs]]
name = "dist"
dataset = "s3://data/imagenet/"
gpus = 8
ideal_io = "912MB/s"
nodes = ["n1", "n2"]
dataset_size = "1.3TB"
"""


def write_config(tmp_path: Path, text: str = CONFIG) -> str:
    (tmp_path / "jobs.toml").write_text(JOBS)
    path = tmp_path / "controller.toml"
    path.write_text(text.format(sock1=tmp_path / "n1.sock", sock2=tmp_path / "n2.sock"))
    return str(path)


def test_config_and_jobs_file_load(tmp_path: Path) -> None:
    cfg = load_controller_config(write_config(tmp_path))
    assert cfg.remote_io == 1e9 and cfg.interval == 30.0 and cfg.policy == "gavel"
    assert cfg.nodes[0].cache == 2**40 and cfg.nodes[1].cache is None
    assert cfg.jobs_file == str(tmp_path / "jobs.toml")
    (entry,) = load_jobs_file(cfg.jobs_file)
    assert entry.nodes == ("n1", "n2") and entry.dataset_size == 1.3e12


def test_config_mistakes_name_the_line(tmp_path: Path) -> None:
    text = CONFIG.replace("gpus = 8", "gpus = 8\ngpu_count = 8")
    with pytest.raises(ConfigError, match=r"controller.toml:10: unknown key 'gpu_count'"):
        load_controller_config(write_config(tmp_path, text))
    text = CONFIG.replace('policy = "gavel"', 'policy = "lottery"')
    with pytest.raises(ConfigError, match=r":1: unknown policy 'lottery'"):
        load_controller_config(write_config(tmp_path, text))


def test_a_broken_jobs_file_keeps_the_previous_jobs(tmp_path: Path) -> None:
    cfg = load_controller_config(write_config(tmp_path))
    ctl = Controller(cfg, factory=lambda node: FakeNode(node.name, TB))
    assert ctl.reload_jobs() and [e.name for e in ctl.entries] == ["dist"]
    assert not ctl.reload_jobs()  # unchanged
    (tmp_path / "jobs.toml").write_text(JOBS + "\nnodez = 1\n")
    assert not ctl.reload_jobs()
    assert [e.name for e in ctl.entries] == ["dist"]


def test_a_jobs_file_of_values_or_not_utf8_keeps_the_previous_jobs(tmp_path: Path) -> None:
    """`jobs = [1]` (TypeError) and a non-UTF-8 file (UnicodeDecodeError) escaped
    load_jobs_file: every poll of a running controller logged a traceback."""
    cfg = load_controller_config(write_config(tmp_path))
    ctl = Controller(cfg, factory=lambda node: FakeNode(node.name, TB))
    assert ctl.reload_jobs() and [e.name for e in ctl.entries] == ["dist"]
    jobs = tmp_path / "jobs.toml"
    jobs.write_text("jobs = [1]\n")
    with pytest.raises(ConfigError, match=r"jobs.toml:1: jobs must be a table, not 1$"):
        load_jobs_file(str(jobs))
    assert not ctl.reload_jobs() and [e.name for e in ctl.entries] == ["dist"]
    jobs.write_bytes(JOBS.replace("dist", "d\xefst").encode("latin-1"))
    with pytest.raises(ConfigError, match=r"jobs.toml: not UTF-8 text"):
        load_jobs_file(str(jobs))
    assert not ctl.reload_jobs() and [e.name for e in ctl.entries] == ["dist"]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            b'policy = "gavel"\nremote_io = "1GB/s"\nnodes = [1]\n',
            "controller.toml:3: nodes must be a table, not 1",
        ),
        (
            b'policy = "g\xe2vel"\n',
            "controller.toml: not UTF-8 text (byte 11: invalid continuation byte); "
            "TOML files are UTF-8",
        ),
    ],
)
def test_cli_config_of_values_or_not_utf8_is_one_line(
    tmp_path: Path, raw: bytes, message: str
) -> None:
    path = tmp_path / "controller.toml"
    path.write_bytes(raw)
    res = CliRunner().invoke(main, ["controller", "run", "--config", str(path), "--dry-run"])
    assert res.exit_code == 1
    assert res.output.strip().splitlines() == [f"silofs-ctl: error: {tmp_path}/{message}"]


def test_a_jobs_file_naming_a_node_not_in_the_config_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A typo in a job's nodes (n3, gpu-1 for gpu-01) left the job out of every plan
    without a word: plan.py plans only the config's nodes."""
    cfg = load_controller_config(write_config(tmp_path))
    (tmp_path / "jobs.toml").write_text(JOBS.replace('["n1", "n2"]', '["n1", "n3", "gpu-4"]'))
    ctl = Controller(cfg, factory=lambda node: FakeNode(node.name, TB))
    with caplog.at_level(logging.WARNING):
        assert ctl.reload_jobs()
    (record,) = [r for r in caplog.records if "not a node of the config" in r.getMessage()]
    assert record.getMessage() == (
        f"jobs file {tmp_path / 'jobs.toml'}: job dist names n3, gpu-4, not a node of the "
        "config's [[nodes]]: not planned there"
    )
    caplog.clear()
    (tmp_path / "jobs.toml").write_text(JOBS)
    with caplog.at_level(logging.WARNING):
        assert ctl.reload_jobs()
    assert "not a node of the config" not in caplog.text


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ('name = "dist"', 'name = "d\\u001b[2Jist"', "name 'd\\x1b[2Jist' holds a control"),
        ('"s3://data/imagenet/"', '"s3://data/\\nimagenet/"', "dataset 's3://data/\\nimagenet/'"),
        ('["n1", "n2"]', '["n1", "n\\u001b]0;x\\u0007"]', "node 'n\\x1b]0;x\\x07' holds"),
    ],
)
def test_a_jobs_file_name_with_a_control_character_is_refused(
    tmp_path: Path, old: str, new: str, message: str
) -> None:
    """The dry run's table printed a job name's ESC sequences to the terminal (recolour,
    clear, retitle) and its newlines as rows of their own."""
    jobs = tmp_path / "jobs.toml"
    jobs.write_text(JOBS.replace(old, new))
    with pytest.raises(ConfigError) as info:
        load_jobs_file(str(jobs))
    assert message in str(info.value) and "holds a control character" in str(info.value)


def test_a_missing_jobs_file_is_reported_once_and_picked_up_when_it_appears(
    tmp_path: Path,
) -> None:
    cfg = load_controller_config(write_config(tmp_path))
    (tmp_path / "jobs.toml").unlink()
    ctl = Controller(cfg, factory=lambda node: FakeNode(node.name, TB))
    assert ctl.reload_jobs() and ctl.entries == []
    assert not ctl.reload_jobs()
    (tmp_path / "jobs.toml").write_text(JOBS)
    assert ctl.reload_jobs() and [e.name for e in ctl.entries] == ["dist"]


def test_cli_dry_run_with_nodes_down_prints_the_table(tmp_path: Path) -> None:
    res = CliRunner().invoke(
        main, ["controller", "run", "--config", write_config(tmp_path), "--dry-run"]
    )
    assert res.exit_code == 0, res.output
    assert "dist" in res.output and "s3://data/imagenet/" in res.output
    assert "node n1 not updated" in res.output and "node n2 not updated" in res.output


def test_cli_once_fails_when_a_node_is_down(tmp_path: Path) -> None:
    res = CliRunner().invoke(
        main, ["controller", "run", "--config", write_config(tmp_path), "--once"]
    )
    assert res.exit_code == 1
    assert "Traceback" not in res.output


def test_cli_bad_config_is_one_line(tmp_path: Path) -> None:
    text = CONFIG.replace('remote_io = "1GB/s"', 'remote_io = "-1GB/s"')
    res = CliRunner().invoke(main, ["controller", "run", "--config", write_config(tmp_path, text)])
    assert res.exit_code == 1
    assert res.output.strip().count("\n") == 0
    assert "controller.toml:2: remote_io must not be negative" in res.output


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('poll = "0.000001s"', "poll must be at least 0.1s (1e-06s given)"),
        ('poll = "10ms"', "poll must be at least 0.1s"),
        ('interval = "0.5s"', "interval must be at least 1s"),
        ('timeout = "1ms"', "timeout must be at least 0.1s"),
    ],
)
def test_a_period_that_would_be_a_busy_loop_is_refused(
    tmp_path: Path, line: str, message: str
) -> None:
    """poll = "0.000001s" asked every node's daemon for its status about a million times a
    second, without a word: the controller was a busy loop, every daemon's socket with it."""
    key = line.split(" ")[0]
    text = "\n".join(x for x in CONFIG.splitlines() if not x.startswith(f"{key} ="))
    text = text.replace('remote_io = "1GB/s"', f'remote_io = "1GB/s"\n{line}')
    res = CliRunner().invoke(
        main, ["controller", "run", "--once", "--config", write_config(tmp_path, text)]
    )
    assert res.exit_code == 1 and res.output.strip().count("\n") == 0, res.output
    assert message in res.output


def test_the_floors_of_the_periods_themselves_are_accepted(tmp_path: Path) -> None:
    text = CONFIG.replace('interval = "30s"', 'interval = "1s"\npoll = "0.1s"\ntimeout = "100ms"')
    cfg = load_controller_config(write_config(tmp_path, text))
    assert (cfg.poll, cfg.timeout, cfg.interval) == (0.1, 0.1, 1.0)


@pytest.mark.parametrize("value", ['"100"', "100", "1e9", '" 5 "'])
def test_a_rate_without_a_unit_in_the_config_is_refused(tmp_path: Path, value: str) -> None:
    """As on the command line (`allocate-io`, `--io-limit`): remote_io = 100 was 100 B/s
    for the whole link, every job paused in effect, without a word."""
    text = CONFIG.replace('remote_io = "1GB/s"', f"remote_io = {value}")
    args = ["controller", "run", "--once", "--config", write_config(tmp_path, text)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 1 and res.output.strip().count("\n") == 0, res.output
    assert "controller.toml:2: remote_io: the rate" in res.output
    assert "needs a unit" in res.output


@pytest.mark.parametrize(("value", "expected"), [("0", 0.0), ('"0"', 0.0), ("inf", math.inf)])
def test_a_rate_of_zero_or_inf_needs_no_unit(tmp_path: Path, value: str, expected: float) -> None:
    text = CONFIG.replace('remote_io = "1GB/s"', f"remote_io = {value}")
    assert load_controller_config(write_config(tmp_path, text)).remote_io == expected


def test_a_jobs_ideal_io_without_a_unit_is_refused(tmp_path: Path) -> None:
    path = write_config(tmp_path)
    (tmp_path / "jobs.toml").write_text(JOBS.replace('"912MB/s"', "912"))
    with pytest.raises(ConfigError, match="ideal_io: the rate '912' needs a unit"):
        load_jobs_file(load_controller_config(path).jobs_file)


def test_status_with_the_contract_field_names_parses() -> None:
    seen = parse_status(
        "n1",
        {
            "node": {"cache_size": 64 * 2**20},
            "datasets": [
                {
                    "name": "imagenet",
                    "uri": IMAGENET,
                    "size": 10,
                    "cached_bytes": 5,
                    "cache_allocation": None,
                    "hit_ratio": 0.5,
                }
            ],
            "jobs": [
                {
                    "name": "j",
                    "dataset": IMAGENET,
                    "io_allocation": 7,
                    "throughput": 9,
                    "remote_bytes_per_s": 3,
                    "limiter_wait_s": 0.0,
                }
            ],
        },
    )
    assert isinstance(seen, NodeSeen)
    assert seen.jobs["j"].dataset == IMAGENET and seen.jobs["j"].throughput == 9
    assert seen.datasets[IMAGENET].cached == 5 and seen.cache_size == 64 * 2**20


class StrictNode(FakeNode):
    """Refuses, as the daemon does (409), a cache allocation taking the node's allocations
    over its cache size."""

    def put_cache(self, dataset: str, nbytes: int) -> None:
        others = sum(
            d.get("cache_allocation") or 0 for uri, d in self.datasets.items() if uri != dataset
        )
        if others + nbytes > self.cache_size:
            raise NodeError(f"allocations would total {others + nbytes}", unreachable=False)
        super().put_cache(dataset, nbytes)


def test_pushes_shrink_before_they_grow_so_one_round_moves_cache() -> None:
    # s3://a/ grows 300 -> 700 GB and s3://b/ shrinks 700 -> 300 GB on a 1 TB node: in
    # name order the grow would come first and be refused until the next round
    node = StrictNode("n1", 1 * TB)
    for uri, held in (("s3://a/", 300 * GB), ("s3://b/", 700 * GB)):
        node.add_dataset(uri, 1 * TB)
        node.datasets[uri]["cache_allocation"] = held
    node.add_job("j", "s3://a/", io_allocation=50 * MB)
    node.add_job("k", "s3://b/", io_allocation=None)
    plan = Plan(
        cache={"n1": {"s3://a/": 700 * GB, "s3://b/": 300 * GB}},
        io={"n1": {"j": 80 * MB, "k": 20 * MB}},
        jobs=[],
    )
    seen = {"n1": parse_status("n1", node.status())}
    with ThreadPoolExecutor(1) as pool:
        report = push_plan(plan, {"n1": node}, seen, pool)
    assert report.failed == {} and report.pushed == 4
    assert node.datasets["s3://a/"]["cache_allocation"] == 700 * GB
    # shrinks (cache b, IO k from unlimited) before grows (cache a, IO j)
    assert node.puts == [
        ("cache", "s3://b/", 300 * GB),
        ("io", "k", 20 * MB),
        ("cache", "s3://a/", 700 * GB),
        ("io", "j", 80 * MB),
    ]


def test_the_example_config_names_the_socket_a_root_daemon_listens_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """configs/controller.toml's local node is reachable with the daemons' defaults."""
    from silofs.config import default_socket

    monkeypatch.delenv("SILOFS_SOCKET", raising=False)
    monkeypatch.setattr("os.geteuid", lambda: 0)  # the daemon as a system service
    path = Path(__file__).resolve().parents[2] / "configs" / "controller.toml"
    cfg = load_controller_config(str(path))
    assert cfg.nodes[0].socket == default_socket()
    # and the forwarding example reaches the same socket on the remote node
    assert f":{default_socket()} " in path.read_text()


def test_registered_jobs_replace_the_jobs_file_and_the_file_wins_by_name() -> None:
    """A Slurm prolog registers each job on each of its nodes (GPUs, f*, epochs); the
    controller plans with that, and a jobs.toml entry of the same name wins whole."""
    nodes = two_nodes()
    reg = {"gpus": 8, "ideal_io": 912 * MB, "epochs": 3, "datasets": [IMAGENET], "nodes": []}
    for node in nodes.values():
        node.jobs["dist"]["registration"] = reg
    # registered before its mounts: known from the registration alone
    nodes["n2"].jobs["queued"] = {"name": "queued", "registration": {**reg, "gpus": 2}}
    nodes["n1"].jobs["local"]["registration"] = {"gpus": 4, "datasets": [WIKI]}
    ctl = controller(nodes, config(), [JobEntry("local", "wiki", gpus=1, ideal_io=20 * MB)])
    plan = ctl.round(force=True)
    assert plan is not None
    jobs = {j.name: j for j in plan.jobs}
    assert jobs["dist"].f_star == 912 * MB and jobs["dist"].nodes == ("n1", "n2")
    assert jobs["queued"].nodes == ("n2",) and jobs["queued"].f_star == 912 * MB
    assert jobs["local"].f_star == 20 * MB  # the file's, not the registration's (none)
    from silofs_ctl.controller import registered_entries

    seen = ctl.observe()
    by_name = {e.name: e for e in registered_entries(seen, {"local"})}
    assert set(by_name) == {"dist", "queued"}
    assert by_name["dist"].gpus == 8 and by_name["dist"].epochs == 3.0
    assert by_name["queued"].gpus == 2


def test_tls_nodes_need_a_tls_table_and_bad_files_are_one_line(tmp_path: Path) -> None:
    text = CONFIG.replace('socket = "{sock2}"', 'address = "tls://gpu-02.example:7470"')
    with pytest.raises(ConfigError, match=r"node n2 is reached over tls://: .* \[tls\]"):
        load_controller_config(write_config(tmp_path, text))
    text += '\n[tls]\ncert = "pki/controller.pem"\nkey = "pki/controller.key"\nca = "pki/ca.pem"\n'
    cfg = load_controller_config(write_config(tmp_path, text))
    assert cfg.nodes[1].socket == "tls://gpu-02.example:7470"
    assert cfg.tls is not None and cfg.tls.ca == str(tmp_path / "pki" / "ca.pem")
    with pytest.raises(ConfigError, match=r"\[tls\]: cannot load") as missing:
        Controller(cfg)  # the files do not exist
    # What to do, in the same line: the shipped controller.toml names pki/ files that an
    # operator following the README's "As services" has not made yet.
    assert f"silofs-ctl certs init {tmp_path / 'pki'}" in str(missing.value)
    assert "\n" not in str(missing.value)
    bad = CONFIG.replace('socket = "{sock2}"', 'socket = "http://gpu-02:7470"')
    with pytest.raises(ConfigError, match="tls://HOST:PORT"):
        load_controller_config(write_config(tmp_path, bad))
    both = CONFIG.replace('socket = "{sock2}"', 'socket = "/a"\naddress = "tls://h:1"')
    with pytest.raises(ConfigError, match="one of socket"):
        load_controller_config(write_config(tmp_path, both))


@pytest.mark.parametrize("value", ["100", "fast", "-1MB/s"])
def test_job_register_refuses_an_ideal_io_without_a_unit(tmp_path: Path, value: str) -> None:
    # Refused before any request (no daemon here): one line, exit 2, naming the flag.
    args = ["job", "register", "j", "--gpus", "1", "--ideal-io", value]
    res = CliRunner().invoke(main, [*args, "--socket", str(tmp_path / "none.sock")])
    assert res.exit_code == 2, res.output
    assert "--ideal-io" in res.output and res.output.strip().count("\n") == 0, res.output


def test_job_register_sends_the_jobs_uid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--uid names the job's user (its owner, docs/SECURITY.md "Jobs"); absent, the body
    has no uid; a uid that cannot be one is refused before any request."""
    sent: list[dict] = []

    class Client:
        def request(self, method: str, path: str, body: dict) -> dict:
            assert (method, path) == ("PUT", "/v1/jobs/slurm-5")
            sent.append(body)
            return {"job": "slurm-5", "registration": body}

    monkeypatch.setattr(job_cmd, "one_node_client", lambda _: contextlib.nullcontext(Client()))
    args = ["job", "register", "slurm-5", "--gpus", "2", "--socket", str(tmp_path / "s")]
    res = CliRunner().invoke(main, [*args, "--uid", "1000"])
    assert res.exit_code == 0 and '"uid": 1000' in res.output, res.output
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert [b.get("uid") for b in sent] == [1000, None]
    for bad in ("-1", "alice", str(1 << 32)):
        res = CliRunner().invoke(main, [*args, "--uid", bad])
        assert res.exit_code == 2 and "--uid" in res.output, res.output
    assert len(sent) == 2


def test_a_config_cache_larger_than_the_nodes_is_planned_as_the_nodes() -> None:
    """`cache = "2TB"` in controller.toml on a node whose daemon has 1 TB: the plan gave
    one dataset 2 TB, the daemon refused it (409) at every poll, and the dataset had no
    allocation at all, for ever. The daemon's cache size bounds the budget; the config
    can only make it smaller."""
    node = StrictNode("n1", 1 * TB)
    for uri in ("s3://a/", "s3://b/"):
        node.add_dataset(uri, 3 * TB)
    node.add_job("j", "s3://a/")
    node.add_job("k", "s3://b/")
    cfg = ControllerConfig(
        policy="gavel",
        remote_io=100 * MB,
        nodes=(NodeConfig("n1", "/run/n1.sock", gpus=4, cache=2 * TB),),
    )
    entries = [
        JobEntry(name, uri, gpus=1, ideal_io=100 * MB)
        for name, uri in (("j", "s3://a/"), ("k", "s3://b/"))
    ]
    ctl = controller({"n1": node}, cfg, entries)
    plan = ctl.round(force=True)
    assert plan is not None and ctl.refused == {} and ctl.not_updated == {}
    planned = plan.cache["n1"]
    assert sum(planned.values()) == pytest.approx(1 * TB, rel=1e-9)
    held = {uri: d["cache_allocation"] for uri, d in node.datasets.items()}
    assert held == planned
    # a config budget below the daemon's stays the budget
    small = ControllerConfig(
        policy="gavel",
        remote_io=100 * MB,
        nodes=(NodeConfig("n1", "/run/n1.sock", gpus=4, cache=400 * GB),),
    )
    plan = controller({"n1": node}, small, entries).round(force=True)
    assert plan is not None and sum(plan.cache["n1"].values()) == pytest.approx(400 * GB)


def test_a_config_cache_larger_than_the_nodes_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    node = FakeNode("n1", 1 * TB)
    cfg = ControllerConfig(
        policy="gavel",
        remote_io=100 * MB,
        nodes=(NodeConfig("n1", "/run/n1.sock", gpus=4, cache=2 * TB),),
    )
    ctl = controller({"n1": node}, cfg, [])
    with caplog.at_level(logging.WARNING, logger="silofs_ctl.controller"):
        for _ in range(3):
            ctl.round(force=True)
    said = [r.getMessage() for r in caplog.records if "more than the daemon's" in r.getMessage()]
    assert said == [
        "node n1: cache = 1.8TiB in the config is more than the daemon's cache "
        "(931.3GiB): planning with the daemon's"
    ]


def link_sum(nodes: dict[str, FakeNode]) -> float:
    """What the nodes enforce now, all together: the link's load at worst."""
    return sum(j["io_allocation"] or 0 for n in nodes.values() for j in n.jobs.values())


def test_a_silent_node_keeps_its_last_allocations_reserved_on_the_link(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """n2 stops answering the controller but still serves, enforcing what it was last
    pushed: the next plan divided the whole link among n1's jobs (80.2 MB/s for dist on
    n1 + 19.8 for local, with n2's 42.8 still fetched: 143 MB/s on a 100 MB/s link)."""
    nodes = two_nodes()
    ctl = controller(nodes, config(), ENTRIES)
    ctl.round(force=True)
    assert link_sum(nodes) == pytest.approx(100 * MB, abs=3)
    held = nodes["n2"].jobs["dist"]["io_allocation"]
    assert held > 30 * MB
    nodes["n2"].down = True  # to the controller only: it keeps enforcing `held`
    with caplog.at_level(logging.WARNING, logger="silofs_ctl.controller"):
        assert ctl.round() is not None  # n2 going silent re-plans by itself
        ctl.round(force=True)
    assert nodes["n2"].jobs["dist"]["io_allocation"] == held
    assert link_sum(nodes) <= 100 * MB + 3
    assert ctl.reserved == {"n2": {"dist": held}}
    said = [r.getMessage() for r in caplog.records if "reserved" in r.getMessage()]
    assert len(said) == 1 and "n2" in said[0] and format_rate(held) in said[0]
    assert f"its last {format_rate(held)} reserved" in ctl.not_updated["n2"]
    # the rest of the link is still divided: n1's jobs get what n2 does not hold
    n1 = sum(j["io_allocation"] for j in nodes["n1"].jobs.values())
    assert n1 == pytest.approx(100 * MB - held, abs=3)


def test_a_silent_node_that_answers_again_gets_its_new_plan_and_frees_its_reservation(
    caplog: pytest.LogCaptureFixture,
) -> None:
    nodes = two_nodes()
    ctl = controller(nodes, config(), ENTRIES)
    ctl.round(force=True)
    nodes["n2"].down = True
    ctl.round(force=True)
    assert "n2" in ctl.reserved
    # while it was silent, its job moved on: it reads from cache now and needs less
    nodes["n2"].jobs.pop("dist")
    nodes["n2"].add_job("other", IMAGENET)
    nodes["n2"].jobs["other"]["io_allocation"] = None
    nodes["n2"].down = False
    with caplog.at_level(logging.WARNING, logger="silofs_ctl.controller"):
        assert ctl.round() is not None
    assert ctl.reserved == {}
    assert any("n2" in r.getMessage() and "back" in r.getMessage() for r in caplog.records)
    # it got the new plan, and the whole link is divided again over what runs now
    assert nodes["n2"].jobs["other"]["io_allocation"] is not None
    assert link_sum(nodes) == pytest.approx(100 * MB, abs=3)


def test_a_node_silent_from_the_start_reserves_nothing() -> None:
    nodes = two_nodes()
    nodes["n2"].down = True
    ctl = controller(nodes, config(), ENTRIES)
    ctl.round(force=True)
    assert ctl.reserved == {}
    n1 = sum(j["io_allocation"] for j in nodes["n1"].jobs.values())
    assert n1 == pytest.approx(100 * MB, abs=3)


def test_a_node_refusing_a_shrink_does_not_take_the_link_over_its_total(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """n1 answers but refuses lowering its job's IO: it goes on enforcing the old, larger
    rate, so the grows the plan gave the difference to (n2's job) must give it back in
    that very round, and in every round it goes on refusing."""
    n1, n2 = FakeNode("n1", 1 * TB), FakeNode("n2", 1 * TB)
    n1.add_dataset(IMAGENET, 1300 * GB)
    n1.add_job("big", IMAGENET)
    n2.add_dataset(WIKI, 100 * GB)
    n2.add_job("small", WIKI)
    nodes = {"n1": n1, "n2": n2}
    entries = [
        JobEntry("big", IMAGENET, gpus=4, ideal_io=912 * MB),
        JobEntry("small", "wiki", gpus=4, ideal_io=20 * MB),
    ]
    ctl = controller(nodes, config(), entries)
    ctl.round(force=True)
    assert link_sum(nodes) == pytest.approx(100 * MB, abs=3)
    enforced = n1.jobs["big"]["io_allocation"]
    assert enforced > 50 * MB

    def refuse(job: str, rate: int | None) -> None:
        current = n1.jobs[job]["io_allocation"]
        if rate is None or current is None or rate < current:
            raise NodeError("bytes_per_s: out of range", unreachable=False)
        n1.jobs[job]["io_allocation"] = rate

    n1.put_io = refuse  # type: ignore[method-assign]
    # the jobs swap needs: the plan moves most of big's share to small
    ctl.entries = [
        JobEntry("big", IMAGENET, gpus=4, ideal_io=20 * MB),
        JobEntry("small", "wiki", gpus=4, ideal_io=912 * MB),
    ]
    with caplog.at_level(logging.WARNING, logger="silofs_ctl.push"):
        for _ in range(3):
            plan = ctl.round(force=True)
            assert plan is not None and plan.io["n1"]["big"] < enforced
            assert n1.jobs["big"]["io_allocation"] == enforced  # refused: still enforced
            assert "out of range" in ctl.refused["n1"]
            assert link_sum(nodes) <= 100 * MB + 3
    # what the link allows still goes out: small gets the rest of it
    assert n2.jobs["small"]["io_allocation"] == pytest.approx(100 * MB - enforced, abs=3)
    said = [r.getMessage() for r in caplog.records if "link" in r.getMessage()]
    assert said and "n1" in said[0]
    # once the shrink lands, small gets its whole planned share
    del n1.put_io
    plan = ctl.round(force=True)
    assert plan is not None and ctl.refused == {}
    assert n2.jobs["small"]["io_allocation"] == int(plan.io["n2"]["small"])
    assert link_sum(nodes) <= 100 * MB + 3


class ShrinkRefusingNode(FakeNode):
    """Refuses every IO update that lowers a job's allocation (or ends unthrottled)."""

    def put_io(self, job: str, rate: int | None) -> None:
        current = self.jobs[job]["io_allocation"] if job in self.jobs else -1
        if rate is not None and (current is None or 0 <= rate < current):
            raise NodeError("bytes_per_s: out of range", unreachable=False)
        super().put_io(job, rate)


def _push(plan: Plan, nodes: dict[str, FakeNode]) -> PushReport:
    seen = {name: parse_status(name, node.status()) for name, node in nodes.items()}
    with ThreadPoolExecutor(2) as pool:
        return push_plan(plan, dict(nodes), seen, pool)


def test_an_unthrottled_job_refusing_its_shrink_withholds_every_io_grow() -> None:
    n1, n2 = ShrinkRefusingNode("n1", 1 * TB), FakeNode("n2", 1 * TB)
    n1.add_job("wild", IMAGENET, io_allocation=None)
    n2.add_job("tame", WIKI, io_allocation=10 * MB)
    plan = Plan(cache={}, io={"n1": {"wild": 50 * MB}, "n2": {"tame": 50 * MB}}, jobs=[])
    report = _push(plan, {"n1": n1, "n2": n2})
    # nothing bounds what wild fetches: no grow can be paid for
    assert n2.jobs["tame"]["io_allocation"] == 10 * MB and n2.puts == []
    assert "out of range" in report.failed["n1"] and report.held_back == 40 * MB


def test_a_node_lost_before_its_shrink_landed_holds_back_the_grows_it_paid_for() -> None:
    n1, n2 = FakeNode("n1", 1 * TB), FakeNode("n2", 1 * TB)
    n1.add_job("big", IMAGENET, io_allocation=80 * MB)
    n2.add_job("small", WIKI, io_allocation=20 * MB)
    n2.add_job("new", WIKI)
    del n2.jobs["new"]  # planned there, no mount yet: holds no allocation

    def lost(job: str, rate: int | None) -> None:
        raise NodeError("the silofs daemon at /run/n1.sock did not answer")

    n1.put_io = lost  # type: ignore[method-assign]
    plan = Plan(
        cache={}, io={"n1": {"big": 20 * MB}, "n2": {"small": 50 * MB, "new": 30 * MB}}, jobs=[]
    )
    report = _push(plan, {"n1": n1, "n2": n2})
    assert report.unreachable == {"n1"}
    # big may go on at 80: the grows (30 for small, 30 for new) give back its 60
    # (small keeps its 20, so is not pushed); a job with no allocation yet still gets
    # one, 0 here: left unset it would mount unthrottled
    assert n2.puts == [("io", "new", 0)]
    assert report.held_back == pytest.approx(60 * MB, abs=2)
