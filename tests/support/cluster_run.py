"""An N-node cluster running on this host: its daemons started with their cluster's
silofs.toml (tests/support/cluster.py writes them), the store reached through one fault
proxy, a bucket mounted on every node; stopped and their logs checked on the way out.

Owns the processes of such a cluster for a test's duration; never decides what a test
asserts beyond "no daemon logged a problem".
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tests.support.cluster import ClusterNode, write_cluster
from tests.support.faultproxy import FaultPlan, FaultProxy
from tests.support.net import free_ports
from tests.support.node import Node
from tests.support.poll import wait_for


class ClusterDaemon(Node):
    """A Node started with its cluster's silofs.toml."""

    def __init__(self, spec: ClusterNode, socket: str | None = None) -> None:
        super().__init__(spec.root, "64M", config=spec.config, socket=socket)
        self.spec = spec

    def cluster(self) -> dict:
        return self.status()["cluster"]

    def member(self, address: str) -> dict:
        return next(m for m in self.cluster()["members"] if m["address"] == address)


@dataclass
class RunningCluster:
    nodes: list[ClusterDaemon]
    mps: list[Path]
    proxy: FaultProxy
    pki: Path
    uri: str


@contextmanager
def running_cluster(
    store: Any, bucket: str, tree: dict[str, bytes], tmp_path: Path, n: int, chunk_size: str
) -> Iterator[RunningCluster]:
    """`n` daemons on 127.0.0.1 (a dead-peer bound of 1 s, a backoff of 0.5 s), each
    counting every member up, the bucket (made of `tree`) read through one fault proxy
    and mounted on each with `--chunk-size chunk_size`. The caller applies the store's
    environment first."""
    store.create(bucket, tree)
    up = urlsplit(store.endpoint_url)
    with FaultProxy(upstream=(up.hostname or "127.0.0.1", up.port or 80), faults=FaultPlan()) as p:
        specs = write_cluster(
            tmp_path,
            ["127.0.0.1"] * n,
            free_ports(n),
            cluster={"peer_timeout_seconds": 1.0, "peer_backoff_seconds": 0.5},
            extra={"backend": {"endpoint_url": p.url}},
        )
        nodes = [ClusterDaemon(s) for s in specs]
        try:
            for node in nodes:
                node.start()
            # The nodes start one after the other: each pinged the later ones while they
            # were still starting, was refused, and counts them down for the backoff
            # (doubling with each refusal while they start) until its next probe. Tests
            # begin with every member up everywhere (their reads' homes, their parts).
            for node in nodes:
                wait_for(
                    lambda node=node: all(m["state"] == "up" for m in node.cluster()["members"]),
                    timeout=60,
                    what=f"{node.spec.name} to find every member up",
                )
            uri = store.uri(bucket)
            mps = [
                node.mount(uri, tmp_path / f"mnt{i}", "--chunk-size", chunk_size)
                for i, node in enumerate(nodes)
            ]
            yield RunningCluster(nodes, mps, p, tmp_path / "pki", uri)
        finally:
            for node in nodes:
                node.cleanup()
        problems = [x for node in nodes for x in node.log_problems()]
        assert not problems, "\n".join(problems)
