"""On-disk format of one cached chunk, and how chunks are named.

Owns the byte layout of an LMDB value (a versioned header, then the chunk's bytes), the
content-derived chunk key, and the one verify-count-log of a cached value. A golden-bytes
test pins this layout: changing it means a new FORMAT_VERSION, never a silent
reinterpretation of old caches. Never does I/O.

Layout of a version-2 value (little-endian):
    magic      4s   b"SLFC"
    version    u16  FORMAT_VERSION (2)
    blk_shift  u8   log2 of the checksum block size (16: 64 KiB)
    reserved   u8   0
    hdr_len    u32  bytes before the data: fixed part, variable part, block sums, hdr_sum
    dataset    u64  id of the dataset that admitted (and is charged for) the chunk
    index      u64  chunk index within the object
    csize      u64  nominal chunk size the object was cut with
    length     u32  number of data bytes that follow the header
    key_len    u16, key (utf-8): the object key as the admitting dataset listed it
    cid_len    u16, content_id (utf-8): store-reported identity (etag/md5/generation+size)
    sums       u64 x ceil(length / block): xxh3_64 of each data block (the last may be short)
    hdr_sum    u64  xxh3_64 of the header bytes before it, [0, hdr_len - 8)
    data       length bytes

Why per-block sums: every read of a cached chunk is verified when it is served (promise
3), and a FUSE read of [off, off+size) checks the header and only the blocks it covers,
so the cost follows the bytes served, not the chunk size (measured: docs/RESULTS.md).

Version-1 values (one xxh3_64 over header and data) are not verified any more: they are
a miss (StaleFormatError, not counted as corrupt) and the refetch replaces them with a
version-2 value. A cache written by this version is read as a miss by an older one.
"""

from __future__ import annotations

import logging
import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import xxhash

from silofs import heap
from silofs.errors import UsageError
from silofs.records import ObjectInfo

log = logging.getLogger(__name__)

# A value being built in place: a heap buffer, or a memory file's mapping (silofs/sealed.py).
Buffer = bytearray | mmap.mmap

MAGIC = b"SLFC"
FORMAT_VERSION = 2
BLOCK_SHIFT = 16
BLOCK_SIZE = 1 << BLOCK_SHIFT
_FIXED = struct.Struct("<4sHBBIQQQI")
# _FIXED cut around the dataset id (bytes 12-20): magic to hdr_len; index, csize, length
# and the key's length (ChunkRef.expect).
_LEAD = struct.Struct("<4sHBBI")
_IDENT = struct.Struct("<QQIH")
_DATASET_AT, _INDEX_AT = _LEAD.size, _LEAD.size + 8
_LEN16 = struct.Struct("<H")
_SUM = struct.Struct("<Q")
_V1_PREFIX = struct.Struct("<4sH")
_MIN_HDR = _FIXED.size + 4 + 8  # two empty strings, no blocks, the header sum
KEY_SIZE = 16
_hash = xxhash.xxh3_64_intdigest


class ChunkFormatError(Exception):
    """A cached value failed verification; the caller treats it as a miss."""


class StaleFormatError(ChunkFormatError):
    """A well-formed value of an older FORMAT_VERSION: a miss, refetched, not corrupt."""


@dataclass(frozen=True)
class ChunkHeader:
    dataset: int
    index: int
    chunk_size: int
    length: int
    checksum: int  # of the header (hdr_sum)
    key: str
    content_id: str
    header_len: int
    sums_offset: int  # where the block sums start
    block_shift: int


def chunk_length(obj: ObjectInfo, chunk_size: int, index: int) -> int:
    """Bytes in chunk `index` of `obj`; UsageError if the index is past the end."""
    start = index * chunk_size
    if index < 0 or (start >= obj.size and not (obj.size == 0 and index == 0)):
        raise UsageError(f"chunk {index} is past the end of {obj.key}")
    return min(chunk_size, obj.size - start)


# The most chunks a mount's read-ahead span may name (GET /v1/chunks?span=FIRST-LAST):
# the mount never asks for more, the daemon answers 400 to more.
MAX_SPAN_CHUNKS = 64


@dataclass(slots=True, unsafe_hash=True)
class ChunkRef:
    """Chunk `index` of a listed object cut into `chunk_size` pieces, with its key and
    length computed once: every step of a read or a miss passes this along. Nothing
    changes a ref once made (hashed and compared by its fields, as a frozen one).

    Slots set by plain assignments, not a frozen dataclass: a frozen one sets each field
    through object.__setattr__ (~0.8 k instructions a field), and one whose __init__
    writes its __dict__ instead (as this was) pays ~3.7x per attribute load after it
    (CPython 3.11); a hit reads a dozen of them per request (bench/README.md, "the
    kept-mount round")."""

    obj: ObjectInfo
    chunk_size: int
    index: int
    key: bytes
    length: int
    content_bytes: bytes  # obj.content_id encoded, as a value's header holds it
    # The header length of its value as written under obj.key (header_bytes): what a
    # hit copies along with the data, in the same read (0: not known, as for a ref
    # built by hand). Derived from the fields above: not compared.
    header: int = field(default=0, compare=False)
    # Its value's header as written under obj.key, but for the dataset id, the block
    # sums and the header sum: (bytes [0, 12), bytes [20, the sums), the header's
    # length), what check_copy compares a copy's header with instead of parsing it
    # (None: parse, as for a ref built by hand). Derived from the fields above: not
    # compared.
    expect: tuple[bytes, bytes, int] | None = field(default=None, compare=False)

    def __init__(
        self,
        obj: ObjectInfo,
        chunk_size: int,
        index: int,
        key: bytes,
        length: int,
        content_bytes: bytes,
        header: int = 0,
        expect: tuple[bytes, bytes, int] | None = None,
    ) -> None:
        self.obj = obj
        self.chunk_size = chunk_size
        self.index = index
        self.key = key
        self.length = length
        self.content_bytes = content_bytes
        self.header = header
        self.expect = expect

    @classmethod
    def of(cls, obj: ObjectInfo, chunk_size: int, index: int) -> ChunkRef:
        length = chunk_length(obj, chunk_size, index)
        cid = obj.content_id
        cid_bytes = cid.encode()
        key_bytes = obj.key.encode()
        # header_bytes() written out: one call fewer on every file a mount opens.
        header = (
            _MIN_HDR
            + len(key_bytes)
            + len(cid_bytes)
            + 8 * ((length + BLOCK_SIZE - 1) >> BLOCK_SHIFT)
        )
        # The header's bytes as _header() writes them, up to the sums (the dataset id
        # left out: any dataset may have admitted the chunk).
        lead = _LEAD.pack(MAGIC, FORMAT_VERSION, BLOCK_SHIFT, 0, header)
        ident = b"".join(
            (
                _IDENT.pack(index, chunk_size, length, len(key_bytes)),
                key_bytes,
                _LEN16.pack(len(cid_bytes)),
                cid_bytes,
            )
        )
        key = chunk_key(cid, chunk_size, index)
        return cls(obj, chunk_size, index, key, length, cid_bytes, header, (lead, ident, header))

    @property
    def start(self) -> int:
        return self.index * self.chunk_size


class CorruptCounter(Protocol):
    corrupt_chunks: int


def chunk_key(content_id: str, chunk_size: int, index: int) -> bytes:
    """The LMDB key of a chunk: a hash of what the bytes are, not where they live.

    Two datasets whose store reports the same content identity share the chunk.
    """
    return xxhash.xxh3_128_digest(f"{content_id}\0{chunk_size}\0{index}".encode())


def _variable_part(key: str, content_id: str) -> bytes:
    k = key.encode()
    c = content_id.encode()
    return _LEN16.pack(len(k)) + k + _LEN16.pack(len(c)) + c


def _blocks(length: int, shift: int) -> int:
    return (length + (1 << shift) - 1) >> shift


def _header(dataset: int, index: int, chunk_size: int, data: memoryview, var: bytes) -> bytes:
    """A value's whole header for `data`: fixed part, variable part, block sums, hdr_sum."""
    n = len(data)
    sums = b"".join(
        _SUM.pack(_hash(data[off : off + BLOCK_SIZE])) for off in range(0, n, BLOCK_SIZE)
    )
    hdr_len = _FIXED.size + len(var) + len(sums) + 8
    fixed = _FIXED.pack(
        MAGIC, FORMAT_VERSION, BLOCK_SHIFT, 0, hdr_len, dataset, index, chunk_size, n
    )
    header = fixed + var + sums
    return header + _SUM.pack(_hash(header))


def encode_chunk(
    dataset: int, index: int, chunk_size: int, key: str, content_id: str, data: bytes | memoryview
) -> bytes:
    """Header + data as one value, block sums and header sum filled in. The data is
    copied once, by the join; no buffer is zero-filled first. A chunk read from a
    stream is built in place instead (ChunkValue: no copy at all)."""
    mv = memoryview(data)
    return b"".join((_header(dataset, index, chunk_size, mv, _variable_part(key, content_id)), mv))


class ChunkValue:
    """A value built in place: the caller fills `data` (a view of the value's data part,
    say a socket's recv_into), then seal() writes the header in front of it. The value
    is what encode_chunk would return for those bytes, without their copy into it (a
    cold read hands the value's own data on to the reader: node/fetch.py)."""

    def __init__(
        self,
        length: int,
        key: str,
        content_id: str,
        alloc: Callable[[int], Buffer] = heap.uninitialized,
    ) -> None:
        self._var = _variable_part(key, content_id)
        self._hdr_len = header_bytes(key.encode(), content_id.encode(), length)
        # Not zeroed first (alloc's buffer may hold anything): the caller fills all of
        # `data` or drops the value.
        self.value = alloc(self._hdr_len + length)
        self.data = memoryview(self.value)[self._hdr_len :]

    def seal(self, dataset: int, index: int, chunk_size: int) -> Buffer:
        """The value, its header written for the data as it is now. `data` is released:
        the value is the one reference to its buffer left here."""
        header = _header(dataset, index, chunk_size, self.data, self._var)
        assert len(header) == self._hdr_len
        self.value[: self._hdr_len] = header
        self.data.release()
        return self.value


def _parse(mv: memoryview) -> tuple[int, int, int, int, int, int, int, int, int, int]:
    """(dataset, index, csize, length, hdr_len, shift, key_at, cid_at, sums_at, checksum)
    of a value whose header checksum holds, else ChunkFormatError. Touches no data."""
    n = len(mv)
    if n < _FIXED.size:
        _short(mv)
    magic, version, shift, _, hdr_len, dataset, index, csize, length = _FIXED.unpack_from(mv)
    _check_kind(magic, version)
    if hdr_len + length != n or hdr_len < _MIN_HDR:
        raise ChunkFormatError("header length does not match the value")
    (checksum,) = _SUM.unpack_from(mv, hdr_len - 8)
    if _hash(mv[: hdr_len - 8]) != checksum:
        raise ChunkFormatError("header checksum mismatch")
    # The header is as written (or a checksum collision); a writer's own inconsistency
    # is still refused below rather than trusted.
    if not 12 <= shift <= 26:
        raise ChunkFormatError(f"bad block size 2**{shift}")
    key_at = _FIXED.size + 2
    (klen,) = _LEN16.unpack_from(mv, _FIXED.size)
    cid_at = key_at + klen + 2
    if cid_at > hdr_len - 8:
        raise ChunkFormatError("bad variable header: key runs past the header")
    (clen,) = _LEN16.unpack_from(mv, cid_at - 2)
    sums_at = cid_at + clen
    if sums_at + 8 * _blocks(length, shift) + 8 != hdr_len:
        raise ChunkFormatError("variable header length mismatch")
    return dataset, index, csize, length, hdr_len, shift, key_at, cid_at, sums_at, checksum


def decode_header(value: bytes | memoryview) -> ChunkHeader:
    """Parse and check the header (its own checksum included) without touching the data."""
    mv = memoryview(value)
    dataset, index, csize, length, hdr_len, shift, key_at, cid_at, sums_at, checksum = _parse(mv)
    try:
        key = bytes(mv[key_at : cid_at - 2]).decode()
        cid = bytes(mv[cid_at:sums_at]).decode()
    except UnicodeDecodeError as exc:
        raise ChunkFormatError(f"bad variable header: {exc}") from None
    return ChunkHeader(dataset, index, csize, length, checksum, key, cid, hdr_len, sums_at, shift)


def layout(head: bytes | bytearray | memoryview) -> tuple[int, int]:
    """(hdr_len, block shift) as the fixed part of a value's header states them,
    UNCHECKED: how much of a value to copy before check_copy checks the copy. Raises
    ChunkFormatError (StaleFormatError for version 1) if `head` holds no fixed part."""
    if len(head) < _FIXED.size:
        _short(head)
    _, _, shift, _, hdr_len, _, _, _, _ = _FIXED.unpack_from(head)
    return hdr_len, shift


def header_bytes(key: bytes, content_id: bytes, length: int) -> int:
    """The header length of a value written for this chunk under `key` (the object key
    as the admitting dataset listed it): what a reader copies along with the data."""
    return _MIN_HDR + len(key) + len(content_id) + 8 * _blocks(length, BLOCK_SHIFT)


def _short(mv: bytes | bytearray | memoryview) -> None:
    n = len(mv)
    if n >= _V1_PREFIX.size and _V1_PREFIX.unpack_from(mv) == (MAGIC, 1):
        raise StaleFormatError("chunk format version 1")
    raise ChunkFormatError("value shorter than a chunk header")


def _check_kind(magic: bytes, version: int) -> None:
    """ChunkFormatError unless the fixed header names a value of this format version
    (StaleFormatError for version 1: a refetch, not damage)."""
    if magic != MAGIC:
        raise ChunkFormatError("bad magic")
    if version != FORMAT_VERSION:
        if version == 1:
            raise StaleFormatError("chunk format version 1")
        raise ChunkFormatError(f"unknown chunk format version {version}")


def verify_chunk(
    value: bytes | memoryview,
    content_id: str | bytes,
    chunk_size: int,
    index: int,
    expected_length: int,
    lo: int = 0,
    hi: int | None = None,
) -> memoryview:
    """The whole data of `value` if it is the expected chunk, else ChunkFormatError.

    Checks the header (its checksum and identity fields) on every call, and the data
    blocks covering [lo, hi) (default: all of it). Bytes outside those blocks are NOT
    verified: the caller serves only [lo, hi) of the returned view. The returned view
    is of `value` itself, so `value` must be bytes nobody changes after the check: for a
    value in the LMDB map (which a writer, or anything that writes data.mdb, may change
    under a reader) use copy_verified."""
    mv = value if type(value) is memoryview else memoryview(value)
    if hi is None:
        hi = expected_length
    # The value is its own header and its own blocks: check_copy checks them in place.
    # The layout is unchecked here (check_copy refuses a wrong one before it looks at
    # the blocks), only used to find the block covering `lo`.
    hdr_len, shift = layout(mv)
    start = (lo >> shift) << shift if 12 <= shift <= 26 and lo > 0 else 0
    check_copy(
        mv, len(mv), mv[hdr_len + start :], content_id, chunk_size, index, expected_length, lo, hi
    )
    return mv[hdr_len:]


def copy_verified(
    value: bytes | memoryview,
    content_id: str | bytes,
    chunk_size: int,
    index: int,
    expected_length: int,
    lo: int = 0,
    hi: int | None = None,
) -> memoryview:
    """Exactly the data [lo, hi) of `value` if it is the expected chunk, else
    ChunkFormatError: the blocks covering [lo, hi) are copied out of `value` first and the
    copy is what is checked and returned. This is the hit path of every FUSE read
    (`content_id` given encoded: ChunkRef.content_bytes): a value in the LMDB map may
    change after a check of the map itself (a damaged disk, anything writing data.mdb),
    and the kernel copies a reply only after the handler returns, so only bytes of our
    own are ever both checked and served."""
    mv = value if type(value) is memoryview else memoryview(value)
    if hi is None:
        hi = expected_length
    hdr_len, shift = layout(mv)
    if not 12 <= shift <= 26 or not _MIN_HDR <= hdr_len <= len(mv):
        hdr_len, shift = len(mv), BLOCK_SHIFT  # check_copy names what is wrong
    header = memoryview(mv[:hdr_len].tobytes())
    start = (lo >> shift) << shift
    end = hdr_len + (((hi - 1) >> shift) + 1 << shift) if hi > lo else hdr_len + start
    own = memoryview(mv[hdr_len + start : end].tobytes())
    return check_copy(header, len(mv), own, content_id, chunk_size, index, expected_length, lo, hi)


def check_copy(
    header: memoryview,
    size: int,
    blocks: memoryview,
    content_id: str | bytes,
    chunk_size: int,
    index: int,
    expected_length: int,
    lo: int,
    hi: int,
    expect: tuple[bytes, bytes, int] | None = None,
) -> memoryview:
    """Exactly the data [lo, hi) of a value of `size` bytes if it is the expected chunk,
    else ChunkFormatError, checked on copies the caller made and nobody else can change:
    `header`, at least the value's first hdr_len bytes (layout()), and `blocks`, its
    data from the block covering `lo` on, through the one covering hi - 1 (or more). The
    result is a view of `blocks`.

    The header must be sound (its own checksum) and name exactly this chunk; then each
    block covering [lo, hi) must match its sum. With `expect` (ChunkRef.expect: the
    header's bytes but for the dataset id and the sums, as written under the reader's
    own object key), a header holding exactly those bytes is that chunk's, laid out as
    expected: only its checksum is left to check, no field parsed. Any other header is
    parsed and checked field by field (a value admitted under another dataset's key for
    the same content passes there). Every hit passes here, so all of it is one frame."""
    hdr_len = 0
    if expect is not None:
        lead, ident, hdr_len = expect
        sums_at = _INDEX_AT + len(ident)
        if not (
            hdr_len + expected_length == size
            and len(header) >= hdr_len
            and header[:_DATASET_AT] == lead
            and header[_INDEX_AT:sums_at] == ident
        ):
            hdr_len = 0
    if hdr_len:
        shift = BLOCK_SHIFT  # in `lead`
        if _hash(header[: hdr_len - 8]) != _SUM.unpack_from(header, hdr_len - 8)[0]:
            raise ChunkFormatError("header checksum mismatch")
    else:
        cid = content_id.encode() if type(content_id) is str else content_id
        if len(header) < _FIXED.size:
            _short(header)
        magic, version, shift, _, hdr_len, _, idx, csize, dlen = _FIXED.unpack_from(header)
        if magic != MAGIC or version != FORMAT_VERSION:
            _check_kind(magic, version)
        if hdr_len + dlen != size or hdr_len < _MIN_HDR or len(header) < hdr_len:
            raise ChunkFormatError("header length does not match the value")
        if not 12 <= shift <= 26:
            raise ChunkFormatError(f"bad block size 2**{shift}")
        if _hash(header[: hdr_len - 8]) != _SUM.unpack_from(header, hdr_len - 8)[0]:
            raise ChunkFormatError("header checksum mismatch")
        cid_at = _FIXED.size + 4 + _LEN16.unpack_from(header, _FIXED.size)[0]
        if cid_at > hdr_len - 8:
            raise ChunkFormatError("bad variable header: key runs past the header")
        sums_at = cid_at + _LEN16.unpack_from(header, cid_at - 2)[0]
        if sums_at + 8 * ((dlen + (1 << shift) - 1) >> shift) + 8 != hdr_len:
            raise ChunkFormatError("variable header length mismatch")
        if idx != index or csize != chunk_size or header[cid_at:sums_at] != cid:
            raise ChunkFormatError("chunk header names another object or chunk")
        if dlen != expected_length:
            raise ChunkFormatError(f"chunk length {dlen} != expected {expected_length}")
    step = 1 << shift
    if not 0 <= lo <= hi <= expected_length:
        raise ValueError(f"range [{lo}, {hi}) outside a chunk of {expected_length} bytes")
    if hi <= lo:
        return memoryview(b"")
    b = lo >> shift
    start = b << shift
    n = min(((hi - 1) >> shift) + 1 << shift, expected_length) - start
    if len(blocks) < n:
        raise ChunkFormatError("short copy of the value")
    data = blocks[:n]
    at = sums_at + 8 * b
    for off in range(0, n, step):
        if _hash(data[off : off + step]) != _SUM.unpack_from(header, at)[0]:
            raise ChunkFormatError(f"checksum mismatch in block {b + (off >> shift)}")
        at += 8
    return data[lo - start : hi - start]


def checked_chunk(
    value: bytes | memoryview,
    ref: ChunkRef,
    counts: CorruptCounter,
    lo: int = 0,
    hi: int | None = None,
    *,
    copy: bool = True,
) -> memoryview | None:
    """The data [lo, hi) (default all of it) of a cached value if it is exactly `ref`,
    else None: a corrupt value is counted in `counts` and logged here, and the caller
    treats it as a miss (and refetches, replacing the value). A value of an older format
    is a miss too, but not counted as corrupt. What is returned was copied out of `value`
    before it was checked (copy_verified); `copy=False` only where `value` is already
    the caller's own bytes: then the check is of `value`, and a view of it returned."""
    args = (ref.content_bytes, ref.chunk_size, ref.index, ref.length, lo, hi)
    try:
        if not copy:
            view = verify_chunk(value, *args)
            return view[lo:hi]
        return copy_verified(value, *args)
    except StaleFormatError:
        return None
    except ChunkFormatError as exc:
        count_damage(ref, counts, exc)
        return None


def count_damage(ref: ChunkRef, counts: CorruptCounter, exc: ChunkFormatError) -> None:
    """Count and log a cached value of `ref` that failed its check (the caller refetches)."""
    counts.corrupt_chunks += 1
    log.warning(
        "cached chunk %d of %s failed verification (%s); refetching", ref.index, ref.obj.key, exc
    )
