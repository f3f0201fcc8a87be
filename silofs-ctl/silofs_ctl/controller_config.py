"""The controller's settings and its jobs file: TOML -> typed, checked dataclasses.

Owns: the controller.toml and jobs.toml schemas (docs/CONTROLLER.md,
configs/controller.toml), their defaults, and error messages naming the file and line.
Never: talks to a node, plans, or accepts a key it does not know (a typo would silently
fall back to a default).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .policies import FifoPolicy, GavelPolicy, GreedyPolicy, Policy, SjfPolicy
from .slurm import SlurmConfig
from .tomlcheck import Checker, load_toml, read_text

log = logging.getLogger(__name__)

# Floors of the controller's periods: below them a typo (poll = "0.000001s") is a busy
# loop asking every node's daemon (and slurmctld, which Slurm asks sites to poll sparingly)
# thousands of times a second, and a timeout under a network's round trip fails every
# node. Each is well under what a cluster needs (re-planning faster than jobs change
# rates plans nothing new).
MIN_POLL = 0.1
MIN_INTERVAL = 1.0
MIN_TIMEOUT = 0.1
MIN_SLURM_POLL = 1.0

# The policies a controller config may name.
POLICIES: dict[str, type[Policy]] = {
    "gavel": GavelPolicy,
    "sjf": SjfPolicy,
    "fifo": FifoPolicy,
    "greedy": GreedyPolicy,
}
CONFIG_KEYS = {
    "policy", "remote_io", "interval", "poll", "timeout", "jobs_file", "nodes", "tls", "slurm",
}  # fmt: skip
NODE_KEYS = {"name", "socket", "address", "gpus", "cache"}
TLS_KEYS = {"cert", "key", "ca"}
SLURM_KEYS = {
    "squeue", "scontrol", "poll", "timeout", "max_output", "format", "priority",
    "max_priority_updates",
}  # fmt: skip
SLURM_FORMATS = ("auto", "json", "text")
SLURM_PRIORITY = ("off", "log", "set")
JOB_KEYS = {"name", "dataset", "gpus", "ideal_io", "nodes", "dataset_size", "epochs"}


@dataclass(frozen=True)
class NodeConfig:
    name: str
    socket: str  # a Unix socket path, or "tls://HOST:PORT" (the daemon's TLS listener)
    gpus: int = 0  # 0: as many as the jobs seen on it use
    cache: int | None = None  # budget to divide; None: the daemon's own cache size


@dataclass(frozen=True)
class TLSConfig:
    """[tls]: the controller's client certificate and key, and the CA that issued the
    nodes' certificates (paths; relative ones are relative to the config file)."""

    cert: str
    key: str
    ca: str


@dataclass(frozen=True)
class ControllerConfig:
    policy: str
    remote_io: float
    nodes: tuple[NodeConfig, ...]
    jobs_file: str | None = None
    interval: float = 30.0
    poll: float = 2.0
    timeout: float = 5.0
    tls: TLSConfig | None = None
    slurm: SlurmConfig | None = None  # [slurm]: ask slurmctld for jobs each round


@dataclass(frozen=True)
class JobEntry:
    """One job as the jobs file describes it; every field but name and dataset optional."""

    name: str
    dataset: str
    gpus: int = 1
    ideal_io: float | None = None
    nodes: tuple[str, ...] = ()
    dataset_size: int | None = None
    epochs: float | None = None


def load_controller_config(path: str) -> ControllerConfig:
    text = read_text(path)
    data = load_toml(text, path)
    ck = Checker(path, text)
    ck.check_keys(data, CONFIG_KEYS, ())
    policy = data.get("policy", "gavel")
    if policy not in POLICIES:
        raise ck.fail(("policy",), f"unknown policy {policy!r} (try {', '.join(POLICIES)})")
    remote_io = ck.rate(
        ck.need(data, "remote_io", ()), ("remote_io",), "remote_io", require_unit=True
    )
    nodes = _config_nodes(ck, data.get("nodes"))
    jobs_file = data.get("jobs_file")
    if jobs_file is not None and not isinstance(jobs_file, str):
        raise ck.fail(("jobs_file",), "jobs_file must be a path")
    if jobs_file:
        jobs_file = str(Path(path).parent / jobs_file)  # relative to the config
    tls = _tls(ck, data.get("tls"), Path(path).parent)
    remote = [n.name for n in nodes if n.socket.startswith("tls://")]
    if remote and tls is None:
        raise ck.fail(
            (),
            f"node {remote[0]} is reached over tls://: the config needs a [tls] table "
            "(cert, key, ca; `silofs-ctl certs init` makes them)",
        )
    return ControllerConfig(
        policy=policy,
        remote_io=remote_io,
        nodes=nodes,
        jobs_file=jobs_file,
        interval=_positive(ck, data, "interval", 30.0, least=MIN_INTERVAL),
        poll=_positive(ck, data, "poll", 2.0, least=MIN_POLL),
        timeout=_positive(ck, data, "timeout", 5.0, least=MIN_TIMEOUT),
        tls=tls,
        slurm=_slurm(ck, data.get("slurm")),
    )


def _slurm(ck: Checker, raw: Any) -> SlurmConfig | None:
    """[slurm]: present (even empty) turns the Slurm source on."""
    if raw is None:
        return None
    where = ("slurm",)
    if not isinstance(raw, dict):
        raise ck.fail(where, "slurm must be a table: [slurm]")
    ck.check_keys(raw, SLURM_KEYS, where)
    d = SlurmConfig()
    for key in ("squeue", "scontrol"):
        if key in raw and (not isinstance(raw[key], str) or not raw[key]):
            raise ck.fail(where + (key,), f"{key} must be a command (a path or a name)")
    for key, allowed in (("format", SLURM_FORMATS), ("priority", SLURM_PRIORITY)):
        if key in raw and raw[key] not in allowed:
            raise ck.fail(where + (key,), f"{key} must be one of {', '.join(allowed)}")
    timeout = _positive(ck, raw, "timeout", d.timeout, where, least=MIN_TIMEOUT)
    poll = _positive(ck, raw, "poll", d.poll, where, least=MIN_SLURM_POLL)
    max_output = ck.size(raw["max_output"], where + ("max_output",), "max_output") if (
        "max_output" in raw) else d.max_output  # fmt: skip
    if max_output <= 0:
        raise ck.fail(where + ("max_output",), "max_output must be positive")
    updates = d.max_priority_updates
    if "max_priority_updates" in raw:
        updates = int(ck.number(raw["max_priority_updates"], where + ("max_priority_updates",),
                                "max_priority_updates", integer=True))  # fmt: skip
        if updates < 1:
            raise ck.fail(where + ("max_priority_updates",), "max_priority_updates must be >= 1")
    return SlurmConfig(
        squeue=raw.get("squeue", d.squeue),
        scontrol=raw.get("scontrol", d.scontrol),
        poll=poll,
        timeout=timeout,
        max_output=max_output,
        format=raw.get("format", d.format),
        priority=raw.get("priority", d.priority),
        max_priority_updates=updates,
    )


def _tls(ck: Checker, raw: Any, base: Path) -> TLSConfig | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ck.fail(("tls",), "tls must be a table: [tls] cert = ..., key = ..., ca = ...")
    ck.check_keys(raw, TLS_KEYS, ("tls",))
    paths = []
    for key in ("cert", "key", "ca"):
        value = ck.need(raw, key, ("tls",))
        if not isinstance(value, str) or not value:
            raise ck.fail(("tls", key), f"{key} must be a path")
        paths.append(str(base / value))  # an absolute value stays as it is
    return TLSConfig(*paths)


def _positive(
    ck: Checker,
    data: Mapping[str, Any],
    key: str,
    default: float,
    where: tuple = (),
    *,
    least: float = 0.0,
) -> float:
    value = ck.duration(data.get(key, default), where + (key,), key)
    if value <= 0:
        raise ck.fail(where + (key,), f"{key} must be positive")
    if value < least:
        raise ck.fail(where + (key,), f"{key} must be at least {least:g}s ({value:g}s given)")
    return value


def _config_nodes(ck: Checker, raw: Any) -> tuple[NodeConfig, ...]:
    if not isinstance(raw, list) or not raw:
        raise ck.fail((), "the config needs at least one [[nodes]] table")
    nodes = []
    for i, table in enumerate(raw):
        where = ("nodes", i)
        ck.check_keys(table, NODE_KEYS, where)
        if ("socket" in table) == ("address" in table):
            raise ck.fail(where, "a node needs one of socket (a Unix socket) or address (tls://)")
        key = "socket" if "socket" in table else "address"
        name, socket = ck.need(table, "name", where), table[key]
        for k, value in (("name", name), (key, socket)):
            if not isinstance(value, str) or not value:
                raise ck.fail(where + (k,), f"{k} must be a non-empty string")
        ck.name(name, where + ("name",), "name")
        if socket.startswith("tls://"):
            from silofs.control.client import parse_tls_address

            try:
                parse_tls_address(socket)
            except ValueError as exc:
                raise ck.fail(where + (key,), str(exc)) from None
        elif "://" in socket:
            raise ck.fail(where + (key,), f"{socket!r}: a node is a socket path or tls://HOST:PORT")
        if any(n.name == name for n in nodes):
            raise ck.fail(where + ("name",), f"node name {name!r} used twice")
        gpus = 0
        if "gpus" in table:
            gpus = int(ck.number(table["gpus"], where + ("gpus",), "gpus", integer=True))
        cache = ck.size(table["cache"], where + ("cache",), "cache") if "cache" in table else None
        nodes.append(NodeConfig(name, socket, gpus, cache))
    return tuple(nodes)


def load_jobs_file(path: str) -> list[JobEntry]:
    text = read_text(path)
    data = load_toml(text, path)
    ck = Checker(path, text)
    ck.check_keys(data, {"jobs"}, ())
    raw = data.get("jobs", [])
    if not isinstance(raw, list):
        raise ck.fail(("jobs",), "jobs must be [[jobs]] tables")
    entries: list[JobEntry] = []
    for i, table in enumerate(raw):
        entry = _job_entry(ck, table, ("jobs", i))
        if any(e.name == entry.name for e in entries):
            raise ck.fail(("jobs", i, "name"), f"job name {entry.name!r} used twice")
        entries.append(entry)
    return entries


def _job_entry(ck: Checker, table: dict, where: tuple) -> JobEntry:
    ck.check_keys(table, JOB_KEYS, where)
    name = ck.name(ck.need(table, "name", where), where + ("name",), "name")
    dataset = ck.name(ck.need(table, "dataset", where), where + ("dataset",), "dataset")
    nodes = table.get("nodes", [])
    if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
        raise ck.fail(where + ("nodes",), "nodes must be a list of node names")
    for node in nodes:
        ck.name(node, where + ("nodes",), "node")
    ideal = None
    if "ideal_io" in table:
        ideal = ck.rate(table["ideal_io"], where + ("ideal_io",), "ideal_io", require_unit=True)
        if ideal <= 0 or math.isinf(ideal):
            raise ck.fail(where + ("ideal_io",), "ideal_io must be a positive, finite rate")
    return JobEntry(
        name=name,
        dataset=dataset,
        gpus=int(ck.number(table.get("gpus", 1), where + ("gpus",), "gpus", integer=True)),
        ideal_io=ideal,
        nodes=tuple(nodes),
        dataset_size=(
            ck.size(table["dataset_size"], where + ("dataset_size",), "dataset_size")
            if "dataset_size" in table
            else None
        ),
        epochs=(
            float(ck.number(table["epochs"], where + ("epochs",), "epochs", integer=False))
            if "epochs" in table
            else None
        ),
    )
