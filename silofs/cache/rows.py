"""Decoding a stored row that may be damaged.

Owns the one rule for every struct/JSON decode of an LMDB row outside the chunk values
(which format.py checksums): LMDB checksums none of its pages, so a flipped byte in a
leaf can change a row's key or value size, or its bytes. A row that does not decode is
one clear log line and the caller's safe default (a recount, a re-listing, a skipped
row), never a struct.error or JSONDecodeError out of a request, a loop or the daemon's
start. A damaged row that still decodes (same size, other bytes) is not caught here:
the rows that decide which bytes are served are checked where they are read (chunk
values by format.py's checksums, against the listing's content id).
"""

from __future__ import annotations

import json
import logging
import struct
from typing import Any

import lmdb

log = logging.getLogger(__name__)

# Messages already logged, so that a damaged row read on every statfs or loop pass is one
# line, not one per read. Bounded: past it, lines are logged again (never a silent fault).
_LOGGED: set[str] = set()
_LOGGED_MAX = 1024


# What decoding a damaged row raises: a short row (struct.error, IndexError), a missing
# separator (ValueError from an unpacking split).
DECODE_ERRORS = (struct.error, IndexError, ValueError)


class DamagedRowError(lmdb.CorruptedError):
    """A listing row that does not decode: an lmdb.Error, so that every handler of a
    damaged page (a mount request's EIO, a fetch's refusal) handles it too."""


def damaged(what: str, raw: bytes | memoryview | None, instead: str) -> None:
    """Log, once, that the `what` row (e.g. "usage row of dataset 3") does not decode,
    and what the caller does instead."""
    size = "missing" if raw is None else f"{len(raw)} bytes"
    message = f"damaged {what} ({size}): {instead}"
    if message in _LOGGED:
        return
    if len(_LOGGED) < _LOGGED_MAX:
        _LOGGED.add(message)
    log.error("%s", message)


def unpack(st: struct.Struct, raw: bytes | memoryview, what: str, instead: str) -> tuple | None:
    """st.unpack(raw), or None (logged) for a row that is not st.size bytes."""
    if len(raw) != st.size:
        damaged(what, raw, instead)
        return None
    return st.unpack(raw)


def loads(raw: bytes | memoryview, what: str, instead: str, kind: type = object) -> Any | None:
    """The JSON value of a row, or None (logged) if it is not JSON of type `kind`."""
    try:
        value = json.loads(bytes(raw))
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError
        value = None
    else:
        if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
            return value
    damaged(what, raw, instead)
    return None
