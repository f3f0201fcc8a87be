"""A dataset's listing as a directory index in LMDB: built in batches, read on demand.

Owns the on-disk form of a listing (LISTING_FORMAT) and both of its sides:
  dirents  dataset id (8) + generation (4) + parent inode (8) + name ->
             a directory: inode (8) + kind (1) [+ full name]
             a file: _FILE (inode, kind, size, mtime, since, ordinal) + version NUL
                     content id (the version inside it written as \x01) NUL [full name]
           (the full name only when it is too long for an LMDB key: the key then holds
           its first bytes and an xxh3_128 of the whole name)
           ... + parent inode 0 + b"c" + inode -> b""   directory complete (see below)
           ... + parent inode 0 + b"e" + parent + inode -> b""   tentative (see below)
  inodes   dataset id (8) + generation (4) + inode (8) ->
             a directory: _INODE header + path
             a file: kind (1) + parent inode (8) + name: where its dirents row is
A file's row in its directory carries everything lookup, readdir and open need, so a
walk (find, ls -l) reads one directory's rows in key order and never the inodes B-tree
(hash-keyed, so every get there lands on another page); an inode number alone (getattr,
open by the kernel) goes through the small inodes row to the dirents row.
ListingBuilder turns a stream of ObjectInfo (any order, any size) into those rows, one
bounded batch per write txn, keeping only one batch of directory state in memory. A
fanned-out listing also sends PrefixListed records: a prefix's sub-prefixes become
directories as soon as a page names them, and a prefix whose pages are all listed gets a
"complete" row, so a mount serving a listing still being written (--list-in-background)
can answer lookups and readdir of that directory before the whole listing is done. A
directory made from a listed prefix is *tentative* (its "e" row, keyed by its parent so
a readdir sees its directory's in one seek) until an object is written under it: a
prefix can hold only 'dir/' markers (or keys that are skipped), and then the directory
is not in the finished listing. It is removed as soon as that is known (its prefix and
those of all its subdirectories listed to their end, with no object), so a mount waits
for a tentative directory, never shows it empty and then loses it.
ListingReader answers lookup/getattr/readdir/resolve-a-path from a read txn, so a mount
never holds the listing in memory. Never opens the env, never decides when to list, and
never talks to a store.

Invariants:
- Inode numbers hash the path, so they do not depend on listing order and a path keeps
  its inode across refreshes; the root is 1. A directory's is xxh3_64 of "d:" + path; a
  file's is its directory's top bits + xxh3_64 of "f:" + path in the low _FILE_BITS.
  A collision (another path already has the number in this generation) probes the next
  number.
- A generation is written completely before the dataset record names it; rows of other
  generations are garbage the daemon deletes in bounded txns (delete_generations).
- A directory has a "complete" row only once every object directly under it and every
  sub-prefix naming it were written (the backend sends PrefixListed after them, and sends
  what a sub-prefix lists only after the page that named it). A directory with a
  "complete" row and no tentative subdirectory ("settled") has exactly the entries it has
  in the finished listing.
- Directories made from a prefix that ended up with no object (only markers, or only
  keys that were skipped) are removed once their prefix and their subdirectories' are
  all listed, and at the latest by finish(), so the finished listing is what a serial one
  would be; until then they are tentative, and only tentative directories are removed.
- Keys no POSIX path can name (empty, '.' or '..' parts, NUL) are skipped and counted; a
  file whose name is also a directory prefix is shadowed (the directory wins, whatever the
  order the keys arrive in), and so is a second object under the same key.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import lmdb
import xxhash

from silofs.records import ObjectInfo, PrefixListed

log = logging.getLogger(__name__)

ROOT_INODE = 1
DIR, FILE = 0, 1
_ID = struct.Struct(">Q")
_GEN = struct.Struct(">I")
_INO = struct.Struct(">Q")
_DIRENT = struct.Struct("<QB")
# kind, parent, size, mtime, aux (dirs: subdirectories; files: ordinal), since (the
# generation whose listing first showed this path with this version: a mount that started
# later cannot have other bytes of it in the kernel's page cache).
_INODE = struct.Struct("<BQQdQI")
# A file's dirents value: inode, kind, size, mtime, since, ordinal in the listing.
_FILE = struct.Struct("<QBQdIQ")
_FREF = struct.Struct("<BQ")  # a file's inodes value: kind, parent (+ name)
# Bumped when the rows change shape; a listing of another format is listed again.
LISTING_FORMAT = 2
_SAME = b"\x01"  # in a stored content id: "the version goes here" (S3: s3:ETAG:size)
_INO_MASK = (1 << 63) - 1  # signed-safe for every consumer of st_ino
# A file's inode number: its directory's path hash in the top 23 bits, its own path's in
# the low 40. The inodes rows are keyed by number, so one directory's files are
# neighbours in that B-tree: a batch dirties a few pages per directory, not a page per
# file (with whole-number hashes a batch's puts landed on random pages of a tree that
# grows with the listing: 5.6 us per object at the start of 1 M, 19.6 at its end).
# Two of a directory's k files share a number with odds ~k^2 / 2^41 (5e-7 for 1,000):
# the second probes on, its number then depends on which came first.
_FILE_BITS = 40
_FILE_LOW = (1 << _FILE_BITS) - 1
_SAMPLES = 5  # shadowed/skipped keys kept as examples for the log and the record


def encode_name(key: str) -> list[bytes] | None:
    """The path components of an object key, or None if no POSIX path can name it."""
    parts = key.encode("utf-8", "surrogateescape").split(b"/")
    for p in parts:
        if p in (b"", b".", b"..") or b"\0" in p:
            return None
    return parts


def _dir_bits(dir_path: bytes) -> int:
    """The top bits every file inode number in directory `dir_path` starts with."""
    return (xxhash.xxh3_64_intdigest(b"d:" + dir_path) & _INO_MASK) >> _FILE_BITS << _FILE_BITS


def _gen_prefix(dsid: int, gen: int) -> bytes:
    return _ID.pack(dsid) + _GEN.pack(gen)


@dataclass(slots=True)
class Entry:
    """One inode of a listing generation."""

    inode: int
    is_dir: bool
    parent: int
    size: int
    mtime: float
    aux: int  # directories: number of subdirectories; files: ordinal in the listing
    since: int
    path: bytes
    version: str = ""
    content_id: str = ""

    @property
    def name(self) -> bytes:
        return self.path.rsplit(b"/", 1)[-1]

    @property
    def obj(self) -> ObjectInfo | None:
        if self.is_dir:
            return None
        key = self.path.decode("utf-8", "surrogateescape")
        return ObjectInfo(key, self.size, self.mtime, self.version, self.content_id)


def _enc(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def _dec(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def _decode_inode(ino: int, raw: bytes | memoryview) -> Entry:
    """A directory's inodes row."""
    kind, parent, size, mtime, aux, since = _INODE.unpack_from(raw)
    assert kind == DIR
    return Entry(ino, True, parent, size, mtime, aux, since, bytes(raw[_INODE.size :]))


def _encode_inode(e: Entry) -> bytes:
    assert e.is_dir
    return _INODE.pack(DIR, e.parent, e.size, e.mtime, e.aux, e.since) + e.path


def _pack_cid(version: bytes, cid: bytes) -> bytes:
    """The content id as stored: most stores build it from the version (S3
    "s3:ETAG:size", local "local:VERSION"), which the row already holds."""
    if version and version in cid and _SAME not in cid:
        return _SAME + cid.replace(version, _SAME)
    if cid[:1] in (_SAME, b"\x02"):
        return b"\x02" + cid  # escaped: a raw id that starts like a template
    return cid


def _unpack_cid(version: bytes, stored: bytes) -> bytes:
    if stored[:1] == _SAME:
        return stored[1:].replace(_SAME, version)
    if stored[:1] == b"\x02":
        return stored[1:]
    return stored


def _encode_file(ino: int, obj: ObjectInfo, since: int, ordinal: int, long_name: bytes) -> bytes:
    version = obj.version.encode("utf-8", "surrogateescape")
    cid = _pack_cid(version, obj.content_id.encode("utf-8", "surrogateescape"))
    head = _FILE.pack(ino, FILE, obj.size, obj.mtime, since, ordinal)
    return b"".join((head, version, b"\0", cid, b"\0", long_name))


def _file_entry(parent: int, parent_path: bytes, name: bytes, v: bytes | memoryview) -> Entry:
    """A file's Entry from its dirents value."""
    ino, _, size, mtime, since, ordinal = _FILE.unpack_from(v)
    version, stored, _ = bytes(v[_FILE.size :]).split(b"\0", 2)
    path = parent_path + b"/" + name if parent != ROOT_INODE else name
    cid = _unpack_cid(version, stored)
    return Entry(ino, False, parent, size, mtime, ordinal, since, path, _dec(version), _dec(cid))


def _dirent_name(key: bytes | memoryview, n: int, v: bytes | memoryview) -> bytes:
    """The entry's name: the key's tail, or the full name a hashed long name keeps."""
    if v[8] == DIR:
        full = bytes(v[_DIRENT.size :])
    else:
        full = bytes(v[_FILE.size :]).split(b"\0", 2)[2]
    return full or bytes(key[n:])


class _Rows:
    """Row keys of one (dataset, generation), and the long-name fallback."""

    def __init__(self, dsid: int, gen: int, max_key: int) -> None:
        self.prefix = _gen_prefix(dsid, gen)
        self.gen = gen
        self.room = max_key - len(self.prefix) - _INO.size  # bytes left for a name

    def dirent(self, parent: int, name: bytes) -> tuple[bytes, bool]:
        """The dirents key of (parent, name), and whether the name had to be hashed."""
        base = self.prefix + _INO.pack(parent)
        if len(name) <= self.room:
            return base + name, False
        return base + name[: self.room - 16] + xxhash.xxh3_128_digest(name), True

    def dir_prefix(self, parent: int) -> bytes:
        return self.prefix + _INO.pack(parent)

    def inode(self, ino: int) -> bytes:
        return self.prefix + _INO.pack(ino)

    def mark(self, kind: bytes, ino: int = 0) -> bytes:
        """A row under parent inode 0 (no directory has it): b"c" complete."""
        return self.prefix + _INO.pack(0) + kind + (_INO.pack(ino) if ino else b"")

    def tentative(self, parent: int = 0, ino: int = 0) -> bytes:
        """The "e" row of directory `ino` in `parent` (made from a listed prefix, no object
        under it yet); with only `parent`, the prefix of its directory's such rows."""
        key = self.prefix + _INO.pack(0) + b"e"
        if parent:
            key += _INO.pack(parent)
            if ino:
                key += _INO.pack(ino)
        return key


@dataclass
class ListingTotals:
    files: int = 0
    bytes: int = 0
    inodes: int = 1  # the root
    shadowed: int = 0
    skipped: int = 0
    shadowed_keys: list[str] = field(default_factory=list)
    skipped_keys: list[str] = field(default_factory=list)
    next_ordinal: int = 0
    blocks: int = 0  # 4 KiB blocks the files would take on a disk (statfs)


class ListingBuilder:
    """Writes one generation of a dataset's listing, one batch per write txn.

    Memory is one batch of objects plus the directories that batch touched: directory
    state (mtime, subdirectory count) is read from and written back to the inodes rows at
    the end of every batch, never kept for the whole listing.
    """

    def __init__(
        self,
        dsid: int,
        gen: int,
        dirents: lmdb._Database,
        inodes: lmdb._Database,
        max_key: int,
        previous: int | None = None,
    ) -> None:
        self.dsid = dsid
        self.gen = gen
        self.rows = _Rows(dsid, gen, max_key)
        self.prev = _Rows(dsid, previous, max_key) if previous is not None else None
        self.dirents = dirents
        self.inodes = inodes
        self.totals = ListingTotals()
        self._dirs: dict[int, Entry] = {}  # this batch's directories, by inode
        self._blocked: set[str] = set()  # listed prefixes never to be marked complete
        self._resolved: set[int] = set()  # directories this batch wrote an object under
        # The directory chain (root first) of the last object added and its key's
        # directory part: the next key of the same directory (most keys: a listing comes
        # a directory at a time) reuses it. Its entries are those of self._dirs, so it
        # lives until anything may take one out of there (a flush, a listed prefix).
        self._last_dir: str | None = None
        self._last_chain: list[Entry] = []
        # ... and what every file row under that directory starts with: its dirents
        # key prefix, its inodes value prefix (_FREF), its path + "/", the top bits of
        # its files' inode numbers (_dir_bits).
        self._last_rows = (b"", b"", b"", 0)

    def start(self, txn: lmdb.Transaction) -> None:
        """Write the empty root. The generation's rows must not exist yet."""
        root = Entry(ROOT_INODE, True, ROOT_INODE, 0, 0.0, 0, self.gen, b"")
        txn.put(self.rows.inode(ROOT_INODE), _encode_inode(root), db=self.inodes)

    def add(self, txn: lmdb.Transaction, objects: Iterable[ObjectInfo | PrefixListed]) -> None:
        """Add a batch of objects (and PrefixListed records) in the caller's write txn."""
        try:
            for obj in objects:
                if isinstance(obj, PrefixListed):
                    self._prefix(txn, obj)
                else:
                    self._add(txn, obj)
        finally:
            self._flush_dirs(txn)

    def _flush_dirs(self, txn: lmdb.Transaction) -> None:
        for d in self._dirs.values():
            txn.put(self.rows.inode(d.inode), _encode_inode(d), db=self.inodes)
        self._dirs.clear()
        self._resolved.clear()
        self._last_dir = None

    # -- one object ----------------------------------------------------------------
    def _dir(self, txn: lmdb.Transaction, ino: int) -> Entry:
        d = self._dirs.get(ino)
        if d is None:
            raw = txn.get(self.rows.inode(ino), db=self.inodes)
            assert raw is not None, f"directory inode {ino} has no row"
            d = self._dirs[ino] = _decode_inode(ino, raw)
        return d

    def _free_inode(self, txn: lmdb.Transaction, kind: bytes, path: bytes) -> int:
        ino = xxhash.xxh3_64_intdigest(kind + path) & _INO_MASK
        while (
            ino <= ROOT_INODE
            or ino in self._dirs
            or txn.get(self.rows.inode(ino), db=self.inodes) is not None
        ):
            ino = (ino + 1) & _INO_MASK  # a collision: order-dependent, and rare (2^-63)
        return ino

    def _claim_file_inode(self, txn: lmdb.Transaction, path: bytes, fref: bytes, high: int) -> int:
        """_free_inode for a file, writing its inodes row `fref` in the same step: one
        put that fails on a taken number instead of a get before every put. `high` is
        _dir_bits() of its directory."""
        ino = high | (xxhash.xxh3_64_intdigest(b"f:" + path) & _FILE_LOW)
        while (
            ino <= ROOT_INODE
            or ino in self._dirs  # a directory of this batch: its row is written at flush
            or not txn.put(self.rows.inode(ino), fref, overwrite=False, db=self.inodes)
        ):
            ino = (ino + 1) & _INO_MASK
        return ino

    def _new_dir(
        self, txn: lmdb.Transaction, parent: Entry, name: bytes, row: bytes, long: bool
    ) -> Entry:
        path = parent.path + b"/" + name if parent.inode != ROOT_INODE else name
        ino = self._free_inode(txn, b"d:", path)
        d = Entry(ino, True, parent.inode, 0, 0.0, 0, self.gen, path)
        self._dirs[ino] = d
        parent.aux += 1
        self.totals.inodes += 1
        txn.put(row, _DIRENT.pack(ino, DIR) + (name if long else b""), db=self.dirents)
        return d

    def _note(self, keys: list[str], key: str) -> None:
        if len(keys) < _SAMPLES:
            keys.append(key)

    def _shadow_file(self, txn: lmdb.Transaction, parent: Entry, name: bytes, v: bytes) -> None:
        """A file that turned out to be a directory prefix: it leaves the listing (the
        caller overwrites its dirents row with the directory's)."""
        f = _file_entry(parent.inode, parent.path, name, v)
        txn.delete(self.rows.inode(f.inode), db=self.inodes)
        self.totals.files -= 1
        self.totals.bytes -= f.size
        self.totals.blocks -= -(-f.size // 4096)
        self.totals.inodes -= 1
        self.totals.shadowed += 1
        self._note(self.totals.shadowed_keys, f.path.decode("utf-8", "surrogateescape"))

    def _add(self, txn: lmdb.Transaction, obj: ObjectInfo) -> None:
        # The hot loop of a first listing (every object, ~5 us each): the rows' parts
        # that depend only on the directory are made once per directory (_last_rows).
        t = self.totals
        where, _, leaf = obj.key.rpartition("/")
        if where == self._last_dir and where:
            chain, name = self._last_chain, leaf.encode("utf-8", "surrogateescape")
            if name in (b".", b"..") or not name or b"\0" in name:
                t.skipped += 1  # see below
                self._note(t.skipped_keys, obj.key)
                return
        else:
            parts = encode_name(obj.key)
            if parts is None:
                # "a//b", "/a", "./a", "a/..": an entry named "", "." or ".." would break
                # readdir and lookup (and "." would make the tree a loop).
                t.skipped += 1
                self._note(t.skipped_keys, obj.key)
                return
            chain, name = self._chain(txn, parts[:-1]), parts[-1]
            d = chain[-1]
            self._last_dir, self._last_chain = where, chain
            self._last_rows = (
                self.rows.dir_prefix(d.inode),
                _FREF.pack(FILE, d.inode),
                d.path + b"/" if d.inode != ROOT_INODE else b"",
                _dir_bits(d.path),
            )
        parent = chain[-1]
        dir_row, fref, path, high = self._last_rows
        long = len(name) > self.rows.room
        row = self.rows.dirent(parent.inode, name)[0] if long else dir_row + name
        path += name
        ino = self._claim_file_inode(txn, path, fref + name, high)
        since = self.gen
        if self.prev is not None:
            # The same path in the previous generation: its directory has the same inode
            # (inode numbers follow the path), so its row has the same key.
            old = txn.get(self.prev.dirent(parent.inode, name)[0], db=self.dirents)
            if old is not None and old[8] == FILE:
                e = _file_entry(parent.inode, parent.path, name, old)
                if e.inode == ino and e.version == obj.version:
                    since = e.since
        value = _encode_file(ino, obj, since, t.next_ordinal, name if long else b"")
        if not txn.put(row, value, overwrite=False, db=self.dirents):
            # A duplicate key, or a file whose name a directory already took: give the
            # inode number back.
            txn.delete(self.rows.inode(ino), db=self.inodes)
            t.shadowed += 1
            self._note(t.shadowed_keys, obj.key)
            return
        t.next_ordinal += 1
        t.files += 1
        t.bytes += obj.size
        t.blocks += -(-obj.size // 4096)
        t.inodes += 1
        resolved = self._resolved
        for d in chain:  # a directory's mtime is its newest entry's
            if obj.mtime > d.mtime:
                d.mtime = obj.mtime
            if d.inode not in resolved and d.inode != ROOT_INODE:
                # It holds an object now: no longer tentative (one delete per directory
                # per batch; a no-op for one that never was).
                resolved.add(d.inode)
                txn.delete(self.rows.tentative(d.parent, d.inode), db=self.dirents)

    def _chain(self, txn: lmdb.Transaction, dirs: list[bytes]) -> list[Entry]:
        """The directories of path components `dirs`, root first, made where missing."""
        chain = [self._dir(txn, ROOT_INODE)]
        for part in dirs:
            parent = chain[-1]
            row, long = self.rows.dirent(parent.inode, part)
            raw = txn.get(row, db=self.dirents)
            if raw is None:
                chain.append(self._new_dir(txn, parent, part, row, long))
                continue
            ino, kind = _DIRENT.unpack_from(raw)
            if kind == FILE:
                # A file "a" and a key "a/b": the directory wins or "a/b" is unreachable.
                self._shadow_file(txn, parent, part, bytes(raw))
                chain.append(self._new_dir(txn, parent, part, row, long))
            else:
                chain.append(self._dir(txn, ino))
        return chain

    # -- listed prefixes (fan-out) -----------------------------------------------------
    def _eager_dir(self, txn: lmdb.Transaction, parent: Entry, name: bytes) -> Entry | None:
        """Directory `name` in `parent`, made now if missing; None if a file has the name
        (the first object under it will shadow the file, as in _add)."""
        row, long = self.rows.dirent(parent.inode, name)
        raw = txn.get(row, db=self.dirents)
        if raw is None:
            d = self._new_dir(txn, parent, name, row, long)
            txn.put(self.rows.tentative(parent.inode, d.inode), b"", db=self.dirents)
            return d
        ino, kind = _DIRENT.unpack_from(raw)
        return None if kind == FILE else self._dir(txn, ino)

    def _prefix(self, txn: lmdb.Transaction, p: PrefixListed) -> None:
        self._last_dir = None  # it may remove directories (_settle)
        if p.key in self._blocked:
            return  # a page of it was skipped: its sub-prefixes may be missing
        d: Entry | None = self._dir(txn, ROOT_INODE)
        if p.key:
            parts = encode_name(p.key[:-1])
            if parts is None:
                return  # every key under it is skipped
            for part in parts:
                assert d is not None
                d = self._eager_dir(txn, d, part)
                if d is None:
                    # A file has the name: this page's sub-prefixes are not made, so
                    # the directory is complete only with the whole listing, even once
                    # an object under it shadows the file. Rare (a file and a prefix of
                    # one name), so the set stays small.
                    self._blocked.add(p.key)
                    return
        assert d is not None
        for sub in p.subs:
            name = sub[len(p.key) : -1]
            if sub.startswith(p.key) and sub.endswith("/") and encode_name(name) == [_enc(name)]:
                self._eager_dir(txn, d, _enc(name))
        if p.done:
            txn.put(self.rows.mark(b"c", d.inode), b"", db=self.dirents)
            self._settle(txn, d)

    def _has_entries(self, txn: lmdb.Transaction, ino: int) -> bool:
        cur = txn.cursor(db=self.dirents)
        start = self.rows.dir_prefix(ino)
        return cur.set_range(start) and bytes(cur.key()).startswith(start)

    def _settle(self, txn: lmdb.Transaction, d: Entry) -> None:
        """`d`'s prefix is listed to its end: if `d` is still tentative and has no
        entries (no object, and every subdirectory it had was removed so), no object can
        come under it: remove it now, not at finish(), so a mount waiting on it answers
        ENOENT, the finished listing's answer. Then its parent likewise, if complete."""
        while d.inode != ROOT_INODE:
            tentative = self.rows.tentative(d.parent, d.inode)
            if txn.get(tentative, db=self.dirents) is None:
                return  # an object was written under it, or it was never tentative
            if txn.get(self.rows.mark(b"c", d.inode), db=self.dirents) is None:
                return  # pages of its prefix are still to come
            if self._has_entries(txn, d.inode):
                return  # tentative subdirectories still being listed
            self._remove(txn, d)
            d = self._dir(txn, d.parent)

    def _remove(self, txn: lmdb.Transaction, e: Entry) -> None:
        """Remove tentative directory `e` (no entries) and its rows."""
        txn.delete(self.rows.tentative(e.parent, e.inode), db=self.dirents)
        txn.delete(self.rows.dirent(e.parent, e.name)[0], db=self.dirents)
        txn.delete(self.rows.inode(e.inode), db=self.inodes)
        txn.delete(self.rows.mark(b"c", e.inode), db=self.dirents)
        self._dirs.pop(e.inode, None)
        self._dir(txn, e.parent).aux -= 1
        self.totals.inodes -= 1

    def finish(self, txn: lmdb.Transaction) -> None:
        """Remove the tentative directories left (made from listed prefixes that no
        object ended up in: a prefix whose listing never sent its end, e.g. behind a file
        of the same name), deepest first (so a parent emptied by that goes too)."""
        start = self.rows.tentative()
        cur = txn.cursor(db=self.dirents)
        tentative: list[int] = []
        if cur.set_range(start):
            for k, _ in cur:
                if not k.startswith(start):
                    break
                tentative.append(_INO.unpack(k[-_INO.size :])[0])
        entries = [e for e in (self._get(txn, ino) for ino in tentative) if e is not None]
        for e in sorted(entries, key=lambda e: -e.path.count(b"/")):
            if self._has_entries(txn, e.inode):
                # Not reached: an entry under it is a file (which resolved it) or a
                # tentative directory (removed before it, deepest first).
                txn.delete(self.rows.tentative(e.parent, e.inode), db=self.dirents)
                continue
            e = self._dirs.get(e.inode, e)
            self._remove(txn, e)
        self._flush_dirs(txn)

    def _get(self, txn: lmdb.Transaction, ino: int) -> Entry | None:
        raw = txn.get(self.rows.inode(ino), db=self.inodes)
        return None if raw is None else _decode_inode(ino, raw)

    def record(self) -> dict:
        t = self.totals
        return {
            "gen": self.gen,
            "objects": t.files,
            "size": t.bytes,
            "inodes": t.inodes,
            "ordinals": t.next_ordinal,
            "blocks": t.blocks,
            "shadowed": t.shadowed,
            "skipped": t.skipped,
            "shadowed_keys": t.shadowed_keys,
            "skipped_keys": t.skipped_keys,
            "listing_format": LISTING_FORMAT,
        }


class ListingReader:
    """Lookups in one generation of one dataset's listing, through the caller's txn."""

    def __init__(
        self, dsid: int, gen: int, dirents: lmdb._Database, inodes: lmdb._Database, max_key: int
    ) -> None:
        self.dsid = dsid
        self.gen = gen
        self.rows = _Rows(dsid, gen, max_key)
        self.dirents = dirents
        self.inodes = inodes

    def get(self, txn: lmdb.Transaction, ino: int) -> Entry | None:
        if not 0 < ino <= _INO_MASK:
            return None
        raw = txn.get(self.rows.inode(ino), db=self.inodes)
        if raw is None:
            return None
        if raw[0] == DIR:
            return _decode_inode(ino, raw)
        _, parent = _FREF.unpack_from(raw)
        name = bytes(raw[_FREF.size :])
        v = txn.get(self.rows.dirent(parent, name)[0], db=self.dirents)
        if v is None:
            return None
        return _file_entry(parent, self._path(txn, parent), name, v)

    def _path(self, txn: lmdb.Transaction, directory: int) -> bytes:
        raw = txn.get(self.rows.inode(directory), db=self.inodes)
        return b"" if raw is None else bytes(raw[_INODE.size :])

    def child(self, txn: lmdb.Transaction, parent: int, name: bytes) -> int | None:
        """The inode of `name` in directory `parent` (no '.'/'..' handling)."""
        row, long = self.rows.dirent(parent, name)
        raw = txn.get(row, db=self.dirents)
        if raw is None:
            return None
        if long and _dirent_name(row, 0, raw) != name:
            return None  # another long name with the same first bytes and hash
        return _DIRENT.unpack_from(raw)[0]

    def complete(self, txn: lmdb.Transaction, ino: int) -> bool:
        """Whether directory `ino` has all its entries in a generation still being
        written (a finished generation is complete throughout): a name it lacks is not
        in the finished listing. Its tentative subdirectories may still go (settled)."""
        return txn.get(self.rows.mark(b"c", ino), db=self.dirents) is not None

    def tentative(self, txn: lmdb.Transaction, parent: int, ino: int) -> bool:
        """Whether directory `ino` in `parent` was made from a listed prefix and has no
        object under it yet: it may turn out to hold only markers and be removed."""
        return txn.get(self.rows.tentative(parent, ino), db=self.dirents) is not None

    def settled(self, txn: lmdb.Transaction, ino: int) -> bool:
        """Whether directory `ino` has exactly its entries of the finished listing: it is
        complete and none of its subdirectories is tentative."""
        if not self.complete(txn, ino):
            return False
        cur = txn.cursor(db=self.dirents)
        start = self.rows.tentative(ino)
        return not (cur.set_range(start) and bytes(cur.key()).startswith(start))

    def lookup(
        self, txn: lmdb.Transaction, parent: int, name: bytes, parent_path: bytes | None = None
    ) -> Entry | None:
        """`name` in directory `parent` (whose path the caller may know already)."""
        row, long = self.rows.dirent(parent, name)
        v = txn.get(row, db=self.dirents)
        if v is None or (long and _dirent_name(row, 0, v) != name):
            return None
        if v[8] == DIR:
            return self.get(txn, _DIRENT.unpack_from(v)[0])
        if parent_path is None:
            parent_path = self._path(txn, parent)
        return _file_entry(parent, parent_path, name, v)

    def children(
        self, txn: lmdb.Transaction, parent: int, after: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes, int]]:
        """(row key, name, inode) of a directory's entries in index order, after `after`
        (a row key this generator returned earlier)."""
        prefix = self.rows.dir_prefix(parent)
        n = len(prefix)
        cur = txn.cursor(db=self.dirents)
        start = prefix if after is None else after
        if not cur.set_range(start):
            return
        if after is not None and cur.key() == after and not cur.next():
            return
        for k, v in cur:
            if not k.startswith(prefix):
                return
            key = bytes(k)
            yield key, _dirent_name(key, n, v), _DIRENT.unpack_from(v)[0]

    def entries(
        self, txn: lmdb.Transaction, parent: int, after: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes, int, Entry | None]]:
        """children(), with each file's Entry read from the directory's own rows (no
        inodes get: a walk reads the directory in key order); None for a directory
        (its subdirectory count is in its inodes row: get() it). The file entries'
        paths are empty: they are for attributes."""
        prefix = self.rows.dir_prefix(parent)
        n = len(prefix)
        cur = txn.cursor(db=self.dirents)
        if not cur.set_range(prefix if after is None else after):
            return
        if after is not None and cur.key() == after and not cur.next():
            return
        for k, v in cur:
            if not k.startswith(prefix):
                return
            key = bytes(k)
            name = _dirent_name(key, n, v)
            if v[8] == DIR:
                yield key, name, _DIRENT.unpack_from(v)[0], None
            else:
                e = _file_entry(parent, b"", name, v)
                yield key, name, e.inode, e

    def resolve(self, txn: lmdb.Transaction, key: str) -> Entry | None:
        """The file listed under object key `key`, or None."""
        parts = encode_name(key)
        if parts is None:
            return None
        ino: int | None = ROOT_INODE
        for part in parts:
            assert ino is not None
            ino = self.child(txn, ino, part)
            if ino is None:
                return None
        e = self.get(txn, ino)  # type: ignore[arg-type]
        return e if e is not None and not e.is_dir else None

    def iter_files(self, txn: lmdb.Transaction) -> Iterator[Entry]:
        """Every file, directory by directory (the dirents rows in key order)."""
        for _, e in self.iter_file_rows(txn):
            yield e

    def iter_file_rows(
        self, txn: lmdb.Transaction, start: bytes | None = None
    ) -> Iterator[tuple[bytes, Entry]]:
        """(row, Entry) of every file from row `start` on; a row is the dirents key
        without the generation's prefix, the same in every generation for one path
        (file_at)."""
        prefix = self.rows.prefix
        n = len(prefix) + _INO.size
        cur = txn.cursor(db=self.dirents)
        # The parent-0 rows ("complete", "eager") sort first: start after them.
        if not cur.set_range(prefix + (start or _INO.pack(ROOT_INODE))):
            return
        last, path = -1, b""
        for k, v in cur:
            if not k.startswith(prefix):
                return
            if v[8] != FILE:
                continue
            parent = _INO.unpack_from(k, len(prefix))[0]
            if parent != last:
                last, path = parent, self._path(txn, parent)
            yield bytes(k[len(prefix) :]), _file_entry(parent, path, _dirent_name(k, n, v), v)

    def file_at(self, txn: lmdb.Transaction, row: bytes) -> Entry | None:
        """The file at `row` (iter_file_rows) in this generation (its path not set)."""
        v = txn.get(self.rows.prefix + row, db=self.dirents)
        if v is None or v[8] != FILE:
            return None
        parent = _INO.unpack_from(row)[0]
        return _file_entry(parent, b"", _dirent_name(row, _INO.size, v), v)


# A file row's bytes that a refresh keeps when the file did not change: all but `since`
# and `ordinal` (the tail of the _FILE header), which a new listing may renumber.
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
    if not cur.set_range(prefix + (start or _INO.pack(ROOT_INODE))):
        return out, None
    seen = 0
    for key, v in cur:
        k = bytes(key)  # a view with a buffers=True txn, as a mount's
        if not k.startswith(prefix):
            return out, None
        if seen >= limit:
            return out, k[n:]
        seen += 1
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
            if now[:_SAME_HEAD] == v[:_SAME_HEAD] and now[_FILE.size :] == v[_FILE.size :]:
                continue
            gone = False  # the same name, other attributes
        name = _dirent_name(k, n + _INO.size, v) if gone else None
        out.append((_DIRENT.unpack_from(v)[0], _INO.unpack_from(k, n)[0], name))
    return out, None


def delete_generations(
    txn: lmdb.Transaction,
    dsid: int,
    keep: set[int],
    dbs: Iterable[lmdb._Database],
    limit: int,
) -> int:
    """Delete up to `limit` rows of `dsid` whose generation is not in `keep`; returns how
    many were deleted (fewer than `limit`: nothing is left to delete)."""
    done = 0
    ds = _ID.pack(dsid)
    for db in dbs:
        cur = txn.cursor(db=db)
        if not cur.set_range(ds):
            continue
        while done < limit:
            k = cur.key()
            if not k.startswith(ds):
                break
            gen = _GEN.unpack(k[8:12])[0]
            if gen in keep:
                if not cur.set_range(_gen_prefix(dsid, gen + 1)):
                    break
                continue
            if not cur.delete():
                break
            done += 1
    return done
