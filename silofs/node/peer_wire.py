"""What members say to each other on the peer routes: the paths, the headers, a chunk
request's fields, and a dataset's description.

Owns the one encoding both sides use (node/cluster.py asks, node/api/peer.py and
node/peer_serve.py answer): a chunk request names everything the home needs to fetch
the chunk itself without a listing (dataset URI, object key, size, version, content id,
chunk size and index) and the asking job; the home computes the chunk key from those,
never takes one. Checked here into one-line ValueErrors (400 on the home). Never does
I/O and never decides anything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import quote

from silofs.cache.format import ChunkRef, header_bytes
from silofs.records import ObjectInfo, job_name_error
from silofs.units import is_digits

CHUNK_PATH = "/v1/peer/chunk"
DATASETS_PATH = "/v1/peer/datasets"
PING_PATH = "/v1/peer/ping"
ALLOCATIONS_PATH = "/v1/peer/allocations"

CLUSTER_HEADER = "x-silofs-cluster"  # the cluster the asker believes it talks to
CHARGE_HEADER = "x-silofs-charge"  # 428: bytes the asker charges its job before asking again
# Where a chunk answer came from (answer_source): "cache", "shared" or "remote".
SOURCE_HEADER = "x-silofs-source"
UNKNOWN_DATASET_HEADER = "x-silofs-unknown-dataset"  # 404: introduce the dataset first

# Store options a member passes on with a dataset (a home opens it with them). Never
# credentials or what selects them (profile, credential), never an endpoint: a home
# sends its own credentials only to its own endpoint. A dataset opened here with other
# options, or another endpoint, is read by this node alone.
PEER_OPTIONS = frozenset({"region", "requester_pays", "anonymous"})

MIN_CHUNK, MAX_CHUNK = 64 << 10, 64 << 20
_MAX_TEXT = 4096
_REQUIRED_ORDER = ("ds", "key", "cid", "size", "version", "cs", "i", "job")
_REQUIRED = frozenset(_REQUIRED_ORDER)
# Every chunk request names its dataset, job and object again: what was escaped or
# checked once is remembered (a handful of datasets and jobs, a few chunks per object),
# at most _MAX_MEMO of each and texts of at most _MEMO_CHARS (a member's asks land here:
# the memory stays bounded), forgotten all at once when full.
_MAX_MEMO = 4096
_MEMO_CHARS = 256
_GOOD_JOBS: set[str] = set()  # job names job_name_error passed
_QUOTED: dict[str, str] = {}  # _quote's answers


@dataclass(frozen=True)
class ChunkAsk:
    """One chunk request of a member."""

    uri: str
    key: str
    content_id: str
    size: int
    version: str
    chunk_size: int
    index: int
    job: str
    charged: bool = False  # the asker charged its job for the chunk (after a 428)
    warm: bool = False  # a warm: no body, the answer says held, admitted or full

    @classmethod
    def of(cls, uri: str, ref: ChunkRef, job: str, *, charged: bool, warm: bool) -> ChunkAsk:
        o = ref.obj
        return cls(
            uri, o.key, o.content_id, o.size, o.version, ref.chunk_size, ref.index, job,
            charged, warm,
        )  # fmt: skip

    def target(self) -> str:
        return (
            f"{CHUNK_PATH}?ds={_quote(self.uri)}&key={_quote(self.key)}"
            f"&cid={_quote(self.content_id)}&size={self.size}&version={_quote(self.version)}"
            f"&cs={self.chunk_size}&i={self.index}&job={_quote(self.job)}"
            f"&charged={int(self.charged)}&warm={int(self.warm)}"
        )

    @classmethod
    def from_query(cls, q: dict[str, str]) -> ChunkAsk:
        """The request a query names; ValueError (one line) if it names none."""
        if not q.keys() >= _REQUIRED:
            raise ValueError(f"missing {next(n for n in _REQUIRED_ORDER if n not in q)}")
        for name in ("ds", "key", "cid", "version"):
            if not q[name] or len(q[name]) > _MAX_TEXT or not q[name].isprintable():
                raise ValueError(f"{name} must be printable text of 1-{_MAX_TEXT} characters")
        if not key_is_listable(q["key"]):
            raise ValueError(f"key {q['key'][:100]!r} is not an object key a listing names")
        job = q["job"]
        if job not in _GOOD_JOBS:
            why = job_name_error(job)
            if why is not None:
                raise ValueError(why)
            if len(_GOOD_JOBS) >= _MAX_MEMO:
                _GOOD_JOBS.clear()
            _GOOD_JOBS.add(job)
        size, cs, index = (_int(q, n) for n in ("size", "cs", "i"))
        if not MIN_CHUNK <= cs <= MAX_CHUNK:
            raise ValueError("cs must be between 64KiB and 64MiB")
        if not 0 <= index <= max(0, (size - 1) // cs):
            raise ValueError(f"the object has no chunk {index}")
        flags = [q.get(n, "0") for n in ("charged", "warm")]
        if any(f not in ("0", "1") for f in flags):
            raise ValueError("charged and warm are 0 or 1")
        return cls(
            q["ds"], q["key"], q["cid"], size, q["version"], cs, index, q["job"],
            flags[0] == "1", flags[1] == "1",
        )  # fmt: skip

    def ref(self) -> ChunkRef:
        """The chunk, as the home computes it: its key from the content id, chunk size
        and index (cache/format.py chunk_key), never from the asker."""
        obj = ObjectInfo(self.key, self.size, 0.0, self.version, self.content_id)
        return ChunkRef.of(obj, self.chunk_size, self.index)


# What a query value may carry as it is (RFC 3986 allows "/" and ":" in a query);
# everything else is percent-encoded.
_UNSAFE = re.compile(r"[^A-Za-z0-9_.~/:-]")


def _escape(m: re.Match[str]) -> str:
    return f"%{ord(m.group()):02X}"


def _quote(text: str) -> str:
    """quote(text, safe="/:"), in one regex pass for ASCII text (a dataset URI, a key, a
    content id and a version: escaped on every chunk request, so remembered)."""
    quoted = _QUOTED.get(text)
    if quoted is None:
        quoted = _UNSAFE.sub(_escape, text) if text.isascii() else quote(text, safe="/:")
        if len(text) <= _MEMO_CHARS:
            if len(_QUOTED) >= _MAX_MEMO:
                _QUOTED.clear()
            _QUOTED[text] = quoted
    return quoted


def _int(q: dict[str, str], name: str) -> int:
    text = q[name]
    if not is_digits(text) or len(text) > 19:
        raise ValueError(f"{name} must be a whole number")
    return int(text)


def key_is_listable(key: str) -> bool:
    """Whether a listing could name `key`: no empty, '.' or '..' part, no NUL, no
    leading '/' (the listing skips those; a home must not read a path they make)."""
    if "\0" in key or key.startswith("/"):
        return False
    parts = key.split("/")
    return "" not in parts and "." not in parts and ".." not in parts


def dataset_body(uri: str, options: dict[str, str]) -> dict[str, object]:
    """The body of PUT /v1/peer/datasets: a dataset a home may not have open."""
    return {"uri": uri, "options": {k: v for k, v in options.items() if k in PEER_OPTIONS}}


# Room for the object key in most_value_bytes: more than any store's key or local path
# (S3 1,024 bytes, PATH_MAX 4,096) as any dataset holding the chunk lists it.
_KEY_ROOM = 64 << 10


def answer_source(header: str | None) -> str:
    """A chunk answer's source header read: "cache" (the home's cache held it: a cluster
    hit), "shared" (no store GET for this ask, and no hit either: the chunk was in flight,
    or waiting in the home's admission queue, from a GET another asker's miss made a
    moment before: its bytes came from the store, charged to that asker's job) or
    "remote" (the home's GET for this ask, charged to the asker's job). A home older
    than "shared" says "cache" for it; anything unknown reads as "cache" too."""
    return header if header in ("shared", "remote") else "cache"


def most_value_bytes(ref: ChunkRef) -> int:
    """The longest value that can hold this chunk, under whatever object key the
    dataset that admitted it lists (a member's answer longer than this is not it)."""
    return ref.length + header_bytes(b"", ref.obj.content_id.encode(), ref.length) + _KEY_ROOM
