"""A node daemon a shared host can trust: idle mounts pin nothing, slow is not gone.

Owns, on real FUSE mounts and a real daemon: an idle mount releases its LMDB read
snapshot, so another dataset's admissions and evictions reuse pages and admission keeps
up round after round; a daemon stopped (SIGSTOP) for longer than the mount's timeout
leaves one registration and counters counted once; a second daemon on the same cache
dir refuses with one line; after a daemon restart an idle mount registers again within
seconds, and one unmounted before it did ends without an error.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest

from silofs.mount.unstick import in_device_read
from tests.support.fixtures import needs_fuse
from tests.support.node import drop_file_cache, force_unmount
from tests.support.poll import wait_for

pytestmark = [needs_fuse, pytest.mark.fuse]

MiB = 1 << 20


def active_readers(cache_dir: str) -> dict[int, str]:
    """pid -> txnid of every LMDB reader slot (txnid '-' when it holds no snapshot)."""
    env = lmdb.open(cache_dir, readonly=True, lock=True, max_dbs=16)
    try:
        out: dict[int, str] = {}
        for line in env.readers().splitlines()[1:]:
            fields = line.split()
            if len(fields) == 3 and fields[0].isdigit():
                pid, txnid = int(fields[0]), fields[2]
                if out.get(pid, "-") == "-":
                    out[pid] = txnid
        return out
    finally:
        env.close()


def test_an_idle_mount_holds_no_snapshot_while_another_dataset_churns(
    make_node, local_store, monkeypatch, tmp_path: Path
) -> None:
    local_store.apply_env(monkeypatch)
    local_store.create("idle", {f"i{n}": os.urandom(64 << 10) for n in range(4)})
    busy_files = {f"b{n:02d}": os.urandom(MiB) for n in range(48)}
    local_store.create("busy", busy_files)
    node = make_node(cache_size="64M")
    idle = node.mount(local_store.uri("idle"), tmp_path / "idle", "--job", "idle")
    (idle / "i0").read_bytes()  # the idle mount has read once, then stays idle
    idle_pid = node.mount_status(str(idle))["pid"]
    wait_for(
        lambda: active_readers(node.cache_dir).get(idle_pid, "-") == "-",
        what="the idle mount to release its read snapshot",
    )
    name = None

    def cached() -> int:
        return next(d["cached_bytes"] for d in node.status()["datasets"] if d["name"] == name)

    for _round in range(10):  # ~400 MiB admitted and evicted: more than the 336 MiB map
        # A fresh mount each round: a mount's own chunk buffer would serve the misses.
        busy = node.mount(
            local_store.uri("busy"),
            tmp_path / f"busy{_round}",
            "--job",
            "busy",
            "--chunk-size",
            "1M",
        )
        if name is None:
            name = next(d["name"] for d in node.status()["datasets"] if "/busy/" in d["uri"])
        node.request("PUT", f"/v1/datasets/{name}/cache", {"bytes": "40M"})
        for key, data in busy_files.items():
            assert (busy / key).read_bytes() == data
        if _round % 2:  # its read snapshot stays in the reader table: the daemon clears it
            pid = node.mount_status(str(busy))["pid"]
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda p=pid: not os.path.exists(f"/proc/{p}"), what="the mount to die")
            force_unmount(str(busy))
        else:
            res = node.run("unmount", str(busy), "--socket", node.socket)
            assert res.returncode == 0, res.stderr
        wait_for(lambda: cached() >= 40 * MiB, what=f"round {_round}: 40 MiB admitted")
        node.request("PUT", f"/v1/datasets/{name}/cache", {"bytes": "4M"})
        wait_for(lambda: cached() <= 4 * MiB, what=f"round {_round}: shrunk to 4 MiB")
        assert active_readers(node.cache_dir).get(idle_pid, "-") == "-"
    wait_for(
        lambda: all(t == "-" for t in active_readers(node.cache_dir).values()),
        what="no reader slot left holding a snapshot",
    )
    writer = node.status()["node"]["writer"]
    assert writer["map_full"] == 0, writer
    assert (idle / "i1").read_bytes()  # the idle mount still serves


def test_a_stopped_daemon_leaves_one_registration_and_true_counters(
    make_node, local_store, monkeypatch, tmp_path: Path
) -> None:
    local_store.apply_env(monkeypatch)
    files = {f"f{n}": os.urandom(256 << 10) for n in range(8)}
    local_store.create("data", files)
    node = make_node(env={"SILOFS_DAEMON_TIMEOUT": "4"})
    mp = node.mount(local_store.uri("data"), tmp_path / "mnt", "--job", "stall")
    assert (mp / "f0").read_bytes() == files["f0"]
    assert node.proc is not None
    os.kill(node.proc.pid, signal.SIGSTOP)
    try:
        # An uncached read against a frozen daemon fails with EIO after the mount's
        # timeout (4 s here, 30 s by default), not after minutes, and once: the kernel
        # asks again for the pages its failed read-ahead left (a second request of the
        # same chunk), which waits a tenth of the timeout (at least 1 s), not all of it.
        t0 = time.monotonic()
        with pytest.raises(OSError) as err:
            (mp / "f1").read_bytes()
        assert err.value.errno == 5
        assert time.monotonic() - t0 < 2 * 4, "the frozen daemon was waited on twice"
    finally:
        os.kill(node.proc.pid, signal.SIGCONT)
    node.expect_errors(r"reading f1 chunk 0: .*said nothing for (4|1)s")
    total = sum(len(files[k]) for k in ("f0", "f1", "f2", "f3"))
    for key in ("f1", "f2", "f3"):  # f1 at once: its shorter wait is no EIO from a live daemon
        assert (mp / key).read_bytes() == files[key]
    m = node.settle(str(mp), total)
    assert len(node.status()["mounts"]) == 1
    assert m["bytes_read"] == total  # counted once
    job = next(j for j in node.status()["jobs"] if j["name"] == "stall")
    assert job["bytes_read"] == total


def test_a_second_daemon_on_the_same_cache_dir_refuses(make_node) -> None:
    node = make_node()
    res = node.run(
        "daemon",
        "--socket",
        str(node.root / "other.sock"),
        "--cache-dir",
        node.cache_dir,
        "--cache-size",
        node.cache_size,
        timeout=60,
    )
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "another silofs daemon" in lines[0], res.stderr
    assert node.status()["node"]["pid"] == node.proc.pid  # the first one is untouched


def test_a_restarted_daemon_gets_the_mounts_buffered_chunks_back(
    make_node, local_store, monkeypatch, tmp_path: Path
) -> None:
    local_store.apply_env(monkeypatch)
    files = {f"f{n}": os.urandom(200 << 10) for n in range(6)}
    local_store.create("data", files)
    uri = local_store.uri("data")
    node = make_node()
    quoted = uri.replace("/", "%2F").replace(":", "%3A")
    node.request("PUT", f"/v1/datasets/{quoted}/cache", {"bytes": 0})  # admit nothing
    mp = node.mount(uri, tmp_path / "mnt", "--job", "offers")
    for key, data in files.items():
        assert (mp / key).read_bytes() == data  # fetched, held in the mount's buffer only
    assert node.status()["datasets"][0]["cached_chunks"] == 0
    node.stop()
    node.start()
    node.request("PUT", f"/v1/datasets/{quoted}/cache", {"bytes": None})
    drop_file_cache(mp / "f0")
    assert (mp / "f0").read_bytes() == files["f0"]  # served from the buffer; it reports,
    # hears 404, registers again and offers what it holds
    ds = wait_for(
        lambda: (d := node.status()["datasets"]) and d[0]["cached_chunks"] == len(files) and d[0],
        what="the buffered chunks to be admitted",
    )
    assert ds["remote_gets"] == 0  # no GET after the restart
    log = "".join(p.read_text() for p in node.logs.iterdir() if p.name.startswith("mount"))
    assert "offered buffered chunks to the daemon again: {'queued': 6}" in log


def test_a_limiter_wait_longer_than_the_timeout_is_not_cut(
    make_node, local_store, monkeypatch, tmp_path: Path
) -> None:
    local_store.apply_env(monkeypatch)
    files = {"a": os.urandom(MiB), "b": os.urandom(MiB)}
    local_store.create("slow", files)
    node = make_node(env={"SILOFS_DAEMON_TIMEOUT": "1"})
    mp = node.mount(
        local_store.uri("slow"),
        tmp_path / "mnt",
        *("--job", "slow", "--io-limit", "300K/s", "--chunk-size", "1M"),
    )
    # The first chunk puts the job's bucket in debt; the second waits ~3.5 s for it,
    # against a mount that accepts 1 s of silence.
    for key, data in files.items():
        assert (mp / key).read_bytes() == data
    job = next(j for j in node.status()["jobs"] if j["name"] == "slow")
    assert job["limiter_wait_s"] > 2.0
    assert len(node.status()["mounts"]) == 1


def test_concurrent_allocations_cannot_together_exceed_the_cache(make_node) -> None:
    import threading

    from silofs.control.client import ControlClient, ControlError

    node = make_node(cache_size="100M")
    outcomes: list[str] = []
    start = threading.Barrier(2)

    def put(name: str) -> None:
        with ControlClient(node.socket, timeout=10) as c:
            start.wait()
            try:
                c.request("PUT", f"/v1/datasets/file%3A%2F%2F%2F{name}%2F/cache", {"bytes": "80M"})
                outcomes.append("ok")
            except ControlError as exc:
                outcomes.append(f"{exc.status}")

    threads = [threading.Thread(target=put, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(outcomes) == ["409", "ok"]
    allocs = node.request("GET", "/v1/allocations")
    assert sum(allocs["cache"].values()) <= allocs["cache_size"]


def test_an_idle_mount_unmounted_after_a_daemon_restart_ends_cleanly(
    make_node, local_store, monkeypatch, tmp_path: Path
) -> None:
    """A mount that read nothing since its daemon restarted learns of the restart only
    from its final report at the unmount: it ends without an error and leaves no
    registration on the new daemon."""
    local_store.apply_env(monkeypatch)
    files = {f"f{n}": os.urandom(200 << 10) for n in range(3)}
    local_store.create("data", files)
    node = make_node()
    mp = node.mount(local_store.uri("data"), tmp_path / "mnt", "--job", "idle")
    for key, data in files.items():
        assert (mp / key).read_bytes() == data
    node.settle(mp, sum(map(len, files.values())))
    pid = node.mount_pid(mp)
    node.stop()
    node.start()
    res = node.run("unmount", str(mp), "--socket", node.socket, timeout=60)
    assert res.returncode == 0, res.stderr
    wait_for(lambda: not os.path.exists(f"/proc/{pid}"), what="the mount process to exit")
    assert not node.log_problems(), "\n".join(node.log_problems())
    # Its goodbye (DELETE, bounded by 2 s: mount/process.py _goodbye) removes a row its
    # idle report may have made since the restart; one a slow daemon did not answer in
    # time goes at the daemon's next reap of dead pids (every 2 s, reap_mounts).
    wait_for(lambda: node.status()["mounts"] == [], what="no registration left")


def test_an_idle_mount_is_known_again_soon_after_a_daemon_restart(
    make_node, local_store, monkeypatch, tmp_path: Path
) -> None:
    """A mount that reads nothing after its daemon restarted registers again within
    seconds all the same: status shows it, and its job, without a read."""
    local_store.apply_env(monkeypatch)
    local_store.create("data", {"f": os.urandom(100 << 10)})
    node = make_node()
    mp = node.mount(local_store.uri("data"), tmp_path / "mnt", "--job", "quiet")
    assert (mp / "f").stat().st_size == 100 << 10
    pid = node.mount_pid(mp)
    node.stop()
    node.start()
    # No "not known yet" check here: the mount's idle report (every IDLE_REPORT_SECONDS,
    # 1 s, mount/process.py) may reach the new daemon between its first answer to
    # start()'s poll and any status asked after, and register it already.
    m = wait_for(lambda: node.status()["mounts"], timeout=10, what="the mount to register")
    assert [(x["pid"], x["job"]) for x in m] == [(pid, "quiet")]


def test_a_restarted_daemon_counts_a_mounts_earlier_reads_once(
    make_node, local_store, monkeypatch, tmp_path: Path
) -> None:
    """The restarted daemon's counters start at 0 (to Prometheus, a reset). The mount's
    first report to it, its counts since it started, is a base, not reads: added, the
    dataset's and job's counters jumped by every byte read before the restart, counted
    twice by increase()/rate(). Reads after it count, and the job's epoch count goes on."""
    data = os.urandom(100 << 10)
    local_store.apply_env(monkeypatch)
    local_store.create("data", {"f": data})
    node = make_node()
    mp = node.mount(local_store.uri("data"), tmp_path / "mnt", "--job", "twice")
    assert (mp / "f").read_bytes() == data
    wait_for(lambda: node.status()["datasets"][0]["bytes_read"] >= len(data), what="a report")
    node.stop()
    node.start()

    def rejoined() -> dict | None:
        m = node.status()["mounts"]
        return m[0] if m and m[0]["bytes_read"] >= len(data) else None

    wait_for(rejoined, timeout=10, what="the mount's first report to the new daemon")
    st = node.status()
    assert st["datasets"][0]["bytes_read"] == 0
    assert [(j["name"], j["bytes_read"], j["epoch"]) for j in st["jobs"]] == [("twice", 0, 1)]
    drop_file_cache(mp / "f")
    assert (mp / "f").read_bytes() == data
    wait_for(
        lambda: node.status()["datasets"][0]["bytes_read"] == len(data),
        what="the read after the restart counted",
    )


def _still(pred: Callable[[], bool], seconds: float) -> bool:
    """`pred` is true again `seconds` later (a state that lasts, not an instant)."""
    time.sleep(seconds)  # the interval between two looks, not a synchronisation
    return pred()


def _lookup_then_die(mp: Path, rng: random.Random) -> None:
    """A process whose lookup is queued on the device, SIGKILLed at a random instant: the
    kernel withdraws a request the mount has not read yet."""
    child = os.fork()
    if child == 0:
        try:
            os.stat(mp / f"nope-{rng.random()}")
        finally:
            os._exit(0)
    spin = time.perf_counter() + rng.random() * 0.003
    while time.perf_counter() < spin:
        pass
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)


def test_a_request_withdrawn_by_a_killed_caller_never_freezes_the_mount(
    make_node, local_store, monkeypatch, tmp_path: Path
) -> None:
    """The mount hang: callers SIGKILLed while their lookups are queued leave the mount
    in pyfuse3's blocking read() of an empty device (mount/unstick.py). A miss already
    asked of the daemon must still be answered to its reader, with no request after it
    to wake the mount."""
    local_store.apply_env(monkeypatch)
    files = {f"f{n}": os.urandom(300 << 10) for n in range(2)}
    local_store.create("data", files)
    # The daemon stays stopped until the withdrawals below leave the mount in read(),
    # up to their 120 s deadline: the mount must wait for it longer than that. With the
    # default 30 s the reader's miss timed out (EIO) at load ~20, the loop still running.
    node = make_node(env={"SILOFS_DAEMON_TIMEOUT": "300"})
    mp = node.mount(local_store.uri("data"), tmp_path / "mnt")
    pid = node.mount_pid(mp)
    assert node.proc is not None
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append((mp / "f1").read_bytes()), daemon=True)
    os.kill(node.proc.pid, signal.SIGSTOP)  # the miss waits for the daemon
    try:
        reader.start()
        # Once the mount blocks in read() with nothing queued, it has read every request
        # before (the reader's too) and sent its miss.
        rng = random.Random(7)
        deadline = time.monotonic() + 120
        while not (in_device_read(pid) and _still(lambda: in_device_read(pid), 0.02)):
            assert time.monotonic() < deadline, "no caller's request was withdrawn mid-read"
            _lookup_then_die(mp, rng)
    finally:
        os.kill(node.proc.pid, signal.SIGCONT)
    # No request is made from here on: only the mount itself can answer the reader.
    reader.join(15)
    assert not reader.is_alive(), "the mount never read the daemon's answer"
    assert got == [files["f1"]]
    assert (mp / "f0").read_bytes() == files["f0"]
