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
read-only mapping of a received descriptor; and a connection's hand-off region (Region):
one sealed memory file per mount connection that peer-served chunks are received into
and named from, passed and mapped once. Never decides who may receive a descriptor
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
# The reply header naming a chunk's data in its connection's hand-off region (Region):
# "OFFSET LENGTH"; the region's descriptor rides with the first such reply's head only.
REGION_HEADER = "x-silofs-region"

# Hand-off regions' bytes at once, at most (Region: one per trusted mount connection
# that was handed a peer-served chunk, alive as long as it): beyond this a connection's
# chunks come as bytes. 128 MiB is 32 connections' regions at the default 4 MiB chunk.
MAX_REGION_BYTES = 128 << 20

_lock = threading.Lock()
_live = 0
_live_bytes = 0
_region_bytes = 0


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


class Region:
    """One connection's hand-off region (a peer-served chunk's answer to its mount): a
    memory file the daemon keeps writable and maps once, sealed against every change by
    others (F_SEAL_FUTURE_WRITE) before its descriptor leaves, passed once with the
    first answer that names it, mapped once by the mount. Each peer-served chunk is
    received into it (decrypted straight from TLS) and checked there, and the answer
    names only where its data lies: no copy into the daemon's socket, none out of the
    mount's, no memory file per chunk (bench/peer_handoff.py).

    The invariant that makes reuse safe is the connection's: one request at a time. The
    daemon writes the region only while it answers a request of this connection, and
    the mount copies what an answer names out of it before that answer's request ends
    (control/client.py), i.e. before it may send the connection's next request. Nothing
    else of the daemon may keep a view of it past the answer (node/peer_ask.py copies
    for the loop's waiters). Its file is dropped with the connection (close()); a
    mount that keeps its mapping keeps only those pages, so only a peer the daemon
    trusts gets a region (as for FD_HEADER)."""

    def __init__(self) -> None:
        self.value: SealedValue | None = None
        self.sent = False  # its descriptor went out with an answer on this connection
        self.filled = 0  # the bytes of the last view() handed out

    @staticmethod
    def usable() -> bool:
        """Whether the kernel keeps the daemon's writable mapping of a sealed file
        while refusing everyone else's (_keeps_map): else no region, bytes instead."""
        return hasattr(os, "memfd_create") and _keeps_map()

    def view(self, size: int, least: int = 0) -> memoryview | None:
        """A writable view of the region's first `size` bytes, the region made (or made
        anew, larger: of at least `least` bytes, so a connection's values of one chunk
        size need one region, whatever the first one's length) first; None if no
        memory file can be had (the caller uses a buffer of its own)."""
        value = self.value
        if value is None or len(value) < size:
            size_made = max(size, least)
            self.close()
            if _live >= MAX_LIVE or not _take_region_bytes(size_made):
                return None
            try:
                fd = os.memfd_create("silofs-region", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            except OSError as exc:  # EMFILE
                log.debug("no hand-off region (%s): bytes instead", exc)
                _give_region_bytes(size_made)
                return None
            try:
                os.ftruncate(fd, size_made)
            except BaseException:
                os.close(fd)
                _give_region_bytes(size_made)
                raise
            try:
                value = _map(fd, size_made, mmap.PROT_READ | mmap.PROT_WRITE)  # owns fd
            except BaseException:  # fd closed by _map
                _give_region_bytes(size_made)
                raise
            weakref.finalize(value, _give_region_bytes, size_made)
            # Sealed before its descriptor can leave: this mapping stays writable,
            # no other (the mount's included) can be made so.
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, FUTURE_SEALS)
            self.value, self.sent = value, False
        self.filled = size
        return memoryview(value)[:size]

    def where(self, data: memoryview) -> str | None:
        """REGION_HEADER's value for `data`, the tail of the last view() (a chunk
        value's data part); None if `data` is not that."""
        value = self.value
        if value is None or data.obj is not value or data.nbytes > self.filled:
            return None
        return f"{self.filled - data.nbytes} {data.nbytes}"

    def close(self) -> None:
        """Drop the region (its file goes once no view of it is left)."""
        value, self.value, self.sent, self.filled = self.value, None, False, 0
        if value is not None:
            try:
                value.close()
            except BufferError:  # a view is alive still: the finalizer closes it
                pass


def _take_region_bytes(size: int) -> bool:
    global _region_bytes
    with _lock:
        if _region_bytes + size > MAX_REGION_BYTES:
            return False
        _region_bytes += size
        return True


def _give_region_bytes(size: int) -> None:
    global _region_bytes
    with _lock:
        _region_bytes -= size


def region_bytes() -> int:
    """The bytes of the hand-off regions alive now (at most MAX_REGION_BYTES)."""
    with _lock:
        return _region_bytes


def map_region(fd: int) -> mmap.mmap:
    """A received hand-off region (Region), mapped read-only; the descriptor is closed.
    ValueError if the file is not sealed against change by others."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if seals & SEALS != SEALS and seals & FUTURE_SEALS != FUTURE_SEALS:
            raise ValueError("the daemon's hand-off region is not sealed against change")
        size = os.fstat(fd).st_size
        if size == 0:
            raise ValueError("an empty hand-off region")
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


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
