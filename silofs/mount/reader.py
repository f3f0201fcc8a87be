"""The mount process's view of the cache: hits from LMDB, misses through the daemon.

Owns the hit path (the header and the blocks of an LMDB value covering the bytes a
request serves, copied out of data.mdb into a buffer of the mount's own while the read
txn that found the value is open, then verified on that copy and served from it: damage
that lands while a file is open is caught too, and bytes that change after the check
never reach a reader), a bounded buffer of chunks fetched by this mount (so a 4 MiB
chunk read in 1 MiB requests is fetched once even when its dataset is full),
single-flight and read-ahead of misses (a reader's miss watched by mount/waits.py: it
ends once the process that opened the file is gone or told to stop), and the counters
the daemon reports. Never talks to a store and never writes LMDB.

Read-ahead is per open file and adaptive: once a run of sequential reads covers more
than half a chunk (and, from a file's start, more than the kernel reads of a file whose
head alone is read: its read-ahead of the first request and the window after it), it
asks for the next chunk, and every span asked for after it is twice as long, up to
max_window chunks (readahead_bytes, at most half the buffer); a new span is asked for
once the reader is within half a window of the end of what was asked; a seek (a read
not where the last one ended) ends the run, and the window starts again at one chunk.
Random reads, files of one chunk and heads of files therefore never read ahead. Each
chunk of a span is its own request to the daemon (so each lands in the buffer and its
single-flight as it is served), and each names the span, so the daemon fetches the span
in one range GET, charged to the job before the GET (node/fetch.py). The misses of one
kernel request that crosses chunks name that request's chunks as their span.

A file is one version from open to close: every chunk of it is looked up by the content
id of the mount's own listing, and misses carry the listed version (&version=) so the
daemon serves that version or refuses (409, EIO here), never bytes of a version a later
refresh listed.

Invariant: an LMDB memoryview (a cursor's B-tree walk, a value's address) is never held
across an await. Another task renews the read txn at the start of its read, which would
invalidate it.

A value is found without touching its pages (cache/bounds.py ValueCursor) and copied out
of data.mdb with RWF_NOWAIT (mount/pages.py), or, for a warm small file read whole where
mincore tells this process what is in memory, out of LMDB's map once mincore says every
page of it is (whole()): a hit whose pages are not all in the page cache (the env
"SSD-warm": cached, but its pages dropped) is not read on the serving thread, where
every other reader would wait for that disk read. That read takes the
snapshot for itself (the next read begins another), a worker thread reads the value's
range (at most FAULT_THREADS at once) and the snapshot ends once it has; the copy is
verified as every hit is. A hit answered without an await is copied into one of the
reader's two scratch buffers (whole()'s, hit()'s), which pyfuse3 writes to /dev/fuse
before any other task runs; bytes
kept across an await (a span's parts, a worker's read) have buffers of their own.

A sequential reader's next DIRECT_AHEAD_BYTES of cached values are read by O_DIRECT into
buffers of the mount's own (mount/ahead.py) by worker threads, where data.mdb takes
O_DIRECT and the values are not in the page cache already: no page-cache fill, no
mapping, no copy out of the map. A request for such a value is verified on that buffer
and served from it (hit(), or chunk() once the read is done). Elsewhere a sequential
reader asks the kernel to read the values of the next VALUE_AHEAD_BYTES of chunks.
"""

from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import lmdb
import trio
import xxhash

from silofs import trace
from silofs.cache.bounds import FirstTime, ValueCursor
from silofs.cache.format import (
    BLOCK_SHIFT,
    BLOCK_SIZE,
    MAX_SPAN_CHUNKS,
    ChunkFormatError,
    ChunkRef,
    StaleFormatError,
    check_copy,
    checked_chunk,
    copy_verified,
    count_damage,
    header_bytes,
    layout,
    verify_chunk,
)
from silofs.cache.store import CacheStore
from silofs.control.client import AsyncControlClient, ControlError, quote_segment
from silofs.flight import SingleFlight
from silofs.mount.ahead import ValuesAhead
from silofs.mount.hot import HotFile
from silofs.mount.pages import DirectFile, ValuePages
from silofs.mount.survive import unforeseen
from silofs.mount.waits import Waits
from silofs.records import MountCounters, ObjectInfo

log = logging.getLogger(__name__)

# A mount's read snapshot is released after this long without a FUSE read (see
# ChunkReader._release_when_idle); the next read begins a fresh one.
SNAPSHOT_IDLE_SECONDS = 0.5
# Read-ahead asks for the next span once the reader is within this many windows of the
# end of what it asked for, and a window is at most this share of the chunk buffer:
# at most 1.5 windows wait in the buffer unread. Measured on moto (bench/cold.py):
# asking a whole window early with quarter-buffer windows gained nothing over this.
AHEAD_TRIGGER = 0.5
WINDOW_OF_BUFFER = 0.5
# Reads reuse a snapshot at most this old (ChunkReader.begin_read). Shorter than the idle
# release, so a busy mount still moves its snapshot forward and LMDB can reuse pages.
SNAPSHOT_REUSE_SECONDS = 0.25


# How far ahead of a sequential reader the kernel reads cached values (_advise_ahead):
# 64 MiB against the 16 MiB window of misses made a 512 MiB pass 0.61 -> 0.82 GB/s, and
# 8 MiB was slower still (docs/RESULTS.md, 2026-11-27).
VALUE_AHEAD_BYTES = 64 << 20
# Sequential readers whose read-ahead the chunk buffer holds at once (buffer_bytes_for).
BUFFER_STREAMS = 2
# A hit of more than this many bytes is copied only once its last page is in the page
# cache (a 1-byte RWF_NOWAIT read): the kernel's read-ahead brings a value's pages in
# order, so one copy that stops short at a page still under IO would be copied again
# whole by a worker. The serving thread copies such a range out of the map
# (ChunkReader._map_copy), a shorter one by preadv.
PROBE_BYTES = 256 << 10
# Hits being read by worker threads at once (ChunkReader._read_in, and the values read
# ahead direct): enough to keep a few readers' disk reads in flight together; each holds
# a read snapshot meanwhile.
FAULT_THREADS = 8
# How far ahead of a sequential reader cached values are read by O_DIRECT into buffers of
# the mount's own (_direct_ahead), where data.mdb takes O_DIRECT and chunks are at least
# DIRECT_MIN_CHUNK: each value read ahead holds a buffer until it is served.
DIRECT_AHEAD_BYTES = 16 << 20
DIRECT_MIN_CHUNK = 1 << 20
# O_DIRECT reads of values read ahead in flight at once (a semaphore the worker threads
# take: one freed hands on at once, where a trio limiter would wait for the serving
# thread's loop): the disk's queue stays busy between one value's read and the next.
# In one process (bench/values_ahead.py, 6 rounds, load 14): 2 read faster than 1 in
# every round, 4 no faster than 2 (bench/README.md).
DIRECT_READS = 2
# At most this many chunk keys remembered as left unanswered (ChunkReader._silent), and
# the silence a new ask of one accepts while the daemon has answered nothing since: this
# fraction of the client's timeout, at least SILENT_RECHECK_MIN seconds.
SILENT_KEYS = 1024
SILENT_RECHECK = 0.1
SILENT_RECHECK_MIN = 1.0
# Value sizes whose views whole() keeps at once (ChunkReader._whole_plan): a bound, not
# a cache (small files of one dataset share a few sizes).
WHOLE_LAYOUTS = 256
_monotonic = time.monotonic  # the hit path's clock, one global lookup
_xxh3 = xxhash.xxh3_64_intdigest  # the block and header sums (cache/format.py)
_SUM1 = struct.Struct("<Q").pack
# Headers whole() keeps as checked, by their ident (ChunkReader._verified): a bound.
WHOLE_HEADERS = 8192


def window_chunks(chunk_size: int, readahead_bytes: int) -> int:
    """The longest read-ahead span in chunks (0: no read-ahead)."""
    if readahead_bytes <= 0:
        return 0
    return max(1, min(MAX_SPAN_CHUNKS, readahead_bytes // chunk_size))


def buffer_bytes_for(chunk_size: int, readahead_bytes: int) -> int:
    """The chunk buffer's default bound: for each of BUFFER_STREAMS sequential readers,
    the chunk it is reading, the one its next request crosses into, and the 1.5
    windows read-ahead may have asked for beyond it (module docstring). A flat 128 MiB
    made the mount's anonymous memory 170 MiB in a cold pass whatever the read-ahead
    (bench/README.md); a chunk evicted before it is read again is served from LMDB if
    it was admitted, else fetched again."""
    window = window_chunks(chunk_size, readahead_bytes)
    return chunk_size * (window + (window + 1) // 2 + 2) * BUFFER_STREAMS


class _Refetch(Exception):
    """A cached value that must be fetched again, already counted if it was damaged."""


class MissError(Exception):
    """A miss could not be served; fs.py answers `errno`: EACCES when the daemon refused
    this reader (403: it may not read the object itself, docs/SECURITY.md), else EIO.
    `logged` once an ERROR line says so: a read-ahead's failure is a warning (the
    reader asks again), and a reader that joined that read-ahead logs it itself."""

    def __init__(self, message: str, errno_: int = errno.EIO) -> None:
        super().__init__(message)
        self.errno = errno_
        self.logged = False
        # The object whose ask failed: chunk keys name content, so a reader of another
        # object with the same bytes that joined the ask asks for its own (_miss).
        self.object_key: str | None = None


@dataclass(init=False)
class OpenFile:
    # The first five in the order open() passes them, positionally (no keyword parsing
    # per OPEN). The read-ahead state after them is read from the class's defaults until
    # a read first sets it (no slots: a slot must be stored before it is read), so an
    # OPEN stores five attributes, not twelve: a warm small file (read whole, in one
    # request) never sets any of it.
    obj: ObjectInfo
    inode: int = 0
    gen: int = 0  # the listing generation it was opened in
    ref: ChunkRef | None = None  # the chunk read last: its key is hashed once, not per read
    # The thread that opened it (FUSE's pid of the OPEN; read() gets none): a miss that
    # waits long ends once that process is gone or told to stop (mount/waits.py).
    opener: int = 0
    next_offset: int = -1  # where a sequential reader reads next
    window: int = 0  # chunks the next read-ahead span covers; 0: no run yet
    ahead: int = 0  # the first chunk read-ahead has not asked for yet
    asked_at: int = -1  # the chunk the reader was in when read-ahead last asked
    run_start: int = 0  # where the current run of sequential reads began
    asked_until: int = 0  # the end (bytes) of what read-ahead asked for in this run
    advised: int = 0  # the first chunk whose cached value was not read ahead yet
    # The kept file's record it was opened from (mount/hot.py), or None: then OPEN,
    # READ and RELEASE of it are the record's few loads (fs.py) while its guards hold.
    hot: HotFile | None = None

    def __init__(
        self,
        obj: ObjectInfo,
        inode: int = 0,
        gen: int = 0,
        ref: ChunkRef | None = None,
        opener: int = 0,
        hot: HotFile | None = None,
    ) -> None:
        self.obj = obj
        self.inode = inode
        self.gen = gen
        self.ref = ref
        self.opener = opener
        self.hot = hot

    def chunk_ref(self, chunk_size: int, index: int) -> ChunkRef:
        ref = self.ref
        if ref is None or ref.index != index or ref.chunk_size != chunk_size:
            ref = self.ref = ChunkRef.of(self.obj, chunk_size, index)
        return ref

    def advance(self, off: int, end: int) -> bool:
        """Note a read of [off, end); whether it continues the previous read. A seek
        ends the read-ahead run: the next one starts again at one chunk."""
        if off == self.next_offset:
            self.next_offset = end
            return True
        if self.window and self.run_start <= off < self.asked_until:
            # The kernel's own read-ahead has several requests in flight, and they reach
            # us out of order: a read inside what this run asked for is still the run.
            self.next_offset = max(self.next_offset, end)
            return True
        self.window = self.ahead = self.asked_until = self.advised = 0
        self.asked_at = -1
        self.run_start = off
        self.next_offset = end
        return False


class ChunkBuffer:
    """Chunks this mount fetched, most recent last, bounded in bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[bytes, tuple[bytes, bool]] = OrderedDict()
        self._refs: dict[bytes, ChunkRef] = {}  # what each item is, to offer it again

    def get(self, key: bytes) -> tuple[bytes, bool] | None:
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
        return item

    def put(self, key: bytes, data: bytes, from_cache: bool, ref: ChunkRef | None = None) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= len(old[0])
        self._items[key] = (data, from_cache)
        if ref is not None:
            self._refs[key] = ref
        self.bytes += len(data)
        while self.bytes > self.max_bytes and len(self._items) > 1:
            gone, (evicted, _) = self._items.popitem(last=False)
            self._refs.pop(gone, None)
            self.bytes -= len(evicted)

    def fetched(self) -> list[tuple[ChunkRef, bytes]]:
        """Chunks the daemon fetched remotely for us (not served from its cache): after a
        daemon restart they are offered for admission again (mount/process.py)."""
        return [
            (self._refs[k], data)
            for k, (data, from_cache) in self._items.items()
            if not from_cache and k in self._refs
        ]


class ChunkReader:
    def __init__(
        self,
        store: CacheStore,
        client: AsyncControlClient,
        *,
        dataset_id: int,
        chunk_size: int,
        buffer_bytes: int | None,
        readahead_bytes: int,
        reregister: Callable[[], Awaitable[None]],
        head_bytes: int = 0,
    ) -> None:
        self.store = store
        # What the kernel reads of a file whose head alone is read: its read-ahead of
        # the first request and the window after it (2 x the bdi's read_ahead_kb). A
        # run from offset 0 is a sequential reader only once it goes past that.
        self.head_bytes = head_bytes
        self.client = client
        self.dataset_id = dataset_id
        self.chunk_size = chunk_size
        if buffer_bytes is None:
            buffer_bytes = buffer_bytes_for(chunk_size, readahead_bytes)
        # The longest span: chunks read ahead wait in the buffer, and an evicted one
        # would be fetched twice, so at most half the buffer (a window plus half of the
        # next may be asked for at once).
        most = min(readahead_bytes, int(buffer_bytes * WINDOW_OF_BUFFER)) // chunk_size
        self.max_window = 0 if readahead_bytes <= 0 else max(1, min(MAX_SPAN_CHUNKS, most))
        # Bytes of read-ahead asked of the daemon and not served yet, all files
        # together: several sequential readers share the buffer.
        self.ahead_limit = max(chunk_size, buffer_bytes // 2)
        self.ahead_bytes = 0
        self.buffer = ChunkBuffer(buffer_bytes)
        self.counters = MountCounters()
        self.mount_id = ""
        self._reregister = reregister
        self._txn: lmdb.Transaction | None = None
        self._txn_at = 0.0  # time.monotonic() when the snapshot began
        self._txn_read = 0  # the read (self._reads) that began it
        self._stale = False  # a miss was served since: the next read begins a new one
        self._reads = 0  # reads begun; the idle task compares it between its ticks
        self._chunks_db = store.db(b"chunks")
        self._cursor: ValueCursor | None = None  # on self._txn's chunks db
        self._damaged = FirstTime()  # chunk keys whose lookup failed
        self.pages = ValuePages(os.path.join(store.path, "data.mdb"))
        if self.pages.enabled and store.value_bounds() is None:
            self.pages.enabled = False  # no cursor finds a value untouched
        self._fault_limiter = trio.CapacityLimiter(FAULT_THREADS)
        self._direct_reads = threading.BoundedSemaphore(DIRECT_READS)
        self.read_in = 0  # hits a worker thread read because the page cache lacked them
        self.direct: DirectFile | None = None
        self.ahead: ValuesAhead | None = None
        self._env_reads_around = False  # the map's faults read around (_find_alone)
        self._direct_lead = max(1, DIRECT_AHEAD_BYTES // chunk_size)
        if self.pages.enabled and chunk_size >= DIRECT_MIN_CHUNK:
            self._open_direct(os.path.join(store.path, "data.mdb"))
        # The scratch buffer of hits answered without an await (_copy_out).
        self._scratch = memoryview(bytearray(0))  # a header and the blocks after it
        self._short = b""  # the chunk hit() found not all in the page cache, last
        # The chunk hit() found absent, and in which read (self._reads): chunk() of it
        # in that read goes to the daemon without a second look.
        self._absent: tuple[bytes, int] = (b"", 0)
        # whole(): value size -> its views of _whole_scratch (_whole_plan), and whether
        # that path can serve at all (values copied by preadv with RWF_NOWAIT).
        self._wholes: dict[int, tuple] = {}
        # ChunkRef.expect's ident (the object key, content id, chunk index, size and
        # length a header names) -> the whole header whole() last checked in full for
        # it: a copy holding exactly those bytes needs no second look at the header
        # (its fields and its own sum passed), only at the block sums it holds.
        self._verified: dict[bytes, bytes] = {}
        self._whole_ok = self.pages.enabled and self.pages.nowait
        # whole() copies out of the map where mincore tells what is in the page cache
        # (ValuePages.in_memory), else by preadv with RWF_NOWAIT.
        self._whole_map = self.pages.truthful
        # Hot records' locations (mount/hot.py) hold while this is their `placed`: one
        # more for each cursor on a snapshot of another txn id or map (_value_cursor).
        self._placed = 1
        self._placed_in: tuple[int, int] = (-1, -1)
        # The largest one-chunk file whole() serves: hit() copies a longer range out of
        # the map instead (PROBE_BYTES).
        self.whole_max = min(chunk_size, PROBE_BYTES)
        # whole()'s own scratch buffer, of whole_max bytes (at most 256 KiB), made once
        # (_whole_plan): hit()'s grows with what it copies, and views of a replaced one
        # kept by hot records (mount/hot.py) would keep each old buffer alive.
        self._whole_scratch = memoryview(bytearray(self.whole_max))
        self._flights: SingleFlight[bytes, tuple[bytes, bool]] = SingleFlight()
        # A reader's misses that wait, ended once the opener's process stops (EINTR).
        self.waits = Waits()
        # Chunk keys whose last ask the daemon left unanswered for the client's timeout,
        # and when that ask failed (trio's clock): _silence_for.
        self._silent: dict[bytes, float] = {}
        self._nursery: trio.Nursery | None = None
        # In LRU mode the daemon needs to know what was hit: it never sees hits itself.
        self.track_hits = False
        self.touched: list[bytes] = []

    def _open_direct(self, data_path: str) -> None:
        """Read a sequential reader's next values by O_DIRECT where data.mdb allows it.
        A buffer holds a whole value and the page-aligned bytes around it (its header
        is at most a few KiB: the object key, the content id, a sum per block)."""
        direct = DirectFile(data_path)
        if not direct.enabled:
            return
        self._env_reads_around = bool(self.store.env.flags()["readahead"])
        room = self.chunk_size + (8 << 10) + self.chunk_size // 512 + 2 * direct.align
        size = (room + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        self.direct = direct
        self.ahead = ValuesAhead(size, (self._direct_lead + 2) * BUFFER_STREAMS)

    def registered(self, mount_id: str, track_hits: bool) -> None:
        """The daemon knows this mount by `mount_id` (again, after a daemon restart)."""
        self.mount_id = mount_id
        self.track_hits = track_hits

    def start(self, nursery: trio.Nursery) -> None:
        """Begin serving: open the first read snapshot; read-ahead runs in `nursery`."""
        self._nursery = nursery
        self.renew()
        nursery.start_soon(self._release_when_idle)
        nursery.start_soon(self.waits.run)

    async def _release_when_idle(self) -> None:
        """Drop the read snapshot after SNAPSHOT_IDLE_SECONDS without a read.

        While a snapshot is open LMDB cannot reuse any page freed after it began: one
        idle mount made data.mdb grow to the map limit under another dataset's
        admissions and evictions, and admission stopped. The next read (or a lookup in
        _snapshot) begins a new one; the hit path pays one integer increment for this."""
        seen = -1
        while True:
            await trio.sleep(SNAPSHOT_IDLE_SECONDS)
            if self._reads == seen and self._txn is not None:
                # No await since the last read began: no LMDB view is in use (invariant).
                self._cursor = None
                txn, self._txn = self._txn, None
                try:
                    txn.abort()
                except Exception as exc:  # noqa: BLE001 - a task of the mount: never its end
                    unforeseen("releasing the idle read snapshot", exc)
            seen = self._reads

    def close(self) -> None:
        """Release the read snapshot and the env: an open snapshot left behind by an
        ended process pins LMDB pages until the daemon's reader_check clears it."""
        self._cursor = None
        if self._txn is not None:
            self._txn.abort()
            self._txn = None
        self.pages.close()
        if self.direct is not None:
            self.direct.close()
        if self.ahead is not None:
            self.ahead.close()
        self.store.close()

    # -- the hit path (synchronous) --------------------------------------------------
    def begin_read(self) -> None:
        """Call at the start of each FUSE read. Keeps the read snapshot if it is younger
        than SNAPSHOT_REUSE_SECONDS (beginning one per read cost more than the lookup).

        An older snapshot answers a hit the same: a chunk key names one version's bytes
        (promise 3 needs no fresher view). Only a chunk admitted since the snapshot
        began looks absent, so a lookup that misses looks again in a fresh one
        (_find) before asking the daemon, and the read after a miss begins a fresh
        one (the writer may have admitted that chunk, or replaced a value that failed
        its check, since). Safe only where no LMDB view is still in use."""
        self._reads += 1
        if (
            self._txn is None
            or self._stale
            or _monotonic() - self._txn_at >= SNAPSHOT_REUSE_SECONDS
        ):
            self.renew()  # whole() runs these lines inline: keep the two the same

    def renew(self) -> None:
        """Start a fresh read snapshot. Safe only where no LMDB view is still in use."""
        self._cursor = None
        if self._txn is not None:
            self._txn.abort()
            self._txn = None
        self._txn_at = time.monotonic()
        self._txn_read = self._reads
        self._stale = False
        self._txn = self.store.snapshot()

    def _snapshot(self) -> lmdb.Transaction:
        """The current read snapshot; a new one if it was released while idle (a read
        that awaited a miss for longer than SNAPSHOT_IDLE_SECONDS)."""
        if self._txn is None:
            self.renew()
        assert self._txn is not None
        return self._txn

    def cached_bytes(self) -> int:
        """Bytes the cache holds for this mount's dataset (its usage row), read in a
        short txn of its own: statfs must not renew or pin the reads' snapshot."""
        with self.store.read_txn() as txn:
            return self.store.usage_of(txn, self.dataset_id).bytes

    def _find(self, ref: ChunkRef) -> tuple[int, int] | None:
        """(address, size) of the cached value of `ref` in the current snapshot
        (self._txn), none of its pages touched but the first (bounds.py), or None if
        absent. For self.pages.enabled only (a ValueCursor finds values there)."""
        cur = self._cursor or self._value_cursor()
        assert cur is not None
        where = cur.find(ref.key)  # DamagedValueError (an lmdb.Error) outside data.mdb
        return where if where is not None else self._find_fresh(ref)

    def _find_fresh(self, ref: ChunkRef) -> tuple[int, int] | None:
        """_find's answer once the current snapshot lacks `ref`: admitted since an
        earlier read began the snapshot? Look in a fresh one."""
        if self._txn_read == self._reads:
            return None
        self.renew()
        cur = self._value_cursor()
        assert cur is not None
        return cur.find(ref.key)

    def _get(self, key: bytes) -> memoryview | None:
        """The value of `key` as a view of the map, faulted in on this thread: where
        values cannot be copied out of the file (not self.pages.enabled)."""
        cur = self._value_cursor()
        value = self._snapshot().get(key, db=self._chunks_db) if cur is None else cur.get(key)
        if value is None and self._txn_read != self._reads:
            self.renew()
            return self._get(key)
        return value  # type: ignore[return-value]

    def _value_cursor(self) -> ValueCursor | None:
        """The current snapshot's cursor on the chunks db (None: values cannot be
        bounds-checked here, cache/bounds.py). A snapshot of another txn id than the
        last cursor's, or a map that moved, makes every hot record's location stale
        (_placed, mount/hot.py)."""
        if self._cursor is None:
            txn = self._snapshot()
            cur = self._cursor = self.store.value_cursor(txn, self._chunks_db)
            placed = (txn.id(), cur.start if cur is not None else -1)
            if placed != self._placed_in:
                self._placed_in = placed
                self._placed += 1
        return self._cursor

    def _header_guess(self, ref: ChunkRef, size: int) -> int:
        """The header length of `ref`'s value (of `size` bytes) as this dataset admits
        it: a read copies it along with the data, in one preadv where the data begins at
        the chunk's start (_copy_out copies it again if the header says otherwise)."""
        guess = ref.header or header_bytes(ref.obj.key.encode(), ref.content_bytes, ref.length)
        return guess if guess < size else size

    def _copy_out(
        self,
        ref: ChunkRef,
        base: int,
        size: int,
        lo: int,
        hi: int,
        waits: bool,
        hdr: int,
        shift: int = BLOCK_SHIFT,
        exact: bool = False,
    ) -> memoryview | None:
        """[lo, hi) of `ref`'s value (`size` bytes at `base` in data.mdb), copied out of
        the file and checked on the copy (check_copy), else ChunkFormatError. The header
        is copied as `hdr` bytes and the data in blocks of 1 << `shift` as this dataset
        writes them, and again as the value's own header says if that differs (`exact`:
        it did). `waits`: a worker thread's read, into new bytes, waiting for the disk;
        else into this reader's scratch, None if a page is not in the page cache."""
        start = (lo >> shift) << shift
        end = min((((hi - 1) >> shift) + 1) << shift, ref.length) if hi > lo else start
        pages = self.pages
        if waits:  # bytes, not a bytearray: nothing zero-fills them first
            try:
                head = memoryview(pages.pread(hdr, base))
                data = memoryview(pages.pread(end - start, base + hdr + start) if end else b"")
            except OSError as exc:  # a bad sector, say: refetched like a damaged value
                raise ChunkFormatError(f"cannot read data.mdb: {exc}") from None
            if len(head) + len(data) < hdr + end - start:
                raise ChunkFormatError("value runs past the end of data.mdb")
        else:
            nowait = pages.nowait
            if nowait and end - start > PROBE_BYTES and not pages.cached(base + hdr + end - 1):
                return None  # its last page is not in yet: copy none of it twice
            # This reader's own buffers for a hit served without an await: pyfuse3 writes
            # a handler's reply to /dev/fuse before its task yields (fuse_reply_buf, GIL
            # held), and no other thread ever touches them, so the next request may reuse
            # them. Never for bytes kept across an await (chunk(), a span's parts).
            need = hdr + end - start
            mv = self._scratch
            if len(mv) < need:
                mv = self._scratch = memoryview(bytearray(need))  # the old may be exported
            head, data = mv[:hdr], mv[hdr:need]
            if start == 0 and end:  # header and data are one run of the file: one read
                got = pages.read(base, [mv[:need]], nowait)
            else:
                got = pages.read(base, [head], nowait)
                if got == hdr and end:
                    got += pages.read(base + hdr + start, [data], nowait)
            if got < hdr + end - start:
                return None
        cid = ref.content_bytes
        try:
            return check_copy(
                head, size, data, cid, ref.chunk_size, ref.index, ref.length, lo, hi, ref.expect
            )
        except StaleFormatError:
            raise
        except ChunkFormatError:
            # Laid out otherwise than guessed (another dataset's key in the header, say:
            # the copy then fails its check)? Copy the value again as its header says.
            # Asked only after a failed check: a hit pays no second parse of the header.
            found = layout(head) if not exact else (hdr, shift)
            if found == (hdr, shift) or found[0] > size or not 12 <= found[1] <= 26:
                raise
        return self._copy_out(ref, base, size, lo, hi, waits, *found, exact=True)

    async def _read_in(
        self, ref: ChunkRef, base: int, size: int, lo: int, hi: int, hdr: int
    ) -> memoryview | None:
        """[lo, hi) of a value not all in the page cache, read by a worker thread; None
        if a remap ended the snapshot that found it before the worker began (the caller
        looks the value up again).

        The snapshot the value was found in (self._txn) is this read's own until the
        thread is done: a read that begins meanwhile begins a fresh one instead of
        ending it, so the writer cannot reuse the value's pages while the thread reads
        them. A remap would end it (py-lmdb ends every txn of the env), so the worker
        pins it (CacheStore.pin) and a remap waits for its read. The worker, not this
        task: a remap runs on this thread, and would wait forever for a pin whose
        thread had not started (the limiter hands out threads from this thread). What
        the thread read is this read's own copy, so the snapshot ends then."""
        txn = self._txn
        assert txn is not None
        self._txn = None
        self._cursor = None
        self.read_in += 1
        store = self.store

        def copy() -> memoryview | None:
            with store.remap_lock:
                pinned = store.pin(txn)
            if not pinned:
                return None
            try:
                view = self._copy_out(ref, base, size, lo, hi, True, hdr)
            finally:
                store.unpin(txn)
            assert view is not None  # a read that waits is short only at the file's end
            return view

        try:
            return await trio.to_thread.run_sync(copy, limiter=self._fault_limiter)
        finally:
            txn.abort()  # ended by now, unless no thread took it (cancelled)

    def whole(self, f: OpenFile) -> memoryview | None:
        """All of a one-chunk file of at most whole_max bytes (f.ref: its chunk 0, made
        by ChunkRef.of), read through the page cache and verified, as hit(f, 0, 0,
        length) serves it, with begin_read() done either way; None where the general
        path must serve it (the caller then calls hit(), which looks again, not
        begin_read(): a second for one FUSE read would have hit() look once more in a
        snapshot of its own for nothing, as a daemon-answered miss did).

        The same work as hit() with every decision that does not change per read made
        once per value layout (_whole_plan: the buffers and views), so a warm small file
        costs one B-tree walk, one copy and one xxh3 pass over its bytes. The copy is out
        of LMDB's map where mincore is truthful here (`_whole_map`), once it says every
        page of the value is in the page cache (a memcpy over page tables, where preadv
        looks up and marks each page of the page cache: 4-6 us less per 110 KiB file of
        a kept mount, bench/README.md "The private copy"), else by preadv with
        RWF_NOWAIT; either way this read's own, checked and served. The check is
        check_copy's with `expect`, on this copy: every block's sum on every read,
        compared with the header's block sums at once (one packed run of digests); and
        the header as this object's chunk is written but for the dataset id (lead and
        ident), the value exactly a header and the data long, and the header's own sum
        - or, for a header byte for byte the one last checked so for this chunk of this
        object (_verified), that identity instead of a second look. Anything else
        (another layout, a value read ahead, a page not in the page cache, a failed
        check) returns None: hit() looks again and chunk() counts the damage.
        """
        # begin_read(), inline (this FUSE read's, whatever path serves it): the one call
        # per warm small file it cost is gone; keep the two the same.
        self._reads += 1
        if (
            self._txn is None
            or self._stale
            or _monotonic() - self._txn_at >= SNAPSHOT_REUSE_SECONDS
        ):
            self.renew()
        return self._whole(f.ref, None)

    def whole_hot(self, h: HotFile) -> memoryview | None:
        """whole() of a file opened from its hot record `h` (mount/hot.py): the same
        read, copy and check, with what whole() finds per read (the value's place, its
        layout's buffers, the header as checked) taken from the record while its
        `placed` holds (no committed write and no remap since whole() filled it in);
        else whole() proper, which fills it in again. begin_read() done either way.

        Every read still copies the header and the data out of the map (once mincore
        says every page is in the page cache) into the mount's own buffers and serves
        that copy only if the header is byte for byte the one checked in full and every
        block's xxh3 is the sum that header holds: a page rewritten, damaged or reused
        since fails it, and the caller's general path (hit(), chunk()) takes the read."""
        self._reads += 1  # begin_read(), inline, as in whole()
        if (
            self._txn is None
            or self._stale
            or _monotonic() - self._txn_at >= SNAPSHOT_REUSE_SECONDS
        ):
            self.renew()
        # No look at the values read ahead, as whole() has: only a sequential reader's
        # chunks after the one it reads are (_direct_ahead), never a one-chunk file's.
        cur = self._cursor or self._value_cursor()
        if h.placed != self._placed:
            return self._whole(h.ref, h)  # placed again (or never yet)
        pages = h.pages
        if not self.pages.in_memory_pages(h.page, h.span, pages):
            return None  # hit() copies what is cached and hands the rest to a worker
        view = cur.map  # type: ignore[union-attr]  # _placed: a read txn's cursor
        head = h.head
        head[:] = view[h.at : h.mid]
        h.data[:] = view[h.mid : h.end]
        if h.pack(*map(_xxh3, h.blocks)) != h.sums or head != h.header:  # type: ignore[misc]
            return None  # every block, on every read; hit() counts the damage
        if self.track_hits and len(self.touched) < 65536:
            self.touched.append(h.ref.key)
        return h.data

    def _whole(self, ref: ChunkRef | None, hot: HotFile | None) -> memoryview | None:
        """whole() once the read is begun; fills in `hot`'s location where it serves
        the value out of the map (whole_hot())."""
        expect = ref.expect if ref is not None else None
        ahead = self.ahead
        if (
            expect is None
            or not self._whole_ok
            or (ahead is not None and (ahead.values or ahead.flights))
        ):
            return None
        try:
            cur = self._cursor or self._value_cursor()
            where = cur.find(ref.key)  # type: ignore[union-attr]  # pages.enabled: a cursor
        except lmdb.Error:
            return None  # hit() looks again, chunk() counts it
        if where is None:
            return None  # admitted since the snapshot began? hit() looks in a fresh one
        addr, size = where
        lead, ident, hdr = expect
        length = ref.length
        if size != hdr + length:
            return None  # laid out otherwise (another dataset's key): check_copy parses it
        plan = self._wholes.get(size)
        if plan is None or plan[0] != hdr:
            plan = self._whole_plan(hdr, length)
        _, iov, head, blocks, pack, head_part, data = plan
        if self._whole_map:
            # The private copy out of LMDB's map once mincore says every page is in the
            # page cache: a memcpy over the process's page tables, where preadv looks up
            # and marks each page of the page cache (~4.5 us less per 110 KiB file of a
            # kept mount, bench/README.md). The same copy, verified the same: only its
            # source changes.
            if not self.pages.in_memory(addr, size):  # reserve()d by _whole_plan
                return None  # hit() copies what is cached and hands the rest to a worker
            at = addr - cur.start  # type: ignore[union-attr]  # cur.value(), inline
            view = cur.map  # type: ignore[union-attr]  # a read txn's: never None
            head[:] = view[at : at + hdr]
            data[:] = view[at + hdr : at + size]
        elif self.pages.copy_nowait(addr, iov) != size:
            return None  # not all in the page cache (hit() hands it to a worker), or moved
        sums = pack(*map(_xxh3, blocks))  # every block, on every read
        if head != self._verified.get(ident):
            # Not the header checked last for this chunk of this object: check_copy's
            # `expect` path (as written under this key but for the dataset id, and its
            # own sum), then kept as checked.
            if not (
                head.startswith(lead)
                and head.startswith(ident, len(lead) + 8)  # past the dataset id (u64)
                and head.endswith(_SUM1(_xxh3(head_part)))
                and head.endswith(sums, 0, hdr - 8)
            ):
                return None  # hit() checks it again and chunk() counts the damage
            verified = self._verified
            if len(verified) >= WHOLE_HEADERS:
                verified.clear()  # a bound, not a cache: one more header checked in full
            verified[ident] = bytes(head)
        elif not head.endswith(sums, 0, hdr - 8):  # the block sums end before hdr_sum
            return None
        if hot is not None and self._whole_map:
            # Checked in full or as the header checked so for this chunk: what whole_hot()
            # compares each later copy with while this snapshot's `placed` holds.
            hot.at, hot.mid, hot.end = at, at + hdr, at + size
            hot.page = page = addr & ~(mmap.PAGESIZE - 1)
            hot.span = addr + size - page
            hot.pages = (hot.span + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            hot.head, hot.data, hot.blocks, hot.pack = head, data, blocks, pack
            hot.header, hot.sums = bytes(head), sums
            hot.placed = self._placed
        if self.track_hits and len(self.touched) < 65536:
            self.touched.append(ref.key)
        return data

    def _whole_plan(self, hdr: int, length: int) -> tuple:
        """What whole() reads and checks a value of a `hdr`-byte header and `length` data
        bytes with: (hdr, the preadv's buffers, the header's buffer (a bytearray of its
        own: compared by memcmp, where a view compares byte by byte), the views of the
        data's blocks (the last may be short), the struct packing their sums, the view
        of the header before its own sum, the data's view). The data goes to whole()'s
        scratch buffer (one such copy is served at a time, as hit()'s, _copy_out), made
        once at whole_max bytes: never replaced, so the views the plans and the hot
        records (mount/hot.py) hold stay this reader's one buffer. Kept per value
        size, bounded."""
        size = hdr + length
        mv = self._whole_scratch
        if len(mv) < length:  # never: whole() serves at most whole_max bytes
            mv = memoryview(bytearray(length))
        head = bytearray(hdr)
        data = mv[:length]
        blocks = [data[at : at + BLOCK_SIZE] for at in range(0, length, BLOCK_SIZE)]
        pack = struct.Struct(f"<{len(blocks)}Q").pack
        self.pages.reserve(size)  # whole()'s ValuePages.in_memory of a value this long
        plan = (hdr, [head, data], head, blocks, pack, memoryview(head)[: hdr - 8], data)
        if len(self._wholes) >= WHOLE_LAYOUTS:
            self._wholes.clear()  # a bound, not a cache: one more plan made per size
        self._wholes[size] = plan
        return plan

    # -- one chunk, any source -------------------------------------------------------
    def hit(self, f: OpenFile, index: int, lo: int, hi: int) -> memoryview | None:
        """The chunk's data [lo, hi), copied out of data.mdb and verified, if it is
        cached and in the page cache: the common case, answered without a coroutine,
        in this reader's scratch buffer (valid until the next hit). None where chunk()
        must take it (absent, not in memory, damaged, or a lookup that failed): chunk()
        looks it up again and counts what it finds, so nothing is counted here."""
        ref = f.ref
        if ref is None or ref.index != index or ref.chunk_size != self.chunk_size:
            ref = f.ref = ChunkRef.of(f.obj, self.chunk_size, index)  # f.chunk_ref()'s
        pages = self.pages
        ahead = self.ahead
        try:
            if ahead is not None and ahead.values and (value := ahead.get(ref.key)) is not None:
                view = self._ahead_view(ref, value, lo, hi)
            elif ahead is not None and ahead.flights and ahead.reading(ref.key):
                return None  # chunk() waits for that read
            elif not pages.enabled:
                value = self._get(ref.key)
                if value is None:
                    return None
                cid = ref.content_bytes
                view = copy_verified(value, cid, ref.chunk_size, ref.index, ref.length, lo, hi)
            else:
                cur = self._cursor
                # The current snapshot's cursor, asked directly; a fresh snapshot only
                # when this one lacks the value.
                if cur is None:
                    where = self._find(ref)
                else:
                    where = cur.find(ref.key)
                    if where is None:
                        where = self._find_fresh(ref)
                if where is None:
                    # Absent in this read's snapshot: chunk() asks the daemon without
                    # looking again (a daemon-answered miss looked three times).
                    self._absent = (ref.key, self._reads)
                    return None
                addr, size = where
                base = pages.offset(addr)
                if base is None or not (pages.nowait or pages.value_resident(addr, size)):
                    return None
                hdr = ref.header  # ChunkRef.of's (the hit path makes its refs so)
                if hdr > size or not hdr:
                    hdr = self._header_guess(ref, size)
                if hi - lo > PROBE_BYTES and pages.nowait:
                    view = self._map_copy(ref, addr, base, size, hdr, lo, hi)
                else:
                    view = self._copy_out(ref, base, size, lo, hi, False, hdr)
                if view is None:
                    self._short = ref.key  # chunk() goes straight to a worker
                    return None
        except (ChunkFormatError, lmdb.Error):
            return None
        if self.track_hits and len(self.touched) < 65536:
            self.touched.append(ref.key)
        return view

    def _map_copy(
        self, ref: ChunkRef, addr: int, base: int, size: int, hdr: int, lo: int, hi: int
    ) -> memoryview | None:
        """[lo, hi) of the value the cursor is on (`size` bytes at `addr` in the map and
        at `base` in data.mdb, its header likely `hdr` bytes), copied out of the map and
        verified (copy_verified), if the range's last page is in the page cache, else
        None. A long range copies for less CPU this way than by preadv (one memcpy over
        pages mapped 16 at a time, against the kernel's copy page by page:
        bench/README.md); the copy is this read's own all the same. The pages it reads
        are mapped first (ValuePages.mapped): one the disk cannot read is
        ChunkFormatError here, and chunk() reads the value again by a worker's pread,
        which sees the error and has the chunk refetched, where the copy would have
        raised SIGBUS and killed the mount."""
        pages = self.pages
        if not pages.cached(base + hdr + hi - 1):
            return None
        if not pages.mapped(addr, 0, hdr):
            raise ChunkFormatError("the value's header cannot be read from data.mdb")
        value = self._value_cursor().value()  # type: ignore[union-attr]
        found, shift = layout(value)
        if not 12 <= shift <= 26 or not hdr <= found <= size:
            found, shift = hdr, BLOCK_SHIFT  # copy_verified names what is wrong
        start = (lo >> shift) << shift
        end = min(found + ((((hi - 1) >> shift) + 1) << shift), size)
        if not (
            (found == hdr or pages.mapped(addr, hdr, found))
            and pages.mapped(addr, found + start, end)
        ):
            raise ChunkFormatError("a page of the value cannot be read from data.mdb")
        cid = ref.content_bytes
        return copy_verified(value, cid, ref.chunk_size, ref.index, ref.length, lo, hi)

    def _ahead_view(self, ref: ChunkRef, value: memoryview, lo: int, hi: int) -> memoryview:
        """[lo, hi) of `ref`'s value read ahead direct, verified on the buffer it was read
        into (the mount's own memory), else ChunkFormatError: a view of that buffer,
        valid until the caller's task yields. A value served to its end is dropped, its
        buffer free for the next value read ahead."""
        cid = ref.content_bytes
        view = verify_chunk(value, cid, ref.chunk_size, ref.index, ref.length, lo, hi)[lo:hi]
        ahead = self.ahead
        assert ahead is not None
        ahead.served += 1
        if hi == ref.length:
            ahead.drop(ref.key)
        return view

    async def _cached(
        self, ref: ChunkRef, lo: int, hi: int, kept: bool, again: bool = True
    ) -> memoryview | None:
        """[lo, hi) of `ref`'s cached value, copied out and verified (ChunkFormatError if
        it fails), in buffers of its own (`kept`; else it may be a view of the reader's,
        valid until the caller's task yields: chunk()); None if it is not cached. A value
        being read ahead direct is waited for; a value not all in the page cache is read
        by a worker thread (_read_in)."""
        ahead = self.ahead
        if ahead is not None and not ahead.wanted(ref.key):
            value = await ahead.wait(ref.key)
            if value is not None:
                try:
                    view = self._ahead_view(ref, value, lo, hi)
                except ChunkFormatError:
                    ahead.drop(ref.key)
                    raise
                return memoryview(view.tobytes()) if kept else view
        pages = self.pages
        if not pages.enabled:
            value = self._get(ref.key)
            return None if value is None else self._checked(value, ref, lo, hi)
        where = self._find(ref)
        if where is None:
            return None
        addr, size = where
        base = pages.offset(addr)
        if base is None:  # not where data.mdb is mapped: copy it out of the map instead
            return self._checked(self._value_cursor().value(), ref, lo, hi)  # type: ignore[union-attr]
        hdr = self._header_guess(ref, size)
        short, self._short = self._short, b""
        if short != ref.key and (pages.nowait or pages.value_resident(addr, size)):
            view = self._copy_out(ref, base, size, lo, hi, False, hdr)
            if view is not None:  # the scratch is the next hit's
                return memoryview(view.tobytes()) if kept else view
        view = await self._read_in(ref, base, size, lo, hi, hdr)
        if view is None:  # a remap ended the snapshot that found it: in a fresh one
            if not again:
                raise _Refetch  # remapped again meanwhile: the daemon serves it
            return await self._cached(ref, lo, hi, kept, again=False)
        return view

    def _checked(self, value: memoryview, ref: ChunkRef, lo: int, hi: int) -> memoryview:
        """[lo, hi) of a value in the map, copied out and verified; _Refetch if it is
        damaged (counted and logged) or of an older format."""
        view = checked_chunk(value, ref, self.counters, lo, hi)
        if view is None:
            raise _Refetch
        return view

    async def chunk(
        self,
        f: OpenFile,
        index: int,
        lo: int = 0,
        hi: int | None = None,
        span: tuple[int, int] | None = None,
        kept: bool = True,
    ) -> tuple[memoryview, bool, str]:
        """(data, hit, source): the chunk's bytes [lo, hi) (chunk offsets; default all of
        it) from LMDB (hit, "cache"; copied out of data.mdb and verified), this mount's
        buffer ("buffer"; a hit if the daemon had it cached), or the daemon ("cache" if it
        found the chunk cached, "store" if it had to GET it), in bytes of their own. A
        miss names `span` (the chunks the same request reads) to the daemon. With
        `kept` False the caller replies with the bytes before its task yields again
        (fs.py's read of one chunk), so a hit may be a view of a buffer of the reader's,
        as hit()'s is, and is not copied out of it."""
        ref = f.chunk_ref(self.chunk_size, index)
        if hi is None:
            hi = ref.length
        try:
            if self._absent == (ref.key, self._reads):  # hit() just looked: not there
                view = None
            else:
                view = await self._cached(ref, lo, hi, kept)
        except (StaleFormatError, _Refetch):  # of an older format, or counted already
            data, from_cache = await self._miss(ref, refetch=True, opener=f.opener, inode=f.inode)
            return memoryview(data)[lo:hi], from_cache, "cache" if from_cache else "store"
        except ChunkFormatError as exc:
            count_damage(ref, self.counters, exc)
            data, from_cache = await self._miss(ref, refetch=True, opener=f.opener, inode=f.inode)
            return memoryview(data)[lo:hi], from_cache, "cache" if from_cache else "store"
        except lmdb.Error as exc:
            # LMDB has no checksums of its own pages: a damaged B-tree page can make a
            # lookup fail. A miss, like a damaged value; never an exception out of read().
            # A damaged node stays (cache/store.py _delete_chunk): counted once.
            if self._damaged(ref.key):
                self.counters.corrupt_chunks += 1
                log.warning("cache lookup of chunk %d of %s failed: %s", index, f.obj.key, exc)
            data, from_cache = await self._miss(ref, refetch=True, opener=f.opener, inode=f.inode)
            return memoryview(data)[lo:hi], from_cache, "cache" if from_cache else "store"
        if view is not None:
            if self.track_hits and len(self.touched) < 65536:
                self.touched.append(ref.key)
            return view, True, "cache"
        if (item := self.buffer.get(ref.key)) is not None:
            return memoryview(item[0])[lo:hi], item[1], "buffer"
        data, from_cache = await self._miss(
            ref, refetch=False, span=span, opener=f.opener, inode=f.inode
        )
        return memoryview(data)[lo:hi], from_cache, "cache" if from_cache else "store"

    async def _miss(
        self,
        ref: ChunkRef,
        refetch: bool,
        span: tuple[int, int] | None = None,
        ahead: bool = False,
        opener: int = 0,
        inode: int = 0,
    ) -> tuple[bytes, bool]:
        """The chunk from the daemon, single-flight. A reader's miss (`opener`: the pid
        of its file's OPEN, `inode` the file's) ends with Interrupted once that process
        is gone or told to stop (mount/waits.py); a read-ahead's (no opener) waits on."""

        async def ask() -> tuple[bytes, bool]:
            try:
                data, from_cache = await self._ask_daemon(ref, refetch, span, ahead)
            except MissError as exc:
                exc.object_key = ref.obj.key
                raise
            self.buffer.put(ref.key, data, from_cache, ref)
            return data, from_cache

        async def flown() -> tuple[bytes, bool]:
            while True:
                try:
                    return (await self._flights.run(ref.key, ask))[0]
                except MissError as exc:
                    if exc.object_key not in (None, ref.obj.key):
                        continue  # another file with these bytes failed (changed): ours
                    if not ahead and not exc.logged:  # this reader joined a read-ahead's ask
                        _log_failure(logging.ERROR, ref, exc)
                        exc.logged = True
                    raise

        if ref.key in self._flights:  # joins another's ask: a flight's wait, in a scope
            result = await self.waits.wait(opener, flown, inode)
        else:  # leads it: its waits are the client's requests, ended by their abort
            result = await self.waits.watch(opener, flown, inode)
        self._stale = True  # the chunk may be admitted (or replaced) now: see begin_read
        return result

    async def _ask_daemon(
        self,
        ref: ChunkRef,
        refetch: bool,
        span: tuple[int, int] | None = None,
        ahead: bool = False,
    ) -> tuple[bytes, bool]:
        silence = self._silence_for(ref)
        for attempt in (1, 2):
            path = (
                f"/v1/chunks?mount={self.mount_id}&key={quote_segment(ref.obj.key)}"
                f"&index={ref.index}&version={quote_segment(ref.obj.version)}"
                # A streamed chunk may come as the daemon's sealed file (silofs/sealed.py).
                + "&fd=1"
                # A peer-served chunk may come named in the connection's hand-off region.
                + "&region=1"
                + ("&refetch=1" if refetch else "")
                + (f"&span={span[0]}-{span[1]}" if span is not None else "")
            )
            frozen = False
            if trace.ON:
                trace.mark("mount:ask", trace.chunk_id(ref.obj.key, ref.index))
            try:
                if silence is None:
                    status, headers, body = await self.client.request("GET", path)
                else:
                    status, headers, body = await self.client.request("GET", path, timeout=silence)
                if trace.ON:
                    trace.mark("mount:answered", trace.chunk_id(ref.obj.key, ref.index))
            except ControlError as exc:
                status, headers, body = None, {}, str(exc).encode()
                frozen = exc.timed_out  # silent for client.timeout s: EIO, no re-register
                if frozen:
                    self._note_silence(ref.key)
            if status == 200:
                return body, headers.get("x-silofs-source") == "cache"
            # The daemon's 404 names this mount (authz.py): an object key or a store's
            # message saying "no mount" must not look like a daemon restart.
            unknown = f"no mount {self.mount_id!r}".encode()
            gone = (status is None and not frozen) or (status == 404 and unknown in body)
            if gone and attempt == 1:
                try:
                    await self._reregister()  # the daemon restarted: introduce ourselves
                    continue
                except (ControlError, MissError) as exc:
                    body = str(exc).encode()
            exc = MissError(_error_text(body), errno.EACCES if status == 403 else errno.EIO)
            _log_failure(logging.WARNING if ahead else logging.ERROR, ref, exc)
            exc.logged = not ahead
            raise exc
        raise AssertionError("unreachable")

    def _note_silence(self, key: bytes) -> None:
        if len(self._silent) >= SILENT_KEYS:
            self._silent.clear()  # a bound, not a cache: forgetting costs one more wait
        self._silent[key] = trio.current_time()

    def _silence_for(self, ref: ChunkRef) -> float | None:
        """The silence to accept for this ask: the client's (None), or a tenth of it for
        a chunk whose ask the daemon left unanswered for the client's whole timeout less
        than that timeout ago, when it has answered nothing since. The kernel asks again
        for the pages of a read-ahead that failed (a buffered read() of a miss is two
        requests of one chunk), and a frozen daemon would make that reader wait twice the
        timeout; a daemon that woke up answers (or sends 102) within the tenth."""
        since = self._silent.get(ref.key)
        if since is None:
            return None
        timeout = self.client.timeout
        if self.client.answered_at > since or trio.current_time() - since >= timeout:
            del self._silent[ref.key]  # the daemon answered since, or long ago
            return None
        return max(SILENT_RECHECK_MIN, timeout * SILENT_RECHECK)

    # -- read-ahead --------------------------------------------------------------------
    def prefetch(self, f: OpenFile, current: int) -> None:
        """After a sequential read that reached chunk `current`: have the kernel read
        the cached values of the next VALUE_AHEAD_BYTES (_advise_ahead), and ask the
        daemon for the next span if the reader is within half a window of the end of
        what was asked (module docstring). Chunks our dataset holds (its owners rows; a
        get of the value would fault in up to chunk_size bytes), in flight or in the
        buffer are not asked for; one owned by another dataset is missed here and the
        daemon serves it from LMDB."""
        if self._nursery is None or self.max_window == 0:
            return
        run = f.next_offset - f.run_start
        if run <= self.chunk_size // 2 or (f.run_start == 0 and run <= self.head_bytes):
            # Not yet a sequential reader: the kernel reads the head of a file in two
            # requests of its own read-ahead (an image decoder reading a header).
            return
        last = (f.obj.size - 1) // self.chunk_size
        if self.direct is not None and self.direct.enabled:
            self._direct_ahead(f, current, last)
        elif self.pages.enabled:
            self._advise_ahead(f, current, last)
        if current == f.asked_at:
            return  # once per chunk: the span asked for before is usually still in flight
        f.ahead = max(f.ahead, current + 1)
        f.window = max(f.window, 1)
        if f.ahead > last or f.ahead - current - 1 > f.window * AHEAD_TRIGGER:
            return
        first, end = f.ahead, min(last, f.ahead + f.window - 1)
        if self.ahead_bytes and self.ahead_bytes + (end - first + 1) * self.chunk_size > (
            self.ahead_limit
        ):
            return  # other files' read-ahead fills the buffer: ask on a later read
        txn = self._snapshot()
        refs = []
        for index in range(first, end + 1):
            ref = ChunkRef.of(f.obj, self.chunk_size, index)
            try:
                if self.store.owns(txn, self.dataset_id, ref.key):
                    continue  # cached: its value is read ahead instead (_advise_ahead)
            except lmdb.Error:
                return  # a damaged page: the reader's own lookup will count it
            if self._wanted(ref):
                refs.append(ref)
        f.ahead = end + 1
        f.asked_until = f.ahead * self.chunk_size
        f.asked_at = current
        f.window = min(f.window * 2, self.max_window)
        for ref in refs:
            self.ahead_bytes += ref.length
            self._nursery.start_soon(self._prefetch_one, ref, (first, end))

    def _advise_ahead(self, f: OpenFile, current: int, last: int) -> None:
        """Keep the kernel reading the cached values of a sequential reader's next
        VALUE_AHEAD_BYTES: once less than half of that is advised, the rest up to it. A
        value costs no buffer while it is read ahead, so the lead is longer than the
        read-ahead window of misses, and the serving thread finds the next chunks in
        memory (without it, a 512 MiB file waited on the disk inside set_key)."""
        assert self._nursery is not None
        lead = max(1, VALUE_AHEAD_BYTES // self.chunk_size)
        if f.advised > current + lead // 2:
            return
        first, end = max(f.advised, current + 1), min(last, current + lead)
        if first > end:
            return
        f.advised = end + 1
        keys = [ChunkRef.of(f.obj, self.chunk_size, i).key for i in range(first, end + 1)]
        self._nursery.start_soon(self._read_ahead_values, keys)

    def _direct_ahead(self, f: OpenFile, current: int, last: int) -> None:
        """Keep the values of a sequential reader's next DIRECT_AHEAD_BYTES of chunks read
        (or being read) by O_DIRECT into buffers of the mount's own: the disk does the
        work the page cache's fill, the map's faults and the copy out of it did. Only
        chunks our dataset holds (its owners rows, which touch no value): a cold file's
        are misses, and a worker would look each up for nothing."""
        assert self._nursery is not None and self.ahead is not None
        lead = self._direct_lead
        if f.advised > current + lead:
            return
        first, end = max(f.advised, current + 1), min(last, current + lead)
        if first > end:
            return
        f.advised = end + 1
        txn = self._snapshot()
        for index in range(first, end + 1):
            key = ChunkRef.of(f.obj, self.chunk_size, index).key
            try:
                if not self.ahead.wanted(key) or not self.store.owns(txn, self.dataset_id, key):
                    continue
            except lmdb.Error:
                return  # a damaged page: the reader's own lookup will count it
            # Begun here, not in the task: the reader's next request, which may come
            # before the task runs, waits for this read instead of reading it itself.
            if self.ahead.begin(key):
                self._nursery.start_soon(self._read_ahead_direct, key)

    async def _read_ahead_direct(self, key: bytes) -> None:
        """Read `key`'s cached value (a read begun) into a buffer of ValuesAhead, by a
        worker thread. A value that cannot be read is left to the reader's own read of
        it, which counts the damage and has it refetched."""
        ahead = self.ahead
        assert ahead is not None
        buf = ahead.buffer()  # taken in the task: never while a reply may still read it
        value = None
        try:
            if buf is not None:
                value = await trio.to_thread.run_sync(
                    self._read_direct, key, buf, limiter=self._fault_limiter
                )
        except (OSError, lmdb.Error) as exc:
            log.debug("reading a cached value ahead: %s", exc)
        except Exception as exc:  # noqa: BLE001 - a task of the mount: never its end
            # The reader's own read of the value (a worker's pread) serves it instead.
            unforeseen("reading a cached value ahead (O_DIRECT)", exc)
        finally:
            ahead.end(key, buf, value)

    def _read_direct(self, key: bytes, buf: mmap.mmap) -> memoryview | None:
        """The value of `key` read by O_DIRECT into `buf` (a worker thread's call), in a
        snapshot of the worker's own, open until the read is done so the writer cannot
        reuse the value's pages meanwhile. None if it is not cached, does not fit `buf`,
        or is all in the page cache already (the serving thread copies it from there for
        less than a read from the disk).

        The remap lock is held for what reads LMDB's map (the snapshot's begin, the
        B-tree walk, the address's offset, mincore), not across the read: that reads the
        file at an offset, which a remap does not move. The snapshot is pinned instead
        (CacheStore.pin: a remap ends every txn, and waits for this one). So up to
        DIRECT_READS values' reads are in flight at once, each in a worker of its own,
        and the disk's queue stays busy between them (tests/unit/test_reader_direct.py)."""
        pages, direct, store = self.pages, self.direct, self.store
        assert direct is not None
        with store.remap_lock:
            txn = store.read_txn()
            found: tuple[int, int] | None = None
            try:
                cur = store.value_cursor(txn, self._chunks_db)
                where = self._find_alone(cur, key) if cur is not None else None
                if where is not None and direct.enabled:
                    addr, size = where
                    base = pages.offset(addr)
                    start, end = direct.span(base or 0, size)
                    if not (
                        base is None or end - start > len(buf) or pages.value_cached(addr, size)
                    ):
                        found = base, size
            finally:
                if found is None:
                    txn.abort()
            if found is None:
                return None
            store.pin(txn)  # under the remap lock, in the snapshot just begun: alive
        try:
            with self._direct_reads:
                return direct.read(*found, buf)
        finally:
            store.unpin(txn)

    def _find_alone(self, cur: ValueCursor, key: bytes) -> tuple[int, int] | None:
        """cur.find(key) with no read-around of the page faults it takes (a worker's
        call, under the remap lock). The lookup touches the value's first page; with the
        env's read-around (the bdi's read-ahead, megabytes on some disks) that fault
        would fill the page cache with the value read direct next, and the ones after
        it: the very fill the direct read saves. The map reads around again after it:
        a hit's lookup on the serving thread meanwhile reads only the page it needs.
        The map's span is the cursor's own bounds, found with it."""
        if not self._env_reads_around:
            return cur.find(key)
        self.pages.read_around(cur.start, cur.map_end, False)
        try:
            return cur.find(key)
        finally:
            self.pages.read_around(cur.start, cur.map_end, True)

    async def _read_ahead_values(self, keys: list[bytes]) -> None:
        """Have the kernel read the values of `keys` ahead (MADV_WILLNEED; keys not
        cached are skipped), found in a snapshot of the worker's own: the lookups'
        B-tree faults (each reading around it) happen there, not on the serving thread.
        A hint by address only: harmless once that snapshot ends or if the env is
        remapped meanwhile (ValuePages)."""

        def advise() -> None:
            # The serving thread must not remap the env under this walk (adopt_map_size).
            with self.store.remap_lock, self.store.read_txn() as txn:
                cur = self.store.value_cursor(txn, self._chunks_db)
                for key in keys if cur is not None else ():
                    where = cur.find(key)
                    if where is not None:
                        self.pages.willneed(where[0], 0, where[1])  # GIL released

        try:
            await trio.to_thread.run_sync(advise, limiter=self._fault_limiter)
        except lmdb.Error:
            pass  # a damaged page: the reader's own lookup will count it
        except Exception as exc:  # noqa: BLE001 - a hint only: never the mount's end
            unforeseen("advising cached values ahead", exc)

    def _wanted(self, ref: ChunkRef) -> bool:
        return ref.key not in self._flights and self.buffer.get(ref.key) is None

    async def _prefetch_one(self, ref: ChunkRef, span: tuple[int, int]) -> None:
        try:
            if self._wanted(ref):
                await self._miss(ref, False, span, ahead=True)
        except MissError:
            pass  # the reader will ask again and get the error itself
        except Exception as exc:  # noqa: BLE001 - a task of the mount: never its end
            unforeseen(f"reading chunk {ref.index} of {ref.obj.key} ahead", exc)
        finally:
            self.ahead_bytes -= ref.length


def _log_failure(level: int, ref: ChunkRef, exc: MissError) -> None:
    log.log(level, "reading %s chunk %d: %s", ref.obj.key, ref.index, exc)


def _error_text(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:200] or "no answer from the silofs daemon"
