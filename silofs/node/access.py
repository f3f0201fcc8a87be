"""Access decisions for requests from untrusted peers (docs/SECURITY.md).

Owns the arithmetic of POSIX mode bits for a peer (its uid and gids, never the daemon's
own credentials) and the cloud access policy (which groups may open which URI
prefixes). Pure functions over stat results and settings: never opens a file (the
local backend walks paths, node/authz.py decides when to ask), never changes the
process's credentials (a setfsuid in one worker thread would race the others).
"""

from __future__ import annotations

import stat
from collections.abc import Iterable, Mapping

R, W, X = 4, 2, 1


def mode_allows(
    st_mode: int, st_uid: int, st_gid: int, uid: int, gids: Iterable[int], want: int
) -> bool:
    """Whether uid/gids get every bit of `want` (R|W|X) on a file with these stat fields,
    as the kernel decides without ACLs: the owner class if uid owns it, else the group
    class if any gid matches, else others. The classes do not add up: an owner with
    0o077 may do nothing. Root (uid 0) is not special here: callers exempt trusted peers."""
    if uid == st_uid:
        bits = (st_mode >> 6) & 7
    elif st_gid in set(gids):
        bits = (st_mode >> 3) & 7
    else:
        bits = st_mode & 7
    return bits & want == want


def is_dir(st_mode: int) -> bool:
    return stat.S_ISDIR(st_mode)


def cloud_allowed(
    canonical: str, gids: Iterable[int], policy: Mapping[str, frozenset[int] | None]
) -> bool:
    """Whether a peer in `gids` may open the cloud dataset `canonical` under `policy`
    (URI prefix -> gids allowed; None means every local user). Prefixes end in "/", so
    "s3://public/" never matches "s3://public-private/"."""
    mine = set(gids)
    for prefix, allowed in policy.items():
        if canonical.startswith(prefix) and (allowed is None or allowed & mine):
            return True
    return False
