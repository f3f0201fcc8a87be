"""Chunk values in sealed memory files: a cold chunk handed from the daemon to a mount on
the same host by descriptor, not by its bytes over the socket.

The daemon receives a streamed chunk from the store into a value built in a memory file
of its own (memfd), then seals the file against every change (writes, shrinking,
growing, new seals) before any other process can hold it; the value is what it admits
to LMDB and what its reply names. A mount that asked for it gets the descriptor with the
reply's head (SCM_RIGHTS) and maps the file read-only: the chunk's bytes are copied
neither into the daemon's socket nor out of the mount's, and the mount's reply to FUSE
reads them from the shared pages. The seal is what keeps the sharing safe: the mount
cannot change a byte the daemon checksums, admits or serves to any other reader.

Owns the buffer a streamed value is built in (a memory file for a big one, at most
MAX_LIVE at once, each holding two descriptors while it lives; else the heap), sealing
it, telling whether a reply's data is all of one, and a mount's
read-only mapping of a received descriptor. Never decides who may receive a descriptor
(the chunk route does: the same peer checks as for the bytes, and only a peer the
daemon trusts, since the pages stay charged to the daemon while the receiver holds
them), and never writes a value once it is sealed.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import threading
import weakref

log = logging.getLogger(__name__)

# Every change of the file refused: shrinking (which would fault the daemon's mapping),
# growing, new seals, and writes: write(2) and writable shared mappings for
# F_SEAL_WRITE, which needs the daemon's own writable mapping gone first; new ones only
# for F_SEAL_FUTURE_WRITE (linux/fcntl.h; Python's fcntl does not name it), which keeps
# it, where the kernel also refuses to make a read-only mapping writable (_keeps_map).
_F_SEAL_FUTURE_WRITE = 0x10
_FIXED = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
SEALS = _FIXED | fcntl.F_SEAL_WRITE
FUTURE_SEALS = _FIXED | _F_SEAL_FUTURE_WRITE
# Mappings of memory files at once (each holds one descriptor of ours and one of its
# own), at most: beyond this a value is built on the heap and its reply carries its
# bytes. 256 covers the admission queue's default 256 MiB of 1 MiB chunks; a lower
# open-files limit lowers it (limit_live).
MAX_LIVE = 256
# A value smaller than this is built on the heap: its bytes cost less to send than the
# descriptor's setup (memfd_create, ftruncate, two mappings) and the mount's mapping.
MIN_BYTES = 512 << 10
# The reply header naming the descriptor that came with the head: "OFFSET LENGTH" of the
# chunk's data in the file.
FD_HEADER = "x-silofs-fd"

_lock = threading.Lock()
_live = 0
_live_bytes = 0


class SealedValue(mmap.mmap):
    """A chunk value in a memory file: writable by the daemon until seal(), then a
    read-only mapping of the sealed file. `fd` stays open (for replies) while it lives;
    `data_len` (once sealed) is the length of the chunk's data, the value's tail."""

    fd: int
    data_len: int = -1

    def fileno(self) -> int:
        return self.fd


def limit_live(nofile: int) -> None:
    """At most a sixteenth of the process's open-files limit `nofile` held by values."""
    global MAX_LIVE
    MAX_LIVE = max(0, min(MAX_LIVE, nofile // 32))


def live() -> dict[str, int]:
    """The values alive in memory files now, their bytes, and the most at once."""
    with _lock:
        return {"count": _live, "bytes": _live_bytes, "max": MAX_LIVE}


def fds_held() -> int:
    """The most descriptors values may hold at once."""
    return 2 * MAX_LIVE


def _forget(fd: int, size: int) -> None:
    global _live, _live_bytes
    os.close(fd)
    with _lock:
        _live -= 1
        _live_bytes -= size


def _map(fd: int, size: int, prot: int) -> SealedValue:
    """A shared mapping of the file, its pages mapped at once (no fault per page), that
    owns `fd` from here on (closed when the mapping is collected)."""
    global _live, _live_bytes
    try:
        value = SealedValue(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=prot)
    except BaseException:
        os.close(fd)
        raise
    with _lock:
        _live += 1
        _live_bytes += size
    value.fd = fd
    weakref.finalize(value, _forget, fd, size)
    return value


def buffer(size: int) -> bytearray | SealedValue:
    """A writable buffer for a value of `size` bytes, filled whole before it is read:
    in a fresh memory file if the value is big enough to be worth one and fewer than
    MAX_LIVE are alive, else on the heap (silofs/heap.py, not zeroed)."""
    from silofs import heap  # ctypes: not for a client that only maps values

    if size < MIN_BYTES or _live >= MAX_LIVE or not hasattr(os, "memfd_create"):
        return heap.uninitialized(size)
    try:
        fd = os.memfd_create("silofs-chunk", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:  # EMFILE, or a kernel without memfd
        log.debug("no memory file for a chunk (%s): built on the heap", exc)
        return heap.uninitialized(size)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return _map(fd, size, mmap.PROT_READ | mmap.PROT_WRITE)


def seal(value: SealedValue, data_len: int) -> SealedValue:
    """`value`, filled, sealed against every change. Where the kernel's
    F_SEAL_FUTURE_WRITE holds (_keeps_map), `value` itself, the daemon's own mapping
    kept (closing it and mapping the file again cost ~15% of the daemon's CPU in a cold
    read); else its writable mapping is closed, the file sealed with F_SEAL_WRITE, and a
    read-only mapping of it takes its place: nothing may hold a view of `value` then
    (BufferError, and nothing is sealed: the caller keeps `value`)."""
    if _keeps_map():
        fcntl.fcntl(value.fd, fcntl.F_ADD_SEALS, FUTURE_SEALS)
        value.data_len = data_len
        return value
    fd = os.dup(value.fd)  # the sealed mapping's own: `value`'s closes with `value`
    try:
        value.close()  # BufferError while a view of it is held
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)  # no writable mapping is left: may seal
    except BaseException:
        os.close(fd)
        raise
    sealed = _map(fd, os.fstat(fd).st_size, mmap.PROT_READ)
    sealed.data_len = data_len
    return sealed


_KEEPS_MAP: bool | None = None


def _keeps_map() -> bool:
    """Whether F_SEAL_FUTURE_WRITE holds here: a sealed file's read-only shared mapping
    cannot be made writable (kernels that clear VM_MAYWRITE for it; older ones let
    mprotect add write access), nor a writable one made. Tried once on a scratch file."""
    global _KEEPS_MAP
    if _KEEPS_MAP is None:
        try:
            _KEEPS_MAP = _try_future_write()
        except OSError as exc:
            log.debug("F_SEAL_FUTURE_WRITE not usable (%s): sealing with F_SEAL_WRITE", exc)
            _KEEPS_MAP = False
    return _KEEPS_MAP


def _try_future_write() -> bool:
    import ctypes  # the daemon's: not for a client that only maps values

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
    fd = os.memfd_create("silofs-probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, mmap.PAGESIZE)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, FUTURE_SEALS)
        try:
            mmap.mmap(fd, mmap.PAGESIZE, flags=mmap.MAP_SHARED).close()  # writable
            return False
        except PermissionError:
            pass
        addr = libc.mmap(None, mmap.PAGESIZE, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return False
        try:
            rw = mmap.PROT_READ | mmap.PROT_WRITE
            return bool(libc.mprotect(ctypes.c_void_p(addr), mmap.PAGESIZE, rw) != 0)
        finally:
            libc.munmap(ctypes.c_void_p(addr), mmap.PAGESIZE)
    finally:
        os.close(fd)


def passable(data: object) -> tuple[SealedValue, int] | None:
    """(the sealed value, the offset of `data` in it) if `data` is the chunk data of a
    sealed value, else None. The daemon's only views of a sealed value are of its whole
    data part (node/fetch.py), so a view of its length is that one."""
    obj = getattr(data, "obj", None)
    if not isinstance(obj, SealedValue) or obj.data_len <= 0 or obj.closed:
        return None
    assert isinstance(data, memoryview)
    if data.nbytes != obj.data_len:
        return None
    return obj, len(obj) - obj.data_len


def map_received(fd: int, where: str) -> memoryview:
    """The chunk data a reply's descriptor names (`where`: the FD_HEADER value), mapped
    read-only; the descriptor is closed. ValueError if the file is not sealed against
    change or `where` is not inside it."""
    try:
        offset_text, _, length_text = where.partition(" ")
        if not (offset_text.isdigit() and length_text.isdigit()):
            raise ValueError(f"a bad {FD_HEADER} header: {where[:40]!r}")
        offset, length = int(offset_text), int(length_text)
        size = os.fstat(fd).st_size
        if length == 0 or offset + length > size:
            raise ValueError(f"{FD_HEADER} {where!r} is outside a file of {size} bytes")
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if seals & SEALS != SEALS and seals & FUTURE_SEALS != FUTURE_SEALS:
            raise ValueError("the daemon's chunk file is not sealed against change")
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
    finally:
        os.close(fd)  # the mapping holds the file
    return memoryview(mapped)[offset : offset + length]
