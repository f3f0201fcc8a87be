"""A big cached file read through a real FUSE mount and a real daemon, its values direct.

Owns, on real mounts: a fresh mount reading a big cached file whose pages left the page
cache serves every byte from the cache, reads its values by O_DIRECT (data.mdb stays
mostly out of the page cache, where the kernel's read of each value would have filled
it), and has a value damaged on disk counted and refetched; chunks the daemon admitted a
moment ago (their pages dirty, some evicted: the values only partly cached) read right
at once through another mount.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import random
from pathlib import Path

import pytest

from silofs.cache.bounds import buffer_address
from silofs.cache.format import chunk_key
from silofs.node.store_write import WritableStore, env_map_size
from silofs.units import parse_size
from tests.support.fixtures import needs_fuse
from tests.support.node import Node
from tests.support.poll import wait_for

pytestmark = [needs_fuse, pytest.mark.fuse]

CHUNK = 4 << 20  # the daemon's default chunk size
CHUNKS = 12
DATA = random.Random("big-direct").randbytes(CHUNKS * CHUNK - 777)


def cached_bytes(path: str) -> int:
    """Bytes of the file at `path` in the page cache (mincore on a map of it: nothing is
    read). Root sees every file's residency (pages.ValuePages.truthful)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = os.path.getsize(path)
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
    try:
        vec = (ctypes.c_ubyte * pages)()
        assert libc.mincore(buffer_address(m), size, vec) == 0, ctypes.get_errno()
        return sum(v & 1 for v in vec) * mmap.PAGESIZE
    finally:
        m.close()


def evict(node: Node, sync: bool) -> None:
    """Drop data.mdb's pages that no process maps from the page cache; `sync`: written
    back first (else the dirty pages are only queued for writeback, and stay)."""
    fd = os.open(os.path.join(node.cache_dir, "data.mdb"), os.O_RDONLY)
    try:
        if sync:
            os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def admitted(node: Node) -> None:
    wait_for(
        lambda: node.status()["datasets"][0]["cached_chunks"] == CHUNKS,
        what="every chunk admitted",
    )


def read_sequentially(path: Path) -> bytes:
    out = bytearray()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(1 << 20):
            out += block
    return bytes(out)


def test_a_big_cached_file_is_read_direct_and_a_damaged_value_refetched(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"big.bin": DATA})
    node = make_node(cache_size="128M")
    uri = local_store.uri(bucket_name)
    first = node.mount(uri, tmp_path / "a")
    assert read_sequentially(first / "big.bin") == DATA  # cold: the daemon admits it
    admitted(node)
    node.unmount(first)

    # Chunk 9's value damaged on disk (one data byte), as a bad sector would.
    store = WritableStore(node.cache_dir, env_map_size(parse_size(node.cache_size)))
    try:
        obj = store.get_object(node.status()["datasets"][0]["id"], "big.bin")
        key = chunk_key(obj.content_id, CHUNK, 9)
        with store.env.begin(write=True) as txn:
            value = bytearray(txn.get(key, db=store.db(b"chunks")))
            value[-5000] ^= 0xFF
            txn.put(key, bytes(value), db=store.db(b"chunks"))
    finally:
        store.close()
    evict(node, sync=True)
    data_mdb = os.path.join(node.cache_dir, "data.mdb")
    before = cached_bytes(data_mdb)

    mp = node.mount(uri, tmp_path / "b")  # a fresh mount process: none of it mapped
    assert read_sequentially(mp / "big.bin") == DATA
    status = node.settle(mp, len(DATA))
    assert status["corrupt_chunks"] == 1
    # Read through the page cache, every value would be in it now (48 MiB). Read
    # direct, only what the first chunk's reads, the lookups, the refetched chunk's
    # admission and any chunk the reader reached before its direct read-ahead did
    # (a worker's buffered read: more of them on a loaded host, 27 MiB once) brought in.
    filled = cached_bytes(data_mdb) - before
    assert filled < len(DATA) * 3 // 4, f"{filled >> 20} MiB of data.mdb filled by the read"


def test_chunks_admitted_a_moment_ago_read_right_at_once(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    """The daemon writes data.mdb through the page cache and leaves its pages dirty; an
    eviction then drops the clean ones and queues the dirty ones for writeback, so the
    values are partly cached and the mount reads them direct. The kernel writes a
    range's dirty pages back before it reads the range direct: every byte is the one
    committed."""
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"big.bin": DATA})
    node = make_node(cache_size="128M")
    uri = local_store.uri(bucket_name)
    first = node.mount(uri, tmp_path / "a")
    assert read_sequentially(first / "big.bin") == DATA
    admitted(node)
    evict(node, sync=False)
    mp = node.mount(uri, tmp_path / "b")
    assert read_sequentially(mp / "big.bin") == DATA
    status = node.settle(mp, len(DATA))
    assert status["corrupt_chunks"] == 0 and status["hits"] > 0
