"""Byte flips in the B-tree pages of a real env never end the process that reads it.

Owns cache/bounds.py's promise on real LMDB pages: with bytes flipped in leaf and branch
pages (a node's overflow page number or value size among them), every way the mount and
the daemon reach a chunk value (a mount's lookup, the daemon's cached(), admission with
replace, eviction) either works or raises an lmdb.Error; none ends the process with
SIGBUS or SIGSEGV. Each trial runs in a forked child so a fault is counted, not fatal.
The control arm proves the flips are the kind that kill: the same flips read through
py-lmdb's plain get() end some children.
"""

from __future__ import annotations

import faulthandler
import os
import random
import shutil
import signal
import struct
from pathlib import Path
from typing import BinaryIO

import lmdb
import pytest

from silofs.cache.bounds import DamagedValueError, FirstTime, mdb_val_offset
from silofs.cache.format import chunk_key, encode_chunk
from silofs.cache.store import CacheStore, Usage
from silofs.node.store_write import PendingChunk, WritableStore

PAGE = 4096
MAP = 64 << 20
TRIALS = 120
_PAGE_HEAD = struct.Struct("<QHHI")


def _unlimited(_d: int, _u: object) -> int:
    return 1 << 62


def _chunks(n: int, seed: int) -> list[PendingChunk]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        size = rnd.choice((40, 900, rnd.randrange(5_000, 60_000)))  # inline and overflow
        data = rnd.randbytes(size)
        value = encode_chunk(1, i, 1 << 20, f"k{i}", "cid", data)
        out.append(PendingChunk(1, chunk_key("cid", 1 << 20, i), value, size))
    return out


def _chunk_pages(path: Path) -> list[int]:
    """The branch and leaf pages of the chunks db (16-byte keys; a branch's first key
    is empty). The env is a compacted copy: no free page looks like one."""
    data = (path / "data.mdb").read_bytes()
    pages = []
    for p in range(2, len(data) // PAGE):
        at = p * PAGE
        pgno, _, flags, lower_upper = _PAGE_HEAD.unpack_from(data, at)
        n = ((lower_upper & 0xFFFF) - 16) // 2
        if pgno != p or not flags & 0x03 or n < 2:
            continue
        (second,) = struct.unpack_from("<H", data, at + 18)
        if struct.unpack_from("<H", data, at + second + 6)[0] == 16:
            pages.append(p)
    return pages


def _flip(path: Path, pages: list[int], rnd: random.Random, anywhere: bool) -> None:
    """Flip one bit of what points at a value with overflow pages: its leaf node's value
    size, or its page number; and if `anywhere`, one bit anywhere in the used part of a B-tree page
    (its node offsets [16, lower) or its nodes [upper, PAGE); the gap is free space)."""
    with open(path / "data.mdb", "r+b") as f:
        if anywhere:
            at = rnd.choice(pages) * PAGE
            f.seek(at)
            page = f.read(PAGE)
            lower_upper = _PAGE_HEAD.unpack_from(page)[3]
            lower, upper = lower_upper & 0xFFFF, lower_upper >> 16
            used = [*range(16, min(lower, PAGE)), *range(min(upper, PAGE), PAGE)]
            _flip_bit(f, at + rnd.choice(used or range(16, PAGE)), rnd.randrange(8))
        at, node = _big_node(f, pages, rnd)
        bit = rnd.randrange(32 + 24)  # its size's bits, then its page number's low 24
        _flip_bit(f, at + node + (bit // 8 if bit < 32 else 24 + (bit - 32) // 8), bit % 8)


def _big_node(f: BinaryIO, pages: list[int], rnd: random.Random) -> tuple[int, int]:
    """(page offset, node offset) of a random leaf node whose value has overflow pages
    (its data is the 8-byte page number; its key, 16 bytes, sits between)."""
    while True:
        at = rnd.choice(pages) * PAGE
        f.seek(at)
        page = f.read(PAGE)
        _, _, flags, lower_upper = _PAGE_HEAD.unpack_from(page)
        n = ((lower_upper & 0xFFFF) - 16) // 2
        nodes = [struct.unpack_from("<H", page, 16 + 2 * i)[0] for i in range(n)]
        big = [o for o in nodes if o + 32 <= PAGE and struct.unpack_from("<H", page, o + 4)[0] & 1]
        if flags & 0x02 and big:
            return at, rnd.choice(big)


def _flip_bit(f: BinaryIO, pos: int, bit: int) -> None:
    f.seek(pos)
    (b,) = f.read(1)
    f.seek(pos)
    f.write(bytes([b ^ (1 << bit)]))


def _everything(path: Path, items: list[PendingChunk], plain: bool, write: bool) -> None:
    """What a mount and the daemon do with chunk values (reads; and if `write`, the
    daemon's replacement and eviction), each step allowed to fail with an lmdb.Error (or
    a damaged row's struct.error), never with a signal."""
    safe = (lmdb.Error, struct.error, ValueError, KeyError)
    store = CacheStore(str(path), MAP)
    chunks = store.db(b"chunks")
    with store.read_txn() as txn:
        for item in items:
            try:
                value = (
                    txn.get(item.key, db=chunks)
                    if plain
                    else store.get_value(txn, chunks, item.key)
                )
                if value is not None:
                    bytes(value)
            except safe:
                pass
    store.close()
    if not write:
        return
    store = WritableStore(str(path), MAP)
    usage: dict[int, Usage] = {}
    for step in (
        lambda: usage.update(store.load_usage()),
        lambda: store.admit(
            [PendingChunk(*i[:4], replace=True) for i in _tuples(items)], usage, _unlimited
        ),
        lambda: store.evict_random(1, 0, usage),
    ):
        try:
            step()
        except safe:
            pass
    store.close()


def _tuples(items: list[PendingChunk]) -> list[tuple]:
    return [(i.dataset, i.key, i.value, i.data_len) for i in items]


def _trials(
    base: Path, work: Path, items: list[PendingChunk], plain: bool, anywhere: bool
) -> dict[str, int]:
    pages = _chunk_pages(base)
    outcome = {"ok": 0, "signal": 0}
    for trial in range(TRIALS):
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(base, work)
        _flip(work, pages, random.Random(trial), anywhere)
        pid = os.fork()
        if pid == 0:
            # The parent counts the signal; pytest's faulthandler would print a stack
            # for each of the control arm's expected deaths.
            faulthandler.disable()
            try:
                _everything(work, items, plain, write=not (plain or anywhere))
            finally:  # an error is allowed (its exit status is not read); a signal is not
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        outcome["signal" if os.WIFSIGNALED(status) else "ok"] += 1
    return outcome


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[PendingChunk]]:
    path = tmp_path_factory.mktemp("env")
    items = _chunks(150, seed=3)
    store = WritableStore(str(path / "made"), MAP)
    store.admit(items, {}, _unlimited)
    (path / "compact").mkdir()
    store.env.copy(str(path / "compact"), compact=True)
    store.close()
    shutil.copy(path / "made" / "lock.mdb", path / "compact")
    return path / "compact", items


@pytest.mark.slow
@pytest.mark.skipif(mdb_val_offset() < 0, reason="this py-lmdb keeps its MDB_val elsewhere")
def test_flipped_nodes_raise_and_never_fault(base, tmp_path: Path) -> None:
    """Reads survive any flip in a chunks page; the daemon's deletes and replacements
    survive flips of what points at a value. (LMDB's writer trusts the rest of a page,
    its node offsets and key sizes: a write txn over those can still fault, which is
    the daemon's to survive, under systemd's Restart=, not this module's.)"""
    path, items = base
    control = _trials(path, tmp_path / "c", items, plain=True, anywhere=True)
    reads = _trials(path, tmp_path / "r", items, plain=False, anywhere=True)
    writes = _trials(path, tmp_path / "w", items, plain=False, anywhere=False)
    print(f"\ncontrol (plain get): {control}; guarded reads: {reads}; guarded writes: {writes}")
    assert control["signal"] > 0, "no flip reached past the file: the test proves nothing"
    assert reads["signal"] == 0 and writes["signal"] == 0, (reads, writes)


def test_a_value_beyond_the_file_is_refused_before_it_is_touched(base, tmp_path: Path) -> None:
    """One node's value size made to run 256 MiB on, past the end of data.mdb and of
    the map (LMDB itself refuses a page number past its last page, not a size): the
    lookup raises DamagedValueError, and neither replacement nor eviction touches the
    value; the daemon's open grew data.mdb to the map's size, sparse."""
    path, items = base
    work = tmp_path / "w"
    shutil.copytree(path, work)
    store = CacheStore(str(work), MAP)
    big = next(i for i in items if i.data_len > 5_000)
    with store.read_txn() as txn:
        cur = store.value_cursor(txn, store.db(b"chunks"))
        assert cur is not None
        addr, _ = cur.find(big.key)
        pgno = (addr - 16 - cur.start) // PAGE
    store.close()
    data = bytearray((work / "data.mdb").read_bytes())
    # The leaf node: size (lo, hi: 2 + 2 bytes), flags, key size, key, overflow pgno.
    at = data.find(big.key)
    while at >= 0 and struct.unpack_from("<Q", data, at + 16)[0] != pgno:
        at = data.find(big.key, at + 1)  # an owners row ends with the key too
    assert at > 0
    struct.pack_into("<H", data, at - 6, struct.unpack_from("<H", data, at - 6)[0] + 0x1000)
    (work / "data.mdb").write_bytes(bytes(data))
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            store = CacheStore(str(work), MAP)
            with store.read_txn() as txn:
                try:
                    store.get_value(txn, store.db(b"chunks"), big.key)
                except DamagedValueError:
                    code = 0
            store.close()
            store = WritableStore(str(work), MAP)
            st = (work / "data.mdb").stat()
            code = code or (st.st_size != MAP or st.st_blocks * 512 > MAP // 4) * 4
            res = store.admit([PendingChunk(*_tuples([big])[0], replace=True)], {}, _unlimited)
            code = code or (res.damaged != 1 or res.rejected) * 2
            usage = store.load_usage()
            store.evict_random(1, 0, usage)
            code = code or (usage[1].bytes != 0) * 3
            store.close()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert not os.WIFSIGNALED(status), signal.Signals(os.WTERMSIG(status)).name
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_damaged_node_is_reported_once_per_key() -> None:
    """A node left in place is refused on every lookup; FirstTime makes its chunk one
    count and one log line per process, and forgets everything past its limit."""
    first = FirstTime(limit=3)
    assert [first(k) for k in (b"a", b"a", b"b", b"a")] == [True, False, True, False]
    assert first(b"c") and first(b"d")  # the fourth key: the first three are forgotten
    assert first(b"a") and not first(b"d")


def test_bounds_end_at_the_map_when_the_file_is_larger(tmp_path: Path) -> None:
    """A daemon that ran with a bigger cache size grew data.mdb past this map: a value
    running past the map's end is refused though it is inside the file."""
    store = WritableStore(str(tmp_path), 64 << 20)
    store.close()
    os.truncate(tmp_path / "data.mdb", 256 << 20)
    store = CacheStore(str(tmp_path), 64 << 20)
    bounds = store.value_bounds()
    assert bounds is not None
    start, end, map_end = bounds
    assert end == map_end == start + store.env.info()["map_size"] < start + (256 << 20)
    store.close()


@pytest.mark.skipif(mdb_val_offset() < 0, reason="this py-lmdb keeps its MDB_val elsewhere")
def test_bounds_are_found_once_per_map_and_again_for_a_value_past_them(
    base, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lookup costs no fstat once the bounds are known; a value past the end known
    (the file grew since: it never shrinks) is checked against the file again, served,
    and the new end kept; a remap finds them again."""
    path, items = base
    work = tmp_path / "w"
    shutil.copytree(path, work)
    store = CacheStore(str(work), MAP)
    chunks = store.db(b"chunks")
    bounds = store.value_bounds()
    assert bounds is not None
    start, end, map_end = bounds
    calls = []
    real_fstat = os.fstat
    monkeypatch.setattr(os, "fstat", lambda fd: calls.append(fd) or real_fstat(fd))
    with store.read_txn() as txn:
        for item in items:
            assert bytes(store.get_value(txn, chunks, item.key)) == item.value
    assert calls == []  # nothing asked per lookup
    big = next(i for i in items if i.data_len > 5_000)
    with store.read_txn() as txn:
        cur = store.value_cursor(txn, chunks)
        assert cur is not None
        addr, size = cur.find(big.key)
    # As if found while data.mdb ended before this value (the file has grown since).
    store._bounds = (start, addr, map_end)
    with store.read_txn() as txn:
        assert bytes(store.get_value(txn, chunks, big.key)) == big.value
    assert len(calls) == 1 and store.value_bounds() == (start, end, map_end)
    with store.read_txn() as txn:
        assert bytes(store.get_value(txn, chunks, big.key)) == big.value
    assert len(calls) == 1  # the new end is kept
    store.adopt_map_size()
    assert store._bounds is None and store.value_bounds() == (start, end, map_end)
    store.close()
