"""Where a chunk lives in a cluster: weighted rendezvous hashing of its key over the
members.

Owns the one placement rule every member computes alike: each member scores a chunk
key, score = -weight / ln(u) with u = (xxh3_64(address + key) + 0.5) / 2**64 uniform
in (0, 1), and the chunk's home is the live member with the highest score (Schindelhauer
and Schomaker, "Weighted Distributed Hash Tables", SPAA '05: a member holds a share of
the keys proportional to its weight). A member joining or leaving moves only the keys
whose best-scoring member it is or becomes (about 1/N of them), and while a member is
down its keys go to the next member by score, the same one on every node. Pure: never
does I/O and never decides which members are live (node/membership.py does).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import xxhash

_TWO_64 = float(1 << 64)
# The largest float below 1: a hash within 1,024 of 2**64 is 2**64 as a float, so its u
# was 1.0 and ln(u) 0, a ZeroDivisionError on every node for that (member, key), a
# chunk none could place (its reads failed, a stand-in sweep over it failed whole).
# Clamped to this, such a member scores highest; every other u is unchanged.
_BELOW_ONE = 1.0 - 2.0**-53
_hash = xxhash.xxh3_64_intdigest


@dataclass(frozen=True)
class Candidate:
    """A member as placement sees it: its address (the hash's salt) and its weight."""

    address: str
    weight: float = 1.0
    salt: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "salt", self.address.encode())


def score(salt: bytes, weight: float, key: bytes) -> float:
    """The member's score for `key` (higher wins); `salt` is its address, encoded."""
    u = min((_hash(salt + key) + 0.5) / _TWO_64, _BELOW_ONE)
    return -weight / math.log(u)


def ranked(key: bytes, members: Iterable[Candidate]) -> list[Candidate]:
    """The members ordered by their score for `key`, best first."""
    return sorted(members, key=lambda m: score(m.salt, m.weight, key), reverse=True)


def home(key: bytes, members: Sequence[Candidate]) -> Candidate:
    """The member with the highest score for `key` (members must not be empty)."""
    best, best_score = members[0], -1.0
    for m in members:
        s = score(m.salt, m.weight, key)
        if s > best_score:
            best, best_score = m, s
    return best
