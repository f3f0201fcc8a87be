"""Several processes serving one FUSE connection with pyfuse3: fork after INIT.

Owns the three facts that make it work, and nothing of a filesystem's logic:

- pyfuse3 answers requests only on a session that saw INIT itself (libfuse
  fuse_lowlevel.c: `got_init`), and offers no way to attach to a connection. So the
  session is mounted and run (`run_until_init`) only until libfuse has answered INIT
  (Operations.init() is called inside do_init, before its reply is sent), then its trio
  loop is *cancelled*, not terminate()d: terminate() sets the session's exit flag, which
  pyfuse3 has no call to clear (fuse_session_reset is not wrapped), so main() could
  never run again. A forked copy of that process has the session with got_init set.
- Each child gives itself its own device of the connection (`clone_device`:
  open /dev/fuse, ioctl FUSE_DEV_IOC_CLONE, dup2 over the inherited descriptor number,
  which the libfuse session copy keeps using). Replies go to the device that read the
  request, and when a child dies the kernel ends the requests it had read with
  ECONNABORTED (fuse_dev_release), so its readers get an error, never a hang.
- pyfuse3 reads the device after epoll says it is readable, with a blocking read. With
  several processes every one of them wakes for each request and all but one would then
  block in read() until the next request arrives, their trio loops frozen (a miss
  waiting in such a process would wait for someone else's request). `ReadToken` makes
  one process at a time the reader: the token is one byte in a pipe, taken before
  waiting for the device, given back as soon as the request is in (the first line of
  each handler, `release_after_receive`, or at the latest when the process waits for the
  device again). pyfuse3 looks its trio module up at call time (pyfuse3.asyncio
  replaces it the same way), so `install` gives it one whose wait_readable does that.

Never decides how many processes serve, never opens LMDB or sockets (callers open
their own after the fork: an LMDB env or a socket must never cross a fork).
"""

from __future__ import annotations

import errno
import fcntl
import functools
import inspect
import logging
import mmap
import os
import struct
import sys
import termios
import time
from collections.abc import Callable
from typing import Any

import pyfuse3
import trio

log = logging.getLogger(__name__)

FUSE_DEV_IOC_CLONE = 0x8004E500  # _IOR(229, 0, uint32_t), linux/fuse.h


def fuse_fd() -> int:
    """The descriptor of this process's /dev/fuse (the pyfuse3 session's); pyfuse3 does
    not expose it. Call with exactly one session open."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "/dev/fuse":
                found.append(int(name))
        except OSError:
            continue
    if len(found) != 1:
        raise RuntimeError(f"expected one /dev/fuse descriptor, found {found}")
    return found[0]


def clone_device(fd: int) -> None:
    """Make `fd` this process's own device of the connection `fd` is on."""
    new = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(new, FUSE_DEV_IOC_CLONE, struct.pack("I", fd))
        os.dup2(new, fd, inheritable=False)
    finally:
        os.close(new)


async def answer_init(ops: pyfuse3.Operations) -> None:
    """Run pyfuse3.main() (after pyfuse3.init) until the kernel's INIT was answered.

    Nothing else is read: the cancellation lands at the loop's next checkpoint, which
    comes before its next receive (and before any second worker task's)."""
    with trio.CancelScope() as scope:
        original = ops.init

        def init() -> None:
            original()
            scope.cancel()

        ops.init = init  # type: ignore[method-assign]
        try:
            await pyfuse3.main()
        finally:
            ops.init = original  # type: ignore[method-assign]
    if not scope.cancelled_caught:
        raise RuntimeError("the FUSE session ended before INIT")


def run_until_init(ops: pyfuse3.Operations) -> None:
    trio.run(answer_init, ops)


class ReadToken:
    """One byte in a pipe: the process holding it is the one reading /dev/fuse.

    Its holder's pid is kept in shared memory, so the supervisor puts a new byte in the
    pipe when a process dies holding it (`recover`), else every reader would wait."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._holder = mmap.mmap(-1, 8, flags=mmap.MAP_SHARED)
        os.write(self.w, b"t")
        self.holding = False
        self._pid = os.getpid()  # a syscall per call: kept, and set again in a child
        os.register_at_fork(after_in_child=self._forked)
        self._gave = False  # gave it at a handler's start since it last took it

    async def take(self, wait_first: bool = False) -> None:
        """Take the byte; `wait_first` when this process just gave it (another is
        taking it now: reading at once would only fail)."""
        if wait_first:
            await trio.lowlevel.wait_readable(self.r)
        while True:
            try:
                if os.read(self.r, 1):
                    self.holding = True
                    struct.pack_into("<q", self._holder, 0, self._pid)
                    return
            except BlockingIOError:
                pass
            await trio.lowlevel.wait_readable(self.r)

    def _forked(self) -> None:
        self._pid = os.getpid()
        self.holding = self._gave = False

    def give(self) -> None:
        if self.holding:
            self.holding = False
            self._gave = True
            struct.pack_into("<q", self._holder, 0, 0)
            os.write(self.w, b"t")

    def holder(self) -> int:
        return int(struct.unpack_from("<q", self._holder, 0)[0])

    def available(self) -> int:
        """Bytes in the pipe (FIONREAD): 1 while no process holds the token."""
        buf = fcntl.ioctl(self.r, termios.FIONREAD, b"\0\0\0\0")
        return int(struct.unpack("<i", buf)[0])

    def recover(self, dead: int) -> bool:
        """After process `dead` ended: give the token back if it died holding it (or,
        rarely, between taking the byte and writing its pid). True if it did."""
        lost = self.holder() == dead
        if not lost and self.holder() == 0 and self.available() == 0:
            time.sleep(0.05)  # a live process between its read and its pid: it writes it
            lost = self.holder() == 0 and self.available() == 0
        if lost:
            struct.pack_into("<q", self._holder, 0, 0)
            os.write(self.w, b"t")
            return True
        return False

    async def wait_readable(self, fd: int) -> None:
        """pyfuse3's wait for the device: the token first, then readability."""
        self.give()  # the request this process read last is in: another may read
        gave, self._gave = self._gave, False
        await self.take(wait_first=gave)
        try:
            await trio.lowlevel.wait_readable(fd)
        except BaseException:
            self.give()
            raise


class _Lowlevel:
    def __init__(self, token: ReadToken) -> None:
        self.wait_readable = token.wait_readable

    def __getattr__(self, name: str) -> Any:
        return getattr(trio.lowlevel, name)


class _Trio:
    """trio as pyfuse3 sees it: the same, but for lowlevel.wait_readable."""

    def __init__(self, token: ReadToken) -> None:
        self.lowlevel = _Lowlevel(token)

    def __getattr__(self, name: str) -> Any:
        return getattr(trio, name)


_token: ReadToken | None = None


def install(token: ReadToken) -> None:
    global _token
    _token = token
    pyfuse3.trio = _Trio(token)  # type: ignore[attr-defined]


def give_token() -> None:
    if _token is not None and _token.holding:
        _token.give()


def release_after_receive(cls: type) -> type:
    """Class decorator: each request handler of a pyfuse3.Operations subclass gives the
    read token back first thing (the request is in; another process may read the next
    one while this one is served). A request libfuse answers itself never reaches a
    handler; the token comes back when this process next waits for the device."""
    for name, base in vars(pyfuse3.Operations).items():
        if name.startswith("_") or name == "init" or not inspect.iscoroutinefunction(base):
            continue
        fn = getattr(cls, name)
        if getattr(fn, "_gives_token", False):
            continue

        def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(fn)
            def handler(*args: Any, **kwargs: Any) -> Any:
                if _token is not None and _token.holding:
                    _token.give()
                return fn(*args, **kwargs)

            handler._gives_token = True  # type: ignore[attr-defined]
            return handler

        setattr(cls, name, wrap(fn))
    return cls


def child_exit(code: int) -> None:
    """End a forked serving process without running the parent's atexit handlers or
    flushing buffers it inherited."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def is_disconnected(exc: BaseException) -> bool:
    """The kernel ended the session (unmounted: ENODEV; aborted: ECONNABORTED). pyfuse3
    raises it from inside its own nursery and ours, so trio hands it over wrapped in
    ExceptionGroups: it counts when every exception in the group is one."""
    if isinstance(exc, BaseExceptionGroup):
        return all(is_disconnected(e) for e in exc.exceptions)
    return isinstance(exc, OSError) and exc.errno in (errno.ENODEV, errno.ECONNABORTED)
