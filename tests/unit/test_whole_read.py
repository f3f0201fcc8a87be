"""ChunkReader.whole (mount/reader.py): a one-chunk file read whole, the warm small
file's hit path, checked as every hit is (promise 3, docs/SEMANTICS.md).

Over a real LMDB env: whole() serves exactly what hit() serves for files of one to four
checksum blocks, and refuses (None: the general path takes it, which counts the damage
and refetches) any value whose header, block sums, header sum or data differ from what
was written for this object, whichever byte it is."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from silofs.cache.format import BLOCK_SIZE, ChunkRef, encode_chunk
from silofs.mount import reader as reader_module
from silofs.mount.hot import HotFile
from silofs.mount.listing_view import Entry
from silofs.mount.reader import ChunkReader, OpenFile
from silofs.node.store_write import PendingChunk, WritableStore
from silofs.records import ObjectInfo

CS = 4 << 20
DSID = 3
SIZES = [1000, BLOCK_SIZE, 110 << 10, 2 * BLOCK_SIZE, 200 << 10]


async def _never() -> None:
    raise AssertionError("a hit never re-registers")


def _obj(name: str, size: int) -> ObjectInfo:
    return ObjectInfo(name, size, 1.0, "v1", f"cid-{name}")


def _body(o: ObjectInfo) -> bytes:
    seed = o.key.encode() + b"|"
    return (seed * (o.size // len(seed) + 1))[: o.size]


def _admit(store: WritableStore, o: ObjectInfo, value: bytes) -> None:
    ref = ChunkRef.of(o, CS, 0)
    store.admit([PendingChunk(DSID, ref.key, value, ref.length)], {}, lambda *_: 1 << 40)


@pytest.fixture(params=["map", "preadv"])
def copy_by(request: pytest.FixtureRequest) -> str:
    """How whole() takes its private copy: out of LMDB's map once mincore says the value
    is in the page cache (where mincore can tell), or by preadv with RWF_NOWAIT."""
    return str(request.param)


def _reader(store: WritableStore, copy_by: str = "preadv") -> ChunkReader:
    r = ChunkReader(
        store,
        None,  # type: ignore[arg-type]  # hits never ask the daemon
        dataset_id=DSID,
        chunk_size=CS,
        buffer_bytes=CS,
        readahead_bytes=0,
        reregister=_never,
    )
    if not r._whole_ok:
        pytest.skip("no RWF_NOWAIT read of data.mdb here: whole() never serves")
    if copy_by == "map" and not r.pages.truthful:
        r.close()
        pytest.skip("mincore cannot tell this process what data.mdb has in memory")
    r._whole_map = copy_by == "map"
    return r


def _open(o: ObjectInfo) -> OpenFile:
    return OpenFile(o, ref=ChunkRef.of(o, CS, 0))


def test_whole_serves_what_hit_serves_for_every_size(store: WritableStore, copy_by: str) -> None:
    objs = [_obj(f"f{size}.bin", size) for size in SIZES]
    for o in objs:
        _admit(store, o, encode_chunk(DSID, 0, CS, o.key, o.content_id, _body(o)))
    r = _reader(store, copy_by)
    try:
        for _ in range(2):  # the second round reuses each size's views
            for o in objs:
                f = _open(o)
                view = r.whole(f)
                assert view is not None and bytes(view) == _body(o), o.size
                r.begin_read()
                assert bytes(r.hit(f, 0, 0, o.size) or b"") == _body(o)
    finally:
        r.close()


def _flip(at: Callable[[int, int], int]) -> Callable[[bytes, int], bytes]:
    """A damage: one bit of the byte at at(hdr_len, data_len) flipped."""

    def damage(value: bytes, hdr: int) -> bytes:
        i = at(hdr, len(value) - hdr)
        return value[:i] + bytes([value[i] ^ 1]) + value[i + 1 :]

    return damage


DAMAGES = {
    "magic": _flip(lambda h, n: 0),
    "hdr_len": _flip(lambda h, n: 8),
    "index": _flip(lambda h, n: 20),
    "object key": _flip(lambda h, n: 45),
    "first block sum": _flip(lambda h, n: h - 8 - 8 * -(-n // BLOCK_SIZE)),
    "last block sum": _flip(lambda h, n: h - 9),
    "header sum": _flip(lambda h, n: h - 1),
    "first data byte": _flip(lambda h, n: h),
    "last byte of the first block": _flip(lambda h, n: h + BLOCK_SIZE - 1),
    "last data byte": _flip(lambda h, n: h + n - 1),
}


@pytest.mark.parametrize("kind", sorted(DAMAGES))
def test_whole_never_serves_a_damaged_value(store: WritableStore, kind: str, copy_by: str) -> None:
    o = _obj("small/file.bin", 110 << 10)
    good = encode_chunk(DSID, 0, CS, o.key, o.content_id, _body(o))
    hdr = ChunkRef.of(o, CS, 0).header
    bad = DAMAGES[kind](good, hdr)
    assert bad != good and len(bad) == len(good)
    _admit(store, o, bad)
    r = _reader(store, copy_by)
    try:
        assert r.whole(_open(o)) is None
        r.begin_read()
        assert r.hit(_open(o), 0, 0, o.size) is None  # the general path refuses it too
    finally:
        r.close()


def test_whole_leaves_a_value_written_otherwise_to_the_general_path(
    store: WritableStore,
) -> None:
    """The same content admitted by another dataset under another key (a header laid out
    otherwise): not whole()'s to judge, and hit() parses and serves it; one admitted by
    another dataset under the same key is whole()'s (the dataset id is not compared)."""
    o = _obj("small/a.bin", 110 << 10)
    other = ObjectInfo("elsewhere/with/a/longer/name.bin", o.size, 1.0, "v1", o.content_id)
    _admit(store, o, encode_chunk(DSID + 1, 0, CS, other.key, o.content_id, _body(o)))
    p = _obj("small/b.bin", 1000)
    _admit(store, p, encode_chunk(DSID + 1, 0, CS, p.key, p.content_id, _body(p)))
    r = _reader(store)
    try:
        assert r.whole(_open(o)) is None
        r.begin_read()
        assert bytes(r.hit(_open(o), 0, 0, o.size) or b"") == _body(o)
        view = r.whole(_open(p))
        assert view is not None and bytes(view) == _body(p)
    finally:
        r.close()


def test_a_value_not_in_the_page_cache_is_not_whole_s(store: WritableStore, copy_by: str) -> None:
    """whole() copies with RWF_NOWAIT, or out of the map once mincore says every page is
    in memory: a value whose pages the page cache lacks is left to the general path (a
    worker thread reads it), never waited for here."""
    o = _obj("cold.bin", 200 << 10)
    _admit(store, o, encode_chunk(DSID, 0, CS, o.key, o.content_id, _body(o)))
    r = _reader(store, copy_by)
    try:
        data = os.path.join(store.path, "data.mdb")
        fd = os.open(data, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not evicted
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            view = r.whole(_open(o))
            # The lookup's fault may read around into the value: a hit then is right.
            assert view is None or bytes(view) == _body(o)
        finally:
            os.close(fd)
    finally:
        r.close()


@pytest.mark.parametrize("kind", sorted(DAMAGES))
def test_a_value_damaged_after_it_was_served_is_never_served_again(
    store: WritableStore, kind: str, copy_by: str
) -> None:
    """whole() keeps the header it checked in full, and takes a copy holding exactly
    those bytes as checked: damage that lands after a read, in the header or the data,
    is refused on the next read all the same."""
    o = _obj("small/file.bin", 110 << 10)
    good = encode_chunk(DSID, 0, CS, o.key, o.content_id, _body(o))
    _admit(store, o, good)
    r = _reader(store, copy_by)
    try:
        f = _open(o)
        for _ in range(2):
            view = r.whole(f)
            assert view is not None and bytes(view) == _body(o)
        key = ChunkRef.of(o, CS, 0).key
        with store.env.begin(write=True) as txn:
            txn.put(key, DAMAGES[kind](good, f.ref.header), db=store.db(b"chunks"))
        r.renew()  # a snapshot that sees the write
        assert r.whole(f) is None
        with store.env.begin(write=True) as txn:
            txn.put(key, good, db=store.db(b"chunks"))
        r.renew()
        view = r.whole(f)
        assert view is not None and bytes(view) == _body(o)
    finally:
        r.close()


def test_in_memory_tells_a_value_the_page_cache_dropped(store: WritableStore) -> None:
    """The check before whole()'s copy out of the map (ValuePages.in_memory): False once
    the value's pages left the page cache (the copy would wait for the disk on the
    serving thread, or raise SIGBUS on a read error), True once they are back; False
    for a range the map does not hold. The value is found before the drop, in the
    snapshot that stays open, so no lookup of this test reads it back."""
    o = _obj("cold.bin", 200 << 10)
    _admit(store, o, encode_chunk(DSID, 0, CS, o.key, o.content_id, _body(o)))
    r = _reader(store, "map")
    try:
        r.begin_read()
        cur = r._value_cursor()
        assert cur is not None
        where = cur.find(ChunkRef.of(o, CS, 0).key)
        assert where is not None
        addr, size = where
        data = os.path.join(store.path, "data.mdb")
        fd = os.open(data, os.O_RDONLY)
        try:
            os.pread(fd, os.fstat(fd).st_size, 0)
            assert r.pages.in_memory(addr, size)
            os.fsync(fd)  # dirty pages are not evicted
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            assert not r.pages.in_memory(addr, size)
            assert r.whole(_open(o)) is None
            os.pread(fd, os.fstat(fd).st_size, 0)
            assert r.pages.in_memory(addr, size)
        finally:
            os.close(fd)
        assert not r.pages.in_memory(8 << 20, size)  # nothing is mapped there
    finally:
        r.close()


# -- a kept file's hot record (mount/hot.py): ChunkReader.whole_hot ------------------


def _hot(o: ObjectInfo) -> HotFile:
    node = Entry(2, False, 1, o.size, o.mtime, 0, 1, o.key.encode(), o.version, o.content_id)
    return HotFile(1, node, ChunkRef.of(o, CS, 0), 1)


def _map_reader(store: WritableStore) -> ChunkReader:
    """A reader that copies out of the map: where hot records hold a location."""
    return _reader(store, "map")


def _next_snapshot(r: ChunkReader) -> None:
    """The next read begins a snapshot of its own, as one SNAPSHOT_REUSE_SECONDS later."""
    r._txn_at = float("-inf")


def test_a_hot_record_is_placed_once_and_serves_what_whole_serves(
    store: WritableStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    o = _obj("small/hot.bin", 110 << 10)
    _admit(store, o, encode_chunk(DSID, 0, CS, o.key, o.content_id, _body(o)))
    r = _map_reader(store)
    try:
        h = _hot(o)
        assert h.placed == 0
        assert bytes(r.whole_hot(h) or b"") == _body(o)  # placed by whole() proper
        assert h.placed == r._placed
        # From then on no lookup: the record's place, copied and checked again.
        monkeypatch.setattr(r, "_whole", None)
        for _ in range(3):
            assert bytes(r.whole_hot(h) or b"") == _body(o)
        # A snapshot of the same txn id (nothing committed since) keeps the place.
        _next_snapshot(r)
        assert bytes(r.whole_hot(h) or b"") == _body(o)
    finally:
        r.close()


def test_a_hot_record_is_placed_again_after_any_commit(
    store: WritableStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another write txn committed (an admission, an eviction): the place may be stale,
    so the record is placed again in the next snapshot, where the value has moved."""
    o = _obj("small/moves.bin", 110 << 10)
    value = encode_chunk(DSID, 0, CS, o.key, o.content_id, _body(o))
    _admit(store, o, value)
    # The reads' clock stands still: the snapshot is renewed only where the test says
    # (_next_snapshot), never because the commit below (an fsync) or the host took
    # SNAPSHOT_REUSE_SECONDS, which would place the record anew before it is asserted
    # to still serve from the old place.
    monkeypatch.setattr(reader_module, "_monotonic", lambda: 0.0)
    r = _map_reader(store)
    try:
        h = _hot(o)
        assert bytes(r.whole_hot(h) or b"") == _body(o)
        placed, at = h.placed, h.at
        key = ChunkRef.of(o, CS, 0).key
        with store.env.begin(write=True) as txn:  # rewritten elsewhere in the file
            txn.delete(key, db=store.db(b"chunks"))
            txn.put(b"\0filler", b"x" * (300 << 10), db=store.db(b"chunks"))
            txn.put(key, value, db=store.db(b"chunks"))
        # The snapshot the reads began still holds the old place (LMDB frees its pages
        # only once no snapshot holds them): the record serves on until it ends.
        assert bytes(r.whole_hot(h) or b"") == _body(o) and h.placed == placed
        _next_snapshot(r)
        assert bytes(r.whole_hot(h) or b"") == _body(o)
        assert h.placed == r._placed != placed
        assert h.at != at  # it was found where it is now, not read where it was
    finally:
        r.close()


def test_a_hot_record_of_an_evicted_chunk_is_never_used(
    store: WritableStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An allocation shrunk (or any eviction): the record's place is never read again,
    though its pages may hold another value by then."""
    o = _obj("small/evicted.bin", 110 << 10)
    _admit(store, o, encode_chunk(DSID, 0, CS, o.key, o.content_id, _body(o)))
    r = _map_reader(store)
    try:
        h = _hot(o)
        assert bytes(r.whole_hot(h) or b"") == _body(o)
        # The dataset's allocation shrunk to nothing: evicted as the enforcer evicts.
        usage = store.load_usage()
        assert store.evict_random(DSID, 0, usage) > 0
        with store.env.begin(write=True) as txn:
            # Its pages reused by another value (no snapshot other than ours holds them).
            txn.put(b"\0other", b"y" * (200 << 10), db=store.db(b"chunks"))
        _next_snapshot(r)

        def used(*_: object) -> bool:
            raise AssertionError("the record's place was used after the commit")

        monkeypatch.setattr(r.pages, "in_memory_pages", used)
        assert r.whole_hot(h) is None  # not cached: the general path asks the daemon
        assert r.whole_hot(h) is None  # and again: the record is never placed
    finally:
        r.close()


@pytest.mark.parametrize("where", ["header", "first data byte", "last data byte"])
def test_a_hot_record_never_serves_bytes_changed_under_it(store: WritableStore, where: str) -> None:
    """A page of the value rewritten with no commit (a damaged disk, a writer of
    data.mdb other than LMDB): the record's guards hold, its check does not."""
    o = _obj("small/flipped.bin", 110 << 10)
    _admit(store, o, encode_chunk(DSID, 0, CS, o.key, o.content_id, _body(o)))
    r = _map_reader(store)
    try:
        h = _hot(o)
        assert bytes(r.whole_hot(h) or b"") == _body(o)
        at = {"header": h.at + 30, "first data byte": h.mid, "last data byte": h.end - 1}[where]
        fd = os.open(os.path.join(store.path, "data.mdb"), os.O_RDWR)
        try:
            byte = os.pread(fd, 1, at)
            os.pwrite(fd, bytes([byte[0] ^ 1]), at)
            assert h.placed == r._placed  # the guards cannot see it
            assert r.whole_hot(h) is None  # the check does: the general path takes it
            os.pwrite(fd, byte, at)
            assert bytes(r.whole_hot(h) or b"") == _body(o)
        finally:
            os.close(fd)
    finally:
        r.close()


def test_hot_records_keep_to_one_buffer_while_hit_s_grows(store: WritableStore) -> None:
    """hit() replaces its scratch buffer with a longer one when it copies more: the
    records' views stay on whole()'s own, so no record keeps an old buffer alive."""
    small, big = _obj("small/a.bin", 1000), _obj("small/b.bin", 200 << 10)
    for o in (small, big):
        _admit(store, o, encode_chunk(DSID, 0, CS, o.key, o.content_id, _body(o)))
    r = _map_reader(store)
    try:
        h = _hot(small)
        assert bytes(r.whole_hot(h) or b"") == _body(small)
        before = r._scratch
        r.begin_read()
        assert bytes(r.hit(_open(big), 0, 0, big.size) or b"") == _body(big)
        assert r._scratch is not before  # grown
        assert bytes(r.whole_hot(_hot(big)) or b"") == _body(big)
        assert bytes(r.whole_hot(h) or b"") == _body(small)
        assert h.data.obj is r._whole_scratch.obj
    finally:
        r.close()
