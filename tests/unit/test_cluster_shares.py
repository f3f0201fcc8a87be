"""The cluster's cache-shares table (node/cluster_shares.py): entry-by-entry merging, so
changes made at once on two members both hold, the digest members compare, persistence,
and malformed bodies refused."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import trio

from silofs.errors import UsageError
from silofs.node.cluster_shares import (
    MAX_AHEAD,
    MAX_SHARES,
    ClusterShares,
    check_shares,
    now_version,
    parse_shares,
)
from silofs.node.store_write import WritableStore


class _Writer:
    """The Writer's call(), in this thread (unit test: no admission queue to order)."""

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)


def _table(store: WritableStore) -> ClusterShares:
    return ClusterShares(store, _Writer())  # type: ignore[arg-type]


def _push(src: ClusterShares, dst: ClusterShares) -> bool:
    """What a push or a pull does: the receiver parses the sender's view and merges it."""
    parsed = parse_shares(src.view())
    assert parsed is not None
    return trio.run(dst.accept, *parsed[1:])


def test_changes_made_at_once_on_two_members_both_hold(tmp_path) -> None:
    a = _table(WritableStore(str(tmp_path / "a"), 16 << 20))
    b = _table(WritableStore(str(tmp_path / "b"), 16 << 20))
    trio.run(a.set, "s3://one/", 100)
    trio.run(b.set, "s3://two/", 200)  # b has not seen a's change yet
    assert a.digest != b.digest
    assert _push(a, b) and _push(b, a)
    assert a.shares == b.shares == {"s3://one/": 100, "s3://two/": 200}
    assert a.digest == b.digest and a.version == b.version
    assert not _push(a, b)  # nothing new: no write, no log line


def test_the_newer_change_of_one_dataset_wins_in_either_order(tmp_path) -> None:
    a = _table(WritableStore(str(tmp_path / "a"), 16 << 20))
    b = _table(WritableStore(str(tmp_path / "b"), 16 << 20))
    trio.run(a.set, "s3://one/", 100)
    _push(a, b)
    trio.run(b.set, "s3://one/", None)  # later: back to the shared pool
    assert not _push(a, b)  # a's older entry does not undo it
    assert _push(b, a)
    assert a.shares == b.shares == {"s3://one/": None}


def test_a_change_missed_behind_a_newer_one_shows_in_the_digest(tmp_path) -> None:
    """a's change reached nobody (its push failed), then b's newer one reached a: the
    versions are equal, only the digests tell b to pull."""
    a = _table(WritableStore(str(tmp_path / "a"), 16 << 20))
    b = _table(WritableStore(str(tmp_path / "b"), 16 << 20))
    trio.run(a.set, "s3://one/", 100)
    trio.run(b.set, "s3://two/", 200)
    _push(b, a)
    assert a.version == b.version and a.digest != b.digest
    _push(a, b)  # the pull a differing digest starts
    assert b.shares == a.shares


def test_the_merged_table_survives_a_restart(tmp_path) -> None:
    store = WritableStore(str(tmp_path / "a"), 16 << 20)
    a = _table(store)
    trio.run(a.set, "s3://one/", 100)
    trio.run(a.accept, {"s3://two/": 7}, {"s3://two/": 5})
    again = _table(store)
    assert again.view() == a.view() and again.digest == a.digest


def test_malformed_bodies_are_refused() -> None:
    ok = {"version": 9, "shares": {"s3://b/": 1}, "stamps": {"s3://b/": 9}}
    assert parse_shares(ok) == (9, {"s3://b/": 1}, {"s3://b/": 9})
    for bad in (
        {**ok, "stamps": {"s3://b/": 10}},  # an entry newer than its table
        {**ok, "stamps": {"s3://c/": 9}},  # stamps of other entries
        {**ok, "stamps": {"s3://b/": True}},
        {**ok, "stamps": []},
        {**ok, "version": -1},
        {**ok, "shares": {"s3://b/": -5}},
    ):
        assert parse_shares(bad) is None, bad


def test_what_a_member_may_push_is_bounded_and_named_in_one_line() -> None:
    now = now_version()
    ok = {"version": now, "shares": {"s3://b/": 1}}
    assert check_shares(ok, now=now)[1] == {"s3://b/": 1}
    many = {f"s3://b{i}/": 1 for i in range(MAX_SHARES + 1)}
    for bad, says in (
        ({"version": now, "shares": many}, "shares (at most"),
        ({"version": now, "shares": {"s3://b/x": 1}}, "canonical URI"),  # not a dataset's name
        ({"version": now, "shares": {"s3://b/\nforged log line/": 1}}, "printable"),
        ({"version": now, "shares": {"s3://" + "b" * 2000 + "/": 1}}, "printable"),
        ({"version": now, "shares": {"no-scheme-at-all": 1}}, "canonical URI"),
        ({"version": now, "shares": {"s3://b/": 1 << 80}}, "bytes"),
        ({"version": now + MAX_AHEAD + 1, "shares": {"s3://b/": 1}}, "ahead"),
        ([1, 2], "a shares body is"),
    ):
        with pytest.raises(ValueError) as err:
            check_shares(bad, now=now)
        assert says in str(err.value) and "\n" not in str(err.value), (bad, err.value)


def test_pushes_of_made_up_datasets_stop_at_the_tables_bound(tmp_path) -> None:
    """Each push within the body's bound, but together more than a table may hold: the
    one that would overflow it is refused whole, and nothing of it is kept."""
    table = _table(WritableStore(str(tmp_path / "a"), 64 << 20))
    half = MAX_SHARES // 2 + 1
    for n in range(2):
        body = {f"s3://made-up-{n}-{i}/": 1 for i in range(half)}
        stamps = dict.fromkeys(body, 5)
        if n == 0:
            assert trio.run(table.accept, body, stamps)
        else:
            with pytest.raises(UsageError, match="at most"):
                trio.run(table.accept, body, stamps)
    assert len(table.shares) == half and len(_table(table.store).shares) == half
