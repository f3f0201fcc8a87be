"""The node's one LMDB writer: admission, eviction, and every other write txn.

Owns the Writer: the only code that opens LMDB write txns, batching admissions into
large txns from one thread and carrying out the quota policy (silofs/node/quota.py) on
them. Never decides quotas, never fetches and never serves reads; a full queue drops an
admission (the chunk is admitted on a later miss) rather than slow a reader down.

Admission holds its queue while streamed offers keep coming (a cold read streaming in:
chunks of GETs that each cover several; any other offer ends the hold): it writes
once they pause for batch_seconds, once the queue is within one batch (batch_bytes, at
most half the queue) of its bound, or HOLD_SECONDS (at least batch_seconds) after the
first offer it holds, whichever comes first, in txns of at most batch_bytes each. Its
writes (LMDB's copy of every value, then the page cache's) then run after the reads,
not beside them on the same cores; the queue's bound (admission_queue_bytes) is the
memory this takes, as before, and the batch left free is room for what arrives before
the write begins (the queue is empty again once it has), so holding drops nothing.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import trio

from silofs import heap
from silofs.cache.format import Buffer
from silofs.cache.store import Usage
from silofs.node.lru_index import LruIndex
from silofs.node.quota import QuotaPolicy
from silofs.node.store_write import AdmitResult, PendingChunk, WritableStore
from silofs.node.supervise import describe
from silofs.units import count

log = logging.getLogger(__name__)

T = TypeVar("T")

# The nice value of the thread that admits chunks (_AdmitThread). Admission copies every
# fetched byte twice more (into LMDB's pages, then into the page cache) on the path of a
# cold read: at a lower priority it runs on what the readers leave (a cold 256 MiB read
# on moto 146 -> 178 MB/s, docs/RESULTS.md 2026-11-27); its queue
# (admission_queue_bytes) holds what it has not written yet.
ADMIT_NICE = 10
# The longest admission holds its queue while offers keep coming (module docstring),
# from the first offer held: what a kill -9 of the daemon may cost in refetches.
HOLD_SECONDS = 5.0
# After admitting, the daemon keeps its freed chunk buffers for the next cold read
# (silofs/heap.py) until no offer came for this long, then gives them back.
IDLE_GIVE_BACK_SECONDS = 10.0


@dataclass
class WriterStats:
    admitted_chunks: int = 0
    admitted_bytes: int = 0
    rejected_chunks: int = 0  # over the dataset's quota
    dropped_chunks: int = 0  # queue full
    damaged_chunks: int = 0  # their key's LMDB node is damaged
    map_full_chunks: int = 0  # offered in a batch that hit the map's size
    evicted_bytes: int = 0
    batches: int = 0
    map_full: int = 0
    failed_batches: int = 0  # a batch's txn raised (a full disk, an I/O error)
    # The last batch's failure in one line, cleared by the next batch committed: status
    # shows why the cache stopped filling (a full disk), not only the daemon's log.
    error: str | None = None


def _newest_that_fit(items: list[PendingChunk], quota: int) -> set[int]:
    """ids of the most recently fetched items (last in the batch) that fit in `quota`."""
    kept: set[int] = set()
    room = quota
    for item in reversed(items):
        if item.data_len <= room:
            kept.add(id(item))
            room -= item.data_len
    return kept


class _AdmitThread:
    """One thread, ADMIT_NICE below the daemon's priority, that runs admission batches
    for the trio loop (a worker of trio's cache would keep the nice value for whatever
    it runs next, and only a privileged process may lower it again). Started on first
    use."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def _serve(self) -> None:
        # ADMIT_NICE below the daemon's own priority, whatever that is: an absolute value
        # would put admission level with a daemon started at nice 10, and above one
        # started at 15 (when run as root, which may raise a priority).
        me = threading.get_native_id()
        try:
            os.setpriority(
                os.PRIO_PROCESS, me, min(19, os.getpriority(os.PRIO_PROCESS, me) + ADMIT_NICE)
            )
        except OSError as exc:
            log.info("admission runs at the daemon's priority: %s", exc)
        while (job := self._jobs.get()) is not None:
            job()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in the thread; like trio.to_thread.run_sync, a cancellation waits
        for it to finish (a write txn is never left half done)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="silofs-admit", daemon=True)
            self._thread.start()
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        out: list[tuple[bool, Any]] = []

        def job() -> None:
            try:
                out.append((True, fn(*args)))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting task
                out.append((False, exc))
            token.run_sync_soon(done.set)

        self._jobs.put(job)
        with trio.CancelScope(shield=True):
            await done.wait()
        ok, value = out[0]
        if not ok:
            raise value
        await trio.lowlevel.checkpoint_if_cancelled()
        return value  # type: ignore[no-any-return]

    def stop(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None


class Writer:
    """Serialises every LMDB write of the node in one thread at a time."""

    def __init__(
        self,
        store: WritableStore,
        usage: dict[int, Usage],
        policy: Callable[[], QuotaPolicy],
        *,
        batch_bytes: int,
        batch_seconds: float,
        queue_bytes: int,
        sync_seconds: float,
    ) -> None:
        self.store = store
        self.lru = LruIndex(store)
        self.usage = usage  # owned by the trio loop; replaced after each write
        self.policy = policy
        self.batch_bytes = batch_bytes
        self.batch_seconds = batch_seconds
        self.queue_bytes = queue_bytes
        self.sync_seconds = sync_seconds
        self.stats = WriterStats()
        self._queue: list[PendingChunk] = []
        self._queued = 0
        # Offered chunks by key until their batch is committed (or refused): a miss on
        # one in that gap (a reader right behind a prefetch) is served from here rather
        # than fetched again (fetch.py Fetcher.cached).
        self._pending: dict[bytes, PendingChunk] = {}
        self._streaming = False  # the last offer was one of a stream's chunks (_hold)
        self._wakeup = trio.Event()
        self._settled = trio.Event()  # set (and made anew) whenever offers leave _pending
        self._lock = trio.Lock()  # one write txn at a time, in one thread
        self._admit_thread = _AdmitThread()

    def offer(self, item: PendingChunk) -> bool:
        """Queue a chunk for admission; False (and counted) when the queue is full."""
        if self._queued + len(item.value) > self.queue_bytes:
            self.stats.dropped_chunks += 1
            return False
        self._queue.append(item)
        self._queued += len(item.value)
        self._pending[item.key] = item
        self._streaming = item.streamed
        self._wakeup.set()
        return True

    def pending_chunks(self) -> int:
        """Chunks offered and not yet committed (or refused): 0 once every offer so far
        is in LMDB or was turned away."""
        return len(self._pending)

    def pending(self, key: bytes) -> bytes | Buffer | None:
        """The encoded value of a chunk offered and not yet committed, if there is one."""
        item = self._pending.get(key)
        return None if item is None else item.value

    async def settled(self, key: bytes) -> None:
        """Return once no offer of `key` waits to be committed: it is in LMDB, or was
        turned away (over its dataset's quota, or dropped)."""
        while key in self._pending:
            await self._settled.wait()

    def _note_settled(self) -> None:
        self._settled.set()
        self._settled = trio.Event()

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        """Run a write operation in the writer thread, serialised with admissions."""
        async with self._lock:
            return await trio.to_thread.run_sync(fn, *args)

    def close(self) -> None:
        """End the admission thread (after the last flush)."""
        self._admit_thread.stop()

    async def with_usage(self, fn: Callable[..., T], *args: object) -> T:
        """Run a write that changes accounting (an eviction, the stand-in sweep of
        node/standins.py) in a worker thread, serialised with admissions; fn gets the
        usage copy as its last argument."""
        return await self._with_usage(fn, *args)

    async def _with_usage(self, fn: Callable[..., T], *args: object, admission: bool = False) -> T:
        """Like call(), for writes that change accounting: fn gets a private copy of
        the usage taken under the lock, and the copy becomes the truth once committed.
        `admission`: in the admission thread, at its lower priority."""
        async with self._lock:
            usage = {k: Usage(v.bytes, v.chunks) for k, v in self.usage.items()}
            try:
                if admission:
                    result = await self._admit_thread.run(fn, *args, usage)
                else:
                    result = await trio.to_thread.run_sync(fn, *args, usage)
            except BaseException:
                # fn may have committed some txns before it failed (eviction works in
                # several); the copy may also hold changes of an aborted txn. The usage
                # rows are the committed truth, and cheap to read.
                usage = self.store.load_usage()
                raise
            finally:
                self.usage.clear()  # in place: other components hold this dict
                self.usage.update(usage)
            return result

    async def run(self) -> None:
        """The admission loop. The daemon runs it and sync_loop() under supervision
        (node/supervise.py): a failed batch is logged and the loop restarted."""
        wrote = False
        while True:
            with trio.move_on_after(IDLE_GIVE_BACK_SECONDS) as idle:
                await self._wakeup.wait()
            if idle.cancelled_caught:
                if wrote:  # the buffers of what it admitted, kept meanwhile
                    await trio.to_thread.run_sync(heap.give_back)
                    wrote = False
                continue
            await self._hold()
            await self.flush()
            wrote = True

    async def _hold(self) -> None:
        """Let a batch build up. Streamed offers (module docstring): wait while they keep
        coming, until none came for batch_seconds, the queue is within one batch of its
        bound, or HOLD_SECONDS passed. Others: one txn per batch_seconds or batch_bytes,
        not one per chunk."""
        if not self._streaming:
            # Random misses (small files, other members' chunks) are not held longer:
            # a held queue serves them as hits, a cache beyond their allocation.
            with trio.move_on_after(self.batch_seconds):
                while self._queued < self.batch_bytes:
                    self._rearm()
                    await self._wakeup.wait()
            return
        hold_bytes = self.queue_bytes - min(self.batch_bytes, self.queue_bytes // 2)
        with trio.move_on_after(max(HOLD_SECONDS, self.batch_seconds)):
            while self._streaming and self._queued < hold_bytes:
                self._rearm()
                with trio.move_on_after(self.batch_seconds) as quiet:
                    await self._wakeup.wait()
                if quiet.cancelled_caught:
                    return

    def _rearm(self) -> None:
        """Make the next wait for an offer block until one comes. Only a wakeup already
        set is replaced: the run loop may be waiting on the current one, and a flush
        from another task (a warm's, a fill budget's) that replaced it left the loop
        waiting on an event no offer sets any more, so admissions stalled until
        IDLE_GIVE_BACK_SECONDS (~10 s) while offers piled up in memory."""
        if self._wakeup.is_set():
            self._wakeup = trio.Event()

    async def flush(self) -> None:
        """Write everything queued, in txns of at most batch_bytes (and one chunk), and
        return once what another flush was writing when this one began (the run loop's
        batch, taken from the queue before this call) is settled too: every offer made
        before the call is then in LMDB or turned away, which is what a caller flushing
        asks (a warm saying done, a fill budget's exact count)."""
        # Taken before ours is written: those not in our batch are in another flush's.
        before = list(self._pending.items())
        batch, self._queue, self._queued = self._queue, [], 0
        self._rearm()
        await self._write(batch)
        # Another flush writes its batch without waiting on this one: no cycle.
        for key, item in before:
            while self._pending.get(key) is item:
                await self._settled.wait()

    async def _write(self, batch: list[PendingChunk]) -> None:
        while batch:
            size, n = 0, 0
            while n < len(batch) and (n == 0 or size + len(batch[n].value) <= self.batch_bytes):
                size += len(batch[n].value)
                n += 1
            part, batch = batch[:n], batch[n:]
            try:
                full = await self._flush_part(part)
            except BaseException as exc:
                self._forget(batch, "dropped_chunks")  # never written: said so
                if isinstance(exc, Exception):  # not a cancellation
                    self.stats.failed_batches += 1
                    self.stats.error = describe(exc, where=False)
                raise
            if self.stats.error is not None:  # its failure was an ERROR line: so is this
                log.info("the writer admits again (a batch committed after: %s)", self.stats.error)
            self.stats.error = None
            if full:  # the rest would not fit either (one warning, as for one txn)
                self._forget(batch, "map_full_chunks")
                return

    def _forget(self, items: list[PendingChunk], counter: str) -> None:
        setattr(self.stats, counter, getattr(self.stats, counter) + len(items))
        self._settle(items)

    def _settle(self, items: list[PendingChunk]) -> None:
        """These offers leave _pending (a newer offer of the same key stays)."""
        for item in items:
            if self._pending.get(item.key) is item:
                del self._pending[item.key]
        self._note_settled()

    async def _flush_part(self, batch: list[PendingChunk]) -> bool:
        """Admit one txn's worth; whether the map was full."""
        policy = self.policy()
        try:
            res: AdmitResult = await self._with_usage(
                self._admit_batch, batch, policy, admission=True
            )
        finally:
            self._settle(batch)  # committed (or refused): LMDB answers from now on
        self.stats.batches += 1
        self.stats.admitted_chunks += res.admitted
        self.stats.admitted_bytes += res.admitted_bytes
        self.stats.rejected_chunks += res.rejected
        self.stats.damaged_chunks += res.damaged
        self.stats.map_full_chunks += res.unplaced
        self.stats.map_full += int(res.full)
        return res.full

    def _admit_batch(
        self, batch: list[PendingChunk], policy: QuotaPolicy, usage: dict[int, Usage]
    ) -> AdmitResult:
        """In the writer thread. LRU datasets make room by evicting their least recently
        used chunks; uniform datasets admit only what fits (promise 1)."""
        lru_ds = {i.dataset for i in batch if i.dataset in policy.lru}
        dropped = 0
        pooled = {d for d in lru_ds if d not in policy.allocations}
        if pooled:
            batch, dropped = self._admit_pooled_lru(batch, pooled, policy, usage)
        for dsid in lru_ds - pooled:
            quota = policy.quota(dsid, usage)
            kept = _newest_that_fit([i for i in batch if i.dataset == dsid], quota)
            dropped += sum(1 for i in batch if i.dataset == dsid) - len(kept)
            batch = [i for i in batch if i.dataset != dsid or id(i) in kept]
            target = quota - sum(i.data_len for i in batch if i.dataset == dsid)
            if usage.get(dsid, Usage()).bytes > target:
                self.stats.evicted_bytes += self.lru.evict_oldest(dsid, target, usage)
        res = self.store.admit(batch, usage, policy.quota)
        res.rejected += dropped
        for dsid in lru_ds:
            self.lru.touch(dsid, [i.key for i in batch if i.dataset == dsid])
        return res

    def _admit_pooled_lru(
        self,
        batch: list[PendingChunk],
        pooled: set[int],
        policy: QuotaPolicy,
        usage: dict[int, Usage],
    ) -> tuple[list[PendingChunk], int]:
        """LRU datasets without an allocation are one LRU over what the shared pool
        leaves them (the pool minus what its uniform datasets hold): room for the batch
        is made by evicting the chunks used least recently by any of them, so a dataset
        read often holds more than one read rarely (Alluxio; the simulator's sim_lru).
        Returns the batch without what cannot fit at all, and how many were dropped."""
        members = {d for d in policy.lru if d not in policy.allocations} | pooled
        shared = policy.cache_size - sum(policy.allocations.values())
        uniform = sum(
            u.bytes for d, u in usage.items() if d not in policy.allocations and d not in members
        )
        room = max(0, shared - uniform)
        mine = [i for i in batch if i.dataset in pooled]
        kept = _newest_that_fit(mine, room)
        out = [i for i in batch if i.dataset not in pooled or id(i) in kept]
        incoming = sum(i.data_len for i in mine if id(i) in kept)
        held = sum(usage.get(d, Usage()).bytes for d in members)
        if held + incoming > room:
            self.stats.evicted_bytes += self.lru.evict_oldest_among(
                members, held + incoming - room, usage
            )
        return out, len(mine) - len(kept)

    async def touch(self, dsid: int, keys: list[bytes]) -> None:
        """Record hits of an LRU dataset reported by a mount."""
        await self.call(self.lru.touch, dsid, keys)

    async def shrink(self, dsid: int, target: int, lru: bool = False) -> int:
        """Evict chunks of `dsid` (random, or least recently used) until it fits `target`."""
        evict = self.lru.evict_oldest if lru else self.store.evict_random
        freed: int = await self._with_usage(evict, dsid, target)
        self.stats.evicted_bytes += freed
        if freed:
            log.info("evicted %s of dataset %d to fit %d", count(freed, "byte"), dsid, target)
        return freed

    async def sync_loop(self) -> None:
        while True:
            await trio.sleep(self.sync_seconds)
            await self.call(self.store.sync)
