"""glibc's heap in the daemon and the mounts: freed chunk buffers kept for the next ones.

Owns two malloc settings of a process and the call that hands its free heap back to the
kernel. A cold read allocates a buffer per chunk: the daemon its cache value
(node/fetch.py), freed once admission committed it; a mount its copy of the daemon's
answer (mount/reader.py), freed when its buffer drops it. By default glibc gives freed
buffers above a few MiB back to the kernel at once, and every next chunk's buffer is
faulted in and zeroed page by page afresh (56 buffers of 4 MiB: ~57,000 minor faults,
0.08-0.1 CPU-s of kernel time, every time; kept, none after the first). Never allocates
and never decides how much to keep or when to give it back: the daemon's Writer gives
it back when admission is idle, a mount keeps at most its chunk buffer's size. Elsewhere
than glibc on Linux this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Allocations above this are their own mappings, given back when freed (glibc's largest
# allowed threshold): chunk buffers up to it come from the heap and are reused.
_MMAP_THRESHOLD = 32 << 20

_libc: ctypes.CDLL | None = None


def _glibc() -> ctypes.CDLL | None:
    global _libc
    if _libc is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            libc.mallopt  # noqa: B018 - glibc's, or not glibc
            libc.malloc_trim  # noqa: B018
        except (OSError, AttributeError):
            return None
        _libc = libc
    return _libc


def keep_freed(limit: int) -> bool:
    """Keep up to `limit` bytes of freed heap in the process for reuse (and allocations
    up to _MMAP_THRESHOLD on the heap); whether glibc took the settings."""
    libc = _glibc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD))
    ok = bool(libc.mallopt(_M_TRIM_THRESHOLD, max(limit, 128 << 10))) and ok
    if not ok:
        log.info("glibc refused the heap settings: chunk buffers are faulted in afresh")
    return ok


def give_back() -> None:
    """Hand the free heap back to the kernel (ctypes releases the GIL meanwhile)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
