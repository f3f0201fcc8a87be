"""Reads through real FUSE mounts equal the store's bytes, for local and S3 datasets."""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import random
import stat
import subprocess
import threading
from pathlib import Path

import pytest

from silofs.mount.fs import NAME_MAX
from silofs.mountinfo import mounts
from tests.support.fixtures import needs_fuse
from tests.support.node import Node, drop_file_cache, mounted
from tests.support.poll import wait_for

pytestmark = [needs_fuse, pytest.mark.fuse]

CHUNK = 256 << 10


def sample_tree(seed: int = 1) -> dict[str, bytes]:
    """Small files, multi-chunk files, an empty file, odd names, a deep directory."""
    rnd = random.Random(seed)
    tree = {f"train/img{i:03d}.jpg": rnd.randbytes(rnd.randint(10_000, 60_000)) for i in range(40)}
    tree["big/shard-0.tar"] = rnd.randbytes(5 * CHUNK + 12345)
    tree["big/shard-1.tar"] = rnd.randbytes(3 * CHUNK)  # ends exactly on a chunk boundary
    tree["empty.txt"] = b""
    tree["with space/naïve café ☃.txt"] = "unicode body ✓".encode() * 100
    tree["a/b/c/d/e/f/g/deep.bin"] = rnd.randbytes(777)
    return tree


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_all(mp: Path, tree: dict[str, bytes]) -> dict[str, str]:
    return {k: sha((mp / k).read_bytes()) for k in tree}


def store_env(kind: str, s) -> tuple[dict[str, str], list[str]]:
    """Environment for the daemon and mount flags that reach store `s` the usual way."""
    if kind == "s3":
        return {}, ["--endpoint-url", s.endpoint_url]
    if kind == "azure":
        return {"AZURE_STORAGE_CONNECTION_STRING": s.connection_string}, []
    if kind == "gcs":
        return {"STORAGE_EMULATOR_HOST": s.endpoint_url}, []
    return {}, []


_SERVER = {"s3": "s3_server", "azure": "azurite_server", "gcs": "gcs_server"}


@pytest.fixture(params=["local", "s3", "azure", "gcs"])
def store(request: pytest.FixtureRequest, local_store, monkeypatch, bucket_name):
    """(store helper, uri, extra mount args) for a bucket holding sample_tree(); the
    credentials are in the environment the daemon will inherit."""
    kind = request.param
    s = local_store if kind == "local" else request.getfixturevalue(_SERVER[kind])
    s.apply_env(monkeypatch)
    env, args = store_env(kind, s)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    s.create(bucket_name, sample_tree())
    return s, s.uri(bucket_name), args


def test_every_file_reads_back_identical(make_node, store, tmp_path: Path) -> None:
    s, uri, args = store
    node: Node = make_node(cache_size="64M")
    mp = node.mount(uri, tmp_path / "mnt", "--chunk-size", "256K", *args)
    tree = sample_tree()
    expected = {k: sha(v) for k, v in tree.items()}
    assert read_all(mp, tree) == expected
    listed = {str(p.relative_to(mp)) for p in mp.rglob("*") if p.is_file()}
    assert listed == set(tree)
    assert (mp / "empty.txt").stat().st_size == 0
    # Second pass from the cache, page cache dropped: same bytes, no new remote GETs.
    first = node.settle(str(mp), sum(map(len, tree.values())))
    chunks = sum(-(-len(v) // CHUNK) for v in tree.values())
    wait_for(
        lambda: node.status()["datasets"][0]["cached_chunks"] == chunks,
        what="the first pass to be admitted",
    )
    for k in tree:
        drop_file_cache(mp / k)
    assert read_all(mp, tree) == expected
    m = node.settle(str(mp), 2 * sum(map(len, tree.values())))
    assert m["remote_gets"] == first["remote_gets"]
    assert m["hit_bytes"] - first["hit_bytes"] == sum(map(len, tree.values()))


def test_posix_tools_agree_with_the_source(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, sample_tree())
    src = local_store.root / bucket_name
    node = make_node()
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "mnt", "--chunk-size", "256K")

    def walk(root: Path) -> list[tuple[str, list[str], list[str]]]:
        return sorted(
            (os.path.relpath(d, root), sorted(ds), sorted(fs)) for d, ds, fs in os.walk(root)
        )

    assert walk(mp) == walk(src)

    def run(cmd: str, cwd: Path) -> bytes:
        return subprocess.run(cmd, shell=True, cwd=cwd, check=True, capture_output=True).stdout

    find = "find . -type f -printf '%P %s\\n' | sort"
    assert run(find, mp) == run(find, src)

    def du_files(root: Path) -> list[bytes]:
        out = run("du -ab . | sort -k2", root).splitlines()
        return [ln for ln in out if (root / ln.split(b"\t")[1].decode()).is_file()]

    assert du_files(mp) == du_files(src)
    tar = (
        "tar c --sort=name --mode=0444 --owner=0 --group=0 --numeric-owner --mtime=@0 "
        "--format=gnu . | sha256sum"
    )
    assert run(tar, mp) == run(tar, src)

    big = sample_tree()["big/shard-0.tar"]
    with open(mp / "big/shard-0.tar", "rb") as f:
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            assert m[:] == big
            assert m[CHUNK - 10 : CHUNK + 10] == big[CHUNK - 10 : CHUNK + 10]
        for off, n in [
            (0, 1),
            (CHUNK - 3, 7),
            (3 * CHUNK + 5, 2 * CHUNK),
            (len(big) - 4, 100),
            (len(big) + 10, 5),
        ]:
            f.seek(off)
            assert f.read(n) == big[off : off + n]


def test_the_mount_is_read_only(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, sample_tree())
    node = make_node()
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "mnt")
    attempts = [
        lambda: open(mp / "train/img000.jpg", "r+b"),
        lambda: open(mp / "new.txt", "wb"),
        lambda: os.mkdir(mp / "newdir"),
        lambda: os.unlink(mp / "empty.txt"),
        lambda: os.rename(mp / "empty.txt", mp / "moved.txt"),
        lambda: os.rmdir(mp / "a"),
        lambda: os.chmod(mp / "empty.txt", 0o777),
        lambda: os.truncate(mp / "empty.txt", 0),
    ]
    for attempt in attempts:
        with pytest.raises(OSError) as exc:
            attempt()
        assert exc.value.errno == 30, exc.value  # EROFS
    assert (local_store.root / bucket_name / "empty.txt").exists()


def _bdi_read_ahead_kb(mp: Path) -> int:
    """The read_ahead_kb of the bdi of the mount at `mp`, found through mountinfo."""
    target = os.path.realpath(mp)
    entries = [e for e in mounts() if e.mountpoint == target]
    assert entries, f"{target} is not in /proc/self/mountinfo"
    return int(Path(f"/sys/class/bdi/{entries[-1].device}/read_ahead_kb").read_text())


@pytest.mark.parametrize("processes", [1, 2])
def test_the_kernel_reads_ahead_a_mebibyte_once_mounted(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path, processes: int
) -> None:
    """The INIT reply sets the bdi's read-ahead to the kernel's offer (128 KiB): the
    mount raises it only after answering INIT, and is ready only then, so the first
    file opened reads 1 MiB at a time."""
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"a.bin": b"x" * 1000})
    node = make_node()
    args = ["--serve-processes", str(processes)] if processes > 1 else []
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "mnt", *args)
    assert _bdi_read_ahead_kb(mp) == 1024
    assert (mp / "a.bin").read_bytes() == b"x" * 1000


def test_hit_ratio_follows_the_cache_share(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    """Uniform caching: with cache = half the dataset, every epoch after the first hits 0.5."""
    rnd = random.Random(7)
    tree = {f"d/{i:04d}.bin": rnd.randbytes(20_000) for i in range(200)}
    total = sum(map(len, tree.values()))
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, tree)
    allocation = total // 2
    node = make_node(cache_size=str(allocation), args=("--chunk-size", "256K"))
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "mnt")
    read = 0
    for epoch in range(4):
        before = node.settle(str(mp), read)
        order = list(tree)
        rnd.shuffle(order)
        for k in order:
            assert (mp / k).read_bytes() == tree[k]
            drop_file_cache(mp / k)
        read += total
        after = node.settle(str(mp), read)
        ratio = (after["hit_bytes"] - before["hit_bytes"]) / total
        cached = node.status()["datasets"][0]["cached_bytes"]
        assert cached <= allocation
        if epoch == 0:
            assert ratio == 0.0
        else:
            assert abs(ratio - 0.5) <= 0.05, f"epoch {epoch}: hit ratio {ratio:.3f}"


def test_concurrent_readers_of_a_cold_file_fetch_each_chunk_once(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    data = random.Random(3).randbytes(8 * CHUNK)
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"cold.bin": data})
    node = make_node()
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "mnt", "--chunk-size", "256K")
    results: list[bytes] = []
    barrier = threading.Barrier(8)

    def reader() -> None:
        with open(mp / "cold.bin", "rb") as f:
            barrier.wait()
            results.append(f.read())

    threads = [threading.Thread(target=reader) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [data] * 8
    m = node.settle(str(mp), len(data))
    assert m["remote_gets"] == 8
    assert m["remote_bytes"] == len(data)


def _fusectl(mode: int = os.W_OK) -> Path | None:
    """/sys/fs/fuse/connections, mounted if it is not (root; a fresh host may not have
    fusectl mounted until someone asks); None where it cannot be, or lacks `mode` access."""
    conns = Path("/sys/fs/fuse/connections")
    if conns.is_dir() and not any(conns.iterdir()) and os.geteuid() == 0:
        subprocess.run(["mount", "-t", "fusectl", "none", str(conns)], capture_output=True)
    return conns if conns.is_dir() and os.access(conns, mode) else None


def _fuse_waiting(conns: Path, mp: Path) -> int:
    """Requests of the FUSE connection at `mp` the kernel sent and has no answer to."""
    return int((conns / str(os.minor(os.stat(mp).st_dev)) / "waiting").read_text())


def test_hits_are_served_while_a_miss_waits(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    """A miss waiting for its job's IO allocation holds up no hit: reads of a cached file
    go on through the same mount while the miss still waits, and both read right."""
    rnd = random.Random(11)
    tree = {"hot.bin": rnd.randbytes(100_000), "cold.bin": rnd.randbytes(400_000)}
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, tree)
    node = make_node()
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "mnt", "--job", "j")
    assert (mp / "hot.bin").read_bytes() == tree["hot.bin"]
    conns = _fusectl(os.R_OK)
    if conns is None:
        pytest.skip("no readable /sys/fs/fuse/connections (fusectl)")
    wait_for(lambda: node.status()["datasets"][0]["cached_chunks"] == 1, what="admission")
    node.request("PUT", "/v1/jobs/j/io", {"bytes_per_s": 0})  # no remote IO: a miss waits
    cold: list[bytes] = []
    waiter = threading.Thread(target=lambda: cold.append((mp / "cold.bin").read_bytes()))
    waiter.start()
    hits: list[bool] = []

    def read_hot() -> None:
        for _ in range(50):
            drop_file_cache(mp / "hot.bin")
            hits.append((mp / "hot.bin").read_bytes() == tree["hot.bin"])

    hot = threading.Thread(target=read_hot, daemon=True)
    try:
        wait_for(lambda: _fuse_waiting(conns, mp) >= 1, what="the miss to wait in the mount")
        hot.start()
        hot.join(20)
        assert not hot.is_alive() and hits == [True] * 50, "hits waited behind the miss"
        assert waiter.is_alive() and not cold  # the miss still waits
    finally:
        node.request("PUT", "/v1/jobs/j/io", {"bytes_per_s": None})
        waiter.join(60)
    assert cold == [tree["cold.bin"]]


def test_unmount_and_fusermount_both_end_the_mount(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, sample_tree())
    node = make_node()
    uri = local_store.uri(bucket_name)
    mp1 = node.mount(uri, tmp_path / "m1", "--job", "one")
    mp2 = node.mount(uri, tmp_path / "m2", "--job", "two")
    assert len(node.status()["mounts"]) == 2
    res = node.run("unmount", str(mp1))
    assert res.returncode == 0, res.stderr
    assert not mounted(mp1)
    subprocess.run(["fusermount3", "-u", str(mp2)], check=True)
    assert not mounted(mp2)
    wait_for(lambda: not node.status()["mounts"], what="the daemon to notice both unmounts")


def test_an_aborted_connection_ends_the_mount_quietly(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    """Aborting the FUSE connection (what an unmount racing the next receive looks like
    to the session loop: ECONNABORTED) ends the mount process with a goodbye to the
    daemon and no ERROR in its log (the node fixture checks), and readers get ENOTCONN."""
    tree = sample_tree()
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, tree)
    node = make_node()
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "m")
    assert (mp / "empty.txt").read_bytes() == b""
    conns = _fusectl()
    if conns is None:
        pytest.skip("no writable /sys/fs/fuse/connections (fusectl)")
    abort = conns / str(os.minor(os.stat(mp).st_dev)) / "abort"
    abort.write_text("1")
    with pytest.raises(OSError) as err:
        (mp / "train/img000.jpg").read_bytes()
    assert err.value.errno == errno.ENOTCONN
    wait_for(lambda: not node.status()["mounts"], what="the mount's goodbye")
    subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)


def test_every_mutating_call_is_erofs_and_the_read_only_calls_work(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    """The POSIX surface as a user's tools hit it: every call that would write is EROFS
    at once (never a hang), fsync of a read handle succeeds as on any read-only mount,
    and the read-side calls around the edges (pread past EOF and of 0 bytes, SEEK_DATA
    and SEEK_HOLE, mmap MAP_SHARED, O_DIRECT, a directory opened as a file and a file
    as a directory, statfs, xattrs) answer what a local read-only filesystem does."""
    local_store.apply_env(monkeypatch)
    big = random.Random("posix").randbytes(5 << 20)
    local_store.create(bucket_name, {"f.bin": big, "e.txt": b"", "d/x": b"x"})
    node = make_node()
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "mnt")
    f = mp / "f.bin"
    with open(f, "rb") as handle:
        fd = handle.fileno()
        writes = {
            "O_CREAT": lambda: os.open(mp / "new", os.O_CREAT | os.O_WRONLY, 0o644),
            "O_TRUNC": lambda: os.open(mp / "e.txt", os.O_RDONLY | os.O_TRUNC),
            "O_APPEND": lambda: os.open(f, os.O_WRONLY | os.O_APPEND),
            "truncate": lambda: os.truncate(f, 0),
            "unlink": lambda: os.unlink(f),
            "rename": lambda: os.rename(f, mp / "g"),
            "mkdir": lambda: os.mkdir(mp / "nd"),
            "rmdir": lambda: os.rmdir(mp / "d"),
            "chmod": lambda: os.chmod(f, 0o777),
            "chown": lambda: os.chown(f, 1, 1),
            "utime": lambda: os.utime(f, (1, 1)),
            "utime now": lambda: os.utime(f),
            "setxattr": lambda: os.setxattr(f, "user.x", b"1"),
            "removexattr": lambda: os.removexattr(f, "user.x"),
            "link": lambda: os.link(f, mp / "h"),
            "symlink": lambda: os.symlink("f.bin", mp / "s"),
            "mknod": lambda: os.mknod(mp / "fifo", 0o600 | stat.S_IFIFO),
        }
        for what, call in writes.items():
            with pytest.raises(OSError) as exc:
                call()
            assert exc.value.errno == errno.EROFS, what
        # Only a writable handle could allocate or write; this one is read-only.
        for call in (lambda: os.posix_fallocate(fd, 0, 10), lambda: os.write(fd, b"x")):
            with pytest.raises(OSError) as exc:
                call()
            assert exc.value.errno == errno.EBADF
        os.fsync(fd)  # nothing unwritten: succeeds (it was EROFS)
        # O_APPEND asks nothing of a read-only handle (a write through it is EBADF): it
        # opens and reads, as on a read-only local disk (it was EROFS).
        appending = os.open(f, os.O_RDONLY | os.O_APPEND)
        try:
            assert os.pread(appending, 10, 5) == big[5:15]
            with pytest.raises(OSError) as exc:
                os.write(appending, b"x")
            assert exc.value.errno == errno.EBADF
        finally:
            os.close(appending)
        os.fdatasync(fd)
        assert subprocess.run(["sync", str(f)], capture_output=True).returncode == 0
        assert os.pread(fd, 10, len(big) + 100) == b""
        assert os.pread(fd, 0, 5) == b""
        assert os.pread(fd, 1 << 20, len(big) - 10) == big[-10:]
        assert os.lseek(fd, 0, os.SEEK_DATA) == 0
        assert os.lseek(fd, 0, os.SEEK_HOLE) == len(big)
        with pytest.raises(OSError) as exc:
            os.lseek(fd, len(big) + 1, os.SEEK_DATA)
        assert exc.value.errno == errno.ENXIO
        with mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ) as m:
            assert m[:] == big
        with pytest.raises(OSError) as exc:
            mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        assert exc.value.errno == errno.EACCES
    direct = os.open(f, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, 1 << 20)
        n = os.preadv(direct, [buf], 4096)
        assert n == 1 << 20 and buf[:n] == big[4096 : 4096 + n]
    finally:
        os.close(direct)
    with pytest.raises(IsADirectoryError):
        (mp / "d").read_bytes()
    with pytest.raises(NotADirectoryError):
        os.open(f, os.O_RDONLY | os.O_DIRECTORY)
    with pytest.raises(NotADirectoryError):
        os.stat(f / "x")
    for call in (lambda: os.getxattr(f, "user.x"), lambda: os.listxattr(f)):
        with pytest.raises(OSError) as exc:
            call()
        assert exc.value.errno in (errno.ENOTSUP, errno.ENODATA)
    vfs = os.statvfs(mp)
    assert vfs.f_flag & os.ST_RDONLY and vfs.f_namemax == NAME_MAX  # 1024 before Linux 6.15
    assert vfs.f_files >= 4 and vfs.f_blocks * vfs.f_frsize >= len(big)
    # df -i: the listing's inodes used and room for more (IUse% 0, not 100%)
    assert vfs.f_ffree == vfs.f_favail > 0 and 4 <= vfs.f_files - vfs.f_ffree < 100
    df = subprocess.run(["df", "--output=ipcent", str(mp)], capture_output=True, text=True)
    assert df.returncode == 0 and df.stdout.split()[-1] == "1%", df
