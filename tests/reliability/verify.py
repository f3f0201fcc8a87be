"""Reading through a mount the way a careful application does, for the reliability checks.

Owns `pread_all`: a read that returns fewer bytes than asked is not end-of-file on Linux
when an I/O error came after some bytes were copied (filemap_read returns the partial
count; the next read reports the error). So a short read is followed up at the next offset:
an error there is an error, more bytes are more bytes, and only zero bytes before the end
of the file is a short file (wrong bytes). Never decides what a check asserts.
"""

from __future__ import annotations

import os


def pread_all(fd: int, n: int, off: int) -> tuple[bytes, OSError | None, bool]:
    """(bytes read, the error that stopped the read or None, whether a read returned zero
    bytes early, i.e. the file looked shorter than `n` from `off`: the caller knows the
    real size and decides whether that was end-of-file)."""
    parts: list[bytes] = []
    got = 0
    while got < n:
        try:
            data = os.pread(fd, n - got, off + got)
        except OSError as exc:
            return b"".join(parts), exc, False
        if not data:
            return b"".join(parts), None, True
        parts.append(data)
        got += len(data)
    return b"".join(parts), None, False
