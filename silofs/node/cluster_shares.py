"""The cache shares of a cluster: each dataset's share of the cluster's caches, versioned
and persisted, and this node's part of it.

Owns the one table every member holds alike (dataset URI -> bytes, or None: back to the
shared pool) with the version that orders its changes (the newest wins; a member that
missed one pulls it from a member whose ping names a newer version), persisting it in
the cache env's meta (row "cluster:shares") through the Writer, and the part arithmetic:
part = share x this member's weight / the configured members' weights (configured, not
live: a member going down must not make every other one evict). Never pushes or pulls
(node/cluster.py does), never evicts (the enforcer does, from the quota policy).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from silofs.node.store_write import WritableStore
from silofs.node.writer import Writer
from silofs.units import format_size

log = logging.getLogger(__name__)

META_ROW = "cluster:shares"


def now_version() -> int:
    """A version from the clock: microseconds since the epoch."""
    return time.time_ns() // 1000


class ClusterShares:
    """The shares table and its version."""

    def __init__(self, store: WritableStore, writer: Writer) -> None:
        self.store = store
        self.writer = writer
        row = store.get_meta(META_ROW)
        self.version = 0
        self.shares: dict[str, int | None] = {}
        if isinstance(row, dict):
            parsed = parse_shares(row)
            if parsed is not None:
                self.version, self.shares = parsed

    def view(self) -> dict[str, Any]:
        return {"version": self.version, "shares": dict(self.shares)}

    async def accept(self, version: int, shares: dict[str, int | None]) -> bool:
        """Put a table in force if it is newer than ours (persisted first); whether it was."""
        if version <= self.version:
            return False
        await self.writer.call(
            self.store.put_meta, META_ROW, {"version": version, "shares": shares}
        )
        self.version, self.shares = version, dict(shares)
        log.info("cluster cache shares, version %d: %s", version, _describe(shares))
        return True

    async def set(self, uri: str, size: int | None) -> int:
        """Change one dataset's share here (an allocate-cache on this node); the new
        version, to be pushed to every member."""
        shares = {**self.shares, uri: size}
        version = max(now_version(), self.version + 1)
        await self.accept(version, shares)
        return version

    def share(self, uri: str) -> int | None:
        return self.shares.get(uri)

    def part(self, uri: str, weight: float, total: float) -> int | None:
        """This member's part of a dataset's share (None: no share, the shared pool)."""
        size = self.shares.get(uri)
        if size is None or total <= 0:
            return None
        return int(size * weight / total)


def parse_shares(body: dict) -> tuple[int, dict[str, int | None]] | None:
    """(version, shares) of a persisted row or a pushed body; None if malformed."""
    version, shares = body.get("version"), body.get("shares")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        return None
    if not isinstance(shares, dict):
        return None
    out: dict[str, int | None] = {}
    for uri, size in shares.items():
        if not isinstance(uri, str) or not uri or len(uri) > 4096:
            return None
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
            return None
        out[uri] = size
    return version, out


def _describe(shares: dict[str, int | None]) -> str:
    return (
        ", ".join(
            f"{uri} {'shared pool' if s is None else format_size(s)}" for uri, s in shares.items()
        )
        or "none"
    )
