"""One mount process: registers with the daemon, mounts the listing, serves reads.

Owns the life of one FUSE mount: readiness (the `silofs mount` parent returns only once
the mount answers), raising the bdi read-ahead, periodic counter reports, re-registering
after a daemon restart, and a clean unmount on SIGTERM or `fusermount3 -u`, each within
a bound (docs/SEMANTICS.md): requests in flight get TERM_GRACE_SECONDS after SIGTERM, and
a mount gone from this namespace's mount table with nothing open ends even while a copy
in another mount namespace keeps the kernel's connection. Never lists a store or fetches
from one (the daemon does), never writes LMDB, and never unmounts a mount other than its
own (a later mount at the same path).

With --serve-processes N > 1 (mount/forked.py) this process registers, mounts and
answers INIT, closes its LMDB env and its daemon connections, and forks N serving
processes; it then only supervises them (Supervisor): a serving process that dies is
replaced, SIGTERM unmounts (every serving process then reads ENODEV and ends), and it
stays the pid the daemon watches for the mount's liveness. Each serving process opens
its own env and its own daemon connections, follows the listing itself, and reports
the counters of all of them (mount/shared.py) so status counts each byte once.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import gc
import logging
import os
import re
import secrets
import select
import signal
import time
from collections import deque
from collections.abc import Callable
from typing import BinaryIO
from urllib.parse import quote

import pyfuse3
import trio

from silofs import heap
from silofs.cache.listing import ListingReader
from silofs.cache.store import CacheStore
from silofs.config import MountSettings
from silofs.control.client import AsyncControlClient, ControlError, quote_segment
from silofs.errors import SilofsError, first_leaf
from silofs.logsetup import reopen_log_files
from silofs.mount import forked, turns, unstick
from silofs.mount.fs import Presentation, SilofsFS, sync_first
from silofs.mount.listing_view import Entry, ListingView, changed_entries
from silofs.mount.reader import ChunkReader, MissError
from silofs.mount.shared import SharedTables
from silofs.mount.survive import unforeseen
from silofs.mountinfo import fuse_device_refusal, mounts
from silofs.records import MAX_HELD, MountCounters
from silofs.units import count

log = logging.getLogger(__name__)

# A serving process that dies is replaced, unless this many died within RESTART_WINDOW
# seconds: then the mount is unmounted (readers get ENOTCONN), never left to hang.
MAX_RESTARTS = 5
RESTART_WINDOW = 60.0
# The young GC generation is collected every this many allocations, not 700, and what
# the mount allocated until it serves is kept out of collections (gc.freeze): a serving
# loop allocates short-lived objects per request, and the full collections that
# promotions set off walk the whole heap (the daemon does the same: node/service.py).
GC_YOUNG = 10_000
# Rows of the previous listing compared per read txn after a refresh (_forget_walk).
FORGET_BATCH = 10_000
CHILD_TERM_SECONDS = 0.5  # after the unmount, then SIGTERM (still connected: detached)
CHILD_EXIT_SECONDS = 10.0  # after the unmount, then SIGKILL
# The last report after an unmount: a daemon slow to answer must not keep the ended
# mount's process (and `silofs unmount`'s wait for it) for the client's whole timeout;
# the daemon forgets a mount whose process is gone anyway (reap_mounts).
FINAL_REPORT_SECONDS = 2.0
# Counters are reported every 250 ms while they move, and at least this often while the
# mount is idle: a restarted daemon learns of a mount serving nothing within this (the
# 404 that makes it register again), so status and end-job see it, and a rate sampled
# then falls to zero rather than keeping the last one.
IDLE_REPORT_SECONDS = 1.0
# After SIGTERM, requests being answered get this long to finish; then they are cancelled
# and the connection aborted (readers get ENOTCONN): a cold read waiting on a store that
# does not answer must not keep the process (and a scheduler's epilog) for the daemon's
# whole retry budget.
TERM_GRACE_SECONDS = 2.0
# How often a detached mount (gone from the mount table, files still open) checks
# whether the last of them was closed.
DETACHED_POLL_SECONDS = 0.25
MOUNT_TABLE = "/proc/self/mountinfo"


async def open_dataset(
    client: AsyncControlClient,
    uri: str,
    refresh: bool,
    endpoint_url: str | None,
    options: dict[str, str] | None = None,
) -> dict:
    """Ask the daemon for the dataset and wait, polling, until its listing is ready."""
    body = {"uri": uri, "refresh": refresh, "endpoint_url": endpoint_url}
    if options:
        body["options"] = options
    ds = await client.json("POST", "/v1/datasets", body)
    # No time limit: a first listing of tens of millions of objects takes as long as it
    # takes, and the daemon reports its progress in status.
    while ds["state"] in ("checking", "listing"):
        await trio.sleep(0.1)
        ds = await client.json("GET", f"/v1/datasets/{ds['id']}")
    if ds["state"] != "ready":
        raise SilofsError(ds.get("error") or f"dataset {uri} is {ds['state']}")
    return ds


def raise_read_ahead(target: str, kb: int) -> None:
    """Raise the mount's bdi read_ahead_kb so the kernel sends 1 MiB reads, not 128 KiB.

    Only once INIT has been answered: the kernel offers INIT a max_readahead of the
    bdi's default (128 KiB), libfuse echoes it back, and the reply sets the bdi's
    read-ahead to the smaller of the two, undoing a raise made before it. A file opened
    before the raise keeps the old read-ahead until it is closed. `target` must be
    resolved (realpath) before mounting. The bdi is found through /proc/self/mountinfo:
    stat()ing our own mountpoint from the process that serves it would deadlock, and
    realpath() stats every component. Logged at WARNING if it did not take.
    """
    try:
        for entry in reversed(mounts()):  # the newest mount at that path is ours
            if entry.mountpoint == target and entry.fstype.startswith("fuse"):
                path = f"/sys/class/bdi/{entry.device}/read_ahead_kb"
                with open(path, "w") as bdi:
                    bdi.write(str(kb))
                with open(path) as bdi:
                    now = int(bdi.read())
                if now != kb:
                    log.warning("read_ahead_kb of %s is %d, not %d", target, now, kb)
                return
    except (OSError, ValueError) as exc:
        log.warning("could not raise read_ahead_kb for %s: %s", target, exc)


def fsname(uri: str) -> str:
    """The dataset's URI as the mount's source (/proc/self/mountinfo): a comma would end
    the option (written "_"), and pyfuse3 passes options as ASCII, so any other
    character outside printable ASCII is percent-encoded (UTF-8): a directory named
    "données" once failed every mount of it with UnicodeEncodeError."""
    return "".join(c if " " <= c <= "~" else quote(c, safe="") for c in uri.replace(",", "_"))


# A refused refresh's answer ends "try again in N s" (node/datasets.py); without it, this.
RELIST_RETRY_SECONDS = 5.0


def listing_age(listed_at: float, wall_now: float, known_for: float) -> float:
    """Seconds since a listing was made, for the metadata TTL: the wall-clock age from
    its persisted listed_at (the daemon's clock, which outlives this process), but never
    less than `known_for`, the monotonic seconds this mount has known that listing. A
    wall clock stepped back since the listing (an NTP step, `date -s`) would otherwise
    keep the listing fresh for as long as the step, a day back no relist for a day; a
    step forward at worst relists once early, and the new listing's time is the new
    clock's."""
    return max(wall_now - listed_at, known_for)


def relist_wait(message: str) -> float:
    """Seconds to wait before asking a refresh again, from the daemon's 429 line."""
    m = re.search(r"try again in ([0-9]{1,6}) s", message)
    return float(m.group(1)) if m else RELIST_RETRY_SECONDS


class MountProcess:
    def __init__(self, settings: MountSettings, socket_path: str) -> None:
        self.s = settings
        self.socket_path = socket_path
        self.client = AsyncControlClient(
            socket_path, max_connections=32, timeout=settings.daemon_timeout
        )
        self.dataset: dict = {}
        # Ours for the life of the process, sent with every registration: a registration
        # repeated because the daemon answered slowly is the same mount to the daemon
        # (one entry, counters never counted twice), and a restarted daemon learns it.
        self.mount_id = secrets.token_hex(8)
        self.registered = False
        self.reader: ChunkReader | None = None
        self.fs: SilofsFS | None = None
        self._registering = False
        self._nursery: trio.Nursery | None = None
        self._offering = False
        self._relisting = False
        # A refresh the daemon refused (429, its min_refresh_seconds): not asked again
        # before this monotonic time; said once in the log.
        self._relist_after = 0.0
        self._relist_limited = False
        # The listing (its listed_at) the metadata TTL counts from, and the monotonic
        # time this process first saw it (listing_age).
        self._listing_seen: tuple[object, float] = (None, 0.0)
        self._forgetting: trio.CancelScope | None = None  # the walk of _forget_changed
        self.store: CacheStore | None = None
        self.shared: SharedTables | None = None
        self._ops: SilofsFS | None = None  # the object pyfuse3.init() was given
        self.signalled = False  # a serving process ended by a signal (not an unmount)
        # pyfuse3.main() returned because this process ended the session itself, and the
        # mount goes with it (a signal, or its `silofs mount` went away before "ready");
        # otherwise main() returning means the kernel unmounted us.
        self.unmount_at_end = False
        self.reg: dict = {}
        self.first_gen: int | None = None
        self.lru = False
        # Resolved now: once mounted, this process must never stat its own mountpoint.
        self.realpath = os.path.realpath(settings.mountpoint)
        # The mount's "major:minor" once mounted: names this mount, not whatever is
        # mounted at the same path later.
        self.device: str | None = None

    async def register(self) -> dict:
        if self.s.dataset_id is not None:
            self.dataset = {"id": self.s.dataset_id}  # opened by `silofs mount` already
        else:
            self.dataset = await open_dataset(
                self.client, self.s.uri, self.s.refresh, self.s.endpoint_url, self.s.store_options
            )
        body = {
            "id": self.mount_id,
            "dataset": self.dataset["id"],
            "job": self.s.job,
            "mountpoint": os.path.abspath(self.s.mountpoint),
            # After a daemon restart, keep the chunk size this mount's reads are cut with:
            # the new daemon's default may differ.
            "chunk_size": self.reader.chunk_size if self.reader else self.s.chunk_size,
            "io_limit": self.s.io_limit,
            "admission": self.s.admission,
            "background": self.s.list_in_background,
            # A restarted daemon takes this mount's next report as a base, not as reads.
            "again": self._registering,
        }
        reg = await self.client.json("POST", "/v1/mounts", body)
        self.mount_id = reg["id"]  # ours, unless the daemon is older than this mount
        self.registered = True
        self.lru = reg.get("admission") == "lru"
        if self.reader is not None:
            self.reader.registered(self.mount_id, self.lru)
            await self._report()
        return reg

    async def _reregister(self) -> None:
        log.warning("the daemon does not know this mount (restarted?); registering again")
        # A restarted daemon knows no dataset: open it again (its saved listing).
        self.s = dataclasses.replace(self.s, refresh=False, dataset_id=None)
        self._registering = True  # register() reports, which must not recurse here
        try:
            await self.register()
        except (ControlError, SilofsError) as exc:
            raise MissError(f"cannot re-register with the daemon: {exc}") from None
        finally:
            self._registering = False
        if self._nursery is not None and not self._offering:
            self._offering = True
            self._nursery.start_soon(self._offer_buffer)

    async def _offer_buffer(self) -> None:
        """Offer the chunks this mount fetched (its buffer, at most buffer_bytes) to the
        restarted daemon, one request at a time: admissions a restart lost come back
        without a remote GET. The daemon checks each against its listing."""
        assert self.reader is not None
        counts: dict[str, int] = {}
        try:
            for ref, data in self.reader.buffer.fetched():
                path = (
                    f"/v1/mounts/{self.mount_id}/offer?key={quote_segment(ref.obj.key)}"
                    f"&index={ref.index}&content_id={quote_segment(ref.obj.content_id)}"
                )
                try:
                    answer = await self.client.json("PUT", path, data)
                except ControlError as exc:
                    if exc.status == 409:  # stale for this listing: skip it
                        counts["refused"] = counts.get("refused", 0) + 1
                        continue
                    log.info("stopped offering buffered chunks: %s", exc)
                    break
                counts[answer["chunk"]] = counts.get(answer["chunk"], 0) + 1
        except Exception as exc:  # noqa: BLE001 - offers are not promises: never the mount's end
            unforeseen("offering buffered chunks to the daemon", exc)
        finally:
            self._offering = False
        if counts:
            log.info("offered buffered chunks to the daemon again: %s", counts)

    def _options(self) -> set[str]:
        opts = set(pyfuse3.default_options) | {
            f"fsname=silofs:{fsname(self.s.uri)}",
            "subtype=silofs",
            "ro",
            "noatime",
        }
        if self.s.allow_other:
            opts.add("allow_other")
        elif self.s.allow_root:
            opts.add("allow_root")
        return opts

    async def run(self, ready: Callable[[str | None], None]) -> None:
        """Mount and serve until unmounted. ready(None) once serving, ready(msg) on failure."""
        try:
            reg = await self.register()
            self._open(reg)
            assert self.fs is not None
            quiet_forgotten_replies()
            pyfuse3.init(self.fs, self.s.mountpoint, self._options())
            self.device = mount_device(self.realpath)
        except (ControlError, SilofsError, RuntimeError, OSError) as exc:
            await self._goodbye()
            ready(_mount_error(exc, self.s.mountpoint))
            return
        # One process: its worker tasks pass the device on only when a handler waits.
        # (With --serve-processes the read token decides, and pyfuse3's lock was made
        # before the fork: mount/forked.py.)
        turns.install()
        await self._serve(ready=ready)

    def _open(self, reg: dict, shared: SharedTables | None = None) -> None:
        """Open the env, the listing and the reader for registration `reg`: once, or in
        each serving process after the fork (an LMDB env never crosses a fork)."""
        self.reg = reg
        store = CacheStore(reg["cache_dir"], reg["map_size"])
        # The listing stays in the env: opening it reads one record, whatever its size.
        record = store.dataset_record(reg["dataset"])
        building = reg.get("building_gen")
        if building is not None and record.get("gen") == building:
            building = None  # a serving process forked after the listing completed
        if building is not None:
            # --list-in-background: serve the generation being written; a lookup or
            # readdir waits only until its own directory is listed (fs.py).
            record = {"gen": building}
        elif "gen" not in record:
            store.close()
            raise SilofsError(f"dataset {self.s.uri} has no saved listing")
        view = ListingView(store, reg["dataset"], record, building=building is not None)
        if self.first_gen is not None:
            # A serving process: what "listed when the mount started" means (fs.py
            # _keep_cache) is the same in every process, restarted ones included.
            view.first_gen = self.first_gen
        self.store = store
        self.reader = ChunkReader(
            store,
            self.client,
            dataset_id=reg["dataset"],
            chunk_size=reg["chunk_size"],
            buffer_bytes=self.s.buffer_bytes,
            readahead_bytes=self.s.readahead_bytes,
            head_bytes=2 * self.s.read_ahead_kb << 10,
            reregister=self._reregister,
        )
        # A cold read's chunks come in a fresh buffer each and leave the chunk buffer in
        # turn: as much freed heap as it holds is kept for the next ones (silofs/heap.py).
        heap.keep_freed(self.reader.buffer.max_bytes)
        # Where a dying opener's file may be held by another process (mount/waits.py).
        self.reader.waits.mountpoint = self.realpath
        self.reader.registered(self.mount_id, self.lru)
        look = Presentation(
            self.s.uid,
            self.s.gid,
            self.s.file_mode,
            self.s.dir_mode,
            self.s.attr_timeout if self.s.metadata_ttl is None else self.s.metadata_ttl,
        )
        if self._ops is None:
            self.fs = self._ops = SilofsFS(view, self.reader, look, shared)
        else:
            # A serving process: pyfuse3 keeps calling the Operations object it was
            # given before the fork (it has no call to replace it), so that object is
            # set up again, with nothing left of the one the supervisor closed.
            self._ops.__init__(view, self.reader, look, shared)  # type: ignore[misc]
            self.fs = self._ops
        self.fs.forget_attrs = _invalidate_attrs
        if shared is not None:
            self.fs.catch_up = self._catch_up

    def _close(self) -> None:
        if self.fs is not None:
            self.fs.listing.close()  # before the env closes
        if self.reader is not None:
            self.reader.close()
        self.fs = self.reader = self.store = None

    async def prepare_fork(self, ready: Callable[[str | None], None]) -> bool:
        """--serve-processes N: register, mount and answer INIT, then close everything
        a fork must not share (the env, the daemon connections). False if it failed
        (ready() was told why)."""
        try:
            reg = await self.register()
            self._open(reg)
            assert self.fs is not None
            # Each handler gives the device's read token back first (forked.py), then
            # brings the process up to the others' listing and numbers (fs.sync_first).
            forked.release_after_receive(sync_first(SilofsFS))
            quiet_forgotten_replies()
            pyfuse3.init(self.fs, self.s.mountpoint, self._options())
            self.device = mount_device(self.realpath)
        except (ControlError, SilofsError, RuntimeError, OSError) as exc:
            await self._goodbye()
            self._close()
            ready(_mount_error(exc, self.s.mountpoint))
            return False
        await forked.answer_init(self.fs)
        raise_read_ahead(self.realpath, self.s.read_ahead_kb)
        self.first_gen = self.fs.listing.first_gen
        log.info(
            "mounted %s at %s (%s, %s)",
            self.s.uri,
            self.s.mountpoint,
            count(self.fs.listing.files, "file"),
            count(self.s.serve_processes, "serving process", "serving processes"),
        )
        self._close()
        await self.client.aclose()
        return True

    async def serve_forked(self, shared: SharedTables) -> None:
        """One serving process, forked after INIT: its own env and daemon connections,
        the counters it served so far (its row: a restarted process continues it)."""
        self.shared = shared
        self.client = AsyncControlClient(
            self.socket_path, max_connections=32, timeout=self.s.daemon_timeout
        )
        self._open(self.reg, shared)
        assert self.reader is not None
        self.reader.counters = shared.own_counters()
        await self._serve(child=True)

    async def _serve(
        self, child: bool = False, ready: Callable[[str | None], None] | None = None
    ) -> None:
        _, older, oldest = gc.get_threshold()
        gc.set_threshold(GC_YOUNG, older, oldest)
        gc.freeze()
        unmount = True
        # A request withdrawn between trio's wakeup and pyfuse3's blocking read() must
        # not freeze this loop until the next request: the watcher run_mount started
        # interrupts that read (mount/unstick.py).
        unstick.arm()
        try:
            async with trio.open_nursery() as nursery:
                assert self.reader is not None
                self._nursery = nursery
                self.reader.start(nursery)
                if ready is not None:
                    nursery.start_soon(self._ready_after_init, ready)
                nursery.start_soon(self._report_loop)
                nursery.start_soon(self._child_signals if child else self._signals)
                if not child:
                    nursery.start_soon(self._end_when_unmounted)
                try:
                    await pyfuse3.main()
                except BaseException as exc:
                    # The kernel ended the session: ENODEV after an unmount, or
                    # ECONNABORTED when it aborted the connection (an unmount racing the
                    # next receive, fusermount -z, /sys/fs/fuse/connections/N/abort).
                    if not forked.is_disconnected(exc):
                        raise
                    log.info("the kernel ended the FUSE session: %s", first_leaf(exc))
                unmount = self.unmount_at_end  # else the kernel already unmounted us
                nursery.cancel_scope.cancel()
        finally:
            # Ended: nothing may start in the nursery now, and a daemon that restarted
            # since the last report is not told of a mount that is gone (_report).
            self._nursery = None
            if child:
                # The next process reads ENODEV in turn; the supervisor unmounts (once)
                # and says goodbye; this one's counters go into the sum.
                forked.give_token()
            else:
                # Never unmount what another mount put at our path since.
                pyfuse3.close(unmount=unmount and mounted_here(self.device))
            with trio.CancelScope(shield=True):
                with trio.move_on_after(FINAL_REPORT_SECONDS):
                    await self._report()
                if not child:
                    await self._goodbye()
            self._close()
            if not child:
                log.info("unmounted %s", self.s.mountpoint)

    async def _ready_after_init(self, ready: Callable[[str | None], None]) -> None:
        """Once pyfuse3.main() has answered the kernel's INIT: raise the bdi read-ahead
        (raise_read_ahead: not before the INIT reply) and tell `silofs mount` the mount
        is ready, so a file its caller opens next reads with the raised read-ahead."""
        assert self.fs is not None
        await self.fs.initialized.wait()
        # init() runs inside libfuse's INIT handling, before its reply: this task runs
        # only after pyfuse3's loop yields, which is after the reply went out.
        await trio.lowlevel.checkpoint()
        raise_read_ahead(self.realpath, self.s.read_ahead_kb)
        log.info(
            "mounted %s at %s (%s)",
            self.s.uri,
            self.s.mountpoint,
            count(self.fs.listing.files, "file"),
        )
        try:
            ready(None)
        except OSError as exc:
            _caller_gone(exc, self.s.mountpoint)
            self.unmount_at_end = True
            await self._terminate("its silofs mount went away")

    async def _child_signals(self) -> None:
        """A serving process: SIGTERM ends it (the supervisor replaces it, or is
        unmounting); SIGHUP reopens the log, as the supervisor does."""
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
            async for signum in sigs:
                if signum == signal.SIGHUP:
                    reopen_log_files()
                    continue
                self.signalled = True  # not the unmount: the supervisor replaces it
                assert self._nursery is not None
                self._nursery.cancel_scope.cancel()
                return

    async def _signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
            async for signum in sigs:
                if signum == signal.SIGHUP and not _has_terminal():
                    # No terminal to hang up (the background mount process, a unit): a
                    # SIGHUP is logrotate's postrotate. Reopen the log; never unmount.
                    files = reopen_log_files()
                    log.info("received SIGHUP: %s", ", ".join(files) or "no log file; ignored")
                    continue
                # SIGHUP of a terminal that closed ends it, as libfuse does. A signal
                # ends the mount with the process, as rclone's and gcsfuse's do: a dead
                # mountpoint (ENOTCONN until someone unmounts it) helps nobody.
                self.unmount_at_end = True
                await self._terminate("the signal")
                return

    async def _terminate(self, why: str) -> None:
        """End serving: pyfuse3.terminate() stops receiving, but pyfuse3.main() still
        waits for every handler in flight; past the grace they are cancelled (the
        caller is cancelled first if main() returns)."""
        pyfuse3.terminate()
        await trio.sleep(TERM_GRACE_SECONDS)
        log.warning(
            "requests still in flight %.0f s after %s: cancelling them", TERM_GRACE_SECONDS, why
        )
        assert self._nursery is not None
        self._nursery.cancel_scope.cancel()

    async def _end_when_unmounted(self) -> None:
        """End once this mount has left this namespace's mount table and nothing is open
        in it. The kernel ends the session only when the last copy of the mount goes: a
        copy in another mount namespace (any unshare or `ip netns exec` run while it was
        mounted) outlives `silofs unmount` here, and this process would wait, serving
        nobody, for as long as that namespace lives. A lazily detached mount still
        serves the files open in it until the last is closed."""
        if self.device is None:
            return
        try:
            with open(MOUNT_TABLE, "rb") as table:  # opened first: no change is missed
                while mounted_here(self.device):
                    await trio.to_thread.run_sync(_wait_for_change, table, abandon_on_cancel=True)
        except Exception as exc:  # noqa: BLE001 - the kernel's ENODEV still ends the mount
            unforeseen("watching the mount table", exc)
            return
        assert self.fs is not None
        while self.fs.open_handles():
            await trio.sleep(DETACHED_POLL_SECONDS)
        log.info("%s is no longer mounted here and nothing is open in it", self.s.mountpoint)
        await self._terminate("the unmount")

    async def _report_loop(self) -> None:
        last = None
        reported = trio.current_time()
        while True:
            await trio.sleep(0.25)
            assert self.reader is not None and self.fs is not None
            try:
                self.fs.listing.release_if_idle()
                await self._follow_listing()
                now = dataclasses.astuple(self._counters_to_report())
                if now != last or trio.current_time() - reported >= IDLE_REPORT_SECONDS:
                    await self._report()
                    last = now
                    reported = trio.current_time()
            except Exception as exc:  # noqa: BLE001 - one round's failure; the next tries again
                unforeseen("the mount's report loop", exc)

    async def _follow_listing(self) -> None:
        """Move to a newer listing generation once the daemon has written one (a refresh,
        or a metadata TTL that expired). One record read per report period."""
        assert self.fs is not None and self.store is not None
        m = self.fs.listing
        record = self.store.dataset_record(m.dsid)
        gen = record.get("gen")
        # After a failed listing (m.failed) the next one may write the same generation
        # number again (none was recorded): a record naming it is that listing, whole.
        if gen is not None and (gen != m.gen or m.building or m.failed):
            if gen == m.gen or not m.building:
                before = m.reader
                stale = self.fs.switch(record)  # a newer listing, or ours is complete now
                await self._after_switch(before, stale)
        if self.fs.stale_inodes:
            inodes, self.fs.stale_inodes = self.fs.stale_inodes, []
            await trio.to_thread.run_sync(_invalidate_attrs, inodes)
        if m.building and gen != m.gen:
            try:
                ds = await self.client.json("GET", f"/v1/datasets/{m.dsid}")
            except ControlError:
                return
            if ds.get("state") == "error":
                log.error("listing failed: %s", ds.get("error"))
                m.listing_failed()
        ttl = self.s.metadata_ttl
        if ttl is not None and not self._relisting and time.monotonic() >= self._relist_after:
            listed_at = record.get("listed_at", 0)
            now = time.monotonic()
            if self._listing_seen[0] != listed_at:
                self._listing_seen = (listed_at, now)
            age = listing_age(float(listed_at), time.time(), now - self._listing_seen[1])
            if age > ttl:
                assert self._nursery is not None
                self._relisting = True
                self._nursery.start_soon(self._relist)

    async def _after_switch(self, before: ListingReader, stale: list[Entry]) -> None:
        """Tell the kernel what a switch() from listing `before` changed."""
        assert self.fs is not None
        m = self.fs.listing
        if stale:
            log.info("the new listing changed %d recently used entries", len(stale))
            # The root has no name to forget.
            names = [(e.inode, e.parent, e.name if e.inode != e.parent else None) for e in stale]
            await trio.to_thread.run_sync(_invalidate, names)
        # One walk per mount: serving processes share the kernel connection,
        # whose entries any one of them can invalidate.
        walker = self.shared is None or self.shared.index == 0
        if m.reader is not before and m.previous is before and walker:
            self._forget_changed(before, m.reader)

    def _catch_up(self) -> None:
        """With serving processes: another one switched to a newer listing (the versions
        table says so, mount/shared.py); this one switches now, inside the request that
        noticed (fs.py _sync_shared), so no process answers a path under the listing
        before (its old number, its old version) once any answers it under the new. The
        kernel is told in a task of its own: an invalidation waits for the directory's
        lock, which a LOOKUP being answered holds."""
        assert self.fs is not None and self.store is not None and self._nursery is not None
        m = self.fs.listing
        record = self.store.dataset_record(m.dsid)
        gen = record.get("gen")
        if gen is None or gen <= m.gen or m.building:
            return
        before = m.reader
        stale = self.fs.switch(record)
        log.info("listing %d: switched to as another serving process did", gen)
        self._nursery.start_soon(self._after_switch, before, stale)

    def _forget_changed(self, old: ListingReader, new: ListingReader) -> None:
        """Start telling the kernel to forget every file `new` changed or dropped, not
        only those switch() found among the recently used entries: the kernel keeps names
        and attributes for the entry timeout (an hour with an indefinite metadata TTL), and
        would serve a changed file cut at its old size, or a deleted one, long after a
        refresh. A walk still running for an older switch stops (the daemon deletes its
        old generation once a newer listing begins anyway): a file it had not reached
        keeps its kernel entry until the timeout, unless this switch changed it too."""
        if self._forgetting is not None:
            self._forgetting.cancel()
        assert self._nursery is not None
        self._forgetting = trio.CancelScope()
        self._nursery.start_soon(self._forget_walk, old, new, self._forgetting)

    async def _forget_walk(
        self, old: ListingReader, new: ListingReader, scope: trio.CancelScope
    ) -> None:
        # In bounded batches, each a short read txn in a worker thread (rows compared
        # raw, ~1.6 us each), so the serving thread and the daemon's writer are not held.
        assert self.store is not None
        store = self.store

        def batch(row: bytes | None) -> tuple[list[tuple[int, int, bytes | None]], bytes | None]:
            with store.read_txn() as txn:
                return changed_entries(txn, old, new, row, FORGET_BATCH)

        row: bytes | None = None
        forgotten = 0
        with scope:
            try:
                while True:
                    changed, row = await trio.to_thread.run_sync(batch, row)
                    if changed:
                        if self.fs is not None:  # under the numbers the kernel knows
                            k = self.fs.kernel_inode
                            changed = [(k(ino), parent, name) for ino, parent, name in changed]
                        await trio.to_thread.run_sync(_invalidate, changed)
                        forgotten += len(changed)
                    if row is None:
                        break
            except Exception as exc:  # noqa: BLE001 - best effort: never end the mount
                log.warning("after a refresh: kernel entries not all refreshed: %s", exc)
        if forgotten:
            log.info("told the kernel to forget %d changed or deleted entries", forgotten)

    async def _relist(self) -> None:
        """Ask the daemon to list again (the metadata TTL expired); it lists once however
        many mounts ask, and this mount follows the new generation when it is written."""
        try:
            body = {"uri": self.s.uri, "refresh": True, "endpoint_url": self.s.endpoint_url}
            ds = await self.client.json("POST", "/v1/datasets", body)
            while ds["state"] in ("checking", "listing"):
                await trio.sleep(0.25)
                ds = await self.client.json("GET", f"/v1/datasets/{ds['id']}")
        except ControlError as exc:
            if exc.status != 429:
                log.warning("could not refresh the listing: %s", exc)
                return
            # Refused for now (min_refresh_seconds between users' refreshes, or a per-user
            # limit): asked again when the answer says, not at every report tick; said once.
            wait = relist_wait(exc.message)
            self._relist_after = time.monotonic() + wait
            if not self._relist_limited:
                self._relist_limited = True
                log.info("the daemon refused a refresh for now (asked again in %gs): %s",
                         wait, exc)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - the next expiry asks again
            unforeseen("asking the daemon to refresh the listing", exc)
        finally:
            self._relisting = False

    def _counters_to_report(self) -> MountCounters:
        """This process's counters; with serving processes, the sum of all of them (each
        row only grows, so the sums only grow): status counts each byte once.

        The report loop compares these sums, not this process's own counters: the
        daemon keeps whichever report came last, and a report another process computed
        before this one's final reads may land after this one's. Every process re-reports
        when the sum moves, so each one's last report carries the final sum."""
        assert self.reader is not None
        if self.shared is None:
            return self.reader.counters
        self.shared.publish(self.reader.counters)
        return self.shared.total()

    async def _report(self) -> None:
        if self.reader is None or not self.registered:
            return
        touched, self.reader.touched = self.reader.touched, []
        counters = self._counters_to_report()
        body = {
            **dataclasses.asdict(counters),
            "touched": [k.hex() for k in touched],
        }
        if self.fs is not None and self.fs.listing.gen is not None:
            # The generation this process serves: the daemon keeps it until it moves on.
            body["gen"] = self.fs.listing.gen
        if self.shared is not None:
            # Another serving process reads a handle's entry from the generation it was
            # opened in (fs.py _adopt): deleted, a read of it there was EIO. The newest
            # MAX_HELD if ever more (the daemon's limit).
            held = sorted(self.shared.open_generations() - {body.get("gen")})
            body["held"] = held[-MAX_HELD:]
        try:
            answer = await self.client.json("PUT", f"/v1/mounts/{self.mount_id}/stats", body)
            self.reader.track_hits = answer.get("admission") == "lru"
        except ControlError as exc:
            log.debug("could not report counters: %s", exc)
            if exc.status == 404 and not self._registering and self._nursery is not None:
                # The daemon restarted. A mount serving only hits never sends a miss, so
                # this is where it finds out and introduces itself again (while it
                # serves: its final report's counters are simply dropped).
                try:
                    await self._reregister()
                except MissError as again:
                    log.warning("%s", again)

    async def _goodbye(self) -> None:
        if self.registered:
            try:
                with trio.move_on_after(2):
                    await self.client.json("DELETE", f"/v1/mounts/{self.mount_id}")
            except ControlError:
                pass


def _caller_gone(exc: OSError, mountpoint: str) -> None:
    """The `silofs mount` waiting for this mount's "ready" is gone (killed, interrupted:
    EPIPE): it told its caller the mount failed, so the mount ends, cleanly."""
    log.warning(
        "the silofs mount that started this mount is gone (%s): unmounting %s",
        exc.strerror or exc,
        mountpoint,
    )


def mount_device(target: str) -> str | None:
    """The "major:minor" of the newest FUSE mount at `target` (resolved), if any."""
    for entry in reversed(mounts()):
        if entry.mountpoint == target and entry.fstype.startswith("fuse"):
            return entry.device
    return None


def mounted_here(device: str | None) -> bool:
    """Whether the mount `device` is still in this namespace's mount table (at any
    path: a bind mount of it counts). Unknown devices count as mounted."""
    return device is None or any(e.device == device for e in mounts(MOUNT_TABLE))


def _wait_for_change(table: BinaryIO) -> None:
    """Block until the mount table changes (the kernel marks an open mountinfo file
    exceptional on every mount or unmount in the namespace), or a while passes."""
    select.select([], [], [table], 30.0)


def _invalidate(names: list[tuple[int, int, bytes | None]]) -> None:
    """Tell the kernel to forget attributes and names that a new listing changed:
    (inode, parent, name) each, the name forgotten only where one is given. Runs in a
    thread: a notification can block until the kernel is done with a request this
    process has to answer."""
    for ino, parent, name in names:
        try:
            pyfuse3.invalidate_inode(ino, attr_only=True)
        except OSError as exc:  # ENOENT: the kernel did not have it
            log.debug("invalidating inode %d: %s", ino, exc)
        if name is not None:
            try:
                pyfuse3.invalidate_entry(parent, name)
            except OSError as exc:
                log.debug("invalidating %r in inode %d: %s", name, parent, exc)


def _invalidate_attrs(inodes: list[int]) -> None:
    for ino in inodes:
        try:
            pyfuse3.invalidate_inode(ino, attr_only=True)
        except OSError as exc:
            log.debug("invalidating inode %d: %s", ino, exc)


def _mount_error(exc: BaseException, mountpoint: str) -> str:
    if isinstance(exc, RuntimeError) and "fuse" in str(exc).lower():
        refusal = fuse_device_refusal(mountpoint)
        if refusal is not None:
            return refusal
        return (
            f"cannot mount at {mountpoint}: {exc} (is /dev/fuse available and the "
            "mountpoint an empty, unmounted directory?)"
        )
    return str(exc)


def run_mount(
    settings: MountSettings, socket_path: str, ready: Callable[[str | None], None]
) -> None:
    mp = MountProcess(settings, socket_path)
    watcher = unstick.spawn(os.getpid())  # this process, or the serving ones it forks
    try:
        if settings.serve_processes <= 1:
            trio.run(mp.run, ready)
            return
        if trio.run(mp.prepare_fork, ready):
            Supervisor(mp, socket_path).run(ready)
    finally:
        unstick.stop(watcher)


class _Stop(Exception):
    pass


class Supervisor:
    """--serve-processes N: the process that mounted, after INIT. Serves nothing (so each
    fork is a copy of the state right after INIT, a replacement too), holds no env and
    no socket; forks the serving processes, replaces one that dies, unmounts once."""

    def __init__(self, mp: MountProcess, socket_path: str) -> None:
        self.mp = mp
        self.socket_path = socket_path
        self.n = mp.s.serve_processes
        self.shared = SharedTables(self.n)
        self.token = forked.ReadToken()
        self.fd = forked.fuse_fd()
        self.children: dict[int, int] = {}  # pid -> index
        self.deaths: deque[float] = deque()

    def _spawn(self, index: int) -> None:
        pid = os.fork()
        if pid:
            self.children[pid] = index
            return
        code = 0
        try:
            _die_with_parent()
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
                signal.signal(sig, signal.SIG_DFL)
            forked.clone_device(self.fd)
            self.shared.index = index
            trio.run(self.mp.serve_forked, self.shared)
            if self.mp.signalled:
                code = 3  # exit status 0 means "the kernel unmounted us" to run()
        except BaseException as exc:  # noqa: BLE001 - the process ends here either way
            if not forked.is_disconnected(exc):
                log.error("serving process %d failed: %r", os.getpid(), exc)
                code = 1
        finally:
            forked.give_token()
        forked.child_exit(code)

    def run(self, ready: Callable[[str | None], None]) -> None:
        forked.install(self.token)

        def stop(*_: object) -> None:
            raise _Stop

        def hangup(*_: object) -> None:
            if _has_terminal():
                raise _Stop
            reopen_log_files()
            for pid in self.children:
                os.kill(pid, signal.SIGHUP)

        # Told first: the ready pipe must not be inherited by the serving processes (the
        # `silofs mount` parent reads it to EOF when something fails). Requests wait in
        # the kernel until the first serving process reads them.
        try:
            ready(None)
        except OSError as exc:
            _caller_gone(exc, self.mp.s.mountpoint)
            self._end(unmount=True)
            return
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGHUP, hangup)
        unmounted = False
        try:
            for i in range(self.n):
                self._spawn(i)
            while self.children:
                ended = self._next_exit()
                if ended is None:
                    log.info("%s is no longer mounted here and nothing is open in it",
                             self.mp.s.mountpoint)  # fmt: skip
                    break
                pid, status = ended
                index = self.children.pop(pid)
                if self.token.recover(pid):
                    log.info("serving process %d held the device's read token: put back", pid)
                if os.waitstatus_to_exitcode(status) == 0:
                    unmounted = True  # it read ENODEV: the kernel unmounted us
                if unmounted:
                    continue
                now = time.monotonic()
                self.deaths.append(now)
                while self.deaths and now - self.deaths[0] > RESTART_WINDOW:
                    self.deaths.popleft()
                if len(self.deaths) > MAX_RESTARTS:
                    log.error(
                        "%s died within %.0f s: unmounting %s",
                        count(len(self.deaths), "serving process", "serving processes"),
                        RESTART_WINDOW,
                        self.mp.s.mountpoint,
                    )
                    break
                log.warning(
                    "serving process %d ended (%s): starting another",
                    pid,
                    _status_text(status),
                )
                self._spawn(index)
        except _Stop:
            pass
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
            self._end(unmount=not unmounted)

    def _next_exit(self) -> tuple[int, int] | None:
        """The next serving process to end (pid, wait status); None once the mount has
        left this namespace's mount table with nothing open in it (a copy in another
        namespace keeps the connection: MountProcess._end_when_unmounted)."""
        detached = False
        with open(MOUNT_TABLE, "rb") as table:  # opened first: no change is missed
            changed = True
            while True:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid in self.children:
                    return pid, status
                if pid:
                    continue  # not a serving process (the watcher of mount/unstick.py)
                if changed and not detached:
                    detached = not mounted_here(self.mp.device)
                if detached and self.shared.open_handles() == 0:
                    return None
                changed = bool(select.select([], [], [table], DETACHED_POLL_SECONDS)[2])

    def _end(self, unmount: bool) -> None:
        # Unmounted, the serving processes read ENODEV and end. A mount detached lazily
        # while a reader holds a file stays connected as long as any of them holds the
        # device: those get SIGTERM, and the last one's exit aborts the connection.
        pyfuse3.close(unmount=unmount and mounted_here(self.mp.device))
        start = time.monotonic()
        termed = False
        while self.children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid:
                self.children.pop(pid, None)
                self.token.recover(pid)
                continue
            if not termed and time.monotonic() - start > CHILD_TERM_SECONDS:
                termed = True
                for pid in self.children:
                    os.kill(pid, signal.SIGTERM)
            if time.monotonic() - start > CHILD_EXIT_SECONDS:
                for pid in self.children:
                    log.warning("serving process %d did not end: killing it", pid)
                    os.kill(pid, signal.SIGKILL)
                for pid in list(self.children):
                    os.waitpid(pid, 0)
                self.children.clear()
                break
            time.sleep(0.02)
        trio.run(self._goodbye)
        log.info("unmounted %s", self.mp.s.mountpoint)

    async def _goodbye(self) -> None:
        mp = self.mp
        mp.client = AsyncControlClient(self.socket_path, max_connections=2, timeout=5)
        try:
            with trio.move_on_after(5):
                body = {**dataclasses.asdict(self.shared.total()), "touched": []}
                await mp.client.json("PUT", f"/v1/mounts/{mp.mount_id}/stats", body)
        except ControlError as exc:
            log.debug("could not report counters: %s", exc)
        await mp._goodbye()
        await mp.client.aclose()


class ForgottenReplies(logging.Filter):
    """pyfuse3 logs at ERROR every answer the kernel refused. ENOENT means the kernel no
    longer waited for it: the request was interrupted, or the connection was aborted
    (an unmount racing a RELEASE). The handler's work is done and nobody is owed an
    answer, so that one is said at INFO; every other refusal stays an ERROR."""

    ENOENT_TEXT = os.strerror(errno.ENOENT)

    def filter(self, record: logging.LogRecord) -> bool:
        if (
            record.levelno == logging.ERROR
            and "fuse_reply_* failed" in str(record.msg)
            and isinstance(record.args, tuple)
            and self.ENOENT_TEXT in record.args
        ):
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg = str(record.msg) + " (the kernel no longer waited for the answer)"
        return True


def quiet_forgotten_replies() -> None:
    """Install ForgottenReplies on pyfuse3's logger, once."""
    logger = logging.getLogger("pyfuse3")
    if not any(isinstance(f, ForgottenReplies) for f in logger.filters):
        logger.addFilter(ForgottenReplies())


def _die_with_parent() -> None:
    """A serving process ends with its supervisor (kill -9 included): the connection is
    then aborted and readers get ENOTCONN, as with one process, instead of a mount
    nobody can unmount cleanly."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:
        os._exit(1)


def _status_text(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"exit status {os.waitstatus_to_exitcode(status)}"


def _has_terminal() -> bool:
    """Whether this process has a controlling terminal (a foreground mount)."""
    try:
        os.close(os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY))
        return True
    except OSError:
        return False
