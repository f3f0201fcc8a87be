"""One cache across four node daemons, each a host of its own: a network namespace on
one bridged subnet with a shaped link, its own cache dir, socket, certificate and FUSE
mount (tests/support/netcluster.py), all reading one moto bucket through a fault proxy
that limits the store's link and counts what it sends.

- Four nodes, one dataset, each its own random order, each node's cache a quarter of
  the dataset (and the slack placement needs): over two epochs the store sends about the
  dataset once, every node's epoch-2 hit ratio is >= 0.95, every byte is right, and
  the chunks are held once in the cluster, each at the home placement names.
- A cluster share of half the dataset: every node's epoch-2 hit ratio is 0.5 +- 0.05.
- A peer answering flipped bytes, a short body or too slowly (a TLS-terminating fault
  proxy in front of its peer port): detected, counted by reason, served from the store.
- kill -9 of a home mid-epoch: every read elsewhere completes within the peer bound plus
  the store's time with right bytes; restarted, the home is found up and serves again.
- A member down for a backoff its refusals grew, restarted: its first ping has it
  probed and up again at once, not when that backoff ends.
- A home cut off the network (no reset): one read waits the bound, the next skip it.
- A store slower than the peer bound is not a dead home (102 Processing), and three
  nodes asking one chunk at once cause one store GET.
- Certificates: a node certificate naming no member and a controller's certificate are
  refused on the peer routes, a member's certificate on an admin route too.
- A member added mid-epoch (its own cluster; the list pushed with `silofs-ctl cluster
  set`): about 1/4 of the chunks change home, only those are fetched again, nothing is
  served wrong, and the epoch after is all hits.

Waiting is polling with a deadline. The tests of the first cluster share it (made once
per module) and run in file order: each leaves the caches in a state the next can
start from. Needs root (namespaces), tc and FUSE; skipped with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import math
import random
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.faultproxy import Fault, FaultPlan
from tests.support.fixtures import needs_fuse
from tests.support.net import Link, NetnsUnavailable, ShapingUnavailable, netns_socket
from tests.support.netcluster import (
    PEER_PORT,
    Cluster,
    ClusterSpec,
    EpochReads,
    cluster,
    epoch,
    read_file,
)
from tests.support.poll import wait_for
from tests.support.servers import S3Server
from tests.support.trees import random_files

pytestmark = [needs_fuse, pytest.mark.fuse, pytest.mark.servers]

CHUNK = 128 << 10
FILES = 256  # one chunk each: 32 MiB per dataset
DATASET = FILES * CHUNK
NODES = 4
# Weighted rendezvous hashing gives each member a binomial share of the chunks (std
# ~sqrt(3/FILES) of a quarter: 11% here): a cache of exactly a quarter would leave the
# members over their quarter missing in every epoch. docs/SEMANTICS.md states the slack
# that makes that rare for any placement (+32% here); the placements here are fixed by
# the datasets' content ids and the members' addresses (the largest home of the first
# dataset holds 1.05 quarters, of the others up to 1.23).
SLACK = 1.2
PEER_TIMEOUT = 2.0
BACKOFF = 0.5
DEADLINE = 60.0


def _files(seed: int) -> dict[str, bytes]:
    return random_files(seed, FILES, CHUNK, "train/{i:04d}.bin")


def _make(
    tmp_path_factory: pytest.TempPathFactory, store: S3Server, spec: ClusterSpec
) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("cluster")
    try:
        with cluster(root, store, spec) as c:
            yield c
            problems = [p for cn in c.nodes.values() for p in cn.node.log_problems()]
    except (NetnsUnavailable, ShapingUnavailable) as exc:
        pytest.skip(str(exc))
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server) -> Iterator[Cluster]:
    """Four members, n2's peer port behind a (pass-through) fault proxy."""
    spec = ClusterSpec(
        nodes=NODES,
        cache_size=math.ceil(DATASET / NODES * SLACK),
        chunk_size=CHUNK,
        proxied=("n2",),
        node_link=Link(rate=125e6),
        store_rate=50e6,
        store_first_byte=0.01,
        cluster={"peer_timeout_seconds": PEER_TIMEOUT, "peer_backoff_seconds": BACKOFF},
    )
    yield from _make(tmp_path_factory, s3_server, spec)


def _dataset(c: Cluster, name: str, seed: int) -> tuple[str, dict[str, bytes]]:
    bucket = f"silofs-cluster-{name}-{random.randrange(1 << 30):x}"
    files = _files(seed)
    c.store.create(bucket, files)
    return bucket, files


def _mount_all(c: Cluster, bucket: str, roles: list[str], name: str) -> dict[str, Path]:
    return {r: c.mount(r, c.store.uri(bucket), name=name) for r in roles}


def _counters(c: Cluster, role: str, mp: Path) -> dict[str, int]:
    m = c.nodes[role].node.mount_status(mp)
    # hit_bytes: the bytes it read that a cache held (here, or at their home), as its
    # status' hit ratio counts them; remote_bytes: the store GETs its misses caused,
    # here or at their home.
    return {"read": m["bytes_read"], "hit": m["hit_bytes"], "store": m["remote_bytes"]}


def _run_epoch(
    c: Cluster,
    mounts: dict[str, Path],
    files: dict[str, bytes],
    seed: int,
    done: int,
    gets: dict[str, float] | None = None,
) -> tuple[dict[str, EpochReads], dict[str, float], int]:
    """One epoch on every mount: (reads, each node's hit ratio, store bytes sent).
    `done` epochs were read on these mounts before (their counters are cumulative).
    `gets`, if given, gets each node's share of its reads that caused no store GET
    charged to it: its hits, and the misses a GET made for another node's miss of
    the same chunk at the same moment served (the home's single flight, or its
    admission queue)."""
    before = {r: _counters(c, r, mp) for r, mp in mounts.items()}
    sent = c.store_bytes()
    reads = epoch(mounts, files, seed=seed, readers=4)
    size = sum(map(len, files.values()))
    ratios = {}
    for role, mp in mounts.items():
        c.nodes[role].node.settle(mp, (done + 1) * size)
        after = _counters(c, role, mp)
        ratios[role] = (after["hit"] - before[role]["hit"]) / (after["read"] - before[role]["read"])
        if gets is not None:
            gets[role] = 1 - (after["store"] - before[role]["store"]) / size
    return reads, ratios, c.store_bytes() - sent


@contextlib.contextmanager
def _epoch_past(
    mounts: dict[str, Path], files: dict[str, bytes], seed: int, part: int
) -> Iterator[dict[str, EpochReads]]:
    """An epoch on every mount in a thread; the body runs once every node has read
    1/`part` of it, and the epoch is over (its reads in the dict) when the block ends."""
    progress: dict[str, EpochReads] = {}
    worker = threading.Thread(
        target=epoch, args=(mounts, files, seed), kwargs={"readers": 4, "out": progress}
    )
    worker.start()
    try:
        wait_for(
            lambda: progress and all(len(r.reads) >= FILES // part for r in progress.values()),
            DEADLINE,
            f"1/{part} of the epoch read",
        )
        yield progress
    finally:
        worker.join()


def _assert_right(reads: dict[str, EpochReads], files: dict[str, bytes]) -> None:
    for role, r in reads.items():
        assert not r.errors, f"{role}: {r.errors[:3]}"
        assert r.wrong_bytes == 0, f"{role}: {r.wrong_bytes} wrong bytes"
        assert len(r.reads) == len(files), f"{role} read {len(r.reads)} of {len(files)}"


def _member(c: Cluster, asker: str, role: str) -> dict:
    """What node `asker` knows of member `role` (state, counters)."""
    view = c.nodes[asker].node.request("GET", "/v1/cluster")
    address = c.nodes[role].member
    return next(m for m in view["members"] if m["address"] == address)


def _share(c: Cluster, bucket: str, size: int) -> None:
    """`silofs-ctl allocate-cache` on n1: the dataset's cluster share, pushed to every
    member; back once every member has it."""
    uri = c.store.uri(bucket)
    node = c.nodes["n1"].node
    res = subprocess.run(
        [sys.executable, "-m", "silofs_ctl", "allocate-cache", uri, str(size),
         "--socket", node.socket],
        capture_output=True, text=True, timeout=60, env=node.env,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    for role in c.spec.members or c.spec.roles:
        wait_for(
            lambda role=role: _shares(c, role).get(uri) == size, DEADLINE, f"the share on {role}"
        )


def _shares(c: Cluster, role: str) -> dict:
    return c.nodes[role].node.request("GET", "/v1/cluster")["shares"]


def _release(c: Cluster, bucket: str) -> None:
    """A share of 0 for a dataset a test is done with: every home evicts its chunks, so
    the next test starts with the caches to itself."""
    _share(c, bucket, 0)
    for role in c.spec.roles:
        wait_for(lambda role=role: _held(c, role, bucket) == 0, DEADLINE, f"{role} evicting")


def _held(c: Cluster, role: str, bucket: str) -> int:
    """The chunks of a dataset node `role` holds, whether it has the dataset open or
    holds it only for the members (the cluster view's datasets)."""
    uri = c.store.uri(bucket)
    status = c.nodes[role].status()
    for ds in (status.get("cluster") or {}).get("datasets", []):
        if ds["uri"] == uri:
            return ds["cached_bytes"] // CHUNK  # one-chunk files
    return next((ds["cached_chunks"] for ds in status["datasets"] if ds["uri"] == uri), 0)


# ---------------------------------------------------------------------------------------
# Four members, each cache a quarter


@pytest.mark.slow
def test_four_nodes_fetch_each_chunk_once_and_hit_in_epoch_two(four: Cluster) -> None:
    c = four
    bucket, files = _dataset(c, "quarter", 1)
    mounts = _mount_all(c, bucket, c.spec.roles, "quarter")
    reads1, _, sent1 = _run_epoch(c, mounts, files, seed=11, done=0)
    _assert_right(reads1, files)
    reads2, ratios2, sent2 = _run_epoch(c, mounts, files, seed=12, done=1)
    _assert_right(reads2, files)
    print(f"store: epoch 1 {sent1 / DATASET:.3f} D, epoch 2 {sent2 / DATASET:.3f} D; "
          f"epoch-2 hit ratios {ratios2}")  # fmt: skip
    # Alone, four nodes would have had the store send ~7 D (4 D, then 3 D).
    assert 0.95 * DATASET <= sent1 + sent2 <= 1.1 * DATASET
    assert all(h >= 0.95 for h in ratios2.values()), ratios2
    # One copy per chunk in the cluster, each at the home placement names.
    homes = c.homes(bucket)
    held = {r: _held(c, r, bucket) for r in c.spec.roles}
    assert sum(held.values()) == len(homes), (held, len(homes))
    for role in c.spec.roles:
        assert held[role] == sum(1 for h in homes.values() if h == role), held
    _release(c, bucket)


@pytest.mark.slow
def test_a_cluster_share_of_half_the_dataset_is_half_the_hits_everywhere(four: Cluster) -> None:
    c = four
    bucket, files = _dataset(c, "half", 2)
    mounts = _mount_all(c, bucket, c.spec.roles, "half")
    _share(c, bucket, DATASET // 2)
    try:
        reads1, _, _ = _run_epoch(c, mounts, files, seed=21, done=0)
        _assert_right(reads1, files)
        gets: dict[str, float] = {}
        reads2, ratios2, _ = _run_epoch(c, mounts, files, seed=22, done=1, gets=gets)
        _assert_right(reads2, files)
        print(f"epoch-2 hit ratios with a share of half: {ratios2}; reads without a "
              f"store GET of their own: {gets}")  # fmt: skip
        # The share is what the homes may hold: each its part (equal weights: a quarter).
        for role in c.spec.roles:
            held = _held(c, role, bucket) * CHUNK
            assert held <= DATASET // 2 // NODES, f"{role} holds {held} of a share of half"
        # The share's hits everywhere (issue 22: 0.5 +- 0.05). A chunk another node
        # missed a moment before, still in flight or waiting in its home's admission
        # queue, is served from there with no store GET, but as a miss ("shared"), not a
        # hit: it saves GETs beyond the hits (4 nodes reading at once: ~5%), never hits.
        assert all(0.45 <= h <= 0.55 for h in ratios2.values()), ratios2
        assert all(gets[r] >= ratios2[r] for r in ratios2), (gets, ratios2)
    finally:
        _release(c, bucket)  # the module's cluster: the next test needs the room


# ---------------------------------------------------------------------------------------
# A peer that answers wrong


@pytest.fixture(scope="module")
def faulty(four: Cluster) -> dict:
    """A dataset mounted on n1, and the files homed at n2 not read yet."""
    bucket, files = _dataset(four, "faults", 3)
    mp = four.mount("n1", four.store.uri(bucket), name="faults")
    fresh = sorted(k for (k, _), h in four.homes(bucket).items() if h == "n2")
    return {"bucket": bucket, "files": files, "mp": mp, "fresh": fresh}


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        (Fault("corrupt", path="^/v1/peer/chunk"), "corrupt"),
        (Fault("truncate", path="^/v1/peer/chunk", at=0.5), "short"),
        (Fault("delay", path="^/v1/peer/chunk", seconds=PEER_TIMEOUT + 2), "timeout"),
    ],
    ids=["flipped-byte", "short-body", "too-slow"],
)
def test_a_peer_answering_wrong_is_detected_counted_and_read_from_the_store(
    four: Cluster, faulty: dict, fault: Fault, reason: str
) -> None:
    c = four
    files, mp, fresh = faulty["files"], faulty["mp"], faulty["fresh"]
    wait_for(lambda: _member(c, "n1", "n2")["state"] == "up", DEADLINE, "n2 up, seen by n1")
    key = fresh.pop()
    before, sent = _member(c, "n1", "n2"), c.store_bytes()
    proxy = c.fault("n2", FaultPlan(faults=[fault]))
    try:
        r = read_file(mp / key, files[key])
    finally:
        proxy.set_plan(FaultPlan())
    after = _member(c, "n1", "n2")
    assert r.error is None and r.wrong == 0, r
    assert proxy.stats[fault.kind] >= 1
    assert after["errors"].get(reason, 0) == before["errors"].get(reason, 0) + 1, after
    assert after["store_fallbacks"] == before["store_fallbacks"] + 1, after
    path = f"/{faulty['bucket']}/{key}"  # n1 read it from the store itself
    gets = c.store_proxy.wait_history(
        lambda h: any(x.target.startswith(path) and x.client == c.nodes["n1"].ip for x in h)
    )
    assert c.store_bytes() - sent >= CHUNK, gets[-3:]
    # The read waited no longer than the bound (and the store's time) on a slow peer.
    assert r.seconds < PEER_TIMEOUT + 5.0, r
    wait_for(lambda: _member(c, "n1", "n2")["state"] == "up", DEADLINE, "n2 up again")
    # Back up, it serves n1 again: right bytes, no new error.
    key = fresh.pop()
    r = read_file(mp / key, files[key])
    assert r.error is None and r.wrong == 0, r
    again = _member(c, "n1", "n2")
    assert again["errors"] == after["errors"] and again["bytes_in"] > after["bytes_in"]


# ---------------------------------------------------------------------------------------
# A home killed mid-epoch


@pytest.mark.slow
def test_a_home_killed_mid_epoch_fails_no_read_and_serves_again_once_back(
    four: Cluster,
) -> None:
    c = four
    victim, readers = "n3", ["n1", "n2", "n4"]
    bucket, files = _dataset(c, "kill", 4)
    mounts = _mount_all(c, bucket, readers, "kill")
    _share(c, bucket, int(DATASET * SLACK))  # each home's part: its whole cache
    reads, _, _ = _run_epoch(c, mounts, files, seed=41, done=0)  # the homes hold them
    _assert_right(reads, files)
    with _epoch_past(mounts, files, seed=42, part=4) as progress:
        c.nodes[victim].node.kill9()
    _assert_right(progress, files)
    slowest = max(r.slowest for r in progress.values())
    # Connection refused at once; a chunk's store GET on this host takes well under
    # a second (load included): a read never waited on the dead home.
    assert slowest < PEER_TIMEOUT + 3.0, slowest
    # Each reader finds it down: by a refused ask, or, one that needed none of its chunks
    # after the kill (done with its epoch first: n1, in one run under load), by its
    # next ping (every 5 s).
    for role in readers:
        wait_for(
            lambda role=role: _member(c, role, victim)["state"] == "down",
            DEADLINE,
            f"{victim} down, seen by {role}",
        )
    c.start(victim)
    for role in readers:
        wait_for(
            lambda role=role: _member(c, role, victim)["state"] == "up",
            DEADLINE,
            f"{victim} up again, seen by {role}",
        )
    # It serves its chunks again, from the cache it kept through kill -9; n1 holds
    # those it was the next home of while the victim was down (and read meanwhile).
    ours = [k for (k, _), h in c.homes(bucket).items() if h == victim]
    stand_in = c.homes(bucket, roles=readers)
    at_n1 = sum(1 for k in ours if stand_in[(k, 0)] == "n1")
    before, sent = _member(c, "n1", victim), c.store_bytes()
    for key in ours:
        r = read_file(mounts["n1"] / key, files[key])
        assert r.error is None and r.wrong == 0, r
    after = _member(c, "n1", victim)
    served = (after["bytes_in"] - before["bytes_in"]) // CHUNK  # values: a header each
    assert len(ours) - at_n1 <= served <= len(ours), (served, len(ours), at_n1)
    assert after["errors"] == before["errors"]
    assert c.store_bytes() - sent < CHUNK * len(ours) // 10  # hits at the home
    _release(c, bucket)


def test_a_member_down_that_calls_is_probed_then_not_at_its_backoffs_end(
    four: Cluster,
) -> None:
    """A member refused while it was gone stays down here for a backoff its refusals
    doubled (to 16 s here); back, its first ping reaches this node at once: it is
    probed then and up again well before that backoff ends."""
    c = four
    victim, asker = "n3", "n1"
    c.nodes[victim].node.kill9()
    # Refused probes in a row double its backoff (0.5, 1, 2, 4, 8 s): the next is 16 s
    # after the fifth.
    wait_for(
        lambda: _member(c, asker, victim)["down_for_s"] > 12.0,
        DEADLINE,
        f"{asker}'s probes of {victim} refused until its backoff is long",
    )
    left = _member(c, asker, victim)["down_for_s"]
    assert _member(c, asker, victim)["errors"].get("refused", 0) >= 5
    t0 = time.monotonic()
    c.start(victim)
    wait_for(lambda: _member(c, asker, victim)["state"] == "up", DEADLINE, f"{victim} up")
    back = time.monotonic() - t0
    print(f"{victim} up at {asker} {back:.1f} s after its start, its backoff had {left:.1f} s")
    assert back < left - 3.0, (back, left)
    for role in ("n2", "n4"):
        wait_for(
            lambda role=role: _member(c, role, victim)["state"] == "up",
            DEADLINE,
            f"{victim} up again, seen by {role}",
        )


def test_a_home_cut_off_the_network_never_holds_a_read_longer_than_the_bound(
    four: Cluster, faulty: dict
) -> None:
    """No reset, no answer (its link off the bridge): the first read of one of its
    chunks waits the peer bound and reads from the store; the next ones skip it."""
    c = four
    files, mp = faulty["files"], faulty["mp"]
    victim = "n4"
    ours = sorted(k for (k, _), h in c.homes(faulty["bucket"]).items() if h == victim)[:6]
    before = _member(c, "n1", victim)
    c.net.set_link(victim, up=False)
    try:
        reads = [read_file(mp / key, files[key]) for key in ours]
    finally:
        c.net.set_link(victim, up=True)
    assert all(r.error is None and r.wrong == 0 for r in reads), reads
    print(f"reads with {victim} cut off: {[round(r.seconds, 2) for r in reads]}")
    assert max(r.seconds for r in reads) < PEER_TIMEOUT + 3.0
    assert sum(r.seconds for r in reads[1:]) < PEER_TIMEOUT  # it was skipped after one
    after = _member(c, "n1", victim)
    assert after["errors"].get("timeout", 0) > before["errors"].get("timeout", 0), after
    wait_for(lambda: _member(c, "n1", victim)["state"] == "up", DEADLINE, f"{victim} back")


def test_a_slow_store_is_not_a_dead_peer_and_is_asked_once_for_all(four: Cluster) -> None:
    """The store's first byte slower than the peer bound: the home says 102 while it
    waits, so three nodes asking it for one chunk at once wait for it (no timeout, no
    fallback) and the store is asked once."""
    c = four
    bucket, files = _dataset(c, "slow", 6)
    askers, home = ["n1", "n2", "n4"], "n3"
    mounts = _mount_all(c, bucket, askers, "slow")
    key = sorted(k for (k, _), h in c.homes(bucket).items() if h == home)[0]
    before = {r: _member(c, r, home) for r in askers}
    c.store_proxy.set_plan(FaultPlan(first_byte_delay=PEER_TIMEOUT + 1.5, bandwidth=50e6))
    try:
        start = threading.Barrier(len(askers))

        def read(role: str) -> object:
            start.wait()
            return read_file(mounts[role] / key, files[key])

        with ThreadPoolExecutor(len(askers)) as pool:
            reads = list(pool.map(read, askers))
    finally:
        c.store_proxy.set_plan(FaultPlan(first_byte_delay=0.01, bandwidth=50e6))
    assert all(r.error is None and r.wrong == 0 for r in reads), reads
    assert min(r.seconds for r in reads) >= PEER_TIMEOUT  # they did wait for the store
    path = f"/{bucket}/{key}"
    gets = c.store_proxy.wait_history(lambda h: any(x.target.startswith(path) for x in h))
    assert sum(1 for x in gets if x.method == "GET" and x.target.startswith(path)) == 1
    for role in askers:
        after = _member(c, role, home)
        assert after["errors"] == before[role]["errors"], (role, after)
        assert after["store_fallbacks"] == before[role]["store_fallbacks"]
        assert (after["bytes_in"] - before[role]["bytes_in"]) // CHUNK == 1  # (and a header)
        assert after["state"] == "up"


# ---------------------------------------------------------------------------------------
# Who may call the peer routes


def _ask(c: Cluster, ctx: ssl.SSLContext, path: str, named: str | None) -> int | None:
    """A request to n1's listener from the hub's namespace: the HTTP status, or None if
    the TLS handshake (or the connection) failed."""
    ip = c.nodes["n1"].ip
    sock = netns_socket(c.net.names["hub"])
    sock.settimeout(10)
    try:
        sock.connect((ip, PEER_PORT))
        with ctx.wrap_socket(sock, server_hostname=ip) as tls:
            head = f"GET {path} HTTP/1.1\r\nhost: {ip}\r\nconnection: close\r\n"
            if named is not None:
                head += f"x-silofs-cluster: {named}\r\n"
            tls.sendall((head + "\r\n").encode())
            line = tls.recv(4096).split(b"\r\n", 1)[0]
    except (ssl.SSLError, OSError):
        return None
    finally:
        sock.close()
    parts = line.split()
    return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None


def _ctx(pki: Path, name: str, ca: Path | None = None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(pki / "ca.pem")
    ctx.load_cert_chain((ca or pki) / f"{name}.pem", (ca or pki) / f"{name}.key")
    return ctx


def test_only_members_certificates_reach_the_peer_routes(four: Cluster, tmp_path: Path) -> None:
    c = four
    pki = c.pki
    ctl = [sys.executable, "-m", "silofs_ctl", "certs"]
    for args in (["node", str(pki), "stranger", "--address", "10.213.0.99"],
                 ["init", str(tmp_path / "foreign")]):  # fmt: skip
        res = subprocess.run([*ctl, *args], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
    name = c.spec.name
    ping = "/v1/peer/ping"
    assert _ask(c, _ctx(pki, "n3"), ping, name) == 200  # a member
    assert _ask(c, _ctx(pki, "n3"), ping, "another-cluster") == 403
    assert _ask(c, _ctx(pki, "n3"), "/v1/status", None) == 403  # a member, an admin route
    assert _ask(c, _ctx(pki, "stranger"), ping, name) == 403  # a node, not a member
    assert _ask(c, _ctx(pki, "controller"), ping, name) == 403  # a controller
    assert _ask(c, _ctx(pki, "controller"), "/v1/status", None) == 200
    assert _ask(c, _ctx(pki, "controller", tmp_path / "foreign"), ping, name) is None
    chunk = "/v1/peer/chunk?ds=s3://x/&key=a&cid=c&size=1&version=v&cs=131072&i=0&job=j"
    assert _ask(c, _ctx(pki, "controller"), chunk, name) == 403
    assert _ask(c, _ctx(pki, "stranger"), chunk, name) == 403
    assert c.nodes["n1"].status()["cluster"]["name"] == name  # still serving


# ---------------------------------------------------------------------------------------
# A member added mid-epoch


@pytest.fixture(scope="module")
def joining(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server) -> Iterator[Cluster]:
    """Three members; n4 runs with the four-member list, not yet a member of the others'."""
    spec = ClusterSpec(
        nodes=NODES,
        cache_size=math.ceil(DATASET / 3 * SLACK),
        chunk_size=CHUNK,
        members=("n1", "n2", "n3"),
        store_rate=50e6,
        store_first_byte=0.01,
        cluster={"peer_timeout_seconds": PEER_TIMEOUT, "peer_backoff_seconds": BACKOFF},
        name="joining",
    )
    yield from _make(tmp_path_factory, s3_server, spec)


@pytest.mark.slow
def test_a_member_added_mid_epoch_moves_a_quarter_of_the_chunks(joining: Cluster) -> None:
    c = joining
    old, new = ["n1", "n2", "n3"], ["n1", "n2", "n3", "n4"]
    bucket, files = _dataset(c, "join", 5)
    mounts = _mount_all(c, bucket, old, "join")
    reads, _, sent = _run_epoch(c, mounts, files, seed=51, done=0)
    _assert_right(reads, files)
    assert sent <= 1.1 * DATASET
    before, after = c.homes(bucket, roles=old), c.homes(bucket, roles=new)
    moved = {k for k in before if before[k] != after[k]}
    assert all(after[k] == "n4" for k in moved)  # only to the new member
    assert 0.18 <= len(moved) / len(before) <= 0.32, len(moved)
    # Mid-epoch, every node is told the four members.
    sent = c.store_bytes()
    with _epoch_past(mounts, files, seed=52, part=3) as progress:
        c.push_members(new)
    _assert_right(progress, files)
    for role in old:
        wait_for(
            lambda role=role: _member(c, role, "n4")["state"] == "up", DEADLINE, f"n4 on {role}"
        )
    for role, mp in mounts.items():
        c.nodes[role].node.settle(mp, 2 * DATASET)
    reads, _, _ = _run_epoch(c, mounts, files, seed=53, done=2)
    _assert_right(reads, files)
    # The moved chunks were fetched once, by their new home (in the rest of the epoch
    # of the add or in the next: how much of it was left when the list took effect,
    # pushed by `silofs-ctl cluster set`, is the host's timing); the rest stayed hits.
    fetched = (c.store_bytes() - sent) / CHUNK
    assert len(moved) * 0.9 <= fetched <= len(moved) * 1.1 + 8
    assert _held(c, "n4", bucket) == len(moved)
    reads, ratios, _ = _run_epoch(c, mounts, files, seed=54, done=3)
    _assert_right(reads, files)
    print(f"moved {len(moved)} of {len(before)}; store GETs since the add ~{fetched:.0f}; "
          f"then hit ratios {ratios}")  # fmt: skip
    assert all(h >= 0.95 for h in ratios.values()), ratios
