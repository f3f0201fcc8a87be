"""Cached values read ahead by O_DIRECT for a sequential reader, without FUSE.

Owns: a sequential reader's next values are read direct into the mount's own buffers and
served from them, every byte exact, with none of their pages filled into the page cache;
a value damaged on disk is counted once and refetched; a value the direct read cannot
read is read the other way (and counted and refetched if that fails too); a file that
refuses O_DIRECT reads (EINVAL) makes the reader read as it did without; a value whose
pages LMDB's writer has just written (dirty in the page cache) reads as written; the
buffers stay within their bound; several values are read at once, and a value's read,
direct or a worker's read of a hit, keeps its snapshot until it is done: a remap waits
for it, and the daemon's evictions cannot reuse its pages under it. A real LMDB env;
the writer runs in another process, as the daemon does.
"""

from __future__ import annotations

import mmap
import os
import random
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest
import trio
import trio.testing

from silofs.cache.format import ChunkRef
from silofs.cache.store import CacheStore
from silofs.mount import reader as reader_mod
from silofs.mount.ahead import ValuesAhead
from silofs.mount.pages import DirectFile
from silofs.mount.reader import ChunkReader, OpenFile
from silofs.node.store_write import WritableStore
from silofs.records import ObjectInfo
from tests.support.pagecache import drop_unmapped_pages

CHUNK = 1 << 20  # reader.DIRECT_MIN_CHUNK: the smallest chunk read ahead direct
ROOT = Path(__file__).resolve().parents[2]
OBJ = ObjectInfo("big.bin", 6 * CHUNK - 12345, 1.0, "v1", "cid-big")
ALL = (0, 1, 2, 3, 4, 5)


def body() -> bytes:
    return random.Random(7).randbytes(OBJ.size)


def admit(
    env: str, damaged: tuple[int, ...] = (), sync: bool = True, chunks: tuple[int, ...] = ALL
) -> None:
    """Admit `chunks` of OBJ from another process, as the daemon does; a chunk in
    `damaged` with one data byte changed after it was encoded. `sync`: written back to
    the disk, so its pages can be evicted."""
    code = textwrap.dedent(
        f"""
        from silofs.cache.format import ChunkRef, encode_chunk
        from silofs.node.store_write import PendingChunk, WritableStore
        from tests.unit.test_reader_direct import CHUNK, OBJ, body
        s = WritableStore({env!r}, 64 << 20)
        data = body()
        pending = []
        for i in {chunks!r}:
            ref = ChunkRef.of(OBJ, CHUNK, i)
            part = data[i * CHUNK : i * CHUNK + ref.length]
            value = bytearray(encode_chunk(1, i, CHUNK, OBJ.key, OBJ.content_id, part))
            if i in {damaged!r}:
                value[-100] ^= 1
            pending.append(PendingChunk(1, ref.key, bytes(value), ref.length))
        s.admit(pending, {{}}, lambda _d, _u: 1 << 40)
        if {sync!r}:
            s.sync()
        s.close()
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


def churn(env: str, tag: str) -> None:
    """From another process, as the daemon does: evict every chunk of dataset 1, then
    admit as many values of dataset 2 (keys and bytes of `tag`'s own), each in a txn of
    its own. LMDB's writer puts them in the pages freed by an earlier eviction once no
    snapshot older than that eviction is open, else at the end of the file."""
    code = textwrap.dedent(
        f"""
        import hashlib, random
        from silofs.node.store_write import PendingChunk, WritableStore
        from tests.unit.test_reader_direct import CHUNK, OBJ
        s = WritableStore({env!r}, 64 << 20)
        usage = s.load_usage()
        s.evict_random(1, 0, usage)
        rng = random.Random({tag!r})
        for i in range(6):
            key = hashlib.sha256(f"{tag}-{{i}}".encode()).digest()[:16]
            value = rng.randbytes(CHUNK + 4096)
            s.admit([PendingChunk(2, key, value, CHUNK)], usage, lambda _d, _u: 1 << 40)
        s.sync()
        s.close()
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


def evict(env: str) -> None:
    """Drop data.mdb's pages no process maps from the page cache (as drop_caches does
    to a cache whose pages a fresh mount has not touched yet)."""
    fd = os.open(os.path.join(env, "data.mdb"), os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class Daemon:
    """Answers a chunk request with OBJ's bytes of that chunk, and records it."""

    def __init__(self) -> None:
        self.requests: list[str] = []

    async def request(self, method: str, path: str) -> tuple[int, dict, bytes]:
        self.requests.append(path)
        index = int(path.split("&index=", 1)[1].split("&", 1)[0])
        return 200, {"x-silofs-source": "store"}, body()[index * CHUNK : (index + 1) * CHUNK]


async def _never() -> None:
    raise AssertionError("no re-registration here")


@pytest.fixture
def env(tmp_path: Path) -> Iterator[str]:
    path = str(tmp_path / "env")
    os.makedirs(path)
    WritableStore(path, 64 << 20).close()
    yield path


@pytest.fixture
def no_read_around(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mounts open the env with readahead: the serving thread's lookup of the first
    chunk then reads (and maps) megabytes around the value's first page, which in a test
    env of a few MiB is every value. Without it a lookup touches only the pages it reads.
    (The worker that reads values direct turns the read-around off for its own lookups:
    test_the_direct_reads_lookups_read_nothing_around.)"""
    real = lmdb.open

    def without(path: str, **kwargs: object) -> lmdb.Environment:
        return real(path, **{**kwargs, "readahead": False})

    monkeypatch.setattr(lmdb, "open", without)


def reader(env: str, daemon: Daemon) -> ChunkReader:
    """A mount's reader of `env` whose values are read direct, where data.mdb allows.
    Its own reads of a value (the first chunk's, before read-ahead starts) read no
    other value into the page cache: in a test env of a few MiB the disk's read-ahead
    would bring in all of it."""
    r = ChunkReader(
        CacheStore(env, 64 << 20),
        daemon,  # type: ignore[arg-type]
        dataset_id=1,
        chunk_size=CHUNK,
        buffer_bytes=None,
        readahead_bytes=2 * CHUNK,
        reregister=_never,
    )
    if r.direct is None or not r.pages.truthful:
        r.close()
        pytest.skip("no O_DIRECT reads of data.mdb, or mincore does not tell, here")
    os.posix_fadvise(r.pages._fd, 0, 0, os.POSIX_FADV_RANDOM)
    return r


async def read_all(r: ChunkReader, size: int = 256 << 10) -> bytes:
    """OBJ read from start to end in `size` requests, as fs.py reads one chunk's range:
    a hit on the serving thread if it can, else through chunk(); read-ahead after each."""
    f = OpenFile(OBJ)
    out = bytearray()
    for off in range(0, OBJ.size, size):
        end = min(off + size, OBJ.size, (off // CHUNK + 1) * CHUNK)
        index, lo, hi = off // CHUNK, off % CHUNK, end - off // CHUNK * CHUNK
        r.begin_read()
        sequential = f.advance(off, end)
        view = r.hit(f, index, lo, hi)
        if view is None:  # used before the next await, as fs.py replies with it
            view, _, _ = await r.chunk(f, index, lo, hi, kept=False)
        out += view
        if sequential:
            r.prefetch(f, index)
    return bytes(out)


def lookup(r: ChunkReader, index: int, alone: bool = True) -> tuple[int, int]:
    """(address, size) of chunk `index`'s value, found as the direct reads' worker finds
    it (`alone`: its fault reads nothing around), or as any other lookup."""
    key = ChunkRef.of(OBJ, CHUNK, index).key
    with r.store.read_txn() as txn:
        cur = r.store.value_cursor(txn, r._chunks_db)
        assert cur is not None
        where = r._find_alone(cur, key) if alone else cur.find(key)
    assert where is not None
    return where


def data_cached(r: ChunkReader, where: tuple[int, int]) -> bool:
    """Whether any page of a value's data past its first two pages (which its lookup
    touched) is in the page cache: mincore, which reads nothing."""
    addr, size = where
    first = (addr + 8192) // mmap.PAGESIZE * mmap.PAGESIZE
    return any(r.pages.resident(a, 0, 1) for a in range(first, addr + size, mmap.PAGESIZE))


def resident(r: ChunkReader, index: int) -> bool:
    return data_cached(r, lookup(r, index))


def run(r: ChunkReader, main) -> None:  # type: ignore[no-untyped-def]
    async def top() -> None:
        async with trio.open_nursery() as nursery:
            r.start(nursery)
            await main()
            nursery.cancel_scope.cancel()

    try:
        trio.run(top)
    finally:
        r.close()


def test_a_sequential_reader_is_served_from_values_read_direct(
    env: str, no_read_around: None
) -> None:
    admit(env)
    evict(env)
    daemon = Daemon()
    r = reader(env, daemon)

    async def main() -> None:
        assert await read_all(r) == body()
        ahead = r.ahead
        assert ahead is not None
        # Read-ahead starts once over half a chunk was read in sequence: chunk 0 is the
        # reader's own read; every later one was read direct and served from its buffer.
        assert ahead.read == 5 and ahead.served == 5 * 4
        assert not any(resident(r, i) for i in range(2, 6)), "a value read direct was cached"
        assert r.counters.corrupt_chunks == 0 and daemon.requests == []
        assert ahead.allocated <= ahead.max_buffers

    run(r, main)


def test_chunks_not_cached_are_not_read_ahead_direct(env: str, no_read_around: None) -> None:
    """A chunk our dataset does not hold is a miss: read-ahead asks the daemon for it,
    and no worker looks it up to read it direct."""
    admit(env, chunks=(0, 1, 2))
    evict(env)
    daemon = Daemon()
    r = reader(env, daemon)

    async def main() -> None:
        assert await read_all(r) == body()
        assert r.ahead is not None and r.ahead.read == 2  # chunks 1 and 2
        assert not r.ahead.flights
        asked = {p.split("&index=")[1].split("&")[0] for p in daemon.requests}
        assert asked == {"3", "4", "5"}

    run(r, main)


def test_bytes_kept_across_an_await_are_a_copy_of_the_buffer(
    env: str, no_read_around: None
) -> None:
    """chunk() with the bytes kept (a request across chunks keeps each part while it
    awaits the next) gives bytes of their own: the value's buffer, free once served to
    its end, may be read into again before the reply."""
    admit(env)
    evict(env)
    r = reader(env, Daemon())

    async def main() -> None:
        f = OpenFile(OBJ)
        f.advance(0, CHUNK)
        r.begin_read()
        await r.chunk(f, 0)
        r.prefetch(f, 0)
        assert r.ahead is not None and r.ahead.reading(ChunkRef.of(OBJ, CHUNK, 1).key)
        r.begin_read()
        data, hit, _ = await r.chunk(f, 1)  # waits for the read, then served to its end
        buf = r.ahead.buffer()
        assert buf is not None
        buf[:] = bytes(len(buf))  # the freed buffer, read into again
        assert hit and bytes(data) == body()[CHUNK : 2 * CHUNK]

    run(r, main)


def test_a_value_damaged_on_disk_is_counted_once_and_refetched(
    env: str, no_read_around: None
) -> None:
    admit(env, damaged=(3,))
    evict(env)
    daemon = Daemon()
    r = reader(env, daemon)

    async def main() -> None:
        assert await read_all(r) == body()
        assert r.counters.corrupt_chunks == 1
        assert len(daemon.requests) == 1 and "&index=3&" in daemon.requests[0]
        assert "refetch=1" in daemon.requests[0]

    run(r, main)


def test_a_value_the_direct_read_cannot_read_is_read_the_other_way(
    env: str, no_read_around: None
) -> None:
    """A direct read that fails (an I/O error: here a descriptor every read of which
    fails) leaves the value to the reader's own read, which serves it from the cache;
    never an exception out of a read."""
    admit(env)
    evict(env)
    daemon = Daemon()
    r = reader(env, daemon)
    assert r.direct is not None
    os.close(r.direct.fd)
    r.direct.fd = os.open(env, os.O_RDONLY)  # a directory: each read fails, EISDIR

    async def main() -> None:
        assert await read_all(r) == body()
        assert r.ahead is not None and r.ahead.read == 0
        assert r.counters.corrupt_chunks == 0 and daemon.requests == []

    run(r, main)


def test_a_value_no_read_can_read_is_counted_and_refetched(env: str, no_read_around: None) -> None:
    """A value neither the direct read nor the reader's own can read (a bad sector: here
    descriptors every read of which fails) is damaged: counted and refetched, and the
    reader gets every byte, never an exception, never SIGBUS."""
    admit(env)
    evict(env)
    daemon = Daemon()
    r = reader(env, daemon)
    assert r.direct is not None

    async def main() -> None:
        assert await read_all(r) == body()  # learns where data.mdb is mapped
        assert r.direct is not None
        os.close(r.direct.fd)
        os.close(r.pages._fd)
        r.direct.fd = os.open(env, os.O_RDONLY)  # a directory: each read fails, EISDIR
        r.pages._fd = os.open(env, os.O_RDONLY)
        evict(env)
        assert await read_all(r) == body()
        # Every chunk, each time it is asked for: the fake daemon never replaces it.
        assert r.counters.corrupt_chunks >= 6 and len(daemon.requests) >= 6
        assert all("refetch=1" in p for p in daemon.requests)
        assert {p.split("&index=")[1].split("&")[0] for p in daemon.requests} == set("012345")

    run(r, main)


def test_a_file_that_refuses_o_direct_reads_is_read_as_without(
    env: str, no_read_around: None
) -> None:
    admit(env)
    evict(env)
    daemon = Daemon()
    r = reader(env, daemon)
    assert r.direct is not None
    r.direct.align = 1  # offsets the disk cannot read direct: EINVAL
    probe = mmap.mmap(-1, 2 * mmap.PAGESIZE)
    if r.direct.read(1, 10, probe) is not None:
        r.close()
        pytest.skip("this filesystem reads any offset direct")
    r.direct.enabled = True  # as it was before the first read said otherwise

    async def main() -> None:
        assert await read_all(r) == body()
        assert r.direct is not None and not r.direct.enabled
        assert r.ahead is not None and r.ahead.read == 0
        assert r.counters.corrupt_chunks == 0 and daemon.requests == []

    run(r, main)


def test_values_just_written_read_direct_as_written(
    env: str, no_read_around: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LMDB's writer writes through the page cache and (sync=False) leaves the pages
    dirty: a direct read of them at once has the kernel write them back first, so it
    reads what was committed, not what the disk held before."""
    admit(env, sync=False)  # the values' pages are dirty: the disk holds none of them
    daemon = Daemon()
    r = reader(env, daemon)
    monkeypatch.setattr(r.pages, "value_cached", lambda addr, size: False)

    async def main() -> None:
        assert await read_all(r) == body()
        assert r.ahead is not None and r.ahead.read == 5
        assert r.counters.corrupt_chunks == 0 and daemon.requests == []

    run(r, main)


def test_the_direct_reads_lookups_read_nothing_around(env: str) -> None:
    """The worker's lookup of a value it reads direct touches the value's first page;
    with the env's read-around on (as a mount opens it) that fault would read the pages
    around it into the page cache, the value's own among them. It does not: the
    lookup's fault reads that one page, and the direct read adds none. (The same lookup
    without the guard reads around, where the disk reads ahead at all: the test can
    tell.)"""
    admit(env)
    r = reader(env, Daemon())
    try:
        # A read txn reads LMDB's meta pages, and a cursor the B-tree's: pages every
        # lookup touches, so a mount keeps them. Touched once here, they stay mapped,
        # and the rest is evicted.
        lookup(r, 0)
        evict(env)
        assert r._env_reads_around and r.ahead is not None
        buf = r.ahead.buffer()
        assert buf is not None
        where = lookup(r, 3)
        assert not data_cached(r, where)
        view = r._read_direct(ChunkRef.of(OBJ, CHUNK, 3).key, buf)
        assert view is not None and bytes(view[-5:]) == body()[4 * CHUNK - 5 : 4 * CHUNK]
        assert not data_cached(r, where)
        if not data_cached(r, lookup(r, 1, alone=False)):
            pytest.skip("this disk reads nothing around a fault: no guard to check")
    finally:
        r.close()


def test_direct_file_reads_bytes_written_a_moment_ago(tmp_path: Path) -> None:
    path = tmp_path / "data.mdb"
    path.write_bytes(b"a" * (4 * mmap.PAGESIZE))
    direct = DirectFile(str(path))
    if not direct.enabled:
        pytest.skip("no O_DIRECT here")
    buf = mmap.mmap(-1, 4 * mmap.PAGESIZE)
    try:
        with open(path, "r+b") as f:
            os.fsync(f.fileno())
            f.seek(5000)
            f.write(b"new")  # dirty in the page cache only
            f.flush()
            view = direct.read(4990, 20, buf)
        assert view is not None and bytes(view) == b"a" * 10 + b"new" + b"a" * 7
        with pytest.raises(OSError):
            direct.read(4 * mmap.PAGESIZE - 10, 20, buf)  # runs past the end of the file
    finally:
        direct.close()


def test_the_buffers_stay_within_their_bound() -> None:
    ahead = ValuesAhead(mmap.PAGESIZE, 2)

    async def main() -> None:
        assert ahead.begin(b"a") and ahead.begin(b"b")
        assert ahead.reading(b"a") and not ahead.wanted(b"a")
        assert not ahead.begin(b"c")  # as many reads in flight as buffers
        a, b = ahead.buffer(), ahead.buffer()
        assert a is not None and b is not None and ahead.buffer() is None
        ahead.end(b"a", a, memoryview(a)[:10])
        ahead.end(b"b", b, None)  # nothing to keep: free again
        assert ahead.get(b"a") is not None and not ahead.reading(b"a")
        assert ahead.begin(b"c") and ahead.begin(b"d")
        c = ahead.buffer()
        assert c is b  # the free one first
        d = ahead.buffer()
        assert d is a and ahead.get(b"a") is None  # then the oldest value's
        assert ahead.allocated == 2
        ahead.end(b"c", c, None)
        ahead.end(b"d", d, memoryview(d)[:5])
        assert await ahead.wait(b"d") is not None
        ahead.drop(b"d")
        assert ahead.get(b"d") is None and ahead.wanted(b"d")

    trio.run(main)


def test_small_chunks_are_not_read_direct(env: str) -> None:
    r = ChunkReader(
        CacheStore(env, 64 << 20),
        Daemon(),  # type: ignore[arg-type]
        dataset_id=1,
        chunk_size=reader_mod.DIRECT_MIN_CHUNK // 2,
        buffer_bytes=None,
        readahead_bytes=2 * CHUNK,
        reregister=_never,
    )
    try:
        assert r.direct is None and r.ahead is None
    finally:
        r.close()


def test_direct_reads_are_in_flight_together(env: str, no_read_around: None) -> None:
    """A sequential reader's values read ahead direct are read by several workers at
    once (the remap lock is not held across a read), so the disk's queue is not left
    empty between one value's read and the next; every byte still exact. Each read
    waits (up to a deadline) until another is in flight too: one at a time, none
    would ever see another."""
    admit(env)
    evict(env)
    daemon = Daemon()
    r = reader(env, daemon)
    assert r.direct is not None
    real = r.direct.read
    state = threading.Condition()
    counts = {"now": 0, "most": 0}

    def read(base: int, size: int, buf: mmap.mmap) -> memoryview | None:
        with state:
            counts["now"] += 1
            counts["most"] = max(counts["most"], counts["now"])
            state.notify_all()
            state.wait_for(lambda: counts["most"] >= 2, timeout=10)
        try:
            return real(base, size, buf)
        finally:
            with state:
                counts["now"] -= 1

    r.direct.read = read  # type: ignore[method-assign]

    async def main() -> None:
        assert await read_all(r) == body()
        assert r.ahead is not None and r.ahead.read == 5
        assert counts["most"] >= 2, "one direct read at a time"
        assert r.counters.corrupt_chunks == 0 and daemon.requests == []

    run(r, main)


def test_a_value_in_a_direct_read_is_neither_remapped_nor_reused_under_it(
    env: str, no_read_around: None
) -> None:
    """While a value's O_DIRECT read is in flight, the lookups' lock is free (another
    worker looks its value up), and the daemon may evict the value and admit others,
    committing meanwhile: the read still reads the value's bytes, because its snapshot
    stays open until the read is done and keeps the writer off its pages. A remap
    (which ends every txn of the env, py-lmdb) waits for that read. Once the snapshot
    ends the writer does reuse those pages (checked below): a read whose snapshot ended
    before it, or at a remap, would read the new bytes."""
    admit(env)
    evict(env)
    r = reader(env, Daemon())
    assert r.direct is not None and r.ahead is not None
    ref = ChunkRef.of(OBJ, CHUNK, 3)
    addr, size = lookup(r, 3)
    base = r.pages.offset(addr)
    assert base is not None
    before = os.pread(r.pages._fd, size, base)
    evict(env)  # that read cached the value: the worker would leave it to a hit
    real = r.direct.read
    in_read, go = threading.Event(), threading.Event()

    def held(at: int, n: int, buf: mmap.mmap) -> memoryview | None:
        in_read.set()
        assert go.wait(60)
        return real(at, n, buf)

    r.direct.read = held  # type: ignore[method-assign]
    buf = r.ahead.buffer()
    assert buf is not None
    got: list[bytes | None] = []
    remapped = threading.Event()

    def work() -> None:
        view = r._read_direct(ref.key, buf)
        got.append(None if view is None else bytes(view))

    def remap() -> None:
        r.store.adopt_map_size()
        remapped.set()

    worker = threading.Thread(target=work)
    remapper = threading.Thread(target=remap)
    worker.start()
    try:
        assert in_read.wait(30)
        assert r.store.remap_lock.acquire(timeout=10), "the lookups' lock held across a read"
        r.store.remap_lock.release()
        remapper.start()
        churn(env, "a")  # the value evicted, others admitted: its pages are freed
        assert not remapped.is_set(), "a remap went ahead under a read in flight"
    finally:
        go.set()
        worker.join(60)
        if remapper.is_alive() or remapped.is_set():
            remapper.join(60)
    try:
        assert got == [before], "the direct read read other bytes than the value's"
        assert remapped.is_set()
        assert lookup_absent(r, ref.key)
        churn(env, "b")  # no snapshot from before the eviction now: the pages are reused
        assert os.pread(r.pages._fd, size, base) != before, "the writer reuses no pages"
    finally:
        r.close()


def test_a_remap_waits_for_a_workers_read_of_a_hit(env: str, no_read_around: None) -> None:
    """A hit not in the page cache is read by a worker in the snapshot that found it;
    a remap meanwhile (the serving thread adopting a map the daemon grew) would end that
    snapshot, and the daemon's evictions and admissions could then reuse the value's
    pages under the read: it waits for the read instead, which reads the value's bytes
    (no damage counted, nothing refetched)."""
    admit(env)
    drop_unmapped_pages(env)  # all of them: nothing maps data.mdb yet
    daemon = Daemon()
    r = reader(env, daemon)
    r.pages.nowait = False  # mincore: a RWF_NOWAIT read's read-ahead may land in time
    real = r.pages.pread
    in_read, go = threading.Event(), threading.Event()

    def held(n: int, offset: int) -> bytes:
        in_read.set()
        assert go.wait(60)
        return real(n, offset)

    r.pages.pread = held  # type: ignore[method-assign]
    remapped = threading.Event()
    remapper = threading.Thread(target=lambda: (r.store.adopt_map_size(), remapped.set()))

    async def main() -> None:
        f = OpenFile(OBJ)
        r.begin_read()
        async with trio.open_nursery() as nursery:
            got: list[bytes] = []

            async def read() -> None:
                data, hit, _ = await r.chunk(f, 2)
                got.append(bytes(data) if hit else b"")

            nursery.start_soon(read)
            assert await trio.to_thread.run_sync(in_read.wait, 30)
            try:
                remapper.start()
                await trio.to_thread.run_sync(churn, env, "a")
                assert not remapped.is_set(), "a remap went ahead under a read in flight"
            finally:
                go.set()
        assert got == [body()[2 * CHUNK : 3 * CHUNK]]
        assert r.read_in == 1 and r.counters.corrupt_chunks == 0 and daemon.requests == []
        await trio.to_thread.run_sync(remapper.join, 60)
        assert remapped.is_set()

    run(r, main)


def test_a_remap_while_a_read_of_a_hit_waits_for_a_thread_waits_for_nothing(
    env: str, no_read_around: None
) -> None:
    """A worker's read of a hit pins its snapshot once its thread runs, not before: a
    remap on the serving thread (snapshot() adopting a map the daemon grew) while the
    read waits for a thread (every one busy) must not wait for it, since only the
    serving thread can hand that thread out. The remap ends the read's snapshot; its
    worker finds it ended, and the value is looked up again in a fresh one: every byte,
    nothing counted damaged, nothing asked of the daemon."""
    admit(env)
    drop_unmapped_pages(env)  # all of them: nothing maps data.mdb yet
    daemon = Daemon()
    r = reader(env, daemon)
    r.pages.nowait = False  # mincore: a RWF_NOWAIT read's read-ahead may land in time
    r._fault_limiter = trio.CapacityLimiter(1)

    async def main() -> None:
        f = OpenFile(OBJ)
        got: list[tuple[bytes, bool]] = []

        async def read() -> None:
            data, hit, _ = await r.chunk(f, 2)
            got.append((bytes(data), hit))

        async with trio.open_nursery() as nursery:
            await r._fault_limiter.acquire()  # every worker thread busy
            r.begin_read()
            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()
            assert r.read_in == 1, "the read did not go to a worker"
            assert r.store._pins == 0, "a read waiting for its thread holds a pin"
            r.store.adopt_map_size()  # on the serving thread, as snapshot() does
            r._fault_limiter.release()
        assert got == [(body()[2 * CHUNK : 3 * CHUNK], True)]
        assert r.read_in == 2 and r.counters.corrupt_chunks == 0 and daemon.requests == []

    run(r, main)


def lookup_absent(r: ChunkReader, key: bytes) -> bool:
    with r.store.snapshot() as txn:
        cur = r.store.value_cursor(txn, r._chunks_db)
        assert cur is not None
        return cur.find(key) is None
