"""Writing one generation of a dataset's listing into the directory index (the daemon's side).

Owns ListingBuilder: it turns a stream of ObjectInfo (any order, any size) into the rows
cache/listing.py defines, one bounded batch per write txn, keeping only one batch of
directory state in memory. A fanned-out listing also sends PrefixListed records: a
prefix's sub-prefixes become directories as soon as a page names them, and a prefix
whose pages are all listed gets a "complete" row, so a mount serving a listing still
being written (--list-in-background) can answer lookups and readdir of that directory
before the whole listing is done. A directory made from a listed prefix is *tentative*
(its "e" row) until an object is written under it: a prefix can hold only 'dir/'
markers (or keys that are skipped), and then the directory is not in the finished
listing. It is removed as soon as that is known (its prefix and those of all its
subdirectories listed to their end, with no object), so a mount waits for a tentative
directory, never shows it empty and then loses it. Runs in the daemon's writer only;
never opens the env, never decides when to list, and never talks to a store.

Invariants (what cache/listing.py's readers rely on):
- Inode numbers hash the path, so they do not depend on listing order and a path keeps
  its inode across refreshes; the root is 1. A directory's is xxh3_64 of "d:" + path; a
  file's is its directory's top bits + xxh3_64 of "f:" + path in the low _FILE_BITS.
  A collision (another path already has the number in this generation) probes the next
  number.
- A directory gets its "complete" row only once every object directly under it and every
  sub-prefix naming it were written (the backend sends PrefixListed after them, and
  sends what a sub-prefix lists only after the page that named it).
- Directories made from a prefix that ended up with no object (only markers, or only
  keys that were skipped) are removed once their prefix and their subdirectories' are
  all listed, and at the latest by finish(), so the finished listing is what a serial one
  would be; until then they are tentative, and only tentative directories are removed.
- Keys no POSIX path can name (empty, '.' or '..' parts, NUL) are skipped and counted; a
  file whose name is also a directory prefix is shadowed (the directory wins, whatever
  the order the keys arrive in), and so is a second object under the same key.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import lmdb
import xxhash

from silofs.cache.listing import (
    DIR,
    DIRENT,
    FILE,
    FILE_REF,
    INO,
    INO_MASK,
    LISTING_FORMAT,
    ROOT_INODE,
    Entry,
    Rows,
    decode_dir,
    decode_file,
    encode_dir,
    encode_file,
    encode_name,
)
from silofs.cache.rows import DECODE_ERRORS, DamagedRowError
from silofs.records import ObjectInfo, PrefixListed

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


def _dir_bits(dir_path: bytes) -> int:
    """The top bits every file inode number in directory `dir_path` starts with."""
    return (xxhash.xxh3_64_intdigest(b"d:" + dir_path) & INO_MASK) >> _FILE_BITS << _FILE_BITS


def _enc(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


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
        self.rows = Rows(dsid, gen, max_key)
        self.prev = Rows(dsid, previous, max_key) if previous is not None else None
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
        # key prefix, its inodes value prefix (FILE_REF), its path + "/", the top bits of
        # its files' inode numbers (_dir_bits).
        self._last_rows = (b"", b"", b"", 0)

    def start(self, txn: lmdb.Transaction) -> None:
        """Write the empty root. The generation's rows must not exist yet."""
        root = Entry(ROOT_INODE, True, ROOT_INODE, 0, 0.0, 0, self.gen, b"")
        txn.put(self.rows.inode(ROOT_INODE), encode_dir(root), db=self.inodes)

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
            txn.put(self.rows.inode(d.inode), encode_dir(d), db=self.inodes)
        self._dirs.clear()
        self._resolved.clear()
        self._last_dir = None

    # -- one object ----------------------------------------------------------------
    def _dir(self, txn: lmdb.Transaction, ino: int) -> Entry:
        d = self._dirs.get(ino)
        if d is None:
            raw = txn.get(self.rows.inode(ino), db=self.inodes)
            assert raw is not None, f"directory inode {ino} has no row"
            d = self._dirs[ino] = decode_dir(ino, raw)
        return d

    def _free_inode(self, txn: lmdb.Transaction, kind: bytes, path: bytes) -> int:
        ino = xxhash.xxh3_64_intdigest(kind + path) & INO_MASK
        while (
            ino <= ROOT_INODE
            or ino in self._dirs
            or txn.get(self.rows.inode(ino), db=self.inodes) is not None
        ):
            ino = (ino + 1) & INO_MASK  # a collision: order-dependent, and rare (2^-63)
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
            ino = (ino + 1) & INO_MASK
        return ino

    def _new_dir(
        self, txn: lmdb.Transaction, parent: Entry, name: bytes, row: bytes, long: bool
    ) -> Entry:
        path = parent.path + b"/" + name if parent.inode != ROOT_INODE else name
        ino = self._free_inode(txn, b"d:", path)
        d = Entry(ino, True, parent.inode, 0, 0.0, 0, self.gen, path)
        self._dirs[ino] = d
        parent.aux += 1
        parent.size += 1  # a directory's size: its entries (its end offset: mount/fs.py)
        self.totals.inodes += 1
        txn.put(row, DIRENT.pack(ino, DIR) + (name if long else b""), db=self.dirents)
        return d

    def _note(self, keys: list[str], key: str) -> None:
        if len(keys) < _SAMPLES:
            keys.append(key)

    def _shadow_file(self, txn: lmdb.Transaction, parent: Entry, name: bytes, v: bytes) -> None:
        """A file that turned out to be a directory prefix: it leaves the listing (the
        caller overwrites its dirents row with the directory's)."""
        f = decode_file(parent.inode, parent.path, name, v)
        txn.delete(self.rows.inode(f.inode), db=self.inodes)
        parent.size -= 1
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
                FILE_REF.pack(FILE, d.inode),
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
                e = decode_file(parent.inode, parent.path, name, old)
                if e.inode == ino and e.version == obj.version:
                    since = e.since
        value = encode_file(ino, obj, since, t.next_ordinal, name if long else b"")
        if not txn.put(row, value, overwrite=False, db=self.dirents):
            # A duplicate key, or a file whose name a directory already took: give the
            # inode number back.
            txn.delete(self.rows.inode(ino), db=self.inodes)
            t.shadowed += 1
            self._note(t.shadowed_keys, obj.key)
            return
        t.next_ordinal += 1
        parent.size += 1
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
            ino, kind = _dirent(raw)
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
        ino, kind = _dirent(raw)
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
        parent = self._dir(txn, e.parent)
        parent.aux -= 1
        parent.size -= 1
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
                if len(k) < len(start) + INO.size:  # a damaged key: no directory named
                    raise DamagedRowError(f"tentative row {bytes(k).hex()}")
                tentative.append(INO.unpack(k[-INO.size :])[0])
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
        return None if raw is None else decode_dir(ino, raw)

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


def _dirent(raw: bytes | memoryview) -> tuple[int, int]:
    """A dirents row's inode and kind; DamagedRowError (an lmdb.Error: the listing fails
    in one line, datasets.py, and the next one writes a new generation) for a row too
    short (cache/rows.py)."""
    try:
        ino, kind = DIRENT.unpack_from(raw)
    except DECODE_ERRORS:
        raise DamagedRowError(f"dirents row of {len(raw)} bytes") from None
    return int(ino), int(kind)
