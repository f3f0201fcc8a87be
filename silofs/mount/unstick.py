"""A serving process never stays blocked reading /dev/fuse with no request queued.

pyfuse3 reads the device with a blocking read() once trio says it is readable, holding
the GIL. A request can leave the device's queue in between: the kernel drops a request
nobody has read yet when its caller dies of a fatal signal (fuse_dev:
request_wait_answer), so a data loader killed while its open() or stat() was queued
leaves the device readable for an instant and then empty. The read() then blocks the
process until some other request arrives, and nothing else runs meanwhile: the answers
of misses already asked of the daemon stay unread in their sockets, their readers wait,
the reports stop, and a job whose readers all wait on misses never sends the request
that would end it (the "mount hang": a mount that never read three readable daemon
sockets). tests/integration/test_robust.py kills callers at random instants while
their lookups are queued.

Owns the watcher: a small process of its own (`python -m silofs.mount.unstick PID`;
no thread of the mount could run while that read() holds the GIL) that looks every
LOOK_SECONDS at the main thread of PID and of its children (the serving processes of
--serve-processes) and, when one is in read() of a /dev/fuse descriptor twice
CONFIRM_SECONDS apart (a read that finds a request returns at once), sends it SIGURG
through a pidfd (`_interrupt`): the mount's own, opened while it was this watcher's
parent, or one of a serving process opened and then checked to be a child of the mount,
so a pid the kernel gave to another process meanwhile is never signalled.
`arm` gives a serving process a handler for it, installed without SA_RESTART (as
Python's signal.signal does), so the read() fails with EINTR, which pyfuse3's loop
takes as "wait for the device again". A read that took a request is never cut (the
kernel checks for signals only while it waits for one). The watcher ends when PID does.
Never reads the device, never answers a request, holds no descriptor of the mount's.
"""

from __future__ import annotations

import errno
import logging
import os
import platform
import signal
import subprocess
import sys
import time

log = logging.getLogger(__name__)

# How often the serving processes are looked at, and how long one must stay in read()
# of the device before it is interrupted.
LOOK_SECONDS = 0.25
CONFIRM_SECONDS = 0.05
# read(2)'s number, as /proc/PID/syscall shows it.
_READ = {"x86_64": 0, "aarch64": 63, "riscv64": 63, "ppc64le": 3, "s390x": 3}.get(
    platform.machine()
)
PR_SET_PTRACER = 0x59616D61  # linux/prctl.h: Yama's "this pid may trace me"
SIGNAL = signal.SIGURG  # ignored by default: one sent to a process without `arm` ends nothing


def arm() -> None:
    """In a serving process's main thread: let SIGURG interrupt its blocking read()."""
    signal.signal(SIGNAL, lambda *_: None)


def spawn(pid: int) -> subprocess.Popen | None:
    """The watcher of `pid` and its children; None where it could not see them."""
    if _READ is None or not os.path.exists(f"/proc/{pid}/syscall"):
        log.debug("no watcher for blocked FUSE reads: no /proc/%d/syscall", pid)
        return None
    try:
        watcher = subprocess.Popen(
            [sys.executable, "-m", "silofs.mount.unstick", str(pid)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            close_fds=True,
        )
    except OSError as exc:
        log.warning("no watcher for blocked FUSE reads: %s", exc)
        return None
    # Reading another process's /proc/PID/syscall is a ptrace-attach check: under Yama
    # (ptrace_scope 1, Ubuntu's default) only an ancestor passes it, and the watcher is
    # a child. Name it as this process's tracer (EINVAL without Yama: nothing to do).
    import ctypes  # not for a process that never spawns a watcher

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PTRACER, watcher.pid, 0, 0, 0)
    return watcher


def stop(watcher: subprocess.Popen | None) -> None:
    if watcher is not None and watcher.poll() is None:
        watcher.terminate()
        try:
            watcher.wait(timeout=2)
        except subprocess.TimeoutExpired:
            watcher.kill()
            watcher.wait()


def in_device_read(pid: int) -> bool:
    """Whether `pid`'s main thread is in read() of a /dev/fuse descriptor."""
    try:
        with open(f"/proc/{pid}/syscall") as f:
            fields = f.read().split()
        if len(fields) < 2 or fields[0] != str(_READ):
            return False
        return os.readlink(f"/proc/{pid}/fd/{int(fields[1], 16)}") == "/dev/fuse"
    except (OSError, ValueError):
        return False


def _serving(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [pid, *(int(c) for c in f.read().split())]
    except (OSError, ValueError):
        return [pid]


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _interrupt(mount: int, mount_fd: int, pid: int) -> bool:
    """SIGNAL to `pid` if it is still in read() of the device and is the mount (`mount`,
    whose pidfd is `mount_fd`) or a child of it; whether it was sent. Sent through a
    pidfd, which names one process for good: a pid the kernel reused since it was looked
    at is another process's, and a pidfd opened on it fails the parent check (a child
    of the mount opened and checked is that child, alive or dead). `mount_fd` -1: no
    pidfds here (a kernel before 5.3, a seccomp profile without pidfd_open): checked
    the same, then sent by pid, the mount still this watcher's parent."""
    fd = mount_fd
    if pid != mount and mount_fd >= 0:
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return False  # gone
    try:
        if pid != mount and _parent_of(pid) != mount:
            return False  # not a serving process of this mount (any more)
        if not in_device_read(pid):
            return False
        if fd >= 0:
            signal.pidfd_send_signal(fd, SIGNAL)
        elif os.getppid() == mount:
            os.kill(pid, SIGNAL)  # the narrowest window there is without a pidfd
        else:
            return False
        return True
    except OSError:
        return False  # ended meanwhile
    finally:
        if fd != mount_fd:
            os.close(fd)


def _pidfd(pid: int) -> int:
    """A pidfd of `pid`; -1 where the kernel gives none (ENOSYS, or EPERM from seccomp)."""
    try:
        return os.pidfd_open(pid)
    except OSError as exc:
        if exc.errno in (errno.ENOSYS, errno.EPERM):
            return -1
        raise


def watch(pid: int) -> None:
    """Until `pid` (this process's parent) is gone: interrupt a blocked read() of the
    device (module docstring). Its end is told by the parent changing, never by its pid's
    /proc entry, which a new process may take."""
    try:
        mount_fd = _pidfd(pid)
        with open(f"/proc/{pid}/syscall") as f:
            f.read()  # the access check is made on read
    except OSError as exc:  # stderr: the mount's log
        print(f"silofs.mount.unstick: cannot watch pid {pid}: {exc}", file=sys.stderr)
        return
    if os.getppid() != pid:
        return  # the mount ended before the pidfd was opened: it may name another process
    while os.getppid() == pid:
        time.sleep(LOOK_SECONDS)
        blocked = [p for p in _serving(pid) if in_device_read(p)]
        if not blocked:
            continue
        time.sleep(CONFIRM_SECONDS)
        for p in blocked:
            _interrupt(pid, mount_fd, p)


if __name__ == "__main__":
    # A Ctrl-C or hangup of the mount's terminal reaches this process too: the mount
    # decides what they mean, and this one ends when it does.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    watch(int(sys.argv[1]))
