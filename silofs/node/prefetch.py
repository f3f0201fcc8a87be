"""Prefetch by hint: fetch a job's misses ahead of its reader, in the order it said.

Owns one hint per mount (POST /v1/mounts/{id}/hints): the paths a training job will read
next, in order, and the task that walks them, fetching the chunks the dataset does not
hold through the Fetcher (single-flight with the reader's own misses, charged to the
job's token bucket first: promise 2), at most `window` bytes ahead of where the reader
is. A new hint replaces the old one; `append` extends it. The idea is DELI's
("Quantifying and Improving Performance of Distributed Deep Learning with Cloud
Storage", IC2E '21) and DLCache's ("Dataset Placement and Data Loading Optimizations for
Cloud-Native Deep Learning Workloads", ISORC '23): a loader that knows its order has
what it reads next fetched ahead of it.

Where the reader is: the daemon never sees hits, so the position (in bytes of the hinted
order) is the larger of the bytes the mount reported reading since the hint arrived
(every 250 ms) and the start of the furthest hinted chunk the mount missed on. Hinted
files behind that position are skipped: the reader's own misses fetch them.

Admission stays uniform (promise 1): a chunk is fetched only if the dataset would admit
it (node/fill_budget.py: what it holds, plus what is in flight or offered, plus the
chunk, within its quota); at the first one that would not fit (checked again after a
Writer flush) the hint stops, "full". In lru mode the window is capped by the quota, so
prefetched chunks do not evict each other before they are read.

Never writes LMDB (the Writer admits what the Fetcher offers), never decides quotas or
rates, and never raises into the daemon: each hint's task runs supervised
(node/supervise.py), a failure marks the hint `error`.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from silofs.cache.format import ChunkRef
from silofs.errors import AccessDeniedError, BackendError, first_leaf
from silofs.node.fetch import BACKGROUND
from silofs.node.fill_budget import FillBudget
from silofs.node.state import DatasetState, MountState, PrefetchCounters
from silofs.records import ObjectInfo
from silofs.units import count, format_size

log = logging.getLogger(__name__)

# Paths one request may carry, and paths one mount's hint may hold not yet walked:
# ~100 B each in the daemon, so at most ~100 MB per mount. The helper (silofs/hints.py)
# sends a long order in pieces of MAX_HINT_PATHS as the reader gets to them.
MAX_HINT_PATHS = 65_536
MAX_HINT_PENDING = 1 << 20
# And across all of one untrusted uid's mounts (a uid may hold 256 mounts).
MAX_HINT_PENDING_PER_UID = 1 << 20
MAX_HINT_PATH_LEN = 4096
# Objects resolved (listing lookup, access check, owners rows) per thread hop.
RESOLVE_BATCH = 256
# Failed chunk GETs (after the backend's retries) that end a hint: the store is away.
MAX_ERRORS = 8


def concurrency(fetch_threads: int) -> int:
    """Chunk GETs one hint keeps in flight: three quarters of the Fetcher's threads, so
    a reader's miss on something not hinted still finds a thread soon."""
    return max(1, fetch_threads * 3 // 4)


@dataclass
class _Chunk:
    """A prefetched chunk the reader has not passed yet."""

    key: str
    index: int
    end: int  # offset in the hinted order just past this chunk
    length: int
    missed: bool = False  # the reader asked the daemon for it anyway


@dataclass
class Hint:
    """One mount's hint and the progress of its prefetch."""

    mount_id: str
    job: str
    dsid: int
    chunk_size: int
    window: int  # bytes prefetched ahead of the reader, at most
    # Who hinted: None for root and admins, else (uid, gids) for per-object checks.
    peer: tuple[int, frozenset[int]] | None
    base_read: int  # the mount's reported bytes_read when the hint arrived
    paths: deque[str] = field(default_factory=deque)  # hinted, not walked yet
    hinted: int = 0  # paths received for this hint (appends included)
    walked: int = 0  # paths taken off `paths`
    state: str = "running"  # running | done | full | cancelled | error
    error: str = ""
    position: int = 0  # hinted bytes the reader has passed (an estimate, see module doc)
    front: int = 0  # hinted bytes the walk has passed
    ahead_bytes: int = 0  # prefetched (or in flight) bytes at or past `position`
    waiting: bool = False  # the walk waits for the reader: the window is full
    ahead: deque[_Chunk] = field(default_factory=deque)
    # hinted object key -> (start, end) offsets, for objects the walk has reached and
    # the reader has not passed (a miss on one moves the position); oldest first.
    starts: OrderedDict[str, tuple[int, int]] = field(default_factory=OrderedDict)
    by_chunk: dict[tuple[str, int], _Chunk] = field(default_factory=dict)
    counters: PrefetchCounters = field(default_factory=PrefetchCounters)
    job_counters: PrefetchCounters = field(default_factory=PrefetchCounters)  # the job's
    unknown: int = 0  # hinted paths not in the listing (or directories)
    denied: int = 0  # hinted paths the peer may not read: never fetched
    behind: int = 0  # hinted paths the reader had passed before the walk got there
    cached_bytes: int = 0  # hinted bytes the dataset already held: nothing to fetch
    errors: int = 0  # chunk GETs that failed (after the backend's retries)
    # monotonic (elapsed_s is a duration: a wall clock stepped back made it negative)
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    moved: trio.Event = field(default_factory=trio.Event, repr=False)
    scope: trio.CancelScope = field(default_factory=trio.CancelScope, repr=False)
    running: bool = False  # a task walks it
    budget: FillBudget | None = field(default=None, repr=False)  # its walk's, once it runs

    @property
    def in_flight(self) -> int:
        """Bytes being fetched."""
        return self.budget.in_flight if self.budget is not None else 0

    def view(self) -> dict[str, Any]:
        c = self.counters
        return {
            "state": self.state,
            "error": self.error or None,
            "window": self.window,
            "hinted": self.hinted,
            "pending": len(self.paths),
            "walked": self.walked,
            "position": self.position,
            "front": self.front,
            "ahead_bytes": self.ahead_bytes,
            "in_flight_bytes": self.in_flight,
            "waiting_for_reader": self.waiting,
            "prefetched_bytes": c.bytes,
            "prefetched_chunks": c.chunks,
            "hit_chunks": c.hit_chunks,
            "missed_chunks": c.missed_chunks,
            "cached_bytes": self.cached_bytes,
            "unknown": self.unknown,
            "denied": self.denied,
            "behind": self.behind,
            "errors": self.errors,
            "elapsed_s": round((self.finished or time.monotonic()) - self.started, 2),
        }

    # -- the reader's position ------------------------------------------------------
    def advance(self, position: int) -> None:
        """The reader has passed `position` hinted bytes: chunks behind it that it never
        asked the daemon for were served as hits (or by the page cache)."""
        if position <= self.position:
            return
        self.position = position
        while self.ahead and self.ahead[0].end <= position:
            chunk = self.ahead.popleft()
            self.by_chunk.pop((chunk.key, chunk.index), None)
            self.ahead_bytes -= chunk.length
            if not chunk.missed:
                self.counters.hit_chunks += 1
                self.job_counters.hit_chunks += 1
        while self.starts and next(iter(self.starts.values()))[1] <= position:
            self.starts.popitem(last=False)
        self.moved.set()
        self.moved = trio.Event()

    def missed(self, key: str, index: int) -> None:
        """The mount asked the daemon for chunk `index` of `key`."""
        chunk = self.by_chunk.get((key, index))
        if chunk is not None and not chunk.missed:
            chunk.missed = True
            self.counters.missed_chunks += 1
            self.job_counters.missed_chunks += 1
        span = self.starts.get(key)
        if span is not None:
            self.advance(span[0] + index * self.chunk_size)


class Prefetcher:
    """The node's hints, one per mount. `d` is the Daemon (node/daemon.py imports this
    module, so it is not imported back)."""

    def __init__(self, d: Any) -> None:
        self.d = d
        self.hints: dict[str, Hint] = {}

    # -- the route's side -------------------------------------------------------------
    def hint(
        self,
        m: MountState,
        paths: list[str],
        *,
        append: bool,
        window: int,
        peer: tuple[int, frozenset[int]] | None,
    ) -> Hint:
        """Start (or with `append`, extend) the mount's hint. ValueError if the hint
        would hold more than MAX_HINT_PENDING paths not walked yet, or an untrusted
        peer's hints together more than MAX_HINT_PENDING_PER_UID."""
        old = self.hints.get(m.id)
        extend = append and old is not None and old.state in ("running", "done")
        kept = len(old.paths) if extend and old is not None else 0
        if kept + len(paths) > MAX_HINT_PENDING:
            raise ValueError(
                f"the hint would hold {kept + len(paths)} paths not read yet "
                f"(limit {MAX_HINT_PENDING}): send the next ones later"
            )
        if peer is not None:
            others = sum(
                len(h.paths)
                for mid, h in self.hints.items()
                if mid != m.id and (om := self.d.mounts.get(mid)) is not None and om.uid == m.uid
            )
            if others + kept + len(paths) > MAX_HINT_PENDING_PER_UID:
                raise ValueError(
                    f"uid {m.uid}'s hints would hold {others + kept + len(paths)} paths not "
                    f"read yet (limit {MAX_HINT_PENDING_PER_UID} per uid)"
                )
        if extend and old is not None:
            old.paths.extend(paths)
            old.hinted += len(paths)
            if not old.running:
                old.state, old.finished = "running", None
                self._start(old)
            return old
        if old is not None:
            self._stop(old, "cancelled")
        h = Hint(m.id, m.job, m.dsid, m.chunk_size, window, peer, m.reported.bytes_read)
        h.paths.extend(paths)
        h.hinted = len(paths)
        h.job_counters = self.d.job(m.job).prefetch
        self.hints[m.id] = h
        self._start(h)
        log.info(
            "mount %s (job %s): hint of %s, window %s",
            m.id,
            m.job,
            count(len(paths), "path"),
            format_size(window),
        )
        return h

    def cancel(self, mount_id: str) -> Hint | None:
        h = self.hints.get(mount_id)
        if h is not None:
            self._stop(h, "cancelled")
        return h

    def _stop(self, h: Hint, state: str) -> None:
        h.paths.clear()
        h.scope.cancel()
        if h.state == "running":
            h.state = state

    def _start(self, h: Hint) -> None:
        h.scope = trio.CancelScope()
        h.running = True

        def failed(reason: str) -> None:
            h.state, h.error, h.finished, h.running = "error", reason, time.monotonic(), False

        self.d.spawn(f"prefetch of mount {h.mount_id}", self._run, h, on_failure=failed)

    # -- the daemon's hooks -------------------------------------------------------------
    def reported(self, m: MountState) -> None:
        """The mount reported its counters: its reads since the hint move the position."""
        h = self.hints.get(m.id)
        if h is not None:
            h.advance(m.reported.bytes_read - h.base_read)

    def missed(self, m: MountState, key: str, index: int) -> None:
        h = self.hints.get(m.id)
        if h is not None:
            h.missed(key, index)

    def forget(self, mount_id: str) -> None:
        """The mount is gone: stop its hint and forget it."""
        h = self.hints.pop(mount_id, None)
        if h is not None:
            self._stop(h, "cancelled")

    # -- the walk -------------------------------------------------------------------------
    async def _run(self, h: Hint) -> None:
        BACKGROUND.set(True)  # this task's and its children's GETs leave misses a share
        with h.scope:
            try:
                await self._walk(h)
                if h.state == "running":
                    h.state = "done"
            except* BackendError as group:
                # The walk's or a fetch's (inside the walk's nursery): one line, the first.
                exc = first_leaf(group)
                h.state, h.error = "error", str(exc)
                log.error("prefetch of mount %s stopped: %s", h.mount_id, exc)
        h.running = False
        if h.scope.cancelled_caught and h.state == "running":
            h.state = "cancelled"
        h.finished = time.monotonic()
        # A sampler's pieces end and restart the walk often; replacing a hint cancels it.
        log.log(
            logging.DEBUG if h.state in ("done", "cancelled") else logging.INFO,
            "prefetch of mount %s %s: %s prefetched, %s hit, %d missed",
            h.mount_id,
            h.state,
            format_size(h.counters.bytes),
            count(h.counters.hit_chunks, "chunk"),
            h.counters.missed_chunks,
        )

    def _resolve(
        self, ds: DatasetState, keys: list[str], peer: tuple[int, frozenset[int]] | None, cs: int
    ) -> list[tuple[str, Any]]:
        """In a thread: for each key ("ok", (object, [(chunk, held by the dataset)])), or
        ("unknown", key) / ("denied", key). One read txn for listing and owners rows;
        for an untrusted peer of a local dataset, each object is checked as the peer
        (docs/SECURITY.md: a hint fetches only what its sender could read)."""
        d, found = self.d, []
        gen = ds.record.get("gen")
        if gen is None:
            gen = ds.building_gen
        with d.store.read_txn() as txn:
            listing = d.store.listing(ds.id, gen) if gen is not None else None
            for key in keys:
                e = listing.resolve(txn, key) if listing is not None else None
                obj: ObjectInfo | None = None if e is None else e.obj
                if obj is None:
                    found.append(("unknown", key))
                    continue
                refs = [ChunkRef.of(obj, cs, i) for i in range(max(1, -(-obj.size // cs)))]
                held = [(r, d.store.owns(txn, ds.id, r.key)) for r in refs]
                found.append(("ok", (obj, held)))
        check = getattr(ds.backend, "check_peer_read", None)
        if peer is None or ds.uri.scheme != "file" or check is None:
            return found
        out: list[tuple[str, Any]] = []
        for kind, item in found:
            if kind == "ok":
                try:
                    check(item[0], *peer)
                except (AccessDeniedError, BackendError, OSError):
                    out.append(("denied", item[0].key))
                    continue
            out.append((kind, item))
        return out

    async def _walk(self, h: Hint) -> None:
        d = self.d
        ds: DatasetState | None = d.datasets.get(h.dsid)
        if ds is None:
            return
        limiter = d.job(h.job).limiter
        slots = trio.Semaphore(concurrency(d.settings.fetch_threads))
        budget = h.budget = FillBudget(d, ds.id)
        failure: list[BackendError] = []
        lru = d.modes.get(ds.uri.canonical) == "lru"

        async def fetch(ref: ChunkRef, chunk: _Chunk) -> None:
            data = b""
            try:
                data, fetched = await d.fetcher.fetch(ds.id, ds.backend, limiter, ref)
            except BackendError as exc:
                # One object that changed or went is the reader's EIO, not the end of the
                # hint; a store that keeps failing is (MAX_ERRORS).
                h.errors += 1
                for fc in (ds.fetch, d.job(h.job).fetch):
                    fc.errors += 1
                if h.errors == 1:
                    log.warning("prefetch of mount %s: %s", h.mount_id, exc)
                if h.errors >= MAX_ERRORS:
                    failure.append(exc)
                return
            finally:
                budget.ended(ref.length, len(data))
                slots.release()
            if fetched:
                job = d.job(h.job)
                for c in (h.counters, h.job_counters):
                    c.bytes += len(data)
                    c.chunks += 1
                for fc in (ds.fetch, job.fetch):
                    fc.remote_gets += 1
                    fc.remote_bytes += len(data)

        async def fits(length: int) -> bool:
            """Whether the dataset would admit `length` more bytes (promise 1)."""
            if lru:  # admission evicts the least recently used; window() keeps it off ours
                return length <= budget.quota()
            return await budget.fits(length)

        def window() -> int:
            return min(h.window, budget.quota()) if lru else h.window

        await self._steps(h, ds, fetch, fits, failure, slots, budget, window)
        if failure:
            raise failure[0]

    def _held_now(self, dsid: int, key: bytes) -> bool:
        """Whether the dataset holds the chunk, or it waits in the Writer's queue."""
        if self.d.writer.pending(key) is not None:
            return True
        return self.d.store.holds(dsid, key)

    async def _steps(
        self,
        h: Hint,
        ds: DatasetState,
        fetch: Callable[[ChunkRef, _Chunk], Awaitable[None]],
        fits: Callable[[int], Awaitable[bool]],
        failure: list[BackendError],
        slots: trio.Semaphore,
        budget: FillBudget,
        window: Callable[[], int],
    ) -> None:
        """The walk itself: resolve the next paths, start the fetches the window and
        the dataset's quota allow, in hinted order."""
        d = self.d
        async with trio.open_nursery() as nursery:
            while h.paths and not failure:
                batch = [h.paths.popleft() for _ in range(min(RESOLVE_BATCH, len(h.paths)))]
                h.walked += len(batch)
                resolved = await trio.to_thread.run_sync(
                    self._resolve, ds, batch, h.peer, h.chunk_size, limiter=d.fetcher.threads
                )
                for kind, item in resolved:
                    if kind == "unknown":
                        h.unknown += 1
                        continue
                    if kind == "denied":
                        h.denied += 1
                        continue
                    obj, chunks = item
                    start = h.front
                    h.front += obj.size
                    if h.front <= h.position:
                        h.behind += 1
                        continue
                    for ref, is_held in chunks:
                        end = start + ref.start + ref.length
                        if end <= h.position:
                            continue
                        if is_held:
                            h.cached_bytes += ref.length
                            continue
                        # The window: wait until the reader catches up.
                        while h.ahead_bytes and h.ahead_bytes + ref.length > window():
                            h.waiting = True
                            await h.moved.wait()
                        h.waiting = False
                        if end <= h.position:
                            continue
                        if failure:
                            break
                        # Resolved a batch ago: the reader's own miss may have fetched it
                        # since (its position is reported only every 250 ms).
                        if self._held_now(ds.id, ref.key):
                            h.cached_bytes += ref.length
                            continue
                        if not await fits(ref.length):
                            h.state = "full"
                            log.info(
                                "prefetch of mount %s stops: %s is full (its quota %s)",
                                h.mount_id,
                                ds.uri.canonical,
                                format_size(budget.quota()),
                            )
                            h.paths.clear()
                            return
                        # Kept only for objects with a chunk ahead: bounded by the window.
                        h.starts.setdefault(obj.key, (start, start + obj.size))
                        chunk = _Chunk(obj.key, ref.index, end, ref.length)
                        h.ahead.append(chunk)
                        h.by_chunk[(obj.key, ref.index)] = chunk
                        h.ahead_bytes += ref.length
                        await slots.acquire()
                        budget.started(ref.length)
                        nursery.start_soon(fetch, ref, chunk)


__all__ = ["MAX_HINT_PATHS", "MAX_HINT_PENDING", "Hint", "Prefetcher"]
