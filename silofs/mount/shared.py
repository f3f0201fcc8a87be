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
  only in its own part of the table (no two processes write a free slot), any process
  frees a slot (the kernel sends RELEASE once, after the last request on the handle).
- counters: one row of MountCounters per process; the counters reported to the daemon
  are their sum (status counts each byte once, whoever served it), and a restarted
  process continues its row.

Never holds LMDB or sockets, never decides what a handle reads.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import struct

import xxhash

from silofs.records import MountCounters

log = logging.getLogger(__name__)

FILE_SLOTS = 32768  # open files of the mount at once, all processes together
DIR_SLOTS = 2048  # open directories
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
        assert FILE_SLOTS + DIR_SLOTS < (1 << _SLOT_BITS)
        self.processes = processes
        self.slots = FILE_SLOTS + DIR_SLOTS
        # File slots hold no key (1.1 MiB for all); directory slots hold a position key.
        self._dirs_at = FILE_SLOTS * _SLOT.size
        self._rows_at = self._dirs_at + DIR_SLOTS * (_SLOT.size + KEY_BYTES)
        size = self._rows_at + processes * _ROW.size
        self.mem = mmap.mmap(-1, size, flags=mmap.MAP_SHARED)
        self.index = 0  # this process's part of the table and counter row (set after fork)
        self._cursor: dict[int, int] = {}

    # -- handles -----------------------------------------------------------------------
    def _at(self, slot: int) -> int:
        if slot < FILE_SLOTS:
            return slot * _SLOT.size
        return self._dirs_at + (slot - FILE_SLOTS) * (_SLOT.size + KEY_BYTES)

    def _range(self, kind: int) -> range:
        lo, n = (0, FILE_SLOTS) if kind == _FILE else (FILE_SLOTS, DIR_SLOTS)
        per = n // self.processes
        return range(lo + self.index * per, lo + (self.index + 1) * per)

    def _alloc(
        self, kind: int, inode: int, gen: int, value: int, key: bytes | None, opener: int = 0
    ) -> int:
        part = self._range(kind)
        start = self._cursor.get(kind, part.start)
        mem = self.mem
        for i in range(len(part)):
            slot = part.start + (start - part.start + i) % len(part)
            state, _, _, count, _, _, _ = _SLOT.unpack_from(mem, self._at(slot))
            if state == 0:
                count = (count + 1) & 0xFFFFFFFF
                self._write(slot, kind, inode, gen, count, value, key, opener)
                self._cursor[kind] = slot + 1 if slot + 1 < part.stop else part.start
                return (count << _SLOT_BITS) | (slot + 1)
        raise TableFull

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
        if not FILE_SLOTS <= slot < self.slots:
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
        search of the file slots (1 MiB, at C speed) for the inode's bytes: done only for
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
