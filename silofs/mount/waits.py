"""Reads that wait for a process told to stop: found, and ended with EINTR.

A miss can wait a long time: its job's remote IO allocation is 0 (a pause, promise 2)
or tiny, or the store is slow. The kernel does not end such a read for its process:
pyfuse3 never passes FUSE_INTERRUPT on, and a buffered read's process waits on the
page (killable), not on the request, so for such a read the kernel sends none at all.
Left alone, Ctrl-C (a caught SIGINT, Python's KeyboardInterrupt) waits for the raise,
a reader with O_DIRECT stays in D state even after SIGKILL, and the read of a reader
that did die keeps its ask in the daemon: a waiter in the job's limiter, charged and
fetched at the raise.

Owns: the misses of this serving process's readers that wait, the look at the process behind
each one (the thread that opened its file: pyfuse3 gives read() no context, so the
opener stands for the reader) once the read has waited FIRST_LOOK, every LOOK_EVERY
after that, and ending the read (its cancel scope, or for a read that leads its chunk's
ask the abort of that request, watch(): either way its connection to the daemon closes,
and with it go the daemon's wait and charge) when that process

- is gone, or a zombie, since the first look (one gone already then is not taken for
  the reader: a file read through a descriptor its opener left behind reads on), or
- has SIGKILL pending (a kill, or any signal it does not catch that ends it: the
  kernel turns those into SIGKILL for every thread),

and in both cases no other process holds the file open under this mount (/proc/*/fd and
fdinfo, walked in a worker thread once the opener is found dying, the verdict taken at
the next look, and trusted for HOLDERS_EVERY after that: the walk reads every process's
descriptors, milliseconds here and a good part of a second on a host with tens of
thousands, and on the loop it would stall every read this process serves): the opener
may have handed it on (subprocess's stdin=f, a fork after open), and the reader is then
that other process, whom the opener's death does not stop (and the opener's pid, which
any new process may take, is not looked at again). A holder this process may not look at
(another user's, another mount namespace's) is not seen: such a read ends as before. Or
when that process

- has SIGINT, SIGTERM, SIGHUP or SIGQUIT pending, caught and not blocked, at two
  looks in a row (one look could catch a signal on its way to a running thread), in
  disk sleep (D) both times: the only state where a reader waiting on us keeps a
  caught signal pending. A stopped opener (Ctrl-Z, SIGSTOP, a debugger's stop) keeps
  one pending too, till it goes on; it is not the reader, whose read would hold it in
  D, but a parent whose child reads the file it handed on.

Other signals (SIGCHLD, timers, SIGUSR1...) never end a read: a C program that
restarts its reads (SA_RESTART) does not expect EINTR from a regular file. Never
signals a process, never answers a request itself (fs.py turns Interrupted into EINTR).
"""

from __future__ import annotations

import logging
import math
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import trio

from silofs.control.client import ABORT_HOOK, Aborted
from silofs.units import is_digits

log = logging.getLogger(__name__)

T = TypeVar("T")

FIRST_LOOK = 0.25  # seconds a read waits before its process is looked at
LOOK_EVERY = 0.25  # seconds between looks (a caught signal takes two)
# Seconds a look at who holds files open (a walk of /proc/*/fd) is trusted, at most:
# a dying opener whose file another process holds is looked at again this often, the
# walk costing a readlink per descriptor of every process this one may look at.
HOLDERS_EVERY = 5.0

_KILL = 1 << (signal.SIGKILL - 1)
_STOPPING = sum(
    1 << (s - 1) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
)


class Interrupted(Exception):
    """The process behind a waiting read is gone or told to stop: answer EINTR."""


@dataclass(eq=False, slots=True)
class _Wait:
    tid: int  # the opener's thread (FUSE's pid of the OPEN request)
    since: float
    inode: int = 0  # the file's (its st_ino); 0: unknown, no holder is looked for
    # How the read is ended: its cancel scope (wait()), or the abort of the request it
    # waits on (watch(): None while it waits on nothing that can be aborted).
    scope: trio.CancelScope | None = None
    abort: Callable[[], None] | None = None
    over: bool = False  # watch() returned: a task that inherited the hook attaches nothing
    tgid: int = 0  # its process, from the first look; 0 before
    watched: bool = True  # False: nothing to look at (no pid, or gone at the first look)
    stopping: bool = False  # a caught stopping signal was pending at the last look
    # Found gone while another process held the file: never looked at again (its pid
    # may be reused by any process meanwhile), only the file's holders are.
    gone: bool = False
    why: str = ""

    def attach(self, abort: Callable[[], None] | None) -> None:
        """ABORT_HOOK's callback: the request this read now waits on (None: none)."""
        if self.over:
            return
        self.abort = abort
        if abort is not None and self.why:  # found dying while it waited elsewhere
            abort()

    def end(self) -> None:
        if self.scope is not None:
            self.scope.cancel()
        elif self.abort is not None:
            self.abort()  # else when it next waits on a request (attach)


@dataclass(slots=True)
class ProcLook:
    """What /proc/PID/status says of a thread, as far as a waiting read cares."""

    tgid: int
    state: str
    threads: int
    pending: int  # its own pending signals and its process's (SigPnd | ShdPnd)
    blocked: int
    caught: int

    @classmethod
    def read(cls, proc: str, pid: int) -> ProcLook | None:
        try:
            with open(f"{proc}/{pid}/status", "rb") as f:
                text = f.read()
        except OSError:  # gone (or hidden by hidepid: then never watched)
            return None
        fields: dict[bytes, bytes] = {}
        for line in text.splitlines():
            name, _, value = line.partition(b":")
            fields[name] = value.strip()
        try:
            return cls(
                tgid=int(fields[b"Tgid"]),
                state=fields[b"State"][:1].decode(),
                threads=int(fields.get(b"Threads", b"1")),
                pending=int(fields[b"SigPnd"], 16) | int(fields[b"ShdPnd"], 16),
                blocked=int(fields[b"SigBlk"], 16),
                caught=int(fields[b"SigCgt"], 16),
            )
        except (KeyError, ValueError):
            return None

    @property
    def gone(self) -> bool:
        # A zombie leader whose other threads still run is a live process.
        return self.state in ("Z", "X") and self.threads <= 1


class Waits:
    """The waiting reads of one serving process, and the task that looks at them."""

    def __init__(
        self,
        proc: str = "/proc",
        mountpoint: str = "",
        run_sync: Callable[..., Awaitable[dict[int, set[int]]]] = trio.to_thread.run_sync,
    ) -> None:
        self.proc = proc
        self._run_sync = run_sync  # how run() walks /proc: a worker thread
        # Resolved (never stat()ed: this process serves it); "": no holder is looked for.
        self.mountpoint = mountpoint
        self._holders: dict[int, set[int]] = {}  # inode -> processes holding it open
        self._holders_at = -math.inf  # when _holders was looked at (trio's clock)
        self._want_holders = False  # a look found a dying opener with no fresh walk
        self._waits: dict[_Wait, None] = {}
        self._wake: trio.Event | None = None  # set while run() waits for a first read
        self.interrupted = 0  # reads ended (the mount also counts them per mount)

    def __len__(self) -> int:
        return len(self._waits)

    async def wait(self, opener: int, call: Callable[[], Awaitable[T]], inode: int = 0) -> T:
        """call()'s result; Interrupted if the opener's process is gone or told to stop
        before it returns (call() is then cancelled). `inode`: the file's, whose other
        holders keep a dying opener's read going. Costs a cancel scope and a dict
        entry when call() returns at once: misses only, hits never get here."""
        if opener <= 0:  # no pid (a handle another serving process opened): as before
            return await call()
        w = _Wait(opener, trio.current_time(), inode, trio.CancelScope())
        self._waits[w] = None
        if self._wake is not None:
            self._wake.set()
        try:
            with w.scope:  # type: ignore[union-attr]
                return await call()
        finally:
            del self._waits[w]
        # Only a cancel of ours gets here (any other cancel re-raises out of the scope).
        self.interrupted += 1
        raise Interrupted(w.why)

    async def watch(self, opener: int, call: Callable[[], Awaitable[T]], inode: int = 0) -> T:
        """wait() for a call whose waits are the daemon client's requests (a miss that
        leads its chunk's ask), without a cancel scope (~50 k instructions a miss,
        bench/miss_ir.py): the read is ended by aborting the request it waits on
        (control/client.py ABORT_HOOK: its connection closed, as the scope's cancel
        closed it). A read found dying while it waits on nothing abortable (a free
        connection slot) ends when it next asks."""
        if opener <= 0:
            return await call()
        w = _Wait(opener, trio.current_time(), inode)
        self._waits[w] = None
        if self._wake is not None:
            self._wake.set()
        token = ABORT_HOOK.set(w.attach)
        try:
            return await call()
        except Aborted:
            if not w.why:
                raise  # not ours (an outer caller's hook)
        finally:
            ABORT_HOOK.reset(token)
            w.over, w.abort = True, None
            del self._waits[w]
        self.interrupted += 1
        raise Interrupted(w.why)

    async def run(self) -> None:
        """Look at the waiting reads every LOOK_EVERY while there are any."""
        while True:
            if not self._waits:
                self._wake = trio.Event()
                await self._wake.wait()
                self._wake = None
            await trio.sleep(LOOK_EVERY)
            if self._want_holders:
                self._want_holders = False
                at = trio.current_time()
                self._holders = await self._run_sync(holders, self.proc, self.mountpoint)
                self._holders_at = at
            self.look_all(trio.current_time())

    def look_all(self, now: float) -> None:
        for w in list(self._waits):
            if w.watched and not w.why and now - w.since >= FIRST_LOOK:
                why = self._look(w, now)
                if why:
                    w.why = why
                    log.info("a read waiting %.1fs ends with EINTR: %s", now - w.since, why)
                    w.end()

    def _look(self, w: _Wait, now: float) -> str:
        """Why w's read should end now, or ""."""
        if w.gone:
            return "" if self._held_elsewhere(w, now) else f"process {w.tgid} is gone"
        seen = ProcLook.read(self.proc, w.tid)
        if w.tgid == 0:  # the first look
            if seen is None or seen.gone:
                w.watched = False  # gone before: not the reader (an inherited descriptor)
                return ""
            w.tgid = seen.tgid
        elif seen is None and w.tid != w.tgid:
            # The opening thread ended; its process may read on in another thread.
            w.tid = w.tgid
            seen = ProcLook.read(self.proc, w.tgid)
        if seen is None or seen.gone:
            w.gone = True
            return "" if self._held_elsewhere(w, now) else f"process {w.tgid} is gone"
        if seen.pending & _KILL:
            return "" if self._held_elsewhere(w, now) else f"process {w.tgid} is being killed"
        stopping = seen.pending & ~seen.blocked & seen.caught & _STOPPING
        if seen.state not in ("D", "Z"):  # Z: a leader whose other threads live (gone)
            stopping = 0  # not waiting in the kernel: it is not the reader (a parent)
        if stopping and w.stopping:
            names = [signal.Signals(s).name for s in range(1, 32) if stopping & (1 << (s - 1))]
            return f"process {w.tgid} has {', '.join(names)} pending"
        w.stopping = bool(stopping)
        return ""

    def _held_elsewhere(self, w: _Wait, now: float) -> bool:
        """Whether a process other than w's opener holds w's file open under this
        mount, by a walk of /proc begun after w's read began and at most HOLDERS_EVERY
        ago (one walk serves every dying opener of a look). With no such walk yet, the
        read is taken as held until run() has walked (the next look decides)."""
        if not self.mountpoint or not w.inode:
            return False
        if self._holders_at < w.since or now - self._holders_at >= HOLDERS_EVERY:
            self._want_holders = True
            return True
        return bool(self._holders.get(w.inode, set()) - {w.tgid})


def holders(proc: str, mountpoint: str) -> dict[int, set[int]]:
    """The processes holding each file under `mountpoint` open, by inode: of those
    whose descriptors this process may look at (its user's; every one for root), a
    readlink of each and, for one under the mount, its fdinfo's ino. Never stat()s
    through a descriptor: that would ask this mount, from the thread serving it."""
    prefix = mountpoint.rstrip("/") + "/"
    found: dict[int, set[int]] = {}
    try:
        pids = [int(p) for p in os.listdir(proc) if is_digits(p)]
    except OSError:
        return found
    for pid in pids:
        try:
            fds = os.listdir(f"{proc}/{pid}/fd")
        except OSError:  # gone, or another user's
            continue
        for fd in fds:
            try:
                if not os.readlink(f"{proc}/{pid}/fd/{fd}").startswith(prefix):
                    continue
                with open(f"{proc}/{pid}/fdinfo/{fd}", "rb") as f:
                    info = f.read()
            except OSError:  # closed meanwhile
                continue
            for line in info.splitlines():
                if line.startswith(b"ino:"):
                    try:
                        found.setdefault(int(line[4:]), set()).add(pid)
                    except ValueError:
                        pass
                    break
    return found
