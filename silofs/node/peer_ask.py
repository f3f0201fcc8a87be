"""A mount's miss of a chunk homed at another member, asked from the mount connection's
thread: the exchange with the home, its check and the answer to the mount without a
trip through the trio loop.

Owns that thread's side of the asking path (node/cluster.py owns the loop's), the
record of a miss served through the cluster that both sides give their readers
(PeerRead), and the decision, made from the daemon's state as it reads now (the
listing, the chunk's home and whether it is up, the job's limiter, the dataset's
options), to ask here at all;
the flights of chunks asked from threads, which the loop's askers of the same chunk
join (one ask per chunk however many readers wait); the per-member exchange slots both
sides share (MemberSlots: at most PEER_POOL exchanges, so connections, per member); and
handing the miss back to the loop when the answer is anything but a verified chunk
(a failure: counted there and the member marked down first, Cluster.ask_failed; a
charge, a dataset to introduce): the loop's handler then reads it as it would have.
Asks here only what the loop would ask the same way: a job without a rate (charged up
front), no hint to tell, no copy to keep, no refetch. Never changes the loop's state
itself (counters under membership.COUNTS), never serves a byte the check did not pass.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import lmdb
import trio

from silofs import trace
from silofs.cache.format import ChunkRef
from silofs.errors import VersionMismatchError
from silofs.node.datasets import Purpose, named_object
from silofs.node.membership import COUNTS, MemberState
from silofs.node.peer_client import PEER_POOL, Abandoned, Bounds, PeerError
from silofs.node.peer_wire import SOURCE_HEADER, ChunkAsk, answer_source, most_value_bytes
from silofs.records import ObjectInfo
from silofs.sealed import Region

if TYPE_CHECKING:
    from silofs.node.state import DatasetState, MountState

log = logging.getLogger(__name__)

_MAX_OBJECTS = 16384  # ThreadAsks.objects' entries (emptied when full)
# More header than a short chunk's value has, in a full chunk's: its blocks' sums (8
# bytes per 64 KiB block, cache/format.py: 8 KiB for a 64 MiB chunk), with room to spare.
_SUMS_ROOM = 16 << 10


@dataclass
class PeerRead:
    """A miss served through the cluster: the bytes (verified), where they came from
    ("cache": a member's cache, no store GET for it; "shared": a store GET the home
    made a moment before for another asker, no hit; "remote": a store GET made for it,
    by its home or, after a failure, by this node: peer_wire.answer_source), and the
    bytes of that GET charged to the job (0 if none)."""

    data: bytes | bytearray | memoryview
    source: str
    charged: int = 0
    fallback: bool = False  # read from the store by this node after a member failed


class MemberSlots:
    """The exchanges with one member at once, taken by the loop's tasks (acquire) and
    by connection threads (try_acquire, which never waits: the loop asks instead)."""

    def __init__(self, token: Any = None, size: int = PEER_POOL) -> None:
        self.free = size
        self.lock = threading.Lock()
        self.waiters: list[trio.Event] = []
        self.token = token  # set once the loop runs (Cluster.probe_loop)

    def try_acquire(self) -> bool:
        with self.lock:
            if self.free > 0:
                self.free -= 1
                return True
            return False

    async def acquire(self) -> None:
        while True:
            with self.lock:
                if self.free > 0:
                    self.free -= 1
                    return
                event = trio.Event()
                self.waiters.append(event)
            await event.wait()

    def release(self, *, on_loop: bool) -> None:
        # Every waiter is woken (one may have been cancelled meanwhile): they take turns.
        with self.lock:
            self.free += 1
            waiters, self.waiters = self.waiters, []
        for event in waiters:
            if on_loop:
                event.set()
            elif self.token is not None:
                self.token.run_sync_soon(event.set)


@dataclass
class ThreadFlight:
    """A chunk asked from a connection thread. Pending while the thread asks; then
    finished (with the chunk, or nothing: the loop asks itself), or failed: the member's
    answer failed and the chunk is to be read from the store, by the first of the loop's
    readers to find it so (lead_fallback)."""

    key: bytes
    # Set on the loop when the state changes (a failure replaces it with a fresh one).
    done: trio.Event = field(default_factory=trio.Event)
    finished: bool = False
    value: PeerRead | None = None
    failure: PeerError | None = None
    address: str = ""  # the member whose answer failed
    led: bool = False  # a loop task reads it from the store
    waiters: int = 0  # the loop's tasks waiting for it
    # The loop's tasks that found it (Cluster.read, under the lock), waiting or about to:
    # its value must then be bytes of their own, not a view of a connection's region.
    joined: int = 0


class ThreadAsks:
    """The asks made from connection threads, and the flights the loop joins."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster  # the Daemon's Cluster (node/cluster.py imports this module)
        self.lock = threading.Lock()  # the flights, and the loop's claims on its own
        self.flights: dict[bytes, ThreadFlight] = {}
        self.token: Any = None  # the loop's (Cluster.probe_loop): None, threads never ask
        # Objects the threads found in a dataset's current listing generation, by
        # (dataset id, generation, key), with the DatasetState they were found through
        # (weakly: a forgotten dataset, and its store client, is not kept alive here):
        # a complete generation's rows never change (a relist writes the next one), so
        # a row found once is the row named_object would find again while that state's
        # record names that generation. Saves the listing's path walk (its LMDB look-ups
        # and decoding: ~50 us of a connection thread's CPU per chunk on a busy host).
        self.objects: dict[tuple[int, int, str], tuple[weakref.ref, ObjectInfo]] = {}

    # -- the loop's side -----------------------------------------------------------------
    def lead_fallback(self, key: bytes) -> ThreadFlight | None:
        """Under the lock: the failed flight of `key` for the caller to read from the store
        (then finish()), if nobody does yet."""
        flight = self.flights.get(key)
        if flight is None or flight.failure is None or flight.led:
            return None
        flight.led = True
        return flight

    async def wait(self, flight: ThreadFlight) -> PeerRead | None:
        """On the loop: the flight's outcome once it changes state; None if it has none
        (yet: the caller looks again, and asks itself if it is gone)."""
        with self.lock:
            pending = not flight.finished and (flight.failure is None or flight.led)
            if pending:
                flight.waiters += 1
                event = flight.done
        if pending:
            await event.wait()
        return flight.value

    def finish(self, flight: ThreadFlight, got: PeerRead | None) -> None:
        """On the loop: the chunk a failed flight's leader read (None: it read nothing,
        its waiters ask themselves). They count no store GET: the leader did."""
        with self.lock:
            self.flights.pop(flight.key, None)
            flight.value = dataclasses.replace(got, charged=0) if got is not None else None
            flight.finished = True
        flight.done.set()

    # -- the thread's side ---------------------------------------------------------------
    def read(
        self,
        ds: DatasetState,
        m: MountState,
        key: str,
        index: int,
        version: str | None,
        gone: Callable[[], bool] | None = None,
        region: Region | None = None,
    ) -> PeerRead | None:
        """From a mount connection's thread: the chunk, asked of its home and checked;
        None if the loop is to serve this miss (its handler then reads it as it would
        have: joining a flight, asking itself, or reading the store). `gone`: whether
        the mount has closed its connection; then the exchange is abandoned (the home
        sees its connection close and stops) and None returned. `region`: the mount
        connection's hand-off region (silofs/sealed.py), which the answer is received
        into and checked in where it can be: the PeerRead's data is then a view of it,
        valid until this connection's next request."""
        c = self.cluster
        d = c.d
        config, membership = c.config, c.membership
        if self.token is None or config is None or membership is None:
            return None
        if config.keep_peer_copies or not c.shareable(ds) or m.id in d.prefetch.hints:
            return None
        job = d.jobs.get(m.job)
        if job is None or job.limiter.rate is not None:
            return None  # a rated job is charged only on the home's 428: the loop's
        obj = self._named(ds, key, version)
        if obj is None or not 0 <= index <= max(0, (obj.size - 1) // m.chunk_size):
            return None
        ref = ChunkRef.of(obj, m.chunk_size, index)
        try:
            member = membership.home(ref.key)
        except KeyError:  # the loop put a new member list in force meanwhile
            return None
        pool, slots = c.pools.get(member.address), c.slots.get(member.address)
        if member.is_self or not member.up or pool is None or slots is None:
            return None
        if self._cached_here(ref):
            return None  # from before a member change: the loop serves it from here
        flight = self._claim(ref.key)
        if flight is None:
            return None
        if not slots.try_acquire():
            self._hand_over(flight, member, ds, ref, None)
            return None
        try:  # _exchange gives the slot back
            return self._exchange(flight, member, pool, slots, ds, m, ref, config, gone, region)
        except Abandoned:  # the mount left: no failure of the member's
            log.debug("ask of %s for a mount that left: abandoned", member.address)
            self._hand_over(flight, member, ds, ref, None)
            return None
        except PeerError as exc:
            self._hand_over(flight, member, ds, ref, exc)
            return None
        except BaseException:
            self._hand_over(flight, member, ds, ref, None)
            raise

    def _named(self, ds: DatasetState, key: str, version: str | None) -> ObjectInfo | None:
        """named_object's answer for a read of `key` (None: the loop decides, errors
        included), from self.objects where it holds the current generation's row."""
        gen = ds.record.get("gen")
        hit = self.objects.get((ds.id, gen, key)) if gen is not None else None
        if hit is not None and hit[0]() is ds and (version is None or hit[1].version == version):
            return hit[1]
        building = ds.building_gen
        try:
            named = named_object(self.cluster.d.store, ds, key, Purpose.READ, version)
        except (VersionMismatchError, lmdb.Error):
            return None
        if named is None:
            return None
        # Only a row of the current generation (not one being built, not the previous
        # one's), as of before and after the look-up.
        current = building is None and ds.building_gen is None and ds.record.get("gen") == gen
        if gen is not None and current and not named.previous:
            if len(self.objects) >= _MAX_OBJECTS:
                self.objects.clear()
            self.objects[(ds.id, gen, key)] = (weakref.ref(ds), named.obj)
        return named.obj

    def _cached_here(self, ref: ChunkRef) -> bool:
        """Whether the chunks db has the key. Only the key is looked up: set_key reads
        B-tree pages and the value's first page, all below the txn's last page, so inside
        data.mdb (cache/bounds.py); the value is never touched here, so it needs no
        bounds (whose fstat, a system call that lets the other connection threads take
        the GIL, would cost more than the look-up)."""
        store = self.cluster.d.store
        with store.read_txn() as txn:
            try:
                return txn.cursor(db=store.db(b"chunks")).set_key(ref.key)
            except lmdb.Error:
                return True  # the loop's lookup counts it

    def _claim(self, key: bytes) -> ThreadFlight | None:
        with self.lock:
            if key in self.flights or key in self.cluster.asks:
                return None  # the loop's handler joins it
            flight = self.flights[key] = ThreadFlight(key)
            return flight

    def _exchange(
        self,
        flight: ThreadFlight,
        member: MemberState,
        pool: Any,
        slots: MemberSlots,
        ds: DatasetState,
        m: MountState,
        ref: ChunkRef,
        config: Any,
        gone: Callable[[], bool] | None = None,
        region: Region | None = None,
    ) -> PeerRead | None:
        c = self.cluster
        dsc = c.dataset_counters(ds.uri.canonical)
        t0 = time.monotonic()
        try:  # the slot taken in read() is given back whatever happens here
            ask = ChunkAsk.of(ds.uri.canonical, ref, m.job, charged=True, warm=False)
            bounds = Bounds(config.peer_timeout_seconds, float(config.peer_floor_rate))
            check = functools.partial(c._verified, member, ref=ref)
            into = None
            if region is not None:  # one region for the mount's chunks, its short ones too
                least = most_value_bytes(ref) - ref.length + m.chunk_size + _SUMS_ROOM
                into = functools.partial(region.view, least=least)
            if trace.ON:
                trace.mark("ask:begin", trace.chunk_id(ask.key, ask.index))
            reply, data = pool.request_checked(
                "GET", ask.target(), bounds, b"", check, gone, most_value_bytes(ref), into
            )
            if trace.ON:  # the answer received and every block checked
                trace.mark("ask:checked", trace.chunk_id(ask.key, ask.index))
        finally:
            slots.release(on_loop=False)
            waited = time.monotonic() - t0
            with COUNTS:
                member.counters.wait_seconds += waited
                dsc.wait_seconds += waited
        if reply.status != 200 or data is None:
            self._hand_over(flight, member, ds, ref, None)  # the loop asks again
            return None
        source = answer_source(reply.headers.get(SOURCE_HEADER))
        with COUNTS:
            for counters in (member.counters, dsc):
                counters.requests_out += 1
                counters.bytes_in += len(reply.body)
        got = PeerRead(data, source, ref.length if source == "remote" else 0)
        if source == "remote":  # the home's GET was for this job: counted on the loop
            self.token.run_sync_soon(_logged, c.count_remote, ds, m, ref.length)
        with self.lock:  # its waiters count no GET: count_remote did, for this mount
            self.flights.pop(flight.key, None)  # found by nobody else from here on
            if type(reply.body) is not memoryview:
                flight.value = PeerRead(data, source)
            elif flight.joined:  # the region is this connection's next answer's
                flight.value = PeerRead(bytes(data), source)
            flight.finished = True
            waiters = flight.waiters
        if waiters:
            self.token.run_sync_soon(flight.done.set)
        return got

    def _hand_over(
        self,
        flight: ThreadFlight,
        member: MemberState,
        ds: DatasetState,
        ref: ChunkRef,
        failure: PeerError | None,
    ) -> None:
        """Nothing served from here. A failure is counted on the loop (ask_failed: the
        member marked down if it is its own) and the flight left failed, for the loop's
        first reader of the chunk (this thread's request, in its handler) to read it from
        the store: run_sync_soon keeps that order. Anything else ends the flight with no
        outcome: its waiters, and the handler, ask again there."""
        with self.lock:
            wake = flight.done
            if failure is None:
                self.flights.pop(flight.key, None)
                flight.finished = True
            else:
                flight.failure, flight.address = failure, member.address
                flight.done = trio.Event()
            waiters = flight.waiters
        try:
            if failure is not None:
                self.token.run_sync_soon(_logged, self.cluster.ask_failed, member, ds, ref, failure)
            if waiters:
                self.token.run_sync_soon(wake.set)
        except trio.RunFinishedError:
            pass


def _logged(fn: Any, *args: Any) -> None:
    """fn(*args) as a callback a thread hands the loop (run_sync_soon): an exception is
    logged here, since raised from such a callback it would end the daemon's loop."""
    try:
        fn(*args)
    except Exception:
        log.exception("counting a peer exchange on the loop failed")
