"""Single-flight: one call per key at a time, its outcome shared by whoever waits.

Owns the one rule both processes use for misses (the daemon per chunk GET, a mount per
chunk request to the daemon): callers that ask for a key already in flight wait for
that call and get its result, or its exception if it failed; if the leader was
cancelled (its client went away), the next waiter leads a new call rather than inherit
nothing. A leader may also claim several keys at once and settle each of them from one
call (the daemon's span GET: one range GET for several chunks). Never retries and never
caches a result beyond the call.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

import trio

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass
class _Flight(Generic[V]):
    # Made by the first waiter: most flights have none (a mount's miss is rarely asked
    # twice at once), and an Event with its parking lot per call is work for nothing.
    done: trio.Event | None = None
    finished: bool = False
    value: V | None = None
    error: Exception | None = None
    waiters: int = 0  # callers that waited for this flight's outcome

    async def wait(self) -> None:
        self.waiters += 1
        if self.done is None:
            self.done = trio.Event()
        await self.done.wait()

    def end(self) -> None:
        if self.done is not None:
            self.done.set()


class SingleFlight(Generic[K, V]):
    def __init__(self) -> None:
        self._flights: dict[K, _Flight[V]] = {}

    def __contains__(self, key: K) -> bool:
        return key in self._flights

    def claim(self, keys: list[K]) -> list[K]:
        """Lead the keys of `keys` that nobody leads yet (no await: callers check and
        claim in one step) and return them. The caller must settle() or abandon() each
        claimed key; waiters on it wait until then."""
        claimed = [k for k in keys if k not in self._flights]
        for k in claimed:
            self._flights[k] = _Flight()
        return claimed

    def settle(self, key: K, value: V | None = None, error: Exception | None = None) -> bool:
        """End a claimed key's flight with its value or its error; whether anyone waited
        for it (nobody else will get this value from here)."""
        flight = self._flights.pop(key)
        if error is None:
            flight.value, flight.finished = value, True
        else:
            flight.error = error
        flight.end()
        return flight.waiters > 0

    def abandon(self, key: K) -> None:
        """End a claimed key's flight with no outcome: a waiter leads a new call."""
        self._flights.pop(key).end()

    async def wait(self, key: K) -> tuple[V, bool] | None:
        """The outcome of the flight of `key` if one is under way: (value, False), or its
        error raised; None if none is under way or its leader abandoned it."""
        flight = self._flights.get(key)
        if flight is None:
            return None
        await flight.wait()
        if flight.error is not None:
            raise flight.error
        return (flight.value, False) if flight.finished else None  # type: ignore[return-value]

    async def run(self, key: K, call: Callable[[], Awaitable[V]]) -> tuple[V, bool]:
        """(value, whether this caller made the call)."""
        while (flight := self._flights.get(key)) is not None:
            await flight.wait()
            if flight.error is not None:
                raise flight.error
            if flight.finished:
                return flight.value, False  # type: ignore[return-value]
        flight = self._flights[key] = _Flight()
        try:
            flight.value = await call()
            flight.finished = True
            return flight.value, True
        except Exception as exc:
            flight.error = exc
            raise
        finally:
            del self._flights[key]
            flight.end()
