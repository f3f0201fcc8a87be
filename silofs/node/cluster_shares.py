"""The cache shares of a cluster: each dataset's share of the cluster's caches, versioned
and persisted, and this node's part of it.

Owns the one table every member holds alike (dataset URI -> bytes, or None: back to the
shared pool), each entry with the version of its last change, merged entry by entry
(the newer version of each dataset wins, so changes made at the same time on two members
to two datasets both hold), the table's version (its newest entry's) and digest (what a
ping compares: members whose digests differ pull each other's table and merge), persisting
it in the cache env's meta (row "cluster:shares") through the Writer, and the part
arithmetic: part = share x this member's weight / the configured members' weights
(configured, not live: a member going down must not make every other one evict). Never
pushes or pulls (node/cluster.py does), never evicts (the enforcer does, from the quota
policy).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import xxhash

from silofs.node.store_write import WritableStore
from silofs.node.writer import Writer
from silofs.units import format_size

log = logging.getLogger(__name__)

META_ROW = "cluster:shares"

Shares = dict[str, int | None]
Stamps = dict[str, int]


def now_version() -> int:
    """A version from the clock: microseconds since the epoch."""
    return time.time_ns() // 1000


class ClusterShares:
    """The shares table, each entry's version, and the table's version."""

    def __init__(self, store: WritableStore, writer: Writer) -> None:
        self.store = store
        self.writer = writer
        self.shares: Shares = {}
        self.stamps: Stamps = {}
        row = store.get_meta(META_ROW)
        if isinstance(row, dict) and (parsed := parse_shares(row)) is not None:
            self.shares, self.stamps = parsed[1], parsed[2]

    @property
    def version(self) -> int:
        return max(self.stamps.values(), default=0)

    @property
    def digest(self) -> str:
        """Of the whole table: equal on two members holding the same entries."""
        rows = sorted((uri, self.shares[uri], self.stamps[uri]) for uri in self.shares)
        return xxhash.xxh3_64_hexdigest(json.dumps(rows).encode())

    def view(self) -> dict[str, Any]:
        return {"version": self.version, "shares": dict(self.shares), "stamps": dict(self.stamps)}

    async def accept(self, shares: Shares, stamps: Stamps) -> bool:
        """Merge a table into ours, entry by entry, the newer stamp of each winning
        (persisted first); whether anything changed. Our version becomes the newest
        stamp we hold, so the table's own version is not needed here."""
        newer = {u: s for u, s in shares.items() if stamps[u] > self.stamps.get(u, -1)}
        if not newer:
            return False
        merged_shares = {**self.shares, **newer}
        merged_stamps = {**self.stamps, **{u: stamps[u] for u in newer}}
        row = {"version": max(merged_stamps.values()), "shares": merged_shares}
        await self.writer.call(self.store.put_meta, META_ROW, {**row, "stamps": merged_stamps})
        self.shares, self.stamps = merged_shares, merged_stamps
        log.info("cluster cache shares, version %d: %s", self.version, _describe(newer))
        return True

    async def set(self, uri: str, size: int | None) -> int:
        """Change one dataset's share here (an allocate-cache on this node); its new
        version (newer than any this node has seen), to be pushed to every member."""
        version = max(now_version(), self.version + 1)
        await self.accept({uri: size}, {uri: version})
        return version

    def share(self, uri: str) -> int | None:
        return self.shares.get(uri)

    def part(self, uri: str, weight: float, total: float) -> int | None:
        """This member's part of a dataset's share (None: no share, the shared pool)."""
        size = self.shares.get(uri)
        if size is None or total <= 0:
            return None
        return int(size * weight / total)


def parse_shares(body: dict) -> tuple[int, Shares, Stamps] | None:
    """(version, shares, stamps) of a persisted row or a pushed body; None if malformed.
    A body without stamps (an older member's) stamps every entry with its version."""
    version, shares, stamps = body.get("version"), body.get("shares"), body.get("stamps")
    if not _is_version(version) or not isinstance(shares, dict):
        return None
    if stamps is None:
        stamps = dict.fromkeys(shares, version)
    if not isinstance(stamps, dict) or set(stamps) != set(shares):
        return None
    out: Shares = {}
    for uri, size in shares.items():
        if not isinstance(uri, str) or not uri or len(uri) > 4096:
            return None
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
            return None
        if not _is_version(stamps[uri]) or stamps[uri] > version:
            return None
        out[uri] = size
    return version, out, dict(stamps)


def _is_version(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _describe(shares: dict[str, int | None]) -> str:
    return (
        ", ".join(
            f"{uri} {'shared pool' if s is None else format_size(s)}" for uri, s in shares.items()
        )
        or "none"
    )
