"""Fetcher single-flight: one GET per chunk, errors shared, a cancelled leader replaced."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import trio
import trio.testing

from silofs.cache.format import ChunkRef
from silofs.errors import TransientError
from silofs.node.fetch import BACKGROUND, FAILED_SECONDS, Fetcher
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


def _running_in_threads(
    fetcher: Fetcher, holders: list[tuple[int, bool]], probe: int, probe_background: bool
) -> tuple[int, bool]:
    """`holders` (dataset id, background) each run a store call that blocks until the
    end; then `probe`'s call: how many holders got a thread, and whether the probe ran
    while they all still blocked. Each wait is for the Fetcher to settle (every task in
    its thread or queued on a limiter), not for a time: a busy host starts threads late."""
    release = threading.Event()
    started: list[int] = []
    probed = [False]
    held = [0]
    ran = [False]  # probed[0] before the holders were released

    def hold(dsid: int) -> None:
        started.append(dsid)
        release.wait(60)

    def settled(tasks: int) -> bool:
        """Every one of `tasks` calls is running in its thread or queued on a limiter
        (a task between two limiters, or holding a thread not started yet, is neither)."""
        limiters = [fetcher.threads, fetcher.background]
        for share in fetcher._per_dataset.values():
            limiters += [share.all, share.background]
        queued = sum(lim.statistics().tasks_waiting for lim in limiters)
        running = len(started) + probed[0]
        return running == fetcher.threads.borrowed_tokens and running + queued == tasks

    async def one(dsid: int, background: bool, fn: Callable[[], None]) -> None:
        BACKGROUND.set(background)
        await fetcher._in_thread(dsid, fn)

    async def main() -> None:
        async with trio.open_nursery() as n:
            try:
                for dsid, background in holders:
                    n.start_soon(one, dsid, background, lambda d=dsid: hold(d))
                with trio.fail_after(30):
                    while not settled(len(holders)):
                        await trio.sleep(0.01)
                held[0] = len(started)
                n.start_soon(one, probe, probe_background, lambda: probed.__setitem__(0, True))
                with trio.fail_after(30):  # the probe ran, or it queues behind the holders
                    while not (probed[0] or settled(len(holders) + 1)):
                        await trio.sleep(0.01)
                ran[0] = probed[0]
            finally:
                release.set()

    trio.run(main)
    return held[0], ran[0]


def test_a_hung_dataset_leaves_other_datasets_the_spare_fetch_threads() -> None:
    """fetch_threads 8: one dataset's 10 blocked GETs hold 8, and another dataset's GET
    runs at once in one of the 2 spares (a store that never answered held every thread,
    and every dataset's misses waited for its timeouts:
    tests/integration/test_store_over_time.py)."""
    fetcher = Fetcher(None, None, 8)  # type: ignore[arg-type]  # _in_thread uses neither
    held, probed = _running_in_threads(fetcher, [(1, False)] * 10, 2, False)
    assert held == 8 and probed  # a node reading one dataset keeps all 8
    assert fetcher._per_dataset == {}  # idle shares are dropped


def test_a_dataset_s_warm_leaves_its_own_misses_a_thread() -> None:
    fetcher = Fetcher(None, None, 8)  # type: ignore[arg-type]
    held, probed = _running_in_threads(fetcher, [(1, True)] * 10, 1, False)
    assert held == 6 and probed  # warms and hints: 3/4 of the dataset's 8
