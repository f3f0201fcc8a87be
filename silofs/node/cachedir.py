"""The cache directory: its checks, its size budget and its permissions.

Owns creating and checking cache_dir, choosing the cache budget against the disk, and
the modes of the directory and the LMDB files. Never opens LMDB (cache/store.py does).
"""

from __future__ import annotations

import os

from silofs.cache.store import disk_free
from silofs.config import NodeSettings
from silofs.errors import UsageError
from silofs.units import format_size

DEFAULT_CACHE_SIZE = 10 << 30


def resolve_cache_size(settings: NodeSettings) -> int:
    """The cache budget: the setting, checked against the disk, or a safe default."""
    os.makedirs(settings.cache_dir, exist_ok=True)
    free = disk_free(settings.cache_dir) + _existing_env_bytes(settings.cache_dir)
    if settings.cache_size is None:
        return max(settings.chunk_size, min(DEFAULT_CACHE_SIZE, free // 2))
    if settings.cache_size > free:
        raise UsageError(
            f"cache size {format_size(settings.cache_size)} is larger than the "
            f"space on {settings.cache_dir} ({format_size(free)} free): "
            "choose a smaller --cache-size"
        )
    return settings.cache_size


def _existing_env_bytes(cache_dir: str) -> int:
    try:
        return os.stat(os.path.join(cache_dir, "data.mdb")).st_blocks * 512
    except FileNotFoundError:
        return 0


def share_cache_with_group(cache_dir: str, gid: int | None) -> None:
    """Let members of the socket group run mount processes: those read the env directly,
    and LMDB readers need write access to its lock file. Other users get nothing, so cached
    bytes stay reachable only through mounts (promise 6)."""
    if gid is None:
        return
    data, lock = os.path.join(cache_dir, "data.mdb"), os.path.join(cache_dir, "lock.mdb")
    for path, mode in ((cache_dir, 0o750), (data, 0o640), (lock, 0o660)):
        os.chown(path, -1, gid)
        os.chmod(path, mode)


def check_cache_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create cache dir {path}: {exc.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"cache dir {path} is not writable: choose another --cache-dir")
