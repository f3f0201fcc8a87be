"""The node daemon: one trio loop owning datasets, jobs, mounts, fetches and the writer.

Owns the node's state and its lifecycle: opening the cache env, binding the control
socket, listing datasets into persisted manifests, registering mount processes, serving
their misses through the Fetcher, and reporting status. HTTP routing lives in
control/routes.py; LMDB writes go through the Writer. Never serves FUSE requests (mount
processes do) and never blocks the loop: SDK calls and write txns run in threads.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable

import lmdb
import trio

from silofs.cache.format import ChunkRef, encode_chunk
from silofs.cache.store import CacheDamagedError, Usage
from silofs.config import NodeSettings, credential_fingerprint
from silofs.errors import BackendError, UnreachableError, UsageError, VersionMismatchError
from silofs.node.backends import BackendOptions, open_backend
from silofs.node.cachedir import (
    check_cache_dir,
    lock_cache_dir,
    move_aside,
    resolve_cache_size,
    secure_cache_dir,
)
from silofs.node.fetch import Fetcher
from silofs.node.limiter import TokenBucket
from silofs.node.listing_builder import ListingBuilder
from silofs.node.metrics import DaemonMetrics, parse_address
from silofs.node.prefetch import Prefetcher
from silofs.node.quota import QuotaPolicy
from silofs.node.state import DatasetState, JobState, MountState
from silofs.node.store_write import LISTING_BATCH, PendingChunk, WritableStore, env_map_size
from silofs.node.supervise import run_once
from silofs.node.warm import WarmState, run_warm
from silofs.node.writer import Writer
from silofs.records import MountCounters, ObjectInfo, PrefixListed, job_name_error
from silofs.units import format_rate, format_size
from silofs.uri import DatasetURI, parse_uri

log = logging.getLogger(__name__)

# A listing batch holding a complete prefix is written when the next page arrives once
# this old, though not full: with a slow store a directory's "complete" row (what a
# --list-in-background lookup waits for) would otherwise wait for 10 000 more objects.
LISTING_FLUSH = 0.25


class Daemon:
    def __init__(self, settings: NodeSettings) -> None:
        self.settings = settings
        # Resolved once, so a misspelt group stops the daemon at start, not a request.
        self.admin_gid = _group_id(settings.admin_group)
        self.socket_gid = _group_id(settings.socket_group)
        check_cache_dir(settings.cache_dir)
        secure_cache_dir(settings.cache_dir, self.socket_gid)  # before LMDB opens a file
        # Held until the process ends: a second daemon on this cache dir refuses to start.
        self.lock_fd = lock_cache_dir(settings.cache_dir)
        self.cache_size = resolve_cache_size(settings)
        self.map_size = env_map_size(self.cache_size)
        self.store = _open_store(settings.cache_dir, self.map_size)
        secure_cache_dir(settings.cache_dir, self.socket_gid)
        self.usage: dict[int, Usage] = self.store.load_usage()
        # Allocations are keyed by canonical URI / job name, persisted in the env's meta
        # db, and kept for datasets and jobs that are not mounted yet (promise 4).
        self.allocations: dict[str, int] = {
            k.removeprefix("cache:"): int(v) for k, v in self.store.iter_meta("cache:")
        }
        self.io_allocations: dict[str, int | None] = {
            k.removeprefix("io:"): v["bytes_per_s"]
            for k, v in self.store.iter_meta("io:")
            if _valid_persisted_job(k.removeprefix("io:"))
        }
        self.modes: dict[str, str] = {
            k.removeprefix("mode:"): str(v) for k, v in self.store.iter_meta("mode:")
        }
        # Job registrations (a cluster scheduler's prolog: GPUs, f*, epochs, datasets;
        # PUT /v1/jobs/{job}), persisted like allocations so a daemon restart in the
        # middle of a job does not make the controller forget its GPUs. Removed by
        # forgetting the job (the epilog does, after unmounting).
        self.registrations: dict[str, dict] = {
            k.removeprefix("job:"): dict(v)
            for k, v in self.store.iter_meta("job:")
            if isinstance(v, dict) and _valid_persisted_job(k.removeprefix("job:"))
        }
        self._enforce = trio.Event()
        # Allocation changes check the sum and then write it (an await): one at a time.
        self._allocating = trio.Lock()
        self.datasets: dict[int, DatasetState] = {}
        self.jobs: dict[str, JobState] = {}
        self.mounts: dict[str, MountState] = {}
        self.writer = Writer(
            self.store,
            self.usage,
            self.quota_policy,
            batch_bytes=settings.writer_batch_bytes,
            batch_seconds=settings.writer_batch_seconds,
            queue_bytes=settings.admission_queue_bytes,
            sync_seconds=settings.sync_seconds,
        )
        self.fetcher = Fetcher(self.store, self.writer, settings.fetch_threads)
        self.prefetch = Prefetcher(self)  # hints, one per mount (node/prefetch.py)
        self.backend_opts = BackendOptions(
            endpoint_url=settings.endpoint_url,
            connect_timeout=settings.connect_timeout,
            read_timeout=settings.read_timeout,
            max_attempts=settings.max_attempts,
            page_size=settings.page_size,
            list_workers=settings.list_workers,
            extra=dict(settings.backend_extra),
        )
        self.started = time.time()
        self.nursery: trio.Nursery | None = None
        # Access (docs/SECURITY.md), all in memory: the uid that opened each dataset
        # first (counted against its limit), the uids whose mount of a local dataset
        # passed the directory-tree check since its last listing, and the cloud policy.
        self.opened_by: dict[int, int] = {}
        self.tree_checked: dict[int, set[int]] = {}
        self.cloud_access = _resolve_access(settings.access)
        # Who started the daemon and how (service.run_daemon fills it; status shows it).
        self.origin: dict[str, object] = {}
        self.credentials = credential_fingerprint(os.environ)
        self.warms: dict[int, WarmState] = {}  # dataset id -> its latest warm
        # monotonic time of the last open, mount, unmount or warm: idle exit counts from it
        self.last_used = time.monotonic()
        self.metrics = DaemonMetrics()  # service.serve adds the status collector
        if settings.metrics_address:
            parse_address(settings.metrics_address)  # a bad one stops the start

    # -- tasks -----------------------------------------------------------------------
    def spawn(
        self,
        what: str,
        fn: Callable[..., Awaitable[object]],
        *args: object,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        """Start a one-shot task in the daemon's nursery, supervised (node/supervise.py):
        an unexpected exception is logged once and given to on_failure, never raised."""
        assert self.nursery is not None
        self.nursery.start_soon(functools.partial(run_once, what, fn, *args, on_failure=on_failure))

    # -- policy --------------------------------------------------------------------
    def quota_policy(self) -> QuotaPolicy:
        by_id = {
            ds.id: self.allocations[ds.uri.canonical]
            for ds in self.datasets.values()
            if ds.uri.canonical in self.allocations
        }
        lru = frozenset(
            ds.id for ds in self.datasets.values() if self.modes.get(ds.uri.canonical) == "lru"
        )
        return QuotaPolicy(self.cache_size, by_id, lru)

    async def set_cache_allocation(self, uri: str, size: int | None) -> None:
        """Allocate `size` bytes of cache to a dataset (None: back to the shared pool).

        The check and the write are one step under a lock: without it two concurrent PUTs
        both pass the check before either is recorded, and together exceed the cache."""
        async with self._allocating:
            await self._set_cache_allocation(uri, size)

    async def _set_cache_allocation(self, uri: str, size: int | None) -> None:
        others = sum(v for k, v in self.allocations.items() if k != uri)
        if size is not None and others + size > self.cache_size:
            over = others + size - self.cache_size
            raise UsageError(
                f"allocations would total {format_size(others + size)}, "
                f"{format_size(over)} more than the cache "
                f"({format_size(self.cache_size)})"
            )
        await self.writer.call(self.store.put_meta, f"cache:{uri}", size)
        if size is None:
            self.allocations.pop(uri, None)
        else:
            self.allocations[uri] = size
        log.info(
            "cache allocation of %s: %s", uri, "shared pool" if size is None else format_size(size)
        )
        self._enforce.set()

    async def set_io_allocation(self, job: str, rate: int | None) -> None:
        """Allocate remote IO to a job (None: unlimited). Applies to queued fetches too."""
        await self.writer.call(self.store.put_meta, f"io:{job}", {"bytes_per_s": rate})
        self.io_allocations[job] = rate
        self.job(job).limiter.set_rate(rate)  # listed in status even before it mounts
        log.info("remote IO allocation of job %s: %s", job, format_rate(rate))

    async def clear_io_allocation(self, job: str) -> bool:
        """Remove a job's remote IO allocation (`silofs-ctl allocate-io JOB --clear`): it
        is unlimited again, its row stays while it is in use. False if it had none."""
        if job not in self.io_allocations:
            return False
        await self.writer.call(self.store.put_meta, f"io:{job}", None)
        self.io_allocations.pop(job, None)
        if job in self.jobs:
            self.jobs[job].limiter.set_rate(None)
        log.info("remote IO allocation of job %s removed", job)
        return True

    async def set_mode(self, uri: str, mode: str) -> None:
        if mode not in ("uniform", "lru"):
            raise UsageError(f"admission mode must be uniform or lru, not {mode!r}")
        await self.writer.call(self.store.put_meta, f"mode:{uri}", mode)
        old = self.modes.get(uri, "uniform")
        self.modes[uri] = mode
        ds = self.find_dataset(uri)
        if ds is not None and old == "lru" and mode == "uniform":
            await self.writer.call(self.writer.lru.forget, ds.id)
        log.info("admission mode of %s: %s", uri, mode)

    async def forget_dataset(self, ds: DatasetState) -> None:
        """Drop a dataset's row, cache allocation and admission mode (`silofs-ctl forget`).
        Its cached chunks and saved listing stay: a later mount reuses them, and they
        count in the shared pool until evicted. Refused while something uses it."""
        self._check_unused(ds=ds)
        uri = ds.uri.canonical
        if uri in self.allocations:
            await self.set_cache_allocation(uri, None)
        if uri in self.modes:
            await self.writer.call(self.store.put_meta, f"mode:{uri}", None)
            self.modes.pop(uri, None)
        self.datasets.pop(ds.id, None)
        self.warms.pop(ds.id, None)
        for job in self.jobs.values():
            for per_dataset in (job.dataset_bytes, job.epochs, job.epoch_cached):
                per_dataset.pop(ds.id, None)
        log.info("forgot dataset %s", uri)

    async def register_job(self, name: str, info: dict) -> None:
        """Record what a cluster scheduler says of a job (checked by the route), for the
        controller; replaces an earlier registration of the same name."""
        await self.writer.call(self.store.put_meta, f"job:{name}", info)
        self.registrations[name] = info
        self.job(name)  # listed in status before it mounts
        log.info("job %s registered: %s", name, info)

    async def forget_job(self, name: str) -> None:
        """Drop a job's row, its remote IO allocation (a mistyped allocate-io) and its
        registration (a finished scheduler job)."""
        self._check_unused(job=name)
        if name in self.io_allocations:
            await self.writer.call(self.store.put_meta, f"io:{name}", None)
            self.io_allocations.pop(name, None)
        if name in self.registrations:
            await self.writer.call(self.store.put_meta, f"job:{name}", None)
            self.registrations.pop(name, None)
        self.jobs.pop(name, None)
        log.info("forgot job %s", name)

    def _check_unused(self, ds: DatasetState | None = None, job: str | None = None) -> None:
        for m in self.mounts.values():
            if (ds is not None and m.dsid == ds.id) or m.job == job:
                raise UsageError(f"{m.mountpoint} still uses it: unmount it first")
        for dsid, w in self.warms.items():
            if w.state == "running" and ((ds is not None and dsid == ds.id) or w.job == job):
                raise UsageError("a warm is running for it: stop it first")
        if ds is not None and ds.state in ("checking", "listing"):
            raise UsageError(f"{ds.uri.canonical} is being listed: try again when it is done")

    async def enforce_loop(self) -> None:
        """Shrink datasets that hold more than their quota (promise 1). Eviction runs in
        small txns in the writer thread, so reads never pause."""
        while True:
            with trio.move_on_after(5):
                await self._enforce.wait()
            self._enforce = trio.Event()
            policy = self.quota_policy()
            for dsid, target in policy.excess(self.usage).items():
                await self.writer.shrink(dsid, target, lru=dsid in policy.lru)

    def busy(self) -> bool:
        """Something still needs the daemon: a mount, a listing in progress, a warm.
        (A dataset opened but not mounted yet counts through last_used: `silofs mount`
        starts its mount process only after the listing is ready.)"""
        return (
            bool(self.mounts)
            or any(ds.state in ("checking", "listing") for ds in self.datasets.values())
            or any(w.state == "running" for w in self.warms.values())
        )

    def start_warm(
        self,
        ds: DatasetState,
        job: str,
        paths: list[str],
        chunk_size: int | None,
        uid: int,
        reader: tuple[int, frozenset[int]] | None = None,
    ) -> WarmState:
        """Start warming `ds` (node/warm.py); the running warm if there is one. With
        `reader` (an untrusted peer's uid and gids), only objects it may read are
        fetched."""
        if ds.state != "ready":
            raise UsageError(f"dataset {ds.uri.canonical} is not ready ({ds.state})")
        w = self.warms.get(ds.id)
        if w is not None and w.state == "running":
            if w.job != job:
                raise UsageError(
                    f"a warm of {ds.uri.canonical} for job {w.job!r} is running: "
                    "wait for it, or stop it first"
                )
            return w
        if chunk_size is None:  # the chunk size its mounts read with, so keys match
            chunk_size = next(
                (m.chunk_size for m in self.mounts.values() if m.dsid == ds.id),
                self.settings.chunk_size,
            )
        w = self.warms[ds.id] = WarmState(job, paths, chunk_size, uid, reader=reader)
        self.job(job)

        def failed(reason: str) -> None:
            w.state, w.error, w.finished = "error", reason, time.time()

        self.spawn(f"warm of {ds.uri.canonical}", run_warm, self, ds, w, on_failure=failed)
        log.info("warm of %s for job %s started (paths %s)", ds.uri.canonical, job, paths or "all")
        return w

    # -- datasets ------------------------------------------------------------------
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
    ) -> DatasetState:
        """Register a dataset (idempotent) and start checking/listing it if needed.
        `options` are per-dataset store options (config.STORE_OPTIONS): they apply when
        the dataset is opened, or re-opened while nothing uses it; a different set while
        mounts use it is a UsageError (one backend per dataset)."""
        uri = parse_uri(uri_text)
        options = dict(options or {})
        self.last_used = time.monotonic()
        dsid = await self.writer.call(lambda: self.store.dataset_id(uri.canonical, create=True))
        assert dsid is not None
        ds = self.datasets.get(dsid)
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
            ds.options = options
            ds.state = "error"  # checked again below with the new options
        if ds is not None and ds.state in ("checking", "listing"):
            return ds
        if ds is None or ds.state == "error" or refresh:
            if ds is None:
                backend = open_backend(uri, self._backend_options(endpoint_url, options))
                ds = DatasetState(dsid, uri, self._short_name(uri, dsid), backend)
                ds.options = options
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
        have_manifest = self.store.current_generation(ds.id) is not None
        try:
            try:
                await trio.to_thread.run_sync(ds.backend.check, limiter=self.fetcher.threads)
            except UnreachableError as exc:
                if not have_manifest or refresh:
                    raise
                log.warning(
                    "%s: %s; serving the persisted listing and cached chunks", ds.uri.canonical, exc
                )
            old_gen = self.store.current_generation(ds.id)
            if refresh or not have_manifest:
                self.tree_checked.pop(ds.id, None)  # a new listing: check mounts again
                record = await self._list(ds)
            ds.record = record
            ds.state = "ready"
            self.last_used = time.monotonic()
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

    async def _list(self, ds: DatasetState) -> dict:
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
        keep = {current} if current is not None else set()
        while (
            await self.writer.call(self.store.delete_stale_generations, ds.id, keep)
            >= LISTING_BATCH
        ):
            pass
        builder = await self.writer.call(self.store.begin_listing, ds.id)
        ds.building_gen = builder.gen  # mounts that asked to may serve it while it grows
        try:
            return await self._fill(ds, builder)
        finally:
            ds.building_gen = None

    async def _fill(self, ds: DatasetState, builder: ListingBuilder) -> dict:
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
            # One task failed (the listing thread or a write): its error is the listing's,
            # as when the listing was one call (BackendError -> the dataset's error).
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise
        if ds.listed == 0:
            raise BackendError(f"{ds.uri.canonical} has no objects: check the prefix")
        record = await self.writer.call(
            self.store.finish_listing,
            builder,
            {"uri": ds.uri.canonical, "listed_at": time.time()},
        )
        t = builder.totals
        if t.shadowed:
            log.warning(
                "%s: %d keys are hidden behind a directory of the same name (or listed twice),"
                " e.g. %s",
                ds.uri.canonical,
                t.shadowed,
                t.shadowed_keys[0],
            )
        if t.skipped:
            log.warning(
                "%s: %d keys cannot be file paths (empty, '.' or '..' parts), e.g. %r",
                ds.uri.canonical,
                t.skipped,
                t.skipped_keys[0],
            )
        elapsed = time.monotonic() - t0
        log.info(
            "listed %s: %d objects, %s in %.1fs (%.0f objects/s), generation %d",
            ds.uri.canonical,
            ds.listed,
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
                "%s: %d cached chunks of versions generation %d no longer lists are the "
                "first eviction victims",
                ds.uri.canonical,
                marked,
                new_gen,
            )

    # -- jobs and mounts -----------------------------------------------------------
    def job(self, name: str) -> JobState:
        job = self.jobs.get(name)
        if job is None:
            job = self.jobs[name] = JobState(name, TokenBucket(self.io_allocations.get(name)))
            job.sample(time.monotonic())  # the zero point of its rates
        return job

    def register_mount(
        self,
        ds: DatasetState,
        job: str,
        mountpoint: str,
        pid: int,
        uid: int,
        chunk_size: int | None,
        mount_id: str | None = None,
        background: bool = False,
    ) -> MountState:
        """Register a mount process. A mount that registers again with its own id (it
        gave up on a slow answer, or the daemon restarted) is the same mount: one entry,
        and its cumulative counters keep their baseline, so nothing is counted twice.
        A mount that asked for it (`background`) may serve a listing still being
        written: its lookups of names not listed yet wait for the listing (mount/fs.py)."""
        listing = background and ds.state == "listing" and ds.building_gen is not None
        if ds.state != "ready" and not listing:
            raise UsageError(f"dataset {ds.uri.canonical} is not ready ({ds.state})")
        cs = chunk_size or self.settings.chunk_size
        self.last_used = time.monotonic()
        known = self.mounts.get(mount_id) if mount_id else None
        if known is not None:
            if (known.uid, known.dsid, known.job) != (uid, ds.id, job):
                raise UsageError(f"mount id {mount_id} is taken by another mount")
            known.pid, known.mountpoint = pid, mountpoint
            log.info("mount %s registered again (pid %d)", known.id, pid)
            return known
        m = MountState(mount_id or uuid.uuid4().hex[:12], job, ds.id, mountpoint, pid, uid, cs)
        self.mounts[m.id] = m
        j = self.job(job)
        j.epoch_cached.setdefault(ds.id, self.usage.get(ds.id, Usage()).bytes)
        log.info(
            "mount %s: %s at %s for job %s (pid %d)", m.id, ds.uri.canonical, mountpoint, job, pid
        )
        return m

    def unregister_mount(self, mount_id: str) -> None:
        m = self.mounts.pop(mount_id, None)
        self.last_used = time.monotonic()
        self.prefetch.forget(mount_id)
        if m is not None:
            log.info("mount %s at %s is gone", m.id, m.mountpoint)

    async def report(self, m: MountState, counters: MountCounters, touched: list[bytes]) -> None:
        delta = counters.minus(m.reported)
        m.reported = counters
        ds = self.datasets[m.dsid]
        ds.reads.add(delta)
        job = self.job(m.job)
        job.reads.add(delta)
        job.sample(time.monotonic())
        self._advance_epoch(job, ds, delta.bytes_read)
        self.prefetch.reported(m)
        if touched and self.modes.get(ds.uri.canonical) == "lru":
            await self.writer.touch(m.dsid, touched)

    def _advance_epoch(self, job: JobState, ds: DatasetState, read: int) -> None:
        """An epoch ends each time the job has read one dataset's worth of bytes. Reads
        the kernel page cache served never reach a mount and are not counted: with
        datasets larger than RAM (the case silofs is for) that is a small lag."""
        total = job.dataset_bytes[ds.id] = job.dataset_bytes.get(ds.id, 0) + max(0, read)
        size = ds.record.get("size", 0)
        epoch = total // size if size > 0 else 0
        if epoch > job.epochs.get(ds.id, 0):
            job.epochs[ds.id] = epoch
            job.epoch_cached[ds.id] = self.usage.get(ds.id, Usage()).bytes
            job.epoch = max(job.epochs.values())

    def effective_cache(self, job: JobState) -> int:
        """Cached bytes that can serve the job's current epoch: what was cached when the
        epoch began and is still cached. A lower bound when other jobs share the dataset."""
        return sum(
            min(cached, self.usage.get(dsid, Usage()).bytes)
            for dsid, cached in job.epoch_cached.items()
        )

    async def get_chunk(
        self,
        m: MountState,
        key: str,
        index: int,
        refetch: bool,
        version: str | None = None,
        span: tuple[int, int] | None = None,
    ) -> tuple[bytes, str]:
        """(bytes, 'cache'|'remote') for a mount's miss. Only objects in the mount's own
        dataset listing are served (promise 6). `version` is the one the reader's handle
        opened: after a refresh an open file keeps reading it (the previous generation
        is kept until the next listing), never the new version's bytes: if neither
        listing has that version, VersionMismatchError (409; EIO in the mount).
        `span` (first, last chunk index, index among them; checked by the route) is the
        read-ahead this request belongs to: the GET that fetches chunk `index` may fetch
        the rest of the span with it (Fetcher.fetch_span)."""
        ds = self.datasets[m.dsid]
        obj = self.store.get_object(ds.id, key, ds.record.get("gen"))
        if obj is None and ds.building_gen is not None:  # a mount of a listing in progress
            obj = self.store.get_object(ds.id, key, ds.building_gen)
        if version is not None and (obj is None or obj.version != version):
            gen = ds.record.get("gen")
            old = self.store.get_object(ds.id, key, gen - 1) if gen else None
            if old is not None and old.version == version:
                obj = old
            elif obj is not None:
                ds.fetch.version_mismatches += 1
                raise VersionMismatchError(
                    f"{ds.uri.canonical}{key} changed since this mount listed it "
                    "(a refresh listed another version); remount to read the new one"
                )
        if obj is None:
            raise UsageError(f"{key!r} is not in the listing of {ds.uri.canonical}")
        last = max(0, (obj.size - 1) // m.chunk_size)
        job = self.job(m.job)
        ref = ChunkRef.of(obj, m.chunk_size, index)
        self.prefetch.missed(m, key, index)  # the reader's position in its hint
        if not refetch:  # a refetch was counted as corrupt by the mount that saw it
            data, bad = self.fetcher.cached(ref, ds.fetch)
            if data is not None:
                ds.fetch.cache_served += 1
                return data, "cache"
            refetch = bad  # replace the bad value rather than keep missing on it
        t0 = time.monotonic()
        try:
            first, end = span if span is not None else (index, index)
            refs = [
                ref if i == index else ChunkRef.of(obj, m.chunk_size, i)
                for i in range(first, min(end, last) + 1)
            ]
            data, fetched = await self.fetcher.fetch_span(
                ds.id,
                ds.backend,
                job.limiter,
                ref,
                refs,
                replace=refetch,
                readahead=span is not None,
            )
            self.metrics.fetch_seconds.labels(ds.uri.canonical).observe(time.monotonic() - t0)
        except BackendError as exc:
            for c in (ds.fetch, job.fetch, m.fetch):
                c.errors += 1
            log.error("%s: chunk %d of %s: %s", ds.uri.canonical, index, key, exc)
            raise
        for c in (ds.fetch, job.fetch, m.fetch):
            c.remote_gets += fetched.chunks
            c.remote_bytes += fetched.bytes
            c.remote_requests += fetched.requests
        return data, "remote"

    def offer_chunk(self, m: MountState, key: str, index: int, content_id: str, data: bytes) -> str:
        """A chunk a mount holds in its buffer, offered again after a daemon restart:
        'present' (cached already), 'queued' (offered to the Writer, admitted if its
        dataset has room) or 'dropped' (queue full). UsageError if it does not match the
        dataset's listing: the object key, the content id the mount fetched it under (a
        refreshed listing makes it stale), the index and the exact length. The chunk
        key is computed here from the listing, never taken from the mount."""
        ds = self.datasets[m.dsid]
        obj = self.store.get_object(ds.id, key)
        if obj is None:
            raise UsageError(f"{key!r} is not in the listing of {ds.uri.canonical}")
        if obj.content_id != content_id:
            raise UsageError(f"{key!r} changed since this chunk was fetched")
        last = max(0, (obj.size - 1) // m.chunk_size)
        if not 0 <= index <= last:
            raise UsageError(f"{key!r} has no chunk {index}")
        ref = ChunkRef.of(obj, m.chunk_size, index)
        if len(data) != ref.length:
            raise UsageError(f"chunk {index} of {key!r} is {ref.length} bytes, not {len(data)}")
        cached, bad = self.fetcher.cached(ref, ds.fetch)
        if cached is not None:
            return "present"
        value = encode_chunk(ds.id, index, m.chunk_size, obj.key, obj.content_id, data)
        # A value that failed verification (or is of an older format) is replaced.
        ok = self.writer.offer(PendingChunk(ds.id, ref.key, value, ref.length, replace=bad))
        return "queued" if ok else "dropped"

    async def reap_mounts(self) -> None:
        """Forget mounts whose process died without saying goodbye (kill -9, fusermount)."""
        while True:
            await trio.sleep(2)
            await self.reap_once()

    async def reap_once(self) -> None:
        for m in list(self.mounts.values()):
            if not _pid_alive(m.pid):
                self.unregister_mount(m.id)
        # A sequential reader's open GET that nobody continued holds a store connection.
        self.fetcher.sweep_parked(trio.current_time())
        # A mount process that ended without closing the env (kill -9, or any exit while
        # a read txn was open) leaves its read snapshot in the lock file's reader table.
        # While it stays, LMDB reuses no page freed after it: data.mdb grows to the map
        # limit and admission stops. reader_check clears slots of dead processes; it scans
        # the table (max_readers slots, one kill(pid, 0) each), so it runs every tick.
        cleared = await trio.to_thread.run_sync(self.store.env.reader_check)
        if cleared:
            log.info("cleared %d stale LMDB reader slot(s) of ended processes", cleared)

    # -- ownership and per-uid limits (docs/SECURITY.md) ----------------------------
    def job_owner(self, job: str) -> int | None:
        """The uid a job belongs to: the one that registered its oldest live mount. Kept
        in memory only, with the mounts: a job with no mount left belongs to no one,
        and after a daemon restart the first mount to re-register claims it."""
        owner = next((m.uid for m in self.mounts.values() if m.job == job), None)
        if owner is None:  # a running warm charges the job too
            owner = next((w.uid for w in self._running_warms() if w.job == job), None)
        return owner

    def _running_warms(self) -> list[WarmState]:
        return [w for w in self.warms.values() if w.state == "running"]

    def held_by(self, uid: int) -> tuple[int, int, int]:
        """(datasets, mounts, jobs) a uid holds, as its limits count them."""
        datasets = sum(1 for dsid in self.datasets if self.opened_by.get(dsid) == uid)
        mine = [m for m in self.mounts.values() if m.uid == uid]
        jobs = {m.job for m in mine} | {w.job for w in self._running_warms() if w.uid == uid}
        return datasets, len(mine), len(jobs)

    def forget_idle_dataset(self, uid: int) -> bool:
        """Forget the oldest dataset `uid` opened that no mount uses and that is not being
        listed, to make room under its limit. Its listing and chunks stay in the cache;
        opening it again reuses them. False if there is none."""
        used = {m.dsid for m in self.mounts.values()}
        for dsid, ds in self.datasets.items():
            if (
                self.opened_by.get(dsid) == uid
                and dsid not in used
                and ds.state not in ("checking", "listing")
            ):
                del self.datasets[dsid]
                self.opened_by.pop(dsid, None)
                self.tree_checked.pop(dsid, None)
                ds.backend.close()
                log.info("forgot idle dataset %s (opened by uid %d)", ds.uri.canonical, uid)
                return True
        return False

    def forget_idle_jobs(self, keep: int) -> None:
        """Keep at most `keep` jobs that have neither a mount nor an IO allocation, the
        oldest forgotten first: a user cycling job names must not grow the daemon."""
        busy = {m.job for m in self.mounts.values()} | set(self.io_allocations)
        busy |= set(self.registrations)
        busy |= {w.job for w in self._running_warms()}
        idle = [name for name in self.jobs if name not in busy]
        for name in idle[: max(0, len(idle) - keep)]:
            del self.jobs[name]


def _open_store(cache_dir: str, map_size: int) -> WritableStore:
    """The node's env; a damaged one is moved aside and replaced by an empty one (a cache
    is disposable: refusing to start would need someone to delete it by hand)."""
    try:
        return WritableStore(cache_dir, map_size)
    except CacheDamagedError as exc:
        moved = move_aside(cache_dir)
        log.error("%s; moved it to %s and starting with an empty cache", exc, moved)
        return WritableStore(cache_dir, map_size)


def _valid_persisted_job(name: str) -> bool:
    """Allocations persisted before job names were checked may hold a name that breaks
    /metrics for everyone: skip it (the row stays in the env, unused)."""
    why = job_name_error(name)
    if why is not None:
        log.warning("ignoring the persisted IO allocation of job %r: %s", name, why)
    return why is None


def _resolve_access(access: dict[str, list[str]]) -> dict[str, frozenset[int] | None]:
    """[access] with group names resolved once at start ("*": every local user)."""
    return {
        prefix: None if "*" in groups else frozenset(_group_id(g) for g in groups)  # type: ignore[misc]
        for prefix, groups in access.items()
    }


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _group_id(group: str | None) -> int | None:
    if group is None:
        return None
    import grp

    try:
        return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise UsageError(f"group {group!r} does not exist") from None


__all__ = ["Daemon"]
