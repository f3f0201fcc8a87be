"""A cluster of silofs nodes on one machine: each node a host of its own (a network
namespace on one bridged subnet), all reading one store through a limited link.

Owns making and unmaking such a cluster for tests and benchmarks:

- the network (tests/support/net.py `bridge`): a hub namespace with a bridge, one
  namespace per node with a veth to it, every node's link shaped with tc;
- the store (moto or s3rver, a subprocess on this host's loopback) reached from every
  node through a FaultProxy that listens on the hub's address (its latency and
  bandwidth are the store's link; its byte count is what the store sent);
- the PKI (`silofs-ctl certs init` / `certs node`), one certificate per node for its
  address;
- each node: a `silofs daemon` inside its namespace, with its own root (cache dir,
  socket, logs) and a silofs.toml naming the store's endpoint, its mutual-TLS listener
  and, when clustered, its [cluster] (the members as the others reach them: through a
  fault proxy in front of its peer port if asked for); started one after the other,
  the cluster handed over once every node counts every member up;
- mounts: FUSE mounts live in this host's mount namespace (a mount process reaches its
  daemon by the Unix socket, which needs no network);
- reading: one epoch on every node at once, each in its own order with its own reader
  threads, every byte compared to the source, each file's page cache dropped after it
  is read (so the next epoch reaches FUSE again);
- placement as the members compute it (silofs.node.placement), for a test to predict
  which node is a chunk's home.

Everything is torn down on exit even when the body raised: mounts unmounted, daemons and
mount processes stopped, proxies closed, namespaces deleted. Never asserts a promise of
silofs (tests do) and never decides what is measured (bench/ does).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.faultproxy import FaultPlan, FaultProxy
from tests.support.net import Bridge, Link, bridge
from tests.support.node import Node, drop_file_cache
from tests.support.poll import wait_for
from tests.support.servers import S3Server

PEER_PORT = 7470  # each node's mutual-TLS listener
PROXY_PORT = 7471  # a fault proxy in front of a node's listener, in its namespace
MIB = 1 << 20


@dataclass(frozen=True)
class ClusterSpec:
    """What cluster to make.

    nodes           how many (roles n1..nN)
    cache_size      each node's cache, bytes
    chunk_size      the daemons' chunk size, bytes
    clustered       False: every node stands alone (no [cluster]); the same network
    members         the roles in the member list at start (None: all); the others are
                    started with the whole list (a member being added)
    weights         role -> cache weight (default 1.0)
    proxied         roles whose peer port others reach through a fault proxy
    node_link       each node's link to the bridge
    store_rate      the store link's bytes/s (None: unlimited)
    store_first_byte  the store's first-byte latency, seconds
    cluster         more [cluster] keys (peer_timeout_seconds, ...)
    name            the cluster's name
    mount_buffer    each mount's chunk buffer (SILOFS_BUFFER_BYTES); None: 8 chunks,
                    what a few readers have in flight (the default is sized for
                    read-ahead, and would be a private cache beside the node's)
    """

    nodes: int = 4
    cache_size: int = 64 * MIB
    chunk_size: int = 256 << 10
    clustered: bool = True
    members: tuple[str, ...] | None = None
    weights: dict[str, float] = field(default_factory=dict)
    proxied: tuple[str, ...] = ()
    node_link: Link = Link(rate=125e6)
    store_rate: float | None = 50e6
    store_first_byte: float = 0.02
    cluster: dict[str, Any] = field(default_factory=dict)
    name: str = "test-cluster"
    mount_buffer: int | None = None

    @property
    def roles(self) -> list[str]:
        return [f"n{i + 1}" for i in range(self.nodes)]


@dataclass
class ClusterNode:
    """One node: its role, address, member address (as the others reach it), its Node
    (daemon, logs, mounts) and, if proxied, the fault proxy in front of its peer port."""

    role: str
    ip: str
    member: str
    node: Node
    proxy: FaultProxy | None = None
    mountpoint: Path | None = None
    job: str = ""

    @property
    def pid(self) -> int:
        return self.node.daemon_pid

    def status(self) -> dict:
        return self.node.status()

    def cluster_status(self) -> dict | None:
        return self.node.status().get("cluster")

    def mount_status(self) -> dict:
        assert self.mountpoint is not None
        return self.node.mount_status(self.mountpoint)

    def dataset_status(self, uri: str) -> dict:
        for ds in self.node.status()["datasets"]:
            if ds["uri"] == uri:
                return ds
        raise AssertionError(f"{self.role}: no dataset {uri} in status")


@dataclass
class Cluster:
    """A running cluster (see `cluster`)."""

    spec: ClusterSpec
    root: Path
    net: Bridge
    store: S3Server
    store_proxy: FaultProxy
    pki: Path
    nodes: dict[str, ClusterNode]
    env: dict[str, str]

    @property
    def endpoint_url(self) -> str:
        return self.store_proxy.url

    def store_bytes(self) -> int:
        """Bytes the store link carried to the nodes so far (bodies and heads)."""
        return self.store_proxy.stats["bytes_to_client"]

    def members(self, roles: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """The member list of `roles` (default: the spec's members), as [cluster] and
        PUT /v1/cluster write it."""
        roles = roles if roles is not None else (self.spec.members or self.spec.roles)
        return [
            {"address": self.nodes[r].member, "weight": self.spec.weights.get(r, 1.0)}
            for r in roles
        ]

    # -- nodes ---------------------------------------------------------------------
    def start(self, role: str) -> None:
        """Start (or restart, after a kill) a node's daemon in its namespace."""
        self.nodes[role].node.start()

    def mount(self, role: str, uri: str, job: str | None = None, name: str = "data") -> Path:
        """Mount `uri` on node `role` (in this host's mount namespace) at mnt-NAME-ROLE."""
        cn = self.nodes[role]
        cn.job = job or f"train-{role}"
        buffer = self.spec.mount_buffer or 8 * self.spec.chunk_size
        env = {"SILOFS_BUFFER_BYTES": str(buffer)}
        mp = self.root / f"mnt-{name}-{role}"
        cn.mountpoint = cn.node.mount(uri, mp, "--job", cn.job, env=env)
        return cn.mountpoint

    def push_members(self, roles: Sequence[str], targets: Sequence[str] | None = None) -> None:
        """The members `roles` pushed to `targets` (default: those members) as an
        operator does it: `silofs-ctl cluster set` over each node's socket (one version
        for all, the weights as --weight)."""
        members = self.members(roles)
        args = ["cluster", "set", "--name", self.spec.name]
        args += ["--nodes", ",".join(self.nodes[r].node.socket for r in targets or roles)]
        args += ["--members", ",".join(m["address"] for m in members)]
        for m in members:
            args += ["--weight", f"{m['address']}={m['weight']:g}"]
        _ctl(*args)

    # -- placement ------------------------------------------------------------------
    def homes(
        self, bucket: str, prefix: str = "", roles: Sequence[str] | None = None
    ) -> dict[tuple[str, int], str]:
        """(object key, chunk index) -> the role of its home among the live `roles`
        (default: the spec's members), as every member computes it: weighted rendezvous
        hashing (silofs.node.placement) of the chunk key, made from the content id the
        S3 listing reports."""
        from silofs.cache.format import chunk_key
        from silofs.node.placement import Candidate, home

        roles = roles if roles is not None else (self.spec.members or self.spec.roles)
        by_address = {self.nodes[r].member: r for r in roles}
        candidates = [Candidate(m["address"], m["weight"]) for m in self.members(roles)]
        out = {}
        cs = self.spec.chunk_size
        for key, size, etag in list_objects(self.store, bucket, prefix):
            content_id = f"s3:{etag}:{size}"
            for index in range(max(1, -(-size // cs))):
                member = home(chunk_key(content_id, cs, index), candidates)
                out[(key[len(prefix) :], index)] = by_address[member.address]
        return out

    # -- faults ---------------------------------------------------------------------
    def fault(self, role: str, plan: FaultPlan) -> FaultProxy:
        """Put `plan` on the proxy in front of `role`'s peer port (spec.proxied)."""
        proxy = self.nodes[role].proxy
        if proxy is None:
            raise ValueError(f"{role} is not proxied (ClusterSpec.proxied)")
        proxy.set_plan(plan)
        return proxy


def list_objects(store: S3Server, bucket: str, prefix: str = "") -> list[tuple[str, int, str]]:
    """(key, size, ETag without quotes) of every object under `prefix`."""
    client = store.client()
    out = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            out.append((o["Key"], int(o["Size"]), o["ETag"].strip('"')))
    return out


# ---------------------------------------------------------------------------------------
# Making one


def _ctl(*args: str) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "silofs_ctl", *args], capture_output=True, text=True, timeout=120
    )
    if res.returncode != 0:
        raise RuntimeError(f"silofs-ctl {' '.join(args)}: {res.stderr.strip()}")


def make_pki(directory: Path, nodes: dict[str, str]) -> Path:
    """A CA (ca.pem, controller.pem) and a node certificate per role for its address,
    with `silofs-ctl certs` as an operator makes them."""
    _ctl("certs", "init", str(directory))
    for role, address in nodes.items():
        _ctl("certs", "node", str(directory), role, "--address", address)
    return directory


def node_env(store: S3Server) -> dict[str, str]:
    """A node daemon's environment: the store's credentials only (no ~/.aws, no
    instance metadata, no proxy)."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.update(store.env)
    env.update(
        {
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
        }
    )
    env.pop("AWS_ENDPOINT_URL", None)
    return env


def _config(c: Cluster, cn: ClusterNode, members: list[dict[str, Any]] | None) -> str:
    pki = c.pki
    text = textwrap.dedent(f"""\
        [backend]
        endpoint_url = "{c.endpoint_url}"

        [control]
        tcp_listen = "{cn.ip}:{PEER_PORT}"
        tls_cert = "{pki}/{cn.role}.pem"
        tls_key = "{pki}/{cn.role}.key"
        tls_client_ca = "{pki}/ca.pem"
        """)
    if members is None:
        return text
    listed = ", ".join(f'{{ address = "{m["address"]}", weight = {m["weight"]} }}' for m in members)
    text += textwrap.dedent(f"""\

        [cluster]
        name = "{c.spec.name}"
        address = "{cn.member}"
        members = [{listed}]
        """)
    for key, value in c.spec.cluster.items():
        text += f"{key} = {_toml(value)}\n"
    return text


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


def _peer_proxy(net: Bridge, pki: Path, role: str, asker: str) -> FaultProxy:
    """A TLS-terminating fault proxy in `role`'s namespace, in front of its listener:
    it shows the askers `role`'s own certificate and asks `role` with `asker`'s (a
    member's), so faults land on the HTTP inside."""
    import ssl

    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(pki / f"{role}.pem", pki / f"{role}.key")
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.load_cert_chain(pki / f"{asker}.pem", pki / f"{asker}.key")
    client.load_verify_locations(pki / "ca.pem")
    ip = net.address(role)
    return FaultProxy(
        (ip, PEER_PORT),
        listen=(ip, PROXY_PORT),
        listen_netns=net.names[role],
        upstream_netns=net.names[role],
        tls_server=server,
        tls_upstream=client,
        upstream_hostname=ip,
        idle_timeout=60.0,
    ).start()


@contextmanager
def cluster(
    root: Path, store: S3Server, spec: ClusterSpec, start: bool = True
) -> Iterator[Cluster]:
    """A cluster made to `spec` under `root`, its nodes' daemons started (unless
    `start` is False); torn down on exit whatever happened."""
    roles = spec.roles
    with ExitStack() as stack:
        links = dict.fromkeys(roles, spec.node_link)
        net = stack.enter_context(bridge("hub", roles, links=links))
        port = int(store.endpoint_url.rsplit(":", 1)[1])
        store_proxy = FaultProxy(
            ("127.0.0.1", port),
            FaultPlan(first_byte_delay=spec.store_first_byte, bandwidth=spec.store_rate),
            listen=(net.address("hub"), 0),
            listen_netns=net.names["hub"],
            idle_timeout=60.0,
        ).start()
        stack.callback(store_proxy.close)
        pki = make_pki(root / "pki", {r: net.address(r) for r in roles})
        nodes: dict[str, ClusterNode] = {}
        c = Cluster(spec, root, net, store, store_proxy, pki, nodes, node_env(store))
        for i, role in enumerate(roles):
            ip = net.address(role)
            proxy = None
            if role in spec.proxied:
                asker = roles[(i + 1) % len(roles)]
                proxy = _peer_proxy(net, pki, role, asker)
                stack.callback(proxy.close)
            port_seen = PROXY_PORT if proxy is not None else PEER_PORT
            node = Node(
                root / role,
                spec.cache_size,
                c.env,
                chunk_size=str(spec.chunk_size),
                config=root / role / "silofs.toml",
                prefix=net.exec_prefix(role),
            )
            stack.callback(node.cleanup)
            nodes[role] = ClusterNode(role, ip, f"tls://{ip}:{port_seen}", node, proxy)
        for cn in nodes.values():
            members = None
            if spec.clustered:
                starting = spec.members or roles
                members = c.members(starting if cn.role in starting else roles)
            (root / cn.role / "silofs.toml").write_text(_config(c, cn, members))
        if start:
            for role in roles:
                c.start(role)
            if spec.clustered:
                # Started one after the other: each node pinged the later ones while
                # they were still starting, was refused, and counts them down for the
                # backoff (doubling with each refusal) until its next probe. Tests begin
                # with every member up everywhere (their reads' homes, their parts).
                # Not a node outside the starting list: the members refuse its pings
                # until a test puts it on theirs.
                for role in spec.members or roles:
                    wait_for(
                        lambda role=role: _all_up(nodes[role].node),
                        timeout=60,
                        what=f"{role} to find every member up",
                    )
        yield c


def _all_up(node: Node) -> bool:
    view = node.request("GET", "/v1/cluster")
    return all(m["state"] == "up" for m in view["members"])


# ---------------------------------------------------------------------------------------
# Reading an epoch


@dataclass
class FileRead:
    key: str
    seconds: float
    nbytes: int
    wrong: int
    error: str | None = None


@dataclass
class EpochReads:
    """One node's epoch: every file it read, in order of completion."""

    role: str
    reads: list[FileRead] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.reads)

    @property
    def wrong_bytes(self) -> int:
        return sum(r.wrong for r in self.reads)

    @property
    def errors(self) -> list[FileRead]:
        return [r for r in self.reads if r.error is not None]

    @property
    def slowest(self) -> float:
        return max((r.seconds for r in self.reads), default=0.0)


def wrong_bytes(got: bytes, want: bytes) -> int:
    """Bytes of `got` that differ from `want`, a missing or extra byte counting one."""
    if got == want:
        return 0
    n = min(len(got), len(want))
    return sum(1 for a, b in zip(got[:n], want[:n], strict=True) if a != b) + abs(
        len(got) - len(want)
    )


def read_file(path: Path, want: bytes) -> FileRead:
    """One whole file read through a mount, compared to the source, its pages dropped."""
    t0 = time.monotonic()
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            parts = []
            while chunk := os.read(fd, 1 << 20):
                parts.append(chunk)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    except OSError as exc:
        return FileRead(str(path), time.monotonic() - t0, 0, 0, f"{exc.strerror or exc}")
    got = b"".join(parts)
    return FileRead(str(path), time.monotonic() - t0, len(got), wrong_bytes(got, want))


def epoch(
    mounts: dict[str, Path],
    files: dict[str, bytes],
    seed: int,
    readers: int = 4,
    stop: threading.Event | None = None,
    out: dict[str, EpochReads] | None = None,
) -> dict[str, EpochReads]:
    """Every node in `mounts` reads every file once, all nodes at once, each in its own
    random order (seeded by `seed` and the role) with `readers` threads taking the
    next file as a data loader's workers do; `stop` set ends it early. `out`, if given,
    is filled as reads complete (another thread may watch the progress)."""
    out = out if out is not None else {}
    out.update({role: EpochReads(role) for role in mounts})
    lock = threading.Lock()

    def node_epoch(role: str, mp: Path) -> None:
        order = sorted(files)
        random.Random(f"{seed}:{role}").shuffle(order)
        it = iter(order)
        t0 = time.monotonic()

        def worker() -> None:
            while stop is None or not stop.is_set():
                with lock:
                    key = next(it, None)
                if key is None:
                    return
                r = read_file(mp / key, files[key])
                r.key = key
                with lock:
                    out[role].reads.append(r)

        threads = [threading.Thread(target=worker) for _ in range(readers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out[role].seconds = time.monotonic() - t0

    threads = [threading.Thread(target=node_epoch, args=item) for item in mounts.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def drop_pages(mp: Path, files: Sequence[str]) -> None:
    """Drop the page cache of `files` under a mount (a read reaches FUSE again)."""
    for key in files:
        drop_file_cache(mp / key)
