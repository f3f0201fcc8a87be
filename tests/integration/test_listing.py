"""Listings through a real mount: the directory index, refresh without remounting,
a daemon killed mid-listing, and mounting while the first listing runs.

Owns what a reader of the mount sees of a listing: readdir of a large directory equal to
the store (the kernel resumes it at our offsets), hard names, `silofs-ctl refresh` while
a file is open (the open handle keeps its version, new opens see the new one, deleted
files vanish, new ones appear), the old listing surviving kill -9 mid-listing and the
next listing starting clean, and --list-in-background never answering ENOENT for a
name the listing has not reached, while waiting only for the directory looked up when
the listing fans out (a slow S3 store: moto behind tests/support/faultproxy.py).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from silofs.cache.store import CacheStore
from tests.support.dirstream import DirStream, needs_getdents, read_all
from tests.support.faultproxy import Fault, FaultPlan, FaultProxy
from tests.support.fixtures import needs_fuse
from tests.support.node import Node, force_unmount
from tests.support.poll import wait_for
from tests.support.servers import AZURITE_KEY, connection_string

pytestmark = [needs_fuse, pytest.mark.fuse]


def _ctl(node: Node, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "silofs_ctl", *args, "--socket", node.socket],
        capture_output=True,
        text=True,
        env=node.env,
        timeout=120,
    )


def _tree(root: Path, dirs: int, per_dir: int) -> None:
    for d in range(dirs):
        sub = root / f"d{d:03d}"
        sub.mkdir(parents=True)
        for i in range(per_dir):
            os.close(os.open(sub / f"f{i:05d}", os.O_CREAT | os.O_WRONLY, 0o644))


def test_readdir_of_a_large_directory_and_hard_names(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    local_store.apply_env(monkeypatch)
    names = [f"file-{i:05d}-{'x' * (i % 200)}" for i in range(3000)]
    tree = {f"big/{n}": b"" for n in names}
    tree |= {"a/b": b"under a", "x" * 255: b"long", "日本/ファイル": b"jp"}
    local_store.create(bucket_name, tree)
    node: Node = make_node()
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "mnt")
    # Many READDIRPLUS requests, each resumed at the offset the last one ended at.
    assert os.listdir(mp / "big") == sorted(names, key=str.encode)
    assert len({e.inode() for e in os.scandir(mp / "big")}) == len(names)
    assert (mp / "a" / "b").read_bytes() == b"under a"
    assert (mp / ("x" * 255)).read_bytes() == b"long"
    assert (mp / "日本" / "ファイル").read_bytes() == b"jp"
    with pytest.raises(OSError) as exc:
        os.stat(mp / ("x" * 256))
    assert exc.value.errno in (errno.ENAMETOOLONG, errno.ENOENT)
    st = os.stat(mp / "big")
    assert st.st_nlink == 2
    assert os.stat(mp).st_nlink == 2 + 3  # a, big, 日本


@pytest.mark.parametrize("processes", [1, 2])
def test_readdir_lists_dot_and_dotdot_and_seekdir_returns_to_a_telldir(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path, processes: int
) -> None:
    """A directory lists '.' (itself) and '..' (its parent; the mount's root: itself, the
    mount point's parent being the kernel's) first, as a local disk and mountpoint-s3,
    gcsfuse and rclone list them (`ls -a` showed neither). A position telldir() gave,
    anywhere in 20,000 names, is where seekdir() comes back to, with one or two
    serving processes."""
    local_store.apply_env(monkeypatch)
    names = [f"f{i:05d}" for i in range(20_000)]
    tree = {f"many/{n}": b"x" for n in names} | {"a/b/c.txt": b"c", "top.txt": b"t"}
    local_store.create(bucket_name, tree)
    node: Node = make_node()
    args = ["--serve-processes", "2"] if processes > 1 else []
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "mnt", *args)

    def ino(*parts: str) -> int:
        return os.stat(mp.joinpath(*parts)).st_ino

    for path, parent in ((mp, mp), (mp / "a", mp), (mp / "a" / "b", mp / "a")):
        got = read_all(path)
        assert [(e.name, e.ino, e.is_dir) for e in got[:2]] == [
            (".", os.stat(path).st_ino, True),
            ("..", os.stat(parent).st_ino, True),
        ], path
        assert all(e.name not in (".", "..") for e in got[2:])
    assert [e.name for e in read_all(mp)] == [".", "..", "a", "many", "top.txt"]
    assert ino("a", "b") != ino("a") != ino()
    ls = subprocess.run(["ls", "-a", str(mp / "a")], capture_output=True, text=True, check=True)
    assert ls.stdout.split() == [".", "..", "b"]
    assert os.listdir(mp / "a") == ["b"]  # Python hides them, as on any disk

    # telldir() after each entry, then seekdir() back to some of them, out of order.
    order, marks = [], []
    with DirStream(mp / "many") as d:
        while (e := d.next()) is not None:
            order.append(e.name)
            marks.append(d.tell())
        assert order == [".", "..", *names]
        for i in (15_000, 1, 0, 19_990, 7, 10_000, len(order) - 1):
            d.seek(marks[i])
            e = d.next()
            want = order[i + 1] if i + 1 < len(order) else None
            assert (e.name if e else None) == want, (i, e)
        d.seek(marks[500])
        rest = []
        while (e := d.next()) is not None:
            rest.append(e.name)
        assert rest == order[501:]


def test_lseek_to_a_directory_s_end_is_past_its_last_name(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    """lseek(dirfd, 0, SEEK_END) answers the directory's st_size (the kernel's, not a
    request): it is past the last name, so a seekdir() there reads nothing, as at
    ext4's end. A fixed 4096 was the offset of a directory's 4,095th name when it had
    more, and a readdir there read on. A small directory's size stays 4096."""
    local_store.apply_env(monkeypatch)
    names = [f"f{i:05d}" for i in range(5000)]
    local_store.create(bucket_name, {**{f"big/{n}": b"" for n in names}, "small/x": b"x"})
    node: Node = make_node()
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "mnt")
    for d, count in ((mp / "big", len(names)), (mp / "small", 1)):
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            end = os.lseek(fd, 0, os.SEEK_END)
        finally:
            os.close(fd)
        assert end == max(4096, 2 + count), d
        with DirStream(d) as stream:
            stream.seek(end)
            assert stream.next() is None, d
            stream.seek(0)
            assert sum(1 for _ in iter(stream.next, None)) == 2 + count


_SMALL_BUFFER_READER = """
import json, random, sys
from tests.support.dirstream import DirStream, getdents
path = sys.argv[1]
tiny = getdents(path, 40)  # one entry per call (glibc reads 32 KiB at a time)
marks, order = [], []
with DirStream(path) as d:
    while (e := d.next()) is not None:
        order.append(e.name)
        marks.append(d.tell())
    seeks = []
    for i in random.Random(7).sample(range(len(order)), 300):
        d.seek(marks[i])
        e = d.next()
        seeks.append([i, e.name if e else None])
print(json.dumps({"tiny": [n for n, _ in tiny], "order": order, "seeks": seeks}))
"""


@needs_getdents
@pytest.mark.parametrize("processes", [1, 2])
def test_a_directory_read_one_entry_per_getdents_call_and_seeked_at_random(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path, processes: int
) -> None:
    """A program reading a large directory with its own small getdents64 buffer (one
    entry per call) and one seekdir()ing to saved telldir() positions at random. The
    kernel asks FUSE for a page of entries per call, takes those that fit and asks
    next at the offset after the last one it took, inside the reply the mount gave: the
    mount counted from the directory's first name on every such call, quadratic: 8,000
    of 100,000 names took 55 s, all of them would take over two hours (a seekdir
    anywhere counted too: 30 ms each in 20,000 names). Each name comes once, in order;
    the subprocess's timeout is the bound (every call answered with a seek)."""
    local_store.apply_env(monkeypatch)
    names = [f"f{i:05d}" for i in range(20_000)]
    local_store.create(bucket_name, {f"many/{n}": b"" for n in names})
    node: Node = make_node()
    args = ["--serve-processes", "2"] if processes > 1 else []
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "mnt", *args)
    repo = Path(__file__).resolve().parents[2]
    res = subprocess.run(
        [sys.executable, "-c", _SMALL_BUFFER_READER, str(mp / "many")],
        capture_output=True,
        text=True,
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert got["tiny"] == [".", "..", *names]
    assert got["order"] == [".", "..", *names]
    order = got["order"]
    for i, name in got["seeks"]:
        assert name == (order[i + 1] if i + 1 < len(order) else None), i


def test_refresh_while_a_file_is_open(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    local_store.apply_env(monkeypatch)
    old, new = b"old version " * 1000, b"NEW " * 5000
    local_store.create(bucket_name, {"a.bin": old, "gone.txt": b"bye", "d/keep.txt": b"k"})
    node: Node = make_node()
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "mnt")
    assert (mp / "gone.txt").read_bytes() == b"bye"
    with open(mp / "a.bin", "rb") as held:
        assert held.read(100) == old[:100]
        local_store.put(bucket_name, "a.bin", new)
        local_store.put(bucket_name, "fresh.txt", b"fresh")
        os.unlink(Path(local_store.root) / bucket_name / "gone.txt")
        res = _ctl(node, "refresh", "--wait", bucket_name)
        assert res.returncode == 0, res.stderr
        assert "generation 2" in res.stdout
        # The mount follows the new listing within its report period.
        wait_for(lambda: (mp / "fresh.txt").exists(), what="the new listing in the mount")
        assert (mp / "fresh.txt").read_bytes() == b"fresh"
        assert sorted(os.listdir(mp)) == ["a.bin", "d", "fresh.txt"]
        with pytest.raises(FileNotFoundError):
            open(mp / "gone.txt", "rb")
        # The open handle keeps reading the version it opened: never a mix.
        assert held.read() == old[100:]
    # A new open sees the new version, with its new size (the mount tells the kernel to
    # drop the names and attributes it cached, right after moving to the new listing).
    wait_for(lambda: os.stat(mp / "a.bin").st_size == len(new), what="the kernel to drop old attrs")
    assert (mp / "a.bin").read_bytes() == new
    assert (mp / "d" / "keep.txt").read_bytes() == b"k"
    ds = node.request("GET", f"/v1/datasets/{bucket_name}")
    assert ds["generation"] == 2 and ds["objects"] == 3


@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.parametrize("refreshes", [1, 2])
def test_a_directory_read_across_refreshes_lists_every_name_once_with_new_attributes(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path, processes: int, refreshes: int
) -> None:
    """A directory read slowly (an indexer's os.scandir over a large directory) while the
    dataset is listed again. Every name in both listings comes once, a name added past
    where the reader was comes too, and the entries carry the new listing's attributes.
    With two listings (the second deletes the rows of the generation the handle opened)
    the read stopped at the kernel's first batches, silently: 6,553 of 20,000 names
    (`ls | wc -l` short, files missing to an indexer). With one, the rest came with the
    old sizes, READDIRPLUS putting them back into the kernel the refresh had told to
    forget them: `stat` showed the old size for the attribute timeout (an hour)."""
    local_store.apply_env(monkeypatch)
    names = [f"f{i:05d}" for i in range(20_000)]
    local_store.create(bucket_name, {f"many/{n}": b"x" for n in names})
    node: Node = make_node()
    args = ["--serve-processes", "2"] if processes > 1 else []
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "mnt", *args)
    seen = []
    with os.scandir(mp / "many") as it:
        for entry in it:
            seen.append(entry.name)
            if len(seen) == 10:
                local_store.put(bucket_name, "many/zz-added", b"new")
                local_store.put(bucket_name, "many/f19990", b"grown")
                for gen in range(2, 2 + refreshes):
                    local_store.put(bucket_name, f"top{gen}", b"t")
                    res = _ctl(node, "refresh", "--wait", bucket_name)
                    assert res.returncode == 0, res.stderr
                    assert f"generation {gen}" in res.stdout
                    wait_for(lambda g=gen: (mp / f"top{g}").exists(), what="the new listing")
    assert os.stat(mp / "many" / "f19990").st_size == len(b"grown")
    assert len(seen) == len(set(seen))
    assert sorted(seen) == [*names, "zz-added"]


def test_a_file_open_while_it_is_deleted_and_listed_twice_still_stats_and_reads(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    """An open file whose object was deleted, then the dataset listed twice (no listing
    the mount can read has it any more): fstat answers its version's size and mtime
    with no links, as for a deleted file open on a local disk, and the handle reads
    its cached bytes. fstat was ENOENT, and so was Python's read() (it fstats first)."""
    local_store.apply_env(monkeypatch)
    data = os.urandom(100_000)
    local_store.create(bucket_name, {"a.bin": data, "b.bin": b"b"})
    node: Node = make_node()
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "mnt")
    before = os.stat(mp / "a.bin")
    assert (mp / "a.bin").read_bytes() == data  # cached
    with open(mp / "a.bin", "rb") as held:
        os.unlink(Path(local_store.root) / bucket_name / "a.bin")
        for gen in (2, 3):
            local_store.put(bucket_name, f"top{gen}", b"t")
            res = _ctl(node, "refresh", "--wait", bucket_name)
            assert res.returncode == 0, res.stderr
            assert f"generation {gen}" in res.stdout
            wait_for(lambda g=gen: (mp / f"top{g}").exists(), what="the new listing")
        st = os.fstat(held.fileno())
        assert (st.st_size, st.st_mtime, st.st_ino) == (
            len(data),
            before.st_mtime,
            before.st_ino,
        )
        assert st.st_nlink == 0
        assert held.read() == data
    assert not (mp / "a.bin").exists()
    assert (mp / "b.bin").read_bytes() == b"b"


def test_an_open_directory_deleted_and_listed_twice_still_stats(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    """A directory open (an fd; a shell's cwd, find's fchdir) whose objects were deleted,
    then the dataset listed twice: fstat answers it as it was opened, with no links, as
    for a directory removed on a local disk, and reading it lists nothing. fstat was
    ENOENT (as it was for an open file, until attack12)."""
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"d/x.bin": b"x", "d/sub/y.bin": b"y", "keep.txt": b"k"})
    node: Node = make_node()
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "mnt")
    before = os.stat(mp / "d")
    fd = os.open(mp / "d", os.O_RDONLY | os.O_DIRECTORY)
    try:
        shutil.rmtree(Path(local_store.root) / bucket_name / "d")
        for gen in (2, 3):
            local_store.put(bucket_name, f"top{gen}", b"t")
            res = _ctl(node, "refresh", "--wait", bucket_name)
            assert res.returncode == 0, res.stderr
            assert f"generation {gen}" in res.stdout
            wait_for(lambda g=gen: (mp / f"top{g}").exists(), what="the new listing")
        wait_for(lambda: not (mp / "d").exists(), what="d/ to go")
        st = os.fstat(fd)
        assert (st.st_ino, st.st_mtime, st.st_nlink) == (before.st_ino, before.st_mtime, 0)
        assert stat.S_ISDIR(st.st_mode)
        assert os.listdir(fd) == []
    finally:
        os.close(fd)
    assert (mp / "keep.txt").read_bytes() == b"k"


def test_a_refresh_reaches_names_the_kernel_holds_beyond_the_mounts_recent_ones(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    """With the default metadata TTL (indefinite) the kernel keeps names and attributes
    for an hour; after a refresh it must not serve a changed file at its old size, nor a
    deleted one, even when the mount's own cache of recent entries (8192) has long
    forgotten them."""
    local_store.apply_env(monkeypatch)
    tree = {f"many/{i:05d}": b"" for i in range(9000)}
    tree |= {"a.txt": b"small", "gone.txt": b"bye", "old/dir/x": b"x"}
    local_store.create(bucket_name, tree)
    node: Node = make_node()
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "mnt")
    assert os.stat(mp / "a.txt").st_size == 5
    assert os.stat(mp / "gone.txt").st_size == 3
    assert os.stat(mp / "old/dir/x").st_size == 1
    for i in range(9000):  # the mount's recent entries move on; the kernel keeps these
        os.stat(mp / "many" / f"{i:05d}")
    new = b"a much bigger new version"
    local_store.put(bucket_name, "a.txt", new)
    os.unlink(Path(local_store.root) / bucket_name / "gone.txt")
    shutil.rmtree(Path(local_store.root) / bucket_name / "old")
    res = _ctl(node, "refresh", "--wait", bucket_name)
    assert res.returncode == 0, res.stderr
    wait_for(lambda: os.stat(mp / "a.txt").st_size == len(new), what="the new size of a.txt")
    assert (mp / "a.txt").read_bytes() == new
    wait_for(lambda: not (mp / "gone.txt").exists(), what="gone.txt to go")
    wait_for(lambda: not (mp / "old").exists(), what="the directory old/ to go")


def test_daemon_killed_mid_listing_keeps_the_old_listing(make_node, tmp_path: Path) -> None:
    store = tmp_path / "store"
    _tree(store, 1, 10)
    uri = f"file://{store}/"
    node: Node = make_node(cache_size="256M")
    mp = node.mount(uri, tmp_path / "mnt")
    assert len(os.listdir(mp / "d000")) == 10
    assert node.run("unmount", str(mp)).returncode == 0
    _tree(store / "more", 40, 1500)  # 60k files: a listing of several batches
    ds = node.request("POST", "/v1/datasets", {"uri": uri, "refresh": True})

    def progress() -> dict | None:
        d = node.request("GET", f"/v1/datasets/{ds['id']}")
        return d if d["listed"] > 10_000 or d["state"] != "listing" else None

    seen = wait_for(progress, timeout=60, what="the listing to pass one batch")
    node.kill9()
    node.start()
    # The listing that was complete is still served; a half-written one is not. (On a
    # machine fast enough to finish 60k objects before the kill, the new one is served.)
    mp = node.mount(uri, mp)
    finished = seen["state"] == "ready"
    assert sorted(os.listdir(mp)) == (["d000", "more"] if finished else ["d000"]), seen
    assert node.run("unmount", str(mp)).returncode == 0
    # The next listing starts clean and sees everything.
    mp = node.mount(uri, mp, "--refresh")
    assert len(os.listdir(mp / "more")) == 40
    assert sum(len(os.listdir(mp / "more" / d)) for d in os.listdir(mp / "more")) == 60_000
    assert node.run("unmount", str(mp)).returncode == 0
    node.stop()
    cache = CacheStore(node.cache_dir, 1 << 30)
    try:
        dsid = ds["id"]
        gens = set()
        with cache.env.begin() as txn:
            for db in (b"dirents", b"inodes"):
                for k, _ in txn.cursor(db=cache.db(db)):
                    if int.from_bytes(k[:8], "big") == dsid:
                        gens.add(int.from_bytes(k[8:12], "big"))
        # Only the current generation and the one before it (kept for open files).
        current = cache.dataset_record(dsid).get("gen")
        assert current is not None and gens <= {current, current - 1}
    finally:
        cache.close()


def test_list_in_background_never_answers_enoent_for_unlisted_names(
    make_node, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    _tree(store, 30, 1000)
    uri = f"file://{store}/"
    node: Node = make_node(cache_size="256M")
    mp = node.mount(uri, tmp_path / "mnt", "--list-in-background")
    # The last directory, whatever the listing reached: a lookup waits, never fails.
    assert (mp / "d029" / "f00999").stat().st_size == 0
    assert len(os.listdir(mp / "d017")) == 1000
    assert not (mp / "d030").exists()
    # A local tree is listed directory by directory: the listing may still run here.
    wait_for(lambda: node.status()["datasets"][0]["state"] == "ready", what="the listing")
    assert node.status()["datasets"][0]["objects"] == 30_000


_SERVER = {"s3": "s3_server", "azure": "azurite_server", "gcs": "gcs_server"}


@pytest.fixture(params=["s3", "azure", "gcs"])
def slow_store(request: pytest.FixtureRequest, monkeypatch, tmp_path: Path):
    """(kind, store helper, a started FaultProxy with no delay yet, the daemon's env, the
    mount flags) for an object store reached through tests/support/faultproxy.py: the test sets
    the delay per request with proxy.set_plan once the objects are uploaded."""
    kind = request.param
    s = request.getfixturevalue(_SERVER[kind])
    s.apply_env(monkeypatch)
    parts = urlsplit(s.endpoint_url)
    with FaultProxy((parts.hostname or "127.0.0.1", parts.port or 80), FaultPlan()) as proxy:
        if kind == "s3":
            env, args = {}, ["--endpoint-url", proxy.url]
        elif kind == "azure":
            blob = f"{proxy.url}/{s.account}"
            env, args = (
                {"AZURE_STORAGE_CONNECTION_STRING": connection_string(blob, AZURITE_KEY)},
                [],
            )
        else:
            env, args = {"STORAGE_EMULATOR_HOST": proxy.url}, []
        yield kind, s, proxy, env, args


def test_list_in_background_waits_only_for_the_directory_looked_up(
    make_node, slow_store, bucket_name, tmp_path: Path
) -> None:
    """A slow store (150 ms per request, 5 keys per page): big/ takes ~40 pages, small/
    one. While big/ is still being listed, small/ answers: its file, its readdir, and
    ENOENT for a name it does not have; a name in big/ waits and is found. A directory
    known only by 'dir/' markers (markers/, markers/sub/) is never shown, not even empty
    while the listing runs: it is in no finished listing. Each object store kind."""
    kind, store, proxy, env, args = slow_store
    big = {f"big/f{i:03d}": b"" for i in range(200)}
    markers = {"markers/": b"", "markers/sub/": b"", "withmarker/": b"", "withmarker/a": b"a"}
    store.create(bucket_name, {**big, **markers, "small/one": b"1", "small/two": b"22"})
    config = tmp_path / "silofs.toml"
    config.write_text("[backend]\npage_size = 5\n")
    node: Node = make_node(env=env, args=("--config", str(config)))
    proxy.set_plan(FaultPlan(first_byte_delay=0.15))
    mp = node.mount(store.uri(bucket_name), tmp_path / "mnt", "--list-in-background", *args)
    try:
        # Progress in status while it lists (40 pages of 150 ms: it is still listing).
        res = _ctl(node, "status")
        assert res.returncode == 0, res.stderr
        assert re.search(r": listing, [\d,]+ objects listed \([\d,]+/s\)", res.stdout), res.stdout
        assert (mp / "small" / "two").read_bytes() == b"22"
        assert sorted(os.listdir(mp / "small")) == ["one", "two"]
        assert not (mp / "small" / "three").exists()
        # The marker-only directory: a lookup waits until its prefixes are listed with
        # no object under them, then ENOENT; the root lists only what will stay.
        assert not (mp / "markers").exists()
        assert sorted(os.listdir(mp)) == ["big", "small", "withmarker"]
        assert (mp / "withmarker" / "a").read_bytes() == b"a"
        # All of that while big/ was still being listed (40 pages of 150 ms one after
        # another: it cannot be done yet unless small/ waited for the whole listing).
        ds = node.status()["datasets"][0]
        assert ds["state"] == "listing", ds
        assert ds["listed"] < 203, ds
        assert (mp / "big" / "f199").stat().st_size == 0  # waits for big/, then found
        assert len(os.listdir(mp / "big")) == 200
        wait_for(lambda: node.status()["datasets"][0]["state"] == "ready", what="the listing")
        assert sorted(os.listdir(mp)) == ["big", "small", "withmarker"]
        assert node.status()["datasets"][0]["objects"] == 203
    finally:
        force_unmount(str(mp))


def test_a_serial_listing_answers_for_a_directory_once_the_keys_pass_it(
    make_node, s3_server, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    """list_workers = 1: one stream of keys in order, 5 a page at 150 ms. a/ is complete
    at the first key past it, so it answers (its files, its readdir, ENOENT for a name
    it lacks) while the 120 pages of big/ are still to come (18 s: room for a slow
    host's process starts), which then list without the delay."""
    s3_server.apply_env(monkeypatch)
    big = {f"big/f{i:03d}": b"" for i in range(600)}
    s3_server.create(bucket_name, {"a/one": b"1", "a/two": b"22", **big})
    config = tmp_path / "silofs.toml"
    config.write_text("[backend]\npage_size = 5\nlist_workers = 1\n")
    node: Node = make_node(args=("--config", str(config)))
    parts = urlsplit(s3_server.endpoint_url)
    plan = FaultPlan(first_byte_delay=0.15)
    with FaultProxy((parts.hostname or "127.0.0.1", parts.port or 80), plan) as proxy:
        mp = node.mount(
            s3_server.uri(bucket_name),
            tmp_path / "mnt",
            "--list-in-background",
            "--endpoint-url",
            proxy.url,
        )
        try:
            assert (mp / "a" / "two").read_bytes() == b"22"
            assert sorted(os.listdir(mp / "a")) == ["one", "two"]
            assert not (mp / "a" / "three").exists()
            ds = node.status()["datasets"][0]
            assert ds["state"] == "listing" and ds["listed"] < 602, ds
            proxy.set_plan(FaultPlan())
            assert len(os.listdir(mp / "big")) == 600  # waits for big/
        finally:
            force_unmount(str(mp))


def test_daemon_killed_mid_listing_of_an_object_store(
    make_node, slow_store, bucket_name, tmp_path: Path
) -> None:
    """kill -9 while an object store's listing is being written (fanned out over 4
    workers, 200 ms per request): the listing that was complete is served after the
    restart, and the next listing starts clean and sees everything."""
    kind, store, proxy, env, args = slow_store
    store.create(bucket_name, {f"d000/f{i}": b"x" for i in range(10)})
    config = tmp_path / "silofs.toml"
    config.write_text("[backend]\npage_size = 5\nlist_workers = 4\n")
    node: Node = make_node(env=env, args=("--config", str(config)))
    uri = store.uri(bucket_name)
    mp = node.mount(uri, tmp_path / "mnt", *args)
    assert len(os.listdir(mp / "d000")) == 10
    assert node.run("unmount", str(mp)).returncode == 0
    for d in range(30):
        for i in range(4):
            store.put(bucket_name, f"more/d{d:02d}/f{i}", b"y")
    proxy.set_plan(FaultPlan(first_byte_delay=0.2))
    body: dict = {"uri": uri, "refresh": True}
    if kind == "s3":
        body["endpoint_url"] = proxy.url
    ds = node.request("POST", "/v1/datasets", body)

    def progress() -> dict | None:
        d = node.request("GET", f"/v1/datasets/{ds['id']}")
        return d if d["listed"] >= 20 or d["state"] != "listing" else None

    seen = wait_for(progress, timeout=60, what="the listing to pass 20 objects")
    node.kill9()
    node.start("--config", str(config))
    mp = node.mount(uri, mp, *args)
    finished = seen["state"] == "ready"
    assert sorted(os.listdir(mp)) == (["d000", "more"] if finished else ["d000"]), seen
    assert node.run("unmount", str(mp)).returncode == 0
    mp = node.mount(uri, mp, "--refresh", *args)
    assert len(os.listdir(mp / "more")) == 30
    assert sum(len(os.listdir(mp / "more" / d)) for d in os.listdir(mp / "more")) == 120
    assert (mp / "more" / "d29" / "f3").read_bytes() == b"y"
    assert node.run("unmount", str(mp)).returncode == 0
    node.stop()
    cache = CacheStore(node.cache_dir, 1 << 30)
    try:
        gens = set()
        with cache.env.begin() as txn:
            for db in (b"dirents", b"inodes"):
                for k, _ in txn.cursor(db=cache.db(db)):
                    if int.from_bytes(k[:8], "big") == ds["id"]:
                        gens.add(int.from_bytes(k[8:12], "big"))
        current = cache.dataset_record(ds["id"]).get("gen")
        assert current is not None and gens <= {current, current - 1}
    finally:
        cache.close()


def _errno(fn) -> int | None:
    try:
        fn()
    except OSError as exc:
        return exc.errno
    return None


def test_list_in_background_never_shows_a_failed_listing_as_the_whole_bucket(
    make_node, s3_server, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    """The store fails every listing page after the second (HTTP 500, past the retries)
    while a --list-in-background mount serves the listing being written. The mount used
    to go on answering from the pages it got as if they were the bucket: an empty or
    partial readdir of the root, ENOENT for names never listed. Now a directory the
    failed listing did not complete answers EIO (readdir, and a name not in it), until
    a refresh that completes: then the whole bucket, in the same mount."""
    s3_server.apply_env(monkeypatch)
    keys = {f"a/f{i}": b"a" for i in range(8)} | {f"b/f{i:02d}": b"bb" for i in range(30)}
    s3_server.create(bucket_name, keys)
    up = urlsplit(s3_server.endpoint_url)
    with FaultProxy((up.hostname or "127.0.0.1", up.port or 80), FaultPlan()) as proxy:
        config = tmp_path / "silofs.toml"
        config.write_text("[backend]\npage_size = 5\nlist_workers = 1\n")
        node: Node = make_node(args=("--config", str(config)))
        node.expect_errors("S3 busy or failing", "listing failed")
        uri = s3_server.uri(bucket_name)
        proxy.set_plan(FaultPlan(first_byte_delay=0.2))
        mp = node.mount(uri, tmp_path / "mnt", "--list-in-background", "--endpoint-url", proxy.url)
        try:

            def pages() -> int:
                return sum(1 for r in proxy.settled_history() if "list-type" in r.target)

            wait_for(lambda: pages() >= 2, what="two listing pages")
            fail = Fault("http_500", path="continuation-token")
            proxy.set_plan(FaultPlan(faults=[fail]))
            wait_for(
                lambda: node.status()["datasets"][0]["state"] == "error", what="the listing to fail"
            )
            # The mount learns it within a report period; until then it waits, then EIO.
            wait_for(lambda: _errno(lambda: os.listdir(mp)) == errno.EIO, what="EIO at the root")
            assert _errno(lambda: (mp / "b" / "f29").stat()) == errno.EIO
            assert _errno(lambda: (mp / "c").stat()) == errno.EIO  # not ENOENT: not known
            proxy.set_plan(FaultPlan())
            res = _ctl(node, "refresh", uri)
            assert res.returncode == 0, res.stderr
            wait_for(lambda: _errno(lambda: os.listdir(mp)) is None, what="the refreshed listing")
            assert sorted(os.listdir(mp)) == ["a", "b"]
            assert len(os.listdir(mp / "b")) == 30
            assert (mp / "b" / "f29").read_bytes() == b"bb"
            assert not (mp / "c").exists()
        finally:
            force_unmount(str(mp))


def test_st_mtime_ns_is_the_stores_timestamp_exactly(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    """Stores stamp to the ms (S3), the us (GCS) or the second (Azure; moto's listing
    too): stat's st_mtime_ns is that stamp, exactly. It was int(seconds * 1e9) of a
    double: ...20.122999808 for S3's ...20.123 (3 ms stamps in 4). Local files stamped
    to the ms and the us stand for them (a local file's digits below the us are not
    kept: docs/SEMANTICS.md)."""
    local_store.apply_env(monkeypatch)
    base = 1_700_000_000 * 10**9
    want = {
        "ms-123": base + 123_000_000,
        "ms-999": base + 999_000_000,
        "us-654321": base + 654_321_000,
        "us-000001": base + 1_000,
        "s": base,
        "old": 86_400 * 10**9 + 500_000_000,
    }
    local_store.create(bucket_name, {k: b"x" for k in want})
    root = Path(local_store.uri(bucket_name).removeprefix("file://"))
    for k, ns in want.items():
        os.utime(root / k, ns=(ns, ns))
    node: Node = make_node()
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "mnt")
    assert {k: os.stat(mp / k).st_mtime_ns for k in want} == want
    assert {e.name: e.stat().st_mtime_ns for e in os.scandir(mp)} == want  # READDIRPLUS
