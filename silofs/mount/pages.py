"""Copying a value of a mount's read txn out of data.mdb, and where its pages are.

Owns ValuePages: copying the bytes of a value a ValueCursor found (by its address in
LMDB's map) out of data.mdb into a buffer of the caller's own with one preadv, without
waiting for the disk on the serving thread (RWF_NOWAIT: a short read says the rest is
not in the page cache, and a worker thread reads it), whether a value is in memory where
that flag is refused (mincore), and asking the kernel to read a range ahead
(MADV_WILLNEED), so a mount's serving thread never waits on the disk for a hit
(mount/reader.py); and whether a value is all in the page cache (in_memory) before a
warm small file is copied out of the map instead. Owns DirectFile too: data.mdb opened
with O_DIRECT, a value read by the disk's DMA into a page-aligned buffer of the caller's
own, bypassing the page cache. Never writes the env, and never checks what it copies
(the caller does, on its copy: cache/format.py check_copy).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import struct
from typing import Any

from silofs.cache.bounds import data_mapping, mdb_val_offset

_MADV_NORMAL = 0
_MADV_RANDOM = 1
_MADV_WILLNEED = 3
_MADV_POPULATE_READ = 22  # Linux 5.14+
_PAGE = mmap.PAGESIZE
_PAGE_MASK = ~(_PAGE - 1)
_PAGE_SHIFT = _PAGE.bit_length() - 1
# statx(2): STATX_DIOALIGN (Linux 6.1+) and where struct statx keeps its answer.
_STATX_DIOALIGN = 0x2000
_STATX_SIZE = 256
_DIO_ALIGN_AT = 152  # stx_dio_mem_align, then stx_dio_offset_align (u32 each)
_AT_FDCWD = -100

log = logging.getLogger(__name__)


def _libc_calls() -> tuple[Any, Any] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mincore, madvise = libc.mincore, libc.madvise
    except (OSError, AttributeError):
        return None
    # Through CDLL (not pythonapi): ctypes releases the GIL for the call, so a madvise
    # waiting for the disk in a worker thread never stalls the serving thread.
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    mincore.restype = madvise.restype = ctypes.c_int
    return mincore, madvise


class ValuePages:
    """The values of a read-only env's read txns, by address: their bytes and residency.

    A hit whose pages are not in memory would wait for the disk on whatever thread
    first reads them; on a mount's one serving thread that serialises every reader
    behind one disk read (docs/ARCHITECTURE.md, "the ceiling of one serving process").
    A ValueCursor (bounds.py) finds a value without touching it; read() copies a range
    of it out of data.mdb (its file offset is its address minus where this process maps
    the file from offset 0, /proc/self/maps), and with `nowait` only what the page cache
    holds: a read of pages not cached starts the kernel's read-ahead for them and
    returns short, and the caller reads the rest from a worker thread. A copy rather
    than a view of the map: the map may change under a reader (a damaged disk, anything
    writing data.mdb), and the kernel copies a FUSE reply only after the handler
    returns. The read also takes the file's sequential read-ahead, where touching the
    map would take one fault (and its read-around) at a time.

    The address and the mapping are read while the snapshot that found the value is
    open, so the writer cannot reuse its pages meanwhile; a wrong address (a remap, a
    damaged node the cursor let through) reads other bytes of the file, which the
    caller's check refuses. Where the file refuses RWF_NOWAIT, value_resident() asks
    mincore instead if it can tell (`truthful`: the kernel reports every page resident
    to a non-root mount of a root daemon's cache, data.mdb 0640, Linux 5.0+).
    `enabled` is False where none of this can work: no MDB_val found in the cursor
    object (another py-lmdb), data.mdb not readable, or neither RWF_NOWAIT nor a
    truthful mincore. Callers then copy a value out of the map on their own thread.
    """

    def __init__(self, data_path: str) -> None:
        calls = _libc_calls()
        self.enabled = calls is not None and mdb_val_offset() >= 0
        self.truthful = _mincore_truthful(data_path)
        if calls is not None:
            self._mincore, self._madvise = calls
        self._fd = -1
        self.nowait = False  # reads may ask for RWF_NOWAIT
        self._no_populate = False  # the kernel refused MADV_POPULATE_READ (mapped())
        self._map = (0, 0)  # [start, end) of the mapping of data.mdb, as last read
        self._byte = bytearray(1)
        self._iov = [self._byte]
        if self.enabled:
            try:
                self._fd = os.open(data_path, os.O_RDONLY | os.O_CLOEXEC)
                os.preadv(self._fd, self._iov, 0, os.RWF_NOWAIT)
                self.nowait = True
            except BlockingIOError:
                self.nowait = True  # page 0 not cached: the flag works
            except (OSError, AttributeError):  # unreadable, or no RWF_NOWAIT (EOPNOTSUPP)
                pass
            # Without RWF_NOWAIT a read would wait on the serving thread unless mincore
            # can tell it will not.
            self.enabled = self._fd >= 0 and (self.nowait or self.truthful)
        self._vec = bytearray(0)
        self._vec_addr = 0
        self._grow(1024)

    def offset(self, addr: int) -> int | None:
        """The offset in data.mdb of the mapped address `addr` (a value's, found by a
        ValueCursor in a snapshot still open), or None if the mapping does not hold it."""
        start, end = self._map
        if start <= addr < end:
            return addr - start
        return self._offset(addr)

    def read(self, offset: int, buffers: list[Any], nowait: bool) -> int:
        """Copy data.mdb from `offset` on into `buffers` (one preadv); the bytes read.
        With `nowait` it stops at the first page not in the page cache (0 if that is
        the first), having started the kernel's read-ahead of it; without, it waits for
        the disk, and is short only at the end of the file. 0 as well if the read fails
        (an I/O error): the caller's worker reads it again and sees the error (pread)."""
        try:
            return os.preadv(self._fd, buffers, offset, os.RWF_NOWAIT if nowait else 0)
        except OSError:
            return 0

    def copy_nowait(self, addr: int, buffers: list[Any]) -> int:
        """read(offset(addr), buffers, True) in one call, for a reader that waits for
        no disk (`nowait`): the bytes copied, 0 if none (a page not cached, an I/O
        error), -1 if the mapping does not hold `addr`. The hit path of a one-chunk
        file read whole (ChunkReader.whole) calls only this."""
        start, end = self._map
        if not start <= addr < end:
            base = self._offset(addr)
            if base is None:
                return -1
            start = addr - base
        try:
            return os.preadv(self._fd, buffers, addr - start, os.RWF_NOWAIT)
        except OSError:
            return 0

    def cached(self, offset: int) -> bool:
        """Whether the page of data.mdb at `offset` is in the page cache (a 1-byte
        RWF_NOWAIT read); for `nowait` readers only."""
        try:
            return os.preadv(self._fd, self._iov, offset, os.RWF_NOWAIT) == 1
        except OSError:
            return False

    def pread(self, n: int, offset: int) -> bytes:
        """`n` bytes of data.mdb from `offset` (fewer at its end), waiting for the disk:
        a worker thread's read. OSError if the read fails."""
        return os.pread(self._fd, n, offset)

    def _grow(self, pages: int) -> None:
        self._vec = bytearray(pages)
        self._vec_addr = ctypes.addressof((ctypes.c_char * pages).from_buffer(self._vec))

    def resident(self, addr: int, lo: int, hi: int) -> bool:
        """Whether every page of [addr+lo, addr+hi) is in memory (not under IO)."""
        start = (addr + lo) & ~(_PAGE - 1)
        end = addr + hi
        pages = (end - start + _PAGE - 1) // _PAGE
        if pages <= 0:
            return True
        if pages > len(self._vec):
            self._grow(pages)
        if self._mincore(start, end - start, self._vec_addr):
            return True  # not mapped as we think (a remap): let the fault path have it
        return self._vec.count(1, 0, pages) == pages

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _offset(self, addr: int) -> int | None:
        """The offset in data.mdb of the mapped address `addr` (LMDB maps the file from
        offset 0), or None if the mapping of data.mdb does not hold it."""
        start, end = self._map
        if not start <= addr < end:
            self._map = data_mapping(self._fd) or (0, 0)  # remapped: read it again
            start, end = self._map
            if not start <= addr < end:
                return None
        return addr - start

    def in_memory(self, addr: int, size: int) -> bool:
        """Whether every page of the value at `addr` (found by a ValueCursor in a
        snapshot still open) is in the page cache and up to date, by mincore, on the
        serving thread's vector; False where the range is not mapped as we think (a
        remap). Only where mincore is `truthful` (the caller asks that once). A copy of
        such a value out of the map (mount/reader.py ChunkReader.whole) then waits for
        no disk and raises no SIGBUS, but for a page evicted in the microseconds between
        this call and the copy. The hit path of every warm small file, kept short: the
        caller has reserve()d the vector for values of this size."""
        start = addr & _PAGE_MASK
        span = addr + size - start
        pages = (span + _PAGE - 1) >> _PAGE_SHIFT
        return not self._mincore(start, span, self._vec_addr) and (
            self._vec.count(1, 0, pages) == pages
        )

    def in_memory_pages(self, start: int, span: int, pages: int) -> bool:
        """in_memory() of a value whose page range a hot record holds (mount/hot.py):
        `span` bytes from the page-aligned `start`, `pages` pages, reserve()d already."""
        return not self._mincore(start, span, self._vec_addr) and (
            self._vec.count(1, 0, pages) == pages
        )

    def reserve(self, size: int) -> None:
        """Make the serving thread's vector long enough for in_memory() of a value of
        `size` bytes at any address (once per value size, not per read)."""
        pages = (size + 2 * _PAGE - 2) >> _PAGE_SHIFT
        if pages > len(self._vec):
            self._grow(pages)

    def value_resident(self, addr: int, size: int) -> bool:
        """Whether every page of the value at `addr`, found by a ValueCursor, is in
        memory, by mincore: where reads cannot ask RWF_NOWAIT (then mincore is truthful
        here, or `enabled` is False: __init__)."""
        return self.resident(addr, 0, size)

    def value_cached(self, addr: int, size: int) -> bool:
        """Whether every page of the value at `addr` (found by a ValueCursor in a snapshot
        still open) is in the page cache, by mincore; False where mincore cannot tell
        (not `truthful`) or the range is not mapped. For any thread: its own vector."""
        start = addr & ~(_PAGE - 1)
        pages = (addr + size - start + _PAGE - 1) // _PAGE
        if not self.truthful or pages <= 0:
            return False
        vec = bytearray(pages)
        at = ctypes.addressof((ctypes.c_char * pages).from_buffer(vec))
        if self._mincore(start, addr + size - start, at):
            return False
        return vec.count(1) == pages

    def mapped(self, addr: int, lo: int, hi: int) -> bool:
        """Map [addr+lo, addr+hi) of LMDB's map into this process before the caller reads
        it there (MADV_POPULATE_READ): True once every page is mapped, False if a page
        cannot be read (an I/O error of the cache disk, a file cut short) or the range is
        not mapped. A read of such a page through the map would raise SIGBUS, which kills
        the mount (Python cannot recover from it in a memmove); the populate reports it
        as an error instead. It does the work the copy's page faults would (it blocks on
        the disk as they would for a page not in memory), so it costs about the same.
        Where the kernel lacks it (before 5.14), True: the caller reads as it did."""
        if self._no_populate:
            return True
        start = (addr + lo) & ~(_PAGE - 1)
        if self._madvise(start, addr + hi - start, _MADV_POPULATE_READ) == 0:
            return True
        if ctypes.get_errno() == errno.EINVAL:
            self._no_populate = True
            return True
        return False

    def read_around(self, start: int, end: int, on: bool) -> None:
        """Whether a fault in the map [start, end) reads the pages around it too."""
        self._madvise(start, end - start, _MADV_NORMAL if on else _MADV_RANDOM)

    def willneed(self, addr: int, lo: int, hi: int) -> None:
        """Start reading [addr+lo, addr+hi) ahead (async in the kernel; it may block
        briefly to submit the IO, so call it from a worker thread)."""
        start = (addr + lo) & ~(_PAGE - 1)
        self._madvise(start, addr + hi - start, _MADV_WILLNEED)


class DirectFile:
    """data.mdb opened with O_DIRECT: a value read by the disk's DMA straight into a
    page-aligned buffer of the caller's own (an anonymous map), with no page-cache fill,
    no mapping and no copy on the CPU (bench/README.md, "The big file read direct").

    LMDB writes data.mdb through the page cache; before the kernel reads a range with
    O_DIRECT it writes back that range's dirty pages, so a value committed a moment ago
    reads as committed. `align` is the file's O_DIRECT offset and length alignment
    (statx STATX_DIOALIGN, at least a page; a page where the kernel does not say), 0
    where the filesystem says it has no O_DIRECT. `enabled` is False where the file
    refuses O_DIRECT, at open or with EINVAL at a read (a filesystem that takes the flag
    but not the reads): the caller then reads as it would without, and that is logged
    once, at debug."""

    def __init__(self, data_path: str) -> None:
        self.fd = -1
        self.align = _dio_align(data_path)
        if self.align:
            try:
                self.fd = os.open(data_path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
            except OSError as exc:
                log.debug("no O_DIRECT reads of %s: %s", data_path, exc)
        self.enabled = self.fd >= 0

    def span(self, base: int, size: int) -> tuple[int, int]:
        """[start, end) of data.mdb an O_DIRECT read of `size` bytes at `base` covers."""
        a = self.align
        return base // a * a, (base + size + a - 1) // a * a

    def read(self, base: int, size: int, buf: mmap.mmap) -> memoryview | None:
        """The `size` bytes at `base` in data.mdb, read into `buf` (page-aligned, at least
        span()'s length long): a view of them in `buf`, with no page of the file cached
        or mapped. None where the file refuses O_DIRECT (EINVAL: `enabled` is False from
        then on). OSError where the disk cannot read them or the file ends before they
        do: the caller takes the value as damaged."""
        start, end = self.span(base, size)
        try:
            got = os.preadv(self.fd, [memoryview(buf)[: end - start]], start)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            if self.enabled:
                log.debug("data.mdb refuses O_DIRECT reads (%s): reading through the map", exc)
            self.enabled = False
            return None
        if got < base + size - start:
            raise OSError(errno.EIO, "the value runs past the end of data.mdb")
        return memoryview(buf)[base - start : base - start + size]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.enabled = False


def _dio_align(path: str) -> int:
    """The O_DIRECT offset and length alignment of the file at `path`, at least a page:
    statx's STATX_DIOALIGN (Linux 6.1+; 0 where it says the file has no O_DIRECT), a
    page where the kernel does not report it (a read then finds out: EINVAL)."""
    try:
        statx = ctypes.CDLL(None, use_errno=True).statx
    except (OSError, AttributeError):
        return _PAGE
    statx.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
    statx.restype = ctypes.c_int
    out = ctypes.create_string_buffer(_STATX_SIZE)
    if statx(_AT_FDCWD, os.fsencode(path), 0, _STATX_DIOALIGN, out) != 0:
        return _PAGE
    if not struct.unpack_from("<I", out.raw)[0] & _STATX_DIOALIGN:
        return _PAGE
    mem, offset = struct.unpack_from("<II", out.raw, _DIO_ALIGN_AT)
    if not offset or mem > _PAGE:  # no O_DIRECT, or buffers a map cannot align
        return 0
    return max(offset, _PAGE)


def _mincore_truthful(data_path: str) -> bool:
    """Whether mincore reports page-cache residency of data.mdb to this process: the
    kernel does for a file the caller owns or may write, or with CAP_FOWNER (root)."""
    try:
        st = os.stat(data_path)
    except OSError:
        return False
    euid = os.geteuid()
    return euid == 0 or st.st_uid == euid or os.access(data_path, os.W_OK)
