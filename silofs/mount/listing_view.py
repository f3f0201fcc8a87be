"""A mount's view of its dataset's listing: lookups in the shared LMDB directory index.

Owns what lookup/getattr/readdir need from one listing generation (cache/listing.py):
'.' and '..', a bounded cache of recently used entries, the path of an inode, the
listing's totals, moving to a newer generation when the daemon lists again, and which
entries of the old generation the kernel must forget then (changed_entries). The
listing itself stays in the env, once per node, so a mount's memory does not grow with
the object count. Never does network I/O, never writes LMDB, and never keeps an LMDB
buffer past the call that read it (entries are decoded copies).
"""

from __future__ import annotations

import logging
import struct
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator

import lmdb
import trio

from silofs.cache.listing import (
    DIR,
    DIRENT,
    FILE_HEAD,
    INO,
    LISTING_FORMAT,
    ROOT_INODE,
    Entry,
    ListingReader,
    dirent_name,
)
from silofs.cache.rows import DECODE_ERRORS
from silofs.cache.store import CacheStore
from silofs.errors import SilofsError
from silofs.units import count

log = logging.getLogger(__name__)

__all__ = ["ROOT_INODE", "Entry", "ListingView", "changed_entries"]

RENEW_SECONDS = 0.5
# How often a lookup waiting for a directory of a listing still being written looks for
# the directory's "complete" row (one LMDB get in a fresh snapshot).
LISTED_POLL_SECONDS = 0.1
CACHE_ENTRIES = 8192  # decoded entries kept per mount (~200 B each): bounded, not per object


class ListingView:
    """The generation of one dataset's listing a mount serves, read through its snapshot."""

    def __init__(
        self,
        store: CacheStore,
        dsid: int,
        record: dict,
        cache_entries: int = CACHE_ENTRIES,
        building: bool = False,
    ) -> None:
        # True while serving a generation the daemon is still writing: a miss may be a
        # name not listed yet, so the FUSE side waits (wait_listed) instead of ENOENT.
        self.building = building
        # The generation being written when its listing failed (listing_failed): what
        # it holds is served, but a directory it never completed is partial.
        self.failed = False
        self.completed = trio.Event()
        if not building:
            self.completed.set()
        if not building and record.get("listing_format") != LISTING_FORMAT:
            # Rows of another shape (a daemon of another silofs wrote them): misread,
            # they would serve wrong names and sizes.
            raise SilofsError(
                f"the listing of dataset {dsid} was written by another silofs version "
                f"(listing format {record.get('listing_format', 1)}, this one reads "
                f"{LISTING_FORMAT}): restart the daemon with this version"
            )
        self.store = store
        self.dsid = dsid
        self.cache_entries = cache_entries
        self._cache: OrderedDict[int, Entry] = OrderedDict()
        self._txn: lmdb.Transaction | None = None
        self._txn_at = 0.0
        self.previous: ListingReader | None = None
        self.reader = self._use(record)
        self.first_gen = self.reader.gen

    def _use(self, record: dict) -> ListingReader:
        self.record = record
        self.gen = int(record["gen"])
        self.files = int(record.get("objects", 0))
        self.total_bytes = int(record.get("size", 0))
        self.inode_count = int(record.get("inodes", 1))
        self.ordinals = int(record.get("ordinals", self.files))
        self.shadowed = list(record.get("shadowed_keys", []))
        self.skipped = list(record.get("skipped_keys", []))
        self._cache.clear()
        return self.store.listing(self.dsid, self.gen)

    def switch(self, record: dict, used: Iterable[Entry] = ()) -> list[Entry]:
        """Serve the newer generation `record` names from now on. Handles already open
        keep their ObjectInfo (their version); the previous generation stays readable
        for getattr of inodes the kernel still holds until the daemon deletes it.
        Returns the recently used entries that changed or went away: the kernel may
        cache them, and the caller invalidates them. `used`: entries used recently that
        this view may not keep (the mount's hot records, fs.py), compared as well."""
        recent = list(self._cache.values())
        recent += [e for e in used if e.inode not in self._cache]
        self.failed = False  # a whole listing from now on
        if self.building and int(record["gen"]) == self.gen:
            self.building = False  # the generation we served is complete: same inodes
            self._use(record)
            self.completed.set()
            self._txn_at = 0.0
            return []
        self.previous = self.reader
        self.reader = self._use(record)
        self._txn_at = 0.0  # the next operation reads a snapshot that has `record`
        log.info("listing generation %d: %s", self.gen, count(self.files, "file"))
        self.renew()
        stale = []
        for old in recent:
            new = self.reader.get(self.txn, old.inode)
            if new is None or (new.size, new.mtime, new.version, new.aux) != (
                old.size,
                old.mtime,
                old.version,
                old.aux,
            ):
                stale.append(old)
        return stale

    def listing_failed(self) -> None:
        """The listing being served will not complete: waits end, and a directory it did
        not complete is unfinished() (EIO), never passed off as whole (a store failing on
        page 3 showed the first pages as the whole bucket: ENOENT for every name after,
        an empty or partial readdir) until a listing that completes is switched to."""
        self.building = False
        self.failed = True
        self.completed.set()

    def unfinished(self, directory: int, *, settled: bool = False) -> bool:
        """Whether `directory` is one the failed listing being served did not complete
        (with `settled`, or left a subdirectory of tentative): a missing name or a
        readdir there cannot be answered. False whenever the listing is whole."""
        if not self.failed:
            return False
        return not self._ready(directory, settled)

    async def wait_listed(
        self, directory: int | None = None, *, name: bytes | None = None, settled: bool = False
    ) -> bool:
        """While the generation is being written, wait until `directory` has all its
        entries (the builder's "complete" row, written when the listing has listed that
        prefix; with `settled`, also no tentative subdirectory, so a readdir shows only
        names the finished listing has), or has `name`, or the whole generation is
        complete; True if it waited or the directory was ready (the caller looks again,
        in a fresh snapshot), False if nothing was being written. Never a missing name
        because the listing is behind: only the directory's own rows, or the whole
        listing, end the wait. (A serial listing completes the root only at its end:
        without `name`, a lookup there would wait for all of it.)"""
        if not self.building:
            return False
        while self.building:
            if directory is not None and self._ready(directory, settled, name):
                break
            with trio.move_on_after(LISTED_POLL_SECONDS):
                await self.completed.wait()
        self._txn_at = 0.0  # look in a snapshot that holds what was waited for
        return True

    async def wait_resolved(self, parent: int, directory: int) -> bool:
        """While the generation is being written and directory `directory` in `parent` is
        tentative (made from a listed prefix, no object under it yet: it may hold only
        'dir/' markers and go), wait until it holds an object, is removed, or the listing
        ends. True if it waited (the caller looks the name up again: gone means the
        finished listing does not have it), False if there was nothing to wait for.
        The first look is in the snapshot the caller's lookup used: in a fresher one the
        directory may have been removed since, and "not tentative" would then pass off
        the caller's stale entry as final."""
        if not self.building or not self._tentative(parent, directory, fresh=False):
            return False
        while self.building and self._tentative(parent, directory):
            with trio.move_on_after(LISTED_POLL_SECONDS):
                await self.completed.wait()
        self._cache.pop(directory, None)
        self._txn_at = 0.0
        return True

    def _ready(self, directory: int, settled: bool, name: bytes | None = None) -> bool:
        self._txn_at = 0.0  # a fresh snapshot: the row may have been written just now
        self.renew()
        if name is not None and self.reader.child(self.txn, directory, name) is not None:
            return True
        if settled:
            return self.reader.settled(self.txn, directory)
        return self.reader.complete(self.txn, directory)

    def _tentative(self, parent: int, directory: int, fresh: bool = True) -> bool:
        if fresh:
            self._txn_at = 0.0
            self.renew()
        return self.reader.tentative(self.txn, parent, directory)

    # -- the read txn --------------------------------------------------------------
    def renew(self) -> None:
        """Call at the start of each FUSE operation: a fresh snapshot if this one is older
        than RENEW_SECONDS. A generation's rows never change once its record is written,
        and are deleted only when the next listing starts (long after this mount moved
        on), so an older snapshot answers the same; renewing less often saves the
        txn churn, and bounding the age keeps the writer from growing the map."""
        now = time.monotonic()
        if self._txn is not None:
            if now - self._txn_at < RENEW_SECONDS:
                return
            self._txn.abort()
        self._txn_at = now
        # Entries are decoded copies: no buffers, nothing refers into the map.
        self._txn = self.store.snapshot(buffers=False)

    def release_if_idle(self) -> None:
        """Drop a snapshot no operation would use again (older than RENEW_SECONDS): an
        open snapshot keeps LMDB from reusing pages freed after it began (reader.py does
        the same for chunk reads). Entries are decoded copies, so nothing refers to it."""
        if self._txn is not None and time.monotonic() - self._txn_at >= RENEW_SECONDS:
            self._txn.abort()
            self._txn = None

    @property
    def txn(self) -> lmdb.Transaction:
        if self._txn is None:
            self.renew()
        assert self._txn is not None
        return self._txn

    def close(self) -> None:
        if self._txn is not None:
            self._txn.abort()
            self._txn = None

    # -- lookups -------------------------------------------------------------------
    def get(self, inode: int) -> Entry | None:
        """The inode in the current generation: a recently used entry, else read in a
        snapshot at most RENEW_SECONDS old (renewed here: a caller that finds the entry
        kept pays no clock read)."""
        e = self._cache.get(inode)
        if e is not None:
            self._cache.move_to_end(inode)
            return e
        self.renew()
        e = self.reader.get(self.txn, inode)
        if e is None:
            return None
        self._remember(e)
        return e

    def get_any(self, inode: int) -> Entry | None:
        """The inode in the current generation, else in the previous one (an inode the
        kernel learnt before a refresh, e.g. fstat of a file open since then)."""
        e = self.get(inode)
        if e is None and self.previous is not None:
            e = self.previous.get(self.txn, inode)
        return e

    def _remember(self, e: Entry) -> None:
        self._cache[e.inode] = e
        if len(self._cache) > self.cache_entries:
            self._cache.popitem(last=False)

    def lookup(self, parent: int, name: bytes) -> Entry | None:
        # Every LOOKUP of a name the kernel does not know comes here: get() and
        # _remember() written out.
        cache = self._cache
        node = cache.get(parent)
        if node is not None:
            cache.move_to_end(parent)
        else:
            node = self.get(parent)
        if node is None or not node.is_dir:
            return None
        if name == b"." or name == b"..":
            return node if name == b"." else self.get(node.parent)
        txn = self._txn if self._txn is not None else self.txn  # renewed by the caller
        e = self.reader.lookup(txn, parent, name, node.path)
        if e is not None:
            cache[e.inode] = e
            if len(cache) > self.cache_entries:
                cache.popitem(last=False)
        return e

    def children(
        self, parent: int, after: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes, int]]:
        """(position key, name, inode) of a directory's entries after position `after`."""
        return self.reader.children(self.txn, parent, after)

    def names(self, inode: int) -> list[bytes]:
        """Every name in a directory, in readdir order (tests and small directories)."""
        return [name for _, name, _ in self.children(inode)]

    def path(self, node: Entry) -> str:
        return node.path.decode("utf-8", "surrogateescape")


# A file row's bytes that a refresh keeps when the file did not change: all but `since`
# and `ordinal` (the tail of the FILE_HEAD header), which a new listing may renumber.
_SAME_HEAD = struct.calcsize("<QBQd")


def changed_entries(
    txn: lmdb.Transaction,
    old: ListingReader,
    new: ListingReader,
    start: bytes | None = None,
    limit: int = 10_000,
) -> tuple[list[tuple[int, int, bytes | None]], bytes | None]:
    """Entries of generation `old` that the kernel may hold and `new` contradicts, among
    up to `limit` rows from row `start` (a row as in iter_file_rows): a file `new` lists
    with other attributes or version, or not at all, or as a directory; a directory
    `new` does not list as the same directory (gone, a file now, another inode). Each
    as (inode, parent, name), the name only for one that is gone from that name; and
    where to go on (None: done). Raw rows compared (the same key in both generations),
    no Entry built: a mount runs this over a whole listing after a refresh."""
    prefix, other = old.rows.prefix, new.rows.prefix
    n = len(prefix)
    cur = txn.cursor(db=old.dirents)
    out: list[tuple[int, int, bytes | None]] = []
    if not cur.set_range(prefix + (start or INO.pack(ROOT_INODE))):
        return out, None
    seen = 0
    for key, v in cur:
        k = bytes(key)  # a view with a buffers=True txn, as a mount's
        if not k.startswith(prefix):
            return out, None
        if seen >= limit:
            return out, k[n:]
        seen += 1
        if len(v) < DIRENT.size or len(k) < n + INO.size:
            continue  # a damaged row (cache/rows.py): no entry the kernel was given
        now = txn.get(other + k[n:], db=new.dirents)
        gone = True  # the name no longer leads to this entry
        # Still a file, or still a directory, and the same inode: a name that leads to
        # another inode (a collision probed on, a listing of older inode numbering) is
        # forgotten, or the kernel keeps opening the old one, which the new listing lacks.
        if now is not None and now[8] == v[8] and now[:8] == v[:8]:
            if v[8] == DIR:
                # A directory's own attributes (nlink) are the recently used entries'
                # care (fs.switch); here only a name that no longer leads to it.
                continue
            if now[:_SAME_HEAD] == v[:_SAME_HEAD] and now[FILE_HEAD.size :] == v[FILE_HEAD.size :]:
                continue
            gone = False  # the same name, other attributes
        try:
            name = dirent_name(k, n + INO.size, v) if gone else None
        except DECODE_ERRORS:
            name = k[n + INO.size :]  # a damaged file row: the key's own name part
        out.append((DIRENT.unpack_from(v)[0], INO.unpack_from(k, n)[0], name))
    return out, None
