"""On-disk format of one cached chunk, and how chunks are named.

Owns the byte layout of an LMDB value (a versioned header, then the chunk's bytes) and
the content-derived chunk key. A golden-bytes test pins this layout: changing it means a
new FORMAT_VERSION, never a silent reinterpretation of old caches. Never does I/O.

Layout of a value (little-endian):
    magic      4s   b"SLFC"
    version    u16  FORMAT_VERSION
    hdr_len    u16  bytes before the data, including the variable part
    dataset    u64  id of the dataset that admitted (and is charged for) the chunk
    index      u64  chunk index within the object
    csize      u64  nominal chunk size the object was cut with
    length     u32  number of data bytes that follow the header
    checksum   u64  xxh3_64 over the header (with this field zero) and the data
    key_len    u16, key (utf-8): the object key as the admitting dataset listed it
    cid_len    u16, content_id (utf-8): store-reported identity (etag/md5/generation+size)
    data       length bytes
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from typing import Protocol

import xxhash

from silofs.errors import UsageError
from silofs.records import ObjectInfo

log = logging.getLogger(__name__)

MAGIC = b"SLFC"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<4sHHQQQIQ")
_CHECKSUM_OFFSET = _FIXED.size - 8
_LEN16 = struct.Struct("<H")
KEY_SIZE = 16


class ChunkFormatError(Exception):
    """A cached value failed verification; the caller treats it as a miss."""


@dataclass(frozen=True)
class ChunkHeader:
    dataset: int
    index: int
    chunk_size: int
    length: int
    checksum: int
    key: str
    content_id: str
    header_len: int


def chunk_length(obj: ObjectInfo, chunk_size: int, index: int) -> int:
    """Bytes in chunk `index` of `obj`; UsageError if the index is past the end."""
    start = index * chunk_size
    if index < 0 or (start >= obj.size and not (obj.size == 0 and index == 0)):
        raise UsageError(f"chunk {index} is past the end of {obj.key}")
    return min(chunk_size, obj.size - start)


@dataclass(frozen=True)
class ChunkRef:
    """Chunk `index` of a listed object cut into `chunk_size` pieces, with its key and
    length computed once: every step of a read or a miss passes this along."""

    obj: ObjectInfo
    chunk_size: int
    index: int
    key: bytes
    length: int

    @classmethod
    def of(cls, obj: ObjectInfo, chunk_size: int, index: int) -> ChunkRef:
        length = chunk_length(obj, chunk_size, index)
        return cls(obj, chunk_size, index, chunk_key(obj.content_id, chunk_size, index), length)

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


def encode_chunk(
    dataset: int, index: int, chunk_size: int, key: str, content_id: str, data: bytes | memoryview
) -> bytes:
    """Header + data as one value, checksum filled in."""
    var = _variable_part(key, content_id)
    hdr_len = _FIXED.size + len(var)
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, hdr_len, dataset, index, chunk_size, len(data), 0)
    h = xxhash.xxh3_64(fixed)
    h.update(var)
    h.update(data)
    fixed = fixed[:_CHECKSUM_OFFSET] + struct.pack("<Q", h.intdigest())
    return b"".join((fixed, var, data))


def decode_header(value: bytes | memoryview) -> ChunkHeader:
    """Parse the header without touching the data (cheap; no checksum)."""
    if len(value) < _FIXED.size:
        raise ChunkFormatError("value shorter than a chunk header")
    magic, version, hdr_len, dataset, index, csize, length, checksum = _FIXED.unpack_from(value)
    if magic != MAGIC:
        raise ChunkFormatError("bad magic")
    if version != FORMAT_VERSION:
        raise ChunkFormatError(f"unknown chunk format version {version}")
    if hdr_len + length != len(value) or hdr_len < _FIXED.size + 4:
        raise ChunkFormatError("header length does not match the value")
    pos = _FIXED.size
    try:
        (klen,) = _LEN16.unpack_from(value, pos)
        key = bytes(value[pos + 2 : pos + 2 + klen]).decode()
        pos += 2 + klen
        (clen,) = _LEN16.unpack_from(value, pos)
        cid = bytes(value[pos + 2 : pos + 2 + clen]).decode()
        pos += 2 + clen
    except (struct.error, UnicodeDecodeError) as exc:
        raise ChunkFormatError(f"bad variable header: {exc}") from None
    if pos != hdr_len:
        raise ChunkFormatError("variable header length mismatch")
    return ChunkHeader(dataset, index, csize, length, checksum, key, cid, hdr_len)


def verify_chunk(
    value: bytes | memoryview, content_id: str, chunk_size: int, index: int, expected_length: int
) -> memoryview:
    """The data of `value` if it is exactly the expected chunk, else ChunkFormatError.

    Checks identity fields first (cheap) and the checksum last (one pass over the data).
    """
    hdr = decode_header(value)
    if hdr.content_id != content_id or hdr.index != index or hdr.chunk_size != chunk_size:
        raise ChunkFormatError("chunk header names another object or chunk")
    if hdr.length != expected_length:
        raise ChunkFormatError(f"chunk length {hdr.length} != expected {expected_length}")
    mv = memoryview(value)
    h = xxhash.xxh3_64(mv[:_CHECKSUM_OFFSET])
    h.update(b"\0" * 8)
    h.update(mv[_FIXED.size :])
    if h.intdigest() != hdr.checksum:
        raise ChunkFormatError("checksum mismatch")
    return mv[hdr.header_len :]


def checked_chunk(
    value: bytes | memoryview, ref: ChunkRef, counts: CorruptCounter
) -> memoryview | None:
    """The data of a cached value if it is exactly `ref`, else None: a corrupt value is
    counted in `counts` and logged once here, and the caller treats it as a miss."""
    try:
        return verify_chunk(value, ref.obj.content_id, ref.chunk_size, ref.index, ref.length)
    except ChunkFormatError as exc:
        counts.corrupt_chunks += 1
        log.warning(
            "cached chunk %d of %s failed verification (%s); refetching",
            ref.index,
            ref.obj.key,
            exc,
        )
        return None
