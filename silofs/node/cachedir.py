"""The cache directory: its checks, its size budget, its lock and its permissions.

Owns creating and checking cache_dir, choosing the cache budget against the disk, the
daemon's lock on the directory (one daemon per cache dir), moving a damaged env aside,
and the modes of the directory and the LMDB files (docs/SECURITY.md). Never opens LMDB
(node/store_write.py does).
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import time

from silofs.config import NodeSettings
from silofs.control.server import untrusted_ancestor
from silofs.errors import UsageError
from silofs.units import format_size

log = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 10 << 30
# The least free space a new cache is made in. LMDB writes a new env's lock.mdb (its
# reader table, 64 KiB) through a shared map: where the disk has no block for a page,
# the first touch of it ends the process with SIGBUS ("Fatal Python error: Bus error"
# at start, on a full disk with the default cache size, which no size check stopped).
NEW_CACHE_ROOM = 1 << 20


def resolve_cache_size(settings: NodeSettings) -> int:
    """The cache budget: the setting, checked against the disk, or a safe default.
    UsageError (one line) where the disk has no room for a new cache, or for the size
    asked (the default: for one chunk)."""
    os.makedirs(settings.cache_dir, exist_ok=True)
    room = disk_free(settings.cache_dir)
    free = room + _existing_env_bytes(settings.cache_dir)
    new = not os.path.exists(os.path.join(settings.cache_dir, "lock.mdb"))
    if (new and room < NEW_CACHE_ROOM) or (
        settings.cache_size is None and free < settings.chunk_size
    ):
        raise UsageError(
            f"cache dir {settings.cache_dir} has {format_size(room)} free, no room for a "
            f"cache: free some space on its disk or choose another --cache-dir"
        )
    if settings.cache_size is None:
        return max(settings.chunk_size, min(DEFAULT_CACHE_SIZE, free // 2))
    if settings.cache_size > free:
        raise UsageError(
            f"cache size {format_size(settings.cache_size)} is larger than the "
            f"space on {settings.cache_dir} ({format_size(free)} free): "
            "choose a smaller --cache-size"
        )
    return settings.cache_size


def disk_free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _existing_env_bytes(cache_dir: str) -> int:
    try:
        return os.stat(os.path.join(cache_dir, "data.mdb")).st_blocks * 512
    except FileNotFoundError:
        return 0


def secure_cache_dir(cache_dir: str, gid: int | None) -> None:
    """Set the modes docs/SECURITY.md promises, on a new cache and an existing one.

    Without socket_group: directory 0700, data.mdb and lock.mdb 0600, so cached bytes
    (some of them root-only files) reach others only through the daemon's checks. With
    socket_group: its members run mount processes, which read the env directly and need
    write access to the lock file: 0750 / 0640 / 0660, group socket_group. Called before
    the env is opened (the directory mode shuts out new opens of files LMDB creates with
    the umask) and again after (the files it just created).
    """
    data, lock = os.path.join(cache_dir, "data.mdb"), os.path.join(cache_dir, "lock.mdb")
    modes = (0o700, 0o600, 0o600) if gid is None else (0o750, 0o640, 0o660)
    for path, mode in zip((cache_dir, data, lock), modes, strict=True):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):  # a root daemon would chmod or write the target
            raise UsageError(f"{path} is a symbolic link: refusing to use it as the cache")
        if gid is not None and st.st_gid != gid:
            os.chown(path, -1, gid, follow_symlinks=False)
        if stat.S_IMODE(st.st_mode) != mode:
            os.chmod(path, mode, follow_symlinks=False)


def check_cache_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create cache dir {path}: {exc.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"cache dir {path} is not writable: choose another --cache-dir")
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.geteuid():
        # Its owner could swap data.mdb for a link and have us write where they choose.
        raise UsageError(
            f"cache dir {path} is not owned by uid {os.geteuid()} (the daemon's): "
            "choose another --cache-dir"
        )
    _check_ancestors(path)


def _check_ancestors(path: str) -> None:
    """UsageError unless no one but the daemon's uid and root controls a directory on the
    way to the cache dir (untrusted_ancestor, the socket directory's rule): else whoever
    may rename in one could move the cache dir away and put one of their own in its
    place, and every mount started after reads its env (listings and chunks) by path."""
    reason = untrusted_ancestor(os.path.dirname(os.path.realpath(path)))
    if reason is not None:
        raise UsageError(f"cache dir {path}: {reason}: choose another --cache-dir")


LOCK_FILE = "daemon.lock"


def lock_cache_dir(path: str) -> int:
    """Take the cache dir's daemon lock (flock on cache_dir/daemon.lock) and return its fd.

    The fd is held for the life of the daemon and the kernel drops the lock when the
    process ends, however it ends (kill -9 included), so a stale lock cannot exist. Two
    daemons writing one env would each keep their own usage rows in memory and write
    them back: the second refuses to start instead. Mount processes never take it."""
    lock_path = os.path.join(path, LOCK_FILE)
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:  # a full disk or file system out of inodes, read-only
        raise UsageError(
            f"cache dir {path}: cannot create its lock file {LOCK_FILE}: {exc.strerror or exc}"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        finally:
            os.close(fd)
        who = f" (pid {holder})" if holder.isdigit() else ""
        raise UsageError(
            f"another silofs daemon{who} is using cache dir {path}: "
            "stop it or choose another --cache-dir"
        ) from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:
        # A full disk (ENOSPC: a traceback at start, before). The flock holds without
        # it: the pid only names the holder to a second daemon. Whether the cache fits
        # is the size check's to say, in one line (so no second line here); a cache
        # that fits serves its hits on a full disk (docs/SEMANTICS.md).
        log.debug("cache dir %s: cannot write this daemon's pid into %s: %s", path,
                    LOCK_FILE, exc.strerror or exc)  # fmt: skip
    return fd


def move_aside(path: str) -> str:
    """Move a damaged env (data.mdb, lock.mdb) to cache_dir/broken-TIMESTAMP/ and return
    that directory. A cache is disposable: the daemon starts again with an empty one, and
    the damaged files stay for whoever wants to look at them (and to delete them)."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    target = os.path.join(path, f"broken-{stamp}")
    n = 1
    while os.path.exists(target):
        n += 1
        target = os.path.join(path, f"broken-{stamp}-{n}")
    os.mkdir(target, 0o700)
    for name in ("data.mdb", "lock.mdb"):
        try:
            os.rename(os.path.join(path, name), os.path.join(target, name))
        except FileNotFoundError:
            pass
    return target
