"""A directory read as C programs read it: libc's opendir/readdir/telldir/seekdir, for
tests of what os.listdir and os.scandir hide ('.' and '..', offsets a program saves
with telldir and comes back to with seekdir). Test support only; Linux, glibc.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest


class _Dirent(ctypes.Structure):  # glibc's struct dirent on 64-bit Linux
    _fields_ = [
        ("d_ino", ctypes.c_uint64),
        ("d_off", ctypes.c_int64),
        ("d_reclen", ctypes.c_ushort),
        ("d_type", ctypes.c_ubyte),
        ("d_name", ctypes.c_char * 256),
    ]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.opendir.restype = ctypes.c_void_p
_libc.opendir.argtypes = [ctypes.c_char_p]
_libc.readdir.restype = ctypes.POINTER(_Dirent)
_libc.readdir.argtypes = [ctypes.c_void_p]
_libc.telldir.restype = ctypes.c_long
_libc.telldir.argtypes = [ctypes.c_void_p]
_libc.seekdir.restype = None
_libc.seekdir.argtypes = [ctypes.c_void_p, ctypes.c_long]
_libc.closedir.argtypes = [ctypes.c_void_p]

DT_DIR = 4


@dataclass(frozen=True)
class Dirent:
    name: str
    ino: int
    is_dir: bool


class DirStream:
    """An open DIR*: next() is readdir (None at the end), tell()/seek() telldir/seekdir."""

    def __init__(self, path: str | Path) -> None:
        self._dir = _libc.opendir(os.fsencode(path))
        if not self._dir:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(path))

    def next(self) -> Dirent | None:
        ctypes.set_errno(0)
        p = _libc.readdir(self._dir)
        if not p:
            if err := ctypes.get_errno():
                raise OSError(err, os.strerror(err))
            return None
        d = p.contents
        return Dirent(os.fsdecode(d.d_name), d.d_ino, d.d_type == DT_DIR)

    def tell(self) -> int:
        return _libc.telldir(self._dir)

    def seek(self, pos: int) -> None:
        _libc.seekdir(self._dir, pos)

    def close(self) -> None:
        if self._dir:
            _libc.closedir(self._dir)
            self._dir = None

    def __enter__(self) -> DirStream:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def read_all(path: str | Path) -> list[Dirent]:
    """Every entry of `path` in readdir's order, '.' and '..' included."""
    out = []
    with DirStream(path) as d:
        while (e := d.next()) is not None:
            out.append(e)
    return out


# getdents64's syscall number by architecture (platform.machine()): x86_64's own
# table, the generic one (asm-generic/unistd.h) of aarch64, riscv64 and loongarch64,
# powerpc's and s390's. Elsewhere None: tests using getdents() skip (needs_getdents).
GETDENTS64: int | None = {
    "x86_64": 217,
    "aarch64": 61,
    "arm64": 61,
    "riscv64": 61,
    "loongarch64": 61,
    "ppc64le": 202,
    "ppc64": 202,
    "s390x": 220,
}.get(platform.machine())
needs_getdents = pytest.mark.skipif(
    GETDENTS64 is None,
    reason=f"getdents64's syscall number on {platform.machine()} is not known to "
    "tests/support/dirstream.py (add it to GETDENTS64)",
)


def getdents(path: str | Path, buffer_size: int) -> list[tuple[str, int]]:
    """Every (name, d_off) of `path` read with getdents64 into a buffer of `buffer_size`
    bytes, as a program with its own small buffer reads a directory (glibc's readdir
    uses 32 KiB). Test support only; the architectures in GETDENTS64 (needs_getdents)."""
    if GETDENTS64 is None:
        raise NotImplementedError(f"getdents64 on {platform.machine()}: see GETDENTS64")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    buf = ctypes.create_string_buffer(buffer_size)
    out = []
    try:
        while True:
            n = _libc.syscall(GETDENTS64, fd, buf, ctypes.c_size_t(buffer_size))
            if n < 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err), str(path))
            if n == 0:
                return out
            raw, p = buf.raw, 0
            while p < n:
                # struct linux_dirent64: u64 ino, s64 off, u16 reclen, u8 type, name
                off = int.from_bytes(raw[p + 8 : p + 16], sys.byteorder, signed=True)
                reclen = int.from_bytes(raw[p + 16 : p + 18], sys.byteorder)
                name = raw[p + 19 : p + reclen].split(b"\0", 1)[0]
                out.append((os.fsdecode(name), off))
                p += reclen
    finally:
        os.close(fd)
