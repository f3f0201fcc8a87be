"""The cache env as the daemon opens it: the one writer, and the reads only it makes.

Owns every change to a cache dir's LMDB env (cache/store.py names its databases): chunk
admission under a quota (uniform: a chunk over the quota is refused, nothing evicted to
make room), eviction (random, and of stale chunks first), stale marking after a refresh,
listing generations (written by node/listing_builder.py, made current in one txn, the
others deleted in bounded txns), dataset ids, persisted settings, the version check and
the map kept backed by data.mdb. A chunk, its owners row and its usage are changed in
one write txn, so accounting never drifts from content, even across kill -9. Called from
one thread at a time (the Writer, or the daemon before its tasks start). Never decides
what to admit or evict: callers pass the quota and the target.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import random
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import lmdb

from silofs.cache import rows
from silofs.cache.bounds import DamagedValueError, FirstTime, ValueCursor
from silofs.cache.format import KEY_SIZE, Buffer, chunk_key
from silofs.cache.listing import GEN, LISTING_FORMAT, gen_prefix
from silofs.cache.store import DSID, USAGE_ROW, CacheStore, Usage, meta_pages_damaged
from silofs.errors import SilofsError, UsageError
from silofs.node.listing_builder import ListingBuilder
from silofs.records import ObjectInfo, PrefixListed

log = logging.getLogger(__name__)

STORE_VERSION = 1
_OWNED_LEN = struct.Struct("<I")  # an owners row's value: the chunk's data length


def _owned_len(raw: bytes | None) -> int:
    """An owners row's length; 0 for a row that is not 4 bytes. LMDB checksums none of
    its pages: a flipped byte in a leaf can change a value's size, and a struct.error
    there failed every admission batch holding that chunk, and the daemon's last flush
    at shutdown with a traceback (found by tests/reliability/test_byteflips.py's long
    form). Uncharging 0 leaves usage a little high, never negative (_uncharge)."""
    if raw is None or len(raw) != _OWNED_LEN.size:
        return 0
    return _OWNED_LEN.unpack(raw)[0]


LISTING_BATCH = 10_000  # objects per listing write txn: bounds the writer's hold and memory
_EVICT_BATCH = 512
# LMDB needs free pages even to delete (copy-on-write). Admission therefore leaves this
# much of the map free, so eviction can always run: a full cache must stay shrinkable.
_HEADROOM_DB = b"headroom"  # filled and emptied inside one txn; never holds committed rows
_HEADROOM_MIN_PAGES = 32
_HEADROOM_MAX_PAGES = 256
# An LMDB page's header, and its flags an overflow value's first page carries.
_PAGE_HEAD = struct.Struct("<QHHI")  # pgno, pad, flags, overflow page count
_P_OVERFLOW = 0x04
_P_DIRTY = 0x10  # set on a write txn's own pages until they are written to the file


@dataclass(frozen=True)
class PendingChunk:
    """A fetched chunk waiting for admission."""

    dataset: int
    key: bytes
    value: bytes | Buffer  # encoded (header + data); never changed once offered
    data_len: int
    replace: bool = False  # overwrite a cached value that failed verification
    streamed: bool = False  # one of several chunks one GET streams (a sequential read)


@dataclass
class AdmitResult:
    admitted: int = 0
    admitted_bytes: int = 0
    rejected: int = 0  # over quota: uniform admission keeps what it has
    present: int = 0  # already cached (another mount or dataset got there first)
    damaged: int = 0  # its key's LMDB node is damaged: left alone, served from the store
    full: bool = False  # LMDB map full: the disk budget is used up (nothing admitted)
    unplaced: int = 0  # offers of a batch that hit the full map


def env_map_size(cache_size: int) -> int:
    """LMDB map size for a byte budget: data + B-tree/overflow-page slack + listings."""
    return int(cache_size * 1.25) + (256 << 20)


class WritableStore(CacheStore):
    """One cache dir's env, opened for writing (and created) by the daemon."""

    readonly = False
    # In a cluster: whether a chunk key is placed at another member (its configured home,
    # node/membership.py placed). Such a chunk is admitted here only while this node
    # stands in for its home (down), and is made a first eviction victim as it is
    # admitted: once the home is back, reads go there, and the copy here must give way
    # to this node's own chunks rather than hold their room in this node's part (it
    # was counted against the dataset's share twice: here and at its home). Called
    # from the Writer's thread; set by node/cluster.py.
    elsewhere: Callable[[bytes], bool] | None = None

    def _open(self, map_size: int) -> None:
        self._check_file()
        super()._open(map_size)
        self._damaged = FirstTime()  # chunk keys whose damaged node was reported
        self._headroom_pages = max(
            _HEADROOM_MIN_PAGES, min(map_size // self.psize // 256, _HEADROOM_MAX_PAGES)
        )
        # Two values fill a leaf page; values this size never need contiguous pages.
        self._headroom_value = bytes(self.psize // 2 - 128)
        self._headroom_db = self.env.open_db(_HEADROOM_DB)
        self._check_version()
        self._back_the_map()
        self._back_the_lock_file()

    # -- opening: the version check, the map backed by the file --------------------
    def _check_file(self) -> None:
        """Refuse a data.mdb whose meta pages name pages past its end (a file truncated
        or copied short while no daemon ran): LMDB opens it, then the first read of such
        a page through the map is a SIGBUS that ends the daemon ("Fatal Python error:
        Bus error"), no error to catch. Raised as SilofsError: CacheStore.__init__ finds
        the meta pages damaged and makes it a CacheDamagedError (the env is moved aside).
        An empty file is a new env to LMDB. Only here, where the daemon's lock rules out
        a writer meanwhile: a mount could read a meta page while the daemon rewrites it."""
        data = os.path.join(self.path, "data.mdb")
        try:
            size = os.stat(data).st_size
        except OSError:
            return  # none yet (LMDB makes it), or unreadable: LMDB says so
        if size and meta_pages_damaged(data):
            raise SilofsError(
                f"data.mdb ({size} bytes) is not a whole LMDB file: its meta pages are "
                "damaged or name pages past its end"
            )

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

    def _back_the_lock_file(self) -> None:
        """Give every page of lock.mdb a block of the disk, at start, while there is
        room (cachedir.py checks for it). LMDB keeps its reader table there, written
        through a shared map, and makes the file sparse: the first reader slot on a page
        without a block, touched while the disk is full, ends that process (the daemon
        or a mount) with SIGBUS. A 4 KiB page holds 64 slots, so the 64th read txn open
        at once among the daemon's and its mounts' threads was enough. UsageError (one
        line) if the disk has no room for it."""
        path = os.path.join(self.path, "lock.mdb")
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return  # no lock file (an env opened without locking)
        try:
            size = os.fstat(fd).st_size
            if size:
                os.posix_fallocate(fd, 0, size)  # blocks only: the bytes stay as they are
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise UsageError(
                    f"cache dir {self.path}: no room on its disk for LMDB's lock file "
                    f"({size} bytes): free some space on it"
                ) from None
            log.warning("cannot allocate the blocks of %s: %s", path, exc)
        finally:
            os.close(fd)

    def _check_version(self) -> None:
        with self.env.begin(write=True) as txn:
            raw = txn.get(b"store_version", db=self.db(b"meta"))
            if raw is None:
                txn.put(b"store_version", json.dumps(STORE_VERSION).encode(), db=self.db(b"meta"))
            elif (version := rows.loads(raw, "store version row", "refusing")) != STORE_VERSION:
                # One line for the CLI either way (a damaged row is not a traceback).
                said = raw.decode(errors="replace") if version is not None else "unreadable"
                raise SilofsError(
                    f"cache at {self.path} has store version {said}, this "
                    f"silofs reads {STORE_VERSION}: use another --cache-dir"
                )

    # -- small helpers -------------------------------------------------------------
    def sync(self) -> None:
        self.env.sync(True)

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

    # -- meta: persisted settings --------------------------------------------------
    def get_meta(self, name: str) -> object | None:
        with self.env.begin() as txn:
            raw = txn.get(name.encode(), db=self.db(b"meta"))
        # None for a damaged row: as if never set (callers also check the type they get).
        return None if raw is None else rows.loads(raw, f"meta row {name!r}", "ignored")

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
                    name = k.decode(errors="replace")
                    value = rows.loads(v, f"meta row {name!r}", "skipped")
                    if value is not None and "\ufffd" not in name:
                        yield name, value

    # -- datasets and listings (node/listing_builder.py) ---------------------------
    def dataset_id(self, uri: str, *, create: bool) -> int | None:
        with self.env.begin(write=create) as txn:
            raw = txn.get(uri.encode(), db=self.db(b"names"))
            if raw is not None:
                # A damaged names row: the dataset is taken as new, under a fresh id
                # (listed again, its chunks fetched again; the old id's rows are left
                # for eviction). Never another dataset's id: that would serve its bytes.
                got = rows.unpack(DSID, raw, f"names row of {uri}", "listing it under a new id")
                if got is not None:
                    return int(got[0])
            if not create:
                return None
            dsid = self._next_dataset_id(txn)
            txn.put(b"next_dataset_id", json.dumps(dsid + 1).encode(), db=self.db(b"meta"))
            txn.put(uri.encode(), DSID.pack(dsid), db=self.db(b"names"))
            txn.put(DSID.pack(dsid), json.dumps({"uri": uri}).encode(), db=self.db(b"datasets"))
            return dsid

    def _next_dataset_id(self, txn: lmdb.Transaction) -> int:
        """The id for a new dataset. A damaged next_dataset_id row is rebuilt from the ids
        in use (past every datasets and names row): reusing one would mix two datasets."""
        raw = txn.get(b"next_dataset_id", db=self.db(b"meta"))
        if not raw:
            return 1
        instead = "rebuilt from the ids in use"
        dsid = rows.loads(raw, "next_dataset_id row", instead, int)
        if dsid is not None:
            if dsid > 0 and txn.get(DSID.pack(dsid), db=self.db(b"datasets")) is None:
                return int(dsid)
            rows.damaged(f"next_dataset_id row ({dsid}: in use or not an id)", raw, instead)
        used = [1]
        for k in txn.cursor(db=self.db(b"datasets")).iternext(values=False):
            if len(k) == DSID.size:
                used.append(DSID.unpack(k)[0] + 1)
        for v in txn.cursor(db=self.db(b"names")).iternext(keys=False, values=True):
            if len(v) == DSID.size:
                used.append(DSID.unpack(v)[0] + 1)
        return max(used)

    def all_datasets(self) -> dict[int, dict]:
        """Every dataset record; a damaged row (key or value) is left out, logged."""
        out: dict[int, dict] = {}
        with self.env.begin() as txn:
            for k, v in txn.cursor(db=self.db(b"datasets")):
                got = rows.unpack(DSID, k, "datasets row key", "skipped")
                if got is None:
                    continue
                record = rows.loads(v, f"record of dataset {got[0]}", "skipped", dict)
                if record is not None:
                    out[got[0]] = record
        return out

    def current_generation(self, dsid: int) -> int | None:
        """The generation the dataset record names, None if never listed (or listed by a
        silofs before generations, or with rows of another LISTING_FORMAT: a mount
        cannot serve those)."""
        record = self.dataset_record(dsid)
        gen = record.get("gen")
        if gen is None or record.get("listing_format") != LISTING_FORMAT:
            return None  # rows of another shape (cache/listing.py): listed again
        return int(gen)

    def get_object(self, dsid: int, key: str, gen: int | None = None) -> ObjectInfo | None:
        """The object listed under `key` in generation `gen` (default: the current one)."""
        if gen is None:
            gen = self.current_generation(dsid)
            if gen is None:
                return None
        with self.env.begin() as txn:
            e = self.listing(dsid, gen).resolve(txn, key)
            return None if e is None else e.obj

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
            txn.put(DSID.pack(builder.dsid), json.dumps(full).encode(), db=self.db(b"datasets"))
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
            prefix = DSID.pack(dsid)
            if cur.set_range(prefix):
                while legacy < limit and cur.key().startswith(prefix):
                    if not cur.delete():
                        break
                    legacy += 1
            return legacy + _delete_generations(txn, dsid, keep, dbs[:2], limit - legacy)

    def replace_listing(self, dsid: int, objects: Iterable[ObjectInfo], record: dict) -> dict:
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

    def iter_listing(self, dsid: int) -> Iterator[ObjectInfo]:
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

    # -- accounting ----------------------------------------------------------------
    def load_usage(self) -> dict[int, Usage]:
        """Bytes and chunks per dataset, read from the usage rows (no cache walk)."""
        with self.env.begin() as txn:
            out: dict[int, Usage] = {}
            for k, v in txn.cursor(db=self.db(b"usage")):
                key = rows.unpack(DSID, k, "usage row key", "skipped")
                if key is None:
                    continue
                dsid = key[0]
                got = rows.unpack(
                    USAGE_ROW, v, f"usage row of dataset {dsid}", "recounted from its owners rows"
                )
                out[dsid] = self._count_usage(txn, dsid) if got is None else Usage(*got)
            return out

    def _count_usage(self, txn: lmdb.Transaction, dsid: int) -> Usage:
        """A dataset's usage from its owners rows (what each chunk charged): the usage
        row's truth, for a usage row that does not decode. Written back at its next
        change (_put_usage)."""
        prefix = DSID.pack(dsid)
        u = Usage()
        cur = txn.cursor(db=self.db(b"owners"))
        if cur.set_range(prefix):
            for k, v in cur:
                if not k.startswith(prefix):
                    break
                u = Usage(u.bytes + _owned_len(v), u.chunks + 1)
        return u

    def _put_usage(self, txn: lmdb.Transaction, dsid: int, u: Usage) -> None:
        txn.put(DSID.pack(dsid), USAGE_ROW.pack(u.bytes, u.chunks), db=self.db(b"usage"))

    def _remove_chunk(self, txn: lmdb.Transaction, key: bytes, usage: dict[int, Usage]) -> bool:
        """Delete a chunk and uncharge its owner; whether its value was deleted (a
        damaged node stays: _delete_chunk).

        The owner is found from the owners rows, not the header, because this runs
        when a value failed verification and its header cannot be trusted.
        """
        deleted = self._delete_chunk(txn, key)
        for owner in list(usage):
            row = DSID.pack(owner) + key
            length_raw = txn.get(row, db=self.db(b"owners"))
            if length_raw is not None:
                self._uncharge(txn, owner, row, _owned_len(length_raw), usage)
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
        txn.put(
            DSID.pack(item.dataset) + item.key,
            _OWNED_LEN.pack(item.data_len),
            db=self.db(b"owners"),
        )
        elsewhere = self.elsewhere
        if elsewhere is not None and elsewhere(item.key):
            txn.put(DSID.pack(item.dataset) + item.key, b"", db=self.db(b"stale"))
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
        prefix = DSID.pack(dsid)
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
                    marked += txn.put(DSID.pack(dsid) + key, b"", db=self.db(b"stale"))
        return marked

    def stale_count(self, dsid: int) -> int:
        with self.env.begin() as txn:
            cur = txn.cursor(db=self.db(b"stale"))
            prefix = DSID.pack(dsid)
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
        prefix = DSID.pack(dsid)
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

    def sweep_elsewhere(
        self, homed_live: Callable[[bytes], bool], after: bytes, usage: dict[int, Usage]
    ) -> tuple[int, int, bytes | None]:
        """Delete up to _EVICT_BATCH first eviction victims (the stale rows after `after`)
        whose chunk `homed_live` says is placed at another member that is live again:
        copies this node made standing in for a home that was down, which count in this
        node's part while reads go to their home. One write txn; returns the bytes freed,
        the chunks deleted and where to go on (None: done). A chunk placed here is never
        `homed_live`'s (the caller's rule), so a stand-in's own chunks stay."""
        freed = removed = 0
        with self.env.begin(write=True) as txn:
            cur = txn.cursor(db=self.db(b"stale"))
            batch: list[bytes] = []
            if cur.set_range(after) if after else cur.first():
                for row in cur.iternext(values=False):
                    if row == after:
                        continue
                    batch.append(bytes(row))
                    if len(batch) >= _EVICT_BATCH:
                        break
            for row in batch:
                if len(row) <= DSID.size:  # a damaged key: no chunk to evict, only the row
                    rows.damaged("stale row key", row, "deleted")
                    txn.delete(row, db=self.db(b"stale"))
                    continue
                dsid, key = DSID.unpack(row[: DSID.size])[0], row[DSID.size :]
                if not homed_live(key):
                    continue
                if self.owns(txn, dsid, key):
                    freed += self.remove_owned(txn, dsid, key, usage)  # and its stale row
                    removed += 1
                else:
                    txn.delete(row, db=self.db(b"stale"))
        return freed, removed, (batch[-1] if len(batch) >= _EVICT_BATCH else None)

    def remove_owned(
        self, txn: lmdb.Transaction, dsid: int, key: bytes, work: dict[int, Usage]
    ) -> int:
        """Delete a chunk `dsid` owns and uncharge it, in the caller's write txn."""
        row = DSID.pack(dsid) + key
        length = _owned_len(txn.get(row, db=self.db(b"owners")))
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
        if size > self.psize // 2 and not _intact_overflow(cur, addr, size, self.psize):
            if self._damaged(key):
                log.warning("chunk %s left in place: its first page's header disagrees", key.hex())
            return False
        return cur.cursor.delete()


def _delete_generations(
    txn: lmdb.Transaction,
    dsid: int,
    keep: set[int],
    dbs: Iterable[lmdb._Database],
    limit: int,
) -> int:
    """Delete up to `limit` rows of `dsid` whose generation is not in `keep`; returns how
    many were deleted (fewer than `limit`: nothing is left to delete)."""
    done = 0
    ds = DSID.pack(dsid)
    for db in dbs:
        cur = txn.cursor(db=db)
        if not cur.set_range(ds):
            continue
        while done < limit:
            k = cur.key()
            if not k.startswith(ds):
                break
            # A key too short for a generation (damaged) is in none that is kept: deleted.
            gen = GEN.unpack_from(k, DSID.size)[0] if len(k) >= DSID.size + GEN.size else None
            if gen is None:
                rows.damaged(f"listing row key of dataset {dsid}", k, "deleted")
            elif gen in keep:
                if not cur.set_range(gen_prefix(dsid, gen + 1)):
                    break
                continue
            if not cur.delete():
                break
            done += 1
    return done


def _intact_overflow(cur: ValueCursor, addr: int, size: int, psize: int) -> bool:
    """Whether the overflow value at `addr` (where cur.find() placed it: in the file, or
    in pages this write txn wrote) starts on a page whose header is an overflow page's
    of as many pages as `size` needs and, in the map, names that page. LMDB frees a
    deleted value's pages by that header; a node pointing into the middle of another
    value would free live pages."""
    head = addr - _PAGE_HEAD.size
    in_map = cur.start <= head < cur.map_end
    if in_map and (head - cur.start) % psize:
        return False
    pgno, _, flags, pages = _PAGE_HEAD.unpack(ctypes.string_at(head, _PAGE_HEAD.size))
    need = -(-(size + _PAGE_HEAD.size) // psize)
    if in_map:
        return pgno == (head - cur.start) // psize and flags == _P_OVERFLOW and pages == need
    # A page of this txn's own (in the heap): the one LMDB found under that number.
    return flags == _P_OVERFLOW | _P_DIRTY and pages == need
