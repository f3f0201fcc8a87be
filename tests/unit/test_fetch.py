"""Fetcher single-flight: one GET per chunk, errors shared, a cancelled leader replaced."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import trio
import trio.testing

from silofs.cache.format import ChunkRef
from silofs.errors import TransientError
from silofs.node.fetch import FAILED_SECONDS, Fetcher
from silofs.node.limiter import TokenBucket
from silofs.records import ObjectInfo

OBJ = ObjectInfo("a.bin", 1000, 0.0, "v1", "test:a")


class SlowBackend:
    uri = "test://b/"

    def __init__(self, fail: bool = False) -> None:
        self.calls = 0
        self.release = threading.Event()
        self.fail = fail

    def get_range(self, info: ObjectInfo, start: int, length: int) -> bytes:
        self.calls += 1
        self.release.wait(10)
        if self.fail:
            raise TransientError("store is busy")
        return b"x" * length


def test_concurrent_askers_share_one_get(make_fetcher: Callable[[], Fetcher]) -> None:
    backend = SlowBackend()
    results: list[tuple[bytes, bool]] = []

    async def main() -> None:
        fetcher = make_fetcher()
        limiter = TokenBucket(None)
        async with trio.open_nursery() as n:
            for _ in range(5):
                n.start_soon(lambda: _ask(fetcher, backend, limiter, results))
            await trio.sleep(0.05)
            backend.release.set()

    trio.run(main)
    assert backend.calls == 1
    assert sorted(r[1] for r in results) == [False] * 4 + [True]
    assert all(r[0] == b"x" * 1000 for r in results)


async def _ask(fetcher: Fetcher, backend, limiter, out: list) -> None:
    out.append(await fetcher.fetch(1, backend, limiter, ChunkRef.of(OBJ, 4096, 0)))


def test_a_cancelled_leader_is_replaced_by_a_waiter(make_fetcher: Callable[[], Fetcher]) -> None:
    """A leader parked on its job's limiter (rate 0) gives up; a waiter of another job,
    with its own allocation, leads a new flight instead of failing."""
    backend = SlowBackend()
    backend.release.set()
    results: list[tuple[bytes, bool]] = []

    async def main() -> None:
        fetcher = make_fetcher()
        async with trio.open_nursery() as n:
            leader = trio.CancelScope()

            async def lead() -> None:
                with leader:
                    await fetcher.fetch(1, backend, TokenBucket(0), ChunkRef.of(OBJ, 4096, 0))

            n.start_soon(lead)
            await trio.sleep(0.02)
            n.start_soon(lambda: _ask(fetcher, backend, TokenBucket(None), results))
            await trio.sleep(0.02)
            assert not results  # waiting on the parked leader's flight
            leader.cancel()

    trio.run(main)
    assert results == [(b"x" * 1000, True)]
    assert backend.calls == 1


def test_a_failed_get_fails_every_waiter_once(make_fetcher: Callable[[], Fetcher]) -> None:
    backend = SlowBackend(fail=True)
    errors: list[Exception] = []

    async def main() -> None:
        fetcher = make_fetcher()
        limiter = TokenBucket(None)

        async def ask() -> None:
            try:
                await fetcher.fetch(1, backend, limiter, ChunkRef.of(OBJ, 4096, 0))
            except TransientError as exc:
                errors.append(exc)

        async with trio.open_nursery() as n:
            for _ in range(3):
                n.start_soon(ask)
            await trio.sleep(0.05)
            backend.release.set()

    trio.run(main)
    assert backend.calls == 1 and len(errors) == 3


def test_a_failed_fetch_is_remembered_for_seconds_not_for_good(
    make_fetcher: Callable[[], Fetcher],
) -> None:
    """The kernel asks again at once for a read that failed: that ask (a fetch, or a span's
    fetch) gets the error without a GET; once FAILED_SECONDS pass, the store is asked."""
    backend = SlowBackend(fail=True)
    backend.release.set()
    ref = ChunkRef.of(OBJ, 4096, 0)

    async def main() -> None:
        fetcher = make_fetcher()
        limiter = TokenBucket(None)
        for _ in range(2):
            with pytest.raises(TransientError):
                await fetcher.fetch(1, backend, limiter, ref)
        with pytest.raises(TransientError):
            await fetcher.fetch_span(1, backend, limiter, ref, [ref])
        assert backend.calls == 1
        # Another dataset listing the same object (other credentials, say) is asked anew.
        with pytest.raises(TransientError):
            await fetcher.fetch(2, backend, limiter, ref)
        assert backend.calls == 2
        await trio.sleep(FAILED_SECONDS + 0.1)
        backend.fail = False
        data, _ = await fetcher.fetch(1, backend, limiter, ref)
        assert bytes(data) == b"x" * 1000 and backend.calls == 3

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
