"""A command's own output that cannot be written: stdout to a full disk or /dev/full, a
pipe whose reader has gone (`silofs-ctl status --json | head -1`, a cron job's log).

Owns telling such an OSError from any other (raised by click.echo writing stdout or
stderr) and ending the command as the CLIs end: one line on stderr and exit 1, or
silently for a closed pipe (as `cat` and `yes` do). Never writes the command's output
itself; any other OSError stays the caller's (a traceback is a bug).
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from typing import Any


def output_error(exc: BaseException) -> OSError | None:
    """`exc` if it is an OSError raised writing stdout or stderr from click.echo (the
    one way both CLIs write), else None."""
    if not isinstance(exc, OSError):
        return None
    stream: Any = None
    tb = exc.__traceback__
    while tb is not None:  # the innermost click.echo frame names the stream it wrote
        code = tb.tb_frame.f_code
        if code.co_name == "echo" and "click" in code.co_filename:
            stream = tb.tb_frame.f_locals.get("file")
        tb = tb.tb_next
    if stream is None:
        return None
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # a test runner's in-memory stream
        return None
    return exc if fd in (1, 2) else None


def end_on_output_error(exc: OSError, prog: str) -> None:
    """Exit 1: quietly for a closed pipe, else with one line on stderr (if stderr can
    take it). stdout is pointed at /dev/null first: the interpreter's last flush of
    what is still buffered would fail again, with a second message."""
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    if exc.errno != errno.EPIPE:
        with contextlib.suppress(OSError):
            why = exc.strerror or str(exc)
            sys.stderr.write(f"{prog}: error: cannot write the output: {why}\n")
            sys.stderr.flush()
    sys.exit(1)
