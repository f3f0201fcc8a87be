"""Listing fan-out by delimiter (silofs/node/backends/base.py RetryingBackend.list).

Owns: the fanned-out listing yields exactly what the serial one does (pages, nested
prefixes, markers and odd keys filtered the same), a failing prefix ends the listing with
its error after retries, a consumer that stops early stops the workers, and a slow
consumer holds the workers back (the page queue is bounded). An in-memory store with a
delimiter listing stands in for S3; the real S3 path is tested against moto in
tests/integration/test_backend_conformance.py.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from silofs.errors import NotFoundError, TransientError
from silofs.node.backends.base import (
    BackendOptions,
    RetryingBackend,
    prefixes_in_order,
    relative_key,
)
from silofs.records import ObjectInfo, PrefixListed


class MemStore(RetryingBackend):
    def __init__(self, keys: list[str], workers: int, page: int = 3, prefix: str = "p/") -> None:
        self.uri = "mem://b/" + prefix
        self.prefix = prefix
        self.keys = sorted(keys)
        self.opts = BackendOptions(list_workers=workers, page_size=page, backoff_base=0.001)
        self.calls = 0
        self.fail: dict[str, list[Exception]] = {}
        self.lock = threading.Lock()

    def _lists_by_prefix(self) -> bool:
        return True

    def _list_page(self, token: str | None) -> tuple[Iterable[Any], str | None]:
        i = int(token or 0)
        keys = [k for k in self.keys if k.startswith(self.prefix)]
        n = self.opts.page_size
        return keys[i : i + n], (str(i + n) if i + n < len(keys) else None)

    def _list_dir_page(
        self, prefix: str, token: str | None
    ) -> tuple[Iterable[Any], list[str], str | None]:
        with self.lock:
            self.calls += 1
            errors = self.fail.get(prefix)
            if errors:
                raise errors.pop(0)
        keys, subs = [], []
        i = (
            bisect.bisect_right(self.keys, token)
            if token
            else bisect.bisect_left(self.keys, prefix)
        )
        last = None
        while i < len(self.keys) and self.keys[i].startswith(prefix):
            if len(keys) + len(subs) >= self.opts.page_size:
                return keys, subs, last
            k = self.keys[i]
            cut = k.find("/", len(prefix))
            if cut >= 0:
                sub = k[: cut + 1]
                subs.append(sub)
                last = sub + "\U0010ffff"  # resume after everything under it
                i = bisect.bisect_left(self.keys, sub[:-1] + "0")
                continue
            keys.append(k)
            last = k
            i += 1
        return keys, subs, None

    def _info(self, item: Any) -> ObjectInfo | None:
        key = relative_key(self.prefix, item)
        return None if key is None else ObjectInfo(key, 1, 1.0, "v", "c")


KEYS = [
    *(f"p/d{d}/f{i}" for d in range(7) for i in range(11)),
    *(f"p/d1/sub{s}/x{i}" for s in range(3) for i in range(4)),
    "p/top",
    "p/marker/",
    "p/a//b",
    "p/./dot",
    "p/deep/a/b/c/d/e",
    "other/not-mine",
]


def test_fanned_out_equals_serial() -> None:
    serial = sorted(o.key for o in MemStore(KEYS, workers=1).list())
    fanned = MemStore(KEYS, workers=8)
    got = [o.key for o in fanned.list()]
    assert len(got) == len(set(got))
    assert sorted(got) == serial
    assert "top" in serial and "deep/a/b/c/d/e" in serial and "d1/sub2/x3" in serial
    assert fanned.calls > 8  # it did split by prefix


class RepeatingStore(MemStore):
    """A store that names each page's sub-prefixes again on the next page of the same
    prefix (as fake-gcs-server does)."""

    def _list_dir_page(
        self, prefix: str, token: str | None
    ) -> tuple[Iterable[Any], list[str], str | None]:
        keys, subs, nxt = super()._list_dir_page(prefix, token)
        if token:  # the previous page's sub-prefixes again
            _, before, _ = super()._list_dir_page(prefix, None)
            subs = before + subs
        return keys, subs, nxt


def test_a_prefix_named_on_several_pages_is_walked_and_announced_once() -> None:
    store = RepeatingStore(KEYS, workers=4, page=2)
    events = list(store.list_events())
    keys = [e.key for e in events if isinstance(e, ObjectInfo)]
    assert len(keys) == len(set(keys))
    assert sorted(keys) == sorted(o.key for o in MemStore(KEYS, workers=1).list())
    announced = [s for e in events if isinstance(e, PrefixListed) for s in e.subs]
    assert len(announced) == len(set(announced))
    assert "d1/sub2/" in announced


def test_transient_errors_are_retried_and_a_hard_one_ends_the_listing() -> None:
    s = MemStore(KEYS, workers=4)
    s.fail["p/d3/"] = [TransientError("blip"), TransientError("blip")]
    assert len(list(s.list())) == len(list(MemStore(KEYS, workers=1).list()))
    s = MemStore(KEYS, workers=4)
    s.fail["p/d5/"] = [NotFoundError("gone")]
    with pytest.raises(NotFoundError):
        list(s.list())


def test_a_consumer_that_stops_early_stops_the_workers() -> None:
    keys = [f"p/d{d:03d}/f{i}" for d in range(200) for i in range(5)]
    s = MemStore(keys, workers=4)
    it = s.list()
    next(it)
    it.close()
    calls = s.calls
    time.sleep(0.3)  # nothing to poll for: asserting that nothing more happens
    assert s.calls <= calls + 4  # at most the pages already in flight


def test_a_slow_consumer_holds_the_workers_back() -> None:
    keys = [f"p/d{d:03d}/f{i}" for d in range(300) for i in range(3)]
    s = MemStore(keys, workers=2, page=3)
    it = s.list()
    next(it)
    deadline = time.monotonic() + 5
    last = -1
    while time.monotonic() < deadline and s.calls != last:  # until the workers block
        last = s.calls
        time.sleep(0.1)
    # The root's 100 pages hold only sub-prefixes (nothing to queue). Of the directory
    # pages, the queue holds 2 x workers; each worker may hold one more it cannot put.
    assert s.calls <= 100 + 2 * 2 + 2 + 1, s.calls
    assert len(list(it)) == len(keys) - 1


def test_a_serial_listing_says_when_each_directory_is_complete() -> None:
    """list_workers = 1 lists one flat stream of keys in the store's order: each
    directory gets a PrefixListed(done) right after its last key, before any key past
    it, so a --list-in-background mount answers for it before the listing ends."""
    s = MemStore(KEYS, workers=1)
    events = list(s.list_events())
    seen: set[str] = set()
    for i, e in enumerate(events):
        if isinstance(e, PrefixListed):
            assert e.done and e.key.endswith("/") and e.key not in seen
            seen.add(e.key)
            # Everything under it came before, nothing under it after.
            assert not any(
                isinstance(o, ObjectInfo) and o.key.startswith(e.key) for o in events[i:]
            )
            assert any(isinstance(o, ObjectInfo) and o.key.startswith(e.key) for o in events[:i])
    dirs = {o.key[: j + 1] for o in s.list() for j, c in enumerate(o.key) if c == "/"}
    last_dirs = set(_dirs(max(o.key for o in s.list())))
    assert seen == dirs - last_dirs  # the last key's directories end with the listing


def _dirs(key: str) -> list[str]:
    return [key[: j + 1] for j, c in enumerate(key) if c == "/"]


def test_keys_out_of_order_end_the_records() -> None:
    objs = [ObjectInfo(k, 1, 1.0, "v", "c") for k in ["a/1", "b/1", "a/2", "c/1"]]
    events = list(prefixes_in_order(objs, "mem://"))
    assert [e.key for e in events if isinstance(e, PrefixListed)] == ["a/"]
    assert [e.key for e in events if isinstance(e, ObjectInfo)] == [o.key for o in objs]


def test_a_directory_bucket_lists_no_records_serially() -> None:
    s = MemStore(KEYS, workers=1)
    s.bucket = "data--usw2-az1--x-s3"  # S3 Express One Zone: keys not in order
    assert not any(isinstance(e, PrefixListed) for e in s.list_events())


@pytest.mark.parametrize("workers", [1, 4])
def test_a_local_tree_is_listed_directory_by_directory(tmp_path: Path, workers: int) -> None:
    """A local store lists like an object store's prefixes (base.fan_out): the same
    files as a walk of the tree, pages of page_size entries, and each directory's
    PrefixListed(done) after every file in it and after the page naming it."""
    from silofs.node.backends.local import LocalBackend
    from silofs.uri import parse_uri

    root = tmp_path / "tree"
    want = {f"d{d}/f{i}" for d in range(5) for i in range(7)} | {"top", "d1/s/x", "d1/s/t/y"}
    for k in want:
        (root / k).parent.mkdir(parents=True, exist_ok=True)
        (root / k).write_bytes(b"x" * len(k))
    (root / "empty" / "deeper").mkdir(parents=True)
    (root / "link").symlink_to(root / "top")
    opts = BackendOptions(list_workers=workers, page_size=3)
    b = LocalBackend(parse_uri(f"file://{root}/"), opts)
    events = list(b.list_events())
    objs = [e for e in events if isinstance(e, ObjectInfo)]
    assert sorted(o.key for o in objs) == sorted(want)
    assert all(o.size == len(o.key) for o in objs)
    done = {}
    for i, e in enumerate(events):
        if isinstance(e, PrefixListed):
            assert all(s.startswith(e.key) and s.endswith("/") for s in e.subs)
            if e.done:
                done[e.key] = i
    assert set(done) == {
        "",
        "d0/",
        "d1/",
        "d2/",
        "d3/",
        "d4/",
        "d1/s/",
        "d1/s/t/",
        "empty/",
        "empty/deeper/",
    }
    for key, i in done.items():
        assert not any(
            isinstance(o, ObjectInfo) and o.key.startswith(key) and "/" not in o.key[len(key) :]
            for o in events[i:]
        ), key


class CountingStore(MemStore):
    """Counts prefixes named on a page and not yet listed: the fan-out's backlog."""

    def __init__(self, keys: list[str], workers: int, page: int) -> None:
        super().__init__(keys, workers, page)
        self.named: set[str] = set()
        self.started: set[str] = set()
        self.max_backlog = 0

    def _list_dir_page(
        self, prefix: str, token: str | None
    ) -> tuple[Iterable[Any], list[str], str | None]:
        with self.lock:
            self.started.add(prefix)
        items, subs, nxt = super()._list_dir_page(prefix, token)
        with self.lock:
            self.named.update(subs)
            self.max_backlog = max(self.max_backlog, len(self.named - self.started))
        time.sleep(0.0005)  # a request takes time: the root's pages outrun the walks
        return items, subs, nxt


def test_the_backlog_of_named_prefixes_stays_bounded(monkeypatch) -> None:
    """5,000 sample directories under one prefix: the prefixes named and not yet walked
    stay within FAN_OUT_BACKLOG per worker (the rest are walked depth first by the
    worker that found them), and the listing is still exactly the serial one."""
    import silofs.node.backends.base as base

    monkeypatch.setattr(base, "FAN_OUT_BACKLOG", 8)
    keys = [f"p/s{i:05d}/x.jpg" for i in range(5000)]
    store = CountingStore(keys, workers=4, page=500)
    got = sorted(o.key for o in store.list_events() if isinstance(o, ObjectInfo))
    assert got == sorted(k[2:] for k in keys)
    assert store.max_backlog <= 8 * 4 + 500, store.max_backlog  # + one page's names
    assert store.max_backlog >= 8 * 4  # the bound is what held it, not the store's pace
