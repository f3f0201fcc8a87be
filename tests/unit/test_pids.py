"""pids.pid_alive: the one "is this process alive" rule (CLI, demo, the mount reaper)."""

from __future__ import annotations

import os
import subprocess
import time

from silofs.pids import pid_alive


def test_a_running_process_is_alive_and_an_exited_one_is_not() -> None:
    assert pid_alive(os.getpid())
    assert pid_alive(1)  # another user's, or root's: kill(0) may say EPERM; it exists
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert pid_alive(child.pid)
        child.kill()
        # Not reaped yet: a zombie, which kill(pid, 0) still finds.
        deadline = time.monotonic() + 10
        while pid_alive(child.pid):
            assert time.monotonic() < deadline, "a killed child still counts as alive"
            time.sleep(0.01)
        assert child.poll() is not None  # reaped only now, by us
    finally:
        child.kill()
        child.wait()
    assert not pid_alive(child.pid)
