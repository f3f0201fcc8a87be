"""`silofs unmount`: end one mount and wait, boundedly, for its mount process.

Owns naming the mount (as the kernel's mount table has it), finding the process that
serves it (through the daemon, or /proc when the daemon does not answer), the
unmount itself (fusermount3, so a user may unmount their own mount) and the wait.

Never stats the mountpoint itself: a mount whose process is stuck or gone would hang
the caller (the epilog with it). Never waits more than DAEMON_TIMEOUT for the daemon
or EXIT_WAIT for the mount process; never signals anything (`silofs end-job` does,
as root).
"""

from __future__ import annotations

import logging
import os
import pwd
import subprocess
import time
from dataclasses import dataclass

from silofs.control.client import ControlClient, ControlError
from silofs.errors import SilofsError, UsageError
from silofs.jobend import mount_process_claims
from silofs.mountinfo import mounts, silofs_mounts
from silofs.pids import pid_alive

log = logging.getLogger(__name__)

DAEMON_TIMEOUT = 2.0  # seconds for the daemon to name the mount's process
EXIT_WAIT = 10.0  # seconds the mount process has to end after the unmount
FUSERMOUNT_TIMEOUT = 10.0


@dataclass(frozen=True)
class Outcome:
    path: str
    pid: int | None
    ended: bool  # the mount process is gone (or was never found)


def mount_path(mountpoint: str) -> str:
    """The mount table's name for `mountpoint`, or UsageError. The parent is resolved,
    not the mountpoint (that would ask the mount's process); a symlink naming a mount
    is followed only when the name itself is no mountpoint."""
    path = _resolved_parent(mountpoint)
    table = silofs_mounts()
    if path in table:
        return path
    if os.path.islink(path) and (target := os.path.realpath(path)) in table:
        return target
    raise UsageError(f"{path} is not a silofs mount")


def _resolved_parent(path: str) -> str:
    """`path` made absolute with its parent's symlinks resolved, its last part kept."""
    absolute = os.path.abspath(path)
    parent, name = os.path.split(absolute)
    return os.path.join(os.path.realpath(parent), name) if name else absolute


def mount_pid(socket: str, path: str) -> int | None:
    """The pid of the process serving `path`: as the daemon knows it, else as a mount
    process's command line says (only waited for, never signalled)."""
    try:
        with ControlClient(socket, timeout=DAEMON_TIMEOUT) as client:
            for m in client.request("GET", "/v1/status")["mounts"]:
                if _resolved_parent(m["mountpoint"]) == path:
                    return int(m["pid"])
    except (ControlError, KeyError, TypeError, ValueError) as exc:
        # An answer that is no status (another version, another program on the socket)
        # names no process either: the unmount goes on without the daemon.
        log.debug("the daemon did not name the mount's process: %r", exc)
    claims = [pid for pid, said in mount_process_claims() if _resolved_parent(said) == path]
    return claims[0] if len(claims) == 1 else None


def unmount(mountpoint: str, socket: str, lazy: bool) -> Outcome:
    """Unmount `mountpoint` (detach it if `lazy`) and wait up to EXIT_WAIT for its
    process. SilofsError with fusermount3's reason if the kernel refused (busy)."""
    path = mount_path(mountpoint)
    pid = mount_pid(socket, path)
    cmd = ["fusermount3", "-u"] + (["-z"] if lazy else []) + [path]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=FUSERMOUNT_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise SilofsError(f"cannot unmount {path}: fusermount3 did not finish") from None
    if res.returncode != 0:
        reason = (res.stderr.strip().splitlines() or ["fusermount3 failed"])[-1]
        inner = _mounts_inside(path)
        owner = entry.owner if (entry := silofs_mounts().get(path)) else None
        if owner is not None and os.geteuid() not in (0, owner):
            # fusermount3 says "entry ... not found in /etc/mtab" (its own table of a
            # user's mounts), which a user who sees the mount in `mount` cannot act on.
            reason = f"it is {_user(owner)}'s mount: only that user or root may unmount it"
        elif not lazy and "busy" in reason.lower() and inner:
            # A mount inside it holds it, not open files: closing files would not help.
            reason += (
                f" ({inner[0]} is mounted inside it: unmount that first, or "
                "`silofs unmount --lazy` to detach both now)"
            )
        elif not lazy and "busy" in reason.lower():
            # What umount(8) users reach for next: say it, and what it does.
            reason += (
                " (files are open in it; close them, or `silofs unmount --lazy` to detach now)"
            )
        raise SilofsError(f"cannot unmount {path}: {reason}")
    deadline = time.monotonic() + EXIT_WAIT
    while pid and time.monotonic() < deadline and pid_alive(pid):
        time.sleep(0.05)
    return Outcome(path, pid, ended=not (pid and pid_alive(pid)))


def _user(uid: int) -> str:
    """`uid 1008 (alice)`, or `uid 1008` when it has no name here."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _mounts_inside(path: str) -> list[str]:
    """Mountpoints below `path` in this namespace's mount table (any file system), the
    deepest first."""
    inner = [e.mountpoint for e in mounts() if e.mountpoint.startswith(path.rstrip("/") + "/")]
    return sorted(inner, key=lambda p: p.count("/"), reverse=True)


def outcome_line(outcome: Outcome, lazy: bool) -> str:
    """What `silofs unmount` says: what is true once it returns."""
    if outcome.ended:
        return f"unmounted {outcome.path}"
    if lazy:
        return (
            f"detached {outcome.path}; its mount process {outcome.pid} ends when the "
            "files open in it are closed"
        )
    return (
        f"unmounted {outcome.path}; its mount process {outcome.pid} is still running "
        f"after {EXIT_WAIT:.0f}s"
    )
