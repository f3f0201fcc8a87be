"""How pyfuse3's worker tasks take turns at /dev/fuse: one reads while every hit is served.

pyfuse3's loop (3.x, `_session_loop`) runs worker tasks that each wait for the device
under one trio.Lock, receive a request, and await its handler. It starts another task
whenever one receives a request while no other waits, so after the first request a
mount runs two, and with trio's fair lock they take turns per request: the one that
received parks on the lock, the other is handed it and woken (a park, an unpark and a
scheduler pass per request, ~12% of a 4-reader mount's samples), and each acquire is a
checkpoint of its own. A filesystem whose handlers never wait can bound the loop to one
task; silofs cannot, since a miss waits for the daemon and must never hold up a hit.

`install` replaces that lock with a `TurnLock` (pyfuse3 looks trio up at call time, as
forked.py also uses): taking it when free costs no checkpoint, and releasing it wakes
nobody while at most one task is parked on it, so the task that just received keeps the
device for its next request and the other one stays parked. The turn passes only when
it must:

- a task whose step ends while the lock is free and a task is parked on it (its handler
  waits: a miss, a fault-in, a listing not there yet; or it left pyfuse3's loop, as when
  the kernel ends the session) hands the lock on before any other task runs
  (`_PassTurn`, a trio instrument: no wrapper per request);
- with two or more tasks parked, a release hands the lock on (pyfuse3 ends a task once
  more than `min_tasks` wait: without a holder none of them would ever wake again);
- a release during an exception (the session closed, a cancellation) hands it on, so
  the parked tasks see the end too.

The lock is free with a task parked on it only between the receiving task's release and
its next acquire, which it runs without yielding unless its handler waits; a parked task
waits with no timeout of its own, and a backstop task hands a lock left free on once
every PARK_SECONDS (a step the instrument never saw end). Also,
`wait_readable` returns at once when a request is already queued on the device, up to
STREAK times in a row, without a trip through trio's scheduler and epoll. Never changes
what a request is answered, nor which requests are read.
"""

from __future__ import annotations

import select
from typing import Any

import pyfuse3
import trio

# How often a backstop task looks whether the lock was left free with a task parked on
# it (the instrument hands the lock on at once): one wakeup of the mount per period,
# where a timeout armed on every park cost each miss a deadline set and cleared.
PARK_SECONDS = 1.0
# Requests a task may take from the device in a row without yielding to trio when each
# was already queued (_Lowlevel.wait_readable).
STREAK = 8


class TurnLock:
    """pyfuse3's read lock: one task waits for the device at a time (module docstring)."""

    __slots__ = ("_held", "_lot")

    def __init__(self) -> None:
        self._held = False
        self._lot = trio.lowlevel.ParkingLot()

    async def __aenter__(self) -> None:
        if not self._held:
            self._held = True  # no checkpoint: the wait for the device that follows is one
            return
        await self._lot.park()  # woken holding it (_hand_on, pass_turn, _backstop)

    async def __aexit__(self, exc_type: object, *_: object) -> None:
        if exc_type is not None or len(self._lot) > 1:
            self._hand_on()
        else:
            self._held = False

    def _hand_on(self) -> None:
        # Ownership passes with the wakeup, as trio.Lock does: nobody can take it between.
        self._held = bool(self._lot.unpark(count=1))

    def pass_turn(self) -> None:
        """If the lock is free and a task is parked on it: wake that one holding it."""
        if not self._held and self._lot:
            self._held = True
            self._lot.unpark(count=1)


_lock: TurnLock | None = None


def _new_lock() -> TurnLock:
    global _lock
    _lock = TurnLock()
    return _lock


class _PassTurn(trio.abc.Instrument):
    """After every task step: a free lock with a task parked on it passes to that task
    (the step's task received the last request and now waits, or left the loop)."""

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        lock = _lock
        if lock is not None and not lock._held and lock._lot:
            lock.pass_turn()


class _Lowlevel:
    """trio.lowlevel as pyfuse3 sees it: wait_readable returns at once, without a trip
    through trio's scheduler and epoll, when a request is already queued on the device
    (a poll with no timeout), at most STREAK times in a row: then it waits through trio
    as before, so the mount's other tasks (replies from the daemon, reports) still run."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self._poll = select.poll()
        self._fd = -1
        self._streak = 0

    async def wait_readable(self, fd: int) -> None:
        if self._streak < STREAK:
            if fd != self._fd:
                if self._fd >= 0:
                    self._poll.unregister(self._fd)
                self._poll.register(fd, select.POLLIN)
                self._fd = fd
            if self._poll.poll(0):
                self._streak += 1
                return
        self._streak = 0
        await self._real.wait_readable(fd)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _Trio:
    """trio as pyfuse3 sees it: the same, but for Lock and lowlevel.wait_readable."""

    Lock = staticmethod(_new_lock)

    def __init__(self, real: Any) -> None:
        self._real = real
        self.lowlevel = _Lowlevel(real.lowlevel)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def install() -> None:
    """From inside the trio run that will call pyfuse3.main(): have pyfuse3 take turns
    at the device with a TurnLock. pyfuse3 makes its lock on its first wait for the
    device after init(), so call it before that."""
    if not isinstance(pyfuse3.trio, _Trio):  # type: ignore[attr-defined]
        pyfuse3.trio = _Trio(pyfuse3.trio)  # type: ignore[attr-defined]
    trio.lowlevel.add_instrument(_PassTurn())
    trio.lowlevel.spawn_system_task(_backstop, name="silofs.turns.backstop")


async def _backstop() -> None:
    """Every PARK_SECONDS: a lock left free with a task parked on it passes to that
    task (what the instrument does after every step; this only covers a step it never
    saw end, so no parked task waits longer than this for a free lock)."""
    while True:
        await trio.sleep(PARK_SECONDS)
        lock = _lock
        if lock is not None:
            lock.pass_turn()
