"""The kernel page cache across opens, on real FUSE mounts; the mount's memory in status.

Owns: a re-read of a version the kernel already holds never reaches the mount process
(keep_cache), also for a version a refresh brought after the mount started; an open of
another version than the kernel's pages hold reads the new bytes (the pages are dropped);
pages a new version's handle fills on purpose (fadvise, readahead, mmap) are never
read by a handle of the old one, with one serving process or several;
status shows each mount's resident memory split into anonymous and file-backed (mapped
LMDB) bytes.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import random
from pathlib import Path

import pytest

from tests.support.fixtures import needs_fuse
from tests.support.node import drop_file_cache
from tests.support.poll import wait_for

pytestmark = [needs_fuse, pytest.mark.fuse]


def test_a_reread_of_the_same_version_stays_in_the_kernel_even_after_a_refresh(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    rnd = random.Random(11)
    old, new, other = rnd.randbytes(300_000), rnd.randbytes(200_000), rnd.randbytes(5000)
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"f.bin": old, "g.bin": other})
    uri = local_store.uri(bucket_name)
    node = make_node()
    a = node.mount(uri, tmp_path / "a")

    assert (a / "f.bin").read_bytes() == old
    assert (a / "f.bin").read_bytes() == old  # from the kernel's pages
    node.settle(str(a), len(old))

    local_store.put(bucket_name, "f.bin", new)
    node.mount(uri, tmp_path / "b", "--refresh")  # a new listing generation; `a` follows it
    # The mount invalidates the kernel's attributes of entries the new listing changed.
    wait_for(lambda: os.stat(a / "f.bin").st_size == len(new), what="mount a to follow")

    assert (a / "f.bin").read_bytes() == new  # another version: the old pages are dropped
    assert (a / "f.bin").read_bytes() == new  # the same version again: the kernel's pages
    assert (a / "g.bin").read_bytes() == other  # reaches the mount: a barrier for counters
    want = len(old) + len(new) + len(other)
    assert node.settle(str(a), want)["bytes_read"] == want


def test_status_splits_a_mounts_memory(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"f.bin": b"x" * 100_000})
    node = make_node()
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "mnt")
    assert (mp / "f.bin").read_bytes() == b"x" * 100_000
    memory = node.mount_status(str(mp))["memory"]
    assert set(memory) == {"anon_bytes", "file_bytes", "shmem_bytes"}
    # A Python process holds some MiB of its own; the mapped env and libraries are files.
    assert memory["anon_bytes"] > 1 << 20 and memory["file_bytes"] > 0


def test_pages_an_old_handle_read_are_not_kept_for_the_new_version(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    chunk = 256 << 10
    rnd = random.Random(12)
    old, new = rnd.randbytes(2 * chunk), rnd.randbytes(2 * chunk)  # same size
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"f.bin": old})
    uri = local_store.uri(bucket_name)
    node = make_node()
    a = node.mount(uri, tmp_path / "a", "--chunk-size", "256K")
    f = a / "f.bin"

    fd = os.open(f, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no kernel read-ahead
        assert os.pread(fd, chunk, chunk) == old[chunk:]  # chunk 1 of the old version
        wait_for(lambda: node.status()["datasets"][0]["cached_bytes"] >= chunk, what="admission")
        mtime = os.stat(f).st_mtime_ns
        local_store.put(bucket_name, "f.bin", new)
        node.mount(uri, tmp_path / "b", "--chunk-size", "256K", "--refresh")
        wait_for(lambda: os.stat(f).st_mtime_ns != mtime, what="mount a to follow")

        assert f.read_bytes() == new  # the new version's pages
        drop_file_cache(f)
        # The old handle reads its own version from the cache: its bytes are now the
        # inode's pages at chunk 1.
        assert os.pread(fd, chunk, chunk) == old[chunk:]
        assert f.read_bytes() == new  # a new open must not be served those pages
    finally:
        os.close(fd)


def test_an_old_handle_never_reads_pages_a_new_version_filled(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    chunk = 256 << 10
    rnd = random.Random(13)
    old, new = rnd.randbytes(2 * chunk), rnd.randbytes(2 * chunk)  # same size
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"f.bin": old})
    uri = local_store.uri(bucket_name)
    node = make_node()
    node.expect_errors(r"changed since (this mount listed it|listing)")
    a = node.mount(uri, tmp_path / "a", "--chunk-size", "256K")
    f = a / "f.bin"

    fd = os.open(f, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        assert os.pread(fd, 4096, 0) == old[:4096]
        mtime = os.stat(f).st_mtime_ns
        local_store.put(bucket_name, "f.bin", new)
        node.mount(uri, tmp_path / "b", "--chunk-size", "256K", "--refresh")
        wait_for(lambda: os.stat(f).st_mtime_ns != mtime, what="mount a to follow")

        assert f.read_bytes() == new  # opened while the old handle is open
        for off in (chunk + 100, 0):
            try:
                got = os.pread(fd, 4096, off)
            except OSError as exc:  # the store refuses the old version: EIO, never new
                assert exc.errno == errno.EIO
                continue
            assert got == old[off : off + 4096], f"new bytes at {off} through an old handle"
    finally:
        os.close(fd)
    assert f.read_bytes() == new


@pytest.mark.parametrize("processes", [1, 2], ids=["one-process", "serve-processes-2"])
@pytest.mark.parametrize("fill", ["fadvise", "readahead", "mmap"])
def test_pages_a_new_handle_fills_on_purpose_are_not_read_by_an_old_handle(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path, fill: str, processes: int
) -> None:
    """posix_fadvise(WILLNEED), readahead(2) and mmap fill an inode's pages through a
    handle whatever its direct_io (found by attack20: with both versions under one
    inode, the old handle then read the new version's bytes). The new version opened
    while a handle of the old one is open has an inode of its own (mount/fs.py
    _retire): its pages are never the old handle's. With --serve-processes too: the
    numbers are in the tables every serving process shares (mount/shared.py), and any
    process may answer the old handle's, the new handle's or the path's requests."""
    rnd = random.Random(17)
    old, new = rnd.randbytes(64 << 10), rnd.randbytes(64 << 10)  # same size
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"f.bin": old})
    uri = local_store.uri(bucket_name)
    node = make_node()
    node.expect_errors(r"changed since (this mount listed it|listing)")
    args = ["--serve-processes", str(processes)] if processes > 1 else []
    a = node.mount(uri, tmp_path / "a", *args)
    f = a / "f.bin"
    fd = os.open(f, os.O_RDONLY)  # the old version's handle, nothing read yet
    try:
        mtime = os.stat(f).st_mtime_ns
        local_store.put(bucket_name, "f.bin", new)
        node.mount(uri, tmp_path / "b", "--refresh")
        wait_for(lambda: os.stat(f).st_mtime_ns != mtime, what="mount a to follow")
        fresh = os.open(f, os.O_RDONLY)
        try:
            assert os.fstat(fresh).st_ino != os.fstat(fd).st_ino  # an inode per version
            assert os.fstat(fd).st_mtime_ns == mtime  # the old handle's version's
            if fill == "fadvise":
                os.posix_fadvise(fresh, 0, 0, os.POSIX_FADV_WILLNEED)
            elif fill == "readahead":
                libc = ctypes.CDLL(None, use_errno=True)
                assert libc.readahead(fresh, ctypes.c_longlong(0), ctypes.c_size_t(len(new))) == 0
            else:
                with mmap.mmap(fresh, 0, mmap.MAP_PRIVATE, mmap.PROT_READ) as m:
                    assert m[:] == new
            wait_for(lambda: os.pread(fresh, len(new), 0) == new, what="the new version")
            try:
                got = os.pread(fd, len(old), 0)
            except OSError as exc:  # the store refuses the old version: EIO, never new
                assert exc.errno == errno.EIO
            else:
                assert got == old, "the new version's bytes through a handle of the old one"
        finally:
            os.close(fresh)
    finally:
        os.close(fd)
