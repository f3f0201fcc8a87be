"""The on-disk chunk format (silofs/cache/format.py), pinned byte for byte.

Owns the golden bytes of one encoded chunk and its LMDB key: if either test here fails,
the layout changed, and that needs a new FORMAT_VERSION, not a new golden value. Also
owns verify_chunk's promise (docs/SEMANTICS.md promise 3): any damaged or foreign value
is a ChunkFormatError (a miss), never other exceptions and never wrong bytes; a range
read checks the header and the blocks it covers; a version-1 value is a StaleFormatError
(a miss that is refetched, not counted as corrupt).
"""

from __future__ import annotations

import struct

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from silofs.cache import format as chunk_format
from silofs.cache.format import (
    BLOCK_SIZE,
    FORMAT_VERSION,
    KEY_SIZE,
    MAGIC,
    ChunkFormatError,
    ChunkRef,
    ChunkValue,
    StaleFormatError,
    check_copy,
    checked_chunk,
    chunk_key,
    copy_verified,
    decode_header,
    encode_chunk,
    layout,
    verify_chunk,
)
from silofs.records import ObjectInfo

# Version 2: fixed part (40 B), key, content id, one block sum, header sum, data.
GOLDEN = bytes.fromhex(
    "534c4643020010004e0000000300000000000000010000000000000000040000000000000b000000"
    "0700612f622e6a70670b0073333a6162633a323030308b98e640eab147d4aed4aa45869579d5"
    "68656c6c6f20776f726c64"
)
# The same chunk as version 1 wrote it (one xxh3_64 over header and data): kept so an old
# cache's values are recognised as stale, not as damage.
GOLDEN_V1 = bytes.fromhex(
    "534c4643010042000300000000000000010000000000000000040000000000000b000000"
    "3754d385ee6b26ea0700612f622e6a70670b0073333a6162633a3230303068656c6c6f20"
    "776f726c64"
)
GOLDEN_KEY = "e9f155be0f43134fcfa2cc8569eb5504"
# xxh3_64 of a multi-block value (1024-byte pattern x 150 = 150 KiB, three blocks).
GOLDEN_MULTI_HASH = "68b9eeea27fe0917"

CID = "s3:abc:2000"
HDR = 78  # header length of GOLDEN


def golden() -> bytes:
    return encode_chunk(
        dataset=3, index=1, chunk_size=1024, key="a/b.jpg", content_id=CID, data=b"hello world"
    )


def test_golden_bytes() -> None:
    assert golden() == GOLDEN
    assert golden().hex() == GOLDEN.hex()  # a readable diff when it fails


def test_golden_multi_block_value() -> None:
    value = encode_chunk(3, 1, 1 << 20, "big", "c", bytes(range(256)) * 600)
    assert xxhash.xxh3_64_hexdigest(value) == GOLDEN_MULTI_HASH
    h = decode_header(value)
    assert h.header_len == 40 + 2 + 3 + 2 + 1 + 3 * 8 + 8
    for b in range(3):
        block = value[h.header_len + b * BLOCK_SIZE : h.header_len + (b + 1) * BLOCK_SIZE]
        (want,) = struct.unpack_from("<Q", value, h.sums_offset + 8 * b)
        assert want == xxhash.xxh3_64_intdigest(block)


def test_golden_chunk_key() -> None:
    key = chunk_key(CID, 1024, 1)
    assert key.hex() == GOLDEN_KEY
    assert len(key) == KEY_SIZE


def test_golden_layout_fields() -> None:
    # The same pin, field by field, so a failure says which field moved.
    magic, version, shift, reserved, hdr_len, dataset, index, csize, length = struct.unpack_from(
        "<4sHBBIQQQI", GOLDEN
    )
    assert (magic, version, shift, reserved, hdr_len) == (b"SLFC", 2, 16, 0, HDR)
    assert (dataset, index, csize, length) == (3, 1, 1024, 11)
    assert GOLDEN[40:62] == b"\x07\x00a/b.jpg\x0b\x00s3:abc:2000"
    assert GOLDEN[62:70] == struct.pack("<Q", xxhash.xxh3_64_intdigest(b"hello world"))
    assert GOLDEN[70:HDR] == struct.pack("<Q", xxhash.xxh3_64_intdigest(GOLDEN[:70]))
    assert GOLDEN[HDR:] == b"hello world"
    assert MAGIC == b"SLFC" and FORMAT_VERSION == 2 and BLOCK_SIZE == 64 << 10


def test_version_1_values_are_stale_not_corrupt() -> None:
    with pytest.raises(StaleFormatError):
        verify_chunk(GOLDEN_V1, CID, 1024, 1, 11)

    class Counts:
        corrupt_chunks = 0

    counts = Counts()
    obj = ObjectInfo("a/b.jpg", 1024 + 11, 0.0, "v", CID)
    assert checked_chunk(GOLDEN_V1, ChunkRef.of(obj, 1024, 1), counts) is None
    assert counts.corrupt_chunks == 0
    assert bytes(checked_chunk(GOLDEN, ChunkRef.of(obj, 1024, 1), counts)) == b"hello world"
    damaged = GOLDEN[:-1] + b"D"
    assert checked_chunk(damaged, ChunkRef.of(obj, 1024, 1), counts) is None
    assert counts.corrupt_chunks == 1


def test_range_verification_checks_only_the_covered_blocks() -> None:
    data = bytes(range(256)) * 1024  # 256 KiB: four blocks
    value = bytearray(encode_chunk(1, 0, 1 << 20, "k", "c", data))
    hdr = decode_header(bytes(value)).header_len
    value[hdr + 2 * BLOCK_SIZE + 5] ^= 1  # damage block 2
    v = bytes(value)
    n = len(data)
    # Ranges within blocks 0-1 or 3 are served; any range touching block 2 is refused.
    assert bytes(verify_chunk(v, "c", 1 << 20, 0, n, 0, 2 * BLOCK_SIZE)[:10]) == data[:10]
    verify_chunk(v, "c", 1 << 20, 0, n, 3 * BLOCK_SIZE, n)
    verify_chunk(v, "c", 1 << 20, 0, n, 5, 5)  # empty range: header only
    for lo, hi in [
        (0, n),
        (2 * BLOCK_SIZE - 1, 2 * BLOCK_SIZE + 1),
        (2 * BLOCK_SIZE + 5, 3 * BLOCK_SIZE),
    ]:
        with pytest.raises(ChunkFormatError, match="block 2"):
            verify_chunk(v, "c", 1 << 20, 0, n, lo, hi)


def test_served_ranges_are_private_copies_checked_after_the_copy() -> None:
    """The hit path serves a slice of the LMDB map only after the kernel's reply copy, and
    the map may change meanwhile (a damaged disk, a process writing data.mdb): what
    copy_verified and checked_chunk return must not change with the value they came from,
    and must be the range asked for, block-straddling or not."""
    data = bytes(range(256)) * 1024  # 256 KiB: four blocks
    value = bytearray(encode_chunk(1, 0, 1 << 20, "k", "c", data))
    hdr = decode_header(bytes(value)).header_len
    ref = ChunkRef.of(ObjectInfo("k", len(data), 0.0, "v", "c"), 1 << 20, 0)
    counts = type("Counts", (), {"corrupt_chunks": 0})()
    ranges = [
        (0, len(data)),
        (5, 5),
        (BLOCK_SIZE - 3, 2 * BLOCK_SIZE + 7),
        (3 * BLOCK_SIZE, len(data) - 1),
    ]
    for lo, hi in ranges:
        got = copy_verified(value, "c", 1 << 20, 0, len(data), lo, hi)
        counted = checked_chunk(value, ref, counts, lo, hi)
        assert counted is not None
        for pos in range(lo, hi, 4093):
            value[hdr + pos] ^= 0xFF  # after the check: must not reach what was returned
        assert bytes(got) == data[lo:hi] and bytes(counted) == data[lo:hi]
        for pos in range(lo, hi, 4093):
            value[hdr + pos] ^= 0xFF


def test_header_damage_is_detected_on_any_range() -> None:
    data = bytes(300 << 10)
    value = encode_chunk(1, 0, 1 << 20, "k", "c", data)
    hdr = decode_header(value).header_len
    for pos in range(0, hdr):
        damaged = bytearray(value)
        damaged[pos] ^= 0x10
        with pytest.raises(ChunkFormatError):
            verify_chunk(bytes(damaged), "c", 1 << 20, 0, len(data), 0, 0)


def test_decode_header() -> None:
    h = decode_header(GOLDEN)
    assert (h.dataset, h.index, h.chunk_size, h.length) == (3, 1, 1024, 11)
    assert (h.key, h.content_id, h.header_len, h.sums_offset) == ("a/b.jpg", CID, HDR, 62)


def test_verify_returns_the_data() -> None:
    data = verify_chunk(GOLDEN, CID, 1024, 1, 11)
    assert isinstance(data, memoryview)
    assert bytes(data) == b"hello world"
    # A memoryview value (LMDB buffers=True) works the same.
    assert bytes(verify_chunk(memoryview(GOLDEN), CID, 1024, 1, 11)) == b"hello world"


def test_chunk_key_depends_on_every_part() -> None:
    keys = {
        chunk_key(CID, 1024, 1),
        chunk_key(CID, 1024, 2),
        chunk_key(CID, 2048, 1),
        chunk_key("s3:abc:2001", 1024, 1),
        # The separator keeps ("x1", 0) and ("x", 10) apart.
        chunk_key("x1", 0, 1),
        chunk_key("x", 10, 1),
    }
    assert len(keys) == 6


@settings(max_examples=300)
@given(st.data())
def test_any_single_flipped_byte_is_detected(data: st.DataObject) -> None:
    pos = data.draw(st.integers(min_value=0, max_value=len(GOLDEN) - 1), label="pos")
    mask = data.draw(st.integers(min_value=1, max_value=255), label="mask")
    damaged = bytearray(GOLDEN)
    damaged[pos] ^= mask
    with pytest.raises(ChunkFormatError):
        verify_chunk(bytes(damaged), CID, 1024, 1, 11)


def test_every_position_and_bit_is_detected() -> None:
    # Exhaustive over single-bit flips of the golden value (78 + 11 bytes x 8 bits).
    for pos in range(len(GOLDEN)):
        for bit in range(8):
            damaged = bytearray(GOLDEN)
            damaged[pos] ^= 1 << bit
            with pytest.raises(ChunkFormatError):
                verify_chunk(bytes(damaged), CID, 1024, 1, 11)


@settings(max_examples=200)
@given(
    dataset=st.integers(min_value=0, max_value=2**64 - 1),
    index=st.integers(min_value=0, max_value=2**40),
    chunk_size=st.integers(min_value=1, max_value=2**40),
    key=st.text(max_size=200),
    content_id=st.text(min_size=1, max_size=80),
    payload=st.binary(max_size=300),
    pos_frac=st.floats(min_value=0, max_value=1, exclude_max=True),
    mask=st.integers(min_value=1, max_value=255),
)
def test_round_trip_and_flip_property(
    dataset: int,
    index: int,
    chunk_size: int,
    key: str,
    content_id: str,
    payload: bytes,
    pos_frac: float,
    mask: int,
) -> None:
    value = encode_chunk(dataset, index, chunk_size, key, content_id, payload)
    h = decode_header(value)
    assert (h.dataset, h.index, h.chunk_size, h.key, h.content_id, h.length) == (
        dataset,
        index,
        chunk_size,
        key,
        content_id,
        len(payload),
    )
    assert bytes(verify_chunk(value, content_id, chunk_size, index, len(payload))) == payload
    damaged = bytearray(value)
    damaged[int(pos_frac * len(value))] ^= mask
    with pytest.raises(ChunkFormatError):
        verify_chunk(bytes(damaged), content_id, chunk_size, index, len(payload))


@pytest.mark.parametrize(
    ("content_id", "chunk_size", "index", "length"),
    [
        ("s3:abc:2001", 1024, 1, 11),  # wrong content id (object changed)
        ("s3:abc:200", 1024, 1, 11),
        ("", 1024, 1, 11),
        (CID, 1024, 0, 11),  # wrong index
        (CID, 1024, 2, 11),
        (CID, 2048, 1, 11),  # wrong chunk size
        (CID, 1023, 1, 11),
        (CID, 1024, 1, 10),  # wrong expected length
        (CID, 1024, 1, 12),
        (CID, 1024, 1, 0),
    ],
)
def test_identity_mismatch_is_detected(
    content_id: str, chunk_size: int, index: int, length: int
) -> None:
    with pytest.raises(ChunkFormatError):
        verify_chunk(GOLDEN, content_id, chunk_size, index, length)


@pytest.mark.parametrize(
    "cut", [0, 1, 4, 8, 39, 40, 41, 61, 62, 69, 70, 77, 78, 79, len(GOLDEN) - 1]
)
def test_truncated_values_are_detected(cut: int) -> None:
    with pytest.raises(ChunkFormatError):
        verify_chunk(GOLDEN[:cut], CID, 1024, 1, 11)


def test_extended_value_is_detected() -> None:
    with pytest.raises(ChunkFormatError):
        verify_chunk(GOLDEN + b"!", CID, 1024, 1, 11)
    with pytest.raises(ChunkFormatError):
        verify_chunk(GOLDEN + b"!", CID, 1024, 1, 12)


def _resealed(value: bytes) -> bytes:
    """`value` with a correct header checksum for whatever its header now says."""
    (hdr_len,) = struct.unpack_from("<I", value, 8)
    body = value[: hdr_len - 8]
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)) + value[hdr_len:]


def test_unknown_version_is_detected_even_with_a_valid_checksum() -> None:
    for version in (0, 3, 0xFFFF):
        other = _resealed(GOLDEN[:4] + struct.pack("<H", version) + GOLDEN[6:])
        with pytest.raises(ChunkFormatError, match="version"):
            verify_chunk(other, CID, 1024, 1, 11)


def test_bad_magic_is_detected_even_with_a_valid_checksum() -> None:
    for magic in (b"SLFD", b"\0\0\0\0", b"slfc"):
        bad = _resealed(magic + GOLDEN[4:])
        with pytest.raises(ChunkFormatError, match="magic"):
            verify_chunk(bad, CID, 1024, 1, 11)


def test_resealed_foreign_dataset_or_key_still_verifies() -> None:
    # Chunks are content-addressed: another dataset's chunk of the same content is
    # served (that is the point of sharing), so dataset and key are not identity checks.
    value = encode_chunk(9, 1, 1024, "other/name.jpg", CID, b"hello world")
    assert bytes(verify_chunk(value, CID, 1024, 1, 11)) == b"hello world"


def test_bad_variable_header_is_a_format_error() -> None:
    # Inconsistent lengths inside the variable part, resealed so only the parser sees it.
    var_bad = bytearray(GOLDEN)
    var_bad[40] = 0xFF  # key_len 255 runs past the header
    with pytest.raises(ChunkFormatError):
        verify_chunk(_resealed(bytes(var_bad)), CID, 1024, 1, 11)
    utf8_bad = bytearray(GOLDEN)
    utf8_bad[42] = 0xFF  # invalid utf-8 in the key
    with pytest.raises(ChunkFormatError):
        decode_header(_resealed(bytes(utf8_bad)))
    # hdr_len shorter than the fixed part plus the two length fields
    short = GOLDEN[:8] + struct.pack("<I", 10) + GOLDEN[12:]
    with pytest.raises(ChunkFormatError):
        decode_header(short)
    # a block size out of bounds
    with pytest.raises(ChunkFormatError, match="block size"):
        decode_header(_resealed(GOLDEN[:6] + b"\x40" + GOLDEN[7:]))


def test_empty_chunk() -> None:
    value = encode_chunk(1, 0, 4096, "empty", "cid", b"")
    assert bytes(verify_chunk(value, "cid", 4096, 0, 0)) == b""
    with pytest.raises(ChunkFormatError):
        verify_chunk(value[:-1], "cid", 4096, 0, 0)


@settings(max_examples=150)
@given(
    size=st.integers(min_value=1, max_value=5 * BLOCK_SIZE + 7),
    a=st.floats(min_value=0, max_value=1),
    b=st.floats(min_value=0, max_value=1),
    where=st.floats(min_value=0, max_value=1, exclude_max=True),
)
def test_a_flip_is_detected_exactly_when_its_block_is_served(
    size: int, a: float, b: float, where: float
) -> None:
    data = bytes(range(256)) * (size // 256 + 1)
    data = data[:size]
    value = bytearray(encode_chunk(1, 0, 1 << 20, "k", "c", data))
    hdr = decode_header(bytes(value)).header_len
    lo, hi = sorted((int(a * size), int(b * size)))
    pos = int(where * size)
    value[hdr + pos] ^= 0x01
    covered = hi > lo and lo // BLOCK_SIZE <= pos // BLOCK_SIZE <= (hi - 1) // BLOCK_SIZE
    if covered:
        with pytest.raises(ChunkFormatError, match="block"):
            verify_chunk(bytes(value), "c", 1 << 20, 0, size, lo, hi)
    else:  # outside what is served: not looked at (the next read of it will be)
        view = verify_chunk(bytes(value), "c", 1 << 20, 0, size, lo, hi)
        assert bytes(view[lo:hi]) == data[lo:hi]


@pytest.mark.parametrize("length", [0, 1, BLOCK_SIZE - 1, BLOCK_SIZE, 3 * BLOCK_SIZE + 5])
def test_a_value_built_in_place_is_the_encoded_value(length: int) -> None:
    data = bytes(range(256)) * (length // 256) + bytes(length % 256)
    built = ChunkValue(length, "dir/ünï.bin", "etag-1:9")
    assert len(built.data) == length
    built.data[:] = data
    value = built.seal(7, 3, 4 << 20)
    assert value == encode_chunk(7, 3, 4 << 20, "dir/ünï.bin", "etag-1:9", data)
    assert verify_chunk(value, "etag-1:9", 4 << 20, 3, length) == data


@pytest.mark.parametrize(
    ("key", "size", "index"),
    [
        ("a/b.bin", 110 << 10, 0),
        ("dïr/ñame-€.bin", (4 << 20) + 5, 1),
        ("x", 0, 0),
        ("k", 9 << 20, 2),
    ],
)
def test_a_refs_header_length_is_its_encoded_values(key: str, size: int, index: int) -> None:
    """ChunkRef.of's header (what a hit copies with the data in one read) is the header
    length of the value written for that chunk, non-ASCII keys and a last short block
    included."""
    obj = ObjectInfo(key, size, 1.0, "v1", "etag-ü")
    ref = ChunkRef.of(obj, 4 << 20, index)
    value = encode_chunk(7, index, 4 << 20, key, obj.content_id, bytes(ref.length))
    assert ref.header == layout(value)[0] == len(value) - ref.length


@pytest.mark.parametrize(
    ("key", "size", "index"),
    [
        ("a/b.jpg", (4 << 20) + 11, 1),
        ("dïr/ñame-€.bin", (4 << 20) + 5, 1),
        ("x", 0, 0),
        ("k", 9 << 20, 2),
    ],
)
def test_a_refs_expected_header_is_its_encoded_values(
    key: str, size: int, index: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ChunkRef.expect holds exactly the bytes a value written for the chunk has around
    the dataset id, up to the block sums, so a hit's header compares equal to it and is
    not parsed (the parse is broken here: the copy passes all the same)."""
    obj = ObjectInfo(key, size, 1.0, "v1", "etag-ü")
    ref = ChunkRef.of(obj, 4 << 20, index)
    value = encode_chunk(7, index, 4 << 20, key, obj.content_id, b"\7" * ref.length)
    assert ref.expect is not None
    lead, ident, hdr = ref.expect
    assert hdr == ref.header
    assert value[:12] == lead and value[20 : 20 + len(ident)] == ident
    head, data = memoryview(value[:hdr]), memoryview(value[hdr:])
    args = (ref.content_bytes, ref.chunk_size, ref.index, ref.length, 0, ref.length)
    monkeypatch.setattr(chunk_format, "_FIXED", None)
    assert bytes(check_copy(head, len(value), data, *args, ref.expect)) == value[hdr:]


def test_a_header_compared_whole_still_catches_every_flipped_bit() -> None:
    """check_copy with the ref's expected header (the hit path) refuses every single-bit
    flip of the value, the dataset id and the sums included, as the parse does."""
    obj = ObjectInfo("a/b.jpg", 1035, 1.0, "v", CID)
    ref = ChunkRef.of(obj, 1024, 1)
    args = (ref.content_bytes, ref.chunk_size, ref.index, ref.length, 0, ref.length)
    value = golden()
    assert (
        bytes(
            check_copy(
                memoryview(value[:HDR]), len(value), memoryview(value[HDR:]), *args, ref.expect
            )
        )
        == b"hello world"
    )
    for pos in range(len(value)):
        for bit in range(8):
            damaged = bytearray(value)
            damaged[pos] ^= 1 << bit
            head, data = memoryview(bytes(damaged[:HDR])), memoryview(bytes(damaged[HDR:]))
            with pytest.raises(ChunkFormatError):
                check_copy(head, len(value), data, *args, ref.expect)


def test_a_value_admitted_under_another_key_passes_the_parse() -> None:
    """A header that differs from the ref's expected one only where a value of the same
    content admitted by another dataset may (its key) is parsed and passes; one of
    another chunk does not."""
    obj = ObjectInfo("a/b.jpg", 1035, 1.0, "v", CID)
    ref = ChunkRef.of(obj, 1024, 1)
    args = (ref.content_bytes, ref.chunk_size, ref.index, ref.length, 0, ref.length)
    other = encode_chunk(9, 1, 1024, "another/name.jpg", CID, b"hello world")
    hdr = layout(other)[0]
    got = check_copy(
        memoryview(other[:hdr]), len(other), memoryview(other[hdr:]), *args, ref.expect
    )
    assert bytes(got) == b"hello world"
    wrong = encode_chunk(3, 2, 1024, "a/b.jpg", CID, b"hello world")
    with pytest.raises(ChunkFormatError, match="another object or chunk"):
        check_copy(memoryview(wrong[:HDR]), len(wrong), memoryview(wrong[HDR:]), *args, ref.expect)
