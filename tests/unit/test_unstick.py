"""The watcher of blocked FUSE reads signals only the mount and its children.

Owns, with real processes (the device read faked: no FUSE here): `_interrupt` sends its
signal through a pidfd to the mount or a child of it, never to a process that took a
pid the watcher looked at (one whose parent is not the mount), nor to a process gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from silofs.mount import unstick


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The pids `_interrupt` signalled (every process reads the device, as far as it
    knows); os.kill must never be used."""
    out: list[int] = []
    monkeypatch.setattr(unstick, "in_device_read", lambda pid: True)

    def send(fd: int, sig: int) -> None:
        assert sig == unstick.SIGNAL
        out.append(int(open(f"/proc/self/fdinfo/{fd}").read().split("Pid:")[1].split()[0]))

    monkeypatch.setattr(signal, "pidfd_send_signal", send)
    real_kill = os.kill

    def kill(pid: int, sig: int) -> None:
        assert sig != unstick.SIGNAL, "signalled by pid, not through a pidfd"
        real_kill(pid, sig)

    monkeypatch.setattr(os, "kill", kill)
    return out


def _sleeper(*prefix: str) -> subprocess.Popen:
    return subprocess.Popen([*prefix, sys.executable, "-c", "import time; time.sleep(60)"])


def test_only_the_mount_and_its_children_are_signalled(sent: list[int]) -> None:
    me = os.getpid()
    mine = _sleeper()
    # A process that is not a child of the "mount" (this test): a grandchild, as a pid
    # reused by some other process would be.
    other = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(p.pid, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    assert other.stdout is not None
    stranger = int(other.stdout.readline())
    mount_fd = os.pidfd_open(me)
    try:
        assert unstick._interrupt(me, mount_fd, me)
        assert unstick._interrupt(me, mount_fd, mine.pid)
        assert not unstick._interrupt(me, mount_fd, stranger)
        mine.kill()
        mine.wait()  # reaped: its pid may be anyone's now
        assert not unstick._interrupt(me, mount_fd, mine.pid)
    finally:
        os.close(mount_fd)
        for p in (mine, other):
            p.kill()
            p.wait()
        try:
            os.kill(stranger, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert sent == [me, mine.pid]


def test_without_pidfds_the_same_checks_then_the_pid(
    sent: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No pidfd_open (an old kernel, a seccomp profile): the parent check still keeps a
    stranger from being signalled; the mount's children are signalled by pid."""
    me = os.getpid()
    mine = _sleeper()
    killed: list[int] = []
    try:
        with monkeypatch.context() as m:
            m.setattr(os, "kill", lambda pid, sig: killed.append(pid))
            m.setattr(os, "getppid", lambda: me)
            assert unstick._interrupt(me, -1, mine.pid)
            assert not unstick._interrupt(me, -1, 1)  # init: not a child of the mount
    finally:
        mine.kill()
        mine.wait()
    assert killed == [mine.pid] and sent == []
