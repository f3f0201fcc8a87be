"""Weighted rendezvous placement (node/placement.py): every member computes the same
home for a key, homes spread by weight, and a member joining or leaving moves only the
keys whose home it is or becomes (about 1/N of them)."""

from __future__ import annotations

import collections
import math
import random

import pytest
import xxhash

from silofs.node import placement
from silofs.node.placement import Candidate, home, ranked, score

KEYS = [xxhash.xxh3_128_digest(str(i).encode()) for i in range(40_000)]


def members(n: int, weights: list[float] | None = None) -> list[Candidate]:
    weights = weights or [1.0] * n
    return [Candidate(f"tls://10.0.0.{i}:7470", w) for i, w in enumerate(weights)]


def spread(ms: list[Candidate]) -> dict[str, float]:
    counts = collections.Counter(home(k, ms).address for k in KEYS)
    return {m.address: counts[m.address] / len(KEYS) for m in ms}


@pytest.mark.parametrize(
    "weights", [[1.0] * 4, [2.0, 1.0, 1.0], [4.0, 1.0, 1.0, 1.0, 1.0], [0.5, 1.5, 3.0]]
)
def test_homes_spread_by_weight(weights: list[float]) -> None:
    ms = members(len(weights), weights)
    got = spread(ms)
    total = sum(weights)
    for m in ms:
        assert got[m.address] == pytest.approx(m.weight / total, abs=0.015), (m, got)


def test_the_home_is_the_same_whatever_the_order_of_the_members() -> None:
    ms = members(5, [1, 2, 1, 3, 1])
    shuffled = ms[:]
    random.Random(3).shuffle(shuffled)
    assert all(home(k, ms) == home(k, shuffled) for k in KEYS[:5000])
    assert all(ranked(k, ms)[0] == home(k, ms) for k in KEYS[:2000])


@pytest.mark.parametrize("n", [3, 4, 8])
def test_a_member_joining_moves_about_one_nth_and_only_to_itself(n: int) -> None:
    before = members(n)
    joined = Candidate("tls://10.0.1.99:7470")
    after = [*before, joined]
    moved = [k for k in KEYS if home(k, before) != home(k, after)]
    # Every key that moved moved to the new member; about 1/(n+1) of them did.
    assert all(home(k, after) == joined for k in moved)
    assert len(moved) / len(KEYS) == pytest.approx(1 / (n + 1), abs=0.015)


@pytest.mark.parametrize("n", [3, 4, 8])
def test_a_member_leaving_moves_only_its_own_keys(n: int) -> None:
    before = members(n)
    gone = before[1]
    after = [m for m in before if m != gone]
    moved = [k for k in KEYS if home(k, before) != home(k, after)]
    assert all(home(k, before) == gone for k in moved)
    assert len(moved) / len(KEYS) == pytest.approx(1 / n, abs=0.015)
    # ... and each goes to its next member by score, the same on every node.
    assert all(home(k, after) == ranked(k, before)[1] for k in moved[:2000])


def test_scores_are_positive_and_grow_with_weight() -> None:
    key = KEYS[0]
    salt = b"tls://10.0.0.1:7470"
    assert 0 < score(salt, 1.0, key) < score(salt, 2.0, key)


@pytest.mark.parametrize("h", [2**64 - 1, 2**64 - 1024, 2**64 - 1025, 0])
def test_a_hash_at_either_end_of_its_range_scores_a_finite_number(
    h: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hash within 1,024 of 2**64 is 2**64 as a float: u was 1.0, ln(u) 0 and the
    score a ZeroDivisionError (about one (member, key) pair in 2**54: a chunk no node
    could place). Now it scores highest, and every other hash as before."""
    monkeypatch.setattr(placement, "_hash", lambda data: h)
    s = score(b"tls://10.0.0.1:7470", 1.0, b"k")
    assert 0 < s < float("inf")
    monkeypatch.setattr(placement, "_hash", lambda data: 2**63)
    assert score(b"tls://10.0.0.1:7470", 1.0, b"k") == -1.0 / math.log((2**63 + 0.5) / 2**64)
