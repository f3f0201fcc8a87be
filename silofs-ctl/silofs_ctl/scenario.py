"""Simulation scenarios: the TOML format, loaded into typed specs and validated.

Owns: the scenario schema (docs/CONTROLLER.md), sizes/rates/durations with units, and
error messages that name the file and line of the offending key. tomllib gives no line
numbers, so lines come from a light scan of the text (tables and `key =` lines).
Never: simulates, and never accepts a key it does not know (a typo would silently fall
back to a default and skew results).

    [cluster]
    remote_io = "200MB/s"
    cache = "cluster"      # one cache across the nodes (default), or "per-node"
    [[cluster.nodes]]      # one table per node; `count = N` repeats it
    gpus = 4
    cache = "1TiB"
    [[jobs]]
    name = "resnet50-a"
    submit = "0s"
    gpus = 1
    dataset = "imagenet-a"  # jobs naming the same dataset share it
    dataset_size = "1.3TiB" # needed on the first job that names a dataset
    ideal_io = "114MB/s"    # f*
    epochs = 13
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from silofs.units import count

from .tomlcheck import Checker, ConfigError, load_toml, parse_duration, read_text

log = logging.getLogger(__name__)

TOP_KEYS = {"description", "cluster", "jobs"}
CLUSTER_KEYS = {"remote_io", "nodes", "cache"}
# How the nodes cache: "cluster", one cache across them (a silofs cluster, the SiloD
# paper's distributed cache: a dataset is cached once); "per-node", each alone.
NODE_CACHES = ("cluster", "per-node")
NODE_KEYS = {"name", "gpus", "cache", "count"}
JOB_KEYS = {"name", "submit", "gpus", "dataset", "dataset_size", "ideal_io", "epochs"}
# What a scenario may ask of the simulator. Nodes: `count = 30000000` built a node list
# for minutes (each name checked against all before it). Years: the simulator steps at
# least every --interval (600 s) while caches fill, ~50 us a step, and gives up after
# 5,000,000 steps; a job that cannot finish in fewer (1 PB at 1 B/s) ran for minutes and
# ended in "gave up". A run that cannot end within HORIZON_YEARS at its best (see
# _check_horizon) is refused at load, naming the job or key that makes it so: ten
# simulated years take ~3 s, and real traces (Philly, Helios) span months.
MAX_NODES = 10_000
HORIZON_YEARS = 10
# Submit times: the simulator's clock is a float of seconds, whose step at time t is
# t x 2.2e-16. Past 100,000 years (3.2e12 s) it is over 0.5 ms and grows: a 200 s job
# submitted at 1e17 s reported a JCT of 192 s, at 1e308 s of 0 s (it "ran" in no time),
# without a word. Idle time costs no steps, so the bound is about precision only.
MAX_SUBMIT_YEARS = 100_000
_YEAR = 365 * 86400.0
__all__ = ["JobSpec", "NodeSpec", "Scenario", "ScenarioError", "load_scenario", "parse_duration"]


class ScenarioError(ConfigError):
    """A scenario that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class NodeSpec:
    name: str
    gpus: int
    cache: int


@dataclass(frozen=True)
class JobSpec:
    name: str
    submit: float
    gpus: int
    dataset: str
    dataset_size: int
    ideal_io: float
    epochs: float
    line: int = 0


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    remote_io: float
    nodes: tuple[NodeSpec, ...]
    jobs: tuple[JobSpec, ...]
    node_caches: str = "cluster"  # one of NODE_CACHES

    @property
    def per_node(self) -> bool:
        return self.node_caches == "per-node"

    @property
    def total_gpus(self) -> int:
        return sum(n.gpus for n in self.nodes)

    @property
    def datasets(self) -> dict[str, int]:
        return {j.dataset: j.dataset_size for j in self.jobs}


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file; ScenarioError names the line at fault."""
    return parse_scenario(read_text(path, ScenarioError), str(path))


def parse_scenario(text: str, path: str = "<scenario>") -> Scenario:
    data = load_toml(text, path, ScenarioError)
    ld = Checker(path, text, ScenarioError)
    ld.check_keys(data, TOP_KEYS, ())
    description = data.get("description", "")
    if not isinstance(description, str):
        raise ld.fail(("description",), "description must be a string")
    cluster = ld.need(data, "cluster", ())
    if not isinstance(cluster, dict):
        raise ld.fail(("cluster",), "[cluster] must be a table")
    ld.check_keys(cluster, CLUSTER_KEYS, ("cluster",))
    remote_io = ld.rate(
        ld.need(cluster, "remote_io", ("cluster",)), ("cluster", "remote_io"), "remote_io"
    )
    if remote_io <= 0:
        raise ld.fail(("cluster", "remote_io"), 'remote_io must be positive (or "unlimited")')
    node_caches = cluster.get("cache", "cluster")
    if node_caches not in NODE_CACHES:
        raise ld.fail(("cluster", "cache"), 'cache must be "cluster" or "per-node"')
    nodes = _nodes(ld, cluster.get("nodes"))
    jobs = _jobs(ld, data.get("jobs"), sum(n.gpus for n in nodes))
    _check_horizon(ld, remote_io, sum(n.gpus for n in nodes), jobs)
    return Scenario(Path(path).stem, description, remote_io, nodes, jobs, node_caches)


def _check_horizon(ld: Checker, remote_io: float, gpus: int, jobs: tuple[JobSpec, ...]) -> None:
    """Refuse a scenario whose shortest possible run (the time jobs run, not the idle
    time between submissions) is longer than HORIZON_YEARS.

    Three lower bounds on the makespan, each exact for some scenario: a job reads its
    epochs at ideal_io at most (every byte a hit, the whole cluster's GPUs its own); the
    jobs' GPU time cannot run on more GPUs than the cluster has; and every dataset's bytes
    that some job reads come from the store at least once (caches start empty), through
    one link of remote_io."""
    limit = HORIZON_YEARS * _YEAR

    def years(seconds: float) -> str:
        return f"{seconds / _YEAR:.3g} years"

    work = 0.0
    for i, j in enumerate(jobs):
        # Not the submit times: the simulator jumps over time when nothing runs, so a
        # job submitted 10,000 years after the others costs no steps.
        alone = j.epochs * j.dataset_size / j.ideal_io
        work += alone * j.gpus
        if alone > limit:
            raise ld.fail(
                ("jobs", i, "epochs"),
                f"job {j.name!r} needs {years(alone)} at least (epochs x dataset_size / "
                f"ideal_io), past the simulator's horizon of {HORIZON_YEARS} years",
            )
    if work / gpus > limit:
        raise ld.fail(
            ("cluster", "nodes", 0),
            f"the jobs need {years(work / gpus)} of all {gpus} GPUs at least, past the "
            f"simulator's horizon of {HORIZON_YEARS} years",
        )
    once: dict[str, float] = {}  # dataset -> bytes fetched at least
    for j in jobs:
        once[j.dataset] = max(once.get(j.dataset, 0.0), min(j.epochs, 1.0) * j.dataset_size)
    if sum(once.values()) / remote_io > limit:
        raise ld.fail(
            ("cluster", "remote_io"),
            f"remote_io fetches the datasets once in {years(sum(once.values()) / remote_io)} "
            f"at least, past the simulator's horizon of {HORIZON_YEARS} years",
        )


def _nodes(ld: Checker, raw: Any) -> tuple[NodeSpec, ...]:
    if not isinstance(raw, list) or not raw:
        raise ld.fail(("cluster",), "the cluster needs at least one [[cluster.nodes]] table")
    nodes: list[NodeSpec] = []
    names: set[str] = set()
    for i, table in enumerate(raw):
        where = ("cluster", "nodes", i)
        ld.check_keys(table, NODE_KEYS, where)
        raw_gpus = ld.need(table, "gpus", where)
        gpus = int(ld.number(raw_gpus, where + ("gpus",), "gpus", integer=True))
        cache = ld.size(ld.need(table, "cache", where), where + ("cache",), "cache")
        count = int(ld.number(table.get("count", 1), where + ("count",), "count", integer=True))
        if len(nodes) + count > MAX_NODES:
            raise ld.fail(where + ("count",), f"more than {MAX_NODES} nodes in all")
        base = ld.name(table.get("name", f"node{i}"), where + ("name",), "name")
        for k in range(count):
            name = base if count == 1 else f"{base}-{k}"
            if name in names:
                raise ld.fail(where + ("name",), f"node name {name!r} used twice")
            names.add(name)
            nodes.append(NodeSpec(name, gpus, cache))
    return tuple(nodes)


def _jobs(ld: Checker, raw: Any, total_gpus: int) -> tuple[JobSpec, ...]:
    if not isinstance(raw, list) or not raw:
        raise ld.fail((), "the scenario needs at least one [[jobs]] table")
    sizes: dict[str, int] = {}
    names: set[str] = set()
    jobs = []
    for i, table in enumerate(raw):
        job = _job(ld, table, ("jobs", i), sizes)
        if job.name in names:
            raise ld.fail(("jobs", i, "name"), f"job name {job.name!r} used twice")
        if job.gpus > total_gpus:
            raise ld.fail(
                ("jobs", i, "gpus"),
                f"job {job.name!r} needs {count(job.gpus, 'GPU')} but the cluster has only "
                f"{total_gpus}",
            )
        names.add(job.name)
        jobs.append(job)
    return tuple(jobs)


def _job(ld: Checker, table: dict, where: tuple, sizes: dict[str, int]) -> JobSpec:
    ld.check_keys(table, JOB_KEYS, where)
    name = ld.name(ld.need(table, "name", where), where + ("name",), "name")
    dataset = ld.name(ld.need(table, "dataset", where), where + ("dataset",), "dataset")
    if "dataset_size" in table:
        size = ld.size(table["dataset_size"], where + ("dataset_size",), "dataset_size")
        if size == 0:
            raise ld.fail(where + ("dataset_size",), "dataset_size must not be zero")
        if sizes.get(dataset, size) != size:
            raise ld.fail(
                where + ("dataset_size",),
                f"dataset {dataset!r} was given size {sizes[dataset]} bytes before, now {size}",
            )
        sizes[dataset] = size
    elif dataset not in sizes:
        raise ld.fail(where, f"missing key 'dataset_size' (first job naming {dataset!r})")
    ideal = ld.rate(ld.need(table, "ideal_io", where), where + ("ideal_io",), "ideal_io")
    if ideal <= 0 or math.isinf(ideal):
        raise ld.fail(where + ("ideal_io",), "ideal_io must be a positive, finite rate")
    submit = ld.duration(table.get("submit", 0), where + ("submit",), "submit")
    if submit > MAX_SUBMIT_YEARS * _YEAR:
        raise ld.fail(
            where + ("submit",),
            f"submit is {submit / _YEAR:.3g} years, past the simulator's {MAX_SUBMIT_YEARS:,} "
            "(its clock would lose the job's milliseconds)",
        )
    return JobSpec(
        name=name,
        submit=submit,
        gpus=int(ld.number(ld.need(table, "gpus", where), where + ("gpus",), "gpus", integer=True)),
        dataset=dataset,
        dataset_size=sizes[dataset],
        ideal_io=ideal,
        epochs=float(
            ld.number(ld.need(table, "epochs", where), where + ("epochs",), "epochs", integer=False)
        ),
        line=ld.lines.line(*where) or 0,
    )
