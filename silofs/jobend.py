"""Ending a finished batch job on this node: what a scheduler's epilog runs, as root.

Owns finding every mount of one job, whoever made it, ending it, and saying what is
left. The job's mounts are every mount at or under the job's directory in the kernel's
mount table (the prolog made them there), and the silofs mounts the daemon lists for
the job elsewhere, when the mount table says the process that registered one is its
owner. Each is unmounted, lazily when a reader still holds files open in it; its mount
processes (found in /proc by their command line, and through the daemon) get a few
seconds to exit, then SIGTERM (which ends a lazily detached mount: the kernel drops the
connection when its server goes), then SIGKILL. Then the daemon forgets the job (its
registration and IO allocation) and, when nothing of the job is left, its directory
goes: kept, it lets the epilog run again end what the first run could not.

Never stats a mountpoint (root may not stat another user's FUSE mount, and a dead one
hangs the caller); never follows a symlink on the way to a mount it unmounts (the
directories there are the job user's, who may swap one for a link); never signals a
process unless it is a mount process of that mount, run wholly by the mount's owner,
and still the process it was when found; never waits more than DAEMON_TIMEOUT for one
answer of the daemon, or at all once it has not answered: the job's mounts end the
same without it.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from silofs.control.client import ControlClient, ControlError, quote_segment
from silofs.mountinfo import MountEntry, mounts

log = logging.getLogger(__name__)

DAEMON_TIMEOUT = 2.0  # seconds for one answer of the daemon
FORGET_WITHIN = 5.0  # the daemon drops a dead mount's row within 2 s (its reaper)
TERM_AFTER = 2.0  # seconds a mount process has to exit after its unmount
KILL_AFTER = 4.0
GIVE_UP_AFTER = 5.0
MNT_DETACH = 2
UMOUNT_NOFOLLOW = 8

_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class MountProcess:
    """A process serving one of the job's mounts, as found: its start time (clock
    ticks after boot) tells it from a later process given the same pid."""

    pid: int
    ppid: int
    started: int
    mountpoint: str


def open_dir_nofollow(path: str) -> int:
    """An O_PATH fd of the directory `path` (absolute), reached one component at a
    time without following a symlink anywhere: OSError (ENOTDIR, ELOOP) where a
    component is not a real directory."""
    flags = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open("/", flags)
    try:
        for part in path.split("/"):
            if part in ("", "."):
                continue
            if part == "..":  # the mount table's paths are canonical; this one is not
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
            next_fd = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = next_fd
    except BaseException:
        os.close(fd)
        raise
    return fd


def umount(path: str, flags: int) -> int:
    """umount2(2) on `path` with no symlink followed in any part of it; 0 or the errno.

    The paths come from the mount table, but the directories on the way to a job's
    mount are its user's (the mountpoint the prolog chowned, a home): between the
    table's read and this call the user may rename one and put a symlink in its place,
    and umount2 on the path as written would then follow it and detach, as root, any
    mount the link leads to (another user's job, /run). So the parent is opened one
    component at a time without following symlinks, and the last part is unmounted
    relative to that fd (through /proc/self/fd, a link umount2 follows to the very
    directory opened, never by name again)."""
    parent, name = os.path.split(path)
    if not os.path.isabs(path) or name in ("", ".", ".."):
        return errno.EINVAL
    try:
        fd = open_dir_nofollow(parent)
    except OSError as exc:
        return exc.errno or errno.EINVAL
    try:
        target = os.fsencode(f"/proc/self/fd/{fd}/") + os.fsencode(name)
        if _libc.umount2(target, flags | UMOUNT_NOFOLLOW) == 0:
            return 0
        return ctypes.get_errno()
    finally:
        os.close(fd)


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time) of a process, None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(b")") + 2 :].split()  # the name may hold spaces and ")"
    return fields[0].decode(), int(fields[1]), int(fields[19])


def proc_uids(pid: int) -> set[int] | None:
    """The real, effective, saved and filesystem uids of a process, None once gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return {int(u) for u in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return None


def alive(p: MountProcess) -> bool:
    """Still running (a zombie waiting for its parent has ended) and still itself."""
    st = proc_stat(p.pid)
    return st is not None and st[0] != "Z" and st[2] == p.started


def mount_process_claims() -> list[tuple[int, str]]:
    """(pid, mountpoint) of every process whose command line is a background silofs
    mount process (`silofs mount-process ... SETTINGS_JSON`): what it says it serves.
    Anyone may write such a command line; the caller checks who runs it."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")[:-1]
        except OSError:
            continue
        if b"mount-process" not in argv[:-1]:
            continue
        try:
            settings = json.loads(argv[-1])
            mountpoint = settings["mountpoint"]
        except (ValueError, TypeError, KeyError):
            continue
        if isinstance(mountpoint, str):
            out.append((int(entry), mountpoint))
    return out


class JobEnd:
    """One job's end on this node; run() says each step through `say` and returns
    what is left of the job (empty when nothing is)."""

    def __init__(self, job: str, directory: str | None, socket: str, say: Callable[[str], None]):
        self.job = job
        # The prolog's path and the kernel's (which resolves symlinks in the root).
        self.dir = os.path.abspath(directory) if directory else None
        self.real_dir = os.path.realpath(directory) if directory else None
        self.client = ControlClient(socket, timeout=DAEMON_TIMEOUT)
        self.daemon_error: str | None = None
        self.say = say
        self.left: list[str] = []

    def run(self) -> list[str]:
        with self.client:
            rows = self._daemon_mounts()
            targets = self._targets(rows)
            procs = self._processes(targets, rows)
            for entry in targets:
                self._unmount(entry)
            self._wait(procs)
            self._check(targets, procs)
            self._forget()
            self._remove_dir()
        return self.left

    # -- finding -----------------------------------------------------------------------
    def _kernel_path(self, path: str) -> str:
        """A path as the prolog or a mount process wrote it, as the mount table has it."""
        if self.dir and self.real_dir and path.startswith(self.dir + "/"):
            return self.real_dir + path[len(self.dir) :]
        return path

    def _in_dir(self, path: str) -> bool:
        return self.real_dir is not None and (
            path == self.real_dir or path.startswith(self.real_dir + "/")
        )

    def _daemon_mounts(self) -> list[dict]:
        """The daemon's mounts of the job; none if it does not answer (then it is not
        asked again)."""
        try:
            status = self.client.request("GET", "/v1/status")
            rows = status.get("mounts", []) if isinstance(status, dict) else None
            if not isinstance(rows, list) or not all(
                isinstance(m, dict) and isinstance(m.get("pid"), int) for m in rows
            ):
                # Not a silofs daemon's status (another version, something else on the
                # socket): the job's mounts still end, by the mount table.
                raise ControlError(
                    f"the silofs daemon at {self.client.socket_path} answered GET "
                    "/v1/status with something that is no status"
                )
        except ControlError as exc:
            self.daemon_error = str(exc)
            self.say(f"daemon: {exc}: ending the job's mounts by the mount table alone")
            return []
        return [m for m in rows if m.get("job") == self.job]

    def _targets(self, rows: list[dict]) -> list[MountEntry]:
        """The job's mounts, newest first (a mount inside another goes before it)."""
        table = mounts()
        found = [e for e in table if self._in_dir(e.mountpoint)]
        paths = {e.mountpoint for e in found}
        by_path = {e.mountpoint: e for e in table}
        for row in rows:
            path = self._kernel_path(str(row.get("mountpoint")))
            entry = by_path.get(path)
            if entry is None or path in paths:
                continue
            # The row's mountpoint is what its process said: unmount it only if the
            # registering process (its pid is the daemon's, from the socket) owns it.
            if entry.owner is None or proc_uids(int(row["pid"])) != {entry.owner}:
                self.say(
                    f"not unmounting {path}: the daemon lists it for {self.job}, but it is "
                    "not a FUSE mount of the user whose process registered it"
                )
                continue
            found.append(entry)
            paths.add(path)
        order = {id(e): i for i, e in enumerate(table)}
        return sorted(found, key=lambda e: order[id(e)], reverse=True)

    def _processes(self, targets: list[MountEntry], rows: list[dict]) -> list[MountProcess]:
        """The mount processes of the targets, run by the mount's owner (every uid)."""
        owner = {e.mountpoint: e.owner for e in targets}
        claims = mount_process_claims()
        claims += [(int(r["pid"]), str(r.get("mountpoint"))) for r in rows]
        procs: dict[int, MountProcess] = {}
        for pid, claimed in claims:
            path = self._kernel_path(claimed)
            if pid in procs or owner.get(path) is None or proc_uids(pid) != {owner[path]}:
                continue
            st = proc_stat(pid)
            if st is not None:
                procs[pid] = MountProcess(pid, st[1], st[2], path)
        return list(procs.values())

    # -- ending ------------------------------------------------------------------------
    def _unmount(self, entry: MountEntry) -> None:
        path = entry.mountpoint
        err = umount(path, 0)
        if err == errno.EBUSY:
            err = umount(path, MNT_DETACH)
            if err == 0:
                self.say(f"{path} is busy (a process holds files open in it): detached it")
                return
        if err in (0, errno.EINVAL, errno.ENOENT):  # EINVAL: no longer a mount
            self.say(f"unmounted {path}")
        elif err in (errno.ENOTDIR, errno.ELOOP):
            self.say(
                f"cannot unmount {path}: a directory on its path is no longer one (a "
                "symlink put in its place?); not following it as root"
            )
        else:
            self.say(f"cannot unmount {path}: {os.strerror(err)}")

    def _wait(self, procs: list[MountProcess]) -> None:
        """Until the mount processes are gone: SIGTERM after TERM_AFTER (to the
        supervisor of forked serving processes only: a serving process it sees die is
        replaced), SIGKILL to all after KILL_AFTER, giving up after GIVE_UP_AFTER."""
        start = time.monotonic()
        sent: set[int] = set()
        while running := [p for p in procs if alive(p)]:
            waited = time.monotonic() - start
            if waited >= GIVE_UP_AFTER:
                return
            sig = signal.SIGKILL if waited >= KILL_AFTER else signal.SIGTERM
            if waited >= TERM_AFTER and sig not in sent:
                pids = {p.pid for p in running}
                chosen = [p for p in running if sig == signal.SIGKILL or p.ppid not in pids]
                for p in chosen:
                    try:
                        os.kill(p.pid, sig)
                    except ProcessLookupError:
                        pass
                sent.add(sig)
                shown = ", ".join(f"{p.pid} ({p.mountpoint})" for p in chosen)
                self.say(f"{sig.name} to {shown}: running {waited:.1f}s after the unmount")
            time.sleep(0.05)
        if procs:
            self.say(f"mount processes ended: {', '.join(str(p.pid) for p in procs)}")

    def _check(self, targets: list[MountEntry], procs: list[MountProcess]) -> None:
        table = mounts()
        ended = {(e.device, e.mountpoint) for e in targets}
        for e in table:
            if self._in_dir(e.mountpoint) or (e.device, e.mountpoint) in ended:
                self.left.append(f"mount {e.mountpoint}")
        for p in procs:
            if alive(p):
                self.left.append(f"mount process {p.pid} ({p.mountpoint})")

    def _remove_dir(self) -> None:
        """rmdir the job's mountpoints and its directory (never their contents), once
        nothing else of the job is left. While something is (a mount, a process, the
        job on a daemon that did not answer), the directory stays: it is what tells the
        epilog, run again when the node is fixed, that this job is silofs's to end."""
        if self.dir is None or not os.path.isdir(self.dir):
            return
        if self.left:
            self.say(f"kept {self.dir}: the job is not ended yet (run the epilog again)")
            return
        with os.scandir(self.dir) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    try:
                        os.rmdir(entry.path)
                    except OSError as exc:
                        self.say(f"kept {entry.path}: {exc.strerror}")
        try:
            os.rmdir(self.dir)
            self.say(f"removed {self.dir}")
        except OSError as exc:
            self.say(f"kept {self.dir}: {exc.strerror}")

    def _forget(self) -> None:
        """DELETE the job's row; a mount the daemon still lists (its process was
        killed: the daemon's reaper drops it within 2 s) is waited for, briefly."""
        if self.daemon_error is not None:
            self.left.append(f"job {self.job} on the daemon ({self.daemon_error})")
            return
        deadline = time.monotonic() + FORGET_WITHIN
        while True:
            try:
                self.client.request("DELETE", f"/v1/jobs/{quote_segment(self.job)}")
                self.say(f"forgot job {self.job}")
                return
            except ControlError as exc:
                if exc.status == 404:
                    self.say(f"job {self.job} was not registered on the daemon")
                    return
                if exc.status != 409 or self.left or time.monotonic() > deadline:
                    self.left.append(f"job {self.job} on the daemon ({exc})")
                    return
            time.sleep(0.2)


def end_job(job: str, directory: str | None, socket: str, say: Callable[[str], None]) -> list[str]:
    """End `job` on this node (see the module's docstring); what is left of it."""
    return JobEnd(job, directory, socket, say).run()
