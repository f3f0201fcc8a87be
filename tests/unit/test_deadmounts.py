"""silofs/deadmounts.py without FUSE: what `silofs end-dead-mounts` does with each
answer of its probes (live, dead, no answer, another mount, cannot tell) and of its
detaches, and that a child that does not answer costs its timeout, not more. (Real
dead, live and stopped mounts of real users under Slurm: tests/integration/
test_slurm.py.)"""

from __future__ import annotations

import errno
import os
import time

import pytest

from silofs import deadmounts
from silofs.mountinfo import MountEntry


def _entry(mount_id: int, path: str) -> MountEntry:
    return MountEntry("0:99", path, "fuse.silofs", "silofs:file:///d/",
                      "ro,user_id=4242,group_id=4242", mount_id)  # fmt: skip


# The children that answer must do so within the timeout. Seven forked at once from a
# process with a ~300 MB heap (the suite's, late in a run) on the busy 2-core test host
# (load ~14) answered 0.03 s after the forks (median of 200 rounds), p99 0.23 s,
# slowest 0.32 s: a 0.5 s timeout was within 2x of that.
ANSWER_BOUND = 2.0  # 60x that median, 6x the slowest
# The caller's own stalls on such a host (7 forks took up to 0.68 s there): what may
# come on top of the timeout and REAP_WAIT, still far from the 60 s the sleeper holds.
STALL = 5.0


def test_a_child_that_does_not_answer_is_killed_at_the_timeout() -> None:
    children = {
        1: deadmounts._start(lambda: 7),
        2: deadmounts._start(lambda: time.sleep(60) or 0),
        3: deadmounts._start(lambda: os._exit(3)),  # died without a word
        4: deadmounts._start(lambda: int("x")),  # failed
    }
    started = time.monotonic()
    got = deadmounts._answers(children, ANSWER_BOUND)
    assert time.monotonic() - started < ANSWER_BOUND + deadmounts.REAP_WAIT + STALL
    assert got == {1: 7, 2: None, 3: deadmounts.BROKEN, 4: deadmounts.BROKEN}
    for child in children.values():  # every one reaped, the killed one too
        with pytest.raises(ChildProcessError):
            os.waitpid(child.pid, os.WNOHANG)


def test_only_a_mount_the_kernel_says_is_dead_is_detached(monkeypatch: pytest.MonkeyPatch) -> None:
    found = [
        _entry(1, "/o/live"),
        _entry(2, "/o/dead"),
        _entry(3, "/o/stopped"),
        _entry(4, "/o/moved"),
        _entry(5, "/o/hidden"),
        _entry(6, "/o/dead-stuck"),
        _entry(7, "/o/dead-swapped"),
    ]
    probe = {
        1: 0,
        2: errno.ENOTCONN,
        3: None,  # sleeps past the timeout
        4: deadmounts.MOVED,
        5: errno.EACCES,
        6: errno.ECONNABORTED,
        7: errno.ENOTCONN,
    }
    detach = {2: 0, 6: errno.EBUSY, 7: errno.ELOOP}

    def fake_probe(e: MountEntry) -> int:
        answer = probe[e.mount_id]
        if answer is None:
            time.sleep(60)
        return answer or 0

    def fake_detach(e: MountEntry) -> int:
        return detach[e.mount_id]

    monkeypatch.setattr(deadmounts, "candidates", lambda uid: found if uid == 4242 else [])
    monkeypatch.setattr(deadmounts, "_probe", fake_probe)
    monkeypatch.setattr(deadmounts, "_detach", fake_detach)
    monkeypatch.setattr(deadmounts, "PROBE_TIMEOUT", ANSWER_BOUND)
    said: list[str] = []
    left = deadmounts.end_dead_mounts(4242, said.append)
    assert said == [  # the live mount: no line
        "detached /o/dead, a dead silofs mount of uid 4242 (its mount process is gone)",
        "left /o/stopped of uid 4242: it did not answer within 2s (its mount process is "
        "stopped or stuck, not gone: it may be live)",
        "left /o/moved of uid 4242: the path leads to another mount now",
        "left /o/hidden of uid 4242: cannot tell whether it is dead (Permission denied)",
        "cannot detach /o/dead-stuck, a dead silofs mount of uid 4242: Device or resource busy",
        "cannot detach /o/dead-swapped, a dead silofs mount of uid 4242: a directory on "
        "its path is no longer one (a symlink?); not following it",
    ]
    assert left == ["/o/dead-stuck", "/o/dead-swapped"]
    assert deadmounts.end_dead_mounts(1, said.append) == [] and len(said) == 6


def test_the_command_is_roots_and_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from silofs.cli import main

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    res = CliRunner().invoke(main, ["end-dead-mounts", "--uid", "1000"])
    assert res.exit_code == 2
    assert res.output.strip() == (
        "silofs: error: end-dead-mounts probes as another user and unmounts: run it as root"
    )
    res = CliRunner().invoke(main, ["end-dead-mounts", "--uid", "-1"])
    assert res.exit_code == 2 and "-1" in res.output


def test_a_probe_child_keeps_no_fd_but_its_answers() -> None:
    """A probe becomes the user: it must hold none of root's files."""
    kept = os.open("/dev/null", os.O_RDONLY)  # an fd of the parent, inheritable or not
    os.set_inheritable(kept, True)
    try:

        def open_fds() -> int:
            return len(os.listdir("/proc/self/fd")) - 1  # the listing's own fd

        got = deadmounts._answers({0: deadmounts._start(open_fds, alone=True)}, 10)
        assert got == {0: 1}  # the answer's pipe alone
        got = deadmounts._answers({0: deadmounts._start(open_fds)}, 10)
        assert got[0] is not None and got[0] > 2
    finally:
        os.close(kept)
