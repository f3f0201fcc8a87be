"""A file is one version from open to close, on real FUSE mounts of one daemon.

Owns: after another mount's `--refresh` lists a changed object, a handle opened before
it reads the old version or gets EIO, never bytes of the new version mixed in (the
mount's chunk requests carry the version it listed; the daemon answers 409 for another
one, or serves the version the handle opened, from the previous listing generation, which
the store then refuses as changed); the refreshing mount reads the new version whole.
And a handle of the old version read to its end (the kernel cuts the inode's size to
it) leaves no cut size behind: an open right after its close reads the new one whole.
"""

from __future__ import annotations

import collections
import errno
import itertools
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.support.fixtures import needs_fuse
from tests.support.poll import wait_for

pytestmark = [needs_fuse, pytest.mark.fuse]

CHUNK = 256 << 10


def _pread(fd: int, size: int, off: int) -> bytes | int:
    """The bytes read, or the errno of a failed read."""
    try:
        return os.pread(fd, size, off)
    except OSError as exc:
        return exc.errno or -1


def test_an_open_file_never_mixes_versions_after_a_refresh(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    old = random.Random("old").randbytes(4 * CHUNK)
    new = random.Random("new").randbytes(4 * CHUNK)  # same size: size cannot tell them apart
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"d/shard.bin": old})
    uri = local_store.uri(bucket_name)
    node = make_node()
    a = node.mount(uri, tmp_path / "a", "--chunk-size", "256K")
    # The refused reads, logged: the daemon reads the old version (kept from the previous
    # listing generation) and the store refuses it as changed.
    node.expect_errors(r"changed since (this mount listed it|listing)")

    fd = os.open(a / "d/shard.bin", os.O_RDONLY)
    try:
        # No kernel read-ahead and no sequential pattern: chunk 1 is not fetched early.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        assert os.pread(fd, 4096, 0) == old[:4096]

        local_store.put(bucket_name, "d/shard.bin", new)
        b = node.mount(uri, tmp_path / "b", "--chunk-size", "256K", "--refresh")
        assert (b / "d/shard.bin").read_bytes() == new  # the refreshed listing

        for off in (CHUNK + 100, 2 * CHUNK, 3 * CHUNK + 5000):
            got = _pread(fd, 4096, off)
            assert got != new[off : off + 4096], f"new bytes at {off} through an old handle"
            assert got in (errno.EIO, old[off : off + 4096]), got
        # Here chunk 1.. were never cached in the old version: the store refused them.
        assert _pread(fd, 4096, CHUNK + 100) == errno.EIO
        assert os.pread(fd, 4096, 0) == old[:4096]  # the cached chunk 0 is still served
    finally:
        os.close(fd)


def _reads(path: Path) -> bytes | None:
    """The file's bytes; None for EIO: a serving process that has not followed the
    refresh yet opens the version it listed, which the store no longer has."""
    try:
        return path.read_bytes()
    except OSError as exc:
        if exc.errno != errno.EIO:
            raise
        return None


def _refresh(node, uri: str) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "silofs_ctl", "refresh", uri, "--wait", "--socket", node.socket],
        capture_output=True,
        text=True,
        env=node.env,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("procs", [1, 2])
def test_a_file_grown_by_a_refresh_opens_whole_right_after_an_old_handle_closes(
    procs, make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    """A handle opened before a refresh that listed the file larger reads its own
    version to its end: that short read makes the kernel cut the inode's size to the
    old one (the handle sees EOF there, not zeros). Once it is closed, a new open must
    see the new size and read the new version whole: the inode's attributes are
    forgotten as the handle is released. They were forgotten only at the report loop's
    next round (up to 0.25 s later), and an open in between read the new version cut
    at the old size, silently, and fstat showed that size."""
    versions = [random.Random(n).randbytes(4 * CHUNK + 7 + n * 100_003) for n in range(4)]
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"f.bin": versions[0]})
    uri = local_store.uri(bucket_name)
    node = make_node()
    node.expect_errors(r"changed since (this mount listed it|listing)")  # _reads's EIO
    mp = node.mount(uri, tmp_path / "a", "--chunk-size", "256K", "--serve-processes", str(procs))
    for before, after in itertools.pairwise(versions):  # a race shows in some rounds
        assert (mp / "f.bin").read_bytes() == before  # cached whole
        fd = os.open(mp / "f.bin", os.O_RDONLY)
        try:
            assert os.pread(fd, 100, 0) == before[:100]
            local_store.put(bucket_name, "f.bin", after)
            _refresh(node, uri)
            # A new open (direct_io, while the old handle is open) reads the new version.
            wait_for(lambda a=after: _reads(mp / "f.bin") == a, what="the refresh")
            got = b""
            while chunk := os.pread(fd, 1 << 20, len(got)):
                got += chunk
            assert got == before  # its own version, to its own end
        finally:
            os.close(fd)
        # Opened right after the close: its RELEASE reached the mount before this OPEN.
        with open(mp / "f.bin", "rb") as f:
            assert os.fstat(f.fileno()).st_size == len(after)
            assert f.read() == after
        assert os.stat(mp / "f.bin").st_size == len(after)


def test_an_old_handle_never_reads_zeros_past_its_version_after_a_refresh_grew_it(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    """While a handle of a version reads through the page cache, the size the mount
    gives the kernel for the file is at most that version's: a read's short reply at
    the version's end then ends it (EOF), whatever the kernel asked in the meantime.
    The mount gave the new listing's size: where the kernel took it while such a read
    was in flight (a refresh's invalidation, a stat), it did not cut its size at the
    short reply, and the reader got the rest of that page as zeros after its version's
    bytes (seen under --metadata-ttl 1 with objects rewritten: test below)."""
    old = random.Random("old").randbytes(300_000)  # ends inside a page
    new = random.Random("new").randbytes(700_000)
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"f.bin": old})
    uri = local_store.uri(bucket_name)
    node = make_node()
    node.expect_errors(r"changed since (this mount listed it|listing)")  # _reads's EIO
    mp = node.mount(uri, tmp_path / "a", "--chunk-size", "256K")
    assert (mp / "f.bin").read_bytes() == old
    fd = os.open(mp / "f.bin", os.O_RDONLY)
    try:
        assert os.pread(fd, 100, 0) == old[:100]
        local_store.put(bucket_name, "f.bin", new)
        _refresh(node, uri)
        wait_for(lambda: _reads(mp / "f.bin") == new, what="the refresh")
        # The handle's inode is the old version's (the new one has its own): its size.
        assert os.stat(mp / "f.bin").st_size == len(new)
        assert os.fstat(fd).st_size == len(old)
        assert os.pread(fd, 1 << 20, 0) == old
    finally:
        os.close(fd)
    with open(mp / "f.bin", "rb") as f:  # after the old handle's RELEASE: the new size
        assert os.fstat(f.fileno()).st_size == len(new)
        assert f.read() == new


def test_readers_under_a_short_metadata_ttl_while_files_are_rewritten_read_one_version_each(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    """Six readers open, fstat and read four files whole while a writer replaces them
    (rename) with versions of other sizes, and the mount lists again every second
    (--metadata-ttl 1). Every read is one version's bytes, or EIO (the version the
    mount listed is gone from the store): never bytes of two versions, never zeros
    after a version's end (seen: 470001 bytes of one version, then 5135 zeros to the
    page's end, before the mount gave no size past a page-cache handle's version)."""

    def size(v: int) -> int:
        return 300_000 + (v % 5) * 170_001  # ends inside a page

    names = [f"f{i}.bin" for i in range(4)]
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {n: bytes([1]) * size(1) for n in names})
    node = make_node()
    node.expect_errors(r"changed since (this mount listed it|listing)|was deleted since")
    uri = local_store.uri(bucket_name)
    mp = node.mount(uri, tmp_path / "mnt", "--chunk-size", "256K", "--metadata-ttl", "1")
    stop = threading.Event()
    seen: collections.Counter[str] = collections.Counter()
    bad: list[tuple] = []

    def writer() -> None:
        rnd, v = random.Random(1), 1
        while not stop.is_set():
            v += 1
            path = local_store.root / bucket_name / rnd.choice(names)
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(bytes([v % 251]) * size(v))
            os.rename(tmp, path)
            stop.wait(0.05)  # a writer's pace, not synchronisation

    def reader(seed: int) -> None:
        rnd = random.Random(seed)
        while not stop.is_set():
            try:
                with open(mp / rnd.choice(names), "rb") as f:
                    data = f.read()
            except OSError as exc:
                assert exc.errno == errno.EIO, exc
                seen["eio"] += 1
                continue
            v = data[0]
            if data.count(v) != len(data):
                bad.append((len(data), [i for i in range(0, len(data), 4096) if data[i] != v][:3]))
            elif len(data) in {size(x) for x in range(v, 5000, 251)}:
                seen["whole"] += 1
            else:
                seen["cut"] += 1  # a refresh listed it shorter (docs/SEMANTICS.md)

    threads = [threading.Thread(target=writer)]
    threads += [threading.Thread(target=reader, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    try:
        time.sleep(20)  # the length of the run, not synchronisation
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not bad, bad[:5]
    assert seen["whole"] > 100, seen
