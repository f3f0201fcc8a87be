"""Where a value of a mount's read txn lies in memory, and bringing it in off the serving thread.

Owns ValuePages: whether the pages of a value a read txn returned are in memory
(a 1-byte RWF_NOWAIT read of data.mdb, or mincore where that is refused), faulting them in
from a worker thread (MADV_POPULATE_READ) and asking the kernel to read a range ahead
(MADV_WILLNEED), so a mount's serving thread never waits on the disk for a hit
(mount/reader.py). Only addresses pass through here: it never reads a value's bytes and
never writes the env.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from typing import Any

from silofs.cache.bounds import data_mapping, mdb_val_offset

_MADV_WILLNEED = 3
_MADV_POPULATE_READ = 22  # Linux 5.14+: fault the range in (readable), waiting for the IO
_PAGE = mmap.PAGESIZE
# Values up to this many pages (256 KiB) are checked whole by one mincore call.
_WHOLE_PAGES = 64


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
    """Residency of the values of a read-only env's read txns, by address.

    A hit whose pages are not in memory page-faults on whatever thread first touches
    them; on a mount's one serving thread that serialises every reader behind one disk
    read (docs/ARCHITECTURE.md, "the ceiling of one serving process"). A ValueCursor
    (bounds.py) finds a value without touching it, value_resident() tells whether its
    pages are in memory, populate() brings them in from a worker thread
    (MADV_POPULATE_READ: a fault's read-around, without the GIL), willneed() starts
    reading a range ahead.

    Only addresses pass through here, never bytes: if the env is remapped meanwhile
    (set_mapsize after the daemon grew the map), or the address read from a cursor were
    wrong, a populate or a hint lands on other pages or fails, which costs a fault later
    and can never crash or serve wrong bytes (the value itself always comes from
    py-lmdb, and the caller verifies it).

    value_resident() asks the page cache through the file: a 1-byte read with
    RWF_NOWAIT at the page's file offset (the value's address minus the mapping's start,
    from /proc/self/maps) fails with EAGAIN when the page is not cached. It costs less
    than mincore through ctypes, and works for a non-root mount of a root daemon's cache
    (data.mdb 0640), to which mincore reports every page resident (Linux 5.0+, a
    side-channel fix). Where the file refuses RWF_NOWAIT, mincore answers instead if it
    can tell (`truthful`). `enabled` is False where none of this can work: no MDB_val
    found in the cursor object (another py-lmdb), data.mdb not readable, neither probe
    usable, or no MADV_POPULATE_READ (Linux < 5.14, found on first use). Callers then
    fault a value's pages in on their own thread when they touch it.
    """

    def __init__(self, data_path: str) -> None:
        calls = _libc_calls()
        self.enabled = calls is not None and mdb_val_offset() >= 0
        self.truthful = _mincore_truthful(data_path)  # else: probe through the file
        if calls is not None:
            self._mincore, self._madvise = calls
        self._fd = -1
        self._map = (0, 0)  # [start, end) of the mapping of data.mdb, as last read
        self._byte = bytearray(1)
        self._iov = [self._byte]
        if self.enabled:
            try:
                self._fd = os.open(data_path, os.O_RDONLY | os.O_CLOEXEC)
                os.preadv(self._fd, self._iov, 0, os.RWF_NOWAIT)
            except BlockingIOError:
                pass  # page 0 not cached: the probe works
            except (OSError, AttributeError):  # no RWF_NOWAIT here (EOPNOTSUPP)
                if self._fd >= 0:
                    os.close(self._fd)
                    self._fd = -1
                self.enabled = self.truthful  # mincore is then the only way to tell
        self._vec = bytearray(0)
        self._vec_addr = 0
        self._grow(1024)

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

    def _cached(self, page: int) -> bool:
        """Whether the page at `page` is in the page cache, asked through the file."""
        start, end = self._map
        if start <= page < end:
            offset = page - start
        else:
            offset = self._offset(page)  # remapped: read the map again
            if offset is None:
                return True  # not ours to judge: let the fault path have it
        try:
            os.preadv(self._fd, self._iov, offset, os.RWF_NOWAIT)
        except BlockingIOError:
            return False
        except OSError:
            return True
        return True

    def value_resident(self, addr: int, size: int) -> bool:
        """Whether the value at `addr`, found by a ValueCursor, is in memory: for a value
        of up to _WHOLE_PAGES pages its last page, else its middle and last page.

        The lookup that found it touched its first page (bounds.py), so that one is in
        memory; if that touch had to read it, the fault read around it. Pages come in
        whole runs (a fault's read-around, a read-ahead), so the last page in memory says
        the ones between are too, short of a run ending and another beginning inside the
        value: a page missed here is faulted in on the caller's thread, and nothing else
        depends on it. Each page is asked of the page cache through the file (a 1-byte
        RWF_NOWAIT read, ~0.9 us): a mincore call through ctypes costs more in Python
        (~1.5 us for a 110 KiB value) and tells a non-root mount nothing."""
        first = addr & ~(_PAGE - 1)
        last = (addr + size - 1) & ~(_PAGE - 1)
        if last == first:
            return True
        if self._fd < 0:  # no RWF_NOWAIT: mincore, truthful here (__init__)
            if last - first < _WHOLE_PAGES * _PAGE:
                return self.resident(addr, 0, size)
            return self.resident(last, 0, 1) and self.resident(first + (last - first) // 2, 0, 1)
        if last - first < _WHOLE_PAGES * _PAGE:
            return self._cached(last)
        return self._cached(last) and self._cached((first + (last - first) // 2) & ~(_PAGE - 1))

    def populate(self, addr: int, lo: int, hi: int) -> bool:
        """Fault [addr+lo, addr+hi) in, waiting for the disk: call from a worker thread.
        Its faults read around as any fault does (the env is mapped with readahead), so
        neighbouring values come in with it. False (and disabled from now on) where the
        kernel lacks MADV_POPULATE_READ."""
        start = (addr + lo) & ~(_PAGE - 1)
        if self._madvise(start, addr + hi - start, _MADV_POPULATE_READ) == 0:
            return True
        if ctypes.get_errno() == errno.EINVAL:  # an older kernel
            self.enabled = False
        return False

    def willneed(self, addr: int, lo: int, hi: int) -> None:
        """Start reading [addr+lo, addr+hi) ahead (async in the kernel; it may block
        briefly to submit the IO, so call it from a worker thread)."""
        start = (addr + lo) & ~(_PAGE - 1)
        self._madvise(start, addr + hi - start, _MADV_WILLNEED)


def _mincore_truthful(data_path: str) -> bool:
    """Whether mincore reports page-cache residency of data.mdb to this process: the
    kernel does for a file the caller owns or may write, or with CAP_FOWNER (root)."""
    try:
        st = os.stat(data_path)
    except OSError:
        return False
    euid = os.geteuid()
    return euid == 0 or st.st_uid == euid or os.access(data_path, os.W_OK)
