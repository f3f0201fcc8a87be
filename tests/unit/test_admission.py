"""Quota policy and the one LMDB writer (silofs/cache/admission.py), in-process with trio.

Owns QuotaPolicy's arithmetic (allocated datasets get their allocation; the rest share
what is left, first come first served; excess() is a shrink plan that evicts no more
than needed) and the Writer's contract: offers are batched into one txn, a full queue
drops and counts, shrink() evicts, call() serialises with everything else, and the
in-memory usage always equals the committed usage rows. Time is trio's MockClock.
"""

from __future__ import annotations

import errno
import math
import os
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import lmdb
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from silofs.cache.store import Usage
from silofs.node import writer as writer_mod
from silofs.node.quota import QuotaPolicy
from silofs.node.standins import sweep_standins
from silofs.node.store_write import PendingChunk, WritableStore
from silofs.node.writer import ADMIT_NICE, Writer
from tests.unit.test_store import check, chunk, owned

MAP = 64 << 20


def U(n: int) -> Usage:  # noqa: N802 - reads like a constructor in tables below
    return Usage(n, max(1, n // 100) if n else 0)


# -- QuotaPolicy -------------------------------------------------------------------------
def test_allocated_datasets_get_their_allocation() -> None:
    p = QuotaPolicy(1000, {1: 300, 2: 200})
    usage = {1: U(300), 2: U(0), 3: U(450)}
    assert p.quota(1, usage) == 300
    assert p.quota(2, usage) == 200
    assert p.quota(1, {}) == 300  # whatever the others hold


def test_unallocated_datasets_share_the_rest_first_come_first_served() -> None:
    p = QuotaPolicy(1000, {1: 300})
    # 700 shared; dataset 3 got there first with 450, so 4 may fill the other 250.
    usage = {1: U(300), 3: U(450)}
    assert p.quota(3, usage) == 700
    assert p.quota(4, usage) == 250
    usage[4] = U(250)
    assert p.quota(4, usage) == 250
    assert p.quota(5, usage) == 0
    # Allocated datasets' bytes do not count against the shared pool.
    usage[1] = U(999)
    assert p.quota(5, usage) == 0 and p.quota(4, usage) == 250


def test_no_allocations_means_one_pool() -> None:
    p = QuotaPolicy(1000)
    assert p.quota(1, {}) == 1000
    assert p.quota(1, {1: U(900)}) == 1000
    assert p.quota(2, {1: U(900)}) == 100


def test_over_allocated_cache_leaves_no_shared_pool() -> None:
    p = QuotaPolicy(1000, {1: 600, 2: 600})
    assert p.quota(3, {}) == 0
    assert p.excess({3: U(10)}) == {3: 0}


def test_excess_of_allocated_datasets() -> None:
    p = QuotaPolicy(1000, {1: 300, 2: 200})
    usage = {1: U(500), 2: U(200), 3: U(100)}
    assert p.excess(usage) == {1: 300}
    assert p.excess({1: U(300), 2: U(0)}) == {}


def test_excess_of_the_shared_pool_evicts_only_what_is_needed() -> None:
    # The pool shrank from 1000 to 700 (dataset 1 got an allocation). Datasets 2 and 3
    # hold 500 + 400 = 900 of it: 200 must go, not 2 x 200 (each shrunk to 700 - other).
    p = QuotaPolicy(1000, {1: 300})
    usage = {1: U(0), 2: U(500), 3: U(400)}
    plan = p.excess(usage)
    after = {d: (plan[d] if d in plan else u.bytes) for d, u in usage.items()}
    assert sum(after[d] for d in (2, 3)) == 700
    # First come first served: the newer dataset (higher id) gives back first.
    assert plan == {3: 200}


def _apply(plan: dict[int, int], usage: dict[int, Usage]) -> dict[int, Usage]:
    return {d: (U(plan[d]) if d in plan else u) for d, u in usage.items()}


@settings(max_examples=300)
@given(
    cache=st.integers(0, 10_000),
    allocs=st.dictionaries(st.integers(1, 6), st.integers(0, 4000), max_size=3),
    held=st.dictionaries(st.integers(1, 6), st.integers(0, 6000), max_size=6),
)
def test_excess_plan_fits_and_is_minimal(
    cache: int, allocs: dict[int, int], held: dict[int, int]
) -> None:
    p = QuotaPolicy(cache, allocs)
    usage = {d: U(b) for d, b in held.items()}
    plan = p.excess(usage)
    for d, target in plan.items():
        assert 0 <= target < usage[d].bytes, "a plan only shrinks"
    after = _apply(plan, usage)
    for d, u in after.items():
        assert u.bytes <= p.quota(d, after), f"dataset {d} still over its quota"
    # Minimal: exactly the bytes over each allocation, plus what overflows the pool.
    shared = max(0, cache - sum(allocs.values()))
    pool = sum(b for d, b in held.items() if d not in allocs)
    needed = sum(max(0, b - allocs[d]) for d, b in held.items() if d in allocs)
    needed += max(0, pool - shared)
    assert sum(usage[d].bytes - t for d, t in plan.items()) == needed
    assert p.excess(after) == {}


# -- Writer --------------------------------------------------------------------------------
def make_writer(store: WritableStore, policy: QuotaPolicy | None = None, **kw: float) -> Writer:
    args: dict[str, float] = {
        "batch_bytes": 1 << 30,
        "batch_seconds": 0.05,
        "queue_bytes": 1 << 30,
        "sync_seconds": math.inf,
    }
    args.update(kw)
    pol = policy or QuotaPolicy(1 << 40)
    return Writer(store, store.load_usage(), lambda: pol, **args)  # type: ignore[arg-type]


def run(fn: Callable[[], Awaitable[None]]) -> None:
    trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


class AdmitSpy:
    """Counts store.admit calls (one call = one write txn) and their sizes."""

    def __init__(self, store: WritableStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.batches: list[int] = []
        real = store.admit

        def admit(items: list[PendingChunk], *a: object, **k: object) -> object:
            self.batches.append(len(items))
            return real(items, *a, **k)  # type: ignore[arg-type]

        monkeypatch.setattr(store, "admit", admit)


class Flushes:
    """When each of a Writer's flushes began and ended (virtual time); `wait(n)` returns
    once n have ended."""

    def __init__(self, w: Writer) -> None:
        self.began: list[float] = []
        self.ended: list[float] = []
        self._changed = trio.Event()
        real = w.flush

        async def flush() -> None:
            self.began.append(trio.current_time())
            await real()
            self.ended.append(trio.current_time())
            self._changed.set()
            self._changed = trio.Event()

        w.flush = flush  # type: ignore[method-assign]

    async def wait(self, n: int = 1) -> None:
        while len(self.ended) < n:
            await self._changed.wait()


def test_flush_admits_all_offers_in_one_txn(
    store: WritableStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = AdmitSpy(store, monkeypatch)

    async def main() -> None:
        w = make_writer(store)
        for i in range(7):
            assert w.offer(chunk(1, i))
        await w.flush()
        assert spy.batches == [7]
        assert (w.stats.batches, w.stats.admitted_chunks, w.stats.admitted_bytes) == (1, 7, 700)
        assert w.usage == {1: Usage(700, 7)}
        await w.flush()  # nothing queued: no txn
        assert spy.batches == [7]
        check(store, w.usage)

    run(main)


async def _flush(w: Writer, store: WritableStore) -> None:
    await w.flush()


async def _sweep(w: Writer, store: WritableStore) -> None:
    # A stand-in sweep (node/standins.py) flushes, then walks the victims in batches.
    await sweep_standins(w, store, lambda key: False)


@pytest.mark.parametrize("outside", [_flush, _sweep], ids=["flush", "standin-sweep"])
def test_offers_after_a_flush_from_another_task_are_admitted_without_waiting(
    store: WritableStore,
    monkeypatch: pytest.MonkeyPatch,
    outside: Callable[[Writer, WritableStore], Awaitable[None]],
) -> None:
    """A warm, a fill budget or the cluster's stand-in sweep flushes from its own task
    while the run loop waits for offers: the next offer still wakes the loop (it once
    waited on an event the flush had replaced, until IDLE_GIVE_BACK_SECONDS, the offers
    held in memory meanwhile: with the sweep, a cluster's nodes admitted nothing)."""
    monkeypatch.setattr(writer_mod, "IDLE_GIVE_BACK_SECONDS", 3600.0)

    async def admitted(w: Writer) -> None:
        with trio.fail_after(60):  # not the hour the loop's idle bound would take
            while w.pending_chunks():
                await trio.sleep(0.01)

    async def main() -> None:
        w = make_writer(store)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(w.run)
            assert w.offer(chunk(1, 0))
            await admitted(w)
            await trio.testing.wait_all_tasks_blocked()  # the loop waits for offers
            await outside(w, store)  # another task's, with nothing queued
            for i in range(1, 4):
                assert w.offer(chunk(1, i))
                await admitted(w)
            assert w.stats.admitted_chunks == 4
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert len(owned(store, 1)) == 4


def test_admission_runs_in_its_own_thread_at_a_lower_priority(
    store: WritableStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Admission copies every fetched byte into LMDB: it runs on what the readers leave
    (one thread of its own at nice ADMIT_NICE), while other writes keep the daemon's."""
    seen: list[tuple[str, int]] = []
    real = store.admit

    def admit(items: list[PendingChunk], *a: object, **k: object) -> object:
        me = threading.get_native_id()
        seen.append((threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, me)))
        return real(items, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(store, "admit", admit)
    base = os.getpriority(os.PRIO_PROCESS, 0)

    async def main() -> None:
        w = make_writer(store)
        for round_ in range(2):
            assert w.offer(chunk(1, round_))
            await w.flush()
        prio = await w.call(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        assert prio == base  # another write: a thread at the daemon's priority
        w.close()

    run(main)
    assert [name for name, _ in seen] == ["silofs-admit"] * 2
    assert all(nice == min(19, base + ADMIT_NICE) for _, nice in seen)
    check(store, store.load_usage())


def test_a_failed_admission_is_raised_in_the_loop_and_the_thread_goes_on(
    store: WritableStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = store.admit
    fail = [True]

    def admit(items: list[PendingChunk], *a: object, **k: object) -> object:
        if fail.pop(0) if fail else False:
            raise lmdb.MapFullError("full")
        return real(items, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(store, "admit", admit)

    async def main() -> None:
        w = make_writer(store)
        assert w.offer(chunk(1, 0))
        with pytest.raises(lmdb.MapFullError):
            await w.flush()
        assert w.offer(chunk(1, 1))
        await w.flush()
        assert w.usage == {1: Usage(100, 1)}
        w.close()

    run(main)


def test_a_flush_returns_once_the_batch_another_flush_is_writing_is_settled(
    store: WritableStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run loop took the queue and is admitting it when a caller flushes (a warm
    saying done, a fill budget's exact count): the flush finds the queue empty, and must
    still return only once that batch is committed, and settled() once a key is."""
    gate = threading.Event()
    real = store.admit

    def admit(items: list[PendingChunk], *a: object, **k: object) -> object:
        assert gate.wait(30)  # the run loop's batch stays in its txn until the test says
        return real(items, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(store, "admit", admit)
    seen: list[str] = []

    async def main() -> None:
        w = make_writer(store, batch_seconds=0.0)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(w.run)
            assert w.offer(chunk(1, 0))
            with trio.fail_after(30):
                while w._queue:  # taken by the run loop
                    await trio.sleep(0.001)

            async def flush() -> None:
                await w.flush()
                seen.append(f"flushed {w.usage.get(1, Usage()).bytes}")

            async def settled() -> None:
                await w.settled(chunk(1, 0).key)
                seen.append(f"settled {w.usage.get(1, Usage()).bytes}")

            nursery.start_soon(flush)
            nursery.start_soon(settled)
            await trio.testing.wait_all_tasks_blocked()
            seen.append("gate")
            gate.set()
            with trio.fail_after(30):
                while len(seen) < 3:
                    await trio.sleep(0.001)
            nursery.cancel_scope.cancel()
        w.close()

    trio.run(main)
    assert seen[0] == "gate" and sorted(seen[1:]) == ["flushed 100", "settled 100"]


def test_run_batches_offers_within_the_batch_window(
    store: WritableStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = AdmitSpy(store, monkeypatch)

    async def main() -> None:
        w = make_writer(store, batch_seconds=0.05)
        flushes = Flushes(w)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(w.run)
            await trio.testing.wait_all_tasks_blocked()
            t0 = trio.current_time()
            for i in range(5):
                w.offer(chunk(1, i))
                await trio.sleep(0.001)  # offers trickle in (virtual time)
            await flushes.wait()
            assert spy.batches == [5], "five offers, one txn"
            assert flushes.ended[0] - t0 >= 0.05 - 1e-9, "waited for the batch window"
            assert flushes.ended[0] - t0 < 0.05 + 0.01
            nursery.cancel_scope.cancel()
        check(store, w.usage)
        assert w.usage[1] == Usage(500, 5)

    run(main)


def test_run_flushes_early_when_the_queue_is_a_batch_from_full(
    store: WritableStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = AdmitSpy(store, monkeypatch)
    size = len(chunk(1, 0).value)

    async def main() -> None:
        w = make_writer(store, batch_bytes=size, queue_bytes=4 * size, batch_seconds=10)
        flushes = Flushes(w)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(w.run)
            await trio.testing.wait_all_tasks_blocked()
            t0 = trio.current_time()
            for i in range(3):
                w.offer(chunk(1, i))
            await flushes.wait()
            assert trio.current_time() - t0 < 1, "did not wait for the 10 s window"
            assert spy.batches == [1, 1, 1], "in txns of batch_bytes"
            nursery.cancel_scope.cancel()

    run(main)


def test_run_holds_the_queue_while_offers_keep_coming(
    store: WritableStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream of offers (a cold read) is written once it pauses, in txns of at most
    batch_bytes; one that never pauses is written HOLD_SECONDS after its first offer."""
    from dataclasses import replace

    from silofs.node.writer import HOLD_SECONDS

    spy = AdmitSpy(store, monkeypatch)
    size = len(chunk(1, 0).value)

    async def main() -> None:
        w = make_writer(store, batch_bytes=3 * size, batch_seconds=0.05)
        flushes = Flushes(w)
        flushed = flushes.began
        async with trio.open_nursery() as nursery:
            nursery.start_soon(w.run)
            await trio.testing.wait_all_tasks_blocked()
            t0 = trio.current_time()
            for i in range(10):  # 0.04 s apart: never a pause of batch_seconds
                w.offer(replace(chunk(1, i), streamed=True))
                await trio.sleep(0.04)
            assert flushed == [], "written while offers kept coming"
            await flushes.wait(1)
            assert spy.batches == [3, 3, 3, 1]
            assert 0.41 - 1e-9 <= flushed[0] - t0 <= 0.42
            # Offers that never pause: written HOLD_SECONDS after the first.
            t1 = trio.current_time()
            i = 10
            while not len(flushed) > 1:
                w.offer(replace(chunk(1, i), streamed=True))
                i += 1
                await trio.sleep(0.04)
            await flushes.wait(2)
            assert HOLD_SECONDS - 1e-9 <= flushed[1] - t1 <= HOLD_SECONDS + 0.05
            nursery.cancel_scope.cancel()
        check(store, w.usage)

    run(main)


def test_random_misses_are_not_held(store: WritableStore) -> None:
    """Offers that are not a stream's chunks (small files, single-chunk misses) are
    written as they come: a held queue would serve them as hits, a cache beyond the
    dataset's allocation."""
    size = len(chunk(1, 0).value)

    async def main() -> None:
        w = make_writer(store, batch_bytes=3 * size, batch_seconds=0.05)
        flushed = Flushes(w).began
        async with trio.open_nursery() as nursery:
            nursery.start_soon(w.run)
            await trio.testing.wait_all_tasks_blocked()
            t0 = trio.current_time()
            for i in range(10):  # 0.04 s apart, as above, but not streamed
                w.offer(chunk(1, i))
                await trio.sleep(0.04)
            assert flushed and flushed[0] - t0 <= 0.05 + 1e-9, "held like a stream"
            nursery.cancel_scope.cancel()

    run(main)


def test_a_full_queue_drops_and_counts(store: WritableStore) -> None:
    size = len(chunk(1, 0).value)

    async def main() -> None:
        w = make_writer(store, queue_bytes=3 * size)
        accepted = [w.offer(chunk(1, i)) for i in range(5)]
        assert accepted == [True, True, True, False, False]
        assert w.stats.dropped_chunks == 2
        await w.flush()
        assert w.usage[1] == Usage(300, 3)
        assert w.offer(chunk(1, 10)), "room again after a flush"
        assert w.stats.dropped_chunks == 2

    run(main)


def test_offers_a_full_map_refuses_are_not_counted_as_over_quota(tmp_path: Path) -> None:
    # Status and metrics say why offers were not admitted: "rejected" means the dataset
    # was over its quota, which a full disk budget is not.
    small = WritableStore(str(tmp_path / "small"), 1 << 20)

    async def main() -> None:
        w = make_writer(small)
        for i in range(80):
            w.offer(chunk(1, i, size=20_000))
        await w.flush()
        s = w.stats
        assert (s.admitted_chunks, s.rejected_chunks, s.map_full_chunks) == (0, 0, 80)
        assert s.map_full >= 1 and s.damaged_chunks == 0

    try:
        run(main)
    finally:
        small.close()


def test_a_write_in_several_txns_stops_at_the_full_map(tmp_path: Path) -> None:
    small = WritableStore(str(tmp_path / "small"), 1 << 20)

    async def main() -> None:
        w = make_writer(small, batch_bytes=100_000)  # 4 chunks a txn
        for i in range(80):
            w.offer(chunk(1, i, size=20_000))
        await w.flush()
        s = w.stats
        assert s.admitted_chunks > 0 and s.rejected_chunks == 0
        assert s.admitted_chunks + s.map_full_chunks == 80
        assert s.map_full == 1, "no txn tried after the first that hit the full map"
        assert w.pending_chunks() == 0
        check(small, w.usage)

    try:
        run(main)
    finally:
        small.close()


def test_writer_respects_the_quota(store: WritableStore) -> None:
    async def main() -> None:
        w = make_writer(store, QuotaPolicy(550))
        for i in range(10):
            w.offer(chunk(1, i))
        await w.flush()
        assert (w.stats.admitted_chunks, w.stats.rejected_chunks) == (5, 5)
        assert w.usage[1] == Usage(500, 5)
        check(store, w.usage)

    run(main)


def test_shrink_evicts_random_chunks(store: WritableStore) -> None:
    async def main() -> None:
        w = make_writer(store)
        for i in range(100):
            w.offer(chunk(1, i))
        for i in range(20):
            w.offer(chunk(2, i))
        await w.flush()
        others = owned(store, 2)
        freed = await w.shrink(1, 2500)
        assert freed == 7500 and w.stats.evicted_bytes == 7500
        assert w.usage[1] == Usage(2500, 25)
        assert owned(store, 2) == others
        check(store, w.usage)
        assert await w.shrink(1, 2500) == 0

    run(main)


def test_usage_dict_is_updated_in_place(store: WritableStore) -> None:
    # Other components (status, excess) hold the same dict object.
    async def main() -> None:
        usage = store.load_usage()
        pol = QuotaPolicy(1 << 30)
        w = Writer(
            store,
            usage,
            lambda: pol,
            batch_bytes=1 << 20,
            batch_seconds=0.05,
            queue_bytes=1 << 20,
            sync_seconds=math.inf,
        )
        w.offer(chunk(1, 0))
        await w.flush()
        assert usage is w.usage and usage == {1: Usage(100, 1)}
        await w.shrink(1, 0)
        assert usage.get(1, Usage()) == Usage()

    run(main)


def test_call_serialises_with_other_writes(store: WritableStore) -> None:
    async def main() -> None:
        w = make_writer(store)
        release = threading.Event()
        started = threading.Event()
        order: list[str] = []

        def slow() -> str:
            order.append("slow start")
            started.set()
            assert release.wait(10)
            order.append("slow end")
            return "slow"

        def quick() -> str:
            order.append("quick")
            return "quick"

        results: dict[str, object] = {}

        async def do(name: str, fn: Callable[[], object]) -> None:
            results[name] = await w.call(fn)

        async def flush() -> None:
            await w.flush()
            order.append("flush")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(do, "slow", slow)
            assert await trio.to_thread.run_sync(started.wait, 10)
            nursery.start_soon(do, "quick", quick)
            await trio.testing.wait_all_tasks_blocked()  # queued first: the lock is FIFO
            w.offer(chunk(1, 0))
            nursery.start_soon(flush)
            await trio.testing.wait_all_tasks_blocked()
            # Both wait for the lock while the slow write holds it.
            assert w._lock.locked() and w._lock.statistics().tasks_waiting == 2
            assert order == ["slow start"]
            release.set()
        assert order == ["slow start", "slow end", "quick", "flush"]
        assert results == {"slow": "slow", "quick": "quick"}
        check(store, w.usage)

    run(main)


def test_a_failed_batch_shows_in_the_stats_until_a_batch_commits(
    store: WritableStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A full disk (or an I/O error) fails the admission txn: status says so while it
    # lasts (writer.error, one line), not only the daemon's log, and the next batch
    # committed clears it.
    async def main() -> None:
        w = make_writer(store)
        real = store.admit

        def full(*args: object) -> object:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(store, "admit", full)
        w.offer(chunk(1, 0))
        with pytest.raises(OSError):
            await w.flush()
        assert w.stats.failed_batches == 1
        assert w.stats.error is not None and "No space left" in w.stats.error
        assert "\n" not in w.stats.error
        monkeypatch.setattr(store, "admit", real)
        w.offer(chunk(1, 1))
        await w.flush()
        assert w.stats.error is None and w.stats.admitted_chunks == 1
        assert w.stats.failed_batches == 1

    run(main)


def test_a_failed_write_leaves_usage_equal_to_the_committed_rows(
    store: WritableStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An eviction that commits some txns and then fails (disk error, full map) must not
    # leave the writer's usage at the pre-eviction numbers: admission would then think
    # the dataset holds more than it does, until a restart.
    async def main() -> None:
        w = make_writer(store)
        for i in range(50):
            w.offer(chunk(1, i))
        await w.flush()
        real = store.evict_random

        def evict_then_fail(dsid: int, target: int, usage: dict[int, Usage]) -> int:
            real(dsid, 3000, usage)  # committed
            raise OSError("disk error after the first txn")

        monkeypatch.setattr(store, "evict_random", evict_then_fail)
        with pytest.raises(OSError):
            await w.shrink(1, 0)
        assert w.usage == store.load_usage() == {1: Usage(3000, 30)}
        check(store, w.usage)

    run(main)


def test_sync_loop_syncs_periodically(
    store: WritableStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = trio.testing.MockClock()  # moved by hand: the sync runs in a thread
    syncs: list[float] = []
    monkeypatch.setattr(store, "sync", lambda: None)

    async def main() -> None:
        w = make_writer(store, sync_seconds=5.0)
        synced = trio.Event()
        real_call = w.call

        async def call(fn: Callable[..., object], *args: object) -> object:
            result = await real_call(fn, *args)
            if fn == store.sync:
                syncs.append(trio.current_time())
                synced.set()  # the loop's next step is its sleep: no checkpoint between
            return result

        w.call = call  # type: ignore[method-assign]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(w.sync_loop)
            for _ in range(3):
                await trio.testing.wait_all_tasks_blocked()
                clock.jump(4.9)
                await trio.testing.wait_all_tasks_blocked()
                assert not synced.is_set(), "synced early"
                clock.jump(0.1)
                await synced.wait()
                synced = trio.Event()
            nursery.cancel_scope.cancel()
        assert syncs == pytest.approx([5.0, 10.0, 15.0])

    trio.run(main, clock=clock)


def test_uncharging_never_goes_below_zero(store: WritableStore) -> None:
    # A damaged owners row claiming more bytes than charged must not wedge the writer.
    usage: dict[int, Usage] = {1: Usage(100, 1)}
    with store.env.begin(write=True) as txn:
        store._uncharge(txn, 1, b"\0" * 24, 1 << 30, usage)
    assert usage[1] == Usage(0, 0)
    assert store.load_usage()[1] == Usage(0, 0)


# -- one LRU over the shared pool (Alluxio-like) -------------------------------------------
def test_unallocated_lru_datasets_share_one_lru(store: WritableStore) -> None:
    # A pool of 1000 bytes, datasets 1 and 2 in LRU mode with no allocation, 3 uniform.
    # Dataset 1 fills the pool, then uses chunks 5-9 again; dataset 2's chunks then push
    # out dataset 1's least recently used (0, 1, 2), not its own and not nothing (were each
    # dataset kept to its first-come share, 2 would admit nothing).
    policy = QuotaPolicy(1000, lru=frozenset({1, 2}))

    async def main() -> None:
        w = make_writer(store, policy)
        for i in range(10):
            w.offer(chunk(1, i))
        await w.flush()
        assert w.usage[1] == Usage(1000, 10)
        await w.touch(1, [chunk(1, i).key for i in range(5, 10)])
        for i in range(3):
            w.offer(chunk(2, i))
        await w.flush()
        assert w.usage[1] == Usage(700, 7) and w.usage[2] == Usage(300, 3)
        kept = owned(store, 1)
        assert {chunk(1, i).key for i in (0, 1, 2)}.isdisjoint(kept)
        assert {chunk(1, i).key for i in range(3, 10)} == kept
        assert w.stats.evicted_bytes == 300
        check(store, w.usage)

    run(main)


def test_pooled_lru_never_evicts_uniform_or_allocated_datasets(store: WritableStore) -> None:
    # 1000 bytes: dataset 4 (LRU) has its own 200 allocation; of the 800 left, dataset 3
    # (uniform, no allocation) holds 400, and 1 and 2 (LRU) share the other 400.
    policy = QuotaPolicy(1000, {4: 200}, lru=frozenset({1, 2, 4}))

    async def main() -> None:
        w = make_writer(store, policy)
        for i in range(4):
            w.offer(chunk(3, i))
        for i in range(2):
            w.offer(chunk(4, i))
        await w.flush()
        for i in range(6):
            w.offer(chunk(1, i))
        await w.flush()
        assert w.usage[1] == Usage(400, 4)  # the newest that fit
        for i in range(2):
            w.offer(chunk(2, i))
        await w.flush()
        assert w.usage[1] == Usage(200, 2) and w.usage[2] == Usage(200, 2)
        assert w.usage[3] == Usage(400, 4) and w.usage[4] == Usage(200, 2)
        check(store, w.usage)

    run(main)


def test_run_gives_the_heap_back_once_idle_after_writing(
    store: WritableStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from silofs import heap
    from silofs.node.writer import IDLE_GIVE_BACK_SECONDS

    given: list[int] = []
    monkeypatch.setattr(heap, "give_back", lambda: given.append(1))

    async def main() -> None:
        w = make_writer(store, batch_seconds=0.05)
        flushes = Flushes(w)

        async def given_after(n: int) -> float:
            t0 = trio.current_time()
            while len(given) < n:
                await trio.sleep(0.01)
            return trio.current_time() - t0

        async with trio.open_nursery() as nursery:
            nursery.start_soon(w.run)
            await trio.sleep(3 * IDLE_GIVE_BACK_SECONDS)
            assert given == [], "nothing admitted: nothing to give back"
            for n in (1, 2):
                w.offer(chunk(1, n))
                await flushes.wait(n)
                assert await given_after(n) >= IDLE_GIVE_BACK_SECONDS - 0.02
                await trio.sleep(3 * IDLE_GIVE_BACK_SECONDS)
                assert len(given) == n, "once per idle spell"
            nursery.cancel_scope.cancel()

    run(main)


def test_silofs_ctl_status_names_a_failed_admission() -> None:
    from silofs_ctl.node_cmds import render_status

    node = {"cached_bytes": 0, "cache_size": 1 << 30, "cache_dir": "/c", "writer": {"error": None}}
    s = {"node": node, "datasets": [], "jobs": [], "mounts": []}
    assert "admission failed" not in render_status(s)
    node["writer"]["error"] = "OSError: [Errno 28] No space left on device"
    line = next(x for x in render_status(s).splitlines() if "last admission failed" in x)
    assert "No space left on device" in line
