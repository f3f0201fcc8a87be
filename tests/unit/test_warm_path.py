"""The mount's warm path without FUSE: the reused read snapshot, the chunk buffer's bound.

Owns: a chunk the daemon admitted after the mount's read snapshot began is served from
LMDB by the next read (the snapshot is reused between reads, so a lookup that misses
looks again in a fresh one) without asking the daemon; the read after a miss begins a
fresh snapshot; the snapshot is not renewed per read; the chunk buffer's default bound
follows read-ahead (chunk size x (read-ahead + 2) x streams) and holds; a hit whose pages
are not in memory is read by a worker thread and verified before it is served; a
sequential reader has the kernel read the cached chunks ahead; a map the daemon grew is
adopted. A real LMDB env;
the admitting writer runs in another process, as the daemon does (LMDB allows one env
per path per process).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import random
import subprocess
import sys
import textwrap
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest
import trio

from silofs.cache.format import ChunkRef
from silofs.cache.store import CacheStore
from silofs.mount import reader as reader_mod
from silofs.mount.pages import ValuePages
from silofs.mount.reader import ChunkReader, MissError, OpenFile, buffer_bytes_for
from silofs.node.store_write import WritableStore
from silofs.records import ObjectInfo
from tests.support.pagecache import drop_unmapped_pages

CHUNK = 64 << 10
ROOT = Path(__file__).resolve().parents[2]


def _obj(i: int) -> ObjectInfo:
    return ObjectInfo(f"f{i}.bin", 1000 + i, 1.0, f"v{i}", f"c{i}")


def _body(i: int) -> bytes:
    return bytes([i % 251]) * (1000 + i)


def admit(env: str, items: list[int]) -> None:
    """Admit objects `items` (one chunk each) from another process, as the daemon does."""
    code = textwrap.dedent(
        f"""
        from silofs.cache.format import ChunkRef, encode_chunk
        from silofs.node.store_write import PendingChunk, WritableStore
        from tests.unit.test_warm_path import _body, _obj, CHUNK
        s = WritableStore({env!r}, 64 << 20)
        pending = []
        for i in {items!r}:
            o = _obj(i)
            ref = ChunkRef.of(o, CHUNK, 0)
            value = encode_chunk(1, 0, CHUNK, o.key, o.content_id, _body(i))
            pending.append(PendingChunk(1, ref.key, value, ref.length))
        s.admit(pending, {{}}, lambda _d, _u: 1 << 40)
        s.close()
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


class FakeDaemon:
    """Answers chunk requests with the object's bytes and counts them."""

    def __init__(self) -> None:
        self.requests: list[str] = []

    async def request(self, method: str, path: str) -> tuple[int, dict, bytes]:
        self.requests.append(path)
        i = int(path.split("key=f", 1)[1].split(".bin", 1)[0])
        return 200, {"x-silofs-source": "store"}, _body(i)


async def _never() -> None:
    raise AssertionError("no re-registration here")


@pytest.fixture
def env(tmp_path: Path) -> Iterator[str]:
    path = str(tmp_path / "env")
    os.makedirs(path)
    WritableStore(path, 64 << 20).close()  # create the dbs
    admit(path, [0])
    yield path


def _reader(
    env: str,
    daemon: Any,
    buffer_bytes: int | None = 1 << 20,
    reregister: Callable[[], Awaitable[None]] = _never,
) -> ChunkReader:
    return ChunkReader(
        CacheStore(env, 64 << 20),
        daemon,
        dataset_id=1,
        chunk_size=CHUNK,
        buffer_bytes=buffer_bytes,
        readahead_bytes=0,
        reregister=reregister,
    )


class NotFoundDaemon:
    """Answers every chunk request 404 with `message`."""

    def __init__(self, message: str) -> None:
        self.message = message
        self.requests = 0

    async def request(self, method: str, path: str) -> tuple[int, dict, bytes]:
        self.requests += 1
        return 404, {}, json.dumps({"error": self.message}).encode()


@pytest.mark.parametrize(
    "message, restarted",
    [
        ("no mount 'm1' (the daemon restarted?)", True),
        ("no mount 'other' (the daemon restarted?)", False),
        ("no such key: 'f2.bin/no mount here'", False),
    ],
)
def test_only_the_daemons_404_for_this_mount_has_it_register_again(
    env: str, message: str, restarted: bool
) -> None:
    """A 404 naming this mount is a daemon that lost it (a restart): register again and
    ask once more. Any other 404, even one whose text says "no mount" (an object key, a
    store's message), is that read's error."""
    daemon = NotFoundDaemon(message)
    calls: list[int] = []

    async def reregister() -> None:
        calls.append(1)

    r = _reader(env, daemon, reregister=reregister)
    r.registered("m1", track_hits=False)

    async def main() -> None:
        r.begin_read()
        with pytest.raises(MissError):
            await r.chunk(OpenFile(_obj(2)), 0)  # not cached

    trio.run(main)
    r.close()
    assert (len(calls), daemon.requests) == ((1, 2) if restarted else (0, 1))


def test_a_chunk_admitted_after_the_snapshot_began_is_a_hit(
    env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reader_mod, "SNAPSHOT_REUSE_SECONDS", 3600.0)  # never by age
    daemon = FakeDaemon()
    r = _reader(env, daemon)

    async def main() -> None:
        r.begin_read()
        _, hit, source = await r.chunk(OpenFile(_obj(0)), 0)
        assert (hit, source) == (True, "cache")
        snapshot = r._txn
        r.begin_read()
        assert r._txn is snapshot  # reused, not one txn per read

        admit(env, [1])  # the daemon admits a chunk while this snapshot is open
        r.begin_read()
        data, hit, source = await r.chunk(OpenFile(_obj(1)), 0)
        assert (hit, source) == (True, "cache")
        assert bytes(data) == _body(1)
        assert daemon.requests == []

    trio.run(main)
    r.close()


def test_the_read_after_a_miss_begins_a_fresh_snapshot(
    env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reader_mod, "SNAPSHOT_REUSE_SECONDS", 3600.0)
    daemon = FakeDaemon()
    r = _reader(env, daemon)

    async def main() -> None:
        r.begin_read()
        data, hit, source = await r.chunk(OpenFile(_obj(2)), 0)  # not cached anywhere
        assert (hit, source, bytes(data)) == (False, "store", _body(2))
        assert len(daemon.requests) == 1
        snapshot = r._txn
        r.begin_read()
        assert r._txn is not snapshot
        r.begin_read()
        data, _, source = await r.chunk(OpenFile(_obj(2)), 0)  # the buffer, not the daemon
        assert (source, len(daemon.requests)) == ("buffer", 1)

    trio.run(main)
    r.close()


def test_the_buffer_is_sized_by_read_ahead_and_stays_within_it(env: str) -> None:
    # Per sequential reader: its chunk, the next, and 1.5 windows of read-ahead.
    assert buffer_bytes_for(4 << 20, 16 << 20) == (4 << 20) * 8 * reader_mod.BUFFER_STREAMS
    r = ChunkReader(
        CacheStore(env, 64 << 20),
        FakeDaemon(),  # type: ignore[arg-type]
        dataset_id=1,
        chunk_size=CHUNK,
        buffer_bytes=None,
        readahead_bytes=3 * CHUNK,
        reregister=_never,
    )
    assert r.buffer.max_bytes == CHUNK * 7 * reader_mod.BUFFER_STREAMS
    for i in range(100):
        o = ObjectInfo(f"big{i}", CHUNK, 1.0, "v", f"c{i}")
        r.buffer.put(ChunkRef.of(o, CHUNK, 0).key, bytes(CHUNK), False)
        assert r.buffer.bytes <= r.buffer.max_bytes
    assert r.buffer.bytes == r.buffer.max_bytes  # full, never over
    r.close()


def test_keys_are_hashed_once_per_handle_and_chunk() -> None:
    f = OpenFile(ObjectInfo("k", 3 * CHUNK, 1.0, "v", "c"))
    a = f.chunk_ref(CHUNK, 1)
    assert f.chunk_ref(CHUNK, 1) is a
    b = f.chunk_ref(CHUNK, 2)
    assert b.index == 2 and b.key != a.key
    assert f.chunk_ref(CHUNK, 2) is b
    assert f.chunk_ref(2 * CHUNK, 1).key == ChunkRef.of(f.obj, 2 * CHUNK, 1).key


BIG = 1 << 20  # chunk size of the fault-in tests: a value far longer than fault-around


def _big_obj(i: int) -> ObjectInfo:
    return ObjectInfo(f"big{i}.bin", BIG - 4096 * i, 1.0, f"v{i}", f"bc{i}")


def _big_body(i: int) -> bytes:
    return bytes(range(256)) * ((BIG - 4096 * i) // 256)


def _admit_big(env: str, items: list[int], damage: bool = False) -> None:
    """Admit big objects `items`; `damage`: with one data byte changed after encoding."""
    code = textwrap.dedent(
        f"""
        from silofs.cache.format import ChunkRef, encode_chunk
        from silofs.node.store_write import PendingChunk, WritableStore
        from tests.unit.test_warm_path import _big_body, _big_obj, BIG
        s = WritableStore({env!r}, 64 << 20)
        pending = []
        for i in {items!r}:
            o = _big_obj(i)
            ref = ChunkRef.of(o, BIG, 0)
            value = encode_chunk(1, 0, BIG, o.key, o.content_id, _big_body(i))
            if {damage!r}:
                value = value[:-1000] + bytes([value[-1000] ^ 1]) + value[-999:]
            pending.append(PendingChunk(1, ref.key, value, ref.length))
        s.admit(pending, {{}}, lambda _d, _u: 1 << 40)
        s.close()
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


def _big_reader(env: str, daemon: FakeDaemon) -> ChunkReader:
    return ChunkReader(
        CacheStore(env, 64 << 20),
        daemon,  # type: ignore[arg-type]
        dataset_id=1,
        chunk_size=BIG,
        buffer_bytes=4 * BIG,
        readahead_bytes=0,
        reregister=_never,
    )


@pytest.fixture
def no_read_around(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mounts open the env with readahead: a fault on a B-tree page then reads (and maps)
    megabytes around it, values included, in a small test env. Without it a lookup
    touches only the pages it reads."""
    real = lmdb.open

    def without(path: str, **kwargs: object) -> lmdb.Environment:
        return real(path, **{**kwargs, "readahead": False})

    monkeypatch.setattr(lmdb, "open", without)


def _probe(r: ChunkReader, probe: str) -> None:
    """Have `r` tell a value in memory as a mount does where the file takes RWF_NOWAIT
    ("file"), or by mincore where it does not."""
    if not r.pages.enabled or (probe == "file" and not r.pages.nowait):
        pytest.skip("no RWF_NOWAIT read of data.mdb here")
    if probe == "mincore":
        if not r.pages.truthful:
            pytest.skip("mincore does not report this env's page cache here")
        r.pages.nowait = False


def _a_worker_read_it(attempt: Callable[[], bool], tries: int = 10) -> None:
    """Run `attempt` (a cold read of an evicted value, checking what it serves) until the
    value was read by a worker thread, as it is unless the disk is faster than the
    kernel's check. A refused RWF_NOWAIT read starts the read-ahead of the pages it
    lacks, and the kernel looks at them again after submitting it: where that I/O
    completes within the call (a disk answered from the host's memory, say) the read
    succeeds, the pages having come in without anyone waiting. That is right to serve
    but not the case under test, so it is tried again; a hit path that never leaves a
    value to a worker fails every try."""
    for _ in range(tries):
        if attempt():
            return
    raise AssertionError(f"no cold read in {tries} went to a worker thread")


@pytest.mark.parametrize("probe", ["mincore", "file"])
def test_a_hit_whose_pages_are_not_in_memory_is_read_by_a_worker(
    tmp_path: Path, no_read_around: None, probe: str
) -> None:
    env = str(tmp_path / "env")
    os.makedirs(env)
    WritableStore(env, 64 << 20).close()
    _admit_big(env, [0, 1, 2])

    def attempt() -> bool:
        drop_unmapped_pages(env)
        daemon = FakeDaemon()
        r = _big_reader(env, daemon)
        _probe(r, probe)
        f = OpenFile(_big_obj(1))
        r.begin_read()
        view = r.hit(f, 0, 0, 4096)
        try:
            if view is not None:  # the kernel's read-ahead landed within the read
                assert bytes(view) == _big_body(1)[:4096] and r.read_in == 0
                return False
            trio.run(_then_served_from_memory, r, f, daemon, env)
            return True
        finally:
            r.close()

    _a_worker_read_it(attempt)


async def _then_served_from_memory(
    r: ChunkReader, f: OpenFile, daemon: FakeDaemon, env: str
) -> None:
    """`r`'s hit() left chunk 0 of `f` to a worker: chunk() reads it there, and once it
    is in memory serves it on this thread."""
    data, hit, source = await r.chunk(f, 0)
    assert (hit, source) == (True, "cache")
    assert r.read_in == 1
    assert r._txn is None  # the snapshot was the worker's, and ended with its read
    assert bytes(data) == _big_body(1)
    n = len(_big_body(1))
    for attempt in range(10):
        if attempt:  # its pages went meanwhile (_in_memory_again): back in memory first
            _in_memory_again(env)
        before = r.read_in
        r.begin_read()
        data, hit, _ = await r.chunk(f, 0)  # now in memory: served on this thread
        assert hit and bytes(data[:256]) == bytes(range(256))
        view = r.hit(f, 0, 5, n - 7)
        if r.read_in == before and view is not None:
            break
    else:
        raise AssertionError("a value in memory was never served on the serving thread")
    assert view is not None and bytes(view) == _big_body(1)[5:-7]
    assert daemon.requests == []


def _in_memory_again(env: str) -> None:
    """Every page of data.mdb in the page cache again. A test that read a value into
    memory and then asks for it on the serving thread may find its pages gone meanwhile:
    another process's drop_caches (the benches on a shared host drop them, bench/
    common.py) or memory reclaim. It reads them in again and asks once more: a hit path
    that never serves a value in memory on its thread fails every try."""
    with open(os.path.join(env, "data.mdb"), "rb") as fh:
        while fh.read(1 << 20):
            pass


def _admit_chunks(env: str, obj: ObjectInfo, indexes: list[int]) -> None:
    code = textwrap.dedent(
        f"""
        from silofs.cache.format import ChunkRef, encode_chunk
        from silofs.node.store_write import PendingChunk, WritableStore
        from silofs.records import ObjectInfo
        from tests.unit.test_warm_path import BIG
        s = WritableStore({env!r}, 64 << 20)
        o = ObjectInfo(*{(obj.key, obj.size, obj.mtime, obj.version, obj.content_id)!r})
        pending = []
        for i in {indexes!r}:
            ref = ChunkRef.of(o, BIG, i)
            body = bytes([i]) * ref.length
            value = encode_chunk(1, i, BIG, o.key, o.content_id, body)
            pending.append(PendingChunk(1, ref.key, value, ref.length))
        s.admit(pending, {{}}, lambda _d, _u: 1 << 40)
        s.close()
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


class BigDaemon:
    def __init__(self) -> None:
        self.requests: list[str] = []

    async def request(self, method: str, path: str) -> tuple[int, dict, bytes]:
        self.requests.append(path)
        i = int(path.split("key=big", 1)[1].split(".bin", 1)[0])
        return 200, {"x-silofs-source": "store"}, _big_body(i)


def _not_a_hit_once_evicted(r: ChunkReader, f: OpenFile, fd: int, lo: int, hi: int) -> None:
    """Evict data.mdb's pages (all but what this process mapped: the lookup's; a page
    cache folio may span more than one page, and is evicted whole or not at all) and
    ask for [lo, hi): not a hit. A refused RWF_NOWAIT read may start the kernel's
    read-ahead of those pages, and pages under I/O are not evicted, so a hit right after
    an earlier refusal may find them back: evict again until the pages stay out. A hit
    path that served a value whose pages are not in memory never returns None."""
    deadline = time.monotonic() + 10
    while True:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if r.hit(f, 0, lo, hi) is None:
            return
        assert time.monotonic() < deadline, f"[{lo}, {hi}) stayed a hit after its eviction"


@pytest.mark.parametrize("probe", ["mincore", "file"])
def test_a_value_whose_last_page_left_the_page_cache_is_not_a_hit_here(
    tmp_path: Path, no_read_around: None, probe: str
) -> None:
    """The serving thread copies a value only if every page of it is in memory, not
    just the first (which its lookup touched, so it stays mapped): with the value's
    other pages evicted hit() leaves it to a worker, and once they are back it serves."""
    env = str(tmp_path / "env")
    os.makedirs(env)
    WritableStore(env, 64 << 20).close()
    _admit_big(env, [228])  # 112 KiB
    r = _big_reader(env, FakeDaemon())
    _probe(r, probe)
    data = os.path.join(env, "data.mdb")

    f = OpenFile(_big_obj(228))
    want = _big_body(228)

    def hit_in_memory() -> memoryview:
        """A hit of the whole value once every page of the env is in the page cache
        (_in_memory_again: tried again if pages went meanwhile)."""
        for _ in range(10):
            _in_memory_again(env)
            r.begin_read()
            view = r.hit(f, 0, 0, len(want))
            if view is not None:
                return view
        raise AssertionError("a value all in memory was never a hit")

    view = hit_in_memory()
    assert bytes(view) == want
    fd = os.open(data, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages are not evicted
        for lo in (0, len(want) - 10):
            _not_a_hit_once_evicted(r, f, fd, lo, len(want))
    finally:
        os.close(fd)
    assert bytes(hit_in_memory()) == want
    r.close()


@pytest.mark.parametrize("probe", ["mincore", "file"])
def test_a_hit_read_by_a_worker_is_verified_before_it_is_served(
    tmp_path: Path, no_read_around: None, probe: str
) -> None:
    env = str(tmp_path / "env")
    os.makedirs(env)
    WritableStore(env, 64 << 20).close()
    _admit_big(env, [0, 1], damage=True)

    def attempt() -> bool:
        drop_unmapped_pages(env)
        daemon = BigDaemon()
        r = _big_reader(env, daemon)  # type: ignore[arg-type]
        _probe(r, probe)

        async def main() -> None:
            r.begin_read()
            data, hit, source = await r.chunk(OpenFile(_big_obj(1)), 0)
            # Read by a worker or (the read-ahead having landed) from memory, the
            # damaged value is counted and refetched, never served.
            assert r.counters.corrupt_chunks == 1
            assert (hit, source, len(daemon.requests)) == (False, "store", 1)
            assert "refetch=1" in daemon.requests[0]
            assert bytes(data) == _big_body(1)

        try:
            trio.run(main)
            return r.read_in == 1
        finally:
            r.close()

    _a_worker_read_it(attempt)


def test_a_sequential_reader_has_the_kernel_read_the_cached_chunks_ahead(
    tmp_path: Path, no_read_around: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where values are not read ahead direct (chunks under DIRECT_MIN_CHUNK, or a
    data.mdb that refuses O_DIRECT: tests/unit/test_reader_direct.py), the kernel reads
    them into the page cache ahead of a sequential reader."""
    monkeypatch.setattr(reader_mod, "DIRECT_MIN_CHUNK", 2 * BIG)
    env = str(tmp_path / "env")
    os.makedirs(env)
    WritableStore(env, 64 << 20).close()
    obj = ObjectInfo("seq.bin", 3 * BIG, 1.0, "v", "seq")
    _admit_chunks(env, obj, [0, 1, 2])
    drop_unmapped_pages(env)
    r = ChunkReader(
        CacheStore(env, 64 << 20),
        FakeDaemon(),  # type: ignore[arg-type]
        dataset_id=1,
        chunk_size=BIG,
        buffer_bytes=8 * BIG,
        readahead_bytes=2 * BIG,
        reregister=_never,
    )
    if not r.pages.enabled or not r.pages.truthful:
        pytest.skip("mincore does not report this env's page cache here")
    r.pages.nowait = False  # mincore: a RWF_NOWAIT read's read-ahead may land in time

    def resident(index: int) -> bool:
        r.begin_read()
        where = r._find(ChunkRef.of(obj, BIG, index))
        assert where is not None
        return r.pages.resident(where[0], 0, where[1])

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            r.start(nursery)
            assert not resident(1) and not resident(2)
            f = OpenFile(obj)
            r.begin_read()
            f.advance(0, BIG // 2 + 4096)
            data, hit, _ = await r.chunk(f, 0, 0, BIG // 2 + 4096)
            assert hit and bytes(data[:4]) == bytes(4)
            r.prefetch(f, 0)  # over half a chunk read in sequence: the next is asked for
            deadline = trio.current_time() + 20
            while not resident(1):
                assert trio.current_time() < deadline, "chunk 1 never read ahead"
                await trio.sleep(0.01)
            assert r.read_in == 1  # chunk 0 only: chunk 1 came in by read-ahead
            nursery.cancel_scope.cancel()

    trio.run(main)
    r.close()


def test_a_map_the_daemon_grew_is_adopted_and_hits_go_on(env: str) -> None:
    assert os.stat(os.path.join(env, "data.mdb")).st_blocks * 512 < 1 << 20  # sparse past that
    daemon = FakeDaemon()
    r = ChunkReader(
        CacheStore(env, 1 << 20),  # the map the daemon had when it began
        daemon,  # type: ignore[arg-type]
        dataset_id=1,
        chunk_size=CHUNK,
        buffer_bytes=1 << 20,
        readahead_bytes=0,
        reregister=_never,
    )

    async def main() -> None:
        r.begin_read()
        _, hit, _ = await r.chunk(OpenFile(_obj(0)), 0)
        assert hit
        admit(env, list(range(100, 1100)))  # ~2 MiB of values: more than the 1 MiB map
        r.renew()  # MapResizedError: remapped through CacheStore.adopt_map_size
        assert r.store.env.info()["map_size"] == 64 << 20
        r.begin_read()
        data, hit, source = await r.chunk(OpenFile(_obj(1099)), 0)
        assert (hit, source, bytes(data)) == (True, "cache", _body(1099))
        assert daemon.requests == []

    trio.run(main)
    r.close()


def _mixed_body(n: int) -> bytes:
    """Bytes that differ at every offset a copy could be off by (not a repeated block)."""
    return random.Random(n).randbytes(n)


@pytest.mark.parametrize("key", ["k", "an/other/dataset/listed/it/under/a/much/longer/key.bin"])
def test_a_chunk_admitted_under_another_key_is_served_exactly(tmp_path: Path, key: str) -> None:
    """A value's header holds the key of the dataset that admitted it, so its length is
    not always what this mount expects: every range, from the chunk's start or not, is
    still exactly the bytes asked for, on the serving thread and through chunk()."""
    env = str(tmp_path / "env")
    os.makedirs(env)
    WritableStore(env, 64 << 20).close()
    obj = ObjectInfo("mine.bin", BIG + BIG // 2 + 17, 1.0, "v", "shared")
    body = _mixed_body(obj.size)
    code = textwrap.dedent(
        f"""
        from silofs.cache.format import ChunkRef, encode_chunk
        from silofs.node.store_write import PendingChunk, WritableStore
        from silofs.records import ObjectInfo
        from tests.unit.test_warm_path import BIG, _mixed_body
        s = WritableStore({env!r}, 64 << 20)
        o = ObjectInfo(*{(obj.key, obj.size, obj.mtime, obj.version, obj.content_id)!r})
        body = _mixed_body(o.size)
        pending = []
        for i in (0, 1):
            ref = ChunkRef.of(o, BIG, i)
            data = body[i * BIG : i * BIG + ref.length]
            value = encode_chunk(1, i, BIG, {key!r}, o.content_id, data)
            pending.append(PendingChunk(1, ref.key, value, ref.length))
        s.admit(pending, {{}}, lambda _d, _u: 1 << 40)
        s.close()
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)
    daemon = FakeDaemon()
    r = _big_reader(env, daemon)
    f = OpenFile(obj)
    ranges = [(0, 0, 1), (0, 1, BIG), (0, 70_000, 200_000), (0, BIG - 5, BIG), (1, 0, 4096)]
    ranges.append((1, 65_536, obj.size - BIG))

    async def main() -> None:
        for index, lo, hi in ranges:
            want = body[index * BIG + lo : index * BIG + hi]
            r.begin_read()
            view = r.hit(f, index, lo, hi)
            if r.pages.enabled:
                assert view is not None
            if view is not None:
                assert bytes(view) == want, (index, lo, hi)
            data, hit, _ = await r.chunk(f, index, lo, hi)
            assert hit and bytes(data) == want, (index, lo, hi)
        assert daemon.requests == [] and r.counters.corrupt_chunks == 0

    trio.run(main)
    r.close()


def test_a_value_that_cannot_be_read_is_refetched_and_the_reader_goes_on(env: str) -> None:
    """A read of data.mdb that fails (an I/O error: here a descriptor every read of
    which fails) is a damaged value: counted, refetched, never an exception out of a
    read, on the serving thread or from a worker."""
    daemon = FakeDaemon()
    r = _reader(env, daemon)
    if not r.pages.enabled:
        pytest.skip("values are not copied out of data.mdb here")

    async def main() -> None:
        r.begin_read()
        f = OpenFile(_obj(0))
        view = r.hit(f, 0, 0, 1000)  # learns where data.mdb is mapped
        assert view is not None and bytes(view) == _body(0)
        os.close(r.pages._fd)
        r.pages._fd = os.open(env, os.O_RDONLY)  # a directory: each read fails, EISDIR
        assert r.hit(f, 0, 0, 1000) is None
        data, hit, source = await r.chunk(f, 0)
        assert (hit, source, bytes(data)) == (False, "store", _body(0))
        assert r.counters.corrupt_chunks == 1 and "refetch=1" in daemon.requests[0]

    trio.run(main)
    r.close()


def test_a_long_hit_whose_pages_cannot_be_mapped_is_refetched_not_read_from_the_map(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A range over PROBE_BYTES is copied out of LMDB's map, where a page the disk
    cannot read would raise SIGBUS in the copy and kill the mount. Its pages are mapped
    first; one that cannot be (what MADV_POPULATE_READ reports for such a page) makes
    the value damaged: counted, refetched, and the reader goes on."""
    env = str(tmp_path / "env")
    os.makedirs(env)
    WritableStore(env, 64 << 20).close()
    _admit_big(env, [1])
    daemon = BigDaemon()
    r = _big_reader(env, daemon)  # type: ignore[arg-type]
    _probe(r, "file")
    want = _big_body(1)
    n = len(want)
    assert n > reader_mod.PROBE_BYTES
    with open(os.path.join(env, "data.mdb"), "rb") as fh:
        while fh.read(1 << 20):  # every page in the page cache: a hit on this thread
            pass
    asked: list[tuple[int, int]] = []
    real = r.pages.mapped

    def mapped(addr: int, lo: int, hi: int) -> bool:
        asked.append((lo, hi))
        return real(addr, lo, hi)

    monkeypatch.setattr(r.pages, "mapped", mapped)

    async def main() -> None:
        r.begin_read()
        f = OpenFile(_big_obj(1))
        view = r.hit(f, 0, 4096, n - 3)
        assert view is not None and bytes(view) == want[4096:-3]
        (_, hdr), data_range = asked  # the header's pages, then the blocks' (from 0 here)
        assert data_range == (hdr, hdr + n)
        monkeypatch.setattr(r.pages, "mapped", lambda addr, lo, hi: False)  # unreadable
        assert r.hit(f, 0, 4096, n - 3) is None
        os.close(r.pages._fd)
        r.pages._fd = os.open(env, os.O_RDONLY)  # and every read of the file fails
        data, hit, source = await r.chunk(f, 0)
        assert (hit, source, bytes(data)) == (False, "store", want)
        assert r.counters.corrupt_chunks == 1 and "refetch=1" in daemon.requests[0]

    trio.run(main)
    r.close()


def test_mapped_reports_a_page_a_read_of_the_map_would_die_on(tmp_path: Path) -> None:
    """ValuePages.mapped on a mapping whose file was cut short under it: False for a
    range past the file's end (a read there raises SIGBUS), True for the pages the file
    still has."""
    page = mmap.PAGESIZE
    path = tmp_path / "data.mdb"
    path.write_bytes(b"x" * (4 * page))
    pages = ValuePages(str(path))
    if not pages.enabled:
        pytest.skip("values are not copied out of data.mdb here")
    with open(path, "r+b") as fh:
        m = mmap.mmap(fh.fileno(), 4 * page)
        fh.truncate(page)
    first = ctypes.c_char.from_buffer(m)
    addr = ctypes.addressof(first)
    try:
        if not pages.mapped(addr, 0, 10) or pages._no_populate:
            pytest.skip("no MADV_POPULATE_READ here (Linux 5.14+)")
        assert pages.mapped(addr, 0, page)
        assert not pages.mapped(addr, 0, 2 * page)
        assert not pages.mapped(addr, 3 * page, 3 * page + 1)
    finally:
        del first
        m.close()
        pages.close()
