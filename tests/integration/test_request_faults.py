"""What one failure ends, on real FUSE mounts and a real daemon: never more than itself.

Owns: an exception nobody foresaw (a bug planted with tests/support/inject.py) in a read,
a lookup, a read-ahead or the mount's report loop is that request's EIO (or nothing, for
a background task) and one ERROR line with its traceback, and the mount keeps serving; a
chunk whose store fetch failed is not fetched again by the read the kernel retries at
once (moto behind tests/support/faultproxy.py), yet is fetched again once the negative
memory's seconds pass; the watcher of mount/unstick.py ends with its mount however the
mount ends.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from silofs.mount.fs import NAME_MAX
from tests.support.faultproxy import Fault, FaultPlan, FaultProxy
from tests.support.fixtures import needs_fuse
from tests.support.inject import fault_env
from tests.support.node import REPO, Node, drop_file_cache, mounted, pids_with, silofs_cmd
from tests.support.poll import wait_for

pytestmark = [needs_fuse, pytest.mark.fuse]

MiB = 1 << 20
CHUNK = 4 << 20


def _read(path: Path) -> bytes:
    out = bytearray()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(MiB):
            out += block
    return bytes(out)


def _planted(node: Node, tmp_path: Path, *faults: str) -> dict[str, str]:
    return fault_env(tmp_path / "planted", node.env["PYTHONPATH"], *faults)


def _reads_again(path: Path, data: bytes, what: str) -> None:
    """Wait until `path` reads as `data` (an error that was not a lasting one)."""

    def reads() -> bool:
        try:
            return path.read_bytes() == data
        except OSError:
            drop_file_cache(path)
            return False

    wait_for(reads, timeout=20, what=what)


def _mount_log(node: Node) -> str:
    return "\n".join(p.read_text(errors="replace") for p in node.logs.iterdir())


def test_a_bug_in_one_read_is_that_read_s_eio_and_the_mount_serves_on(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    local_store.apply_env(monkeypatch)
    files = {"bad.bin": os.urandom(300 << 10), "good.bin": os.urandom(300 << 10)}
    local_store.create(bucket_name, files)
    node = make_node()
    node.expect_errors(r"planted fault")
    env = _planted(node, tmp_path, "silofs.mount.reader:ChunkReader.chunk:2")
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "mnt", env=env)
    # The kernel's read-ahead request fails, and the read of the page asked for: EIO.
    # (Where the kernel asks once more, that third request is served.)
    try:
        got = (mp / "bad.bin").read_bytes()
    except OSError as exc:
        assert exc.errno == errno.EIO
    else:
        assert got == files["bad.bin"]
    assert mounted(mp)
    assert (mp / "good.bin").read_bytes() == files["good.bin"]
    drop_file_cache(mp / "bad.bin")
    assert (mp / "bad.bin").read_bytes() == files["bad.bin"]  # the bug was that read's only
    log = _mount_log(node)
    assert "planted fault in ChunkReader.chunk" in log and "Traceback" in log


def test_a_bug_in_a_lookup_or_the_report_loop_ends_nothing_else(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"a/x.bin": b"x" * 1000, "y.bin": b"y" * 10})
    node = make_node()
    node.expect_errors(r"planted fault")
    env = _planted(
        node,
        tmp_path,
        "silofs.mount.listing_view:ListingView.lookup:1",
        "silofs.mount.process:MountProcess._follow_listing:3",
    )
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "mnt", env=env)
    with pytest.raises(OSError) as failed:
        os.stat(mp / "a")
    assert failed.value.errno == errno.EIO
    # The report loop failed three times meanwhile; the mount still reports and serves.
    wait_for(lambda: _mount_log(node).count("planted fault in MountProcess._follow_listing") >= 3)
    assert (mp / "a" / "x.bin").read_bytes() == b"x" * 1000
    assert (mp / "y.bin").read_bytes() == b"y" * 10
    node.settle(mp, 1010)
    assert mounted(mp)


def test_a_bug_reading_a_value_ahead_direct_leaves_the_read_to_the_reader(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    """The O_DIRECT read-ahead of cached values (mount/reader.py _read_direct) runs as a
    task of the mount's nursery: an exception out of it ended the mount."""
    local_store.apply_env(monkeypatch)
    data = random.Random("direct").randbytes(6 * CHUNK - 99)
    local_store.create(bucket_name, {"big.bin": data})
    node = make_node(cache_size="128M")
    node.expect_errors(r"planted fault")
    uri = local_store.uri(bucket_name)
    first = node.mount(uri, tmp_path / "a")
    assert _read(first / "big.bin") == data
    wait_for(lambda: node.status()["datasets"][0]["cached_chunks"] == 6, what="admitted")
    node.unmount(first)
    fd = os.open(os.path.join(node.cache_dir, "data.mdb"), os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    env = _planted(node, tmp_path, "silofs.mount.reader:ChunkReader._read_direct:0")
    mp = node.mount(uri, tmp_path / "b", env=env)
    assert _read(mp / "big.bin") == data
    assert mounted(mp)
    assert "planted fault in ChunkReader._read_direct" in _mount_log(node)


# -- a store outage -----------------------------------------------------------------


def test_a_failed_fetch_is_not_fetched_again_by_the_retried_read(
    make_node, s3_server, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    s3_server.apply_env(monkeypatch)
    data = os.urandom(100 << 10)  # one chunk
    s3_server.create(bucket_name, {"one.bin": data})
    up = urlsplit(s3_server.endpoint_url)
    with FaultProxy(upstream=(up.hostname or "127.0.0.1", up.port or 80), faults=FaultPlan()) as p:
        node = make_node()
        node.expect_errors(r"reading one\.bin chunk 0")
        mp = node.mount(s3_server.uri(bucket_name), tmp_path / "mnt", "--endpoint-url", p.url)
        outage = FaultPlan(faults=[Fault("http_503", methods="GET", path="one.bin")])
        p.set_plan(outage)
        with pytest.raises(OSError) as failed:
            (mp / "one.bin").read_bytes()
        assert failed.value.errno == errno.EIO

        def gets() -> int:
            history = p.settled_history()
            return sum(1 for r in history if r.method == "GET" and "one.bin" in r.target)

        # One fetch: its retries (max_attempts, 5), not a second round for the read the
        # kernel sent again after the failed read-ahead.
        assert gets() == 5, [(r.target, r.fault) for r in p.history]
        # Not a lasting error: once the store is back, the chunk is fetched again.
        p.set_plan(FaultPlan())
        _reads_again(mp / "one.bin", data, "a read once the store is back")


# -- the watcher of blocked FUSE reads ------------------------------------------------


def _watchers(mount_pid: int) -> list[int]:
    """The unstick watchers whose parent is `mount_pid`."""
    return [p for p in pids_with("silofs.mount.unstick") if _stat(p)[1:2] == [str(mount_pid)]]


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name: state, ppid, ...; [] if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _gone(pid: int) -> bool:
    return _stat(pid)[:1] in ([], ["Z"])


@pytest.mark.parametrize("how", ["fusermount", "umount", "kill9", "sigterm"])
def test_the_watcher_ends_with_its_mount(
    how, make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"f": b"f"})
    node = make_node()
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "mnt")
    pid = node.mount_pid(mp)
    (watcher,) = wait_for(lambda: _watchers(pid), what="the watcher")
    # A daemon restart does not end the mount: the same one watcher after it.
    node.stop()
    node.start()
    assert (mp / "f").read_bytes() == b"f"
    assert _watchers(pid) == [watcher]
    if how == "fusermount":
        subprocess.run(["fusermount3", "-u", str(mp)], check=True)
    elif how == "umount":
        subprocess.run(["umount", str(mp)], check=True)
    elif how == "kill9":
        os.kill(pid, signal.SIGKILL)
    else:
        os.kill(pid, signal.SIGTERM)
    wait_for(lambda: _gone(pid), what="the mount process to end")
    wait_for(lambda: _gone(watcher), timeout=5, what="the watcher to end with its mount")
    if how == "kill9":
        subprocess.run(["fusermount3", "-u", "-z", str(mp)], check=False)


def test_a_bucket_deleted_while_mounted_fails_only_uncached_reads_and_not_for_good(
    make_node, s3_server, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    s3_server.apply_env(monkeypatch)
    files = {"a.bin": os.urandom(100 << 10), "b.bin": os.urandom(100 << 10)}
    s3_server.create(bucket_name, files)
    node = make_node()
    node.expect_errors(r"reading b\.bin chunk 0")
    mnt = tmp_path / "mnt"
    mp = node.mount(s3_server.uri(bucket_name), mnt, "--endpoint-url", s3_server.endpoint_url)
    assert (mp / "a.bin").read_bytes() == files["a.bin"]
    wait_for(lambda: node.status()["datasets"][0]["cached_chunks"] == 1, what="a.bin admitted")
    client = s3_server.client()
    for key in files:
        client.delete_object(Bucket=bucket_name, Key=key)
    client.delete_bucket(Bucket=bucket_name)

    drop_file_cache(mp / "a.bin")
    assert (mp / "a.bin").read_bytes() == files["a.bin"]  # cached: still served
    with pytest.raises(OSError) as failed:
        (mp / "b.bin").read_bytes()
    assert failed.value.errno == errno.EIO
    assert sorted(os.listdir(mp)) == ["a.bin", "b.bin"]  # the listing stays
    assert mounted(mp)
    assert node.status()["datasets"][0]["store_errors"] >= 1

    s3_server.create(bucket_name, files)  # back, the same bytes (the same ETags)
    _reads_again(mp / "b.bin", files["b.bin"], "b.bin read once the bucket is back")


def test_keys_no_posix_name_can_hold(
    make_node, s3_server, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    """S3 keys whose components are longer than NAME_MAX (255 bytes), beside ordinary
    ones (moto's server takes no newline in a key; a local store's names with newlines
    are served: checked by hand): what can be named is served, and the rest never breaks a
    directory's listing for the others."""
    s3_server.apply_env(monkeypatch)
    long = "L" * 300
    files = {
        "ok.bin": b"ok",
        f"{long}.bin": b"long",
        f"d/{long}/x.bin": b"deep",
        "d/y.bin": b"y",
        "e/" + "M" * 255: b"max",
    }
    s3_server.create(bucket_name, files)
    node = make_node()
    mp = node.mount(
        s3_server.uri(bucket_name), tmp_path / "mnt", "--endpoint-url", s3_server.endpoint_url
    )
    top = sorted(os.listdir(mp))
    assert top == sorted(["d", "e", "ok.bin", f"{long}.bin"]), top
    assert sorted(os.listdir(mp / "d")) == sorted([long, "y.bin"])
    # FUSE takes names up to 1024 bytes (FUSE_NAME_MAX), past Linux's usual NAME_MAX.
    assert (mp / f"{long}.bin").read_bytes() == b"long"
    assert (mp / "d" / long / "x.bin").read_bytes() == b"deep"
    assert (mp / "ok.bin").read_bytes() == b"ok"
    assert (mp / "d" / "y.bin").read_bytes() == b"y"
    assert (mp / "e" / ("M" * 255)).read_bytes() == b"max"
    assert mounted(mp)


def test_a_component_past_fuses_1024_bytes_is_served_or_left_out_by_the_kernels_limit(
    make_node, s3_server, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    """A key component longer than 1024 bytes (an Azure name of 1024 characters, most of
    them not ASCII; moto takes such keys from S3 clients too). Linux takes FUSE names up
    to PATH_MAX - 1 since 6.15: it is served as any other. Before, FUSE_NAME_MAX was 1024
    and such a name in a readdir reply failed the whole directory with EIO: it is left out
    (one log line), a lookup of it is ENAMETOOLONG (the kernel's own answer), and its
    neighbours are served either way."""
    s3_server.apply_env(monkeypatch)
    over = "é" * 513  # 1026 bytes, 513 characters
    files = {
        "ok.bin": b"ok",
        f"{over}.bin": b"over",
        f"d/{over}/x.bin": b"deep",
        "d/y.bin": b"y",
        "e/" + "M" * 1024: b"max",
    }
    s3_server.create(bucket_name, files)
    node = make_node()
    mp = node.mount(
        s3_server.uri(bucket_name), tmp_path / "mnt", "--endpoint-url", s3_server.endpoint_url
    )
    assert os.statvfs(mp).f_namemax == NAME_MAX
    assert (mp / "e" / ("M" * 1024)).read_bytes() == b"max"
    assert (mp / "d" / "y.bin").read_bytes() == b"y"
    if NAME_MAX >= 1026:
        assert sorted(os.listdir(mp)) == ["d", "e", "ok.bin", f"{over}.bin"]
        assert sorted(os.listdir(mp / "d")) == sorted([over, "y.bin"])
        assert (mp / f"{over}.bin").read_bytes() == b"over"
        assert (mp / "d" / over / "x.bin").read_bytes() == b"deep"
    else:
        assert sorted(os.listdir(mp)) == ["d", "e", "ok.bin"]
        assert sorted(os.listdir(mp / "d")) == ["y.bin"]
        with pytest.raises(OSError) as err:
            (mp / f"{over}.bin").stat()
        assert err.value.errno == errno.ENAMETOOLONG
        logs = "".join(p.read_text() for p in node.logs.glob("*.log"))
        assert "left out of its readdir" in logs
    assert mounted(mp)


def test_odd_local_names_are_served_and_a_non_utf8_one_skipped(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    local_store.apply_env(monkeypatch)
    names = ["new\nline", "tab\there", " lead", "trail ", "-dash", 'q"uote', "%2F", "..dots"]
    local_store.create(bucket_name, {n: n.encode() for n in names} | {"sub\ndir/f": b"f"})
    root = Path(local_store.uri(bucket_name).removeprefix("file://"))
    (root / os.fsdecode(b"bad\xff\xfe")).write_bytes(b"x")  # a name that is not UTF-8
    node = make_node()
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "mnt")
    assert sorted(os.listdir(mp)) == sorted([*names, "sub\ndir"])
    for n in names:
        assert (mp / n).read_bytes() == n.encode()
    assert (mp / "sub\ndir" / "f").read_bytes() == b"f"
    assert "not UTF-8" in (node.logs / "daemon.log").read_text()


def test_a_local_tree_nested_past_path_max_is_skipped_not_a_failed_mount(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    """A directory chain made with mkdirat past PATH_MAX (4096 bytes from the root): no
    path names it, so stat by path is ENAMETOOLONG, and that failed the whole listing
    (the mount refused: "cannot open file://...: File name too long"). Now the part past
    PATH_MAX is skipped with a warning and the rest is served."""
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"ok.bin": b"ok", "deep/near.bin": b"near"})
    root = Path(local_store.uri(bucket_name).removeprefix("file://"))
    fd = os.open(root / "deep", os.O_RDONLY)
    try:
        for _ in range(18):  # 18 x 251 bytes: past 4096 with the root's own path
            os.mkdir("D" * 250, dir_fd=fd)
            nfd = os.open("D" * 250, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        leaf = os.open("leaf", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd)
        os.write(leaf, b"leaf")
        os.close(leaf)
    finally:
        os.close(fd)
    node = make_node()
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "mnt")
    assert (mp / "ok.bin").read_bytes() == b"ok"
    assert (mp / "deep" / "near.bin").read_bytes() == b"near"
    assert os.listdir(mp / "deep") == ["near.bin"]  # the chain holds no file it can name
    assert "longer than PATH_MAX" in (node.logs / "daemon.log").read_text()


def test_a_directory_of_100k_entries_reads_whole_once_each(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"seed": b""})
    root = Path(local_store.uri(bucket_name).removeprefix("file://"))
    names = [f"f{i:06d}" for i in range(100_000)]
    for n in names:
        (root / n).touch()
    node = make_node()
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "mnt")
    got = os.listdir(mp)  # getdents in 32 KiB batches: offsets resumed many times
    assert len(got) == len(set(got)) == 100_001
    assert sorted(got) == sorted([*names, "seed"])
    with os.scandir(mp) as entries:  # readdirplus: each entry's attributes with it
        first = next(e for e in entries if e.name == "f050000")
        assert first.stat().st_size == 0 and first.is_file()


def test_an_object_replaced_with_another_size_while_open_never_mixes_bytes(
    make_node, s3_server, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    """Rewritten in the store (longer, then shorter) while a reader has it open and has
    read its head: the rest is the old version's bytes or EIO, never the new one's, and
    the file keeps its listed size."""
    s3_server.apply_env(monkeypatch)
    chunk = 256 << 10
    old = random.Random("old").randbytes(3 * chunk + 100)
    s3_server.create(bucket_name, {"f.bin": old})
    node = make_node()
    node.expect_errors(r"reading f\.bin chunk")
    mp = node.mount(
        s3_server.uri(bucket_name),
        tmp_path / "mnt",
        "--endpoint-url",
        s3_server.endpoint_url,
        "--chunk-size",
        "256K",
    )
    for new in (random.Random("new").randbytes(5 * chunk), b"short"):
        drop_file_cache(mp / "f.bin")
        with open(mp / "f.bin", "rb", buffering=0) as f:
            assert f.read(4096) == old[:4096]
            s3_server.put(bucket_name, "f.bin", new)
            assert os.fstat(f.fileno()).st_size == len(old)
            got = bytearray(old[:4096])
            try:
                f.seek(2 * chunk)  # a chunk not read yet: the store has the new version
                got = bytearray(f.read(chunk))
                assert bytes(got) == old[2 * chunk : 3 * chunk]
            except OSError as exc:
                assert exc.errno == errno.EIO
        s3_server.put(bucket_name, "f.bin", old)  # back: the listed ETag again
    assert mounted(mp)


def test_credentials_revoked_while_mounted(
    make_node, s3_server, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    """The store answers 403 AccessDenied to every GET (the key was revoked): cached
    chunks are served, an uncached read is EIO (not EACCES: the reader is not the one
    refused), the mount and the daemon go on, and reads work once the store lets the
    daemon in again."""
    s3_server.apply_env(monkeypatch)
    files = {"a.bin": os.urandom(100 << 10), "b.bin": os.urandom(100 << 10)}
    s3_server.create(bucket_name, files)
    up = urlsplit(s3_server.endpoint_url)
    with FaultProxy(upstream=(up.hostname or "127.0.0.1", up.port or 80), faults=FaultPlan()) as p:
        node = make_node()
        node.expect_errors(r"reading b\.bin chunk 0")
        mp = node.mount(s3_server.uri(bucket_name), tmp_path / "mnt", "--endpoint-url", p.url)
        assert (mp / "a.bin").read_bytes() == files["a.bin"]
        wait_for(lambda: node.status()["datasets"][0]["cached_chunks"] == 1, what="admitted")
        p.set_plan(FaultPlan(faults=[Fault("http_403")]))
        drop_file_cache(mp / "a.bin")
        assert (mp / "a.bin").read_bytes() == files["a.bin"]
        with pytest.raises(OSError) as failed:
            (mp / "b.bin").read_bytes()
        assert failed.value.errno == errno.EIO
        assert mounted(mp) and node.status()["datasets"][0]["store_errors"] >= 1
        p.set_plan(FaultPlan())
        _reads_again(mp / "b.bin", files["b.bin"], "b.bin read once the credentials work")


_READERS = """
import sys, threading
from silofs.cache.store import CacheStore
store = CacheStore(sys.argv[1], 1 << 30)
opened, all_open, done = [], threading.Barrier(201), threading.Event()
def read():
    opened.append(store.env.begin())
    all_open.wait()
    done.wait()
threads = [threading.Thread(target=read) for _ in range(200)]
for t in threads:
    t.start()
all_open.wait()
print(len(opened))
done.set()
"""


def test_a_full_cache_disk_while_admitting(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    """The cache dir's file system fills up (another writer) while a mount's misses are
    admitted: every read is still served right (from the store), the daemon says once
    in status what failed, and it admits again once there is room. Readers of the cache
    (200 read txns at once, as mounts' threads hold them) never end with SIGBUS."""
    if os.geteuid() != 0:
        pytest.skip("mounts a tmpfs for the cache dir")
    local_store.apply_env(monkeypatch)
    files = {f"f{i:02d}": random.Random(i).randbytes(2 * MiB) for i in range(12)}
    local_store.create(bucket_name, files)
    node = make_node(start=False, cache_size="48M")
    os.makedirs(node.cache_dir)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96M", "tmpfs", node.cache_dir], check=True)
    try:
        node.start()
        node.expect_errors(r"the writer failed: DiskError")
        uri = local_store.uri(bucket_name)
        mp = node.mount(uri, tmp_path / "a")
        with open(os.path.join(node.cache_dir, "filler"), "wb") as filler:
            try:
                while True:
                    filler.write(bytes(MiB))
                    filler.flush()
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
        # 200 read txns at once in another process, as mounts' threads hold them: LMDB's
        # reader table had a block for its first page only, and the 64th slot, on a page
        # the full disk could not back, was SIGBUS.
        readers = subprocess.run(
            [sys.executable, "-c", _READERS, node.cache_dir], env={**os.environ,
             "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert readers.returncode == 0 and readers.stdout == "200\n", readers
        for name, data in files.items():
            assert (mp / name).read_bytes() == data
        error = wait_for(lambda: node.status()["node"]["writer"]["error"], what="the error")
        assert "No space left on device" in error
        assert node.status()["datasets"][0]["cached_chunks"] == 0
        # Misses go on while the disk stays full: the writer fails again after each
        # restart, and the log says so once (repeats are DEBUG until a batch commits).
        more = node.mount(uri, tmp_path / "b")  # a mount of its own: its buffer is empty
        for name, data in files.items():
            assert (more / name).read_bytes() == data
        wait_for(lambda: node.status()["node"]["writer"]["failed_batches"] >= 2, what="again")
        log = (node.logs / "daemon.log").read_text()
        assert log.count("the writer failed") == 1, log
        os.unlink(os.path.join(node.cache_dir, "filler"))
        again = node.mount(uri, tmp_path / "c")  # a mount of its own: its buffer is empty
        for name, data in files.items():
            assert (again / name).read_bytes() == data
        wait_for(lambda: node.status()["datasets"][0]["cached_chunks"] > 0, what="admissions")
        assert "the writer admits again" in (node.logs / "daemon.log").read_text()
    finally:
        node.cleanup()
        subprocess.run(["umount", "-l", node.cache_dir], check=False)


def test_a_mount_whose_silofs_mount_was_killed_before_ready_ends_cleanly(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    """`silofs mount` killed (a timeout, Ctrl-C) while it waits for the mount process's
    "ready": it told its caller the mount failed, so the mount ends, unmounted (not left
    as a dead ENOTCONN mountpoint), with one warning and no traceback (the write of
    "ok" to the closed pipe raised EPIPE in a task of the mount)."""
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"f": b"f"})
    node = make_node()
    env = _planted(node, tmp_path, "silofs.mount.process:MountProcess._ready_after_init:sleep3")
    mp = tmp_path / "mnt"
    mp.mkdir()
    node.mountpoints.append(str(mp))
    caller = subprocess.Popen(
        silofs_cmd("mount", local_store.uri(bucket_name), str(mp), "--socket", node.socket),
        env={**node.env, **env},
        stderr=subprocess.DEVNULL,
    )
    wait_for(lambda: mounted(mp), what="the mount (its ready delayed)")
    pid = node.mount_pid(mp)
    caller.kill()
    caller.wait()
    wait_for(lambda: _gone(pid), timeout=15, what="the mount process to end")
    assert not mounted(mp) and os.listdir(mp) == []  # unmounted, not a dead mountpoint
    log = _mount_log(node)
    assert "the silofs mount that started this mount is gone" in log
    assert "Traceback" not in log
