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

Never holds LMDB or sockets, never decides what a handle reads.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import mmap
import os
import struct

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
# the opener's pid (files: FUSE's pid of the OPEN, for mount/waits.py)
_SLOT = struct.Struct("<IQIIQII")
_FILE = 1
_DIR = 2
_SLOT_BITS = 20  # fh = use count << 20 | slot + 1
_COUNTERS = [f.name for f in dataclasses.fields(MountCounters)]
_ROW = struct.Struct(f"<{len(_COUNTERS)}q")


class TableFull(Exception):
    pass


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


class SharedTables:
    def __init__(self, processes: int) -> None:
        self.processes = processes
        self.slots = _FILES + 2 * DIR_SLOTS
        assert self.slots < (1 << _SLOT_BITS)
        # File slots hold no key (2.4 MiB for all); directory slots hold a position key.
        self._dirs_at = _FILES * _SLOT.size
        self._rows_at = self._dirs_at + 2 * DIR_SLOTS * (_SLOT.size + KEY_BYTES)
        size = self._rows_at + processes * _ROW.size
        self.mem = mmap.mmap(-1, size, flags=mmap.MAP_SHARED)
        self.index = 0  # this process's part of the table and counter row (set after fork)
        self._cursor: dict[tuple[int, bool], int] = {}
        # Locked (lockf: per process, so one descriptor made before the fork serves all)
        # while a process allocates in the overflow parts.
        self._overflow_lock = os.memfd_create("silofs-handles", os.MFD_CLOEXEC)

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
        self, kind: int, inode: int, gen: int, value: int, key: bytes | None, opener: int = 0
    ) -> int:
        # A look at the next few slots of its own part, then of the overflow, then the
        # whole of each: a full part is not scanned whole at every OPEN (16,384 slots,
        # ~5 ms), only before the answer is ENFILE.
        for look in (_LOOK, None):
            fh = self._take(kind, False, look, inode, gen, value, key, opener)
            if fh is not None:
                return fh
            # Its own part is full: the overflow, which every process allocates in, so
            # one at a time (the scan and the write under the lock).
            fcntl.lockf(self._overflow_lock, fcntl.LOCK_EX)
            try:
                fh = self._take(kind, True, look, inode, gen, value, key, opener)
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
    ) -> int | None:
        part = self._range(kind, overflow)
        start = self._cursor.get((kind, overflow), part.start)
        mem = self.mem
        for i in range(len(part) if look is None else min(look, len(part))):
            slot = part.start + (start - part.start + i) % len(part)
            state, _, _, count, _, _, _ = _SLOT.unpack_from(mem, self._at(slot))
            if state == 0:
                count = (count + 1) & 0xFFFFFFFF
                self._write(slot, kind, inode, gen, count, value, key, opener)
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
    ) -> None:
        at = self._at(slot)
        key = key or b""
        if key:
            self.mem[at + _SLOT.size : at + _SLOT.size + len(key)] = key
        # The state last: a process reading the slot sees it whole. It reads it only for a
        # handle the kernel got from the OPEN reply, sent after this write.
        _SLOT.pack_into(self.mem, at, 0, inode, gen, count, value, len(key), opener)
        struct.pack_into("<I", self.mem, at, kind)

    def open_file(self, inode: int, gen: int, vhash: int, opener: int = 0) -> int:
        return self._alloc(_FILE, inode, gen, vhash, None, opener)

    def open_dir(self, inode: int, gen: int) -> int:
        return self._alloc(_DIR, inode, gen, 0, None)

    def get(self, fh: int) -> Slot | None:
        """The slot `fh` names, or None if it is free or was reused since."""
        slot = (fh & ((1 << _SLOT_BITS) - 1)) - 1
        if not 0 <= slot < self.slots:
            return None
        at = self._at(slot)
        state, inode, gen, count, value, klen, opener = _SLOT.unpack_from(self.mem, at)
        if state == 0 or count != fh >> _SLOT_BITS:
            return None
        key = bytes(self.mem[at + _SLOT.size : at + _SLOT.size + klen]) if klen else None
        return Slot(state, inode, gen, value, key, opener)

    def set_position(self, fh: int, pos: int, key: bytes | None) -> None:
        """Where a readdir of directory handle `fh` stopped, for whichever process gets
        the next one (a key too long to share is dropped: that process counts)."""
        slot = (fh & ((1 << _SLOT_BITS) - 1)) - 1
        if key is not None and len(key) > KEY_BYTES:
            key, pos = None, 0
        if not _FILES <= slot < self.slots:
            return
        at = self._at(slot)
        state, inode, gen, count, _, _, _ = _SLOT.unpack_from(self.mem, at)
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

    def other_versions_open(self, inode: int, vhash: int) -> bool:
        """Whether a handle of `inode` with another version is open in any process. A
        search of the file slots (2.4 MiB, at C speed) for the inode's bytes: done only for
        inodes whose version changed since the mount started (fs.py)."""
        mem, end = self.mem, self._dirs_at
        pattern = struct.pack("<Q", inode)
        pos = mem.find(pattern, 0, end)
        while pos != -1:
            at = pos - 4  # the inode follows the 4-byte state
            if at >= 0 and at % _SLOT.size == 0:
                state, ino, _, _, value, _, _ = _SLOT.unpack_from(mem, at)
                if state == _FILE and ino == inode and value != vhash:
                    return True
            pos = mem.find(pattern, pos + 1, end)
        return False

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
