"""A dataset's listing as a directory index in LMDB: its rows, and lookups in them.

Owns the on-disk form of a listing (LISTING_FORMAT), which both processes read:
  dirents  dataset id (8) + generation (4) + parent inode (8) + name ->
             a directory: inode (8) + kind (1) [+ full name]
             a file: FILE_HEAD (inode, kind, size, mtime, since, ordinal) + version NUL
                     content id (the version inside it written as \x01) NUL [full name]
           (the full name only when it is too long for an LMDB key: the key then holds
           its first bytes and an xxh3_128 of the whole name)
           ... + parent inode 0 + b"c" + inode -> b""   directory complete (see below)
           ... + parent inode 0 + b"e" + parent + inode -> b""   tentative (see below)
  inodes   dataset id (8) + generation (4) + inode (8) ->
             a directory: DIR_HEAD header + path
             a file: kind (1) + parent inode (8) + name: where its dirents row is
A file's row in its directory carries everything lookup, readdir and open need, so a
walk (find, ls -l) reads one directory's rows in key order and never the inodes B-tree
(hash-keyed, so every get there lands on another page); an inode number alone (getattr,
open by the kernel) goes through the small inodes row to the dirents row.
The rows of a generation are written by the daemon (node/listing_builder.py: one
bounded batch per write txn). A directory made from a prefix a fanned-out listing named
is *tentative* (its "e" row, keyed by its parent so a readdir sees its directory's in one
seek) until an object is written under it, and a directory whose prefix is listed to its
end gets a "complete" row, so a mount serving a listing still being written
(--list-in-background) can answer for that directory before the whole listing is done.
ListingReader answers lookup/getattr/readdir/resolve-a-path from a read txn, so a mount
never holds the listing in memory. The row encoders stay here, next to the decoders
that read their bytes. Never opens the env, never writes it, never decides when to list,
and never talks to a store.

What a reader may rely on:
- Inode numbers hash the path (node/listing_builder.py), so a path keeps its inode
  across refreshes; the root is 1.
- A generation is written completely before the dataset record names it; rows of other
  generations are garbage the daemon deletes in bounded txns.
- A directory has a "complete" row only once every object directly under it and every
  sub-prefix naming it were written. A directory with a "complete" row and no tentative
  subdirectory ("settled") has exactly the entries it has in the finished listing.
- A tentative directory may still be removed (its prefix held no object).
- Keys no POSIX path can name (empty, '.' or '..' parts, NUL) are not in a listing; of a
  file and a directory of the same name, the directory is.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import lmdb
import xxhash

from silofs.cache.rows import DECODE_ERRORS, DamagedRowError, damaged
from silofs.records import ObjectInfo

log = logging.getLogger(__name__)

ROOT_INODE = 1
DIR, FILE = 0, 1
_ID = struct.Struct(">Q")
GEN = struct.Struct(">I")
INO = struct.Struct(">Q")
DIRENT = struct.Struct("<QB")
# kind, parent, size, mtime, aux (dirs: subdirectories; files: ordinal), since (the
# generation whose listing first showed this path with this version: a mount that started
# later cannot have other bytes of it in the kernel's page cache).
DIR_HEAD = struct.Struct("<BQQdQI")
# A file's dirents value: inode, kind, size, mtime, since, ordinal in the listing.
FILE_HEAD = struct.Struct("<QBQdIQ")
FILE_REF = struct.Struct("<BQ")  # a file's inodes value: kind, parent (+ name)
# Bumped when the rows change shape; a listing of another format is listed again.
LISTING_FORMAT = 2
_SAME = b"\x01"  # in a stored content id: "the version goes here" (S3: s3:ETAG:size)
INO_MASK = (1 << 63) - 1  # signed-safe for every consumer of st_ino


def encode_name(key: str) -> list[bytes] | None:
    """The path components of an object key, or None if no POSIX path can name it."""
    parts = key.encode("utf-8", "surrogateescape").split(b"/")
    for p in parts:
        if p in (b"", b".", b"..") or b"\0" in p:
            return None
    return parts


def gen_prefix(dsid: int, gen: int) -> bytes:
    """What every row key of one generation of one dataset's listing starts with."""
    return _ID.pack(dsid) + GEN.pack(gen)


@dataclass(slots=True)
class Entry:
    """One inode of a listing generation."""

    inode: int
    is_dir: bool
    parent: int
    size: int  # files: bytes; directories: entries (0 in a listing written before they were)
    mtime: float
    aux: int  # directories: number of subdirectories; files: ordinal in the listing
    since: int
    path: bytes
    version: str = ""
    content_id: str = ""
    # The file's ObjectInfo, decoded on first use: a mount opens a cached entry many
    # times, and the same entry gives the same object.
    _obj: ObjectInfo | None = field(default=None, compare=False, repr=False)
    # What a mount derives from the file once and keeps with its entry (the reference to
    # its first chunk: mount/fs.py open()), opaque here.
    first_chunk: Any = field(default=None, compare=False, repr=False)

    @property
    def name(self) -> bytes:
        return self.path.rsplit(b"/", 1)[-1]

    @property
    def obj(self) -> ObjectInfo | None:
        obj = self._obj
        if obj is None and not self.is_dir:
            key = self.path.decode("utf-8", "surrogateescape")
            obj = self._obj = ObjectInfo(key, self.size, self.mtime, self.version, self.content_id)
        return obj


def _dec(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def decode_dir(ino: int, raw: bytes | memoryview) -> Entry:
    """A directory's inodes row."""
    try:
        kind, parent, size, mtime, aux, since = DIR_HEAD.unpack_from(raw)
    except DECODE_ERRORS:
        raise DamagedRowError(f"inodes row of directory {ino} ({len(raw)} bytes)") from None
    assert kind == DIR
    return Entry(ino, True, parent, size, mtime, aux, since, bytes(raw[DIR_HEAD.size :]))


def encode_dir(e: Entry) -> bytes:
    assert e.is_dir
    return DIR_HEAD.pack(DIR, e.parent, e.size, e.mtime, e.aux, e.since) + e.path


def pack_cid(version: bytes, cid: bytes) -> bytes:
    """The content id as stored: most stores build it from the version (S3
    "s3:ETAG:size", local "local:VERSION"), which the row already holds."""
    if version and version in cid and _SAME not in cid:
        return _SAME + cid.replace(version, _SAME)
    if cid[:1] in (_SAME, b"\x02"):
        return b"\x02" + cid  # escaped: a raw id that starts like a template
    return cid


_MARKS = (_SAME, b"\x02")  # a stored content id that starts otherwise is the id itself


def unpack_cid(version: bytes, stored: bytes) -> bytes:
    if stored[:1] == _SAME:
        return stored[1:].replace(_SAME, version)
    if stored[:1] == b"\x02":
        return stored[1:]
    return stored


def encode_file(ino: int, obj: ObjectInfo, since: int, ordinal: int, long_name: bytes) -> bytes:
    version = obj.version.encode("utf-8", "surrogateescape")
    cid = pack_cid(version, obj.content_id.encode("utf-8", "surrogateescape"))
    head = FILE_HEAD.pack(ino, FILE, obj.size, obj.mtime, since, ordinal)
    return b"".join((head, version, b"\0", cid, b"\0", long_name))


def decode_file(parent: int, parent_path: bytes, name: bytes, v: bytes | memoryview) -> Entry:
    """A file's Entry from its dirents value."""
    try:
        ino, _, size, mtime, since, ordinal = FILE_HEAD.unpack_from(v)
        version, stored, _ = bytes(v[FILE_HEAD.size :]).split(b"\0", 2)
    except DECODE_ERRORS:
        raise DamagedRowError(f"dirents row of {name!r} in {parent} ({len(v)} bytes)") from None
    path = parent_path + b"/" + name if parent != ROOT_INODE else name
    cid = unpack_cid(version, stored) if stored[:1] in _MARKS else stored
    # Written out (no _dec): every lookup of a file the kernel does not know decodes one.
    return Entry(
        ino,
        False,
        parent,
        size,
        mtime,
        ordinal,
        since,
        path,
        version.decode("utf-8", "surrogateescape"),
        cid.decode("utf-8", "surrogateescape"),
    )


def dirent_name(key: bytes | memoryview, n: int, v: bytes | memoryview) -> bytes:
    """The entry's name: the key's tail, or the full name a hashed long name keeps."""
    if v[8] == DIR:
        full = bytes(v[DIRENT.size :])
    else:
        full = bytes(v[FILE_HEAD.size :]).split(b"\0", 2)[2]
    return full or bytes(key[n:])


class Rows:
    """Row keys of one (dataset, generation), and the long-name fallback."""

    def __init__(self, dsid: int, gen: int, max_key: int) -> None:
        self.prefix = gen_prefix(dsid, gen)
        self.gen = gen
        self.room = max_key - len(self.prefix) - INO.size  # bytes left for a name

    def dirent(self, parent: int, name: bytes) -> tuple[bytes, bool]:
        """The dirents key of (parent, name), and whether the name had to be hashed."""
        base = self.prefix + INO.pack(parent)
        if len(name) <= self.room:
            return base + name, False
        return base + name[: self.room - 16] + xxhash.xxh3_128_digest(name), True

    def dir_prefix(self, parent: int) -> bytes:
        return self.prefix + INO.pack(parent)

    def inode(self, ino: int) -> bytes:
        return self.prefix + INO.pack(ino)

    def mark(self, kind: bytes, ino: int = 0) -> bytes:
        """A row under parent inode 0 (no directory has it): b"c" complete."""
        return self.prefix + INO.pack(0) + kind + (INO.pack(ino) if ino else b"")

    def tentative(self, parent: int = 0, ino: int = 0) -> bytes:
        """The "e" row of directory `ino` in `parent` (made from a listed prefix, no object
        under it yet); with only `parent`, the prefix of its directory's such rows."""
        key = self.prefix + INO.pack(0) + b"e"
        if parent:
            key += INO.pack(parent)
            if ino:
                key += INO.pack(ino)
        return key


class ListingReader:
    """Lookups in one generation of one dataset's listing, through the caller's txn."""

    def __init__(
        self, dsid: int, gen: int, dirents: lmdb._Database, inodes: lmdb._Database, max_key: int
    ) -> None:
        self.dsid = dsid
        self.gen = gen
        self.rows = Rows(dsid, gen, max_key)
        self.dirents = dirents
        self.inodes = inodes

    def get(self, txn: lmdb.Transaction, ino: int) -> Entry | None:
        if not 0 < ino <= INO_MASK:
            return None
        raw = txn.get(self.rows.inode(ino), db=self.inodes)
        if raw is None:
            return None
        try:
            if raw[0] == DIR:
                return decode_dir(ino, raw)
            _, parent = FILE_REF.unpack_from(raw)
        except DECODE_ERRORS:
            raise DamagedRowError(f"inodes row of {ino} ({len(raw)} bytes)") from None
        name = bytes(raw[FILE_REF.size :])
        v = txn.get(self.rows.dirent(parent, name)[0], db=self.dirents)
        if v is None:
            return None
        return decode_file(parent, self._path(txn, parent), name, v)

    def _path(self, txn: lmdb.Transaction, directory: int) -> bytes:
        raw = txn.get(self.rows.inode(directory), db=self.inodes)
        return b"" if raw is None else bytes(raw[DIR_HEAD.size :])

    def child(self, txn: lmdb.Transaction, parent: int, name: bytes) -> int | None:
        """The inode of `name` in directory `parent` (no '.'/'..' handling)."""
        row, long = self.rows.dirent(parent, name)
        raw = txn.get(row, db=self.dirents)
        if raw is None:
            return None
        try:
            if long and dirent_name(row, 0, raw) != name:
                return None  # another long name with the same first bytes and hash
            return int(DIRENT.unpack_from(raw)[0])
        except DECODE_ERRORS:
            raise DamagedRowError(f"dirents row of {name!r} in {parent}") from None

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
        rows = self.rows
        if len(name) <= rows.room:  # Rows.dirent of a name that fits, written out
            v = txn.get(rows.prefix + INO.pack(parent) + name, db=self.dirents)
            if v is None:
                return None
        else:
            row, _ = rows.dirent(parent, name)
            v = txn.get(row, db=self.dirents)
            try:
                if v is None or dirent_name(row, 0, v) != name:
                    return None
            except DECODE_ERRORS:
                raise DamagedRowError(f"dirents row of {name!r} in {parent}") from None
        try:
            if v[8] == DIR:
                return self.get(txn, DIRENT.unpack_from(v)[0])
        except DECODE_ERRORS:
            raise DamagedRowError(f"dirents row of {name!r} in {parent}") from None
        if parent_path is None:
            parent_path = self._path(txn, parent)
        return decode_file(parent, parent_path, name, v)

    def children(
        self, txn: lmdb.Transaction, parent: int, after: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes, int]]:
        """(row key, name, inode) of a directory's entries in index order, after `after`
        (a row key this generator returned earlier)."""
        for key, name, ino, _ in self.entries(txn, parent, after, attrs=False):
            yield key, name, ino

    def entries(
        self, txn: lmdb.Transaction, parent: int, after: bytes | None = None, attrs: bool = True
    ) -> Iterator[tuple[bytes, bytes, int, Entry | None]]:
        """children(), with each file's Entry read from the directory's own rows (no
        inodes get: a walk reads the directory in key order); None for a directory
        (its subdirectory count is in its inodes row: get() it), and for every entry
        without `attrs`. The file entries' paths are empty: they are for attributes."""
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
            try:
                name = dirent_name(key, n, v)
                if not attrs or v[8] == DIR:
                    found: tuple[bytes, bytes, int, Entry | None] = (
                        key,
                        name,
                        DIRENT.unpack_from(v)[0],
                        None,
                    )
                else:
                    e = decode_file(parent, b"", name, v)
                    found = (key, name, e.inode, e)
            except (*DECODE_ERRORS, DamagedRowError):
                # One entry left out, not the whole directory's EIO: the others are whole.
                damaged(f"dirents row {key.hex()}", v, "left out of its directory")
                continue
            yield found

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
        n = len(prefix) + INO.size
        cur = txn.cursor(db=self.dirents)
        # The parent-0 rows ("complete", "eager") sort first: start after them.
        if not cur.set_range(prefix + (start or INO.pack(ROOT_INODE))):
            return
        last, path = -1, b""
        for k, v in cur:
            if not k.startswith(prefix):
                return
            try:
                if v[8] != FILE:
                    continue
                parent = INO.unpack_from(k, len(prefix))[0]
                if parent != last:
                    last, path = parent, self._path(txn, parent)
                e = decode_file(parent, path, dirent_name(k, n, v), v)
            except (*DECODE_ERRORS, DamagedRowError):
                damaged(f"dirents row {bytes(k).hex()}", v, "left out of the files")
                continue
            yield bytes(k[len(prefix) :]), e

    def file_at(self, txn: lmdb.Transaction, row: bytes) -> Entry | None:
        """The file at `row` (iter_file_rows) in this generation (its path not set)."""
        v = txn.get(self.rows.prefix + row, db=self.dirents)
        try:
            if v is None or v[8] != FILE:
                return None
            parent = INO.unpack_from(row)[0]
            name = dirent_name(row, INO.size, v)
        except DECODE_ERRORS:
            raise DamagedRowError(f"dirents row {row.hex()}") from None
        return decode_file(parent, b"", name, v)
