"""The node's datasets and their listings: finding, opening, checking, listing, and
forgetting one.

Owns the dataset records by id, each dataset's backend and store options, the listing
lifecycle (check the store, list it into a new generation of the directory index in
bounded batches, mark the chunks a refresh made stale), the rule for which listing
generations a mount's request may name (named_object), and the access caches tied to a
dataset (who opened it first, whose mount passed the directory-tree check). Never
serves a chunk and never changes allocations; the mounts and warms it asks about are
the Daemon's.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import time
from collections.abc import Callable, Iterable

import lmdb
import trio

from silofs.cache.store import CacheStore
from silofs.config import NodeSettings
from silofs.errors import (
    BackendError,
    RefreshTooSoonError,
    UnreachableError,
    UsageError,
    VersionMismatchError,
    first_leaf,
)
from silofs.node.backends import BackendOptions, open_backend
from silofs.node.fetch import Fetcher
from silofs.node.listing_builder import ListingBuilder
from silofs.node.state import DatasetState, MountState
from silofs.node.store_write import LISTING_BATCH, WritableStore
from silofs.node.warm import WarmState
from silofs.node.writer import Writer
from silofs.records import ObjectInfo, PrefixListed
from silofs.units import count, format_size
from silofs.uri import DatasetURI, parse_uri

log = logging.getLogger(__name__)

# A listing batch holding a complete prefix is written when the next page arrives once
# this old, though not full: with a slow store a directory's "complete" row (what a
# --list-in-background lookup waits for) would otherwise wait for 10 000 more objects.
LISTING_FLUSH = 0.25

# The [backend] settings every dataset's store gets: the BackendOptions fields that
# NodeSettings has by the same names (its backend_extra is `extra`, to which a dataset's
# own store options add).
_BACKEND_SETTINGS = sorted(
    {f.name for f in dataclasses.fields(BackendOptions)}
    & {f.name for f in dataclasses.fields(NodeSettings)}
)

Spawn = Callable[..., None]  # Daemon.spawn: a supervised one-shot task


class Purpose(enum.Enum):
    """What a mount's request names an object of the listing for."""

    READ = "read"  # a miss: the bytes of the version the reader's handle opened
    OFFER = "offer"  # an offered chunk: admitted only against the complete listing


@dataclasses.dataclass(frozen=True)
class Named:
    """The listing row a request names, and whether it is the previous generation's."""

    obj: ObjectInfo
    previous: bool = False


def named_object(
    store: CacheStore, ds: DatasetState, key: str, purpose: Purpose, version: str | None = None
) -> Named | None:
    """The one rule for which listing generations a mount's request may name.

    Mounts read the dataset's listing: its current generation, or for a key it does not
    list, the generation being built (a mount of a listing in progress). An offer names
    the current generation only: bytes are admitted against a complete listing. A read
    names the version its handle opened: where the listing has another, the previous
    generation (kept until the next listing) may still list that one, so a handle
    opened before a refresh keeps reading what it opened; if neither does,
    VersionMismatchError. None: no generation the purpose may name lists `key`."""
    if purpose is Purpose.OFFER:
        obj = store.get_object(ds.id, key)
        return Named(obj) if obj is not None else None
    gen = ds.record.get("gen")
    obj = store.get_object(ds.id, key, gen)
    if obj is None and ds.building_gen is not None:
        obj = store.get_object(ds.id, key, ds.building_gen)
    if version is None or (obj is not None and obj.version == version):
        return Named(obj) if obj is not None else None
    old = store.get_object(ds.id, key, gen - 1) if gen else None
    if old is not None and old.version == version:
        return Named(old, previous=True)
    if obj is not None:
        raise VersionMismatchError(
            f"{ds.uri.canonical}{key} changed since this mount listed it "
            "(a refresh listed another version); remount to read the new one"
        )
    return None


def refresh_wait(listed_at: float | None, now: float, interval: float) -> float:
    """Seconds until a refresh of a dataset last listed at `listed_at` (wall clock, the
    record's "listed_at") may start a new listing under a minimum `interval`; 0: now.
    Never listed (None), or no interval: 0. A clock set back since the listing counts
    as a listing just now, never as a longer wait than `interval`."""
    if listed_at is None or interval <= 0:
        return 0.0
    age = max(now - listed_at, 0.0)
    return max(interval - age, 0.0)


# How long a mount's word on the generation it serves holds (it reports at least once a
# second): a mount that stopped reporting (hung, or gone without unregistering) must not
# keep old generations, and their env space, for ever.
SERVED_GEN_SECONDS = 60.0


# At most this many generations before the current one are kept for mounts: a mount
# that says a generation long gone (a stuck or hostile one: reports are a mount's word),
# or handles opened in many, must not keep every listing since, each a whole listing's
# rows, until the cache's env is full. A mount follows a new listing within a report
# period, so a real one is never this far behind; past it the oldest go (said in the
# log): a read needing one is EIO, never another version's bytes.
KEPT_GENERATIONS = 16


def served_generations(
    mounts: Iterable[MountState], dsid: int, current: int | None, now: float
) -> set[int]:
    """The generations of dataset `dsid` a new listing must not delete: the current one,
    and every one from the oldest a mount said within SERVED_GEN_SECONDS it serves. A
    mount moves to a new generation only when it next reads the record (its report loop),
    so one that said N-1 may be on N-1 or N by now: all between are kept. With serving
    processes, also the generations a mount said its open handles were opened in."""
    if current is None:
        return set()
    said = [
        m.gen
        for m in mounts
        if m.dsid == dsid and m.gen is not None and now - m.gen_seen <= SERVED_GEN_SECONDS
    ]
    oldest = min((g for g in said if g <= current), default=current)
    # The generations open handles were opened in: only those (a handle open across many
    # refreshes keeps its own generation, not every one since).
    held = {
        g
        for m in mounts
        if m.dsid == dsid and now - m.held_seen <= SERVED_GEN_SECONDS
        for g in m.held
        if g <= current
    }
    floor = current - KEPT_GENERATIONS
    need = min(oldest, min(held, default=oldest))
    if need < floor:
        log.warning(
            "dataset %d: mounts say they need generation %d, more than %d before the "
            "current %d: only the last %d are kept",
            dsid,
            need,
            KEPT_GENERATIONS,
            current,
            KEPT_GENERATIONS,
        )
    return set(range(max(oldest, floor), current + 1)).union(g for g in held if g >= floor)


class Catalog:
    """The node's datasets by id, and what happens to them between an open and a forget."""

    def __init__(
        self,
        settings: NodeSettings,
        *,
        store: WritableStore,
        writer: Writer,
        fetcher: Fetcher,
        mounts: dict[str, MountState],
        warms: dict[int, WarmState],
        spawn: Spawn,
        used: Callable[[], None],
    ) -> None:
        self.settings = settings
        self.store = store
        self.writer = writer
        self.fetcher = fetcher  # its thread limiter runs checks and listings
        self.mounts = mounts  # the Daemon's, read here
        self.warms = warms  # the Daemon's, read here
        self.spawn = spawn
        self.used = used  # something used the daemon now (its idle exit counts from it)
        self.datasets: dict[int, DatasetState] = {}
        self.backend_opts = BackendOptions(
            **{name: getattr(settings, name) for name in _BACKEND_SETTINGS},
            extra=dict(settings.backend_extra),
        )
        # Access (docs/SECURITY.md), all in memory: the uid that opened each dataset
        # first (counted against its limit), and the uids whose mount of a local
        # dataset passed the directory-tree check since its last listing.
        self.opened_by: dict[int, int] = {}
        self.tree_checked: dict[int, set[int]] = {}
        # Refreshes refused by the minimum interval, per dataset id (status, metrics):
        # kept when a dataset is forgotten, so a counter never goes back.
        self.refreshes_refused: dict[int, int] = {}

    def find_dataset(self, name: str) -> DatasetState | None:
        for ds in self.datasets.values():
            if name in (ds.name, ds.uri.canonical, str(ds.id)):
                return ds
        if "://" not in name and not name.startswith("/"):
            return None  # a relative path would be resolved against the daemon's cwd
        try:
            canonical = parse_uri(name).canonical
        except UsageError:
            return None
        return next((d for d in self.datasets.values() if d.uri.canonical == canonical), None)

    def _short_name(self, uri: DatasetURI, dsid: int) -> str:
        base = (uri.bucket + "/" + uri.prefix).rstrip("/").split("/")[-1] or uri.bucket
        taken = {d.name for d in self.datasets.values() if d.id != dsid}
        return base if base not in taken else f"{base}-{dsid}"

    async def open_dataset(
        self,
        uri_text: str,
        refresh: bool,
        endpoint_url: str | None = None,
        options: dict[str, str] | None = None,
        *,
        refresh_limited: bool = False,
    ) -> DatasetState:
        """Register a dataset (idempotent) and start checking/listing it if needed.
        `options` are per-dataset store options (config.STORE_OPTIONS): they apply when
        the dataset is opened, or re-opened while nothing uses it; a different set while
        mounts use it is a UsageError (one backend per dataset). A `refresh_limited`
        caller's refresh of a dataset listed less than min_refresh_seconds ago is
        RefreshTooSoonError, counted, and changes nothing; one asked while a check or
        listing runs joins it, as any open does."""
        uri = parse_uri(uri_text)
        options = dict(options or {})
        self.used()
        dsid = await self.writer.call(lambda: self.store.dataset_id(uri.canonical, create=True))
        assert dsid is not None
        ds = self.datasets.get(dsid)
        # Before anything changes (a refused refresh leaves the dataset as it was); a
        # refresh asked while a check or listing runs joins it below, never refused.
        joins = ds is not None and ds.state in ("checking", "listing")
        if refresh and refresh_limited and not joins:
            self._check_refresh_interval(dsid, uri, ds)
        if ds is not None and options and options != ds.options:
            in_use = any(m.dsid == dsid for m in self.mounts.values()) or (
                dsid in self.warms and self.warms[dsid].state == "running"
            )
            if in_use or ds.state in ("checking", "listing"):
                raise UsageError(
                    f"{uri.canonical} is open with store options {ds.options or 'none'}; "
                    f"{options} would be ignored: unmount its mounts first"
                )
            ds.backend = open_backend(uri, self._backend_options(endpoint_url, options))
            ds.options, ds.endpoint_url = options, endpoint_url
            ds.state = "error"  # checked again below with the new options
        if ds is not None and ds.state in ("checking", "listing"):
            return ds
        if ds is None or ds.state == "error" or refresh:
            if ds is None:
                backend = open_backend(uri, self._backend_options(endpoint_url, options))
                ds = DatasetState(dsid, uri, self._short_name(uri, dsid), backend)
                ds.options, ds.endpoint_url = options, endpoint_url
                self.datasets[dsid] = ds
            ds.state, ds.error = "checking", ""

            def failed(message: str, ds: DatasetState = ds) -> None:
                ds.state, ds.error = "error", f"cannot open {ds.uri.canonical}: {message}"
                ds.prepare_errors += 1

            self.spawn(
                f"preparing {ds.uri.canonical}",
                self._prepare_dataset,
                ds,
                refresh,
                on_failure=failed,
            )
        return ds

    def _check_refresh_interval(self, dsid: int, uri: DatasetURI, ds: DatasetState | None) -> None:
        """RefreshTooSoonError if the dataset's last listing was a refresh (anyone's, a
        metadata-TTL relist's) that finished less than min_refresh_seconds ago. Its time
        is the record's, persisted with the listing: a daemon restart does not reopen the
        window."""
        record = ds.record if ds is not None and ds.record else self.store.dataset_record(dsid)
        if not record.get("refreshed"):
            # A dataset's first listing (a mount's, an open's) starts no window: "I added
            # files, refresh" right after mounting lists them. Refreshes are apart.
            return
        listed_at = record.get("listed_at")
        interval = self.settings.min_refresh_seconds
        now = time.time()
        wait = refresh_wait(float(listed_at) if listed_at is not None else None, now, interval)
        if wait <= 0:
            return
        self.refreshes_refused[dsid] = self.refreshes_refused.get(dsid, 0) + 1
        age = max(now - float(listed_at), 0.0)
        wait_s = max(math.ceil(wait), 1)
        raise RefreshTooSoonError(
            f"{uri.canonical} was refreshed {age:.0f} s ago; refreshes by users other than "
            f"root are at least {interval:g} s apart (min_refresh_seconds): "
            f"try again in {wait_s} s",
            wait,
        )

    def _backend_options(self, endpoint_url: str | None, options: dict[str, str]) -> BackendOptions:
        opts = self.backend_opts
        if endpoint_url:
            opts = dataclasses.replace(opts, endpoint_url=endpoint_url)
        if options:
            opts = dataclasses.replace(opts, extra={**opts.extra, **options})
        return opts

    async def _prepare_dataset(self, ds: DatasetState, refresh: bool) -> None:
        record = self.store.dataset_record(ds.id)
        # A listing saved before generations (no "gen"), or with rows of another shape
        # (LISTING_FORMAT), cannot be served: list again.
        have_listing = self.store.current_generation(ds.id) is not None
        # A listing whose content ids the backend no longer makes (Azure's before they
        # named their blob: backends/azurelist.py blob_scope) is listed again, once.
        ids = getattr(ds.backend, "content_ids", 1)
        relist = refresh or (have_listing and record.get("content_ids", 1) != ids)
        if relist and not refresh:
            log.info("%s: listing again: its content ids are of an older form", ds.uri.canonical)
        try:
            try:
                await trio.to_thread.run_sync(ds.backend.check, limiter=self.fetcher.threads)
            except UnreachableError as exc:
                if not have_listing or refresh:
                    raise
                log.warning(
                    "%s: %s; serving the persisted listing and cached chunks", ds.uri.canonical, exc
                )
                relist = False
            old_gen = self.store.current_generation(ds.id)
            if relist or not have_listing:
                self.tree_checked.pop(ds.id, None)  # a new listing: check mounts again
                record = await self._list(ds, refreshed=refresh and have_listing)
            ds.record = record
            ds.state = "ready"
            self.used()
            if old_gen is not None and int(record["gen"]) != old_gen:
                await self._mark_stale(ds, old_gen, int(record["gen"]))
        except BackendError as exc:
            ds.state, ds.error = "error", str(exc)
            ds.prepare_errors += 1
            log.error("dataset %s: %s", ds.uri.canonical, exc)
        except lmdb.Error as exc:
            ds.state = "error"
            ds.error = f"cannot save the listing of {ds.uri.canonical} in the cache: {exc}"
            log.error("%s", ds.error)

    async def _list(self, ds: DatasetState, refreshed: bool = False) -> dict:
        """List the store into a new generation of the dataset's directory index.

        Pages stream from the backend thread into the writer in batches of LISTING_BATCH
        objects, one write txn each, through a channel that holds two batches: daemon
        memory stays flat however large the listing. The generation becomes visible only
        when the record naming it is written (finish_listing), so a daemon killed half
        way leaves the previous listing in place; its rows are deleted by the next one.
        """
        ds.state, ds.listed = "listing", 0
        ds.list_started = time.monotonic()
        current = self.store.current_generation(ds.id)
        # Not the generations mounts still serve (they move at their next look at the
        # record): deleted under them, an unchanged file was ENOENT for a moment.
        keep = served_generations(self.mounts.values(), ds.id, current, time.monotonic())
        while (
            await self.writer.call(self.store.delete_stale_generations, ds.id, keep)
            >= LISTING_BATCH
        ):
            pass
        builder = await self.writer.call(self.store.begin_listing, ds.id)
        ds.building_gen = builder.gen  # mounts that asked to may serve it while it grows
        try:
            return await self._fill(ds, builder, refreshed)
        finally:
            ds.building_gen = None

    async def _fill(self, ds: DatasetState, builder: ListingBuilder, refreshed: bool) -> dict:
        send, recv = trio.open_memory_channel[list[ObjectInfo | PrefixListed]](2)
        # A fanned-out listing also says when a prefix is complete (PrefixListed, in
        # order with its objects): the builder marks that directory complete for mounts
        # serving this generation while it grows (--list-in-background).
        events = getattr(ds.backend, "list_events", ds.backend.list)

        def produce() -> None:
            batch: list[ObjectInfo | PrefixListed] = []
            done_at: float | None = None  # when the batch got its first complete prefix
            for obj in events():
                batch.append(obj)
                if isinstance(obj, ObjectInfo):
                    ds.listed += 1  # progress only; read by status
                elif obj.done and done_at is None:
                    done_at = time.monotonic()
                # A slow store fills a batch slowly: one holding a complete prefix (what
                # a --list-in-background lookup waits for) goes when the next page
                # arrives once LISTING_FLUSH old. Other batches stay full-sized: small
                # txns slow the listing down.
                if len(batch) >= LISTING_BATCH or (
                    done_at is not None and time.monotonic() - done_at >= LISTING_FLUSH
                ):
                    trio.from_thread.run(send.send, batch)
                    batch, done_at = [], None
            if batch:
                trio.from_thread.run(send.send, batch)

        async def producer() -> None:
            async with send:
                await trio.to_thread.run_sync(produce, limiter=self.fetcher.threads)

        t0 = time.monotonic()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(producer)
                async with recv:
                    async for batch in recv:
                        await self.writer.call(self.store.add_to_listing, builder, batch)
        except BaseExceptionGroup as group:
            # A task failed (the listing thread or a write) and the nursery cancelled the
            # other: its error is the listing's (BackendError -> the dataset's error).
            raise first_leaf(group) from None
        if ds.listed == 0:
            raise BackendError(f"{ds.uri.canonical} has no objects: check the prefix")
        record = await self.writer.call(
            self.store.finish_listing,
            builder,
            {
                "uri": ds.uri.canonical,
                "listed_at": time.time(),
                "refreshed": refreshed,
                "content_ids": getattr(ds.backend, "content_ids", 1),
            },
        )
        t = builder.totals
        if t.shadowed:
            log.warning(
                "%s: %s hidden behind a directory of the same name (or listed twice), e.g. %s",
                ds.uri.canonical,
                count(t.shadowed, "key"),
                t.shadowed_keys[0],
            )
        if t.skipped:
            log.warning(
                "%s: %s left out, not file paths (empty, '.' or '..' parts), e.g. %r",
                ds.uri.canonical,
                count(t.skipped, "key"),
                t.skipped_keys[0],
            )
        elapsed = time.monotonic() - t0
        log.info(
            "listed %s: %s, %s in %.1fs (%.0f objects/s), generation %d",
            ds.uri.canonical,
            count(ds.listed, "object"),
            format_size(record["size"]),
            elapsed,
            ds.listed / max(elapsed, 1e-9),
            record["gen"],
        )
        return record

    async def _mark_stale(self, ds: DatasetState, old_gen: int, new_gen: int) -> None:
        """After a refresh: the chunks the dataset holds of objects the new listing
        shows with another content id, or not at all, become its first eviction
        victims (WritableStore.mark_stale). Open handles of the old version keep hitting
        them until space is needed. Chunk keys depend on the chunk size: those of the
        dataset's mounts and the daemon's default are checked. In bounded steps: a
        read txn per LISTING_BATCH files, a write txn per step's keys."""
        sizes = {self.settings.chunk_size} | {
            m.chunk_size for m in self.mounts.values() if m.dsid == ds.id
        }
        marked, row = 0, None
        while True:
            keys, row = await trio.to_thread.run_sync(
                self.store.stale_candidates,
                ds.id,
                old_gen,
                new_gen,
                sizes,
                row,
                limiter=self.fetcher.threads,
            )
            if keys:
                marked += await self.writer.call(self.store.mark_stale, ds.id, keys)
            if row is None:
                break
        ds.stale_chunks = await trio.to_thread.run_sync(
            self.store.stale_count, ds.id, limiter=self.fetcher.threads
        )
        if marked:
            log.info(
                "%s: %s of versions generation %d no longer lists made first eviction victims",
                ds.uri.canonical,
                count(marked, "cached chunk"),
                new_gen,
            )

    def forget_idle_dataset(self, uid: int) -> bool:
        """Forget the oldest dataset `uid` opened that no mount or running warm uses and
        that is not being listed, to make room under its limit. Its listing and chunks
        stay in the cache; opening it again reuses them. False if there is none. A warm
        is a use: the dataset may be another user's warm (whoever opened it first counts
        it), which forgetting it cut off from its progress (404 to `silofs warm`)."""
        used = {m.dsid for m in self.mounts.values()}
        used |= {dsid for dsid, w in self.warms.items() if w.state == "running"}
        for dsid, ds in self.datasets.items():
            if (
                self.opened_by.get(dsid) == uid
                and dsid not in used
                and ds.state not in ("checking", "listing")
            ):
                self.forget(ds)
                log.info("forgot idle dataset %s (opened by uid %d)", ds.uri.canonical, uid)
                return True
        return False

    def forget(self, ds: DatasetState) -> None:
        """Drop a dataset's record, its access caches and its backend (nothing may use
        it: the caller checked). Its listing and cached chunks stay in the env."""
        self.datasets.pop(ds.id, None)
        self.opened_by.pop(ds.id, None)
        self.tree_checked.pop(ds.id, None)
        ds.backend.close()
