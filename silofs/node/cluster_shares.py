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

from silofs.errors import UsageError
from silofs.node.store_write import WritableStore
from silofs.node.writer import Writer
from silofs.units import format_size
from silofs.uri import parse_uri

log = logging.getLogger(__name__)

META_ROW = "cluster:shares"

Shares = dict[str, int | None]
Stamps = dict[str, int]

# What one table may hold, whoever sent it: every node keeps the whole table in memory
# and in one meta row, and hashes it for every ping, so a member pushing made-up
# datasets must not grow it without end.
MAX_SHARES = 4096
MAX_URI = 1024
MAX_SHARE_BYTES = 1 << 60  # 1 EiB: the part arithmetic stays within a float
# A stamp this far ahead of the receiver's clock (microseconds) is refused: the newest
# stamp wins, so one from the far future would pin its entry against every change.
MAX_AHEAD = 24 * 3600 * 1_000_000


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
        if len(merged_shares) > MAX_SHARES:
            raise UsageError(
                f"the cache shares table would hold {len(merged_shares)} datasets "
                f"(at most {MAX_SHARES})"
            )
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
    """(version, shares, stamps) of a persisted row; None if malformed."""
    try:
        return check_shares(body)
    except ValueError:
        return None


def check_shares(body: object, now: int | None = None) -> tuple[int, Shares, Stamps]:
    """(version, shares, stamps) of a pushed or pulled body, or ValueError saying what
    is wrong with it: each URI a dataset's canonical URI, each share a size in bytes or
    null, at most MAX_SHARES entries, no stamp above the table's version nor (given
    `now`, this node's clock) more than MAX_AHEAD ahead of it. A body without stamps
    (an older member's) stamps every entry with its version."""
    if not isinstance(body, dict):
        raise ValueError("a shares body is {version: N, shares: {URI: bytes or null}}")
    version, shares, stamps = body.get("version"), body.get("shares"), body.get("stamps")
    if not _is_version(version) or not isinstance(shares, dict):
        raise ValueError("a shares body is {version: N, shares: {URI: bytes or null}}")
    if len(shares) > MAX_SHARES:
        raise ValueError(f"{len(shares)} shares (at most {MAX_SHARES})")
    if now is not None and version > now + MAX_AHEAD:
        raise ValueError(f"version {version} is more than a day ahead of this node's clock")
    if stamps is None:
        stamps = dict.fromkeys(shares, version)
    if not isinstance(stamps, dict) or set(stamps) != set(shares):
        raise ValueError("stamps must name the same datasets as shares")
    for uri, size in shares.items():
        _check_uri(uri)
        if size is not None and (
            isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_SHARE_BYTES
        ):
            raise ValueError(f"the share of {uri} must be null or 0-{MAX_SHARE_BYTES} bytes")
        if not _is_version(stamps[uri]) or stamps[uri] > version:
            raise ValueError(f"the stamp of {uri} must be a version no newer than the table's")
    return version, dict(shares), dict(stamps)


def _check_uri(uri: object) -> None:
    if not isinstance(uri, str) or not 0 < len(uri) <= MAX_URI or not uri.isprintable():
        raise ValueError(f"a dataset URI must be 1-{MAX_URI} printable characters")
    try:
        canonical = parse_uri(uri).canonical
    except UsageError as exc:
        raise ValueError(str(exc)) from None
    if canonical != uri:
        raise ValueError(f"{uri!r} is not a dataset's canonical URI ({canonical!r})")


def _is_version(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _describe(shares: dict[str, int | None], most: int = 8) -> str:
    """The changed entries for one log line: the first `most` of them, and how many more."""
    shown = [
        f"{uri} {'shared pool' if s is None else format_size(s)}"
        for uri, s in list(shares.items())[:most]
    ]
    if len(shares) > most:
        shown.append(f"and {len(shares) - most} more")
    return ", ".join(shown) or "none"
