"""Stored rows that do not decode (silofs/cache/rows.py) on a real env in a temp dir.

Owns the rule that a damaged row (LMDB checksums no page: a flipped byte in a leaf can
change a row's size or bytes, as tests/reliability/test_byteflips.py's long form does)
is one log line and a safe default: the usage rows recounted, a damaged dataset record
or names row listed again under a fresh id, damaged meta, stale, lru and generation
rows skipped or deleted, a damaged listing row one request's error or one entry left
out of its directory; never a struct.error or JSONDecodeError out of the store.
"""

from __future__ import annotations

import logging
from pathlib import Path

import lmdb
import pytest

from silofs.cache import rows
from silofs.cache.listing import ROOT_INODE, DamagedRowError
from silofs.cache.store import DSID, Usage
from silofs.errors import SilofsError
from silofs.mount.listing_view import changed_entries
from silofs.node.listing_builder import _dirent
from silofs.node.lru_index import LruIndex
from silofs.node.store_write import WritableStore
from silofs.records import ObjectInfo
from tests.unit.test_store import fill, objects


@pytest.fixture(autouse=True)
def _fresh_log_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rows, "_LOGGED", set())


def _put(store: WritableStore, db: bytes, key: bytes, value: bytes) -> None:
    with store.env.begin(write=True) as txn:
        txn.put(key, value, db=store.db(db))


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_damaged_usage_row_is_recounted_from_the_owners_rows(
    store: WritableStore, caplog: pytest.LogCaptureFixture
) -> None:
    usage: dict[int, Usage] = {}
    fill(store, usage, 1, 10)
    fill(store, usage, 2, 3, size=7)
    assert store.load_usage() == {1: Usage(1000, 10), 2: Usage(21, 3)}
    _put(store, b"usage", DSID.pack(1), b"\x01" * 15)  # one byte short
    _put(store, b"usage", b"\x00\x02", b"\x00" * 16)  # a key that names no dataset
    assert store.load_usage() == {1: Usage(1000, 10), 2: Usage(21, 3)}
    assert _errors(caplog) == [
        "damaged usage row of dataset 1 (15 bytes): recounted from its owners rows",
        "damaged usage row key (2 bytes): skipped",
    ]
    with store.env.begin() as txn:  # a mount's statfs: nothing cached, not an exception
        assert store.usage_of(txn, 1) == Usage()
        assert store.usage_of(txn, 2) == Usage(21, 3)


def test_a_damaged_dataset_record_means_listing_it_again(
    store: WritableStore, caplog: pytest.LogCaptureFixture
) -> None:
    ds = store.dataset_id("s3://b/one/", create=True)
    assert ds is not None
    store.replace_listing(ds, objects(5), {"uri": "s3://b/one/"})
    assert store.current_generation(ds) is not None
    for bad in (b'{"uri": "s3://b/one/", "gen"\xff', b"[1]"):
        _put(store, b"datasets", DSID.pack(ds), bad)
        assert store.dataset_record(ds) == {}
        assert store.current_generation(ds) is None  # listed again
        assert store.get_object(ds, "dir0/file-0.bin") is None
        assert ds not in store.all_datasets()
    assert all("record of dataset" in m for m in _errors(caplog)) and _errors(caplog)


def test_a_damaged_names_row_gives_a_fresh_id_never_another_datasets(
    store: WritableStore, caplog: pytest.LogCaptureFixture
) -> None:
    one = store.dataset_id("s3://b/one/", create=True)
    two = store.dataset_id("s3://b/two/", create=True)
    assert (one, two) == (1, 2)
    _put(store, b"names", b"s3://b/one/", b"\x00" * 7)
    assert store.dataset_id("s3://b/one/", create=False) is None
    again = store.dataset_id("s3://b/one/", create=True)
    assert again == 3
    assert store.dataset_id("s3://b/one/", create=False) == 3  # the row is whole again
    assert "damaged names row of s3://b/one/ (7 bytes): listing it under a new id" in (
        _errors(caplog)
    )


@pytest.mark.parametrize("bad", [b"\xff", b'"x"', b"true", b"-4", b"2"])
def test_a_damaged_next_id_row_is_rebuilt_past_the_ids_in_use(
    store: WritableStore, bad: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """ "2" decodes but names a dataset in use: reusing it would serve another dataset's
    listing and chunks."""
    for uri in ("s3://b/one/", "s3://b/two/", "s3://b/three/"):
        store.dataset_id(uri, create=True)
    _put(store, b"meta", b"next_dataset_id", bad)
    assert store.dataset_id("s3://b/four/", create=True) == 4
    assert store.dataset_id("s3://b/five/", create=True) == 5
    assert any("next_dataset_id row" in m for m in _errors(caplog))


def test_damaged_meta_rows_read_as_unset(store: WritableStore) -> None:
    store.put_meta("alloc/a", {"x": 1})
    store.put_meta("alloc/b", {"x": 2})
    _put(store, b"meta", b"alloc/b", b'{"x": ')
    _put(store, b"meta", b"alloc/\xffc", b"{}")
    assert store.get_meta("alloc/b") is None
    assert dict(store.iter_meta("alloc/")) == {"alloc/a": {"x": 1}}


def test_a_damaged_store_version_is_one_clear_error(tmp_path: Path) -> None:
    path = str(tmp_path / "cache")
    s = WritableStore(path, 16 << 20)
    _put(s, b"meta", b"store_version", b"q")  # "1" with one bit flipped
    s.close()
    with pytest.raises(SilofsError, match="store version unreadable.*use another --cache-dir"):
        WritableStore(path, 16 << 20)


def test_damaged_stale_and_generation_keys_are_deleted(
    store: WritableStore, caplog: pytest.LogCaptureFixture
) -> None:
    ds = store.dataset_id("s3://b/one/", create=True)
    assert ds is not None
    store.replace_listing(ds, objects(5), {"uri": "s3://b/one/"})
    gen = store.current_generation(ds)
    short = DSID.pack(ds) + b"\x00\x01"  # a dirents key cut inside its generation
    _put(store, b"dirents", short, b"x")
    _put(store, b"stale", b"\x00\x00\x01", b"")
    assert gen is not None
    assert store.delete_stale_generations(ds, {gen}) == 1
    with store.env.begin() as txn:
        assert txn.get(short, db=store.db(b"dirents")) is None
    assert store.get_object(ds, "dir0/file-0.bin") is not None  # the kept generation
    assert store.sweep_elsewhere(lambda _k: True, b"", {}) == (0, 0, None)
    with store.env.begin() as txn:
        assert txn.get(b"\x00\x00\x01", db=store.db(b"stale")) is None
    assert len(_errors(caplog)) == 2


def test_a_damaged_lru_key_does_not_stop_the_daemon_starting(store: WritableStore) -> None:
    usage: dict[int, Usage] = {}
    fill(store, usage, 1, 3)
    lru = LruIndex(store)
    keys = [k[DSID.size :] for k in _owners(store)]
    lru.touch(1, keys)
    with store.env.begin(write=True) as txn:
        txn.put(DSID.pack(1) + b"\x00\x01", keys[0], db=lru.order)  # a 10-byte key
    again = LruIndex(store)
    assert again._seq == 3
    assert again.evict_oldest(1, 0, usage) == 300
    assert again.evict_oldest_among({1}, 1, usage) == 0


def _owners(store: WritableStore) -> list[bytes]:
    with store.env.begin() as txn:
        return [bytes(k) for k in txn.cursor(db=store.db(b"owners")).iternext(values=False)]


def test_a_damaged_listing_row_is_one_entrys_error_and_left_out_of_readdir(
    store: WritableStore, caplog: pytest.LogCaptureFixture
) -> None:
    ds = store.dataset_id("s3://b/one/", create=True)
    assert ds is not None
    listed = [ObjectInfo(f"f{i}", 10 + i, 1.0, f"v{i}", f"c{i}") for i in range(3)]
    store.replace_listing(ds, listed, {"uri": "s3://b/one/"})
    gen = store.current_generation(ds)
    assert gen is not None
    reader = store.listing(ds, gen)
    row, _ = reader.rows.dirent(ROOT_INODE, b"f1")
    with store.env.begin() as txn:
        whole = bytes(txn.get(row, db=store.db(b"dirents")))
    for bad in (whole[:5], whole[:40], whole[:30] + b"no separators"):
        _put(store, b"dirents", row, bad)
        with store.env.begin() as txn:
            names = [name for _, name, _, _ in reader.entries(txn, ROOT_INODE)]
            assert names == [b"f0", b"f2"]
            assert [e.obj.key for e in reader.iter_files(txn) if e.obj] == ["f0", "f2"]
            with pytest.raises(DamagedRowError):
                reader.lookup(txn, ROOT_INODE, b"f1")
            assert reader.lookup(txn, ROOT_INODE, b"f2") is not None
        assert store.get_object(ds, "f0") == listed[0]
    assert any("left out of its directory" in m for m in _errors(caplog))


def test_a_damaged_row_in_a_listing_being_built_is_an_lmdb_error() -> None:
    """listing_builder reads back the rows of the generation it writes: a row too short
    fails that listing in one line (datasets.py handles lmdb.Error), not a struct.error."""
    with pytest.raises(DamagedRowError) as err:
        _dirent(b"\x00" * 5)
    assert isinstance(err.value, lmdb.Error)
    assert _dirent(b"\x07" + b"\x00" * 7 + b"\x01") == (7, 1)


def test_a_damaged_row_of_the_old_generation_does_not_stop_a_refreshs_forgetting(
    store: WritableStore,
) -> None:
    ds = store.dataset_id("s3://b/one/", create=True)
    assert ds is not None
    old = [ObjectInfo(f"f{i}", 10, 1.0, "v", f"c{i}") for i in range(3)]
    store.replace_listing(ds, old, {"uri": "s3://b/one/"})
    first = store.listing(ds, store.current_generation(ds) or 0)
    row, _ = first.rows.dirent(ROOT_INODE, b"f1")
    _put(store, b"dirents", row, b"\x00" * 4)
    store.replace_listing(ds, [*old[:1], ObjectInfo("f2", 11, 1.0, "v2", "c2b")], {})
    second = store.listing(ds, store.current_generation(ds) or 0)
    with store.read_txn() as txn:
        got, more = changed_entries(txn, first, second)
    assert more is None
    assert [name for _, _, name in got] == [None]  # f2: other attributes; f1 skipped
