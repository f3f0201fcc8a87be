"""A local directory as a bucket: the embedded default that needs no cloud account.

Owns walking a directory tree into ObjectInfo and reading byte ranges with pread.
The version token is inode+mtime_ns+ctime_ns+size, checked before and after each read,
so a file rewritten after listing (even with its mtime restored) is detected.
Never follows a symlink out of the directory and never writes.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterator

from silofs.errors import AccessDeniedError, NotFoundError, ObjectChangedError, UnreachableError
from silofs.node.backends.base import BackendOptions
from silofs.records import ObjectInfo
from silofs.uri import DatasetURI

log = logging.getLogger(__name__)


def _utf8(name: str) -> bool:
    try:
        name.encode()
    except UnicodeEncodeError:  # surrogate-escaped bytes from a non-UTF-8 file name
        return False
    return True


def _version(st: os.stat_result) -> str:
    # The inode catches a file replaced by rename with the same size and mtime (cp -p,
    # rsync -t); ctime catches a rewrite in place that restored the mtime (os.utime,
    # touch -d): no user can set ctime. The price: chmod/chown/link also change ctime,
    # so they read as a change (EIO for open files until a refresh), never as old bytes.
    return f"{st.st_ino}-{st.st_mtime_ns}-{st.st_ctime_ns}-{st.st_size}"


class LocalBackend:
    def __init__(self, uri: DatasetURI, opts: BackendOptions) -> None:
        self.root = uri.bucket
        self.uri = uri.canonical
        self.opts = opts

    def check(self) -> None:
        try:
            st = os.stat(self.root)
        except FileNotFoundError:
            raise NotFoundError(f"directory {self.root} does not exist") from None
        except PermissionError:
            raise AccessDeniedError(f"no permission to read {self.root}") from None
        if not os.path.isdir(self.root):
            raise NotFoundError(f"{self.root} is not a directory")
        if not os.access(self.root, os.R_OK | os.X_OK):
            raise AccessDeniedError(f"no permission to list {self.root}")
        del st

    def list(self) -> Iterator[ObjectInfo]:
        stack = [""]
        while stack:
            rel_dir = stack.pop()
            try:
                entries = list(os.scandir(os.path.join(self.root, rel_dir)))
            except PermissionError:
                raise AccessDeniedError(f"no permission to list {self.root}/{rel_dir}") from None
            except FileNotFoundError:
                continue  # removed while listing
            for entry in entries:
                rel = f"{rel_dir}{entry.name}"
                if not _utf8(rel):
                    log.warning(
                        "skipping %r in %s: the name is not UTF-8, as object keys must be",
                        rel,
                        self.root,
                    )
                    continue
                if entry.is_dir(follow_symlinks=False):
                    stack.append(rel + "/")
                elif entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    v = _version(st)
                    yield ObjectInfo(rel, st.st_size, st.st_mtime, v, f"local:{v}")

    def get_range(self, info: ObjectInfo, start: int, length: int) -> bytes:
        # As every backend: clamped to the listed size, then exactly that many bytes.
        length = max(0, min(length, info.size - start))
        path = os.path.join(self.root, info.key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise ObjectChangedError(f"{self.uri}{info.key} was deleted since listing") from None
        except PermissionError:
            raise AccessDeniedError(f"no permission to read {path}") from None
        except OSError as exc:
            raise UnreachableError(f"cannot open {path}: {exc.strerror}") from None
        try:
            if _version(os.fstat(fd)) != info.version:
                raise ObjectChangedError(f"{self.uri}{info.key} changed since listing")
            try:
                data = os.pread(fd, length, start)
            except OSError as exc:
                if exc.errno == errno.EIO:
                    raise UnreachableError(f"I/O error reading {path}") from None
                raise
            if len(data) != length:  # shorter than listed, with the same version
                raise ObjectChangedError(f"{self.uri}{info.key} changed since listing")
            # A rewrite racing the pread: the bytes read may mix versions, so check again.
            if _version(os.fstat(fd)) != info.version:
                raise ObjectChangedError(f"{self.uri}{info.key} changed while being read")
            return data
        finally:
            os.close(fd)

    def close(self) -> None:
        pass
