"""A local directory as a bucket: the embedded default that needs no cloud account.

Owns walking a directory tree into ObjectInfo (directory by directory, fanned out on
threads like an object store's prefixes: base.fan_out) and reading byte ranges with pread.
The version token is inode+mtime_ns+ctime_ns+size, checked before and after each read,
so a file rewritten after listing (even with its mtime restored) is detected.
Also decides, per object, whether a non-root peer could read it itself (check_peer_read).
Never follows a symlink out of the directory and never writes.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Iterable, Iterator

from silofs.errors import (
    AccessDeniedError,
    BackendError,
    NotFoundError,
    ObjectChangedError,
    UnreachableError,
)
from silofs.node.access import R, X, mode_allows
from silofs.node.backends.base import BackendOptions, DirPage, fan_out
from silofs.records import ObjectInfo, PrefixListed
from silofs.uri import DatasetURI

log = logging.getLogger(__name__)

# Linux's PATH_MAX, the NUL included: a longer path cannot be stat'ed or opened by name
# (ENAMETOOLONG), and the daemon names every file by its path from the root.
_PATH_MAX = 4096


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
        for item in self.list_events():
            if isinstance(item, ObjectInfo):
                yield item

    def list_events(self) -> Iterator[ObjectInfo | PrefixListed]:
        """Every file, listed directory by directory as the object stores list prefixes
        (base.fan_out, on list_workers threads): each directory is complete (a
        PrefixListed) once its entries are read, so a --list-in-background mount answers
        for it before the walk ends. scandir and lstat release the GIL, so a tree on a
        network filesystem (NFS, Lustre: a round trip per directory) lists in parallel."""
        return fan_out("", max(1, self.opts.list_workers), self._dir_pages)

    def _dir_pages(self, rel_dir: str) -> Iterator[DirPage]:
        """One directory's entries in pages of page_size (the scandir stays open between
        pages, so a directory of millions of files is never one list in memory)."""
        try:
            it = os.scandir(os.path.join(self.root, rel_dir))
        except PermissionError:
            raise AccessDeniedError(f"no permission to list {self.root}/{rel_dir}") from None
        except (FileNotFoundError, NotADirectoryError):
            yield [], [], True  # removed (or replaced) while listing
            return
        page = max(1, self.opts.page_size)
        with it:
            objects: list[ObjectInfo] = []
            subs: list[str] = []
            for entry in it:
                rel = f"{rel_dir}{entry.name}"
                if not _utf8(rel):
                    log.warning(
                        "skipping %r in %s: the name is not UTF-8, as object keys must be",
                        rel,
                        self.root,
                    )
                    continue
                if len(os.fsencode(entry.path)) >= _PATH_MAX:
                    # A tree nested past PATH_MAX (made with mkdirat): its entry.stat and
                    # scandir failed with ENAMETOOLONG, which failed the whole listing.
                    log.warning(
                        "skipping %r in %s: its path is longer than PATH_MAX (%d bytes)",
                        rel[:200] + "...",
                        self.root,
                        _PATH_MAX,
                    )
                    continue
                try:
                    if entry.is_dir(follow_symlinks=False):
                        subs.append(rel + "/")
                    elif entry.is_file(follow_symlinks=False):
                        st = entry.stat(follow_symlinks=False)
                        v = _version(st)
                        objects.append(ObjectInfo(rel, st.st_size, st.st_mtime, v, f"local:{v}"))
                except FileNotFoundError:
                    continue  # removed while listing
                if len(objects) + len(subs) >= page:
                    yield objects, subs, False
                    objects, subs = [], []
            yield objects, subs, True

    def identifies(self, info: ObjectInfo) -> bool:
        return False  # a local file is read for a member only as this node lists it

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

    # -- access as a peer (docs/SECURITY.md) ---------------------------------------
    # The daemon runs as root; a non-root peer may get only bytes it could read itself.
    # Each check walks the real path from "/" one component at a time with
    # O_PATH|O_NOFOLLOW and judges the peer's uid/gids against each fstat: no symlink
    # is followed, and what is judged is what was opened (no check-then-open race on
    # the path). get_range opens the path again, but it serves only the inode whose
    # version the listing recorded, and check_peer_read proves the peer could read that
    # same inode, so a path swapped in between yields ObjectChangedError, never bytes.
    def _walk(self, rel: str, uid: int, gids: frozenset[int], last: int) -> os.stat_result:
        fd, st, where = self._open_path(os.path.realpath(self.root), rel, uid, gids)
        try:
            if not mode_allows(*_ids(st), uid, gids, last):
                raise AccessDeniedError(f"uid {uid} may not read {where}")
            _refuse_acl(fd, where)
            return st
        finally:
            os.close(fd)

    def check_peer_read(self, info: ObjectInfo, uid: int, gids: frozenset[int]) -> None:
        """AccessDeniedError unless uid/gids may read the listed object itself: search on
        every directory from "/", read on the file, no symlink, no POSIX ACL."""
        st = self._walk(info.key, uid, gids, R)
        if not stat.S_ISREG(st.st_mode) or _version(st) != info.version:
            raise ObjectChangedError(f"{self.uri}{info.key} changed since listing")

    def check_peer_read_many(
        self, infos: Iterable[ObjectInfo], uid: int, gids: frozenset[int]
    ) -> dict[str, BackendError | OSError]:
        """check_peer_read of many objects (a warm's plan): the error of each one uid/gids
        may not read, by key. Each directory is walked from "/" once, not once per file:
        its O_PATH fd, judged as _walk judges it (search on every directory, itself
        included, no symlink, no ACL), stays open while its files are opened through it
        with openat and judged (no symlink, read, no ACL, the listed version). The same
        inodes are judged as by one walk per object, and no path is resolved twice, so
        the check is as strict; a million files in 1,000 directories cost a million
        openat+fstat+getxattr instead of a walk of every path (measured: docs/RESULTS.md)."""
        by_dir: dict[str, list[ObjectInfo]] = {}
        for info in infos:
            by_dir.setdefault(info.key.rpartition("/")[0], []).append(info)
        real_root = os.path.realpath(self.root)
        bad: dict[str, BackendError | OSError] = {}
        for rel_dir, files in by_dir.items():
            try:
                fd, st, where = self._open_path(real_root, rel_dir, uid, gids)
            except (BackendError, OSError) as exc:
                bad.update((info.key, exc) for info in files)
                continue
            try:
                # What every file here needs of its directory, judged once.
                if not (stat.S_ISDIR(st.st_mode) and mode_allows(*_ids(st), uid, gids, X)):
                    raise AccessDeniedError(f"uid {uid} may not search {where}")
                _refuse_acl(fd, where)
            except (BackendError, OSError) as exc:
                os.close(fd)
                bad.update((info.key, exc) for info in files)
                continue
            try:
                for info in files:
                    try:
                        self._judge_file(fd, where, info, uid, gids)
                    except (BackendError, OSError) as exc:
                        bad[info.key] = exc
            finally:
                os.close(fd)
        return bad

    def _open_path(
        self, real_root: str, rel: str, uid: int, gids: frozenset[int]
    ) -> tuple[int, os.stat_result, str]:
        """(O_PATH fd, fstat, path) of root/rel, reached from "/" one component at a
        time with openat(O_NOFOLLOW): every directory on the way searchable by uid/gids
        and without an ACL, no component a symlink. What rel itself must allow is the
        caller's to judge (read for a file, read+search for a directory to list)."""
        names = [n for n in real_root.split("/") + rel.split("/") if n]
        fd = os.open("/", os.O_PATH | os.O_DIRECTORY)
        try:
            st = os.fstat(fd)
            where = "/"
            for name in names:
                if not (stat.S_ISDIR(st.st_mode) and mode_allows(*_ids(st), uid, gids, X)):
                    raise AccessDeniedError(f"uid {uid} may not search {where}")
                _refuse_acl(fd, where)
                try:
                    nfd = os.open(name, os.O_PATH | os.O_NOFOLLOW, dir_fd=fd)
                except FileNotFoundError:
                    raise ObjectChangedError(f"{self.uri}{rel} was deleted since listing") from None
                os.close(fd)
                fd, where = nfd, os.path.join(where, name)
                st = os.fstat(fd)
                if stat.S_ISLNK(st.st_mode):
                    raise AccessDeniedError(
                        f"{where} is a symbolic link: not followed for uid {uid}"
                    )
            return fd, st, where
        except BaseException:
            os.close(fd)
            raise

    def _judge_file(
        self, dir_fd: int, dir_where: str, info: ObjectInfo, uid: int, gids: frozenset[int]
    ) -> None:
        """check_peer_read's last step, in a directory already judged searchable."""
        name = info.key.rpartition("/")[2]
        try:
            fd = os.open(name, os.O_PATH | os.O_NOFOLLOW, dir_fd=dir_fd)
        except FileNotFoundError:
            raise ObjectChangedError(f"{self.uri}{info.key} was deleted since listing") from None
        try:
            where = os.path.join(dir_where, name)
            st = os.fstat(fd)
            if stat.S_ISLNK(st.st_mode):
                raise AccessDeniedError(f"{where} is a symbolic link: not followed for uid {uid}")
            if not mode_allows(*_ids(st), uid, gids, R):
                raise AccessDeniedError(f"uid {uid} may not read {where}")
            _refuse_acl(fd, where)
        finally:
            os.close(fd)
        if not stat.S_ISREG(st.st_mode) or _version(st) != info.version:
            raise ObjectChangedError(f"{self.uri}{info.key} changed since listing")

    def check_peer_list(self, uid: int, gids: frozenset[int], *, tree: bool) -> None:
        """AccessDeniedError unless uid/gids may list the dataset root (search on its
        ancestors, read+search on it) and, with `tree`, every directory under it: a
        mount shows the names of the whole listing, so it must show only names the
        peer could list itself."""
        self._walk("", uid, gids, R | X)
        if not tree:
            return
        stack = [""]
        while stack:
            rel_dir = stack.pop()
            try:
                entries = list(os.scandir(os.path.join(self.root, rel_dir)))
            except FileNotFoundError:
                continue
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    rel = f"{rel_dir}{entry.name}/"
                    st = entry.stat(follow_symlinks=False)
                    if not mode_allows(*_ids(st), uid, gids, R | X):
                        raise AccessDeniedError(f"uid {uid} may not list {self.root}/{rel}")
                    stack.append(rel)


def _ids(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_mode, st.st_uid, st.st_gid


def _refuse_acl(fd: int, where: str) -> None:
    """Mode bits are all the explicit check reads; a POSIX ACL could deny what they
    allow, so a path with one is refused to non-root peers (fail closed)."""
    try:
        os.getxattr(f"/proc/self/fd/{fd}", "system.posix_acl_access")
    except OSError:
        return  # ENODATA: no ACL; ENOTSUP: a filesystem without ACLs
    raise AccessDeniedError(f"{where} has a POSIX ACL: silofs serves it to root and admins only")
