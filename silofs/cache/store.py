"""The LMDB environment: chunks, per-dataset accounting, manifests, persisted settings.

Owns every LMDB database of a cache dir and the invariants between them:
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
A chunk, its owners row and its usage are changed in one write txn, so accounting never
drifts from content, even across kill -9. Only the daemon writes, from one thread at a
time (the Writer); mount processes open the same env and only read. This module never
decides what to admit or evict: callers pass the quota and the target.

Chunk values are found through bounds.py's ValueCursor (get_value, value_cursor) and
never with a bare get(): a damaged node must cost a refetch, not a SIGBUS. For the same
reason the daemon keeps data.mdb as large as the map (sparse; _back_the_map).

"""

from __future__ import annotations

import json
import logging
import os
import random
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import lmdb

from silofs.cache.bounds import (
    DamagedValueError,
    FirstTime,
    ValueCursor,
    data_mapping,
    intact_overflow,
    mdb_val_offset,
)
from silofs.cache.format import KEY_SIZE, chunk_key
from silofs.cache.listing import (
    LISTING_FORMAT,
    ListingBuilder,
    ListingReader,
    delete_generations,
)
from silofs.errors import SilofsError
from silofs.records import ObjectInfo, PrefixListed

log = logging.getLogger(__name__)

STORE_VERSION = 1
_ID = struct.Struct(">Q")  # big-endian so a dataset's rows sort together
_USAGE = struct.Struct("<QQ")
_LEN = struct.Struct("<I")
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
LISTING_BATCH = 10_000  # objects per listing write txn: bounds the writer's hold and memory
_EVICT_BATCH = 512
# LMDB needs free pages even to delete (copy-on-write). Admission therefore leaves this
# much of the map free, so eviction can always run: a full cache must stay shrinkable.
_HEADROOM_DB = b"headroom"  # filled and emptied inside one txn; never holds committed rows
_HEADROOM_MIN_PAGES = 32
_HEADROOM_MAX_PAGES = 256


@dataclass
class Usage:
    bytes: int = 0
    chunks: int = 0


@dataclass(frozen=True)
class PendingChunk:
    """A fetched chunk waiting for admission."""

    dataset: int
    key: bytes
    value: bytes  # encoded (header + data)
    data_len: int
    replace: bool = False  # overwrite a cached value that failed verification


@dataclass
class AdmitResult:
    admitted: int = 0
    admitted_bytes: int = 0
    rejected: int = 0  # over quota: uniform admission keeps what it has
    present: int = 0  # already cached (another mount or dataset got there first)
    damaged: int = 0  # its key's LMDB node is damaged: left alone, served from the store
    full: bool = False  # LMDB map full: the disk budget is used up (nothing admitted)
    unplaced: int = 0  # offers of a batch that hit the full map


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


def dataset_prefix(dsid: int) -> bytes:
    return _ID.pack(dsid)


class CacheStore:
    """One cache dir's LMDB env, opened by the daemon (writer) or a mount (reader)."""

    def __init__(self, path: str, map_size: int, *, readonly: bool = False) -> None:
        self.path = path
        self.readonly = readonly
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
            raise SilofsError(f"cannot open cache at {path}: {exc}") from None
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
        psize = self.psize = self.env.stat()["psize"]
        try:  # for value_bounds(): the file's size, where it is mapped
            self._data_fd = os.open(os.path.join(path, "data.mdb"), os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            log.warning("cache values are not bounds-checked: %s", exc)
            self._data_fd = -1
        self._map_start: int | None = None  # found on first use (value_bounds)
        self._damaged = FirstTime()  # chunk keys whose damaged node was reported
        self._headroom_pages = max(
            _HEADROOM_MIN_PAGES, min(map_size // psize // 256, _HEADROOM_MAX_PAGES)
        )
        # Two values fill a leaf page; values this size never need contiguous pages.
        self._headroom_value = bytes(psize // 2 - 128)
        if not readonly:
            self._headroom_db = self.env.open_db(_HEADROOM_DB)
            self._check_version()
            self._back_the_map()

    def _back_the_map(self) -> None:
        """Grow data.mdb (sparse: no blocks) to the map's size, so every page of the map
        is backed by the file in every process that maps it.

        LMDB checksums none of its pages. A damaged page number or value size makes it,
        or py-lmdb, touch the map past the end of the file: SIGBUS, which ends a mount
        or the daemon with no error to catch (a read txn refuses page numbers past its
        last page, but a write txn has allocated past the file's end, and nothing bounds
        a value's size). Inside a backed map that touch reads zeros or another page: a
        value that fails its checksum, or an lmdb.Error. LMDB does the same itself with
        MDB_WRITEMAP; the file's used pages, and so the disk it takes, are unchanged."""
        if self._data_fd < 0:
            return
        map_size = self.env.info()["map_size"]
        mapped = os.fstat(self._data_fd)
        if mapped.st_size >= map_size:
            return
        try:
            # The file LMDB opened, not whatever the name leads to now (cachedir.py).
            fd = os.open(
                os.path.join(self.path, "data.mdb"), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
            )
            try:
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) == (mapped.st_dev, mapped.st_ino):
                    os.ftruncate(fd, map_size)
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("cannot grow %s/data.mdb to the map size: %s", self.path, exc)

    # -- small helpers -------------------------------------------------------------
    def db(self, name: bytes) -> lmdb._Database:
        return self.dbs[name]

    def _check_version(self) -> None:
        with self.env.begin(write=True) as txn:
            raw = txn.get(b"store_version", db=self.db(b"meta"))
            if raw is None:
                txn.put(b"store_version", json.dumps(STORE_VERSION).encode(), db=self.db(b"meta"))
            elif json.loads(raw) != STORE_VERSION:
                raise SilofsError(
                    f"cache at {self.path} has store version {raw.decode()}, this "
                    f"silofs reads {STORE_VERSION}: use another --cache-dir"
                )

    def close(self) -> None:
        self.env.close()
        if self._data_fd >= 0:
            os.close(self._data_fd)
            self._data_fd = -1

    def adopt_map_size(self) -> None:
        """The daemon grew the map (MapResizedError): remap at its size. Waits for the
        lookups a worker thread runs in this env (a mount's read-ahead of cached values,
        mount/reader.py), whose B-tree walk a remap would pull the pages from under."""
        with self.remap_lock:
            self.env.set_mapsize(0)
            self._map_start = None  # the new map may start elsewhere

    # -- values, found before they are touched (bounds.py) ----------------------------
    def value_bounds(self) -> tuple[int, int, int] | None:
        """(map start, end of data.mdb in the map, map end) as of now, or None where
        this process's map of data.mdb cannot be found."""
        if self._data_fd < 0:
            return None
        if self._map_start is None:
            span = data_mapping(self._data_fd)
            self._map_start = span[0] if span is not None else 0
            if not self._map_start:
                log.info("no map of %s found: cache values are not bounds-checked", self.path)
        start = self._map_start
        if not start:
            return None
        map_size = self.env.info()["map_size"]
        # The file may be larger than this map (presized by a daemon with a bigger cache
        # size before): what is not mapped is not there to touch.
        size = min(os.fstat(self._data_fd).st_size, map_size)
        return start, start + size, start + map_size

    def value_cursor(
        self, txn: lmdb.Transaction, db: lmdb._Database, *, write: bool = False
    ) -> ValueCursor | None:
        """A ValueCursor on `db` in `txn` (begun before this call), or None where values
        cannot be bounds-checked (another py-lmdb build, no map found)."""
        offset = mdb_val_offset()
        bounds = self.value_bounds() if offset >= 0 else None
        if bounds is None:
            return None
        return ValueCursor(txn.cursor(db=db), offset, bounds, write)

    def get_value(
        self, txn: lmdb.Transaction, db: lmdb._Database, key: bytes
    ) -> memoryview | bytes | None:
        """txn.get(key), except that a value lying outside data.mdb raises
        DamagedValueError (an lmdb.Error) instead of ending the process with SIGBUS."""
        cur = self.value_cursor(txn, db)
        return txn.get(key, db=db) if cur is None else cur.get(key)

    def sync(self) -> None:
        self.env.sync(True)

    def read_txn(self) -> lmdb.Transaction:
        # buffers=True: get() returns memoryviews into the map, valid while the txn is.
        return self.env.begin(buffers=True)

    def _check_headroom(self, txn: lmdb.Transaction) -> None:
        """Raise MapFullError unless the map keeps a few free pages after this txn.

        Allocating the pages (and freeing them again in the same txn) asks LMDB itself,
        which knows about free-list pages still pinned by readers. Leaf-sized values, not
        one large value: overflow pages must be contiguous, and asking for a contiguous
        run every txn would grow the file past a fragmented free list.
        """
        db = self._headroom_db
        value = self._headroom_value
        for i in range(2 * self._headroom_pages):
            txn.put(i.to_bytes(4, "big"), value, append=True, db=db)
        txn.drop(db, delete=False)

    # -- meta ----------------------------------------------------------------------
    def get_meta(self, name: str) -> object | None:
        with self.env.begin() as txn:
            raw = txn.get(name.encode(), db=self.db(b"meta"))
        return None if raw is None else json.loads(raw)

    def put_meta(self, name: str, value: object | None) -> None:
        with self.env.begin(write=True) as txn:
            if value is None:
                txn.delete(name.encode(), db=self.db(b"meta"))
            else:
                txn.put(name.encode(), json.dumps(value).encode(), db=self.db(b"meta"))

    def iter_meta(self, prefix: str) -> Iterator[tuple[str, object]]:
        with self.env.begin() as txn:
            cur = txn.cursor(db=self.db(b"meta"))
            p = prefix.encode()
            if cur.set_range(p):
                for k, v in cur:
                    if not k.startswith(p):
                        break
                    yield k.decode(), json.loads(v)

    # -- datasets and manifests ----------------------------------------------------
    def dataset_id(self, uri: str, *, create: bool) -> int | None:
        with self.env.begin(write=create) as txn:
            raw = txn.get(uri.encode(), db=self.db(b"names"))
            if raw is not None:
                return _ID.unpack(raw)[0]
            if not create:
                return None
            next_raw = txn.get(b"next_dataset_id", db=self.db(b"meta"))
            dsid = json.loads(next_raw) if next_raw else 1
            txn.put(b"next_dataset_id", json.dumps(dsid + 1).encode(), db=self.db(b"meta"))
            txn.put(uri.encode(), _ID.pack(dsid), db=self.db(b"names"))
            txn.put(_ID.pack(dsid), json.dumps({"uri": uri}).encode(), db=self.db(b"datasets"))
            return dsid

    def dataset_record(self, dsid: int) -> dict:
        with self.env.begin() as txn:
            raw = txn.get(_ID.pack(dsid), db=self.db(b"datasets"))
        return json.loads(raw) if raw else {}

    def all_datasets(self) -> dict[int, dict]:
        with self.env.begin() as txn:
            return {_ID.unpack(k)[0]: json.loads(v) for k, v in txn.cursor(db=self.db(b"datasets"))}

    # -- listings (silofs/cache/listing.py) ----------------------------------------
    def listing(self, dsid: int, gen: int) -> ListingReader:
        return ListingReader(dsid, gen, self.db(b"dirents"), self.db(b"inodes"), self._max_key)

    def current_generation(self, dsid: int) -> int | None:
        """The generation the dataset record names, None if never listed (or listed by a
        silofs before generations, or with rows of another LISTING_FORMAT: a mount
        cannot serve those)."""
        record = self.dataset_record(dsid)
        gen = record.get("gen")
        if gen is None or record.get("listing_format") != LISTING_FORMAT:
            return None  # rows of another shape (cache/listing.py): listed again
        return int(gen)

    def begin_listing(self, dsid: int) -> ListingBuilder:
        """A builder for the dataset's next generation. Rows of any generation but the
        current one (a listing killed half way, or one already replaced) must have been
        deleted first (delete_stale_generations)."""
        current = self.current_generation(dsid)
        gen = (current or 0) + 1
        b = ListingBuilder(
            dsid, gen, self.db(b"dirents"), self.db(b"inodes"), self._max_key, previous=current
        )
        with self.env.begin(write=True) as txn:
            b.start(txn)
        return b

    def add_to_listing(
        self, builder: ListingBuilder, objects: list[ObjectInfo | PrefixListed]
    ) -> None:
        with self.env.begin(write=True) as txn:
            builder.add(txn, objects)

    def finish_listing(self, builder: ListingBuilder, record: dict) -> dict:
        """Make the builder's generation the dataset's listing, atomically: mounts see the
        old generation or the new one. Returns the record written."""
        base = {**self.dataset_record(builder.dsid), **record}
        with self.env.begin(write=True) as txn:
            builder.finish(txn)  # in the same txn: the record's counts include it
            full = {**base, **builder.record()}
            txn.put(_ID.pack(builder.dsid), json.dumps(full).encode(), db=self.db(b"datasets"))
        return full

    def delete_stale_generations(
        self, dsid: int, keep: set[int], limit: int = LISTING_BATCH
    ) -> int:
        """Delete up to `limit` listing rows of generations not in `keep` (and legacy
        objects rows), in one txn; returns the number deleted (< limit: all gone)."""
        dbs = (self.db(b"dirents"), self.db(b"inodes"), self.db(b"objects"))
        with self.env.begin(write=True) as txn:
            legacy = 0
            cur = txn.cursor(db=self.db(b"objects"))
            prefix = _ID.pack(dsid)
            if cur.set_range(prefix):
                while legacy < limit and cur.key().startswith(prefix):
                    if not cur.delete():
                        break
                    legacy += 1
            return legacy + delete_generations(txn, dsid, keep, dbs[:2], limit - legacy)

    def replace_manifest(self, dsid: int, objects: Iterable[ObjectInfo], record: dict) -> dict:
        """List `objects` as the dataset's new generation (all at once: tests, small sets)."""
        current = self.current_generation(dsid)
        keep = {current} if current is not None else set()
        while self.delete_stale_generations(dsid, keep) >= LISTING_BATCH:
            pass
        b = self.begin_listing(dsid)
        batch: list[ObjectInfo] = []
        for o in objects:
            batch.append(o)
            if len(batch) >= LISTING_BATCH:
                self.add_to_listing(b, batch)
                batch = []
        self.add_to_listing(b, batch)
        return self.finish_listing(b, record)

    def iter_manifest(self, dsid: int) -> Iterator[ObjectInfo]:
        """The visible files of the dataset's current listing."""
        gen = self.current_generation(dsid)
        if gen is None:
            return
        reader = self.listing(dsid, gen)
        with self.env.begin() as txn:
            for e in reader.iter_files(txn):
                obj = e.obj
                assert obj is not None
                yield obj

    def get_object(self, dsid: int, key: str, gen: int | None = None) -> ObjectInfo | None:
        """The object listed under `key` in generation `gen` (default: the current one)."""
        if gen is None:
            gen = self.current_generation(dsid)
            if gen is None:
                return None
        with self.env.begin() as txn:
            e = self.listing(dsid, gen).resolve(txn, key)
            return None if e is None else e.obj

    # -- accounting ----------------------------------------------------------------
    def load_usage(self) -> dict[int, Usage]:
        """Bytes and chunks per dataset, read from the usage rows (no cache walk)."""
        with self.env.begin() as txn:
            return {
                _ID.unpack(k)[0]: Usage(*_USAGE.unpack(v))
                for k, v in txn.cursor(db=self.db(b"usage"))
            }

    def usage_of(self, txn: lmdb.Transaction, dsid: int) -> Usage:
        """One dataset's usage row, in the caller's txn (a mount's statfs)."""
        row = txn.get(_ID.pack(dsid), db=self.db(b"usage"))
        return Usage(*_USAGE.unpack(row)) if row is not None else Usage()

    def _put_usage(self, txn: lmdb.Transaction, dsid: int, u: Usage) -> None:
        txn.put(_ID.pack(dsid), _USAGE.pack(u.bytes, u.chunks), db=self.db(b"usage"))

    def _remove_chunk(self, txn: lmdb.Transaction, key: bytes, usage: dict[int, Usage]) -> bool:
        """Delete a chunk and uncharge its owner; whether its value was deleted (a
        damaged node stays: _delete_chunk).

        The owner is found from the owners rows, not the header, because this runs
        when a value failed verification and its header cannot be trusted.
        """
        deleted = self._delete_chunk(txn, key)
        for owner in list(usage):
            row = _ID.pack(owner) + key
            length_raw = txn.get(row, db=self.db(b"owners"))
            if length_raw is not None:
                self._uncharge(txn, owner, row, _LEN.unpack(length_raw)[0], usage)
                break
        return deleted

    def _uncharge(
        self, txn: lmdb.Transaction, owner: int, row: bytes, length: int, usage: dict[int, Usage]
    ) -> int:
        txn.delete(row, db=self.db(b"owners"))
        txn.delete(row, db=self.db(b"stale"))  # owners and stale rows share the key
        u = usage.setdefault(owner, Usage())
        # Never below zero: LMDB checksums none of its pages, and a damaged owners row
        # (its length) must not make every later admission fail on a negative usage.
        u.bytes = max(0, u.bytes - length)
        u.chunks = max(0, u.chunks - 1)
        self._put_usage(txn, owner, u)
        return length

    def admit(
        self,
        items: list[PendingChunk],
        usage: dict[int, Usage],
        quota: Callable[[int, Mapping[int, Usage]], int],
    ) -> AdmitResult:
        """Admit `items` in one txn. `usage` is updated in place to the committed state.

        quota(dataset, usage) is the most bytes the dataset may hold right now; a chunk
        that would take it over is rejected (uniform admission: no eviction to make room).
        """
        res = AdmitResult()
        work = {k: Usage(v.bytes, v.chunks) for k, v in usage.items()}
        try:
            with self.env.begin(write=True) as txn:
                for item in items:
                    self._admit_one(txn, item, work, quota, res)
                if res.admitted:
                    self._check_headroom(txn)
        except lmdb.MapFullError:
            log.warning("cache map is full; admission pauses until space is freed")
            return AdmitResult(full=True, unplaced=len(items))
        usage.clear()
        usage.update(work)
        return res

    def _admit_one(
        self,
        txn: lmdb.Transaction,
        item: PendingChunk,
        work: dict[int, Usage],
        quota: Callable[[int, Mapping[int, Usage]], int],
        res: AdmitResult,
    ) -> None:
        chunks = self.db(b"chunks")
        cur = self.value_cursor(txn, chunks, write=True)
        try:
            # Present? Found without touching the value (get() would read its pages).
            found = cur.find(item.key) if cur is not None else txn.get(item.key, db=chunks)
        except DamagedValueError as exc:
            if self._damaged(item.key):
                log.warning("chunk %s not admitted, its node is damaged: %s", item.key.hex(), exc)
            res.damaged += 1
            return
        if found is not None:
            if not item.replace:
                res.present += 1
                return
            if not self._remove_chunk(txn, item.key, work):  # left in place: damaged
                res.damaged += 1
                return
        u = work.setdefault(item.dataset, Usage())
        limit = quota(item.dataset, work)
        if u.bytes + item.data_len > limit:
            # Chunks of versions no listing names make room first: a full dataset would
            # otherwise keep them forever (uniform admission evicts nothing).
            self.evict_stale(txn, item.dataset, limit - item.data_len, work)
            u = work[item.dataset]
        if u.bytes + item.data_len > limit:
            res.rejected += 1
            return
        txn.put(item.key, item.value, db=chunks)
        txn.put(_ID.pack(item.dataset) + item.key, _LEN.pack(item.data_len), db=self.db(b"owners"))
        u.bytes += item.data_len
        u.chunks += 1
        self._put_usage(txn, item.dataset, u)
        res.admitted += 1
        res.admitted_bytes += item.data_len

    def evict_random(self, dsid: int, target_bytes: int, usage: dict[int, Usage]) -> int:
        """Evict random chunks of `dsid` until it holds <= target_bytes. Returns bytes freed.

        Chunk keys are hashes, so the successor of a random probe within the dataset's
        owners range is a random chunk, chosen without walking the cache. It is not
        exactly uniform (a key after a larger gap is likelier), but it is independent of
        access order, which is what keeps the hit ratio at cache/dataset. Works in small
        txns so the writer never holds the lock long.
        """
        freed = 0
        prefix = _ID.pack(dsid)
        # Usage is never negative: a negative target (an allocation computed below zero)
        # means "empty it", and must not loop forever once the dataset is empty.
        target_bytes = max(0, target_bytes)
        batch = _EVICT_BATCH
        while usage.get(dsid, Usage()).bytes > target_bytes:
            work = {k: Usage(v.bytes, v.chunks) for k, v in usage.items()}
            batch_freed = 0
            try:
                with self.env.begin(write=True) as txn:
                    batch_freed += self.evict_stale(txn, dsid, target_bytes, work)
                    for _ in range(batch):
                        if work.get(dsid, Usage()).bytes <= target_bytes:
                            break
                        key = self._random_owned_key(txn, prefix)
                        if key is None:
                            work[dsid] = Usage()  # accounting said more than there is
                            self._put_usage(txn, dsid, work[dsid])
                            break
                        batch_freed += self.remove_owned(txn, dsid, key, work)
            except lmdb.MapFullError:
                # Deleting needs free pages too; smaller txns need fewer (the headroom
                # admission leaves always fits one).
                if batch == 1:
                    raise
                batch //= 2
                log.warning("cache map is full; evicting in batches of %d", batch)
                continue
            freed += batch_freed
            usage.clear()
            usage.update(work)
            if usage.get(dsid, Usage()).chunks <= 0 and usage[dsid].bytes > target_bytes:
                usage[dsid] = Usage()
        return freed

    def _random_owned_key(self, txn: lmdb.Transaction, prefix: bytes) -> bytes | None:
        cur = txn.cursor(db=self.db(b"owners"))
        probe = prefix + random.randbytes(KEY_SIZE)
        if cur.set_range(probe) and cur.key().startswith(prefix):
            return cur.key()[len(prefix) :]
        if cur.set_range(prefix) and cur.key().startswith(prefix):
            return cur.key()[len(prefix) :]
        return None

    # -- chunks of versions no listing names (first eviction victims) -----------------
    def stale_candidates(
        self,
        dsid: int,
        old_gen: int,
        new_gen: int,
        chunk_sizes: Iterable[int],
        after: bytes | None = None,
        limit: int = LISTING_BATCH,
    ) -> tuple[list[bytes], bytes | None]:
        """Chunk keys the dataset owns of up to `limit` files of generation `old_gen` that
        `new_gen` lists with another content id or not at all, cut with each of
        `chunk_sizes`; and where to go on (None: done). One read txn, no chunk value
        read (owners rows only)."""
        sizes = sorted(set(chunk_sizes))
        keys: list[bytes] = []
        with self.env.begin() as txn:
            old = self.listing(dsid, old_gen)
            new = self.listing(dsid, new_gen)
            n = 0
            for row, e in old.iter_file_rows(txn, after):
                if n >= limit:
                    return keys, row
                n += 1
                now = new.file_at(txn, row)
                if now is not None and now.content_id == e.content_id:
                    continue
                obj = e.obj
                assert obj is not None
                for cs in sizes:
                    for index in range(max(1, -(-obj.size // cs))):
                        key = chunk_key(obj.content_id, cs, index)
                        if self.owns(txn, dsid, key):
                            keys.append(key)
        return keys, None

    def mark_stale(self, dsid: int, keys: list[bytes]) -> int:
        """Make chunks `dsid` owns its first eviction victims (random and LRU eviction,
        and admission over the quota take them before anything else). Returns how many
        were marked."""
        marked = 0
        with self.env.begin(write=True) as txn:
            for key in keys:
                if self.owns(txn, dsid, key):
                    marked += txn.put(_ID.pack(dsid) + key, b"", db=self.db(b"stale"))
        return marked

    def stale_count(self, dsid: int) -> int:
        with self.env.begin() as txn:
            cur = txn.cursor(db=self.db(b"stale"))
            prefix = _ID.pack(dsid)
            n = 0
            if cur.set_range(prefix):
                for k in cur.iternext(values=False):
                    if not k.startswith(prefix):
                        break
                    n += 1
            return n

    def evict_stale(
        self, txn: lmdb.Transaction, dsid: int, target: int, work: dict[int, Usage]
    ) -> int:
        """Evict stale chunks of `dsid` (mark_stale) until it holds <= target bytes or
        none is left, in the caller's write txn; returns the bytes freed."""
        freed = 0
        prefix = _ID.pack(dsid)
        cur = txn.cursor(db=self.db(b"stale"))
        while work.get(dsid, Usage()).bytes > target and cur.set_range(prefix):
            row = cur.key()
            if not row.startswith(prefix):
                break
            key = row[len(prefix) :]
            if self.owns(txn, dsid, key):
                freed += self.remove_owned(txn, dsid, key, work)  # deletes the stale row
            else:
                cur.delete()
        return freed

    def owns(self, txn: lmdb.Transaction, dsid: int, key: bytes) -> bool:
        """Whether `dsid` holds chunk `key`, read from its owners row: cheap, and it never
        faults in the chunk's value pages (a get on the chunks db would)."""
        return txn.get(_ID.pack(dsid) + key, db=self.db(b"owners")) is not None

    def remove_owned(
        self, txn: lmdb.Transaction, dsid: int, key: bytes, work: dict[int, Usage]
    ) -> int:
        """Delete a chunk `dsid` owns and uncharge it, in the caller's write txn."""
        row = _ID.pack(dsid) + key
        length = _LEN.unpack(txn.get(row, db=self.db(b"owners")))[0]
        self._delete_chunk(txn, key)
        return self._uncharge(txn, dsid, row, length, work)

    def _delete_chunk(self, txn: lmdb.Transaction, key: bytes) -> bool:
        """Delete the value of chunk `key` unless its node is damaged: LMDB frees a
        value's overflow pages by reading the first one's header, past the end of
        data.mdb (SIGBUS) or in another value (freeing live pages). A damaged node stays,
        orphaned once its owner is uncharged and never served (every lookup refuses it).
        Whether it was deleted."""
        chunks = self.db(b"chunks")
        cur = self.value_cursor(txn, chunks, write=True)
        if cur is None:
            return txn.delete(key, db=chunks)
        try:
            where = cur.find(key)
        except DamagedValueError as exc:
            if self._damaged(key):
                log.warning("chunk %s left in place: %s", key.hex(), exc)
            return False
        if where is None:
            return False
        addr, size = where
        if size > self.psize // 2 and not intact_overflow(cur, addr, size, self.psize):
            if self._damaged(key):
                log.warning("chunk %s left in place: its first page's header disagrees", key.hex())
            return False
        return cur.cursor.delete()


def env_map_size(cache_size: int) -> int:
    """LMDB map size for a byte budget: data + B-tree/overflow-page slack + manifests."""
    return int(cache_size * 1.25) + (256 << 20)


def disk_free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
