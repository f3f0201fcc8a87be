"""Single-flight: one call per key at a time, its outcome shared by whoever waits.

Owns the one rule both processes use for misses (the daemon per chunk GET, a mount per
chunk request to the daemon): callers that ask for a key already in flight wait for
that call and get its result, or its exception if it failed; if the leader was
cancelled (its client went away), the next waiter leads a new call rather than inherit
nothing. Never retries and never caches a result beyond the call.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import trio

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass
class _Flight(Generic[V]):
    done: trio.Event = field(default_factory=trio.Event)
    finished: bool = False
    value: V | None = None
    error: Exception | None = None


class SingleFlight(Generic[K, V]):
    def __init__(self) -> None:
        self._flights: dict[K, _Flight[V]] = {}

    def __contains__(self, key: K) -> bool:
        return key in self._flights

    async def run(self, key: K, call: Callable[[], Awaitable[V]]) -> tuple[V, bool]:
        """(value, whether this caller made the call)."""
        while (flight := self._flights.get(key)) is not None:
            await flight.done.wait()
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
            flight.done.set()
