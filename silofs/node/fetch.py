"""The miss path in the daemon: single-flight per chunk, limiter charge, range GET.

Owns turning "chunk i of object o" into bytes: from LMDB if another mount admitted it
meanwhile, else one remote GET per chunk however many readers wait for it, charged to
the asking job's token bucket before the GET (promise 2), then offered to the Writer.
A mount reading ahead names the span of chunks it will read next; the first request of
the span to arrive fetches the chunks of it that are neither in flight nor held in one
range GET (a store charges per request, and moto or s3rver cost a fixed ~150 ms per
GET of a big object), bounded by MAX_SPAN_BYTES and by the job's rate. Never serves FUSE
requests and never writes LMDB itself (the Writer does).
"""

from __future__ import annotations

import contextvars
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import lmdb
import trio

from silofs import sealed
from silofs.cache.bounds import FirstTime
from silofs.cache.format import (
    MAX_SPAN_CHUNKS,
    Buffer,
    ChunkRef,
    ChunkValue,
    checked_chunk,
    encode_chunk,
)
from silofs.cache.store import CacheStore
from silofs.errors import BackendError
from silofs.flight import SingleFlight
from silofs.node.backends.base import Backend, RangeStream, requests_made
from silofs.node.limiter import TokenBucket
from silofs.node.store_write import PendingChunk
from silofs.node.writer import Writer
from silofs.units import count

# Set in the tasks of warms and hint walks: their GETs are background work. They may
# hold at most background_threads() of the Fetcher's threads, so a mount's miss always
# finds one free of them. The threads are taken first come first served (trio's
# CapacityLimiter is FIFO): before, one user's warms (8 GETs each, one per dataset, up
# to its 64 datasets) or hints (12 each, one per mount) queued hundreds of GETs ahead of
# every other user's misses, and 30 warms made another mount's misses 6x slower
# (docs/SECURITY.md "Store requests"; tests/integration/test_security.py).
BACKGROUND: contextvars.ContextVar[bool] = contextvars.ContextVar("fetch_background", default=False)


def background_threads(threads: int) -> int:
    """The Fetcher's threads warms and hints may hold together: all but a quarter
    (at least one kept for misses, when there are two or more)."""
    return max(1, threads - max(1, threads // 4))


def spare_threads(threads: int) -> int:
    """Threads the Fetcher keeps beyond `fetch_threads` (a quarter, at least one): one
    dataset's GETs hold at most `fetch_threads`, so another dataset's miss always finds
    one of these. A store that accepts a GET and never answers holds its thread through
    its attempts (read_deadline plus a read_timeout at most: ~60 s by default), and 16
    readers of one hung bucket made every other dataset's miss on the node wait 151 s
    (every attempt then) for a thread
    (tests/integration/test_store_over_time.py). Spares, not a smaller share: a node
    reading one dataset keeps all `fetch_threads` GETs at once for its misses."""
    return max(1, threads // 4)


class _DatasetShare:
    """The Fetcher's threads one dataset may hold: `all` (fetch_threads of them) and, of
    those, what its warms and hint walks may hold (background_threads of that), so its
    own misses find one free of them as well."""

    def __init__(self, threads: int) -> None:
        self.all = trio.CapacityLimiter(threads)
        self.background = trio.CapacityLimiter(background_threads(threads))

    def idle(self) -> bool:
        return not any(
            lim.borrowed_tokens or lim.statistics().tasks_waiting
            for lim in (self.all, self.background)
        )


log = logging.getLogger(__name__)

T = TypeVar("T")

# The most one range GET covers. Its bytes stay in the daemon until every chunk of the
# span is handed to the mount that asked (or given up), so this bounds the memory one
# reader's read-ahead can pin per GET; mounts ask for at most their read-ahead window.
MAX_SPAN_BYTES = 64 << 20
# With a job rate set, one GET covers at most this many seconds of the job's rate (and
# at least the chunk asked for): a span is charged whole before its GET, and a bigger
# one makes the job's bytes come in lumps (0.5 s of 20 MB/s was 45% off the rate in a
# 1 s window: tests/integration/test_allocations.py). The bucket's own burst.
SPAN_SECONDS = 0.05
# Chunks of a span that arrived before their own request (the mount sends one request
# per chunk, so this is rare and short): at most this many bytes are kept for them.
LOOSE_BYTES = MAX_SPAN_BYTES
# A sequential reader's open GET waits this long for its next span, and at most this
# many wait at once; each holds one store connection.
PARK_SECONDS = 5.0
MAX_PARKED = 8
# A chunk whose store fetch failed (a BackendError, after the backend's own retries)
# answers a new fetch of it with that error for this long, without a GET: the kernel
# asks again at once for the pages of a read that failed (and a read-ahead's reader asks
# for the chunk itself), which doubled the store's load during an outage. Seconds, so a
# transient error stays one: the first fetch after them asks the store again. At most
# FAILED_KEYS chunks are remembered (the oldest forgotten: one more GET).
# Chunk keys name content (the store's content id), so objects with the same bytes
# share them: a failure is remembered, and a failed GET's waiters get its error, only
# for the object that GET read (BackendError.object_key); a reader of another object
# with those bytes fetches its own (the GET of a changed copy made an unchanged file
# EIO for 3 s).
FAILED_SECONDS = 3.0
FAILED_KEYS = 4096


def _of_object(exc: BackendError, ref: ChunkRef) -> BackendError:
    """exc, marked as the failure of ref's object's GET (the first mark stays)."""
    if exc.object_key is None:
        exc.object_key = ref.obj.key
    return exc


def _foreign(exc: BaseException, ref: ChunkRef) -> bool:
    """Whether exc is the failed GET of another object than ref's (same bytes)."""
    return isinstance(exc, BackendError) and exc.object_key not in (None, ref.obj.key)


@dataclass
class FetchCounters:
    remote_gets: int = 0
    remote_bytes: int = 0
    cache_served: int = 0  # asked of the daemon but found admitted by another mount
    corrupt_chunks: int = 0
    errors: int = 0
    version_mismatches: int = 0  # asked for a version other than the one now listed
    # Store requests made (one GET may fetch a span of chunks; retries and Azure's
    # 4 MiB parts count each): what the store bills and a proxy in front of it sees.
    remote_requests: int = 0


@dataclass
class Fetched:
    """What one call fetched from the store: nothing if it waited on another's GET."""

    chunks: int = 0
    bytes: int = 0
    requests: int = 0


class Fetcher:
    def __init__(self, store: CacheStore, writer: Writer, threads: int) -> None:
        self.store = store
        self.writer = writer
        self.threads = trio.CapacityLimiter(threads + spare_threads(threads))
        self.background = trio.CapacityLimiter(background_threads(threads))
        self._dataset_threads = threads
        self._per_dataset: dict[int, _DatasetShare] = {}  # by dataset id, while in use
        # A chunk's bytes: bytes, or a read-only view of the data in its encoded value.
        self._flights: SingleFlight[bytes, bytes | memoryview] = SingleFlight()
        self._loose: OrderedDict[bytes, bytes | memoryview] = OrderedDict()
        self._loose_bytes = 0
        # Runs reading a stream now, by where they end: the next span waits for them.
        self._busy: dict[tuple[str, str, int], trio.Event] = {}
        # Open GETs of sequential readers, by (object key, content id, next offset).
        self._parked: OrderedDict[tuple[str, str, int], tuple[RangeStream, float]] = OrderedDict()
        self._damaged = FirstTime()  # chunk keys whose lookup failed
        # (dataset id, chunk key) whose fetch failed: (until when, on trio's clock; the
        # error). Per dataset: two datasets may list one object with other credentials.
        self._failed: OrderedDict[tuple[int, bytes], tuple[float, BackendError]] = OrderedDict()

    async def _in_thread(self, dsid: int, fn: Callable[[], T]) -> T:
        """fn() (a store GET of dataset `dsid`) in one of the threads, holding a slot of
        the dataset's share first (fetch_threads: the spares are other datasets'); a
        background task's (BACKGROUND) holds a background slot of its dataset's and of
        all, so misses keep a quarter of the threads from warms and hint walks."""
        share = self._per_dataset.get(dsid)
        if share is None:
            share = self._per_dataset[dsid] = _DatasetShare(self._dataset_threads)
        try:
            if not BACKGROUND.get():
                async with share.all:
                    return await trio.to_thread.run_sync(fn, limiter=self.threads)
            async with share.background, share.all, self.background:
                return await trio.to_thread.run_sync(fn, limiter=self.threads)
        finally:
            if share.idle():
                self._per_dataset.pop(dsid, None)  # a forgotten dataset leaves no entry

    def _failed_lately(self, dsid: int, ref: ChunkRef) -> BackendError | None:
        """The error a fetch of `ref` for `dsid` failed with less than FAILED_SECONDS ago,
        if any, and if it was a GET of ref's own object."""
        got = self._failed.get((dsid, ref.key))
        if got is None:
            return None
        if got[0] <= trio.current_time():
            del self._failed[dsid, ref.key]
            return None
        return None if _foreign(got[1], ref) else got[1]

    def _note_failed(self, dsid: int, keys: list[bytes] | set[bytes], exc: BaseException) -> None:
        if not isinstance(exc, BackendError):
            return  # a bug or a cancellation is not the store's answer
        until = trio.current_time() + FAILED_SECONDS
        for key in keys:
            self._failed.pop((dsid, key), None)
            self._failed[dsid, key] = (until, exc)
        while len(self._failed) > FAILED_KEYS:
            self._failed.popitem(last=False)

    def cached(self, ref: ChunkRef, counters: FetchCounters) -> tuple[memoryview | None, bool]:
        """(a verified copy of the chunk from LMDB or None, whether a value is there that
        failed verification: corrupt (counted) or of an older format; the caller fetches
        with replace=True so the bad value does not stay in the way of every read)."""
        with self.store.read_txn() as txn:
            try:
                value = self.store.get_value(txn, self.store.db(b"chunks"), ref.key)
            except lmdb.Error as exc:  # a damaged LMDB page (LMDB checks none)
                if self._damaged(ref.key):  # a damaged node stays: counted once
                    counters.corrupt_chunks += 1
                    log.warning(
                        "cache lookup of chunk %d of %s failed: %s", ref.index, ref.obj.key, exc
                    )
                return None, False
            if value is None:
                return None, False
            data = checked_chunk(value, ref, counters)  # copied out of the map, then checked
            return (None, True) if data is None else (data, False)

    async def fetch(
        self,
        dsid: int,
        backend: Backend,
        limiter: TokenBucket,
        ref: ChunkRef,
        *,
        replace: bool = False,
        admit: bool = True,
    ) -> tuple[bytes | memoryview, bool]:
        """(bytes, whether this call did the GET): the chunk from the store, admitted if
        its dataset has room (and `admit`: a node reading another member's chunk after
        that member failed does not keep it). Callers asking for a chunk already in
        flight share its GET; one fetched and still waiting for admission (a reader
        right behind a prefetch, or a second request of one reader) is answered from
        the Writer's queue, no GET."""
        if not replace and (value := self.writer.pending(ref.key)) is not None:
            data = checked_chunk(value, ref, FetchCounters())  # we encoded it: never bad
            if data is not None:
                return data, False
        if ref.key not in self._flights and (failed := self._failed_lately(dsid, ref)):
            raise failed.with_traceback(None)  # failed a moment ago: no second round of GETs
        while True:
            try:
                return await self._flights.run(
                    ref.key, lambda: self._fetch_once(dsid, backend, limiter, ref, replace, admit)
                )
            except BackendError as exc:
                if _foreign(exc, ref):
                    continue  # another object's GET (same bytes) failed: ours may not
                self._note_failed(dsid, [ref.key], exc)
                raise

    async def joined(self, key: bytes) -> bytes | memoryview | None:
        """The bytes of a chunk whose GET is in flight (anyone's), once they are in;
        None if none is, its leader gave up, or it failed: that GET may have been of
        another object with these bytes, so the caller's fetch() decides (it raises a
        failure of its own object's GET, remembered, without another GET)."""
        try:
            got = await self._flights.wait(key)
        except BackendError:
            return None
        return None if got is None else got[0]

    async def fetch_span(
        self,
        dsid: int,
        backend: Backend,
        limiter: TokenBucket,
        ref: ChunkRef,
        span: list[ChunkRef],
        *,
        replace: bool = False,
        readahead: bool = False,
    ) -> tuple[bytes | memoryview, Fetched]:
        """The bytes of `ref`, and what this call fetched for them. `span` is the run of
        consecutive chunks of ref's object the reader will read next (ref among them).
        If nobody fetches ref yet, one range GET covers the longest run of `span` around
        ref whose chunks are neither in flight nor held by the dataset (its owners rows),
        within MAX_SPAN_BYTES, MAX_SPAN_CHUNKS and SPAN_SECONDS of the job's rate; the
        run is charged to `limiter` before the GET, and every chunk of it is offered to
        the Writer and handed to whoever waits for it as soon as its bytes are in.
        `readahead`: the request named a span (a sequential reader), so the GET may
        stay open for the reader's next span (_get_run)."""
        while True:
            loose = self._loose.pop(ref.key, None)
            if loose is not None:
                self._loose_bytes -= len(loose)
                return loose, Fetched()
            if not replace and (value := self.writer.pending(ref.key)) is not None:
                # fetched (a prefetch, a span) and not yet committed: no second GET
                data = checked_chunk(value, ref, FetchCounters())  # we encoded it
                if data is not None:
                    return data, Fetched()
            try:
                got = await self._flights.wait(ref.key)
            except BackendError as exc:
                if _foreign(exc, ref):
                    continue  # another object's GET (same bytes) failed: ours may not
                raise
            if got is not None:
                return got[0], Fetched()
            if ref.key in self._flights:
                continue  # its leader gave up and another began since: wait for that one
            if (failed := self._failed_lately(dsid, ref)) is not None:
                raise failed.with_traceback(None)  # failed a moment ago: no second round of GETs
            # No await from here to claim(): what is free is claimed as it was seen.
            run = self._run_around(dsid, limiter, ref, span)
            self._flights.claim([r.key for r in run])
            break
        pending = {r.key for r in run}
        streamed = len(run) > 1
        mine: list[bytes | memoryview] = []

        def deliver(r: ChunkRef, data: memoryview, value: bytes | Buffer) -> None:
            again = replace and r.key == ref.key
            self.writer.offer(
                PendingChunk(dsid, r.key, value, r.length, replace=again, streamed=streamed)
            )
            pending.discard(r.key)
            waited = self._flights.settle(r.key, data)
            if r.key == ref.key:
                mine.append(data)
            elif not waited:
                self._keep_loose(r.key, data)  # its request has not arrived yet

        try:
            requests = await self._get_run(dsid, backend, limiter, run, deliver, readahead)
        except Exception as exc:
            if isinstance(exc, BackendError):
                _of_object(exc, ref)  # a run is of one object
            for key in pending:
                self._flights.settle(key, error=exc)
            self._note_failed(dsid, pending, exc)
            raise
        except BaseException:  # cancelled (the asking mount went away): others lead anew
            for key in pending:
                self._flights.abandon(key)
            raise
        return mine[0], Fetched(len(run), sum(r.length for r in run), requests)

    def _keep_loose(self, key: bytes, data: bytes | memoryview) -> None:
        """A chunk of a span that arrived before its own request: kept (bounded, oldest
        dropped) so the request does not GET it again when its dataset admits nothing."""
        self._loose[key] = data
        self._loose_bytes += len(data)
        while self._loose_bytes > LOOSE_BYTES:
            _, gone = self._loose.popitem(last=False)
            self._loose_bytes -= len(gone)

    def _run_around(
        self, dsid: int, limiter: TokenBucket, ref: ChunkRef, span: list[ChunkRef]
    ) -> list[ChunkRef]:
        """ref and its free neighbours in `span`, forward first (read-ahead is forward)."""
        limit = MAX_SPAN_BYTES
        if limiter.rate is not None:
            limit = min(limit, max(ref.length, int(limiter.rate * SPAN_SECONDS)))
        at = next((i for i, r in enumerate(span) if r.key == ref.key), None)
        if at is None or len(span) < 2:
            return [ref]
        run, total = [ref], ref.length
        with self.store.read_txn() as txn:

            def free(r: ChunkRef) -> bool:
                if len(run) >= MAX_SPAN_CHUNKS or total + r.length > limit:
                    return False
                if r.key in self._flights or r.key in self._loose:
                    return False
                if self._failed_lately(dsid, r) is not None:
                    return False  # its own request answers the error, no GET
                if self.writer.pending(r.key) is not None:
                    return False  # fetched, waiting for admission
                try:
                    return not self.store.owns(txn, dsid, r.key)
                except lmdb.Error:
                    return False  # a damaged page: that chunk's own request will see it

            for r in span[at + 1 :]:
                if not free(r):
                    break
                run.append(r)
                total += r.length
            for r in reversed(span[:at]):
                if not free(r):
                    break
                run.insert(0, r)
                total += r.length
        return run

    async def _get_run(
        self,
        dsid: int,
        backend: Backend,
        limiter: TokenBucket,
        run: list[ChunkRef],
        deliver: Callable[[ChunkRef, memoryview, bytes | Buffer], None],
        readahead: bool,
    ) -> int:
        """Fetch consecutive chunks, charged first, each delivered (in the trio thread)
        as soon as its bytes are in; the number of GETs made.

        One run is one ranged GET, read chunk by chunk. For read-ahead of a job without a
        rate the GET asks for the rest of the object, and what the run did not read
        stays open (parked, PARK_SECONDS, at most MAX_PARKED) for the reader's next
        span, which then needs no GET of its own (a span asked for while the run before
        it is still being read waits for it): moto and s3rver pay a fixed cost per GET
        of a big object, and a store per request. With a rate the GET covers the run
        only, so every byte that crosses the network was charged before its GET. Where
        the store streams no ranges, one get_range. A stream that breaks is read on
        with get_range (and its retries)."""
        total = sum(r.length for r in run)
        t0 = trio.current_time()
        await limiter.charge(total)
        t1 = trio.current_time()
        first = run[0]
        obj = first.obj
        at = (obj.key, obj.content_id, first.start)
        stream_on = readahead and limiter.rate is None
        before = self._busy.get(at)
        after = (obj.key, obj.content_id, first.start + total)
        done_event = trio.Event()
        if stream_on:
            # Claimed before we wait for the run before ours: a span after ours that
            # arrives meanwhile must wait for us too (and continue the stream we will
            # leave at `after`), not open a stream of its own. Claimed only after the
            # wait, a third span of a reader (three requests in flight) found nothing
            # busy at its start and opened a second stream, and the one left at its
            # start was never read again: one GET more, closed by the reaper after
            # PARK_SECONDS (test_cold_reads waited on the proxy's count for it).
            self._busy[after] = done_event
        parked: tuple[RangeStream, float] | None = None
        token = trio.lowlevel.current_trio_token()
        opened = 0
        # A later span of this object already has a stream (its request came first):
        # ours covers only its run, or the stream left open here would go unused.
        streamed_ahead = any(
            k[0] == obj.key and k[1] == obj.content_id and k[2] > first.start + total
            for k in (*self._busy, *self._parked)
        )

        def send(r: ChunkRef, data: bytes | memoryview) -> None:
            value = encode_chunk(dsid, r.index, r.chunk_size, obj.key, obj.content_id, data)
            # The reader gets the value's own copy of the data: no copy of its own.
            view = memoryview(value)[len(value) - len(data) :]
            # Queued, not waited for: the thread reads on. The loop runs these callbacks
            # in order, and before it learns that the thread returned (same queue).
            token.run_sync_soon(deliver, r, view, value)

        def send_read(r: ChunkRef, stream: RangeStream) -> None:
            # The stream's bytes land in the value itself: no copy between the socket
            # and LMDB's put, nor to the reader's reply (it gets a view of the value).
            # A big value is built in a memory file, sealed once filled, and a mount on
            # this host is handed the file rather than its bytes (silofs/sealed.py).
            built = ChunkValue(r.length, obj.key, obj.content_id, sealed.buffer)
            stream.readinto(built.data)
            value = built.seal(dsid, r.index, r.chunk_size)
            del built
            if isinstance(value, sealed.SealedValue):
                value = sealed.seal(value, r.length)
            view = memoryview(value)[len(value) - r.length :].toreadonly()
            token.run_sync_soon(deliver, r, view, value)

        def fetch() -> RangeStream | None:
            nonlocal opened
            noted = requests_made()
            stream = parked[0] if parked is not None else None
            if stream is None and (readahead or len(run) > 1):
                length = obj.size - first.start if stream_on and not streamed_ahead else total
                stream = backend_open(first.start, length)
                opened += stream is not None
            done = 0
            if stream is not None:
                try:
                    for r in run:
                        send_read(r, stream)
                        done += 1
                except Exception as exc:  # a broken stream: the rest by get_range
                    log.info("range stream of %s broke (%s); reading on without it", obj.key, exc)
                    stream.close()
                    stream = None
            rest = run[done:]
            if rest:
                opened += 1
                n = sum(r.length for r in rest)
                # The backend returns exactly n bytes or raises (its contract).
                data = backend.get_range(obj, rest[0].start, n) if n else b""
                view, off = memoryview(data), 0
                for r in rest:
                    send(r, view[off : off + r.length])
                    off += r.length
            if stream is not None and stream.pos >= stream.end:
                stream.close()
                stream = None
            # The requests the store made (retries, Azure's 4 MiB GETs), where the
            # backend counts them (RetryingBackend); else one per open or get_range.
            opened = max(opened, requests_made() - noted)
            return stream

        open_range = getattr(backend, "open_range", None)

        def backend_open(start: int, length: int) -> RangeStream | None:
            # A stream from chunk 0 on: the object is read in chunks, each verified (a
            # range of it was, before: chunk 0 was its own GET, the stream began at 1).
            whole = start == 0 and length == obj.size and length > first.chunk_size
            return None if open_range is None else open_range(obj, start, length, whole=whole)

        try:
            if stream_on and before is not None and at not in self._parked:
                with trio.move_on_after(PARK_SECONDS):
                    await before.wait()  # the run before ours is reading the stream we want
            self.sweep_parked(trio.current_time())
            parked = self._parked.pop(at, None)
            left = await self._in_thread(dsid, fetch)
            if left is not None:
                self._park((obj.key, obj.content_id, left.pos), left, trio.current_time())
        finally:
            if parked is not None and parked[0].pos == first.start:
                parked[0].close()  # never read from: the thread failed before it
            if self._busy.get(after) is done_event:
                del self._busy[after]
            done_event.set()
        log.debug(
            "%s chunks %d-%d (%d bytes): limiter %.3fs, %s %.3fs",
            obj.key,
            first.index,
            run[-1].index,
            total,
            t1 - t0,
            "continued" if parked is not None and not opened else count(opened, "GET"),
            trio.current_time() - t1,
        )
        return opened

    def _park(self, at: tuple[str, str, int], stream: RangeStream, now: float) -> None:
        old = self._parked.pop(at, None)
        if old is not None:
            old[0].close()
        self._parked[at] = (stream, now + PARK_SECONDS)
        while len(self._parked) > MAX_PARKED:
            _, (gone, _) = self._parked.popitem(last=False)
            gone.close()

    def sweep_parked(self, now: float) -> None:
        """Close the open GETs no span continued within PARK_SECONDS (each fetch and
        the daemon's reaper, every 2 s, call this)."""
        for at in [at for at, (_, until) in self._parked.items() if until < now]:
            self._parked.pop(at)[0].close()

    async def _fetch_once(
        self,
        dsid: int,
        backend: Backend,
        limiter: TokenBucket,
        ref: ChunkRef,
        replace: bool,
        admit: bool = True,
    ) -> bytes:
        await limiter.charge(ref.length)
        obj = ref.obj

        def get_and_encode() -> tuple[bytes, bytes]:
            # The backend returns exactly ref.length bytes or raises (its contract).
            data = backend.get_range(obj, ref.start, ref.length) if ref.length else b""
            return data, encode_chunk(
                dsid, ref.index, ref.chunk_size, obj.key, obj.content_id, data
            )

        try:
            data, value = await self._in_thread(dsid, get_and_encode)
        except BackendError as exc:
            _of_object(exc, ref)
            raise
        if admit:
            self.writer.offer(PendingChunk(dsid, ref.key, value, ref.length, replace=replace))
        return data
