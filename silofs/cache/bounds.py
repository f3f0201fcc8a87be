"""Whether a value LMDB points at lies inside data.mdb, found without touching it.

LMDB checksums none of its pages. A damaged leaf node (a flipped overflow page number or
value size) makes a lookup return a value that lies partly or wholly beyond the end of
data.mdb but inside the map: the first byte touched there ends the process with SIGBUS,
in py-lmdb's get() (it reads a byte of every page of a value before returning it) or in
mdb_del/mdb_put freeing the value's overflow pages. A byte flip in the cache must cost
a refetch, never a mount or the daemon.

Owns ValueCursor (a cursor that finds a value's address and size without touching it and
refuses one outside the file), where a py-lmdb Cursor keeps its MDB_val (found once per
process on a scratch env) and where this process maps data.mdb (/proc/self/maps). Never
reads a value's bytes, and never decides what a damaged value costs (callers count it
and refetch). Before deleting a value the daemon also checks its first page's header
(node/store_write.py).
"""

from __future__ import annotations

import ctypes
import logging
import os
import struct
import tempfile
from collections.abc import Callable

import lmdb

log = logging.getLogger(__name__)


class DamagedValueError(lmdb.CorruptedError):
    """A node whose value lies (partly) outside data.mdb: a damaged B-tree page."""


class _PyBuffer(ctypes.Structure):
    """CPython's Py_buffer: the one way to learn a read-only memoryview's address."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None


def buffer_address(view: memoryview | bytes) -> int:
    """Where the bytes of `view` start in memory."""
    pb = _PyBuffer()
    if _get_buffer(view, ctypes.byref(pb), 0):
        raise BufferError("no buffer")
    addr = pb.buf
    _release_buffer(ctypes.byref(pb))
    return int(addr or 0)


_val_offset: int | None = None


def mdb_val_offset() -> int:
    """The offset of [mv_size, mv_data] (the value a cursor is on) inside a py-lmdb
    Cursor object, or -1 if this py-lmdb keeps it elsewhere. Found once per process on a
    scratch env of known values, never on a cache's own values (which may be damaged)."""
    global _val_offset
    if _val_offset is None:
        try:
            _val_offset = _find_val_offset()
        except (lmdb.Error, OSError) as exc:
            log.info("cannot find py-lmdb's MDB_val: %s", exc)
            _val_offset = -1
        if _val_offset < 0:
            log.info("damaged cache values are not bounds-checked (another py-lmdb)")
    return _val_offset


def _find_val_offset() -> int:
    with tempfile.TemporaryDirectory(prefix="silofs-mdbval-") as path:
        env = lmdb.open(path, map_size=1 << 20, lock=False, sync=False, metasync=False)
        try:
            with env.begin(write=True) as txn:
                for i, size in enumerate((3, 700, 5000, 20_000)):  # inline and overflow
                    txn.put(bytes([i]), bytes(size))
            with env.begin(buffers=True) as txn:
                cur = txn.cursor()
                width = type(cur).__basicsize__
                offsets: set[int] | None = None
                for _ in cur.iternext(values=False):
                    value = cur.value()
                    want = struct.pack("@NN", len(value), buffer_address(value))
                    raw = ctypes.string_at(id(cur), width)
                    found = {o for o in range(0, width - 15, 8) if raw[o : o + 16] == want}
                    offsets = found if offsets is None else offsets & found
                    del value
                cur.close()
        finally:
            env.close()
    return offsets.pop() if offsets is not None and len(offsets) == 1 else -1


def map_view(start: int, size: int) -> memoryview:
    """The `size` bytes mapped at `start` as one memoryview (of the map LMDB keeps for
    the env). Only slices a ValueCursor placed inside data.mdb may be touched, and none
    after the env is remapped (set_mapsize), as with any LMDB buffer."""
    return memoryview((ctypes.c_char * size).from_address(start)).cast("B")


def data_mapping(fd: int) -> tuple[int, int] | None:
    """[start, end) of where this process maps the file open on `fd` from offset 0
    (LMDB's map of data.mdb), or None if it does not, or more than once."""
    st = os.fstat(fd)
    spans = []
    with open("/proc/self/maps") as f:
        for line in f:
            span, _, offset, dev, ino = line.split(None, 5)[:5]
            if int(ino) != st.st_ino or int(offset, 16) != 0:
                continue
            major, minor = (int(x, 16) for x in dev.split(":"))
            if os.makedev(major, minor) == st.st_dev:
                lo, hi = (int(x, 16) for x in span.split("-"))
                spans.append((lo, hi))
    return spans[0] if len(spans) == 1 else None


class ValueCursor:
    """A cursor on one db of one txn that finds where a value is without touching it.

    py-lmdb's get() and Cursor.value() "preload" a value (read a byte of each of its
    pages, GIL released) before returning it. Cursor.set_key() positions the cursor,
    touching the B-tree pages and the value's first page only (the LMDB py-lmdb 3.0
    bundles checks the header of every page it gets; it gets only pages below the txn's
    last page, which lie in data.mdb); the value's address and size are then read from
    the cursor object's MDB_val. That is what lets a mount's serving thread look a value
    up without reading all of it (mount/reader.py), and what lets every caller refuse a
    value that runs outside data.mdb before anything touches the rest of it: find()
    raises DamagedValueError for one.

    bounds = (start, end, map_end): the map is [start, map_end), of which [start, end)
    is backed by data.mdb (a committed txn's pages are written before its meta page, and
    the file never shrinks). The bounds may be found before the txn began (once per
    map, CacheStore.value_bounds): a value past `end` but inside the map is checked
    again against the file's size now (refresh) before it is refused. In a read txn
    every value lies there. In a write txn a value may also sit wholly in heap memory:
    in a leaf this txn copied, or in overflow pages this txn wrote (a value put earlier
    in it). LMDB looks a page up in the txn's own dirty pages before the map, so a value
    in the heap is one of this txn's; only a value that lies partly in the map beyond
    the file is refused there.
    (The daemon's deletes check an overflow value's first page header as well.)
    """

    __slots__ = ("cursor", "_val", "start", "_end", "map_end", "_write", "map", "_refresh")

    def __init__(
        self,
        cursor: lmdb.Cursor,
        offset: int,
        bounds: tuple[int, int, int],
        write: bool,
        map_view: memoryview | None = None,
        refresh: Callable[[tuple[int, int, int]], int] | None = None,
    ) -> None:
        self.cursor = cursor
        # [mv_size, mv_data] inside the cursor object, alive as long as self.cursor.
        self._val = (ctypes.c_size_t * 2).from_address(id(cursor) + offset)
        self.start, self._end, self.map_end = bounds
        self._write = write
        # bounds may be older than the txn (CacheStore keeps them per map): the file
        # has grown since, never shrunk. refresh(bounds) is the file's end now, asked
        # for a value that lies in the map past the old end before it is refused.
        self._refresh = refresh
        # The map as bytes from `start` (map_view()), for a read txn's values: they lie
        # in data.mdb, never in a write txn's heap pages. A value find() placed is
        # map[addr - start : addr - start + size] (value(); the hit path of a small file
        # slices it itself, mount/reader.py ChunkReader.whole).
        self.map = None if write else map_view

    def find(self, key: bytes) -> tuple[int, int] | None:
        """(address, size) of the value of `key`, or None if absent; DamagedValueError
        if it lies outside data.mdb."""
        if not self.cursor.set_key(key):
            return None
        val = self._val
        size, addr = val[0], val[1]
        if self.start <= addr and addr + size <= self._end:
            return addr, size  # the common case: a value inside the file as last seen
        in_file = False
        if self._refresh is not None and self.start <= addr:
            if addr + size <= self.map_end:  # past the end found before: look again
                self._end = self._refresh((self.start, self._end, self.map_end))
                in_file = addr + size <= self._end
        in_heap = addr + size <= self.start or addr >= self.map_end  # no byte in the map
        if not in_file and not (self._write and in_heap):
            raise DamagedValueError(f"value of {size} bytes at {addr:#x} lies outside data.mdb")
        return addr, size

    def get(self, key: bytes) -> memoryview | bytes | None:
        """The value of `key` (touched only once find() placed it inside the file)."""
        return None if self.find(key) is None else self.cursor.value()

    def value(self) -> memoryview:
        """The value found last, touching none of its pages: a slice of the map where
        there is one (find() placed it inside data.mdb), else py-lmdb's value(), which
        reads a byte of every page of it (a 4 MiB value: 1024 pages, ~0.1 ms, on each
        1 MiB request of it)."""
        if self.map is None:
            return self.cursor.value()
        at = self._val[1] - self.start
        return self.map[at : at + self._val[0]]


class FirstTime:
    """Keys seen, up to `limit` (then it forgets them all): a damaged node is left in
    place and refused on every lookup, so its chunk is counted and logged once per
    process, not on every read of it."""

    def __init__(self, limit: int = 4096) -> None:
        self._seen: set[bytes] = set()
        self._limit = limit

    def __call__(self, key: bytes) -> bool:
        """Whether `key` is new (and remember it)."""
        if key in self._seen:
            return False
        if len(self._seen) >= self._limit:
            self._seen.clear()
        self._seen.add(key)
        return True
