"""The home's side of the peer routes: serving a chunk a member asks for, from this
node's cache, its Writer's queue, a store GET already in flight, or one store GET after
the asker charged its job.

Owns what a home does with a member's chunk request (node/peer_wire.py ChunkAsk): the
dataset it names (one this node has open, or one a member introduced, opened backend
only: no listing; a local directory only if this node has it open and lists the object
at that version), the lookup (verified before a byte leaves: a damaged value here is a
miss, refetched and replaced), the charge protocol (no new store GET until the asker
says it charged its job: ChargeFirst, answered 428), one store GET per chunk however
many members ask (the Fetcher's single-flight), admission under this node's part of
the dataset's share (the Writer, with the quota policy), a warm's "held / admitted /
full" (the room a FillBudget sees; "admitted" once committed), and the cap on bytes
served to peers (peer_serve_rate, waited for before the answer: the asker hears 102
meanwhile; an ask that would wait on it longer than peer_timeout_seconds is answered
busy at once, ServeBusy, 429, and read from the store by the asker). A chunk held here
is answered from the member connection's thread (held(): its value checked and sent
from the LMDB map, in one read txn kept open until the answer is sent), the rest on
the trio loop (serve()). Never judges who asks (the route table and node/authz.py do)
and never writes LMDB itself.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import lmdb
import trio

from silofs.cache.format import (
    ChunkFormatError,
    ChunkRef,
    checked_chunk,
    encode_chunk,
    verify_chunk,
)
from silofs.errors import UsageError, VersionMismatchError
from silofs.node.backends import open_backend
from silofs.node.datasets import Purpose, named_object
from silofs.node.fill_budget import FillBudget
from silofs.node.limiter import TokenBucket
from silofs.node.peer_wire import PEER_OPTIONS, ChunkAsk
from silofs.node.state import DatasetState
from silofs.uri import parse_uri

log = logging.getLogger(__name__)

# Lookups of large chunk values for members at once (each faults in up to a chunk's
# pages in a worker thread, so the trio loop never waits on the SSD for them).
LOOKUP_THREADS = 4
# A chunk up to this size is looked up, checked and copied on the loop, as the Fetcher
# does for a mount's miss: ~0.1 ms for 128 KiB, against ~1 ms for the round trip to a
# worker thread and back on a busy 2-core host. Larger ones go to a thread, so checking
# and copying many MiB (or faulting them in from the SSD) never stalls the loop.
INLINE_LOOKUP_BYTES = 1 << 20
# The state of a dataset a member introduced (opened backend only, no listing here).
PEER_STATE = "peer"
# Introduced datasets whose store client is kept between GETs, the most recently used:
# a client costs ~12 MB (an SDK session of its own), and members may introduce every
# dataset read anywhere in the cluster (300 with a GET each took a daemon from 76 MB to
# 3.9 GB). The others' clients are closed, and built again at their next GET.
LIVE_CLIENTS = 16
# Datasets members introduced, kept at most this many: the least recently introduced or
# served is forgotten first (its store client closed; named again, it is a 404 asking
# to introduce it anew), never one the cluster's share table names (at most 4,096:
# cluster_shares.MAX_SHARES), whose part this node admits under. Each costs ~3.4 KB and
# a row of every quota pass: a member introducing made-up URIs (s3://made-up-N/) grew a
# home without bound (5,000 of them: +17 MB).
MAX_INTRODUCED = 1024


class ChargeFirst(Exception):
    """Serving needs a new store GET and the asker has not charged its job: it must
    charge `nbytes` and ask again (428)."""

    def __init__(self, nbytes: int) -> None:
        super().__init__(f"charge {nbytes} bytes to the job first")
        self.nbytes = nbytes


class UnknownDataset(Exception):
    """The request names a dataset this node has neither open nor been introduced to."""


class ServeBusy(Exception):
    """The serve cap (peer_serve_rate) would hold this answer longer than askers wait
    for a first byte (429): the asker reads the chunk from the store at once."""


@dataclass
class Held:
    """A held chunk's checked value, lent from the LMDB map: valid until close(), which
    ends the read txn it lies in (called in the thread that called held()). While the
    txn is open, LMDB reuses none of its pages: the value sent is the one checked (bar
    something else writing data.mdb; the asker checks every block anyway)."""

    value: memoryview
    txn: lmdb.Transaction

    def close(self) -> None:
        self.txn.abort()


@dataclass
class Served:
    value: bytes | bytearray | None  # the encoded chunk (header + data); None for a warm
    # "cache": from this node's cache; "shared": no store GET for this ask, nor a hit:
    # the bytes of a GET made a moment before for another asker (in flight, or in the
    # Writer's queue); "remote": this ask's GET (peer_wire.answer_source)
    source: str
    outcome: str = "served"  # a warm: held | admitted | full | dropped (ask again)


class Home:
    """This node as the home of chunks. `d` is the Daemon (which imports the cluster
    modules, so it is not imported here)."""

    def __init__(self, d: Any, serve_rate: int | None) -> None:
        self.d = d
        self.serve_rate = serve_rate
        self._serve_cap: TokenBucket | None = None  # made in the trio loop, on first use
        # When the serve cap will have paid for every answer charged to it (trio clock):
        # its backlog, which a new answer waits behind. Past `serve_wait` of it a member's
        # ask is answered busy at once rather than after minutes of 102s (a cap of
        # 1 KiB/s held every ask for 60 s, then the member was taken for dead).
        self._cap_free_at = 0.0
        self.serve_wait = 2.0  # seconds: the cluster's peer_timeout_seconds
        self.datasets: dict[str, DatasetState] = {}  # introduced by members, not open here
        self._live: dict[str, DatasetState] = {}  # of those, the LIVE_CLIENTS last fetched for
        self.lookups = trio.CapacityLimiter(LOOKUP_THREADS)
        self.budgets: dict[int, FillBudget] = {}  # members' warms, per dataset
        self._budget_locks: dict[int, trio.Lock] = {}
        self._unlimited: TokenBucket | None = None

    # -- datasets ------------------------------------------------------------------
    def dataset(self, uri: str) -> DatasetState | None:
        """The dataset a member names: open here (its backend, its counters), or one a
        member introduced."""
        ds = self.d.catalog.find_dataset(uri) if "://" in uri else None
        if ds is not None and ds.uri.canonical == uri:
            return ds
        return self.datasets.get(uri)

    async def introduce(self, uri_text: str, options: dict[str, str]) -> DatasetState:
        """Open a dataset a member reads, backend only (no check, no listing): this node
        may fetch and admit its chunks. UsageError (403) for what a member may not name:
        a local directory this node does not have open (its files would be read as
        root), store options beyond PEER_OPTIONS."""
        uri = parse_uri(uri_text)
        bad = sorted(set(options) - PEER_OPTIONS)
        if bad:
            raise PermissionError(f"store option {bad[0]!r} is not taken from a member")
        known = self.dataset(uri.canonical)
        if known is not None:
            return known
        if uri.scheme == "file":
            raise PermissionError(
                f"{uri.canonical}: a local directory is served to members only while this "
                "node has it open itself"
            )
        dsid = await self.d.writer.call(lambda: self.d.store.dataset_id(uri.canonical, create=True))
        opts = self.d.catalog.backend_opts
        if options:
            opts = dataclasses.replace(opts, extra={**opts.extra, **options})
        backend = open_backend(uri, opts)
        ds = DatasetState(dsid, uri, f"peer-{dsid}", backend, state=PEER_STATE, options=options)
        self.datasets[uri.canonical] = ds
        log.info("opened %s for the cluster's members (backend only)", uri.canonical)
        self._forget_least_used()
        return ds

    def _used(self, ds: DatasetState) -> None:
        """An introduced dataset was served: the last to be forgotten (a connection
        thread's held() meanwhile may miss it for an instant: the loop serves it then)."""
        uri = ds.uri.canonical
        if ds.state == PEER_STATE and self.datasets.get(uri) is ds:
            del self.datasets[uri]
            self.datasets[uri] = ds

    def _forget_least_used(self) -> None:
        """Keep at most MAX_INTRODUCED introduced datasets, the share table's apart."""
        over = len(self.datasets) - MAX_INTRODUCED
        if over <= 0:
            return
        shared = self.d.cluster.shares.shares
        for uri in [u for u in self.datasets if u not in shared][:over]:
            ds = self.datasets.pop(uri)
            self._live.pop(uri, None)
            ds.backend.close()
            lock = self._budget_locks.get(ds.id)
            if lock is None or not lock.locked():  # a warm filling it keeps its budget
                self.budgets.pop(ds.id, None)
                self._budget_locks.pop(ds.id, None)
            # Its peer counters go with it (a row in status and /metrics each), unless
            # this node has it open itself.
            if self.d.catalog.find_dataset(uri) is None:
                self.d.cluster.forget_counters(uri)
            log.debug("forgot %s, introduced by the cluster's members", uri)

    def _fetching(self, ds: DatasetState) -> None:
        """An introduced dataset's client is about to be used: kept, and the least
        recently used one beyond LIVE_CLIENTS closed (a GET under way on it finishes on
        the connection it holds, or fails and is retried on a new client)."""
        if ds.state != PEER_STATE:
            return
        self._used(ds)
        uri = ds.uri.canonical
        self._live.pop(uri, None)
        self._live[uri] = ds
        if len(self._live) > LIVE_CLIENTS:
            oldest = next(iter(self._live))
            self._live.pop(oldest).backend.close()

    def close(self) -> None:
        for ds in self.datasets.values():
            ds.backend.close()
        self.datasets.clear()
        self._live.clear()

    # -- a chunk -------------------------------------------------------------------
    async def serve(self, ask: ChunkAsk) -> Served:
        """A member's chunk request; ChargeFirst (428), UnknownDataset (404),
        UsageError (409: not the object this node lists), BackendError (the store)."""
        ds = self.dataset(ask.uri)
        if ds is None:
            raise UnknownDataset(ask.uri)
        self._used(ds)
        ref = ask.ref()
        if ds.uri.scheme == "file":
            self._check_listed(ds, ask)
        if ask.warm:
            return await self._warm(ds, ask, ref)
        self._check_busy()  # before a lookup or a GET: neither is wasted on a busy answer
        value, bad = await self._lookup(ds, ref)
        if value is not None:
            return await self._answer(ask, value, "cache")
        if not bad:
            # Fetched a moment ago for another asker: no GET for this one, but no hit of
            # the cache either (a chunk its part will not admit waits in the queue too):
            # "shared", so hit ratios stay the share's (promise 7).
            pending = self.d.writer.pending(ref.key)
            if pending is not None:
                return await self._answer(ask, pending, "shared")
            data = await self.d.fetcher.joined(ref.key)  # another's GET: wait for it
            if data is not None:
                return await self._answer(ask, self._encoded(ds, ref, data), "shared")
        self._check_identity(ds, ask, ref)
        if not ask.charged:
            raise ChargeFirst(ref.length)
        self._fetching(ds)
        data, did = await self.d.fetcher.fetch(ds.id, ds.backend, self._free(), ref, replace=bad)
        return await self._answer(ask, self._encoded(ds, ref, data), "remote" if did else "shared")

    def held(self, ask: ChunkAsk) -> Held | None:
        """From a member connection's thread, not the loop: the verified value of a chunk
        this node holds (closed once sent), if it may be answered there: not a warm, a
        dataset this node knows (a local directory's object listed as the member names
        it), no serve cap (its bucket waits on the loop). None otherwise, and for
        anything unusual (a miss, a damaged or stale value, an object not listed):
        serve() decides then, on the loop."""
        if ask.warm or self.serve_rate is not None:
            return None
        try:
            ds = self.dataset(ask.uri)
        except RuntimeError:  # the loop changed the open datasets meanwhile
            return None
        if ds is None:
            return None
        if ds.uri.scheme == "file":
            try:
                self._check_listed(ds, ask)
            except (UsageError, lmdb.Error):
                return None
        ref = ask.ref()
        store = self.d.store
        txn = store.read_txn()
        try:
            value = store.get_value(txn, store.db(b"chunks"), ref.key)
            if value is not None:
                # Checked where it lies, not copied: sent from there too, txn still open.
                value = memoryview(value)
                verify_chunk(value, ref.content_bytes, ref.chunk_size, ref.index, ref.length)
                return Held(value, txn)
        except (lmdb.Error, ChunkFormatError):
            pass  # serve() looks again, counts and replaces it
        except BaseException:
            txn.abort()
            raise
        txn.abort()
        return None

    async def _warm(self, ds: DatasetState, ask: ChunkAsk, ref: ChunkRef) -> Served:
        """A member's warm: held if this dataset holds the chunk (or it is on its way),
        else fetched only if this node's part of the dataset has room."""
        if await self._holds(ds, ref) or self.d.writer.pending(ref.key) is not None:
            return Served(None, "cache", "held")
        if await self.d.fetcher.joined(ref.key) is not None:
            return Served(None, "cache", "held")
        self._check_identity(ds, ask, ref)
        budget = self.budgets.get(ds.id)
        if budget is None:
            budget = self.budgets[ds.id] = FillBudget(self.d, ds.id)
            self._budget_locks[ds.id] = trio.Lock()
        # A FillBudget answers one filling task: members' warms ask at once, so they
        # take turns between its question and the fetch it allows (fits() waits for
        # what is in flight to land, which needs no turn).
        async with self._budget_locks[ds.id]:
            if not await budget.fits(ref.length):
                return Served(None, "cache", "full")
            if not ask.charged:
                raise ChargeFirst(ref.length)
            budget.started(ref.length)
        self._fetching(ds)
        data = b""
        try:
            data, _ = await self.d.fetcher.fetch(ds.id, ds.backend, self._free(), ref)
        finally:
            budget.ended(ref.length, len(data))
        # "admitted" once it is: the asker's warm says done when every home has
        # answered, and a chunk still in the Writer's queue then is not in this part
        # yet (a status read right after showed a part short by it), nor sure to be.
        await self.d.writer.settled(ref.key)
        if await self._holds(ds, ref):
            return Served(None, "remote", "admitted")
        # Turned away: the Writer found the part full (a mount's reads here took the
        # room meanwhile), or its queue was full (asked again later: "dropped").
        async with self._budget_locks[ds.id]:
            room = await budget.fits(ref.length)
        return Served(None, "remote", "dropped" if room else "full")

    def _check_listed(self, ds: DatasetState, ask: ChunkAsk) -> None:
        """A local directory's object is read for a member only if this node's listing
        names it, at the version and content id the member names: a member never makes
        this node read a file its listing does not show."""
        try:
            named = named_object(self.d.store, ds, ask.key, Purpose.READ, ask.version)
        except VersionMismatchError as exc:
            raise UsageError(str(exc)) from None
        obj = named.obj if named is not None else None
        if obj is None or (obj.content_id, obj.size) != (ask.content_id, ask.size):
            raise UsageError(f"{ask.key!r} is not in this node's listing of {ds.uri.canonical}")

    def _check_identity(self, ds: DatasetState, ask: ChunkAsk, ref: ChunkRef) -> None:
        """Before a store GET for a member: the bytes of the version it names are
        admitted under the content id it names (the chunk key is made of it), so that id
        must be the one the store gives that version: else a member could name one
        object's version with another's content id, and this node's mounts and every
        member asking here would be served the first object's bytes as the second's.
        The backend vouches where the id is made of the version; else this node's
        listing must name the object so (a local directory's was checked already)."""
        if ds.uri.scheme == "file" or ds.backend.identifies(ref.obj):
            return
        if ds.state != PEER_STATE:
            self._check_listed(ds, ask)
            return
        raise UsageError(
            f"content id {ask.content_id[:100]!r} of {ask.key[:100]!r} cannot be checked "
            f"against version {ask.version[:100]!r} without a listing of {ds.uri.canonical}"
        )

    async def _holds(self, ds: DatasetState, ref: ChunkRef) -> bool:
        """Whether the dataset holds the chunk (its owners row: no value pages read)."""
        store = self.d.store

        def owns() -> bool:
            with store.read_txn() as txn:
                try:
                    return bool(store.owns(txn, ds.id, ref.key))
                except lmdb.Error:
                    return False

        return await trio.to_thread.run_sync(owns, limiter=self.lookups)

    async def _lookup(self, ds: DatasetState, ref: ChunkRef) -> tuple[bytes | None, bool]:
        """(the value, verified, or None; whether a value failed verification: fetched
        again with replace). A chunk up to INLINE_LOOKUP_BYTES is looked up on the loop,
        a larger one in a worker thread."""
        store = self.d.store

        def lookup() -> tuple[bytes | None, bool]:
            with store.read_txn() as txn:
                try:
                    value = store.get_value(txn, store.db(b"chunks"), ref.key)
                except lmdb.Error:
                    return None, False  # a damaged page: the store GET replaces nothing
                if value is None:
                    return None, False
                value = bytes(value)  # checked after the copy: the map may change under us
                if checked_chunk(value, ref, ds.fetch, copy=False) is None:
                    return None, True
                return value, False

        if ref.length <= INLINE_LOOKUP_BYTES:
            return lookup()
        return await trio.to_thread.run_sync(lookup, limiter=self.lookups)

    def _encoded(
        self, ds: DatasetState, ref: ChunkRef, data: bytes | memoryview
    ) -> bytes | bytearray:
        pending = self.d.writer.pending(ref.key)
        if pending is not None:
            return pending
        o = ref.obj
        return encode_chunk(ds.id, ref.index, ref.chunk_size, o.key, o.content_id, data)

    async def _answer(self, ask: ChunkAsk, value: bytes | bytearray, source: str) -> Served:
        if self.serve_rate is not None:
            now = trio.current_time()
            self._cap_free_at = max(now, self._cap_free_at) + len(value) / self.serve_rate
        await self.serve_cap().charge(len(value))
        return Served(value, source)

    def _check_busy(self) -> None:
        """ServeBusy if an answer would wait on the serve cap longer than serve_wait: a
        member waits for it (102s) up to a minute and then takes this node for dead,
        where the store would have answered in a fraction of that."""
        if self.serve_rate is None:
            return
        backlog = self._cap_free_at - trio.current_time()
        if backlog > self.serve_wait:
            raise ServeBusy(
                f"serving members at peer_serve_rate, the next answer would wait "
                f"{backlog:.1f}s (more than {self.serve_wait:g}s): read it from the store"
            )

    def serve_waited(self) -> float:
        """Seconds answers to members waited on the serve cap, in all."""
        return self._serve_cap.waited_seconds if self._serve_cap is not None else 0.0

    def set_serve_rate(self, rate: int | None, wait: float = 2.0) -> None:
        """peer_serve_rate, and how long an answer may wait on it (peer_timeout_seconds)."""
        self.serve_rate = rate
        self.serve_wait = wait
        self._cap_free_at = 0.0  # the bucket starts over at its new rate
        if self._serve_cap is not None:
            self._serve_cap.set_rate(rate)

    def serve_cap(self) -> TokenBucket:
        """peer_serve_rate: bytes this node serves to members at most (its own mounts
        come first)."""
        if self._serve_cap is None:
            self._serve_cap = TokenBucket(self.serve_rate, burst_seconds=0.1)
        return self._serve_cap

    def _free(self) -> TokenBucket:
        """The bucket of a GET the asker charged already (promise 2: to its job)."""
        if self._unlimited is None:
            self._unlimited = TokenBucket(None)
        return self._unlimited
