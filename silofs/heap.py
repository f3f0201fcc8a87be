"""glibc's heap in the daemon and the mounts: freed chunk buffers kept for the next ones.

Owns two malloc settings of a process and the call that hands its free heap back to the
kernel. A cold read allocates a buffer per chunk: the daemon its cache value
(node/fetch.py), freed once admission committed it; a mount its copy of the daemon's
answer (mount/reader.py), freed when its buffer drops it (a big streamed chunk is a
memory file instead on both sides: silofs/sealed.py). By default glibc gives freed
buffers above a few MiB back to the kernel at once, and every next chunk's buffer is
faulted in and zeroed page by page afresh (56 buffers of 4 MiB: ~57,000 minor faults,
0.08-0.1 CPU-s of kernel time, every time; kept, none after the first). Never decides
how much to keep or when to give it back: the daemon's Writer gives
it back when admission is idle, a mount keeps at most its chunk buffer's size. Elsewhere
than glibc on Linux this does nothing.

Also hands out buffers without zeroing them (uninitialized): bytearray(n) writes n
zero bytes that a chunk's receive then overwrites, a second pass over every byte of a
cold read in the daemon and in the mount. Such a buffer holds whatever the heap held
before, bytes of earlier chunks of this process: it is for buffers filled whole before
any byte of them is read or handed on, and dropped if the fill fails.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Allocations above this are their own mappings, given back when freed (glibc's largest
# allowed threshold): chunk buffers up to it come from the heap and are reused.
_MMAP_THRESHOLD = 32 << 20

_libc: ctypes.CDLL | None = None


def _raw_bytearray() -> Callable[[None, int], bytearray] | None:
    """CPython's PyByteArray_FromStringAndSize, which with no source leaves the bytes as
    malloc gave them; None on an interpreter without it."""
    try:
        fn = ctypes.pythonapi.PyByteArray_FromStringAndSize
    except AttributeError:
        return None
    fn.restype = ctypes.py_object
    fn.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
    return fn  # type: ignore[no-any-return]


_raw = _raw_bytearray()
# Below this a zeroed bytearray costs less than the foreign call.
_RAW_MIN = 64 << 10


def uninitialized(n: int) -> bytearray:
    """A bytearray of n bytes left as the heap held them (module docstring): only for a
    buffer the caller fills whole before any of it is read or leaves this process."""
    if _raw is None or n < _RAW_MIN:
        return bytearray(n)
    return _raw(None, n)


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
