"""pyfuse3 Operations: a read-only POSIX view of one dataset's listing.

Owns inode attributes, directory listing, open file handles and the shape of each
read (which chunks cover [off, off+size)), and every errno a reader sees: EROFS for
anything that would write, ENOENT for unknown names, EIO when a miss cannot be served
(EACCES when the daemon refuses the reader the object).
lookup/getattr/readdir are served from the dataset's directory index in the shared LMDB
env (mount/listing_view.py), through a read txn at most 0.5 s old, or from what this
mount kept of the generation it serves (a file's LOOKUP reply by name, attribute
replies by inode: bounded, emptied when the generation changes); never the network.
Never fetches or verifies bytes itself (reader.py does).

With several serving processes (`shared` set: mount/shared.py), a handle the kernel got
from another process is derived from the shared table (its inode, generation and
version), so any process answers any request of it the same way; so are the numbers of
an inode per version (_retire), and a process that sees another serve a newer listing
switches to it before it answers (catch_up).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import re
import stat
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Any

import lmdb
import pyfuse3
import trio

from silofs.cache.format import ChunkRef
from silofs.cache.listing import ListingReader
from silofs.mount.hot import HotFile
from silofs.mount.listing_view import Entry, ListingView
from silofs.mount.reader import ChunkReader, MissError, OpenFile
from silofs.mount.shared import (
    FRESH,
    RETIRED,
    VERSION_ROWS,
    SharedTables,
    TableFull,
    version_hash,
)
from silofs.mount.survive import answer_eio, catches_own, eio
from silofs.mount.waits import Interrupted
from silofs.records import ObjectInfo

log = logging.getLogger(__name__)

ATTR_CACHE = 8192  # attribute replies kept per mount
# Files' LOOKUP replies kept by (parent, name), at most this many (then all forgotten:
# a bound, not a cache): a name the kernel forgot (memory pressure, drop_caches, the
# entry timeout) and asks again is one dict get, not a B-tree walk and a decode.
NAME_CACHE = 8192
ADOPTED = 4096  # handles opened by another serving process, kept derived per process
HOT_FILES = 8192  # kept files' hot records (mount/hot.py) per mount: a bound, as NAME_CACHE
# A first read at offset 0 of at least this many bytes opens one GET of the whole object
# (read()): the kernel's first read-ahead request of a sequential reader is 256 KiB to
# 1 MiB; a reader that asked for random access sends only the pages it reads.
STREAM_FROM_HEAD = 128 << 10
# An open that could write (the kernel refuses these on the read-only mount first). Not
# O_APPEND: with O_RDONLY it writes nothing (a write through it is EBADF), and a
# read-only local disk opens it (it was EROFS).
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC


@dataclass(frozen=True)
class Presentation:
    uid: int
    gid: int
    file_mode: int
    dir_mode: int
    timeout: float


async def _erofs(*_args: object, **_kwargs: object) -> None:
    raise pyfuse3.FUSEError(errno.EROFS)


@dataclass
class _DirHandle:
    """An open directory: its generation's reader and where the last readdir stopped, so
    the next one resumes with a B-tree seek instead of counting from the start."""

    inode: int
    listing: ListingReader
    pos: int = 0  # readdir offset of `key`
    key: bytes | None = None  # position key (cache/listing.py) of the entry at `pos`
    # The directory as opendir found it (None: a handle another serving process opened):
    # what getattr answers while it is open and no listing has it any more (_held).
    entry: Entry | None = None
    # The position keys of the last reply's entries, the first ending at offset
    # `recent_base`: the kernel asks next at the offset after the last entry it took,
    # which is inside that reply when the reader's buffer was smaller than it (a
    # getdents64 of one entry took one of a page's): one seek, not a count.
    recent: list[bytes] = field(default_factory=list)
    recent_base: int = 0
    # Offsets are positions in `listing` (no move to another generation since the last
    # rewind or seek): only then do `marks` learn from the names replied.
    counted: bool = True
    # marks[i]: the position key of the entry ending at offset DOTS + (i + 1) * MARK in
    # generation `marks_gen`, so a seekdir() anywhere counts at most MARK names.
    marks: list[bytes] = field(default_factory=list)
    marks_gen: int = -1


# readdir's offsets: '.' is 0 -> 1, '..' is 1 -> 2, the directory's first name 2 -> 3.
DOTS = 2
# A directory handle keeps the position key of every MARK-th name it passes (_seek), up
# to MARKS of them (a million names; a seek past them counts from the last).
MARK = 256
MARKS = 4096


def fuse_name_max(release: str) -> int:
    """The longest name the kernel's FUSE takes (FUSE_NAME_MAX) on kernel `release`:
    1024 bytes before Linux 6.15, PATH_MAX - 1 since ("fuse: Increase FUSE_NAME_MAX to
    PATH_MAX", 27992ef80770). A longer name in a readdir reply fails the kernel's whole
    batch with EIO (the directory unreadable for its other names); a lookup of one the
    kernel refuses itself with ENAMETOOLONG. An unknown release: the older limit (a
    name left out that it could have served, never a directory lost)."""
    m = re.match(r"(\d+)\.(\d+)", release)
    return 4095 if m and (int(m[1]), int(m[2])) >= (6, 15) else 1024


def mtime_ns(mtime: float) -> int:
    """st_mtime_ns of a listed mtime (epoch seconds in a double), to the microsecond.
    Stores stamp to the ms (S3), the us (GCS) or the second (Azure): those are exact.
    A double of today's seconds holds ~0.24 us, so int(mtime * 1e9) served S3's
    ...:20.123 as ...:20.122999808 (3 ms stamps in 4: `ls --full-time`, rsync and make
    saw another time than the store's). A local file's digits below the us are lost
    (the listing keeps seconds in a double)."""
    return round(mtime * 1_000_000) * 1000


NAME_MAX = fuse_name_max(os.uname().release)
# Fresh inode numbers of a path's new version (_retire) count up from here; a listing's
# (hashed, 63 bits) rarely lands there, and _retire probes past any the listing has.
ALIAS_BASE = 0x7FF0_0000_0000_0000
FREE_INODES = 1 << 50  # statfs's free inodes (statfs): a read-only fs that never runs out
_LONG_LOGGED_MAX = 1024  # directories whose names past NAME_MAX were logged (once each)


@dataclass
class _Versions:
    """An inode per version: the kernel's page cache is per inode, so a path whose
    version a switch() changed while handles of the old one are open gets a fresh
    number for the new version (SilofsFS._retire), and the old number lives on for
    those handles until the kernel FORGETs it (SilofsFS.forget). All empty unless a
    refresh met an open old version."""

    # listing inode -> the number the kernel knows the path's version by now
    alias: dict[int, int] = field(default_factory=dict)
    # that number -> its listing inode
    real: dict[int, int] = field(default_factory=dict)
    # a number the kernel may still hold for an older version (getattr answers its
    # handles' version) -> the listing inode of its path
    retired: dict[int, int] = field(default_factory=dict)
    # A fresh number's lookups the kernel counts (LOOKUP and READDIRPLUS replies), less
    # those its FORGETs gave back: it goes back to the listing inode only at 0 (a LOOKUP
    # answered while its FORGET was queued made the kernel a new inode).
    lookups: dict[int, int] = field(default_factory=dict)
    next: int = ALIAS_BASE
    # With serving processes (mount/shared.py), all of the above is this process's copy
    # of the versions table: `seq` the table's sequence number it was read at (a
    # process reads it again when that moves on), `rows` each number's row.
    seq: int = -1
    rows: dict[int, int] = field(default_factory=dict)


def _vhash(node: Entry) -> int:
    """The version of an entry as the shared table holds a handle's (mount/shared.py)."""
    return version_hash(node.version, node.content_id)


@answer_eio  # an exception other than FUSEError is that request's EIO (survive.py)
class SilofsFS(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(
        self,
        listing: ListingView,
        reader: ChunkReader,
        look: Presentation,
        shared: SharedTables | None = None,
    ) -> None:
        super().__init__()
        self.shared = shared
        self.name_max = NAME_MAX
        self._long_logged: set[int] = set()
        # Handles another serving process opened, derived here once (bounded: the
        # RELEASE of such a handle may land in yet another process).
        self._adopted: OrderedDict[int, OpenFile] = OrderedDict()
        self.listing = listing
        self.reader = reader
        self.look = look
        self._files: dict[int, OpenFile] = {}
        self._dirs: dict[int, _DirHandle] = {}
        self._attrs: OrderedDict[int, pyfuse3.EntryAttributes] = OrderedDict()
        # (parent inode, name) -> the LOOKUP reply of a file of the generation served
        # (lookup()); emptied when the listing changes, as _attrs.
        self._names: dict[tuple[int, bytes], pyfuse3.EntryAttributes] = {}
        # inode -> the version the kernel's pages of it hold, for inodes whose version
        # changed since the mount started (_keep_cache); bounded.
        self._page_versions: OrderedDict[int, str] = OrderedDict()
        # inode -> version -> handles open, of the inodes a switch() or the OPEN of a
        # version listed since the mount started counted (open(), _count_versions).
        self._open_versions: dict[int, dict[str, int]] = {}
        # inode -> {size: handles} of the handles that read through the kernel's page
        # cache (not direct_io) a version other than the listing's, and fh -> (inode,
        # size) of each; made at each switch() from the handles open then (no handle
        # opened later reads another version than the listing's), kept by release().
        # The size this process gives the kernel for such an inode is the least of
        # those and the listing's (_build_attr): the kernel zero-fills a page past a
        # short read's end, and with its size of the inode larger than the handle's
        # version (a refresh listed the object larger; the kernel asked for its
        # attributes while the read was in flight, so it did not cut its size at the
        # short read) the reader got those zeros after its version's bytes. A new open
        # meanwhile reads with direct_io, never cut by that size; the handle's release
        # forgets the size (_stale_size).
        self._paged_sizes: dict[int, dict[int, int]] = {}
        self._paged: dict[int, tuple[int, int]] = {}
        self._clamped: set[int] = set()  # inodes whose kept attributes a handle cut
        self._direct: set[int] = set()  # handles opened with direct_io (this process's)
        # An inode per version (one serving process only): _Versions. One attribute, not
        # five: with five, every handler ran more instructions (bench/handler_ir.py),
        # likely as past 30 instance attributes CPython shares no keys of the dict.
        self._iv = _Versions()
        self.stale_inodes: list[int] = []  # attributes the kernel must fetch again
        # Set by the mount (process.py): forgets an inode's attributes in the kernel at
        # once (an attr-only notification: no page or lock of a request in flight is
        # touched, and a read-only mount has no writeback to wait for). None (unit
        # tests): stale_inodes waits for the report loop.
        self.forget_attrs: Callable[[list[int]], None] | None = None
        # Set by the mount with serving processes (process.py): switches this process to
        # the newest listing now (another process switched to it), before the request
        # that noticed is answered; the kernel's entries are told later.
        self.catch_up: Callable[[], None] | None = None
        self._next_fh = 1
        # inode -> the hot record of a kept small file (mount/hot.py), made by open();
        # valid while its epoch is _epoch, which every switch() moves on (and empties
        # this). Bounded: emptied when full, as _names.
        self._hot: dict[int, HotFile] = {}
        self._epoch = 1
        # The two answers of open() (the pages kept or not), one object each with the
        # handle set per OPEN: pyfuse3 copies a FileInfo into its reply as soon as open()
        # returns, before any other task runs (fuse_open_async), so none is answered
        # with another's handle; a FileInfo built per OPEN cost its keyword parsing.
        self._keep = pyfuse3.FileInfo(keep_cache=True)
        self._drop = pyfuse3.FileInfo(keep_cache=False)
        self.initialized = trio.Event()  # set once the kernel's INIT is being answered

    def init(self) -> None:
        # Called by pyfuse3 inside libfuse's INIT handling, before the reply is sent.
        self.initialized.set()

    def switch(self, record: dict) -> list[Entry]:
        """Serve the listing generation `record` names (the daemon listed again); returns
        recently used entries that changed, for the caller to invalidate in the kernel."""
        # Hot records end with the generation they were made in (mount/hot.py). Their
        # entries are recently used ones too, though no OPEN of them touched the
        # listing's entries since: the kernel forgets them as it does those.
        self._epoch += 1
        hot, self._hot = self._hot, {}
        stale = self.listing.switch(record, [h.node for h in hot.values()])
        if self.shared is not None:
            stale = self._retire_shared(stale)
        else:
            self._count_versions()
            if self._open_versions:
                opened = {k: set(v) for k, v in self._open_versions.items()}
                stale = self._retire(stale, opened, lambda node: node.version)
            elif self._iv.alias:
                stale = [self._as_known(e) for e in stale]
            if self._iv.real or self._iv.retired:
                self._renumber_collisions()
        self._attrs.clear()
        self._names.clear()
        self._clamped.clear()
        self._paged_sizes, self._paged = {}, {}
        for fh, f in self._files.items():
            if fh in self._direct or f.inode in self._iv.retired:
                # A retired inode's attributes are its handles' version's (getattr):
                # nothing for the kernel to cut.
                continue
            ino = self._iv.real.get(f.inode, f.inode)  # keyed as _attrs: by listing inode
            node = self.listing.get(ino)
            if node is None or node.size != f.obj.size:
                self._paged[fh] = (ino, f.obj.size)
                sizes = self._paged_sizes.setdefault(ino, {})
                sizes[f.obj.size] = sizes.get(f.obj.size, 0) + 1
        return stale

    def _retire(
        self,
        stale: list[Entry],
        opened: dict[int, set],
        version: Callable[[Entry], object],
        room: int | None = None,
    ) -> list[Entry]:
        """Give a fresh inode number to every path whose listed version is not that of
        a handle open on the number the kernel knows it by (an inode per version: the
        kernel's pages are per inode, and a handle's fadvise, readahead or mmap fills
        them whatever its direct_io). The old number stays for those handles (_iv.retired)
        until the kernel forgets it; its name goes from the kernel's entries (returned
        with `stale`, which process.py invalidates), so the next lookup gets the new one.
        `opened`: kernel number -> the versions (as `version` gives an entry's) of the
        handles open under it. `room`: how many numbers _iv may hold at most (the shared
        table's rows); a path past it keeps its number (its new handles direct_io)."""
        m = self.listing
        out = [self._as_known(e) for e in stale] if self._iv.alias else list(stale)
        named = {(e.parent, e.path) for e in out}
        for kino, versions in opened.items():
            if kino in self._iv.retired:
                continue
            ino = self._iv.real.get(kino, kino)
            node = m.get(ino)
            if node is None or node.is_dir or versions == {version(node)}:
                continue  # deleted (held), or no other version open on it
            if room is not None and len(self._iv.real) + len(self._iv.retired) + 2 > room:
                log.warning(
                    "inode %d: a new version with the old one open, and no room for a "
                    "number of its own (%d): its new handles read with direct_io",
                    kino,
                    room,
                )
                continue
            fresh = self._fresh_number()
            self._iv.retired[kino] = ino
            self._iv.real.pop(kino, None)
            self._iv.lookups.pop(kino, None)
            self._iv.alias[ino] = fresh
            self._iv.real[fresh] = ino
            self._page_versions.pop(kino, None)
            log.info("inode %d: a new version with the old one open: it is %d now", kino, fresh)
            if (node.parent, node.path) not in named:
                out.append(replace(node, inode=kino))
                named.add((node.parent, node.path))
        return out

    def _fresh_number(self) -> int:
        """The next number no listing path and no version has (_retire)."""
        iv, m = self._iv, self.listing
        fresh = iv.next
        while m.get_any(fresh) is not None or fresh in iv.real or fresh in iv.retired:
            fresh += 1
        iv.next = fresh + 1
        return fresh

    def _renumber_collisions(self, room: int | None = None) -> None:
        """A listing numbers each path by a hash of it, probed past collisions
        (cache/listing.py), blind to the numbers _retire gave: one that numbers a path
        with a fresh or retired number in use for another path (the kernel may hold it,
        and its pages of that version) gives this path a fresh number too, never that
        one (its lookups would answer the other path's inode). Rare: the hash must land
        on one of a few numbers counted up from ALIAS_BASE."""
        iv, m = self._iv, self.listing
        for number in [*iv.real, *iv.retired]:
            if number in iv.alias or (iv.real.get(number) or iv.retired.get(number)) == number:
                continue  # renumbered already, or its own path's listing inode
            node = m.get_any(number)
            if node is None or node.inode != number:
                continue
            if room is not None and len(iv.real) + len(iv.retired) + 1 > room:
                log.error("inode %d: listed for a path while in use for another", number)
                continue
            fresh = self._fresh_number()
            iv.alias[number] = fresh
            iv.real[fresh] = number
            log.warning("inode %d: listed for a path while in use for another: %d", number, fresh)

    def _retire_shared(self, stale: list[Entry]) -> list[Entry]:
        """_retire with serving processes: of the handles every process has open, under
        the versions table's lock. The first process to switch to a listing makes the
        numbers; one switching later finds them made (its old numbers retired already,
        its fresh ones' handles of the listed version) and changes nothing."""
        sh = self.shared
        assert sh is not None
        sh.lock_versions()
        try:
            self._load_versions()
            sh.note_gen(self.listing.gen)
            known = (dict(self._iv.real), dict(self._iv.retired), self._iv.next)
            out = self._retire(stale, sh.open_versions(), _vhash, VERSION_ROWS)
            if self._iv.real or self._iv.retired:
                self._renumber_collisions(VERSION_ROWS)
            if (dict(self._iv.real), dict(self._iv.retired), self._iv.next) != known:
                self._store_versions()
        finally:
            sh.unlock_versions()
        return out

    def _sync_shared(self) -> None:
        """With serving processes, before a request that names an inode is answered
        (sync_first): this process serves the newest listing any of them switched to
        (catch_up), and its copy of the versions table (_iv) is the table's. One read of
        the table's head when nothing changed."""
        sh = self.shared
        assert sh is not None
        seq, gen = sh.versions_stamp()
        if gen > self.listing.gen and self.catch_up is not None:
            self.catch_up()  # switch(): reads the table itself
            seq = sh.versions_stamp()[0]
        if seq != self._iv.seq:
            sh.lock_versions()
            try:
                self._load_versions()
            finally:
                sh.unlock_versions()

    def _load_versions(self) -> None:
        """_iv as the versions table has it (the lock held). The replies kept name
        numbers that may have changed: forgotten."""
        sh = self.shared
        assert sh is not None
        t = sh.read_versions()
        iv = _Versions(next=max(t.next, ALIAS_BASE), seq=t.seq, rows=t.rows)
        for number, (role, ino, lookups) in t.numbers.items():
            if role == FRESH:
                iv.alias[ino] = number
                iv.real[number] = ino
                if lookups:
                    iv.lookups[number] = lookups
            elif role == RETIRED:
                iv.retired[number] = ino
        if self._iv.seq != t.seq:
            self._attrs.clear()
            self._names.clear()
        self._iv = iv

    def _store_versions(self) -> None:
        """_iv into the versions table (the lock held, _iv loaded under it)."""
        sh = self.shared
        assert sh is not None
        iv = self._iv
        numbers = {k: (FRESH, ino, iv.lookups.get(k, 0)) for k, ino in iv.real.items()}
        numbers.update((k, (RETIRED, ino, 0)) for k, ino in iv.retired.items())
        gen = sh.versions_stamp()[1]
        iv.seq = sh.write_versions(numbers, iv.next, gen)
        self._load_versions()  # the rows as written (and this process's caches emptied)

    def _as_known(self, e: Entry) -> Entry:
        """`e` under the number the kernel knows its path by now (_iv.alias)."""
        kino = self._iv.alias.get(e.inode)
        if kino is None:
            return e
        return replace(e, inode=kino)

    def _looked_up(self, kino: int) -> bool:
        """A LOOKUP or READDIRPLUS reply names `kino`: count it if it is a fresh number.
        False (with serving processes) if the number its path had when the reply was
        made is no longer its path's (another process took it back on a FORGET
        meanwhile): the reply must be made again."""
        if self.shared is not None:
            return self._looked_up_shared(kino)
        if kino in self._iv.real:
            self._iv.lookups[kino] = self._iv.lookups.get(kino, 0) + 1
        return True

    def _looked_up_shared(self, kino: int) -> bool:
        if kino not in self._iv.real:
            return True  # not a fresh number (as of the table this request began with)
        sh = self.shared
        assert sh is not None
        ino = self._iv.real[kino]
        sh.lock_versions()
        try:
            if sh.versions_stamp()[0] != self._iv.seq:
                self._load_versions()
            if self._iv.alias.get(ino, ino) != kino:
                return False
            row = self._iv.rows.get(kino)
            if row is not None and kino in self._iv.real:
                sh.add_lookups(row, kino, 1)
            return True
        finally:
            sh.unlock_versions()

    def _not_looked_up(self, kino: int) -> None:
        """A reply counted (_looked_up) was not sent after all: one lookup fewer, as a
        FORGET of it would."""
        if self.shared is None:
            self._forget([(kino, 1)])
            return
        self.shared.lock_versions()
        try:
            self._load_versions()
            self._forget([(kino, 1)])
            self._store_versions()
        finally:
            self.shared.unlock_versions()

    def _listing_ino(self, kino: int) -> int:
        """The listing inode of a number the kernel knows or knew a path by."""
        return self._iv.real.get(kino) or self._iv.retired.get(kino) or kino

    def kernel_inode(self, ino: int) -> int:
        """The number the kernel knows listing inode `ino`'s path by now."""
        return self._iv.alias.get(ino, ino) if self._iv.alias else ino

    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        """The kernel dropped these inodes (a FORGET carries all its lookups of one).
        A retired number is done with; a path's fresh number goes back to its listing
        inode once the kernel holds neither, so numbers follow the path again."""
        if self.shared is not None:  # _iv is the table's (sync_first)
            if not any(k in self._iv.real or k in self._iv.retired for k, _ in inode_list):
                return
            # Counts and numbers as the table has them now, changed under its lock.
            self.shared.lock_versions()
            try:
                self._load_versions()
                self._forget(inode_list)
                self._store_versions()
            finally:
                self.shared.unlock_versions()
            return
        if not (self._iv.retired or self._iv.real):
            return
        self._forget(inode_list)

    def _forget(self, inode_list: list[tuple[int, int]]) -> None:
        for kino, n in inode_list:
            ino = self._iv.retired.pop(kino, None)
            if ino is not None:
                self._page_versions.pop(kino, None)
                fresh = self._iv.alias.get(ino)
                if ino == kino and fresh is not None and not self._iv.lookups.get(fresh):
                    self._unalias(ino, fresh)  # the kernel holds neither number now
                continue
            ino = self._iv.real.get(kino)
            if ino is None:
                continue
            left = self._iv.lookups.pop(kino, 0) - n
            if left > 0:
                self._iv.lookups[kino] = left
            elif ino not in self._iv.retired and ino not in self._iv.real:
                # (In real: a path listed on a number in use: _renumber_collisions.)
                self._unalias(ino, kino)

    def _unalias(self, ino: int, kino: int) -> None:
        """Listing inode `ino`'s path goes back to its own number (the kernel holds
        neither it nor `kino`: a fresh inode, no pages)."""
        del self._iv.real[kino]
        del self._iv.alias[ino]
        self._iv.lookups.pop(kino, None)
        self._page_versions.pop(kino, None)
        self._page_versions.pop(ino, None)
        self._attrs.pop(ino, None)
        self._names.clear()  # replies naming `kino` (rare: one per version change)

    def _count_versions(self) -> None:
        """Count every open handle by inode and version (_open_versions), as a switch()
        must: open() leaves uncounted the handles of versions listed when the mount
        started, and this listing may have changed their inodes. From then on open() and
        release() keep the counts of the inodes counted here, so an OPEN of another
        version sees every handle of the old one."""
        counts: dict[int, dict[str, int]] = {}
        for f in self._files.values():
            versions = counts.setdefault(f.inode, {})
            versions[f.obj.version] = versions.get(f.obj.version, 0) + 1
        self._open_versions = counts

    # -- attributes ------------------------------------------------------------------
    def _held(self, inode: int) -> pyfuse3.EntryAttributes | None:
        """The attributes of a file or directory no listing the mount reads has any more
        (deleted in the store, then listed twice) that a handle of this process still
        has open: a file's version's size and mtime, a directory's as opendir found it,
        no links, as fstat of a deleted file or directory open on a local disk (Python's
        read() fstats first, `cd` into a directory since deleted, then `pwd -P` or
        find's fchdir: it was ENOENT). None if no handle here has it: with serving
        processes, one that never served the handle (a directory handle another process
        opened knows no attributes). A scan of the open handles, only where the
        listings have no such inode."""
        for f in chain(self._files.values(), self._live_adopted()):
            if f.inode == inode:
                o = f.obj
                e = Entry(inode, False, 0, o.size, o.mtime, 0, f.gen, b"", o.version)
                a = self._build_attr(e)  # not kept: the handle's, while it is open
                a.st_ino = inode  # the number it was opened by (a path's is _iv.alias's)
                a.st_nlink = 0
                return a
        for h in self._dirs.values():
            if h.inode == inode and h.entry is not None:
                a = self._build_attr(h.entry)  # not kept, as a file's
                a.st_nlink = 0
                return a
        return None

    def _live_adopted(self) -> list[OpenFile]:
        """The handles another process opened that are still open (its RELEASE may have
        reached a third process, which frees the slot: this one kept the handle)."""
        sh = self.shared
        if sh is None or not self._adopted:
            return []
        gone = [fh for fh in self._adopted if sh.get(fh) is None]
        for fh in gone:
            del self._adopted[fh]
        return list(self._adopted.values())

    def _attr(self, node: Entry) -> pyfuse3.EntryAttributes:
        # Building EntryAttributes costs ~12 us of Cython setters, more than the LMDB
        # lookup: keep the recently used ones (bounded; emptied when the listing changes).
        a = self._attrs.get(node.inode)
        if a is not None:
            self._attrs.move_to_end(node.inode)
            return a
        a = self._attrs[node.inode] = self._build_attr(node)
        if len(self._attrs) > ATTR_CACHE:
            self._attrs.popitem(last=False)
        return a

    def _build_attr(self, node: Entry) -> pyfuse3.EntryAttributes:
        # A new EntryAttributes holds zeros (generation, st_rdev) and st_nlink 1: only
        # what differs is set, each setter being a call into pyfuse3.
        a = pyfuse3.EntryAttributes()
        look = self.look
        a.st_ino = self._iv.alias.get(node.inode, node.inode) if self._iv.alias else node.inode
        # The kernel keeps names and attributes exactly as long as the metadata TTL says:
        # a refresh is seen by the kernel no later than that.
        a.entry_timeout = a.attr_timeout = look.timeout
        if node.is_dir:
            a.st_mode = stat.S_IFDIR | look.dir_mode
            a.st_nlink = 2 + node.aux  # aux: its subdirectories
            # Past its last readdir offset (DOTS + its entries: size), and 4096 as a
            # local disk's for the small: lseek(dirfd, 0, SEEK_END) is the kernel's
            # i_size, and a fixed 4096 was a position inside a larger directory
            # (seekdir there read on from its 4,095th name, where ext4's end reads none).
            size = max(4096, DOTS + node.size)
        else:
            a.st_mode = stat.S_IFREG | look.file_mode
            size = node.size
            paged = self._paged_sizes.get(node.inode)
            if paged and min(paged) < size:  # never past a page-cache handle's version
                size = min(paged)
                self._clamped.add(node.inode)
        a.st_size = size
        if look.uid:  # zero already (root's mounts): one setter call fewer per lookup
            a.st_uid = look.uid
        if look.gid:
            a.st_gid = look.gid
        a.st_blksize = 1 << 20
        # As a 4 KiB-block disk would allocate it, so `du` agrees with a local copy.
        a.st_blocks = -(-size // 4096) * 8
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = mtime_ns(node.mtime)
        return a

    @catches_own  # a hot handler: no wrapper frame (survive.py)
    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        try:
            # A file of this generation looked up before: its rows never change once
            # the generation's record is written, so the same reply (_names: files only,
            # of a complete listing; emptied by switch()).
            a = self._names.get((parent_inode, name))
            if a is not None:
                if not self._iv.real or self._looked_up(a.st_ino):
                    return a
            if len(name) > self.name_max:
                # Longer than statfs's f_namemax: no such name is served (readdir leaves
                # them out), as ext4 answers a component past its 255 bytes. The kernel
                # refuses these itself where name_max is its FUSE limit (fuse_name_max);
                # one that takes longer ones (a backport) asked us and had ENOENT.
                raise pyfuse3.FUSEError(errno.ENAMETOOLONG)
            m = self.listing
            m.renew()
            node = m.lookup(parent_inode, name)
            if node is None and await m.wait_listed(parent_inode, name=name):
                # --list-in-background: a name not listed yet is not a missing name.
                m.renew()
                node = m.lookup(parent_inode, name)
            if node is not None and node.is_dir and await m.wait_resolved(parent_inode, node.inode):
                # A directory made from a listed prefix with no object under it yet: it may
                # hold only 'dir/' markers, and the finished listing will not have it.
                m.renew()
                node = m.lookup(parent_inode, name)
            if node is None:
                # A listing that failed part way: not listed is not missing.
                raise pyfuse3.FUSEError(errno.EIO if m.unfinished(parent_inode) else errno.ENOENT)
            a = self._attr(node)
            # Not a directory (a tentative one may go, its nlink follows its listing) and
            # not while the generation is written (a file's name may turn out to be a
            # directory's: the directory is kept).
            # Nor a size cut to a page-cache handle's version (_build_attr): that cut
            # ends with the handle's release, which forgets only _attrs.
            if not node.is_dir and not m.building and node.inode not in self._clamped:
                names = self._names
                if len(names) >= NAME_CACHE:
                    names.clear()
                names[parent_inode, name] = a
            while self._iv.real and not self._looked_up(a.st_ino):
                # Another serving process gave the path its listing inode back meanwhile.
                self._names.pop((parent_inode, name), None)
                a = self._build_attr(node)
            return a
        except pyfuse3.FUSEError:
            raise
        except Exception as exc:  # noqa: BLE001 - this request's EIO, not the mount's end
            raise eio("FUSE lookup", exc) from None

    @catches_own  # a hot handler: no wrapper frame (survive.py)
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        try:
            m = self.listing
            m.renew()
            if self._iv.retired and inode in self._iv.retired:
                return self._retired_attr(inode)
            # A path's fresh number (_retire) answers its listing inode's entry.
            node = m.get_any(self._iv.real.get(inode, inode) if self._iv.real else inode)
            if node is not None:
                return self._attr(node)
            held = self._held(inode)
            if held is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return held
        except pyfuse3.FUSEError:
            raise
        except Exception as exc:  # noqa: BLE001 - this request's EIO, not the mount's end
            raise eio("FUSE getattr", exc) from None

    def _retired_attr(self, kino: int) -> pyfuse3.EntryAttributes:
        """getattr of a number a path had before a switch() gave it a fresh one (_retire):
        its open handles' version (as fstat of a file replaced by a rename on a local
        disk), else its path's entry under this number."""
        held = self._held(kino) if self.shared is None else self._held_shared(kino)
        if held is not None:
            return held
        node = self.listing.get_any(self._iv.retired[kino])
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        a = self._build_attr(node)  # not kept: under another number
        a.st_ino = kino
        return a

    def _held_shared(self, kino: int) -> pyfuse3.EntryAttributes | None:
        """_held of a retired number with serving processes: a handle open under it in
        any process (the table), one of another version than the listing's first."""
        assert self.shared is not None
        files = self.shared.files_of(kino)
        node = self.listing.get(self._iv.retired.get(kino, kino))
        listed = _vhash(node) if node is not None and not node.is_dir else None
        files.sort(key=lambda item: item[1].value == listed)
        for fh, _ in files:
            try:
                f = self._adopt(fh)
            except pyfuse3.FUSEError:  # its version no longer listed: another's
                continue
            if f is not None:
                o = f.obj
                e = Entry(f.inode, False, 0, o.size, o.mtime, 0, f.gen, b"", o.version)
                a = self._build_attr(e)
                a.st_ino = kino
                a.st_nlink = 0
                return a
        return None

    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        return not (mode & os.W_OK)

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        m = self.listing
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        blocks = int(m.record.get("blocks", -(-m.total_bytes // 4096)))
        # df shows the dataset as the local cache holds it: Size is the dataset, Used what
        # is cached, Avail what is not (yet). Nothing can be written either way; 0 free
        # made every mount look 100% full.
        try:
            used = min(blocks, -(-self.reader.cached_bytes() // 4096))
        except lmdb.Error:
            used = 0
        s.f_blocks = blocks
        s.f_bfree = s.f_bavail = blocks - used
        # df -i: IUsed is the listing's inodes, and plenty free (IUse% 0), as
        # mountpoint-s3 (2^64/1024 free) and gcsfuse (2^50) report: 0 free read as 100%
        # used, and tools that check for free inodes before they run refused to.
        s.f_files = m.inode_count + FREE_INODES
        s.f_ffree = s.f_favail = FREE_INODES
        s.f_namemax = self.name_max
        return s

    # -- directories -----------------------------------------------------------------
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        m = self.listing
        m.renew()
        node = m.get(inode)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if not node.is_dir:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        if self.shared is not None:
            try:
                fh = self.shared.open_dir(inode, m.gen)
            except TableFull:
                raise pyfuse3.FUSEError(errno.ENFILE) from None
        else:
            fh = self._next_fh
            self._next_fh += 1
        self._dirs[fh] = _DirHandle(inode, m.reader, entry=node)
        if self.shared is not None and len(self._dirs) > ADOPTED:
            self._dirs.pop(next(iter(self._dirs)))  # its RELEASEDIR may land elsewhere
        return fh

    def _dir_handle(self, fh: int) -> _DirHandle | None:
        """A directory handle: this process's, or one another serving process opened
        (its generation's reader, and where the last readdir stopped, from the table)."""
        h = self._dirs.get(fh)
        if self.shared is None:
            return h
        slot = self.shared.get(fh)
        if slot is None:
            return None
        if h is None:
            m = self.listing
            if slot.gen == m.gen:
                listing = m.reader
            elif m.previous is not None and m.previous.gen == slot.gen:
                listing = m.previous
            else:
                listing = m.store.listing(m.dsid, slot.gen)
            h = self._dirs[fh] = _DirHandle(slot.inode, listing)
            if len(self._dirs) > ADOPTED:  # its RELEASEDIR may land elsewhere: bounded
                self._dirs.pop(next(iter(self._dirs)))
        if (h.pos, h.key) != (slot.value, slot.key):  # another process read on
            h.pos, h.key = slot.value, slot.key
            # Its replies are not this process's, nor may its offsets be positions (it
            # may have moved the handle to another generation).
            h.recent, h.counted = [], False
        return h

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        """'.' and '..' first (as a local disk, mountpoint-s3, gcsfuse and rclone list
        them: `ls -a`, and tools that count them, expect them), then the directory's
        names. Offsets are positions in that order (DOTS + 1 = after the first name) in
        the generation the mount serves (a handle opened before a refresh resumes after
        its last name in the new one). pyfuse3 answers READDIRPLUS, so each entry
        carries its attributes and `ls -l`/`find` need no lookups."""
        h = self._dir_handle(fh)
        if h is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        m = self.listing
        if await m.wait_listed(h.inode, settled=True):
            # A directory's entries are complete once its prefix is listed and none of
            # its subdirectories is tentative (it may hold only markers and go), or with
            # the whole listing; the handle moves to the generation the mount serves
            # now, which has the same inode numbers.
            self._move(h, m.reader)
        if m.unfinished(h.inode, settled=True):
            raise pyfuse3.FUSEError(errno.EIO)  # a listing that failed part way: partial
        m.renew()
        txn = m.txn
        if h.listing.gen != m.gen:
            # The listing changed since the handle opened: it reads on in the generation
            # the mount serves, after the same name, as a directory changed during a
            # read does on a local disk: a name in both listings comes once, and each
            # entry has the attributes a lookup gives. Its own generation's rows go when
            # the next listing starts (the rest of the directory was silently missing),
            # and until then they hold the old sizes, which READDIRPLUS would put back
            # into the kernel right after the refresh told it to forget them.
            self._move(h, m.reader)
        prefix = h.listing.rows.prefix
        if h.key is not None and not h.key.startswith(prefix):
            # A row key differs between generations only in its (dataset, generation)
            # prefix, of one length. (Moved on above, or with serving processes, by
            # another process from a position it saved.)
            h.key = prefix + h.key[len(prefix) :]
        pos = start_id
        recent = h.recent
        if start_id < DOTS:
            h.recent, h.counted = [], True  # a rewind: offsets are positions again
            if not self._reply_dots(h, txn, start_id, token):
                if self.shared is not None:
                    self.shared.set_position(fh, h.pos, h.key)
                return
            pos, after = DOTS, None
        elif start_id == h.pos and (h.key is not None or start_id == DOTS):
            after = h.key
        elif 0 <= start_id - h.recent_base < len(recent):
            # Inside the last reply: the reader took fewer names than it was given.
            after = recent[start_id - h.recent_base]
            if not after.startswith(prefix):  # given in the generation before (as h.key)
                after = prefix + after[len(prefix) :]
        else:  # a seekdir() elsewhere: count, from the nearest mark before it
            found = self._seek(h, txn, start_id)
            if found is False:
                return  # past the end
            after = found
            h.counted = True
        attrs = self._attrs
        h.recent = recent = []
        h.recent_base = pos + 1
        marks = None
        if h.counted:  # offsets are positions in h.listing: every MARK-th name is a mark
            if h.marks_gen != h.listing.gen:
                h.marks, h.marks_gen = [], h.listing.gen
            marks = h.marks
        # A walk (find, ls -R) touches each entry once: reading rows past the caches keeps
        # them for what is looked up again, and saves their upkeep per entry.
        # A file's attributes come with its row in the directory (entries()): a walk
        # reads the directory in key order, never a hash-keyed inodes row per file.
        for key, name, ino, child in h.listing.entries(txn, h.inode, after):
            if len(name) > self.name_max:
                # Left out, its position kept (offsets count every row: seekdir).
                self._too_long(h.inode, name)
                pos += 1
                h.pos, h.key = pos, key
                recent.append(key)  # recent[i] ends at offset recent_base + i
                if marks is not None and pos - DOTS == (len(marks) + 1) * MARK < MARK * MARKS:
                    marks.append(key)
                continue
            attr = attrs.get(ino)
            if attr is None:
                if child is None:  # a directory: its subdirectory count is in its row
                    child = h.listing.get(txn, ino)
                if child is None:
                    continue  # a collision-free index never gets here
                attr = self._build_attr(child)
            # A fresh number is counted before the reply names it (the kernel counts a
            # lookup once it is in the buffer): counted after, a FORGET of its earlier
            # lookups in another serving process meanwhile gave it back, and the kernel
            # held a number no process answered. Taken back meanwhile: the path's own.
            while self._iv.real and not self._looked_up(attr.st_ino):
                if child is None:
                    child = h.listing.get(txn, ino)
                assert child is not None
                attr = self._build_attr(child)
            if not pyfuse3.readdir_reply(token, name, attr, pos + 1):
                if attr.st_ino in self._iv.real:
                    self._not_looked_up(attr.st_ino)  # not sent: the count given back
                break
            pos += 1
            h.pos, h.key = pos, key
            recent.append(key)
            if marks is not None and pos - DOTS == (len(marks) + 1) * MARK < MARK * MARKS:
                marks.append(key)
        if self.shared is not None:
            self.shared.set_position(fh, h.pos, h.key)

    def _too_long(self, directory: int, name: bytes) -> None:
        if directory in self._long_logged:
            return
        if len(self._long_logged) < _LONG_LOGGED_MAX:
            self._long_logged.add(directory)
        log.warning(
            "directory inode %d: a name of %d bytes (%r...) is longer than this kernel's "
            "FUSE takes (%d): left out of its readdir (Linux 6.15 takes up to 4095)",
            directory,
            len(name),
            name[:40],
            self.name_max,
        )

    @staticmethod
    def _move(h: _DirHandle, listing: ListingReader) -> None:
        """The handle reads on in `listing` after the same name: its offsets from here
        on are not positions in that generation (a seekdir counts them there anew)."""
        if listing.gen != h.listing.gen:
            h.counted = False
        h.listing = listing

    @staticmethod
    def _seek(h: _DirHandle, txn: lmdb.Transaction, start_id: int) -> bytes | None | bool:
        """The position key of the name ending at offset `start_id` (> DOTS: None for
        DOTS itself), counting names in h.listing from the nearest mark before it and
        marking every MARK-th name passed; False past the directory's end. A count from
        the first name per seek made a reader seeking all over a large directory
        quadratic (tests/integration/test_listing.py)."""
        if h.marks_gen != h.listing.gen:
            h.marks, h.marks_gen = [], h.listing.gen
        marks = h.marks
        i = min((start_id - DOTS) // MARK, len(marks))
        pos = DOTS + i * MARK
        after = marks[i - 1] if i else None
        if pos == start_id:
            return after
        for key, _, _ in h.listing.children(txn, h.inode, after):
            pos += 1
            if pos - DOTS == (len(marks) + 1) * MARK < MARK * MARKS:
                marks.append(key)
            if pos == start_id:
                return key
        return False

    def _reply_dots(
        self, h: _DirHandle, txn: lmdb.Transaction, start_id: int, token: pyfuse3.ReaddirToken
    ) -> bool:
        """'.' and '..' from offset `start_id` (< DOTS); False if the kernel's buffer
        filled. '..' of the root is the root itself (the mount point's parent is the
        kernel's: it never asks the mount about it; `cd ..` and stat of '..' resolve
        in the kernel, not from this number), as other FUSE file systems list it. The kernel
        takes only a dot entry's inode number and type (it links no dentry for them),
        so a directory no listing has any more answers with its own number for '..'."""
        node = h.listing.get(txn, h.inode)  # h.listing: the generation served (readdir)
        held = node or h.entry
        parent = held.parent if held is not None and held.parent else h.inode
        for i in range(start_id, DOTS):
            ino = h.inode if i == 0 else parent
            e = node if ino == h.inode else h.listing.get(txn, ino)
            if e is not None:
                attr = self._attr(e)
            else:  # gone: its number and its type are what the kernel reads (not kept)
                attr = self._build_attr(held or Entry(ino, True, 0, 0, 0.0, 0, 0, b""))
                attr.st_ino = ino
            if not pyfuse3.readdir_reply(token, b"." * (i + 1), attr, i + 1):
                return False
            h.pos, h.key = i + 1, None
        return True

    def open_handles(self) -> int:
        """Files and directories this process has open (a detached mount ends at 0)."""
        return len(self._files) + len(self._dirs)

    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)
        if self.shared is not None:
            self.shared.free(fh)

    # -- files -----------------------------------------------------------------------
    @catches_own  # a hot handler: no wrapper frame (survive.py)
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        try:
            h = self._hot.get(inode)
            if h is not None and h.epoch == self._epoch and not flags & _WRITE_FLAGS:
                # A kept small file opened before in this listing generation (its hot
                # record, mount/hot.py): what the general path below decided then holds
                # until the next switch() (listed when the mount started, no version of
                # it counted: its pages kept, no count to keep).
                fh = self._next_fh
                self._next_fh = fh + 1
                opener = ctx.pid if ctx is not None else 0  # unit tests: no context
                self._files[fh] = OpenFile(h.obj, inode, h.gen, h.ref, opener, h)
                fi = self._keep
                fi.fh = fh
                return fi
            m = self.listing
            # The current listing only: a deleted object cannot be opened. get() renews
            # the snapshot if it must read one. A number the kernel knows a path by
            # (_iv.alias) or knew it by (_iv.retired: opened through an entry the kernel had
            # not dropped yet, it reads the listed version, direct_io below) is its
            # listing inode's.
            node = m.get(self._listing_ino(inode) if self._iv.real or self._iv.retired else inode)
            if node is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            # Its first chunk's key and header length, made once per entry kept (a file
            # opened again reads the same chunk first): the hit path's ChunkRef, which
            # holds the entry's ObjectInfo too. Only a file's entry has one.
            ref = node.first_chunk
            if ref is None:
                if node.is_dir:
                    raise pyfuse3.FUSEError(errno.EISDIR)
                obj = node.obj  # decoded once per cached entry, not per open
                assert obj is not None
                ref = node.first_chunk = ChunkRef.of(obj, self.reader.chunk_size, 0)
            if flags & _WRITE_FLAGS:
                raise pyfuse3.FUSEError(errno.EROFS)
            obj = ref.obj
            opener = ctx.pid if ctx is not None else 0  # unit tests open with no context
            if self.shared is not None:
                return self._open_shared(node, obj, opener, inode)
            fh = self._next_fh
            self._next_fh = fh + 1
            self._files[fh] = OpenFile(obj, inode, m.gen, ref, opener)
            versions = self._open_versions.get(inode)
            if versions is None:  # no handle of the inode counted
                # A version listed when the mount started is the only one this mount ever
                # served under its inode: no handle of another can be open, and its own
                # need no count until a switch() changes the inode, which counts every
                # open handle (_count_versions). The common case: no dict per OPEN, and
                # RELEASE finds nothing to take out.
                if node.since > m.first_gen:
                    self._open_versions[inode] = {node.version: 1}
            else:
                others = len(versions) - (node.version in versions)
                versions[node.version] = versions.get(node.version, 0) + 1
                if others:
                    # A handle of another version (opened before a refresh) is still open:
                    # the kernel's pages of the inode are shared by all its handles, so this
                    # one reads around them (direct_io) and leaves them to the other version.
                    self._page_versions.pop(inode, None)
                    self._direct.add(fh)
                    return pyfuse3.FileInfo(fh=fh, keep_cache=False, direct_io=True)
            if node.since <= m.first_gen:  # listed when the mount started (_keep_cache)
                fi = self._keep
                if versions is None and 0 < obj.size <= self.reader.whole_max and not m.building:
                    # The next OPEN of it is its hot record's (mount/hot.py): nothing
                    # decided here for it changes before the next switch().
                    hot = self._hot
                    if len(hot) >= HOT_FILES:
                        hot.clear()  # a bound, not a cache
                    h = hot[inode] = HotFile(self._epoch, node, ref, m.gen)
                    self._files[fh].hot = h
            else:
                fi = self._keep if self._keep_cache(node, inode) else self._drop
                if self.forget_attrs is not None:
                    # The kernel may still hold the size of a version listed before (a
                    # refresh's invalidation marks attributes stale, it does not change
                    # the size): forgotten before the reply, so this handle's first read
                    # asks (auto_inval_data) and is cut at this version's end, never past.
                    self.forget_attrs([inode])
            fi.fh = fh
            return fi
        except pyfuse3.FUSEError:
            raise
        except Exception as exc:  # noqa: BLE001 - this request's EIO, not the mount's end
            raise eio("FUSE open", exc) from None

    def _paged_close(self, fh: int) -> None:
        item = self._paged.pop(fh, None)
        if item is None:
            return
        inode, size = item
        sizes = self._paged_sizes[inode]
        if sizes[size] > 1:
            sizes[size] -= 1
            return
        del sizes[size]
        if not sizes:
            del self._paged_sizes[inode]
        if inode in self._clamped:  # its kept attributes may be cut at this size
            self._clamped.discard(inode)
            self._attrs.pop(inode, None)

    def _open_shared(
        self, node: Entry, obj: ObjectInfo, opener: int, kino: int
    ) -> pyfuse3.FileInfo:
        """open() with several serving processes: the handle is a slot of the shared
        table. The kernel's pages of an inode are shared by every process's handles, so
        the page decisions use what every process can see: a version listed when the
        mount started is the only one ever served under its inode (keep the pages); for
        an inode whose version changed since, a handle of another version open anywhere
        means direct_io, and otherwise the pages are dropped (no process remembers which
        version filled them: _page_versions is per process). The inode is the number the
        kernel opened it by, `kino` (a path's fresh number: _retire): its pages."""
        assert self.shared is not None
        vhash = version_hash(obj.version, obj.content_id)
        try:
            fh = self.shared.open_file(node.inode, self.listing.gen, vhash, opener, kino)
        except TableFull:
            raise pyfuse3.FUSEError(errno.ENFILE) from None
        # Kept with the adopted ones, bounded: its RELEASE may land in another process.
        self._adopted[fh] = OpenFile(obj, inode=kino, gen=self.listing.gen, opener=opener)
        if len(self._adopted) > ADOPTED:
            self._adopted.popitem(last=False)
        if node.since <= self.listing.first_gen:
            return pyfuse3.FileInfo(fh=fh, keep_cache=True)
        if self.shared.other_versions_open(kino, vhash):
            return pyfuse3.FileInfo(fh=fh, keep_cache=False, direct_io=True)
        return pyfuse3.FileInfo(fh=fh, keep_cache=False)

    def _adopt(self, fh: int) -> OpenFile | None:
        """A file handle another serving process opened: the same version, from the
        listing generation it was opened in (or the current one, if it still lists that
        version); None if neither has it any more (the read is EIO, never another
        version's bytes: promise 3)."""
        assert self.shared is not None
        f = self._adopted.get(fh)
        if f is not None:
            self._adopted.move_to_end(fh)
            return f
        slot = self.shared.get(fh)
        if slot is None:
            return None
        m = self.listing
        m.renew()
        node = None
        if slot.gen == m.gen:
            node = m.get(slot.inode)
        elif m.previous is not None and m.previous.gen == slot.gen:
            node = m.previous.get(m.txn, slot.inode)
        else:
            node = m.store.listing(m.dsid, slot.gen).get(m.txn, slot.inode)
        if node is None or node.obj is None:
            node = m.get(slot.inode)
        obj = node.obj if node is not None else None
        if obj is None or version_hash(obj.version, obj.content_id) != slot.value:
            log.info("handle %d: the version it opened is no longer listed", fh)
            raise pyfuse3.FUSEError(errno.EIO)
        f = self._adopted[fh] = OpenFile(obj, inode=slot.kino, gen=slot.gen, opener=slot.opener)
        if len(self._adopted) > ADOPTED:
            self._adopted.popitem(last=False)
        return f

    def _keep_cache(self, node: Entry, ino: int) -> bool:
        """Whether the kernel may keep the pages it holds of this inode: only if they can
        only be of the version this open reads (promise 3: one version per open).

        The inode number follows the path, not the version, and the kernel's pages of an
        inode outlive the handles that read them. A version listed already when this
        mount started is the only version this mount ever served under that inode. A
        version a later listing brought is remembered per inode when opened (bounded):
        the next open of the same version keeps the pages, so a re-read never reaches
        this process; an open of another version, or of one forgotten, drops them, and
        a read through a handle of an older listing forgets it (read())."""
        if node.since <= self.listing.first_gen:
            return True
        # `ino`: the number the kernel knows the inode by (_iv.alias), whose pages these are.
        seen = self._page_versions.get(ino)
        self._page_versions[ino] = node.version
        self._page_versions.move_to_end(ino)
        if len(self._page_versions) > ATTR_CACHE:
            self._page_versions.popitem(last=False)
        return seen == node.version

    @catches_own  # the hot path: no wrapper's coroutine frame per read (survive.py)
    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        try:
            f = self._files.get(fh)
            if f is None and self.shared is not None:
                f = self._adopt(fh)
            if f is None:
                raise pyfuse3.FUSEError(errno.EBADF)
            h = f.hot
            if h is not None and h.epoch == self._epoch and not off and size >= h.size:
                # A kept small file read whole, opened from its hot record in this
                # listing generation (mount/hot.py): of the listing's generation, one
                # chunk, no read-ahead state. whole_hot() begins the read whatever it
                # answers; None: the general path below serves it.
                data = self.reader.whole_hot(h)
                if data is not None:
                    c = self.reader.counters
                    c.bytes_read += h.size
                    c.hits += 1
                    c.hit_bytes += h.size
                    return data
                begun = True
            else:
                begun = False
                if f.gen != self.listing.gen:
                    # A handle of an older listing fills the inode's pages with its own
                    # version: the next open must not keep them (_keep_cache).
                    self._page_versions.pop(f.inode, None)
            obj_size = f.obj.size
            r = self.reader
            whole = not begun and not off and obj_size <= size and 0 < obj_size <= r.whole_max
            if whole:
                # A one-chunk file read whole (a warm small file: one request). No
                # read-ahead state to keep: a file of one chunk never reads ahead
                # (prefetch() and _read_span() are its only readers). whole() begins
                # the read (begin_read) whatever it answers.
                data = r.whole(f)
                if data is not None:
                    c = r.counters
                    c.bytes_read += obj_size
                    c.hits += 1
                    c.hit_bytes += obj_size
                    return data
            end = off + size if off + size < obj_size else obj_size
            if off >= end:
                return b""
            cs = r.chunk_size
            first, last = off // cs, (end - 1) // cs
            sequential = f.advance(off, end)  # a seek resets the file's read-ahead window
            if not (whole or begun):
                r.begin_read()
            if first == last:
                lo, hi = off - first * cs, end - first * cs
                data = r.hit(f, first, lo, hi)  # [lo, hi), a verified copy
                if data is not None:
                    c = r.counters
                    c.bytes_read += end - off
                    c.hits += 1
                    c.hit_bytes += end - off
                    if sequential and obj_size > cs:
                        r.prefetch(f, first)
                    return data
                # The first read of a file's head, of the size the kernel's read-ahead
                # asks of a sequential reader (a random reader asks for its pages): a
                # miss names its chunk as a span, so the daemon may stream the object on
                # from there (node/fetch.py) and the reader's next spans continue it.
                streams = off == 0 and size >= STREAM_FROM_HEAD and obj_size > cs
                span = (0, 0) if streams else None
                # Replied with before this task yields: a hit may be the reader's buffer.
                data, hit, source = await r.chunk(f, first, lo, hi, span, kept=False)
                self._count(end - off, hit, source)
                if sequential and obj_size > cs:
                    r.prefetch(f, first)
                return data
            return await self._read_span(f, off, end, first, last, sequential)
        except MissError as exc:  # EIO, or EACCES when the daemon refused this reader
            raise pyfuse3.FUSEError(exc.errno) from None
        except Interrupted:  # a miss whose process is gone or told to stop (mount/waits.py)
            self.reader.counters.interrupted_reads += 1
            raise pyfuse3.FUSEError(errno.EINTR) from None
        except pyfuse3.FUSEError:
            raise
        except Exception as exc:  # noqa: BLE001 - this read's EIO, never the mount's end
            raise eio(f"FUSE read of handle {fh} [{off}, +{size})", exc) from None

    async def _read_span(
        self, f: OpenFile, off: int, end: int, first: int, last: int, sequential: bool
    ) -> bytes:
        """A request crossing chunk boundaries. Each part is bytes no other task changes
        (a copy out of the map, or the daemon's answer), so it may wait for the next.
        Its misses name the request's chunks as their span, so the daemon fetches
        those of them it lacks in one GET, not one GET per chunk in turn."""
        cs = self.reader.chunk_size
        parts = []
        for index in range(first, last + 1):
            lo = max(off, index * cs) - index * cs
            hi = min(end, (index + 1) * cs) - index * cs
            data, hit, source = await self.reader.chunk(f, index, lo, hi, span=(first, last))
            parts.append(data)
            self._count(hi - lo, hit, source)
        if sequential:
            self.reader.prefetch(f, last)
        return b"".join(parts)

    def _count(self, n: int, hit: bool, source: str) -> None:
        c = self.reader.counters
        c.bytes_read += n
        if source == "buffer":
            c.buffer_bytes += n
        elif source == "store":
            c.store_bytes += n
        if hit:
            c.hits += 1
            c.hit_bytes += n
        else:
            c.misses += 1
            c.miss_bytes += n

    @catches_own  # a hot handler: no wrapper frame (survive.py)
    async def release(self, fh: int) -> None:
        try:
            if self.shared is not None:
                self._release_shared(fh)
                return
            f = self._files.pop(fh, None)
            if f is None:
                return
            h = f.hot
            if h is not None and h.epoch == self._epoch:
                # Opened from its hot record in this listing generation (mount/hot.py):
                # never direct_io, paged or counted, and of the listing served.
                return
            if self._direct:
                self._direct.discard(fh)
            if self._paged:
                self._paged_close(fh)
            versions = self._open_versions.get(f.inode)
            if versions is not None:
                # Taken out, put back if other handles of the version remain; the inode's
                # entry goes with its last version (never left empty).
                version = f.obj.version
                left = versions.pop(version, 0) - 1
                if left > 0:
                    versions[version] = left
                elif not versions:
                    del self._open_versions[f.inode]
            if f.gen != self.listing.gen:
                # A handle of an older listing: its reads stopped at the old size, and a short
                # read makes the kernel shrink the file's size to it. Once it is closed, the
                # kernel must ask again (process.py invalidates these between requests).
                node = self.listing.get(self._listing_ino(f.inode))
                if node is None or node.version != f.obj.version:
                    self._stale_size(f.inode)
        except pyfuse3.FUSEError:
            raise
        except Exception as exc:  # noqa: BLE001 - this request's EIO, not the mount's end
            raise eio("FUSE release", exc) from None

    def _release_shared(self, fh: int) -> None:
        assert self.shared is not None
        f = self._adopted.pop(fh, None)
        slot = self.shared.get(fh)
        self.shared.free(fh)
        gen = f.gen if f is not None else slot.gen if slot is not None else self.listing.gen
        if gen != self.listing.gen and slot is not None:
            node = self.listing.get(slot.inode)
            if node is None or version_hash(node.version, node.content_id) != slot.value:
                self._stale_size(slot.kino)  # the number the kernel knows it by

    def _stale_size(self, inode: int) -> None:
        """A handle of an older version of `inode` was released: the kernel may hold the
        size its last short read cut the inode to. Forgotten here, before this handler
        returns (and so before a request read after this RELEASE is answered): left to
        the report loop, an open or stat in the next 0.25 s saw the new version cut at
        the old size, and a stat kept it for the attribute timeout (an hour with an
        indefinite metadata TTL). Not earlier, at the short read: with the size not cut,
        the old handle's reads past its end would be pages of zeros, not EOF."""
        self.stale_inodes.append(inode)
        if self.forget_attrs is not None:
            inodes, self.stale_inodes = self.stale_inodes, []
            self.forget_attrs(inodes)

    async def flush(self, fh: int) -> None:
        # ENOSYS once makes the kernel stop sending FLUSH: +55% small-file reads.
        raise pyfuse3.FUSEError(errno.ENOSYS)

    async def fsync(self, fh: int, datasync: bool) -> None:
        # Nothing of a read-only handle is unwritten: fsync succeeds, as on any read-only
        # mount (EROFS failed `sync FILE` and `dd conv=fsync` of an input). ENOSYS makes
        # the kernel answer 0 and stop sending FSYNC at all.
        raise pyfuse3.FUSEError(errno.ENOSYS)

    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        raise pyfuse3.FUSEError(errno.ENOSYS)  # as fsync

    # -- everything that would write -------------------------------------------------
    write = create = mkdir = mknod = symlink = link = unlink = rmdir = _erofs  # type: ignore
    rename = setattr = setxattr = removexattr = _erofs  # type: ignore


# The handlers a serving process brings up to date first (_sync_shared): those that name
# an inode the versions table or a newer listing may answer otherwise.
SYNCED = ("lookup", "getattr", "open", "readdir", "forget")


def sync_first(cls: type[SilofsFS]) -> type[SilofsFS]:
    """Class decorator for --serve-processes (process.py, before the fork): the SYNCED
    handlers first bring the process to the newest listing and versions table any
    process has (SilofsFS._sync_shared). On the class, not in the handlers, so one
    serving process's handlers run none of it (a LOOKUP answered from _names is a few
    hundred instructions: bench/handler_ir.py). Returns the handler's own coroutine, as
    forked.release_after_receive does: no wrapper frame per request."""
    for name in SYNCED:
        fn = getattr(cls, name)
        if getattr(fn, "_syncs_first", False):
            continue

        def wrap(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
            @functools.wraps(fn)
            def handler(self: SilofsFS, *args: Any, **kwargs: Any) -> Any:
                if self.shared is not None:
                    try:
                        self._sync_shared()
                    except Exception as exc:  # noqa: BLE001 - this request's EIO
                        return _fail(eio(f"FUSE {name}", exc))
                return fn(self, *args, **kwargs)

            handler._syncs_first = True  # type: ignore[attr-defined]
            return handler

        setattr(cls, name, wrap(fn, name))
    return cls


async def _fail(exc: pyfuse3.FUSEError) -> None:
    raise exc
