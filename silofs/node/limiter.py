"""Per-job remote-IO token bucket with a rate settable at runtime (promise 2).

Owns the pacing of remote GETs: charge(n) returns when the job may fetch n more bytes.
Requests queue FIFO; a rate change wakes the head of the queue, which recomputes its
wait under the new rate, so queued requests are neither lost nor reordered. Never
performs I/O and never decides rates (the control API does).
"""

from __future__ import annotations

import logging

import trio

log = logging.getLogger(__name__)


class TokenBucket:
    """Tokens are bytes. A charge may take the balance negative (a chunk is larger than
    the burst); later charges wait until the debt is repaid, so the long-run rate holds
    exactly while a single request never waits for more than its own size."""

    def __init__(self, rate: float | None, burst_seconds: float = 0.05) -> None:
        self._rate = rate  # bytes/s; None = unlimited, 0 = no remote IO at all
        self._burst_seconds = burst_seconds
        self._tokens = 0.0
        self._last = trio.current_time()
        self._lock = trio.Lock()  # trio.Lock is fair: FIFO order of waiters
        self._changed = trio.Event()
        self.waited_seconds = 0.0
        self.charged_bytes = 0

    @property
    def rate(self) -> float | None:
        return self._rate

    def _burst(self) -> float:
        return (self._rate or 0) * self._burst_seconds

    def _refill(self) -> None:
        now = trio.current_time()
        if self._rate:
            self._tokens = min(self._burst(), self._tokens + (now - self._last) * self._rate)
        self._last = now

    def set_rate(self, rate: float | None) -> None:
        self._refill()  # bytes earned so far are earned at the old rate
        self._rate = rate
        if rate is None:
            self._tokens = 0.0
        self._changed.set()
        self._changed = trio.Event()

    async def charge(self, n: int) -> None:
        if n <= 0:
            return
        if self._rate is None and not self._lock.locked():
            # Unlimited and nobody queued: no lock, no wait to count. Taking the lock
            # would count the loop's scheduling delay as limiter wait.
            self.charged_bytes += n
            return
        start = trio.current_time()
        async with self._lock:
            while True:
                self._refill()
                if self._rate is None:
                    break
                # A debt worth less than a nanosecond is paid: waking at the computed
                # deadline leaves float dust of either sign, which must not cost
                # another wait.
                if self._rate > 0 and self._tokens >= -self._rate * 1e-9:
                    self._tokens -= n
                    break
                wait = float("inf") if self._rate == 0 else -self._tokens / self._rate
                with trio.move_on_after(wait):
                    await self._changed.wait()
        self.charged_bytes += n
        self.waited_seconds += trio.current_time() - start
