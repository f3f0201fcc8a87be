"""The LMDB environment of a cache dir: its databases, and what both processes read there.

Owns the databases of a cache dir (their names and row keys) and the read side every
process shares:
  chunks    chunk key (16 B)            -> encoded chunk (format.py)
  owners    dataset id (8 B) + chunk key -> data length (u32): who is charged for it
  usage     dataset id                   -> (bytes, chunks) charged to the dataset
  datasets  dataset id                   -> JSON record (uri, objects, size, listed_at)
  names     canonical URI                -> dataset id
  dirents   dataset id + generation + parent inode + name -> inode, kind   (listing.py)
  inodes    dataset id + generation + inode -> attributes, path, version, content id
  objects   (before listing generations: dataset id + object key -> JSON; rows are
            deleted when their dataset is next listed, never written any more)
  meta      name                         -> JSON (format version, allocations, ...)
  stale     dataset id + chunk key       -> b"": its first eviction victims
Only the daemon writes, from one thread at a time (node/store_write.py, through the
Writer): a chunk, its owners row and its usage change in one write txn, so a reader
never sees accounting drift from content, even across kill -9. Mount processes open the
same env read-only (this class). Never writes the env.

Chunk values are found through bounds.py's ValueCursor (get_value, value_cursor) and
never with a bare get(): a damaged node must cost a refetch, not a SIGBUS. For the same
reason the daemon keeps data.mdb as large as the map (sparse).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from dataclasses import dataclass

import lmdb

from silofs.cache import rows
from silofs.cache.bounds import ValueCursor, data_mapping, map_view, mdb_val_offset
from silofs.cache.listing import ListingReader
from silofs.errors import SilofsError

log = logging.getLogger(__name__)

# A dataset id in row keys: big-endian, so a dataset's rows sort together.
DSID = struct.Struct(">Q")
USAGE_ROW = struct.Struct("<QQ")  # a usage row's value: bytes, chunks
_DBS = (
    b"chunks",
    b"owners",
    b"usage",
    b"datasets",
    b"names",
    b"objects",
    b"meta",
    b"dirents",
    b"inodes",
    b"stale",
)
_DAEMON_ONLY = {b"stale"}  # dbs only the daemon reads (newer than some envs)


@dataclass
class Usage:
    bytes: int = 0
    chunks: int = 0


class CacheDamagedError(SilofsError):
    """The env's files are not a readable LMDB env (damaged meta or tree pages)."""


# What LMDB raises for a damaged file, as opposed to a missing, locked or unwritable one.
_DAMAGE = (
    lmdb.InvalidError,
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.VersionMismatchError,
)


_META_MAGIC, _META_VERSION, _P_META = 0xBEEFC0DE, 1, 0x08


def meta_pages_damaged(data_path: str, psize: int | None = None) -> bool:
    """Whether either LMDB meta page of data.mdb (pages 0 and 1) is not a sane meta page:
    P_META flag, magic, data version, and a last page number inside the file. LMDB
    alternates between the two, so one damaged page is enough to fail an open."""
    psize = psize or os.sysconf("SC_PAGE_SIZE")  # LMDB's page size is the OS page size
    try:
        with open(data_path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            pages = [f.read(psize) for _ in range(2)]
    except OSError:
        return False  # missing or unreadable: not ours to move
    for page in pages:
        if len(page) < 160:
            return True
        flags = struct.unpack_from("<H", page, 10)[0]
        magic, version = struct.unpack_from("<II", page, 16)
        last_pg = struct.unpack_from("<Q", page, 136)[0]
        if not flags & _P_META or magic != _META_MAGIC or version != _META_VERSION:
            return True
        if last_pg * psize >= max(size, 2 * psize) and last_pg > 1:
            return True
    return False


class CacheStore:
    """One cache dir's LMDB env, opened read-only (a mount's; the daemon opens it through
    node/store_write.py's WritableStore, which adds every write)."""

    # Whether this process opens the env read-only: every process but the daemon.
    readonly = True

    def __init__(self, path: str, map_size: int) -> None:
        self.path = path
        try:
            self._open(map_size)
        except (*_DAMAGE, SilofsError) as exc:
            if getattr(self, "env", None) is not None:
                self.env.close()
            # Damaged meta pages show as MDB_INVALID, or as ENOMEM/EINVAL when a size or
            # page number in them is garbage: check them before calling it damage, so a
            # permission or version problem stays what it is.
            if isinstance(exc, _DAMAGE) or meta_pages_damaged(os.path.join(path, "data.mdb")):
                raise CacheDamagedError(f"cache at {path} is damaged: {exc}") from None
            raise

    def _open(self, map_size: int) -> None:
        path, readonly = self.path, self.readonly
        # Held by a thread other than the env's owner while it looks values up, and by
        # adopt_map_size (a remap) in the owner.
        self.remap_lock = threading.Lock()
        # Snapshots kept across work outside that lock (pin): py-lmdb ends every txn of
        # the env at a remap (set_mapsize frees their reader slots), after which the
        # writer may reuse the pages such a snapshot was keeping for a read in flight.
        self._pins = 0
        self._unpinned = threading.Condition(threading.Lock())
        try:
            self.env = lmdb.open(
                path,
                map_size=map_size,
                max_dbs=len(_DBS) + 4,
                subdir=True,
                readonly=readonly,
                create=not readonly,
                # sync=False: a kill -9 loses nothing (the page cache keeps committed
                # pages); an OS crash can lose the last txns but never corrupts the env.
                # The Writer calls sync() periodically to bound that window.
                sync=False,
                metasync=False,
                # Readers (mount processes) serve whole values that span many contiguous
                # overflow pages: with readahead off, a cold 110 KiB value costs ~28
                # synchronous 4 KiB faults (bench/README.md: 0.07x -> 1.2x of local disk).
                # The writer touches scattered B-tree pages, where readahead only wastes IO.
                readahead=readonly,
                max_readers=1024,
                lock=True,
            )
        except _DAMAGE:
            raise
        except lmdb.Error as exc:
            gone = ""
            if readonly and not os.path.exists(os.path.join(path, "data.mdb")):
                # A mount opens the env its daemon made at start: gone means it was
                # removed under the running daemon, which goes on serving its mounts
                # from the unlinked files but can make no new one until restarted.
                gone = (
                    " (the daemon's cache was removed under it: its mounts go on, new "
                    "ones need the daemon restarted, which starts an empty cache)"
                )
            raise SilofsError(f"cannot open cache at {path}: {exc}{gone}") from None
        self.dbs = {}
        for name in _DBS:
            try:
                self.dbs[name] = self.env.open_db(name, create=not readonly)
            except lmdb.NotFoundError:
                # A mount of an env an older daemon made (still running after an
                # upgrade): it lacks dbs no mount reads.
                if not readonly or name not in _DAEMON_ONLY:
                    raise
        self._max_key = self.env.max_key_size()  # 511 in stock LMDB; S3 keys reach 1024
        self.psize = self.env.stat()["psize"]
        try:  # for value_bounds(): the file's size, where it is mapped
            self._data_fd = os.open(os.path.join(path, "data.mdb"), os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            log.warning("cache values are not bounds-checked: %s", exc)
            self._data_fd = -1
        self._map_start: int | None = None  # found on first use (value_bounds)
        # value_bounds() as last found: (start, end of data.mdb in the map, map end).
        # The map changes only in adopt_map_size (which drops it) and data.mdb never
        # shrinks, so a cached end is never past the file's: a value found beyond it is
        # looked at again with a fresh fstat before it is called damaged (ValueCursor).
        # Saves an env.info() dict and an fstat (a system call that hands the GIL to
        # another thread) on every lookup: ~75 us per answer on a busy host.
        self._bounds: tuple[int, int, int] | None = None
        self._bounds_lock = threading.Lock()  # finding or changing them (not reading)
        self._map_view: tuple[int, int, memoryview] | None = None  # start, end, view

    # -- small helpers -------------------------------------------------------------
    def db(self, name: bytes) -> lmdb._Database:
        return self.dbs[name]

    def close(self) -> None:
        self.env.close()
        if self._data_fd >= 0:
            os.close(self._data_fd)
            self._data_fd = -1

    def adopt_map_size(self) -> None:
        """The daemon grew the map (MapResizedError): remap at its size. Waits for the
        lookups a worker thread runs in this env (a mount's read-ahead of cached values,
        mount/reader.py), whose B-tree walk a remap would pull the pages from under, and
        for the snapshots pinned for reads in flight (pin), which it would end."""
        with self.remap_lock:
            with self._unpinned:
                self._unpinned.wait_for(lambda: not self._pins)
            self.env.set_mapsize(0)
            with self._bounds_lock:
                self._map_start = None  # the new map may start elsewhere
                self._bounds = None

    def pin(self, txn: lmdb.Transaction) -> bool:
        """Keep remaps off the read snapshot `txn`, which its holder keeps across work
        outside remap_lock (a read of data.mdb by offset, in a worker thread):
        adopt_map_size waits until unpin() ends it. False, and nothing pinned, if a remap
        ended it already. Call it under remap_lock, so that no remap is under way."""
        with self._unpinned:
            try:
                txn.id()
            except lmdb.Error:  # "closed/deleted/dropped": ended by set_mapsize
                return False
            self._pins += 1
            return True

    def unpin(self, txn: lmdb.Transaction) -> None:
        """End a snapshot pin() kept: from any thread; a remap waiting for it goes on."""
        with self._unpinned:
            txn.abort()
            self._pins -= 1
            if not self._pins:
                self._unpinned.notify_all()

    # -- values, found before they are touched (bounds.py) ----------------------------
    def value_bounds(self) -> tuple[int, int, int] | None:
        """(map start, end of data.mdb in the map, map end), or None where this
        process's map of data.mdb cannot be found. Found once per map: the end is
        the file's size then, which a value found past it asks again (file_end())."""
        bounds = self._bounds
        if bounds is not None or self._data_fd < 0:
            return bounds
        with self._bounds_lock:
            if self._bounds is not None:
                return self._bounds
            if self._map_start is None:
                span = data_mapping(self._data_fd)
                self._map_start = span[0] if span is not None else 0
                if not self._map_start:
                    log.info("no map of %s found: cache values are not bounds-checked", self.path)
            start = self._map_start
            if not start:
                return None
            map_size = self.env.info()["map_size"]
            bounds = self._bounds = (start, self._file_end(start, map_size), start + map_size)
            return bounds

    def _file_end(self, start: int, map_size: int) -> int:
        """Where data.mdb ends in the map as of now. The file may be larger than this
        map (presized by a daemon with a bigger cache size before): what is not mapped
        is not there to touch."""
        return start + min(os.fstat(self._data_fd).st_size, map_size)

    def file_end(self, bounds: tuple[int, int, int]) -> int:
        """A fresh end for `bounds` (the file grew since they were found), kept for the
        next lookups too."""
        start, _, map_end = bounds
        end = self._file_end(start, map_end - start)
        with self._bounds_lock:  # not over a remap's reset (adopt_map_size)
            known = self._bounds
            if known is not None and (known[0], known[2]) == (start, map_end) and known[1] < end:
                self._bounds = (start, end, map_end)
        return end

    def value_cursor(
        self, txn: lmdb.Transaction, db: lmdb._Database, *, write: bool = False
    ) -> ValueCursor | None:
        """A ValueCursor on `db` in `txn` (begun before this call), or None where values
        cannot be bounds-checked (another py-lmdb build, no map found)."""
        offset = mdb_val_offset()
        bounds = self.value_bounds() if offset >= 0 else None
        if bounds is None:
            return None
        start, _, end = bounds
        view = self._map_view
        if view is None or view[0] != start or view[1] != end:
            view = self._map_view = (start, end, map_view(start, end - start))  # a remap
        return ValueCursor(txn.cursor(db=db), offset, bounds, write, view[2], self.file_end)

    def get_value(
        self, txn: lmdb.Transaction, db: lmdb._Database, key: bytes
    ) -> memoryview | bytes | None:
        """txn.get(key), except that a value lying outside data.mdb raises
        DamagedValueError (an lmdb.Error) instead of ending the process with SIGBUS."""
        cur = self.value_cursor(txn, db)
        return txn.get(key, db=db) if cur is None else cur.get(key)

    def removed(self) -> bool:
        """Whether data.mdb at the cache dir is no longer the file this process opened:
        removed (`rm -rf` of the cache dir) or replaced. The env goes on in the unlinked
        file; nothing else at the path is this cache any more."""
        if self._data_fd < 0:
            return False
        try:
            held = os.fstat(self._data_fd)
            now = os.stat(os.path.join(self.path, "data.mdb"))
        except FileNotFoundError:
            return True
        return held.st_nlink == 0 or (held.st_dev, held.st_ino) != (now.st_dev, now.st_ino)

    def read_txn(self) -> lmdb.Transaction:
        # buffers=True: get() returns memoryviews into the map, valid while the txn is.
        return self.env.begin(buffers=True)

    def snapshot(self, *, buffers: bool = True) -> lmdb.Transaction:
        """A fresh read txn, after adopting the map if the daemon grew it since this
        process mapped it (MapResizedError). For the thread that owns the env only: a
        remap under a worker thread's lookups would pull their pages away."""
        try:
            return self.env.begin(buffers=buffers)
        except lmdb.MapResizedError:
            self.adopt_map_size()
            return self.env.begin(buffers=buffers)

    # -- datasets, listings (listing.py), accounting -------------------------------
    def dataset_record(self, dsid: int) -> dict:
        with self.env.begin() as txn:
            raw = txn.get(DSID.pack(dsid), db=self.db(b"datasets"))
        if not raw:
            return {}
        # {} for a damaged record: never listed, so the dataset is listed again.
        record = rows.loads(raw, f"record of dataset {dsid}", "listing it again", dict)
        return {} if record is None else record

    def listing(self, dsid: int, gen: int) -> ListingReader:
        return ListingReader(dsid, gen, self.db(b"dirents"), self.db(b"inodes"), self._max_key)

    def usage_of(self, txn: lmdb.Transaction, dsid: int) -> Usage:
        """One dataset's usage row, in the caller's txn (a mount's statfs)."""
        row = txn.get(DSID.pack(dsid), db=self.db(b"usage"))
        if row is None:
            return Usage()
        # Only a mount's statfs reads it here (nothing cached is a safe answer); the
        # daemon recounts a damaged row (WritableStore.load_usage).
        got = rows.unpack(USAGE_ROW, row, f"usage row of dataset {dsid}", "counted as 0")
        return Usage() if got is None else Usage(*got)

    def owns(self, txn: lmdb.Transaction, dsid: int, key: bytes) -> bool:
        """Whether `dsid` holds chunk `key`, read from its owners row: cheap, and it never
        faults in the chunk's value pages (a get on the chunks db would)."""
        return txn.get(DSID.pack(dsid) + key, db=self.db(b"owners")) is not None

    def holds(self, dsid: int, key: bytes) -> bool:
        """owns() in a read txn of its own (one question, not a walk)."""
        with self.read_txn() as txn:
            return self.owns(txn, dsid, key)
