"""The records both processes speak: an object as listed, a listed prefix, a mount's
counters, a job name.

Owns only plain data shared by the node daemon, the mount processes and the cache
format, so that neither side has to import the other to name them, the job-name
grammar both the CLI and the daemon check, and how a name from someone else is shown
on a terminal or in a log line (shown). Never does I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ObjectInfo:
    """One object under the dataset prefix, as the listing saw it."""

    key: str  # path relative to the dataset prefix, '/'-separated, no leading '/'
    size: int
    mtime: float  # seconds since the epoch
    version: str  # token for conditional reads: S3/Azure etag, GCS generation, local mtime_ns
    content_id: str  # store-reported content identity (etag, md5, crc32c+generation, ...)

    def __init__(self, key: str, size: int, mtime: float, version: str, content_id: str) -> None:
        # Written out (dataclass keeps an __init__ the class defines): a listing makes
        # one per object, and the generated frozen __init__ sets each field through
        # object.__setattr__, 0.66 us per object against 0.29 us for this; fields,
        # equality, hash and immutability after construction are the dataclass's own.
        d = self.__dict__
        d["key"] = key
        d["size"] = size
        d["mtime"] = mtime
        d["version"] = version
        d["content_id"] = content_id


@dataclass(frozen=True)
class PrefixListed:
    """A fanned-out listing's word about one '/'-prefix, after the objects it announces:
    `subs` are sub-prefixes one page of it named, and `done` says every page of it was
    listed (every object directly under it came before this record). `key` and `subs`
    are relative to the dataset prefix: "" is the root, else they end with '/'."""

    key: str
    subs: tuple[str, ...] = ()
    done: bool = False


# The generations one mount report may say its open handles need (`held`: the daemon
# keeps them, node/datasets.py served_generations); a mount sends the newest this many.
MAX_HELD = 1024


@dataclass
class MountCounters:
    """Cumulative counters a mount process reports; the daemon keeps the last report."""

    bytes_read: int = 0
    hit_bytes: int = 0
    miss_bytes: int = 0
    hits: int = 0
    misses: int = 0
    corrupt_chunks: int = 0
    # Where the bytes came from, apart from LMDB: the mount's own chunk buffer (a chunk
    # it fetched for an earlier kernel request), and chunks the daemon had from the
    # store for this read (a GET made for it, or one made a moment before for another
    # reader's miss, here or at a member: "shared"). Served from the cache = bytes_read
    # - buffer - store.
    buffer_bytes: int = 0
    store_bytes: int = 0
    # Reads ended with EINTR while they waited: their process was gone or told to stop
    # (mount/waits.py).
    interrupted_reads: int = 0

    def add(self, other: MountCounters) -> None:
        for k, v in vars(other).items():
            setattr(self, k, getattr(self, k) + v)

    def advance(self, report: MountCounters) -> MountCounters:
        """Take a mount's new cumulative `report` into these, the highest values it has
        reported; the change to add to its dataset's and job's counters. A counter
        that went down has not moved: the change is never negative (the dataset's
        counters are every user's mounts' and Prometheus counters), and the highest
        value stays the base, so a report going down and up again counts nothing twice."""
        delta = MountCounters()
        for k, v in vars(report).items():
            last = getattr(self, k)
            if v > last:
                setattr(delta, k, v - last)
                setattr(self, k, v)
        return delta


JOB_NAME_MAX_BYTES = 255
JOB_NAME_RULE = (
    "a job name is 1-255 bytes of UTF-8, printable, without whitespace, '/', '\"' or '\\'"
)


def job_name_error(name: object) -> str | None:
    """Why `name` is not a job name, or None if it is one. The one place the grammar is
    written (docs/SECURITY.md): job names become URL path segments, log lines, Prometheus
    label values and LMDB meta keys, so each must survive all of them. A lone surrogate
    (legal in JSON, not in UTF-8) once made /metrics answer 500 for everyone."""
    if not isinstance(name, str) or not name:
        return JOB_NAME_RULE
    try:
        size = len(name.encode())
    except UnicodeEncodeError:
        return f"{JOB_NAME_RULE}; this one is not encodable as UTF-8"
    if size > JOB_NAME_MAX_BYTES:
        return f"{JOB_NAME_RULE}; this one is {size} bytes"
    if not all(job_name_char(c) for c in name):
        return JOB_NAME_RULE
    return None


# The names configs/slurm/prolog.sh gives its jobs ("slurm-$SLURM_JOB_ID"): an untrusted
# peer may use one only once a registration names its uid (authz.check_job).
_SLURM_JOB_NAME = re.compile(r"slurm-[0-9]+")


def is_slurm_job_name(name: str) -> bool:
    """Whether `name` is of the form the Slurm prolog gives its jobs: slurm-DIGITS."""
    return _SLURM_JOB_NAME.fullmatch(name) is not None


def job_name_char(c: str) -> bool:
    """Whether a job name may hold the character `c` (job_name_error's rule per
    character; a lone surrogate is not printable, so it is refused here too)."""
    return c.isprintable() and not c.isspace() and c not in '/"\\'


def shown(text: str) -> str:
    """`text` safe to print: every character str.isprintable() refuses (C0 and C1
    controls such as ESC, CSI and BEL, DEL, newlines and tabs, bidi overrides and
    other format characters, lone surrogates) written as its Python escape (\\x1b,
    \\n, \\u202e). Names reach a terminal and the log from others (a dataset URI,
    a mountpoint, an object key in an error, a member's certificate name): none may
    move the cursor, recolour, retitle the terminal or start a line of its own."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def not_utf8(text: str) -> str | None:
    """None if `text` is UTF-8 text; else it shown with its undecodable bytes as \\xNN
    (a path or name the CLI received surrogate-escaped: the daemon's API, its LMDB rows
    and /metrics take UTF-8 only), for a one-line refusal that names it."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return None


def shown_all(value: Any) -> Any:
    """A JSON answer with every string in it, keys included, shown() (for text output;
    JSON output keeps the strings as they are, json.dumps escapes them itself)."""
    if isinstance(value, str):
        return shown(value)
    if isinstance(value, dict):
        return {shown_all(k): shown_all(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [shown_all(v) for v in value]
    return value
