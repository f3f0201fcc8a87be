"""Whether a process is alive, by pid: the one rule the CLI, the demo and the daemon's
mount reaper share.

Owns the answer to "is pid P still running": kill(P, 0) says whether the pid exists
(EPERM: it does, as another user's), and /proc says whether it is a zombie, which has
exited and only waits for its parent to reap it. Never sends a real signal and never
waits.
"""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True while `pid` names a process that has not exited (a zombie has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False  # it exited since kill()
    except OSError:
        return True  # no /proc to ask: kill() said it exists
    # "pid (comm) state ...": comm may hold spaces and parentheses, the state follows
    # the last ")".
    fields = stat.rpartition(b")")[2].split()
    return not fields or fields[0] != b"Z"
