"""Marks of a chunk's way across processes, for measurement only (bench/cluster.py
--timeline): where the wall time of a peer-served read goes between the mount, its
node daemon and the chunk's home, which CPU profiles of each process cannot say.

Off unless the environment names a directory in SILOFS_TRACE_DIR when this module is
first imported (the bench sets it for the daemons and mounts it starts; nothing else
does): then `ON` is true and each mark() appends one line, "MONOTONIC STAGE CHUNK", to
DIR/PID.trace with one write(2) on an O_APPEND descriptor (whole lines from any thread,
none lost when the process is killed). CLOCK_MONOTONIC is one clock for all processes
of a host (network namespaces do not change it), so the bench joins the marks of the
three processes by chunk. Callers test `trace.ON` before building a mark's text, so
with tracing off a mark point costs an attribute load and a branch. The lines name
object keys: the directory is the caller's own (root's for the daemons).
"""

from __future__ import annotations

import os
import time

_DIR = os.environ.get("SILOFS_TRACE_DIR") or None
ON = _DIR is not None

_fd = -1
_pid = -1  # the process _fd was opened in: a forked child opens a file of its own


def mark(stage: str, chunk: str) -> None:
    """One line for `stage` of `chunk` (its object key and index, "KEY#INDEX"), now.
    Call only when ON."""
    global _fd, _pid
    pid = os.getpid()
    if _pid != pid:
        assert _DIR is not None
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
        _fd, _pid = os.open(os.path.join(_DIR, f"{pid}.trace"), flags, 0o600), pid
    os.write(_fd, f"{time.monotonic():.6f} {stage} {chunk}\n".encode())


def chunk_id(key: str, index: int | str | None) -> str:
    """A chunk as every process names it in a mark: its object key and index (the
    characters that would split a line or a field escaped)."""
    return f"{key.translate(_ESCAPES)}#{index}"


_ESCAPES = str.maketrans({"%": "%25", " ": "%20", "\n": "%0A", "\r": "%0D"})
