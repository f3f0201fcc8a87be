"""The page cache of a test's LMDB env as tests see it: how many pages of a file are
cached (mincore on a map nothing touches) and evicting data.mdb's pages until none is
left. Test support only; the mount's own residency checks are mount/pages.py's.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time


def cached_pages(fd: int) -> int | None:
    """How many pages of the file behind `fd` are in the page cache, by mincore on a map
    of it that nothing touches (mapping does not fault pages in); None where the kernel
    will not tell (it reports the page cache only to a file's owner or writer, or root)."""
    size = os.fstat(fd).st_size
    if size == 0:
        return 0
    if os.geteuid() != 0 and os.fstat(fd).st_uid != os.geteuid():
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
        if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec):
            return None
        return sum(b & 1 for b in vec)
    finally:
        libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))


def drop_unmapped_pages(env: str) -> None:
    """Evict all of data.mdb's pages from the page cache, as drop_caches does to a cache
    a fresh mount has not touched yet: for a test whose process maps none of it yet
    (mapped pages stay, and it would wait for them until its deadline). One
    fadvise is not always enough on a busy host (pages still in a CPU's LRU batch or
    under writeback are skipped): evict until none is left, polled with a deadline."""
    fd = os.open(os.path.join(env, "data.mdb"), os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages are not evicted
        deadline = time.monotonic() + 10
        while True:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            left = cached_pages(fd)
            if not left:  # none left, or the kernel will not say: as evicted as it gets
                return
            assert time.monotonic() < deadline, f"{left} pages of data.mdb stayed cached"
            os.fsync(fd)
    finally:
        os.close(fd)
