"""Ending one user's dead silofs mounts: what a scheduler's epilog runs, as root, at the
end of every job of that user (`silofs end-dead-mounts --uid UID`).

Owns telling a dead mount from a live one, and detaching the dead ones. A job's own
script may mount silofs itself; when the job is killed (scancel, a time limit, the OOM
killer) its mount process dies with it and the kernel's mount stays: every access fails
with ENOTCONN, `ls` of the parent errors, and the user's next job cannot mount there.
Where it is and who made it do not tell such a mount from the user's mounts of jobs
still running on the node; whether it is dead does. When the last holder of a FUSE
connection's /dev/fuse fd is gone, the kernel aborts the connection for good, and every
request on it fails at once with ENOTCONN, nobody asked.

The probe: statfs on an O_PATH fd of the mount's root (statfs always asks the mount's
process, where a stat may be answered from cached attributes), in a child that has
become the mount's owner (its user_id and group_id: the kernel answers anyone else,
root included, from nothing, for a mount made without allow_other) and that first
checks the fd is in the very mount the table lists (its mnt_id). A live mount answers;
a dead one fails with ENOTCONN; a mount whose process is stopped (SIGSTOP, `scontrol
suspend`) or stuck does not answer, and after PROBE_TIMEOUT its child is killed (a FUSE
request is killable) and the mount is left: it may be live. All probes run at once, so
a user's stuck mounts cost PROBE_TIMEOUT once, not each.

The detach, in a child of root bounded by DETACH_TIMEOUT: the parent directory opened
one component at a time without following a symlink (the directories on the way are
the user's), the mountpoint opened O_PATH|O_NOFOLLOW and its mnt_id checked again, and
umount2(MNT_DETACH) on /proc/self/fd/N, which names the mount that fd is in, never a
path looked up again: whatever the user renames meanwhile, root detaches the mount
found dead and no other. Lazily, so a process still cwd'd or holding a file there does
not keep it.

Never touches a mount of another uid, a live mount, or one whose probe did not answer;
never signals a process (a dead mount has none left); never stats a mountpoint as root.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from silofs.jobend import MNT_DETACH, open_dir_nofollow
from silofs.mountinfo import MountEntry, mounts

log = logging.getLogger(__name__)

PROBE_TIMEOUT = 2.0  # seconds for every probe together (they run at once)
DETACH_TIMEOUT = 2.0  # seconds for one detach
REAP_WAIT = 1.0  # seconds to reap a child killed at its timeout
DEAD = frozenset({errno.ENOTCONN, errno.ECONNABORTED})  # the connection is aborted
MOVED = -1  # a child's answer: the path leads to another mount than the one listed
BROKEN = -2  # a child's answer: it failed other than with an OSError

_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class _Child:
    pid: int
    out: int  # the read end of the pipe its answer comes on


def _mnt_id(fd: int) -> int:
    """The id of the mount the file `fd` is in, as /proc/PID/mountinfo numbers it."""
    with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
        for line in f:
            if line.startswith(b"mnt_id:"):
                return int(line.split()[1])
    raise OSError(errno.ENOSYS, "no mnt_id in /proc/self/fdinfo")


def _probe(entry: MountEntry) -> int:
    """In the child, as the mount's owner: 0 if the mount's process answers statfs
    (whatever it answers: an error it sends back is an answer), ENOTCONN or
    ECONNABORTED if the kernel says the connection is gone, MOVED, or the errno of
    getting to the mount (it cannot tell: EACCES, ENOENT)."""
    assert entry.owner is not None and entry.group is not None
    os.setgroups([])
    os.setgid(entry.group)
    os.setuid(entry.owner)
    fd = os.open(entry.mountpoint, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    if _mnt_id(fd) != entry.mount_id:
        return MOVED
    try:
        os.fstatvfs(fd)
    except OSError as exc:
        return exc.errno if exc.errno in DEAD else 0
    return 0


def _detach(entry: MountEntry) -> int:
    """In the child, as root: detach exactly the mount `entry` (see the module's
    docstring); 0, the errno, or MOVED."""
    parent, name = os.path.split(entry.mountpoint)
    if not os.path.isabs(entry.mountpoint) or name in ("", ".", ".."):
        return errno.EINVAL
    dir_fd = open_dir_nofollow(parent)
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    if _mnt_id(fd) != entry.mount_id:
        return MOVED
    if _libc.umount2(os.fsencode(f"/proc/self/fd/{fd}"), MNT_DETACH) != 0:
        return ctypes.get_errno()
    return 0


def _start(fn: Callable[[], int], alone: bool = False) -> _Child:
    """fn() in a forked child; its answer (an int) comes on a pipe. The child never
    returns into the caller: it leaves with os._exit, whatever happens. `alone`: it
    closes every fd but its answer's first (a probe becomes the user: it keeps none of
    root's files, not even stdout)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        answer = BROKEN
        try:
            os.close(r)
            if alone:
                os.closerange(0, w)
                os.closerange(w + 1, os.sysconf("SC_OPEN_MAX"))
            answer = fn()
        except OSError as exc:
            answer = exc.errno or BROKEN
        except BaseException:
            answer = BROKEN
        finally:
            try:
                os.write(w, str(answer).encode())
            finally:
                os._exit(0)
    os.close(w)
    return _Child(pid, r)


def _answers(children: dict[int, _Child], timeout: float) -> dict[int, int | None]:
    """Each child's answer by key; None for one that did not answer within `timeout`
    (then SIGKILLed, and reaped if it dies within REAP_WAIT)."""
    got: dict[int, int | None] = {}
    by_fd = {c.out: key for key, c in children.items()}
    poller = select.poll()
    for fd in by_fd:
        poller.register(fd, select.POLLIN | select.POLLHUP)
    deadline = time.monotonic() + timeout
    while by_fd and (left := deadline - time.monotonic()) > 0:
        for fd, _ in poller.poll(left * 1000):
            key = by_fd.pop(fd)
            poller.unregister(fd)
            text = os.read(fd, 64).decode(errors="replace").strip()
            os.close(fd)
            os.waitpid(children[key].pid, 0)  # it has answered: it is leaving
            got[key] = int(text) if text.lstrip("-").isdigit() else BROKEN
    late = [children[key].pid for key in by_fd.values()]
    for fd, key in by_fd.items():
        os.close(fd)
        got[key] = None
        os.kill(children[key].pid, signal.SIGKILL)
    _reap(late)
    return got


def _reap(pids: list[int]) -> None:
    deadline = time.monotonic() + REAP_WAIT
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if os.waitpid(p, os.WNOHANG)[0] == 0]
        if pids:
            time.sleep(0.02)
    if pids:  # stuck in the kernel past SIGKILL: reaped when this process exits
        log.warning("children %s did not end within %.0fs of SIGKILL", pids, REAP_WAIT)


def candidates(uid: int) -> list[MountEntry]:
    """The silofs FUSE mounts `uid` made, in this mount namespace."""
    return [e for e in mounts() if e.is_silofs and e.owner == uid and e.group is not None]


def end_dead_mounts(uid: int, say: Callable[[str], None]) -> list[str]:
    """Detach every dead silofs mount of `uid`, one line each through `say`; the dead
    mounts that could not be detached (each also said)."""
    found = candidates(uid)
    if not found:
        return []
    probes = {i: _start(lambda e=e: _probe(e), alone=True) for i, e in enumerate(found)}
    answers = _answers(probes, PROBE_TIMEOUT)
    left = []
    for i, entry in enumerate(found):
        path, answer = entry.mountpoint, answers[i]
        if answer == 0:
            continue  # live: a job of the user still running, or a mount of their own
        if answer is None:
            say(
                f"left {path} of uid {uid}: it did not answer within {PROBE_TIMEOUT:g}s "
                "(its mount process is stopped or stuck, not gone: it may be live)"
            )
        elif answer == MOVED:
            say(f"left {path} of uid {uid}: the path leads to another mount now")
        elif answer not in DEAD:
            say(f"left {path} of uid {uid}: cannot tell whether it is dead ({_reason(answer)})")
        elif (done := _answers({0: _start(lambda e=entry: _detach(e))}, DETACH_TIMEOUT)[0]) == 0:
            say(f"detached {path}, a dead silofs mount of uid {uid} (its mount process is gone)")
        else:
            reason = "it did not finish" if done is None else _reason(done)
            say(f"cannot detach {path}, a dead silofs mount of uid {uid}: {reason}")
            left.append(path)
    return left


def _reason(answer: int) -> str:
    if answer == MOVED:
        return "the path leads to another mount now"
    if answer == BROKEN:
        return "the child that tried failed unexpectedly"
    if answer in (errno.ENOTDIR, errno.ELOOP):
        return "a directory on its path is no longer one (a symlink?); not following it"
    return os.strerror(answer)
