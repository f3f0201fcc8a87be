"""What the serving processes of one mount share (--serve-processes N, mount/forked.py).

The kernel hands each request to whichever process reads it, so OPEN, READ and RELEASE
of one file handle, or OPENDIR and READDIR of one directory handle, land in different
processes. Owns two tables in anonymous shared memory, mapped by the supervisor before
it forks and so the same pages in every child:

- handles: one slot per open file or directory: its inode, the listing generation it
  was opened in and a hash of the version it opened (a file), or where the last readdir
  stopped (a directory: offset and position key). The file handle the kernel gets names
  the slot and the slot's use count, so a handle is self-describing: any process derives
  the same open file from it (promise 3: one version per open; and the thread that
  opened it, which mount/waits.py looks at), and a slot reused after
  a RELEASE gives a new handle, never an old one's cached state. Each process allocates
  in its own part of the table without a lock (no two processes write a free slot), and
  once that part is full in an overflow part as large as all of them, one process at a
  time (a POSIX record lock, which a killed holder's end releases): the kernel hands
  OPENs to whichever process reads them, so one process's part fills while the others'
  are free, and that was ENFILE (a quarter of the table with four processes). Any
  process frees a slot (the kernel sends RELEASE once, after the last request on it).
- counters: one row of MountCounters per process; the counters reported to the daemon
  are their sum (status counts each byte once, whoever served it), and a restarted
  process continues its row.
- versions: the inode numbers of an inode per version (mount/fs.py _retire): each a
  path's fresh number (with the lookups the kernel counts of it) or a retired one (a
  number the kernel may still hold for an older version's handles), with its listing
  inode; the newest listing generation any process switched to; the next fresh number.
  A request of either number, or its FORGET, may reach any process. Written only under a
  lock (lockf, as the overflow), each structural change moving a sequence number on, so
  a process sees a change with one read and loads the rows under the lock; a full table
  is VersionsFull, and the caller keeps the path's number (direct_io, as before).

Never holds LMDB or sockets, never decides what a handle reads.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import mmap
import os
import struct
from collections.abc import Iterator

import xxhash

from silofs.records import MountCounters

log = logging.getLogger(__name__)

# Open files and directories of the mount at once, all processes together, however the
# kernel spread their OPENs (each kind's own parts hold as many again, split between the
# processes, and an overflow part this many; ENFILE past it).
FILE_SLOTS = 32768
DIR_SLOTS = 2048
_FILES = 2 * FILE_SLOTS  # slot numbers below are files': own parts, then the overflow
_LOOK = 64  # slots an OPEN looks at in a part before it tries the next (_alloc)
KEY_BYTES = 512  # a position key is a dirents key: at most LMDB's 511 bytes

# state, inode, gen, use count, version hash (files) or readdir offset (dirs), key length,
# the opener's pid (files: FUSE's pid of the OPEN, for mount/waits.py), the number the
# kernel knows the file by (files: the listing inode, or a fresh one: fs.py _retire)
_SLOT = struct.Struct("<IQIIQIIQ")
_KINO_AT = _SLOT.size - 8  # where a slot's kernel number is (other_versions_open)
_FILE = 1
_DIR = 2
_SLOT_BITS = 20  # fh = use count << 20 | slot + 1
_COUNTERS = [f.name for f in dataclasses.fields(MountCounters)]
_ROW = struct.Struct(f"<{len(_COUNTERS)}q")
# versions: the sequence number (moved on at each structural change), the newest listing
# generation switched to, the next fresh number; then a row per number.
VERSION_ROWS = 4096  # fresh and retired numbers at once, all processes together
_VHEAD = struct.Struct("<QQQ")
_VROW = struct.Struct("<IQQq")  # role, number, listing inode, lookups (fresh numbers)
FRESH = 1
RETIRED = 2


class TableFull(Exception):
    pass


class VersionsFull(Exception):
    """The versions table holds VERSION_ROWS numbers: no path gets a fresh one."""


def version_hash(version: str, content_id: str) -> int:
    return xxhash.xxh3_64_intdigest(f"{version}\0{content_id}".encode())


@dataclasses.dataclass(frozen=True)
class Slot:
    kind: int
    inode: int
    gen: int
    value: int  # a file: its version hash; a directory: the readdir offset of `key`
    key: bytes | None = None
    opener: int = 0
    kino: int = 0  # a file: the number the kernel knows it by


@dataclasses.dataclass
class VersionRows:
    """The versions table as read under its lock: number -> (role, listing inode,
    lookups), and the row each is in (for a count changed in place)."""

    seq: int
    gen: int
    next: int
    numbers: dict[int, tuple[int, int, int]]
    rows: dict[int, int]


class SharedTables:
    def __init__(self, processes: int) -> None:
        self.processes = processes
        self.slots = _FILES + 2 * DIR_SLOTS
        assert self.slots < (1 << _SLOT_BITS)
        # File slots hold no key (2.4 MiB for all); directory slots hold a position key.
        self._dirs_at = _FILES * _SLOT.size
        self._rows_at = self._dirs_at + 2 * DIR_SLOTS * (_SLOT.size + KEY_BYTES)
        self._versions_at = self._rows_at + processes * _ROW.size
        size = self._versions_at + _VHEAD.size + VERSION_ROWS * _VROW.size
        self.mem = mmap.mmap(-1, size, flags=mmap.MAP_SHARED)
        self.index = 0  # this process's part of the table and counter row (set after fork)
        self._cursor: dict[tuple[int, bool], int] = {}
        # Locked (lockf: per process, so one descriptor made before the fork serves all)
        # while a process allocates in the overflow parts.
        self._overflow_lock = os.memfd_create("silofs-handles", os.MFD_CLOEXEC)
        self._versions_lock = os.memfd_create("silofs-versions", os.MFD_CLOEXEC)

    # -- handles -----------------------------------------------------------------------
    def _at(self, slot: int) -> int:
        if slot < _FILES:
            return slot * _SLOT.size
        return self._dirs_at + (slot - _FILES) * (_SLOT.size + KEY_BYTES)

    def _range(self, kind: int, overflow: bool = False) -> range:
        """This process's own part of a kind's slots, or the overflow part of it."""
        lo, n = (0, FILE_SLOTS) if kind == _FILE else (_FILES, DIR_SLOTS)
        if overflow:
            return range(lo + n, lo + 2 * n)
        per = n // self.processes
        return range(lo + self.index * per, lo + (self.index + 1) * per)

    def _alloc(
        self,
        kind: int,
        inode: int,
        gen: int,
        value: int,
        key: bytes | None,
        opener: int = 0,
        kino: int = 0,
    ) -> int:
        # A look at the next few slots of its own part, then of the overflow, then the
        # whole of each: a full part is not scanned whole at every OPEN (16,384 slots,
        # ~5 ms), only before the answer is ENFILE.
        for look in (_LOOK, None):
            fh = self._take(kind, False, look, inode, gen, value, key, opener, kino)
            if fh is not None:
                return fh
            # Its own part is full: the overflow, which every process allocates in, so
            # one at a time (the scan and the write under the lock).
            fcntl.lockf(self._overflow_lock, fcntl.LOCK_EX)
            try:
                fh = self._take(kind, True, look, inode, gen, value, key, opener, kino)
            finally:
                fcntl.lockf(self._overflow_lock, fcntl.LOCK_UN)
            if fh is not None:
                return fh
        raise TableFull

    def _take(
        self,
        kind: int,
        overflow: bool,
        look: int | None,
        inode: int,
        gen: int,
        value: int,
        key: bytes | None,
        opener: int,
        kino: int,
    ) -> int | None:
        part = self._range(kind, overflow)
        start = self._cursor.get((kind, overflow), part.start)
        mem = self.mem
        for i in range(len(part) if look is None else min(look, len(part))):
            slot = part.start + (start - part.start + i) % len(part)
            state, _, _, count, _, _, _, _ = _SLOT.unpack_from(mem, self._at(slot))
            if state == 0:
                count = (count + 1) & 0xFFFFFFFF
                self._write(slot, kind, inode, gen, count, value, key, opener, kino)
                nxt = slot + 1 if slot + 1 < part.stop else part.start
                self._cursor[kind, overflow] = nxt
                return (count << _SLOT_BITS) | (slot + 1)
        return None

    def _write(
        self,
        slot: int,
        kind: int,
        inode: int,
        gen: int,
        count: int,
        value: int,
        key: bytes | None,
        opener: int = 0,
        kino: int = 0,
    ) -> None:
        at = self._at(slot)
        key = key or b""
        if key:
            self.mem[at + _SLOT.size : at + _SLOT.size + len(key)] = key
        # The state last: a process reading the slot sees it whole. It reads it only for a
        # handle the kernel got from the OPEN reply, sent after this write.
        _SLOT.pack_into(self.mem, at, 0, inode, gen, count, value, len(key), opener, kino)
        struct.pack_into("<I", self.mem, at, kind)

    def open_file(
        self, inode: int, gen: int, vhash: int, opener: int = 0, kino: int | None = None
    ) -> int:
        """A file handle of listing inode `inode`, opened through kernel number `kino`
        (the same unless the path has a fresh number: fs.py _retire)."""
        return self._alloc(_FILE, inode, gen, vhash, None, opener, inode if kino is None else kino)

    def open_dir(self, inode: int, gen: int) -> int:
        return self._alloc(_DIR, inode, gen, 0, None)

    def get(self, fh: int) -> Slot | None:
        """The slot `fh` names, or None if it is free or was reused since."""
        slot = (fh & ((1 << _SLOT_BITS) - 1)) - 1
        if not 0 <= slot < self.slots:
            return None
        at = self._at(slot)
        state, inode, gen, count, value, klen, opener, kino = _SLOT.unpack_from(self.mem, at)
        if state == 0 or count != fh >> _SLOT_BITS:
            return None
        key = bytes(self.mem[at + _SLOT.size : at + _SLOT.size + klen]) if klen else None
        return Slot(state, inode, gen, value, key, opener, kino)

    def set_position(self, fh: int, pos: int, key: bytes | None) -> None:
        """Where a readdir of directory handle `fh` stopped, for whichever process gets
        the next one (a key too long to share is dropped: that process counts)."""
        slot = (fh & ((1 << _SLOT_BITS) - 1)) - 1
        if key is not None and len(key) > KEY_BYTES:
            key, pos = None, 0
        if not _FILES <= slot < self.slots:
            return
        at = self._at(slot)
        state, inode, gen, count, _, _, _, _ = _SLOT.unpack_from(self.mem, at)
        if state != _DIR or count != fh >> _SLOT_BITS:
            return
        self._write(slot, _DIR, inode, gen, count, pos, key)

    def open_handles(self) -> int:
        """Handles open in any process (a scan of every slot: for a detached mount's
        supervisor, a few times a second at most)."""
        state = struct.Struct("<I")
        return sum(
            1 for slot in range(self.slots) if state.unpack_from(self.mem, self._at(slot))[0]
        )

    def free(self, fh: int) -> None:
        slot = (fh & ((1 << _SLOT_BITS) - 1)) - 1
        if 0 <= slot < self.slots and self.get(fh) is not None:
            struct.pack_into("<I", self.mem, self._at(slot), 0)

    def files_of(self, kino: int) -> list[tuple[int, Slot]]:
        """(fh, slot) of every open file the kernel knows by number `kino`, in any
        process. A search of the file slots (2.9 MiB, at C speed) for the number's bytes."""
        mem, end = self.mem, self._dirs_at
        pattern = struct.pack("<Q", kino)
        found = []
        pos = mem.find(pattern, 0, end)
        while pos != -1:
            at = pos - _KINO_AT
            if at >= 0 and at % _SLOT.size == 0:
                state, ino, gen, count, value, _, opener, k = _SLOT.unpack_from(mem, at)
                if state == _FILE and k == kino:
                    fh = (count << _SLOT_BITS) | (at // _SLOT.size + 1)
                    found.append((fh, Slot(state, ino, gen, value, None, opener, k)))
            pos = mem.find(pattern, pos + 1, end)
        return found

    def other_versions_open(self, kino: int, vhash: int) -> bool:
        """Whether a handle of kernel number `kino` with another version is open in any
        process: done only for inodes whose version changed since the mount started
        (fs.py)."""
        return any(slot.value != vhash for _, slot in self.files_of(kino))

    def _open_files(self) -> Iterator[tuple]:
        """The unpacked slot of every file open in any process. A search of the file
        slots for a used one's state byte (memchr: a walk of every slot in Python took
        ~20 ms, a search for its four bytes, three of them zeros, longer)."""
        mem, end = self.mem, self._dirs_at
        used = bytes([_FILE])  # the state's low byte; its other three are zeros
        pos = mem.find(used, 0, end)
        while pos != -1:
            if pos % _SLOT.size:  # the same bytes in another field: on from the next slot
                pos = mem.find(used, pos + _SLOT.size - pos % _SLOT.size, end)
                continue
            row = _SLOT.unpack_from(mem, pos)
            if row[0] == _FILE:
                yield row
            pos = mem.find(used, pos + _SLOT.size, end)

    def open_versions(self) -> dict[int, set[int]]:
        """Kernel number -> the version hashes of the files open under it, in every
        process (a switch()'s view of the handles: fs.py _retire), once per listing
        generation and process."""
        out: dict[int, set[int]] = {}
        for _, _, _, _, value, _, _, kino in self._open_files():
            out.setdefault(kino, set()).add(value)
        return out

    def open_generations(self) -> set[int]:
        """The listing generations of the files open in any process: a process that never
        saw a handle reads its entry from the generation it was opened in (fs.py _adopt),
        so the mount reports these and the daemon keeps them (node/datasets.py
        served_generations); once per report."""
        return {row[2] for row in self._open_files()}

    # -- versions ------------------------------------------------------------------------
    def versions_stamp(self) -> tuple[int, int]:
        """(sequence number, newest generation): read without the lock, as a hint that
        the rows changed (they are then read under it) or that a process switched."""
        seq, gen, _ = _VHEAD.unpack_from(self.mem, self._versions_at)
        return seq, gen

    def lock_versions(self) -> None:
        fcntl.lockf(self._versions_lock, fcntl.LOCK_EX)

    def unlock_versions(self) -> None:
        fcntl.lockf(self._versions_lock, fcntl.LOCK_UN)

    def read_versions(self) -> VersionRows:
        """The whole table (call with the lock held)."""
        seq, gen, nxt = _VHEAD.unpack_from(self.mem, self._versions_at)
        numbers: dict[int, tuple[int, int, int]] = {}
        rows: dict[int, int] = {}
        at = self._versions_at + _VHEAD.size
        view = memoryview(self.mem)[at : at + VERSION_ROWS * _VROW.size]
        try:
            for i, (role, number, ino, lookups) in enumerate(_VROW.iter_unpack(view)):
                if role:
                    numbers[number] = (role, ino, lookups)
                    rows[number] = i
        finally:
            view.release()
        return VersionRows(seq, gen, nxt, numbers, rows)

    def write_versions(self, numbers: dict[int, tuple[int, int, int]], nxt: int, gen: int) -> int:
        """Replace the table's rows (call with the lock held); its new sequence number.
        VersionsFull, the table unchanged, past VERSION_ROWS."""
        if len(numbers) > VERSION_ROWS:
            raise VersionsFull
        at = self._versions_at + _VHEAD.size
        self.mem[at : at + VERSION_ROWS * _VROW.size] = bytes(VERSION_ROWS * _VROW.size)
        for i, (number, (role, ino, lookups)) in enumerate(numbers.items()):
            _VROW.pack_into(self.mem, at + i * _VROW.size, role, number, ino, lookups)
        seq = _VHEAD.unpack_from(self.mem, self._versions_at)[0] + 1
        _VHEAD.pack_into(self.mem, self._versions_at, seq, gen, nxt)
        return seq

    def add_lookups(self, row: int, number: int, n: int) -> None:
        """Count `n` more lookups of fresh number `number` in its row (call with the lock
        held, the row read since the last change): not a structural change."""
        at = self._versions_at + _VHEAD.size + row * _VROW.size
        role, num, ino, lookups = _VROW.unpack_from(self.mem, at)
        assert role == FRESH and num == number
        _VROW.pack_into(self.mem, at, role, num, ino, lookups + n)

    def note_gen(self, gen: int) -> None:
        """A process switched to listing generation `gen` (call with the lock held)."""
        seq, old, nxt = _VHEAD.unpack_from(self.mem, self._versions_at)
        if gen > old:
            _VHEAD.pack_into(self.mem, self._versions_at, seq, gen, nxt)

    # -- counters ----------------------------------------------------------------------
    def publish(self, counters: MountCounters) -> None:
        values = [getattr(counters, name) for name in _COUNTERS]
        _ROW.pack_into(self.mem, self._rows_at + self.index * _ROW.size, *values)

    def own_counters(self) -> MountCounters:
        """This process's row: where a restarted process continues from."""
        at = self._rows_at + self.index * _ROW.size
        return MountCounters(**dict(zip(_COUNTERS, _ROW.unpack_from(self.mem, at), strict=True)))

    def total(self) -> MountCounters:
        sums = [0] * len(_COUNTERS)
        for i in range(self.processes):
            row = _ROW.unpack_from(self.mem, self._rows_at + i * _ROW.size)
            sums = [a + b for a, b in zip(sums, row, strict=True)]
        return MountCounters(**dict(zip(_COUNTERS, sums, strict=True)))
