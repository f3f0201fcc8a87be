"""The records both processes speak: an object as listed, and a mount's counters.

Owns only plain data shared by the node daemon, the mount processes and the cache
format, so that neither side has to import the other to name them. Never does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ObjectInfo:
    """One object under the dataset prefix, as the listing saw it."""

    key: str  # path relative to the dataset prefix, '/'-separated, no leading '/'
    size: int
    mtime: float  # seconds since the epoch
    version: str  # token for conditional reads: S3/Azure etag, GCS generation, local mtime_ns
    content_id: str  # store-reported content identity (etag, md5, crc32c+generation, ...)


@dataclass
class MountCounters:
    """Cumulative counters a mount process reports; the daemon keeps the last report."""

    bytes_read: int = 0
    hit_bytes: int = 0
    miss_bytes: int = 0
    hits: int = 0
    misses: int = 0
    corrupt_chunks: int = 0

    def minus(self, other: MountCounters) -> MountCounters:
        return MountCounters(
            *(a - b for a, b in zip(vars(self).values(), vars(other).values(), strict=True))
        )

    def add(self, other: MountCounters) -> None:
        for k, v in vars(other).items():
            setattr(self, k, getattr(self, k) + v)
