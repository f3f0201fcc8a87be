"""Per-job remote-IO token bucket with a rate settable at runtime (promise 2).

Owns the pacing of remote GETs: charge(n) returns when the job may fetch n more bytes.
Requests queue FIFO; a rate change wakes the head of the queue, which recomputes its
wait under the new rate, so queued requests are neither lost nor reordered. A wait is
never cut: 0 is a pause (promise 2) and a tiny rate is as slow as it says. What a user
sees instead: the charges waiting now and the age of the oldest (status, metrics), and
one line per job and rate once a charge has waited STALL_SECONDS (INFO for 0: a pause is
how a controller works; WARNING for a rate > 0, too small for what is asked), then an
INFO line when that charge goes through. A cancelled charge (its reader went away) leaves the
queue and is not charged. Never performs I/O and never decides rates (the control API
does).
"""

from __future__ import annotations

import itertools
import logging

import trio

from silofs.units import format_duration, format_rate, format_size

log = logging.getLogger(__name__)

# A charge waiting this long is said once per job and rate (a pause, or a rate so small
# that a chunk takes minutes, is otherwise silent: the reader just blocks).
STALL_SECONDS = 10.0


class TokenBucket:
    """Tokens are bytes. A charge may take the balance negative (a chunk is larger than
    the burst); later charges wait until the debt is repaid, so the long-run rate holds
    exactly while a single request never waits for more than its own size."""

    def __init__(self, rate: float | None, burst_seconds: float = 0.05, job: str = "") -> None:
        self.job = job  # named in the stall log line; "" (a serve cap): not logged
        self._rate = rate  # bytes/s; None = unlimited, 0 = no remote IO at all
        self._burst_seconds = burst_seconds
        self._tokens = 0.0
        self._last = trio.current_time()
        self._lock = trio.Lock()  # trio.Lock is fair: FIFO order of waiters
        self._changed = trio.Event()
        self.waited_seconds = 0.0
        self.charged_bytes = 0
        # Charges under way, by arrival, with their start: the first is the oldest
        # (FIFO; a cancelled one leaves from anywhere).
        self._waiting: dict[int, float] = {}
        self._ids = itertools.count()
        self._stall_told = False  # this rate's stall was logged

    @property
    def waiting(self) -> int:
        """Charges waiting now (a reader, a read-ahead, a warm or prefetch GET each)."""
        return len(self._waiting)

    def oldest_wait(self) -> float:
        """Seconds the oldest charge under way has waited (0 if none)."""
        if not self._waiting:
            return 0.0
        return trio.current_time() - next(iter(self._waiting.values()))

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
        self._stall_told = False  # a new rate's stall is told again
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
        me = next(self._ids)
        self._waiting[me] = start
        told = False
        try:
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
                    now = trio.current_time()
                    if self.job and not self._stall_told:
                        # Woken at the stall mark to say so, then waiting on.
                        wait = min(wait, max(0.0, start + STALL_SECONDS - now))
                        if now - start >= STALL_SECONDS:
                            self._stall_told = told = True
                            self._tell_stall(n, now - start)
                            continue
                    with trio.move_on_after(wait):
                        await self._changed.wait()
        finally:
            del self._waiting[me]
        self.charged_bytes += n
        waited = trio.current_time() - start
        self.waited_seconds += waited
        if told:
            log.info(
                "job %s: a fetch went through after waiting %s on its remote IO allocation",
                self.job,
                format_duration(waited),
            )

    def _tell_stall(self, n: int, waited: float) -> None:
        rate = self._rate or 0
        if rate == 0:
            why = "its remote IO allocation is 0 (paused): it waits for a raise"
        else:
            need = max(0.0, -self._tokens) / rate
            why = (
                f"its remote IO allocation is {format_rate(rate)}: "
                f"this fetch waits about {format_duration(need)} more"
            )
        log.log(
            logging.INFO if rate == 0 else logging.WARNING,
            "job %s: a fetch of %s has waited %s; %s (silofs-ctl allocate-io %s RATE, "
            "or --clear; a waiting reader can be interrupted or killed)",
            self.job,
            format_size(n),
            format_duration(waited),
            why,
            self.job,
        )
