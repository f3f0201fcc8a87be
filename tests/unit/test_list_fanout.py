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
from typing import Any

import pytest

from silofs.errors import NotFoundError, TransientError
from silofs.node.backends.base import BackendOptions, RetryingBackend, relative_key
from silofs.records import ObjectInfo


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
