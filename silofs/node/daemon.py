"""The node daemon: one trio loop owning datasets, jobs, mounts, fetches and the writer.

Owns the node's state and the operations on it: opening the cache env, jobs and mount
processes (registering, their reports and epochs, reaping dead ones), serving their
misses through the Fetcher and taking back the chunks they offer, warms, who holds
what (job owners, per-uid counts), and the operations that span its rooms (an IO
allocation and its job's limiter, forgetting a dataset or a job). The datasets and
their listings are node/datasets.py's, the allocations node/allocations.py's, the API
node/routes.py's; LMDB writes go through the Writer. Never serves FUSE requests (mount
processes do) and never blocks the loop: SDK calls and write txns run in threads.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable

import trio

from silofs.cache.format import ChunkRef, encode_chunk
from silofs.cache.store import CacheDamagedError, Usage
from silofs.config import NodeSettings, credential_fingerprint
from silofs.errors import (
    BackendError,
    UsageError,
    VersionMismatchError,
)
from silofs.node.allocations import Allocations
from silofs.node.cachedir import (
    check_cache_dir,
    lock_cache_dir,
    move_aside,
    resolve_cache_size,
    secure_cache_dir,
)
from silofs.node.cluster import Cluster
from silofs.node.datasets import Catalog, Purpose, named_object
from silofs.node.fetch import Fetcher
from silofs.node.limiter import TokenBucket
from silofs.node.metrics import DaemonMetrics, parse_address
from silofs.node.prefetch import Prefetcher
from silofs.node.quota import QuotaPolicy
from silofs.node.state import DatasetState, JobState, MountState
from silofs.node.store_write import PendingChunk, WritableStore, env_map_size
from silofs.node.supervise import run_once
from silofs.node.warm import WarmState, run_warm
from silofs.node.writer import Writer
from silofs.pids import pid_alive
from silofs.records import MountCounters
from silofs.units import count, is_digits

log = logging.getLogger(__name__)

CACHE_WATCH_S = 2.0  # how often watch_cache_dir looks (a stat of data.mdb and an fstat)


class Daemon:
    def __init__(self, settings: NodeSettings) -> None:
        self.settings = settings
        # Resolved once, so a misspelt group stops the daemon at start, not a request.
        self.admin_gid = _group_id(settings.admin_group)
        self.socket_gid = _group_id(settings.socket_group)
        check_cache_dir(settings.cache_dir)
        # Held until the process ends: a second daemon on this cache dir refuses to start,
        # and refuses before it sets a mode: with another socket_group it would open the
        # running daemon's cached bytes to that group, or shut that daemon's mounts out.
        self.lock_fd = lock_cache_dir(settings.cache_dir)
        secure_cache_dir(settings.cache_dir, self.socket_gid)  # before LMDB opens a file
        self.cache_size = resolve_cache_size(settings)
        self.map_size = env_map_size(self.cache_size)
        self.store = _open_store(settings.cache_dir, self.map_size)
        secure_cache_dir(settings.cache_dir, self.socket_gid)
        self.usage: dict[int, Usage] = self.store.load_usage()
        self.cache_removed = False  # watch_cache_dir: the env's files unlinked under us
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
        # What the controller and admins decided, persisted (node/allocations.py).
        self.allocs = Allocations(self.store, self.writer, self.cache_size)
        self.fetcher = Fetcher(self.store, self.writer, settings.fetch_threads)
        self.prefetch = Prefetcher(self)  # hints, one per mount (node/prefetch.py)
        self.warms: dict[int, WarmState] = {}  # dataset id -> its latest warm
        # The datasets and their listings (node/datasets.py).
        self.catalog = Catalog(
            settings,
            store=self.store,
            writer=self.writer,
            fetcher=self.fetcher,
            mounts=self.mounts,
            warms=self.warms,
            spawn=self.spawn,
            used=self.used,
        )
        # monotonic: uptime is a duration; a wall clock stepped back would make it negative
        self.started = time.monotonic()
        self.nursery: trio.Nursery | None = None
        self.cloud_access = _resolve_access(settings.access)  # docs/SECURITY.md
        # Who started the daemon and how (service.run_daemon fills it; status shows it).
        self.origin: dict[str, object] = {}
        self.credentials = credential_fingerprint(os.environ)
        # monotonic time of the last open, mount, unmount or warm: idle exit counts from it
        self.last_used = time.monotonic()
        self.metrics = DaemonMetrics()  # service.serve adds the status collector
        if settings.metrics_address:
            parse_address(settings.metrics_address)  # a bad one stops the start
        # One cache across the members of [cluster] (node/cluster.py); inactive alone.
        self.cluster = Cluster(self, settings)

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

    def used(self) -> None:
        """Something used the daemon now: its idle exit counts from here."""
        self.last_used = time.monotonic()

    # -- datasets (node/datasets.py) --------------------------------------------------
    @property
    def datasets(self) -> dict[int, DatasetState]:
        return self.catalog.datasets

    # -- allocations (node/allocations.py) ------------------------------------------
    @property
    def modes(self) -> dict[str, str]:
        """Admission modes by canonical URI (read only: set_mode changes one)."""
        return self.allocs.modes

    def quota_policy(self) -> QuotaPolicy:
        """Promise 1's inputs: the allocations of the datasets open here and of those
        members read through this node; in a cluster, a dataset with a cluster share
        gets this node's part of it."""
        return self.allocs.quota_policy(
            [*self.datasets.values(), *self.cluster.home.datasets.values()],
            overrides=self.cluster.parts(),
        )

    async def set_cache_allocation(self, uri: str, size: int | None) -> dict[str, str] | None:
        """A dataset's cache allocation; in a cluster, its share of the cluster's caches
        (each member holds its part: node/cluster_shares.py), pushed to every member:
        then the members the push did not reach, with why (None off a cluster)."""
        if self.cluster.active:
            missed = await self.cluster.set_share(uri, size)
            if uri in self.allocs.cache:  # set before the node joined: the share replaces it
                await self.allocs.set_cache(uri, None)
            return missed
        await self.allocs.set_cache(uri, size)
        return None

    async def set_io_allocation(self, job: str, rate: int | None) -> None:
        """Allocate remote IO to a job (None: unlimited). Applies to queued fetches too."""
        await self.allocs.set_io(job, rate)
        self.job(job).limiter.set_rate(rate)  # listed in status even before it mounts

    async def clear_io_allocation(self, job: str) -> bool:
        """Remove a job's remote IO allocation (`silofs-ctl allocate-io JOB --clear`): it
        is unlimited again, its row stays while it is in use. False if it had none."""
        if not await self.allocs.clear_io(job):
            return False
        if job in self.jobs:
            self.jobs[job].limiter.set_rate(None)
        return True

    async def set_mode(self, uri: str, mode: str) -> None:
        old = await self.allocs.set_mode(uri, mode)
        ds = self.catalog.find_dataset(uri)
        if ds is not None and old == "lru" and mode == "uniform":
            await self.writer.call(self.writer.lru.forget, ds.id)

    async def forget_dataset(self, ds: DatasetState) -> None:
        """Drop a dataset's row, cache allocation and admission mode (`silofs-ctl forget`).
        Its cached chunks and saved listing stay: a later mount reuses them, and they
        count in the shared pool until evicted. Refused while something uses it."""
        self._check_unused(ds=ds)
        uri = ds.uri.canonical
        await self.allocs.forget_dataset(uri)
        self.catalog.forget(ds)
        self.warms.pop(ds.id, None)
        for job in self.jobs.values():
            for per_dataset in (job.dataset_bytes, job.epochs, job.epoch_cached):
                per_dataset.pop(ds.id, None)
        log.info("forgot dataset %s", uri)

    async def register_job(self, name: str, info: dict) -> None:
        """Record what a cluster scheduler says of a job (checked by the route), for the
        controller; replaces an earlier registration of the same name."""
        await self.allocs.register_job(name, info)
        self.job(name)  # listed in status before it mounts

    async def forget_job(self, name: str) -> None:
        """Drop a job's row, its remote IO allocation (a mistyped allocate-io) and its
        registration (a finished scheduler job)."""
        self._check_unused(job=name)
        await self.allocs.forget_job(name)
        self.jobs.pop(name, None)
        log.info("forgot job %s", name)

    def _check_unused(self, ds: DatasetState | None = None, job: str | None = None) -> None:
        # A mount unmounted and its process gone may not be reaped yet (every 2 s):
        # `silofs unmount` waits for the process, so a forget right after it must not
        # be refused for a mount that no longer exists.
        self._unregister_dead_mounts()
        for m in self.mounts.values():
            if (ds is not None and m.dsid == ds.id) or m.job == job:
                raise UsageError(f"{m.mountpoint} still uses it: unmount it first")
        for dsid, w in self.warms.items():
            if w.state == "running" and ((ds is not None and dsid == ds.id) or w.job == job):
                raise UsageError("a warm is running for it: stop it first")
        if ds is not None and ds.state in ("checking", "listing"):
            raise UsageError(f"{ds.uri.canonical} is being listed: try again when it is done")

    async def watch_cache_dir(self) -> None:
        """Say once, within CACHE_WATCH_S, that the cache dir was removed (or its env
        replaced) under the daemon: it goes on serving from the unlinked files, but a
        new mount cannot open the env, and before this nothing in the log or status said
        why (a new mount's error did, with only the next request)."""
        while not self.cache_removed:
            await trio.sleep(CACHE_WATCH_S)
            if self.store.removed():
                self.cache_removed = True
                log.warning(
                    "the cache at %s was removed under the running daemon: its mounts go "
                    "on (from the unlinked files, whose space is freed when the daemon "
                    "ends); a new mount fails until the daemon is restarted, which "
                    "starts an empty cache there",
                    self.settings.cache_dir,
                )

    async def enforce_loop(self) -> None:
        """Shrink datasets that hold more than their quota (promise 1). Eviction runs in
        small txns in the writer thread, so reads never pause."""
        while True:
            await self.allocs.changed(timeout=5)
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
            w.state, w.error, w.finished = "error", reason, time.monotonic()

        self.spawn(f"warm of {ds.uri.canonical}", run_warm, self, ds, w, on_failure=failed)
        log.info("warm of %s for job %s started (paths %s)", ds.uri.canonical, job, paths or "all")
        return w

    # -- jobs and mounts -----------------------------------------------------------
    def job(self, name: str) -> JobState:
        job = self.jobs.get(name)
        if job is None:
            job = self.jobs[name] = JobState(name, TokenBucket(self.allocs.io.get(name), job=name))
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
        again: bool = False,
    ) -> MountState:
        """Register a mount process. A mount that registers again with its own id (it
        gave up on a slow answer, or the daemon restarted) is the same mount: one entry,
        and its cumulative counters keep their baseline, so nothing is counted twice.
        A mount that asked for it (`background`) may serve a listing still being
        written: its lookups of names not listed yet wait for the listing (mount/fs.py).
        A mount this daemon does not know that says it registers `again` served before
        a restart: its first report is a base (report())."""
        listing = background and ds.state == "listing" and ds.building_gen is not None
        if ds.state != "ready" and not listing:
            raise UsageError(f"dataset {ds.uri.canonical} is not ready ({ds.state})")
        cs = chunk_size or self.settings.chunk_size
        self.used()
        known = self.mounts.get(mount_id) if mount_id else None
        if known is not None:
            if (known.uid, known.dsid, known.job) != (uid, ds.id, job):
                raise UsageError(f"mount id {mount_id} is taken by another mount")
            known.pid, known.mountpoint = pid, mountpoint
            log.info("mount %s registered again (pid %d)", known.id, pid)
            return known
        m = MountState(mount_id or uuid.uuid4().hex[:12], job, ds.id, mountpoint, pid, uid, cs)
        m.rejoined = again
        self.mounts[m.id] = m
        j = self.job(job)
        j.epoch_cached.setdefault(ds.id, self.usage.get(ds.id, Usage()).bytes)
        log.info(
            "mount %s: %s at %s for job %s (pid %d)", m.id, ds.uri.canonical, mountpoint, job, pid
        )
        return m

    def unregister_mount(self, mount_id: str) -> None:
        m = self.mounts.pop(mount_id, None)
        self.used()
        self.prefetch.forget(mount_id)
        if m is not None:
            log.info("mount %s at %s is gone", m.id, m.mountpoint)

    async def report(self, m: MountState, counters: MountCounters, touched: list[bytes]) -> None:
        delta = m.reported.advance(counters)
        ds = self.datasets[m.dsid]
        job = self.job(m.job)
        if m.rejoined:
            # The first report of a mount that served before this daemon started: its
            # counts since it started, exported by the daemon before. Added again, the
            # dataset's and job's counters (Prometheus counters: a restart is a reset to
            # 0) would count them twice in increase()/rate(). They are the base; the
            # job's epochs still follow every byte its mounts read (_advance_epoch).
            m.rejoined = False
        else:
            ds.reads.add(delta)
            job.reads.add(delta)
        job.sample(time.monotonic())
        self._advance_epoch(job, ds, delta.bytes_read)
        self.prefetch.reported(m)
        if touched and self.allocs.mode(ds.uri.canonical) == "lru":
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
        """(bytes, 'cache'|'shared'|'remote') for a mount's miss ('shared': a member
        answered with the bytes of a GET made for another asker: no GET charged here, and
        a miss to the mount, as all but 'cache'). Only objects in the mount's own dataset
        listing are served (promise 6). `version` is the one the reader's handle
        opened: after a refresh an open file keeps reading it (the previous generation
        is kept until the next listing), never the new version's bytes: if neither
        listing has that version, VersionMismatchError (409; EIO in the mount).
        `span` (first, last chunk index, index among them; checked by the route) is the
        read-ahead this request belongs to: the GET that fetches chunk `index` may fetch
        the rest of the span with it (Fetcher.fetch_span)."""
        ds = self.datasets[m.dsid]
        try:
            named = named_object(self.store, ds, key, Purpose.READ, version)
        except VersionMismatchError:
            ds.fetch.version_mismatches += 1
            raise
        if named is None:
            raise UsageError(f"{key!r} is not in the listing of {ds.uri.canonical}")
        obj = named.obj
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
        peer = await self.cluster.read(ds, job.limiter, m.job, ref, refetch)
        if peer is not None:  # homed at another member (node/cluster.py)
            self.count_fetch(ds, job, m, 1 if peer.charged else 0, peer.charged, 0)
            return peer.data, peer.source
        t0 = time.monotonic()
        try:
            first, end = span if span is not None else (index, index)
            refs = [
                ref if i == index else ChunkRef.of(obj, m.chunk_size, i)
                for i in range(first, min(end, last) + 1)
            ]
            refs = self.cluster.homed_here(refs, ref)  # the others are other members
            data, fetched = await self.fetcher.fetch_span(
                ds.id,
                ds.backend,
                job.limiter,
                ref,
                refs,
                replace=refetch,
                # A GET left open for the reader's next span would stream other
                # members' chunks in a cluster: there, a GET covers its run only.
                readahead=span is not None and not self.cluster.active,
            )
            self.metrics.fetch_seconds.labels(ds.uri.canonical).observe(time.monotonic() - t0)
        except BackendError as exc:
            for c in (ds.fetch, job.fetch, m.fetch):
                c.errors += 1
            # A warning: the asker is told and decides (a mount's read-ahead asks
            # again; a reader's EIO is the mount's ERROR line).
            log.warning("%s: chunk %d of %s: %s", ds.uri.canonical, index, key, exc)
            raise
        self.count_fetch(ds, job, m, fetched.chunks, fetched.bytes, fetched.requests)
        return data, "remote"

    def count_fetch(
        self, ds: DatasetState, job: JobState, m: MountState, chunks: int, nbytes: int, reqs: int
    ) -> None:
        """Store GETs made for a mount's miss (here, or by a member for this node's job)."""
        for c in (ds.fetch, job.fetch, m.fetch):
            c.remote_gets += chunks
            c.remote_bytes += nbytes
            c.remote_requests += reqs

    def offer_value(self, ds: DatasetState, ref: ChunkRef, data: bytes, *, replace: bool) -> None:
        """Offer a chunk served by a member to this node's Writer: a copy kept here
        (keep_peer_copies), or the replacement of a value that failed its check."""
        o = ref.obj
        value = encode_chunk(ds.id, ref.index, ref.chunk_size, o.key, o.content_id, data)
        self.writer.offer(PendingChunk(ds.id, ref.key, value, ref.length, replace=replace))

    def offer_chunk(self, m: MountState, key: str, index: int, content_id: str, data: bytes) -> str:
        """A chunk a mount holds in its buffer, offered again after a daemon restart:
        'present' (cached already), 'elsewhere' (in a cluster, homed at another member
        that is up: not kept here), 'queued' (offered to the Writer, admitted if its
        dataset has room) or 'dropped' (queue full). UsageError if it does not match the
        dataset's listing: the object key, the content id the mount fetched it under (a
        refreshed listing makes it stale), the index and the exact length. The chunk
        key is computed here from the listing, never taken from the mount."""
        ds = self.datasets[m.dsid]
        named = named_object(self.store, ds, key, Purpose.OFFER)
        if named is None:
            raise UsageError(f"{key!r} is not in the listing of {ds.uri.canonical}")
        obj = named.obj
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
        if not bad and not self.cluster.keeps_here(ds, ref.key):
            return "elsewhere"  # its home, another member up now, holds it
        value = encode_chunk(ds.id, index, m.chunk_size, obj.key, obj.content_id, data)
        # A value that failed verification (or is of an older format) is replaced.
        ok = self.writer.offer(PendingChunk(ds.id, ref.key, value, ref.length, replace=bad))
        return "queued" if ok else "dropped"

    async def reap_mounts(self) -> None:
        """Forget mounts whose process died without saying goodbye (kill -9, fusermount)."""
        while True:
            await trio.sleep(2)
            await self.reap_once()

    def _unregister_dead_mounts(self) -> None:
        for m in list(self.mounts.values()):
            if not pid_alive(m.pid):
                self.unregister_mount(m.id)

    async def reap_once(self) -> None:
        self._unregister_dead_mounts()
        # A sequential reader's open GET that nobody continued holds a store connection.
        self.fetcher.sweep_parked(trio.current_time())
        # A mount process that ended without closing the env (kill -9, or any exit while
        # a read txn was open) leaves its read snapshot in the lock file's reader table.
        # While it stays, LMDB reuses no page freed after it: data.mdb grows to the map
        # limit and admission stops. reader_check clears slots of dead processes; it scans
        # the table (max_readers slots, one kill(pid, 0) each), so it runs every tick.
        cleared = await trio.to_thread.run_sync(self.store.env.reader_check)
        if cleared:
            log.info("cleared %s of ended processes", count(cleared, "stale LMDB reader slot"))

    # -- ownership and per-uid limits (docs/SECURITY.md) ----------------------------
    def job_owner(self, job: str) -> int | None:
        """The uid a job belongs to: the one its registration names (an admin's, e.g. the
        Slurm prolog's `job register --uid`; persisted, so it outlives mounts and
        restarts), else the one that registered its oldest live mount (or started its
        running warm). Mounts are in memory only: a job with neither a registered uid
        nor a mount belongs to no one, and after a daemon restart the first mount to
        re-register claims it."""
        owner = self.registered_owner(job)
        if owner is None:
            owner = next((m.uid for m in self.mounts.values() if m.job == job), None)
        if owner is None:  # a running warm charges the job too
            owner = next((w.uid for w in self._running_warms() if w.job == job), None)
        return owner

    def registered_owner(self, job: str) -> int | None:
        """The uid the job's registration names, if any."""
        uid = self.allocs.registrations.get(job, {}).get("uid")
        return uid if isinstance(uid, int) and not isinstance(uid, bool) else None

    def _running_warms(self) -> list[WarmState]:
        return [w for w in self.warms.values() if w.state == "running"]

    def held_by(self, uid: int) -> tuple[int, int, int]:
        """(datasets, mounts, jobs) a uid holds, as its limits count them."""
        datasets = sum(1 for dsid in self.datasets if self.catalog.opened_by.get(dsid) == uid)
        mine = [m for m in self.mounts.values() if m.uid == uid]
        jobs = {m.job for m in mine} | {w.job for w in self._running_warms() if w.uid == uid}
        return datasets, len(mine), len(jobs)

    def forget_idle_jobs(self, keep: int) -> None:
        """Keep at most `keep` jobs that have neither a mount nor an IO allocation, the
        oldest forgotten first: a user cycling job names must not grow the daemon."""
        busy = {m.job for m in self.mounts.values()} | set(self.allocs.io)
        busy |= set(self.allocs.registrations)
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


def _resolve_access(access: dict[str, list[str]]) -> dict[str, frozenset[int] | None]:
    """[access] with group names resolved once at start ("*": every local user)."""
    return {
        prefix: None if "*" in groups else frozenset(_group_id(g) for g in groups)  # type: ignore[misc]
        for prefix, groups in access.items()
    }


def _group_id(group: str | None) -> int | None:
    if group is None:
        return None
    import grp

    try:
        return int(group) if is_digits(group) else grp.getgrnam(group).gr_gid
    except KeyError:
        raise UsageError(f"group {group!r} does not exist") from None


__all__ = ["Daemon"]
