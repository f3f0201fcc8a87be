"""The per-job token bucket (silofs/limiter.py) on trio's MockClock.

Owns promise 2's arithmetic: the long-run rate is the allocation (within 1 %) whatever
the charge sizes, 0 blocks until raised, a rate change reaches queued waiters within one
wait without losing or reordering them, None never waits, and the waiting is accounted.
Virtual time only: no test here sleeps for real.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing

from silofs.node.limiter import STALL_SECONDS, TokenBucket

MiB = 1 << 20


def run(fn: Callable[[], Awaitable[None]]) -> None:
    trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("rate", "sizes"),
    [
        (10e6, [4 * MiB] * 200),  # whole chunks
        (10e6, [1000] * 20_000),  # tiny reads, smaller than the burst
        (1e9, [4 * MiB] * 500),  # fast link
        (3e6, "mixed"),  # a mix of sizes around the burst
        (100.0, [7] * 2000),  # very slow
        (50e6, [64 * MiB] * 20),  # charges far larger than the burst
    ],
)
def test_long_run_rate_is_exact(rate: float, sizes: list[int] | str) -> None:
    rng = random.Random(7)
    charges = (
        [rng.choice([1, 100, 4096, 150_000, 1 * MiB, 4 * MiB]) for _ in range(2000)]
        if sizes == "mixed"
        else sizes
    )
    assert isinstance(charges, list)

    async def main() -> None:
        bucket = TokenBucket(rate)
        t0 = trio.current_time()
        for n in charges:
            await bucket.charge(n)
        elapsed = trio.current_time() - t0
        # The last charge went out on credit; the bytes before it took `elapsed`.
        achieved = (sum(charges) - charges[-1]) / elapsed
        assert achieved == pytest.approx(rate, rel=0.01)
        assert bucket.charged_bytes == sum(charges)

    run(main)


@pytest.mark.parametrize(("rate", "size"), [(3e6, 4 * MiB), (1e9, 4 * MiB), (7.0, 3)])
def test_each_charge_waits_exactly_the_previous_debt(rate: float, size: int) -> None:
    # No spurious extra wait: back-to-back charges go out at exactly i * size / rate.
    async def main() -> None:
        bucket = TokenBucket(rate)
        t0 = trio.current_time()
        times = []
        for _ in range(60):
            await bucket.charge(size)
            times.append(trio.current_time() - t0)
        expected = [i * size / rate for i in range(60)]
        assert times == pytest.approx(expected, rel=1e-9, abs=1e-9)

    run(main)


def test_long_run_rate_with_concurrent_jobs_sharing_a_bucket() -> None:
    rate = 20e6

    async def main() -> None:
        bucket = TokenBucket(rate)
        done: list[float] = []

        async def reader(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(100):
                await bucket.charge(rng.choice([64 << 10, 1 * MiB, 4 * MiB]))
            done.append(trio.current_time())

        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            for seed in range(8):
                nursery.start_soon(reader, seed)
        elapsed = max(done) - t0
        assert bucket.charged_bytes / elapsed == pytest.approx(rate, rel=0.01)

    run(main)


def test_idle_time_earns_at_most_the_burst() -> None:
    async def main() -> None:
        bucket = TokenBucket(1000.0, burst_seconds=0.05)
        await bucket.charge(1)  # settles the start
        await trio.sleep(3600)  # idle for an hour: earns 50 bytes, not 3.6 MB
        t = trio.current_time()
        await bucket.charge(50)  # spends the 50 earned bytes at once
        await bucket.charge(1000)  # the balance is 0, not negative: goes at once too
        assert trio.current_time() == pytest.approx(t, abs=1e-9)
        await bucket.charge(1000)  # now it waits for the previous 1000
        assert trio.current_time() - t == pytest.approx(1.0, abs=1e-6)

    run(main)


def test_rate_zero_blocks_until_raised() -> None:
    async def main() -> None:
        bucket = TokenBucket(0)
        finished: list[float] = []

        async def fetch() -> None:
            await bucket.charge(4096)
            finished.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fetch)
            await trio.sleep(24 * 3600)  # a day of virtual time
            assert finished == []
            bucket.set_rate(0)  # still zero: still blocked
            await trio.sleep(60)
            assert finished == []
            t = trio.current_time()
            bucket.set_rate(1000)
        assert finished == [pytest.approx(t, abs=1e-6)]
        assert bucket.waited_seconds == pytest.approx(24 * 3600 + 60, abs=1e-3)

    run(main)


def test_rate_zero_set_mid_run_holds_queued_waiters() -> None:
    async def main() -> None:
        bucket = TokenBucket(1000.0)
        finished: list[tuple[int, float]] = []

        async def fetch(i: int) -> None:
            await bucket.charge(1000)
            finished.append((i, trio.current_time()))

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(fetch, i)
                await trio.testing.wait_all_tasks_blocked()
            await trio.sleep(0.5)
            bucket.set_rate(0)
            await trio.sleep(100)
            assert [i for i, _ in finished] == [0]
            bucket.set_rate(1000.0)
        # Fetch 1 had earned 500 of its 1000 bytes when the rate went to 0.
        assert [i for i, _ in finished] == [0, 1, 2]
        assert finished[1][1] == pytest.approx(100.5 + 0.5, abs=2e-3)
        assert finished[2][1] == pytest.approx(100.5 + 1.5, abs=2e-3)

    run(main)


@pytest.mark.parametrize("new_rate", [10_000.0, 100.0])
def test_set_rate_reaches_queued_waiters_in_fifo_order(new_rate: float) -> None:
    async def main() -> None:
        bucket = TokenBucket(1000.0)
        finished: list[tuple[int, float]] = []

        async def fetch(i: int) -> None:
            await bucket.charge(1000)
            finished.append((i, trio.current_time()))

        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(fetch, i)
                await trio.testing.wait_all_tasks_blocked()  # queue in this order
            await trio.sleep(0.5)
            bucket.set_rate(new_rate)
        order = [i for i, _ in finished]
        assert order == list(range(6)), "no waiter lost or reordered"
        times = [t - t0 for _, t in finished]
        # Fetch 0 went at once (debt 1000). At 0.5 s, 500 bytes of that debt remained;
        # the head of the queue recomputes its wait under the new rate right away.
        expect = [0.0, 0.5 + 500 / new_rate]
        for _ in range(4):
            expect.append(expect[-1] + 1000 / new_rate)
        assert times == pytest.approx(expect, abs=2e-3)

    run(main)


def test_unlimited_never_waits() -> None:
    async def main() -> None:
        bucket = TokenBucket(None)
        t = trio.current_time()
        for n in (1, 4 * MiB, 1 << 40, 7):
            await bucket.charge(n)
        assert trio.current_time() == t
        assert bucket.waited_seconds == 0
        assert bucket.charged_bytes == 1 + 4 * MiB + (1 << 40) + 7
        assert bucket.rate is None

    run(main)


def test_switching_to_unlimited_releases_everyone() -> None:
    async def main() -> None:
        bucket = TokenBucket(10.0)
        finished: list[int] = []

        async def fetch(i: int) -> None:
            await bucket.charge(1 * MiB)
            finished.append(i)

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(fetch, i)
                await trio.testing.wait_all_tasks_blocked()
            await trio.sleep(1)
            t = trio.current_time()
            bucket.set_rate(None)
        assert finished == [0, 1, 2, 3]
        assert trio.current_time() == pytest.approx(t, abs=1e-6)
        # And back to a rate: the debt did not survive the unlimited period.
        bucket.set_rate(1000.0)
        t = trio.current_time()
        await bucket.charge(1000)
        await bucket.charge(1000)
        assert trio.current_time() - t == pytest.approx(1.0, abs=2e-3)

    run(main)


def test_waited_seconds_and_charged_bytes() -> None:
    async def main() -> None:
        bucket = TokenBucket(1000.0, burst_seconds=0.0)
        for _ in range(5):
            await bucket.charge(1000)  # waits 0, 1, 1, 1, 1
        assert bucket.waited_seconds == pytest.approx(4.0, abs=5e-3)
        assert bucket.charged_bytes == 5000
        await bucket.charge(0)
        await bucket.charge(-5)
        assert bucket.charged_bytes == 5000
        # Concurrent waiters each count their own wait: 1 + 2 + 3 seconds.
        before = bucket.waited_seconds
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(bucket.charge, 1000)
        assert bucket.waited_seconds - before == pytest.approx(1 + 2 + 3, abs=1e-2)

    run(main)


def test_a_cancelled_waiter_leaves_the_queue_intact() -> None:
    async def main() -> None:
        bucket = TokenBucket(1000.0)
        finished: list[tuple[int, float]] = []

        async def fetch(i: int, scope: trio.CancelScope | None = None) -> None:
            with scope or trio.CancelScope():
                await bucket.charge(1000)
                finished.append((i, trio.current_time()))

        t0 = trio.current_time()
        scope = trio.CancelScope()
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(fetch, i, scope if i == 1 else None)
                await trio.testing.wait_all_tasks_blocked()
            await trio.sleep(0.25)
            scope.cancel()  # fetch 1, the head of the queue, gives up
        assert [i for i, _ in finished] == [0, 2]
        # The cancelled request charged nothing: fetch 2 waited only for fetch 0's debt.
        assert finished[1][1] - t0 == pytest.approx(1.0, abs=2e-3)
        assert bucket.charged_bytes == 2000

    run(main)


def test_charges_under_way_and_the_oldest_wait_are_shown() -> None:
    # What status and metrics show of a pause: how many fetches wait, and since when.
    async def main() -> None:
        bucket = TokenBucket(0, job="j")
        assert bucket.waiting == 0 and bucket.oldest_wait() == 0.0
        first = trio.CancelScope()

        async def fetch(n: int, scope: trio.CancelScope | None = None) -> None:
            with scope or trio.CancelScope():
                await bucket.charge(n)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fetch, 1000, first)
            await trio.sleep(5)
            nursery.start_soon(fetch, 500)
            await trio.sleep(2)
            assert bucket.waiting == 2
            assert bucket.oldest_wait() == pytest.approx(7.0)
            first.cancel()  # its reader went away: out of the queue, never charged
            await trio.testing.wait_all_tasks_blocked()
            assert bucket.waiting == 1
            assert bucket.oldest_wait() == pytest.approx(2.0)
            bucket.set_rate(None)
        assert bucket.waiting == 0 and bucket.oldest_wait() == 0.0
        assert bucket.charged_bytes == 500

    run(main)


def test_a_stall_is_logged_once_per_job_and_rate(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        bucket = TokenBucket(0, job="train")
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(bucket.charge, 1000)
            await trio.sleep(STALL_SECONDS - 0.5)
            assert not caplog.records  # a short pause is not news
            await trio.sleep(3600)
            told = [r.getMessage() for r in caplog.records]
            assert len(told) == 1, told  # one line for three waiting fetches, an hour
            assert "job train" in told[0] and "is 0 (paused)" in told[0]
            assert "silofs-ctl allocate-io train" in told[0]
            # INFO: a pause is how a controller runs jobs in turn, not a problem.
            assert caplog.records[0].levelname == "INFO"
            bucket.set_rate(0)  # the same pause set again: told again, once
            await trio.sleep(STALL_SECONDS + 1)
            assert len(caplog.records) == 2
            bucket.set_rate(None)
        went = [r.getMessage() for r in caplog.records[2:]]
        assert len(went) == 1 and "job train: a fetch went through" in went[0], went

    with caplog.at_level("INFO", logger="silofs.node.limiter"):
        run(main)


def test_a_tiny_rate_says_how_long_a_fetch_waits(caplog: pytest.LogCaptureFixture) -> None:
    # 1 B/s is a rate, not an error: the fetch after a 4 MiB one waits 48 days, and the
    # log says so (a typo for 1GB/s is found from that line, not from a silent hang).
    async def main() -> None:
        bucket = TokenBucket(1.0, job="j")
        await bucket.charge(4 * MiB)  # on credit: the bucket's debt is now 4 MiB
        with trio.move_on_after(60):
            await bucket.charge(4 * MiB)
        assert bucket.charged_bytes == 4 * MiB  # the second never went through
        assert bucket.waiting == 0

    with caplog.at_level("WARNING", logger="silofs.node.limiter"):
        run(main)
    (record,) = caplog.records  # a rate too small for what is asked: a WARNING
    line = record.getMessage()
    assert record.levelname == "WARNING" and "is 1B/s" in line and "about 48d" in line, line


def test_an_unnamed_bucket_never_logs(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:  # a member's serve cap (peer_serve.py), not a job
        bucket = TokenBucket(0)
        with trio.move_on_after(3 * STALL_SECONDS):
            await bucket.charge(1)

    with caplog.at_level("INFO", logger="silofs.node.limiter"):
        run(main)
    assert not caplog.records
