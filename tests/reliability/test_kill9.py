"""kill -9 of the daemon and of the mount at random points, under verified reads and
allocation churn: no wrong byte, no committed chunk lost, no death the test did not cause.

Each iteration lets readers and two allocation churners (PUT /v1/datasets/{uri}/cache up and
down, concurrently) run until a random number of reads completed, then kills the daemon or
the mount process with SIGKILL, restarts it, and checks:

- every byte any reader got equals the source (reads go through a real FUSE mount, at random
  offsets through handles kept open across the kill, page cache dropped first), and no read
  ends early without an error (verify.pread_all);
- after a daemon kill: the usage rows equal the sum of the owners rows, every owners row has
  its chunk (the env as the dead daemon left it), and once the restarted daemon settled, the
  chunks committed before the kill are still there, except what enforcing the persisted
  allocation explains (missing chunks totalling at most usage - allocation plus one chunk,
  see unexplained());
- the daemon and the mount never die except when killed (checked before every kill);
  after a daemon restart the mount registers again by itself (promise 4), exactly once.

EIO while the daemon is down (misses) and ENOTCONN while the mount is down are expected and
counted, never compared. Short form 5 iterations, SILOFS_LONG=1: 100 (SILOFS_KILL_ITERATIONS
overrides). Seeded by SILOFS_KILL_SEED (default 1); timing still varies between runs.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from silofs.cache.store import DSID, USAGE_ROW, CacheStore, Usage
from silofs.control.client import ControlClient, ControlError, quote_segment
from silofs.node.store_write import env_map_size
from silofs.units import parse_size
from tests.support.fixtures import needs_fuse
from tests.support.node import Node, drop_file_cache, mounted
from tests.support.poll import wait_for
from tests.support.trees import random_files

from .conftest import scale
from .verify import pread_all

pytestmark = [needs_fuse, pytest.mark.fuse]

ITERATIONS = int(os.environ.get("SILOFS_KILL_ITERATIONS") or scale(5, 100))
SEED = int(os.environ.get("SILOFS_KILL_SEED", "1"))
CHUNK = 256 << 10
MB = 1 << 20
CACHE = "64M"
READERS = 3
SETTLE = 60.0  # seconds for the restarted daemon to enforce allocations / a mount to return


def make_tree(rnd: random.Random) -> dict[str, bytes]:
    """~10 MB: small whole-object chunks and multi-chunk files (edges on and off chunks)."""
    tree = random_files(rnd, 60, range(1, 120_001), "s/{i:03d}.bin")
    tree |= random_files(rnd, 6, [3 * CHUNK, 4 * CHUNK + 1, 5 * CHUNK - 7], "m/{i}.bin")
    tree["empty"] = b""
    return tree


class Verifier:
    """Counts what readers saw; thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reads = 0
        self.bytes = 0
        self.wrong_bytes = 0
        self.short_reads = 0
        self.errors: Counter[str] = Counter()
        self.wrong: list[str] = []

    def check(self, name: str, off: int, got: bytes, want: bytes, failed: bool = False) -> None:
        """`got` must be a prefix of `want`, and all of it unless the read `failed`."""
        wrong = sum(1 for a, b in zip(got, want, strict=False) if a != b) if got != want else 0
        with self.lock:
            self.reads += 1
            self.bytes += len(got)
            if len(got) > len(want) or (len(got) < len(want) and not failed):
                self.short_reads += 1
                self.wrong.append(f"{name}@{off}: {len(got)} bytes, want {len(want)}")
            if wrong:
                self.wrong_bytes += wrong
                self.wrong.append(f"{name}@{off}: {wrong} wrong bytes of {len(want)}")

    def error(self, exc: OSError) -> None:
        with self.lock:
            self.errors[errno.errorcode.get(exc.errno or 0, str(exc.errno))] += 1


def reader(mp: Path, tree: dict[str, bytes], seed: int, stop: threading.Event, v: Verifier) -> None:
    """Open a random file, read 1-4 random ranges through that handle, compare each."""
    rnd = random.Random(seed)
    names = sorted(tree)
    while not stop.is_set():
        name = rnd.choice(names)
        want = tree[name]
        try:
            drop_file_cache(mp / name)
            fd = os.open(mp / name, os.O_RDONLY)
            try:
                for _ in range(rnd.randint(1, 4)):
                    if rnd.random() < 0.3 or not want:
                        off, n = 0, len(want) + 1
                    else:
                        off = rnd.randrange(len(want))
                        n = rnd.randint(1, 3 * CHUNK)
                    got, exc, _ = pread_all(fd, n, off)
                    v.check(name, off, got, want[off : off + n], exc is not None)
                    if exc is not None:
                        raise exc
            finally:
                os.close(fd)
        except OSError as exc:
            v.error(exc)
            stop.wait(0.01)  # pacing while the daemon or the mount is down


def churner(node: Node, uri: str, seed: int, stop: threading.Event, counts: Counter) -> None:
    """Allocation changes up and down: 1-12 MiB (evicts) or back to the shared pool."""
    rnd = random.Random(seed)
    path = f"/v1/datasets/{quote_segment(uri)}/cache"
    while not stop.is_set():
        size = None if rnd.random() < 0.2 else rnd.randint(1, 12) * MB
        try:
            with ControlClient(node.socket, timeout=10) as c:
                c.request("PUT", path, {"bytes": size})
            counts["allocation changes"] += 1
        except ControlError:
            counts["allocation changes refused or unreachable"] += 1
        stop.wait(rnd.uniform(0.02, 0.2))  # pacing the churn, not synchronisation


def committed(store: CacheStore) -> tuple[dict[bytes, int], dict[int, int], list[str]]:
    """(chunk key -> length charged, bytes owned per dataset, accounting faults), all from
    one read txn, so a running writer cannot make a consistent env look inconsistent."""
    faults: list[str] = []
    owners: dict[bytes, int] = {}
    owned: dict[int, int] = {}
    counted: dict[int, int] = {}
    with store.env.begin() as txn:
        chunks = store.db(b"chunks")
        for k, v in txn.cursor(db=store.db(b"owners")):
            dsid, key = int.from_bytes(k[:8], "big"), bytes(k[8:])
            length = int.from_bytes(v, "little")
            owners[key] = length
            owned[dsid] = owned.get(dsid, 0) + length
            counted[dsid] = counted.get(dsid, 0) + 1
            if txn.get(key, db=chunks) is None:
                faults.append(f"owners row without its chunk {key.hex()}")
        usage = {
            DSID.unpack(k)[0]: Usage(*USAGE_ROW.unpack(v))
            for k, v in txn.cursor(db=store.db(b"usage"))
        }
    rows = {d: (u.bytes, u.chunks) for d, u in usage.items() if u.bytes or u.chunks}
    sums = {d: (owned[d], counted[d]) for d in owned}
    if rows != sums:
        faults.append(f"usage rows (bytes, chunks) {rows} != owners rows {sums}")
    return owners, owned, faults


def allocation(store: CacheStore, uri: str) -> int | None:
    """The dataset's cache allocation as the daemon persisted it (its meta row)."""
    with store.env.begin() as txn:
        raw = txn.get(f"cache:{uri}".encode(), db=store.db(b"meta"))
    return None if raw is None else int(json.loads(raw))


def unexplained(missing: dict[bytes, int], must_evict: int) -> int:
    """How many missing chunks enforcement cannot explain, at the least.

    Enforcing an allocation evicts random victims until the dataset fits: at least
    `must_evict` bytes and less than one more chunk beyond that. The most missing chunks
    that can be explained is the most whose lengths (smallest first) fit in
    must_evict + CHUNK; the rest went missing for no reason the daemon had."""
    budget = must_evict + CHUNK if must_evict > 0 else 0
    explained = 0
    for length in sorted(missing.values()):
        if length > budget:
            break
        budget -= length
        explained += 1
    return len(missing) - explained


def test_kill_9_daemon_and_mount_under_verified_reads_and_allocation_churn(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path, figures: dict[str, Any]
) -> None:
    rnd = random.Random(SEED)
    tree = make_tree(rnd)
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, tree)
    uri = local_store.uri(bucket_name)
    node = make_node(cache_size=CACHE, args=("--chunk-size", "256K"))
    # A miss while the daemon is dead is EIO, logged by the mount; nothing else may be an
    # ERROR (the integration fixture reads every log at teardown).
    node.expect_errors(
        r"silofs\.mount\.reader: reading .+ chunk \d+: "
        r".*(cannot reach the silofs daemon|connection to the silofs daemon .* failed)"
    )
    mp = node.mount(uri, tmp_path / "mnt", "--job", "k")
    canonical = node.status()["datasets"][0]["uri"]
    dsid = node.status()["datasets"][0]["id"]  # persisted: the same after every restart

    v = Verifier()
    counts: Counter[str] = Counter()
    stop_readers = threading.Event()
    readers = [
        threading.Thread(target=reader, args=(mp, tree, SEED * 100 + i, stop_readers, v))
        for i in range(READERS)
    ]
    for t in readers:
        t.start()
    lost = 0
    lost_detail: list[str] = []
    accounting: list[str] = []
    deaths: list[str] = []
    mount_deaths: list[str] = []
    registrations: list[str] = []
    last_mount_pid = 0
    started = time.monotonic()

    def progress(n: int) -> None:
        target = v.reads + n
        wait_for(lambda: v.reads >= target, timeout=SETTLE, what=f"{n} more verified reads")

    def registered() -> dict:
        """The mount's status row; after a daemon restart the mount registers again on its
        next miss or report (promise 4), so wait for it."""

        def row() -> dict | None:
            assert node.proc is not None and node.proc.poll() is None, "the daemon died"
            try:
                mounts = node.status()["mounts"]
            except ControlError:
                return None
            for m in mounts:
                if m["mountpoint"] == str(mp):
                    return m
            return None

        return wait_for(row, timeout=SETTLE, what="the mount to be registered")

    try:
        for it in range(ITERATIONS):
            stop_churn = threading.Event()
            churn = [
                threading.Thread(
                    target=churner,
                    args=(node, canonical, SEED * 1000 + it * 2 + j, stop_churn, counts),
                )
                for j in range(2)
            ]
            for t in churn:
                t.start()
            try:
                progress(rnd.randint(1, 40))  # the random kill point
                assert node.proc is not None
                if node.proc.poll() is not None:
                    deaths.append(f"iteration {it}: daemon exited {node.proc.returncode}")
                    node.start()
                if last_mount_pid and not os.path.exists(f"/proc/{last_mount_pid}"):
                    mount_deaths.append(f"iteration {it}: mount {last_mount_pid} exited unkilled")
                    node.run("unmount", str(mp))
                    node.mount(uri, mp, "--job", "k")
                mount_pid = last_mount_pid = registered()["pid"]
                target = rnd.choice(["daemon", "mount"])
                counts[f"{target} kills"] += 1
                if target == "daemon":
                    node.kill9()
                else:
                    os.kill(mount_pid, signal.SIGKILL)
            finally:
                stop_churn.set()
                for t in churn:
                    t.join(30)

            if target == "daemon":
                store = CacheStore(node.cache_dir, env_map_size(parse_size(CACHE)))
                try:
                    before, usage, faults = committed(store)
                    quota = allocation(store, canonical)
                finally:
                    store.close()
                accounting += [f"iteration {it} after kill: {f}" for f in faults]
                node.start()
                progress(20)  # reads (and admissions) resume against the new daemon
                registered()  # hits alone do not reopen the dataset; the mount's report does
                # One mount, one registration, however many of its requests found the
                # daemon gone (a stable mount id: counters are never counted twice).
                rows = [m for m in node.status()["mounts"] if m["mountpoint"] == str(mp)]
                if len(rows) != 1:
                    registrations.append(f"iteration {it}: {len(rows)} registrations")
                must_evict = max(0, usage.get(dsid, 0) - quota) if quota is not None else 0

                def settled(quota: int | None = quota) -> tuple | None:
                    s = CacheStore(node.cache_dir, env_map_size(parse_size(CACHE)))
                    try:
                        after, now, faults = committed(s)
                    finally:
                        s.close()
                    if quota is not None and now.get(dsid, 0) > quota:
                        return None  # the enforcer is still shrinking to the allocation
                    return after, faults

                after, faults = wait_for(settled, timeout=SETTLE, what="enforcement to settle")
                missing = {k: n for k, n in before.items() if k not in after}
                n_lost = unexplained(missing, must_evict)
                if n_lost:
                    lost_detail.append(
                        f"iteration {it}: {len(missing)} of {len(before)} committed chunks "
                        f"({sum(missing.values())} of {sum(before.values())} bytes) missing; "
                        f"usage {usage.get(dsid, 0)} over the allocation {quota} explains "
                        f"{len(missing) - n_lost}"
                    )
                lost += n_lost
                accounting += [f"iteration {it} after restart: {f}" for f in faults]
            else:
                wait_for(
                    lambda pid=mount_pid: not any(m["pid"] == pid for m in node.status()["mounts"]),
                    timeout=SETTLE,
                    what="the daemon to reap the killed mount",
                )
                res = node.run("unmount", str(mp))
                assert res.returncode == 0, res.stderr
                assert not mounted(mp)
                node.mount(uri, mp, "--job", "k")
                last_mount_pid = registered()["pid"]
                progress(20)
            if node.proc.poll() is not None:
                deaths.append(f"iteration {it}: daemon exited {node.proc.returncode} unkilled")
                node.start()
    finally:
        stop_readers.set()
        for t in readers:
            t.join(60)
        figures.update(
            seed=SEED,
            iterations=counts["daemon kills"] + counts["mount kills"],
            daemon_kills=counts["daemon kills"],
            mount_kills=counts["mount kills"],
            allocation_changes=counts["allocation changes"],
            verified_reads=v.reads,
            verified_mb=round(v.bytes / 1e6, 1),
            wrong_bytes=v.wrong_bytes,
            short_reads=v.short_reads,
            read_errors=dict(v.errors),
            lost_committed_chunks=lost,
            accounting_faults=len(accounting),
            daemon_deaths=len(deaths),
            mount_deaths=len(mount_deaths),
            duplicate_registrations=len(registrations),
            seconds=round(time.monotonic() - started, 1),
        )

    # A last pass: every file whole, through fresh handles, once the dust settled.
    for name, want in tree.items():
        drop_file_cache(mp / name)
        got = (mp / name).read_bytes()
        v.check(name, 0, got, want)
    figures.update(wrong_bytes=v.wrong_bytes, short_reads=v.short_reads)
    assert v.wrong_bytes == 0 and v.short_reads == 0, v.wrong[:20]
    assert lost == 0, lost_detail
    assert not accounting, accounting[:10]
    assert not deaths, deaths
    assert not mount_deaths, mount_deaths
    assert not registrations, registrations
    assert node.proc is not None and node.proc.poll() is None
