"""Byte flips in the cache env, online and offline: wrong bytes served stays 0.

Owns the whole-system form of promise 3 (docs/SEMANTICS.md): bytes are flipped in the
LMDB file of a real node (chunk data, chunk headers, the B-tree pages of the chunk index)
while real FUSE mounts
read (re-reading through handles opened before the damage, and through fresh opens), and
again while the node is down; every byte read is compared with the store's. Reads may
fail (EIO) where damage cannot be repaired; no read may return a wrong byte, and no
mount may die. LMDB trusts its own pages: without bounds checks a flipped value size or
page number makes a mount touch past the end of data.mdb (SIGBUS: the mount process
gone, its readers getting ENOTCONN, ECONNABORTED for those in flight). Lookups refuse
such a value and the daemon backs the whole map with the
file (cache/bounds.py, tests/unit/test_damaged_nodes.py); both forms still count
ENOTCONN, and both assert the mount survived.

Short form (CI, a few seconds): a small dataset and a few dozen flips. Long form, run by
hand: SILOFS_LONG=1 python -m pytest -q -s tests/reliability/test_byteflips.py
(more data, hundreds of flips; prints the figures).
"""

from __future__ import annotations

import errno
import mmap
import os
import random
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.fixtures import needs_fuse
from tests.support.node import Node, force_unmount, mounted
from tests.support.poll import wait_for
from tests.support.trees import random_files

pytestmark = [needs_fuse, pytest.mark.fuse]

LONG = os.environ.get("SILOFS_LONG") == "1"
CHUNK = 256 << 10
PAGE = 4096
P_BRANCH, P_LEAF, P_OVERFLOW = 0x01, 0x02, 0x04
_PAGE_HEAD = struct.Struct("<QHHI")  # pgno, pad, flags, (lower/upper | overflow pages)
_VALUE_HEAD = struct.Struct("<4sHBBI")  # magic, version, blk_shift, reserved, hdr_len


@dataclass
class Tally:
    reads: int = 0
    wrong_bytes: int = 0
    wrong_reads: int = 0
    eio: int = 0
    # ENOTCONN, or ECONNABORTED for a request in flight when it happened: the mount
    # process died (see the module docstring)
    gone: int = 0
    other_errors: int = 0
    other_codes: set[str] = field(default_factory=set)
    flips: dict[str, int] = field(default_factory=lambda: {"data": 0, "header": 0, "btree": 0})
    lock: threading.Lock = field(default_factory=threading.Lock)

    def read(self, got: bytes | int, want: bytes) -> None:
        with self.lock:
            self.reads += 1
            if isinstance(got, int):
                if got == errno.EIO:
                    self.eio += 1
                elif got in (errno.ENOTCONN, errno.ECONNABORTED):
                    self.gone += 1
                else:
                    self.other_errors += 1
                    self.other_codes.add(errno.errorcode.get(got, str(got)))
                return
            n = min(len(got), len(want))
            bad = sum(1 for a, b in zip(got[:n], want[:n], strict=True) if a != b)
            bad += abs(len(got) - len(want))
            if bad:
                self.wrong_bytes += bad
                self.wrong_reads += 1


def _dataset(n_small: int, n_big: int, seed: int) -> dict[str, bytes]:
    rnd = random.Random(seed)
    files = random_files(rnd, n_small, range(60_000, 120_001), "s/{i:04d}.bin")
    return files | random_files(rnd, n_big, 4 * CHUNK + 1234, "b/{i:03d}.bin")


def _pread(fd: int, size: int, off: int) -> bytes | int:
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the read must reach FUSE
        return os.pread(fd, size, off)
    except OSError as exc:
        return exc.errno or -1


def _chunk_index_page(m: mmap.mmap, at: int) -> bool:
    """Whether a branch or leaf page holds keys of the chunks or owners db (16- and 24-byte
    keys; this dataset's listing keys are 17-18 bytes, the main db's are names). Listing
    rows (JSON) carry no checksum (docs/SEMANTICS.md), so their pages are not flipped."""
    _, _, _, lower = _PAGE_HEAD.unpack_from(m, at)
    lower &= 0xFFFF
    n = (lower - 16) // 2
    if n <= 0 or n > 500:
        return False
    for i in range(n):
        (off,) = struct.unpack_from("<H", m, at + 16 + 2 * i)
        if not 16 <= off <= PAGE - 8:
            return False
        (ksize,) = struct.unpack_from("<H", m, at + off + 6)
        if ksize not in (16, 24) and not (i == 0 and ksize == 0):  # a branch's first key
            return False
    return True


class Flipper:
    """Flips one byte at a time in data.mdb: in a chunk's data or header (found by their
    overflow pages) or anywhere in a B-tree (branch or leaf) page."""

    def __init__(self, cache_dir: str, rnd: random.Random) -> None:
        self.path = os.path.join(cache_dir, "data.mdb")
        self.rnd = rnd

    def _pages(self) -> tuple[list[tuple[int, int, int]], list[int]]:
        """([(value offset, hdr_len, length)], [B-tree page offsets]) as the file is now."""
        values: list[tuple[int, int, int]] = []
        btree: list[int] = []
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            for p in range(2, len(m) // PAGE):  # pages 0, 1: LMDB's meta pages
                pgno, _, flags, _ = _PAGE_HEAD.unpack_from(m, p * PAGE)
                if pgno != p:
                    continue  # free, or a continuation page of an overflow value
                if flags == P_OVERFLOW:
                    at = p * PAGE + 16
                    magic, version, _, _, hdr_len = _VALUE_HEAD.unpack_from(m, at)
                    if magic == b"SLFC" and version == 2:
                        (length,) = struct.unpack_from("<I", m, at + 36)
                        values.append((at, hdr_len, length))
                elif flags & (P_BRANCH | P_LEAF) and _chunk_index_page(m, p * PAGE):
                    btree.append(p * PAGE)
        return values, btree

    def flip(self, kind: str) -> bool:
        values, btree = self._pages()
        if kind == "btree":
            if not btree:
                return False
            pos = self.rnd.choice(btree) + self.rnd.randrange(16, PAGE)
        else:
            if not values:
                return False
            at, hdr_len, length = self.rnd.choice(values)
            if kind == "header":
                pos = at + self.rnd.randrange(hdr_len)
            elif length:
                pos = at + hdr_len + self.rnd.randrange(length)
            else:
                return False
        fd = os.open(self.path, os.O_RDWR)
        try:
            got = os.pread(fd, 1, pos)
            if not got:
                return False  # a stale header on a free page, claiming bytes past the end
            (b,) = got
            os.pwrite(fd, bytes([b ^ (1 << self.rnd.randrange(8))]), pos)
        finally:
            _close(fd)
        return True


def _open(path: Path) -> int:
    """An fd, or minus the errno of a failed open (ENOTCONN once the mount is gone)."""
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as exc:
        return -(exc.errno or 1)


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:  # ENOTCONN: the mount is gone (counted by the reads)
        pass


def _read_all(mp: Path, files: dict[str, bytes], tally: Tally) -> None:
    for key, want in files.items():
        fd = _open(mp / key)
        if fd < 0:
            tally.read(-fd, want)
            continue
        try:
            tally.read(_pread(fd, len(want) + 1, 0), want)
        finally:
            _close(fd)


def _corrupt_count(node: Node) -> int:
    return sum(d["corrupt_chunks"] for d in node.status()["datasets"])


def test_byte_flips_never_serve_a_wrong_byte(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    n_small, n_big, online, offline = (400, 24, 400, 150) if LONG else (16, 3, 24, 12)
    rnd = random.Random(2026)
    files = _dataset(n_small, n_big, seed=9)
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, files)
    uri = local_store.uri(bucket_name)
    node = make_node(cache_size="512M" if LONG else "64M")
    # A damaged B-tree page fails admissions (the supervised writer restarts) and lookups
    # (a counted miss); misses during the restart may fail (EIO, counted, never bytes).
    node.expect_errors(
        r"the writer failed: ",  # an LMDB error, or a damaged owners row (struct.error)
        r"the last admissions failed: \w+: ",  # at the exit: an LMDB error, SystemError
        # (py-lmdb's Cursor.delete on a damaged page) or a damaged row's struct.error
        r"silofs\.mount\.reader: reading ",
        r"pyfuse3: fuse_release\(\): fuse_reply_\* failed",  # a release racing the unmount
    )
    mp = node.mount(uri, tmp_path / "m0", "--chunk-size", "256K")
    warm = Tally()
    _read_all(mp, files, warm)
    assert warm.wrong_bytes == 0 and warm.eio == 0
    chunks = sum(-(-len(v) // CHUNK) for v in files.values())
    wait_for(lambda: node.status()["datasets"][0]["cached_chunks"] == chunks, what="admission")

    # -- online: flips while two readers read, one through handles opened before --------
    tally = Tally()
    flipper = Flipper(node.cache_dir, rnd)
    stop = threading.Event()
    keys = list(files)
    handles = {k: os.open(mp / k, os.O_RDONLY) for k in keys}

    def reread_open_handles(seed: int) -> None:
        r = random.Random(seed)
        while not stop.is_set():
            k = r.choice(keys)
            want = files[k]
            off = r.randrange(len(want))
            size = r.choice((4096, 128 << 10, 1 << 20))
            tally.read(_pread(handles[k], size, off), want[off : off + size])

    def fresh_opens(seed: int) -> None:
        r = random.Random(seed)
        while not stop.is_set():
            k = r.choice(keys)
            fd = _open(mp / k)
            if fd < 0:
                tally.read(-fd, files[k])
                continue
            try:
                tally.read(_pread(fd, len(files[k]), 0), files[k])
            finally:
                _close(fd)

    threads = [
        threading.Thread(target=reread_open_handles, args=(1,), daemon=True),
        threading.Thread(target=fresh_opens, args=(2,), daemon=True),
    ]
    for t in threads:
        t.start()
    try:
        for i in range(online):
            kind = ("data", "header", "btree")[i % 3]
            if flipper.flip(kind):
                tally.flips[kind] += 1
            before = tally.reads
            wait_for(lambda b=before: tally.reads >= b + 8, what="reads after a flip")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        for fd in handles.values():
            _close(fd)
    online_survived = mounted(mp) and tally.gone == 0
    online_tally = tally
    online_corrupt = _corrupt_count(node)  # as reported so far (mounts report every 250 ms)

    # -- offline: flips while the node is down, then a fresh mount reads everything -----
    force_unmount(str(mp))
    wait_for(lambda: not mounted(mp), what="unmount")
    node.stop()
    off_tally = Tally()
    for i in range(offline):
        kind = ("data", "header", "btree")[i % 3]
        if flipper.flip(kind):
            off_tally.flips[kind] += 1
    node.start()
    mp2 = node.mount(uri, tmp_path / "m1", "--chunk-size", "256K")
    _read_all(mp2, files, off_tally)
    _read_all(mp2, files, off_tally)  # again: what was refetched is now served
    offline_corrupt = _corrupt_count(node)  # since the restart

    print(
        f"\nbyteflips ({'long' if LONG else 'short'}): {len(files)} files, {chunks} chunks; "
        f"online flips {online_tally.flips}, reads {online_tally.reads}, "
        f"EIO {online_tally.eio}, ENOTCONN {online_tally.gone} (mount survived: "
        f"{online_survived}), other errors {online_tally.other_errors}, "
        f"wrong bytes {online_tally.wrong_bytes}, corrupt chunks counted {online_corrupt}; "
        f"offline flips {off_tally.flips}, reads {off_tally.reads}, EIO {off_tally.eio}, "
        f"ENOTCONN {off_tally.gone}, "
        f"wrong bytes {off_tally.wrong_bytes}, corrupt chunks counted {offline_corrupt}"
    )
    assert online_tally.wrong_bytes == 0, f"{online_tally.wrong_reads} reads returned wrong bytes"
    assert off_tally.wrong_bytes == 0, f"{off_tally.wrong_reads} reads returned wrong bytes"
    assert online_tally.other_errors == 0 and off_tally.other_errors == 0, (
        online_tally.other_codes | off_tally.other_codes
    )
    assert sum(online_tally.flips.values()) >= online * 2 // 3
    assert online_survived and off_tally.gone == 0, "a mount died under byte flips"


def test_a_flip_after_the_check_never_reaches_a_reader(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    """The kernel copies a read's reply only after the handler returned, and a daemon
    answers a mount after its own check: a byte flipped in data.mdb after a check and
    undone right after must not reach a reader, so what is checked and served must be a
    copy taken before the check. Flips and unflips one hot chunk's bytes as fast as a
    process can while two readers read it (short form 8 s; long form 60 s)."""
    seconds = 60 if LONG else 8
    rnd = random.Random(7)
    data = rnd.randbytes(200_000)
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"f.bin": data})
    node = make_node(cache_size="64M")
    node.expect_errors(r"silofs\.mount\.reader: reading ")  # a flip seen by a check: a miss
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "m0", "--chunk-size", "256K")
    assert (mp / "f.bin").read_bytes() == data
    wait_for(lambda: node.status()["datasets"][0]["cached_chunks"] == 1, what="admission")
    tally, stop = Tally(), threading.Event()

    def read(size: int, step: int) -> None:
        fd = os.open(mp / "f.bin", os.O_RDONLY)
        off = 0
        while not stop.is_set():
            tally.read(_pread(fd, size, off), data[off : off + size])
            off = (off + step) % len(data)
        os.close(fd)

    readers = [
        threading.Thread(target=read, args=(128 << 10, 0), daemon=True),
        threading.Thread(target=read, args=(70_000, 30_011), daemon=True),
    ]
    for t in readers:
        t.start()
    flipper = Flipper(node.cache_dir, rnd)
    fd = os.open(flipper.path, os.O_RDWR)
    flips = 0
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            values, _ = flipper._pages()  # a chunk refetched after a check moved
            for at, hdr_len, length in values:
                for _ in range(100):
                    pos = at + hdr_len + rnd.randrange(length)
                    b = os.pread(fd, 1, pos)
                    os.pwrite(fd, bytes([b[0] ^ 0xFF]), pos)
                    os.pwrite(fd, b, pos)
                    flips += 1
    finally:
        stop.set()
        for t in readers:
            t.join(30)
        os.close(fd)
    print(f"\nflip-after-check: {flips} flips, {tally.reads} reads, EIO {tally.eio}")
    assert tally.reads > 100 and tally.wrong_bytes == 0, f"{tally.wrong_reads} wrong reads"
    assert tally.other_errors == 0 and tally.gone == 0, tally.other_codes
