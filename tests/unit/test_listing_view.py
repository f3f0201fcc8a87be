"""The tree a mount serves: the LMDB directory index (silofs/cache/listing.py) read through
silofs/mount/listing_view.py, built from listings written by the daemon's code path.

Owns: directories from '/', inode numbers that do not depend on listing order, readdir
order and resumable positions, lookup of '.' and '..', the file-versus-directory-prefix
conflict (the directory wins and the file is reported), keys no POSIX path can name,
names too long for an LMDB key, non-UTF-8 names, the totals, batches that split a
directory, generations (a new listing is invisible until finished; stale rows are
deleted), and agreement with an in-memory listing (tests/unit/reference_listing.py) on
every path, kind, size and object.
"""

from __future__ import annotations

import itertools
import random
import types
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from silofs.cache.listing import Entry
from silofs.errors import SilofsError
from silofs.mount.listing_view import ROOT_INODE, ListingView, changed_entries
from silofs.node import listing_builder
from silofs.node.store_write import WritableStore
from silofs.records import ObjectInfo
from tests.unit.reference_listing import InMemoryListing

_ids = itertools.count(1)


def obj(key: str, size: int = 10, mtime: float = 100.0) -> ObjectInfo:
    return ObjectInfo(key, size, mtime, f"v-{key}", f"c-{key}")


def build(store: WritableStore, listing: list[ObjectInfo], batch: int | None = None) -> ListingView:
    """List `listing` as a fresh dataset through the daemon's path (begin, batches, finish)."""
    dsid = next(_ids)
    b = store.begin_listing(dsid)
    step = batch or max(1, len(listing))
    for i in range(0, max(1, len(listing)), step):
        store.add_to_listing(b, listing[i : i + step])
    record = store.finish_listing(b, {"uri": f"file:///d{dsid}/"})
    return ListingView(store, dsid, record)


LISTING = [
    obj("train/cats/1.jpg", 100, 10.0),
    obj("train/cats/2.jpg", 200, 20.0),
    obj("train/dogs/1.jpg", 300, 30.0),
    obj("val/1.jpg", 400, 5.0),
    obj("README", 5, 1.0),
]


def node_at(m: ListingView, path: str) -> Entry | None:
    node = m.get(ROOT_INODE)
    for part in path.split("/") if path else []:
        assert node is not None
        node = m.lookup(node.inode, part.encode())
        if node is None:
            return None
    return node


def walk_paths(m: ListingView) -> dict[str, Entry]:
    """Every path reachable from the root via lookup of readdir names."""
    out: dict[str, Entry] = {}
    stack = [(m.get(ROOT_INODE), "")]
    while stack:
        node, path = stack.pop()
        assert node is not None
        # Listed first: lookup() renews a snapshot older than RENEW_SECONDS (a loaded
        # host), which would close the one children() iterates (as readdir, which holds
        # one txn for its whole reply, never does).
        for _, name, ino in list(m.children(node.inode)):
            child = m.lookup(node.inode, name)
            assert child is not None and child.inode == ino
            assert child.inode not in {n.inode for n in out.values()}, f"{name!r} loops"
            p = f"{path}/{name.decode(errors='surrogateescape')}" if path else name.decode()
            out[p] = child
            if child.is_dir:
                stack.append((child, p))
    return out


def test_directories_come_from_slashes(store: WritableStore) -> None:
    m = build(store, LISTING)
    root = m.get(ROOT_INODE)
    assert root is not None and root.is_dir and root.inode == ROOT_INODE
    assert m.names(ROOT_INODE) == [b"README", b"train", b"val"]
    train = node_at(m, "train")
    assert train is not None and train.is_dir and m.names(train.inode) == [b"cats", b"dogs"]
    cat = node_at(m, "train/cats/2.jpg")
    assert cat is not None and not cat.is_dir
    assert cat.obj == LISTING[1] and cat.size == 200 and cat.mtime == 20.0
    assert m.path(cat) == "train/cats/2.jpg"
    paths = walk_paths(m)
    files = {p for p, n in paths.items() if not n.is_dir}
    assert files == {o.key for o in LISTING}
    assert {p for p, n in paths.items() if n.is_dir} == {"train", "train/cats", "train/dogs", "val"}
    assert m.inode_count == len(paths) + 1
    _entries_counted(m)
    # nlink of a directory counts its subdirectories
    assert train.aux == 2 and root.aux == 2


def test_totals(store: WritableStore) -> None:
    m = build(store, LISTING)
    assert m.files == 5
    assert m.total_bytes == 100 + 200 + 300 + 400 + 5
    assert m.shadowed == []
    empty = build(store, [])
    assert (empty.files, empty.total_bytes, empty.inode_count) == (0, 0, 1)
    root = empty.get(ROOT_INODE)
    assert root is not None and empty.names(ROOT_INODE) == [] and root.mtime == 0.0


def test_directory_mtime_is_the_newest_inside(store: WritableStore) -> None:
    m = build(store, LISTING)
    assert node_at(m, "train/cats").mtime == 20.0  # type: ignore[union-attr]
    assert node_at(m, "train").mtime == 30.0  # type: ignore[union-attr]
    assert node_at(m, "val").mtime == 5.0  # type: ignore[union-attr]
    assert m.get(ROOT_INODE).mtime == 30.0  # type: ignore[union-attr]


def test_inode_numbers_do_not_depend_on_listing_order_or_batches(store: WritableStore) -> None:
    base = build(store, LISTING)
    expected = {p: n.inode for p, n in walk_paths(base).items()}
    rng = random.Random(3)
    for i in range(20):
        shuffled = LISTING[:]
        rng.shuffle(shuffled)
        m = build(store, shuffled, batch=1 + i % 3)
        assert {p: n.inode for p, n in walk_paths(m).items()} == expected


def test_inode_numbers_are_kept_across_a_refresh(store: WritableStore) -> None:
    dsid = next(_ids)
    store.replace_listing(dsid, LISTING, {})
    first = ListingView(store, dsid, store.dataset_record(dsid))
    before = {p: n.inode for p, n in walk_paths(first).items()}
    changed = [*LISTING[1:4], obj("train/cats/3.jpg"), ObjectInfo("README", 6, 2.0, "v2", "c2")]
    store.replace_listing(dsid, changed, {})
    second = ListingView(store, dsid, store.dataset_record(dsid))
    after = walk_paths(second)
    assert second.gen == first.gen + 1
    for p, n in after.items():
        if p in before:
            assert n.inode == before[p], p
    assert "train/cats/1.jpg" not in after and "train/cats/3.jpg" in after
    # `since`: the generation that first showed this version of the path
    assert after["train/dogs/1.jpg"].since == first.gen
    assert after["README"].since == second.gen
    assert after["README"].obj.version == "v2"  # type: ignore[union-attr]


def test_a_directorys_files_have_neighbouring_inode_numbers(store: WritableStore) -> None:
    # The inodes B-tree is keyed by number: a directory's files must share the top bits
    # (their directory's), or every file of a batch dirties a page of its own.
    m = build(store, [obj(f"d{i % 4}/f{i}") for i in range(800)], batch=100)
    tops: dict[str, set[int]] = {}
    for p, n in walk_paths(m).items():
        if not n.is_dir:
            tops.setdefault(p.split("/")[0], set()).add(n.inode >> listing_builder._FILE_BITS)
    assert len(tops) == 4
    assert all(len(t) == 1 for t in tops.values()), tops
    assert len(set().union(*tops.values())) == 4


def test_colliding_file_inode_numbers_probe_to_distinct_ones(
    store: WritableStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every file's own hash the same: each one after the first probes past the taken
    # numbers, and every file is still found, with its own attributes.
    real = listing_builder.xxhash.xxh3_64_intdigest
    fake = types.SimpleNamespace(
        xxh3_64_intdigest=lambda b: 7 if b.startswith(b"f:") else real(b),
        xxh3_128_digest=listing_builder.xxhash.xxh3_128_digest,
    )
    monkeypatch.setattr(listing_builder, "xxhash", fake)
    files = [obj(f"d/f{i}", size=i) for i in range(50)] + [obj("g/f0", size=99)]
    m = build(store, files, batch=7)
    found = {p: n for p, n in walk_paths(m).items() if not n.is_dir}
    assert len({n.inode for n in found.values()}) == len(files)
    for o in files:
        n = found[o.key]
        assert n.size == o.size and m.get(n.inode) == n


def _tree(m: ListingView | InMemoryListing) -> dict[str, tuple]:
    out = {}
    if isinstance(m, InMemoryListing):
        stack = [(m.get(ROOT_INODE), "")]
        while stack:
            node, path = stack.pop()
            assert node is not None
            for name in node.names:
                child = m.lookup(node.inode, name)
                assert child is not None
                p = f"{path}/{name.decode(errors='surrogateescape')}" if path else name.decode()
                # A directory's size: its entries (its st_size: mount/fs.py).
                size = len(child.names) if child.is_dir else child.size
                out[p] = (child.is_dir, size, child.obj, node.names)
                if child.is_dir:
                    stack.append((child, p))
        return out
    for p, n in walk_paths(m).items():
        parent = m.get(n.parent)
        assert parent is not None
        out[p] = (n.is_dir, n.size, n.obj, m.names(parent.inode))
    return out


KEYS = st.lists(
    st.lists(
        st.sampled_from(["a", "b", "c", "dd", "é", "日", "", ".", ".."]), min_size=1, max_size=4
    ).map("/".join),
    max_size=25,
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(KEYS, st.randoms(use_true_random=False), st.integers(1, 7))
def test_equal_to_the_in_memory_listing(
    store: WritableStore, keys: list[str], rnd: random.Random, batch: int
) -> None:
    """Same paths, kinds, sizes, objects, readdir names and counts as the in-memory listing,
    whatever the listing order and batch size (duplicates included)."""
    listing = [ObjectInfo(k, len(k), float(i), "v", f"c{i}") for i, k in enumerate(keys)]
    # A duplicate key: the first listed wins in both (the in-memory one sorts stably).
    old = InMemoryListing(listing)
    new = build(store, listing, batch)
    assert _tree(new) == _tree(old)
    assert (new.files, new.total_bytes, new.inode_count) == (
        old.files,
        old.total_bytes,
        old.inode_count,
    )
    assert new.record["shadowed"] == len(old.shadowed)
    assert new.record["skipped"] == len(old.skipped)
    # Shuffled: the same visible tree (modulo which duplicate wins) and the same inodes.
    shuffled = listing[:]
    rnd.shuffle(shuffled)
    again = build(store, shuffled, batch)
    a, b = walk_paths(new), walk_paths(again)
    assert {p: (n.inode, n.is_dir) for p, n in a.items()} == {
        p: (n.inode, n.is_dir) for p, n in b.items()
    } or len(set(keys)) != len(keys)
    assert again.record["shadowed"] == new.record["shadowed"]


def test_readdir_order_is_sorted_bytes(store: WritableStore) -> None:
    names = ["b", "B", "a", "_", "Z", "10", "9", "é", "e", "a.b", "a-b"]
    m = build(store, [obj(f"d/{n}") for n in names])
    d = node_at(m, "d")
    assert d is not None
    got = m.names(d.inode)
    assert got == sorted(n.encode() for n in names)
    assert got[0] == b"10" and got[-1] == "é".encode()


def test_readdir_resumes_after_any_position(store: WritableStore) -> None:
    m = build(store, [obj(f"d/{i:05d}") for i in range(500)], batch=37)
    d = node_at(m, "d")
    assert d is not None
    whole = list(m.children(d.inode))
    assert [n for _, n, _ in whole] == [f"{i:05d}".encode() for i in range(500)]
    for cut in (0, 1, 250, 498, 499):
        rest = list(m.children(d.inode, whole[cut][0]))
        assert rest == whole[cut + 1 :]


def test_lookup_dot_and_dotdot(store: WritableStore) -> None:
    m = build(store, LISTING)
    cats = node_at(m, "train/cats")
    train = node_at(m, "train")
    assert cats is not None and train is not None
    assert m.lookup(cats.inode, b".") == cats
    assert m.lookup(cats.inode, b"..") == train
    assert m.lookup(train.inode, b"..").inode == ROOT_INODE  # type: ignore[union-attr]
    assert m.lookup(ROOT_INODE, b"..").inode == ROOT_INODE  # type: ignore[union-attr]
    assert m.lookup(ROOT_INODE, b".").inode == ROOT_INODE  # type: ignore[union-attr]


def test_lookup_misses(store: WritableStore) -> None:
    m = build(store, LISTING)
    readme = node_at(m, "README")
    assert readme is not None
    assert m.lookup(ROOT_INODE, b"nope") is None
    assert m.lookup(ROOT_INODE, b"train/cats") is None  # one component at a time
    assert m.lookup(readme.inode, b"x") is None  # a file has no children
    assert m.lookup(readme.inode, b".") is None
    assert m.lookup(10_000, b"x") is None
    assert m.get(0) is None and m.get(-1) is None and m.get(10_000) is None
    assert m.get(1 << 64) is None


def test_file_and_directory_prefix_the_directory_wins(store: WritableStore) -> None:
    for order in ([0, 1, 2], [1, 0, 2], [2, 1, 0]):
        listing = [obj("a", 7, 50.0), obj("a/b", 3, 1.0), obj("c", 1)]
        m = build(store, [listing[i] for i in order], batch=1)
        a = node_at(m, "a")
        assert a is not None and a.is_dir and m.names(a.inode) == [b"b"]
        assert a.size == 1 and a.obj is None  # a directory's size: its entries
        b = node_at(m, "a/b")
        assert b is not None and b.obj is not None and b.obj.key == "a/b"
        assert m.shadowed == ["a"]
        assert m.files == 2 and m.total_bytes == 3 + 1
        # The hidden file's mtime does not leak into the directory.
        assert a.mtime == 1.0


def test_shadowing_is_the_same_whatever_the_order(store: WritableStore) -> None:
    listing = [obj("x/y"), obj("x"), obj("x/y/z"), obj("x/w")]
    for order in (listing, listing[::-1]):
        m = build(store, order)
        assert sorted(m.shadowed) == ["x", "x/y"]
        assert node_at(m, "x/y/z") is not None
        assert node_at(m, "x/w") is not None
        assert m.files == 2
        _entries_counted(m)


def _entries_counted(m: ListingView) -> None:
    """Every directory's size is the number of its entries (its st_size: mount/fs.py)."""
    for path, node in walk_paths(m).items():
        if node.is_dir:
            assert node.size == len(list(m.children(node.inode))), path
    root = m.get(ROOT_INODE)
    assert root is not None and root.size == len(list(m.children(ROOT_INODE)))


def test_duplicate_keys_are_reported_once_visible(store: WritableStore) -> None:
    m = build(store, [obj("k", 1), obj("k", 2)])
    assert m.files == 1 and m.record["shadowed"] == 1
    assert m.names(ROOT_INODE) == [b"k"]
    assert node_at(m, "k").size == 1  # type: ignore[union-attr]


def test_keys_no_path_can_name_are_left_out_and_reported(store: WritableStore) -> None:
    bad = ["a//b", "/lead", "./x", "d/../y", "d/.", "..", "nul\0byte"]
    good = [obj("d/ok", 4), obj("fine", 6)]
    m = build(store, [*good, *(obj(k) for k in bad)])
    paths = walk_paths(m)
    assert set(paths) == {"d", "d/ok", "fine"}
    for node in paths.values():
        assert node.name not in (b"", b".", b"..") and b"\0" not in node.name
    assert m.files == 2 and m.total_bytes == 10
    assert m.record["skipped"] == len(bad)
    assert set(m.skipped) <= set(bad) and m.skipped
    # '.' and '..' still mean the directory and its parent.
    d = node_at(m, "d")
    assert d is not None and m.lookup(d.inode, b"..") == m.get(ROOT_INODE)


def test_unicode_and_non_utf8_names(store: WritableStore) -> None:
    raw = b"caf\xe9".decode("utf-8", "surrogateescape")  # latin-1 bytes, not UTF-8
    m = build(store, [obj("日本/ファイル.txt"), obj("ñ/ü 1.jpg"), obj(f"x/{raw}")])
    f = node_at(m, "日本/ファイル.txt")
    assert f is not None and f.name == "ファイル.txt".encode()
    assert m.path(f) == "日本/ファイル.txt"
    x = node_at(m, "x")
    assert x is not None and m.names(x.inode) == [b"caf\xe9"]
    e = m.lookup(x.inode, b"caf\xe9")
    assert e is not None and e.obj is not None and e.obj.key == f"x/{raw}"


@pytest.mark.parametrize("length", [255, 256, 480, 491, 492, 600, 1024])
def test_names_too_long_for_an_lmdb_key(store: WritableStore, length: int) -> None:
    long = "n" * (length - 1)
    twins = [long + "a", long + "b", long[:-1] + "é"[:1]]  # same first bytes
    m = build(store, [obj(f"d/{t}", size=i) for i, t in enumerate(twins)] + [obj(f"{long}a/x")])
    d = node_at(m, "d")
    assert d is not None
    assert sorted(m.names(d.inode)) == sorted(t.encode() for t in twins)
    for i, t in enumerate(twins):
        e = m.lookup(d.inode, t.encode())
        assert e is not None and e.size == i and e.obj.key == f"d/{t}"  # type: ignore[union-attr]
    assert m.lookup(d.inode, (long + "c").encode()) is None
    assert node_at(m, f"{long}a/x") is not None
    assert store.get_object(m.dsid, f"d/{twins[1]}").size == 1  # type: ignore[union-attr]


def test_an_unfinished_listing_is_invisible_and_cleaned(store: WritableStore) -> None:
    dsid = next(_ids)
    store.replace_listing(dsid, LISTING, {})
    gen = store.current_generation(dsid)
    b = store.begin_listing(dsid)  # a daemon killed mid-listing: never finished
    store.add_to_listing(b, [obj("partial")])
    assert store.current_generation(dsid) == gen
    assert {o.key for o in store.iter_listing(dsid)} == {o.key for o in LISTING}
    assert store.get_object(dsid, "partial") is None
    # The next listing deletes the partial generation and starts clean.
    store.replace_listing(dsid, [obj("new")], {})
    assert {o.key for o in store.iter_listing(dsid)} == {"new"}
    assert store.current_generation(dsid) == gen + 1  # type: ignore[operator]
    assert store.get_object(dsid, "README", gen) is not None  # the previous one is kept
    store.replace_listing(dsid, [obj("newer")], {})
    assert store.get_object(dsid, "README", gen) is None  # ... until the next listing
    with store.env.begin() as txn:  # no rows of other generations are left
        for db in (b"dirents", b"inodes"):
            gens = {
                bytes(k[8:12])
                for k, _ in txn.cursor(db=store.db(db))
                if k[:8] == dsid.to_bytes(8, "big")
            }
            assert len(gens) == 2, gens


def test_memory_is_bounded(store: WritableStore, tmp_path: Path) -> None:
    m = build(store, [obj(f"d{i % 10}/f{i}") for i in range(3000)], batch=500)
    m.cache_entries = 100
    assert len(walk_paths(m)) == 3010
    _entries_counted(m)  # directories written back and read again across batches
    assert len(m._cache) <= 100


FANOUT_KEYS = st.lists(
    st.tuples(
        st.lists(st.sampled_from(["a", "b", "dd", "é", "", "."]), min_size=1, max_size=4).map(
            "/".join
        ),
        st.booleans(),  # a 'dir/' marker key instead
    ).map(lambda t: t[0] + "/" if t[1] else t[0]),
    max_size=25,
    unique=True,
)


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(FANOUT_KEYS, st.integers(1, 5), st.integers(1, 4), st.sampled_from([1, 4]))
def test_a_directory_marked_complete_has_all_its_entries(
    store: WritableStore, keys: list[str], batch: int, page: int, workers: int
) -> None:
    """--list-in-background: through a listing with PrefixListed records in the stream
    (fanned out, or serial in key order), at every batch boundary a directory with a
    "complete" row already has every entry it has in the finished listing, plus at most
    tentative directories; a settled one has exactly those; and a directory that is not
    tentative is in the finished listing (a prefix holding only 'dir/' markers is never
    shown and then lost). The finished listing equals the serial one."""
    from tests.unit.test_list_fanout import MemStore

    store_keys = ["p/" + k for k in keys]
    serial = list(MemStore(store_keys, workers=1, page=page).list())
    events = list(MemStore(store_keys, workers=workers, page=page).list_events())
    assert sorted(e.key for e in events if isinstance(e, ObjectInfo)) == sorted(
        o.key for o in serial
    )
    final = build(store, serial)
    final_dirs = {p: n for p, n in walk_paths(final).items() if n.is_dir}
    final_dirs[""] = final.get(ROOT_INODE)  # type: ignore[assignment]
    names = {p: final.names(n.inode) for p, n in final_dirs.items()}

    dsid = next(_ids)
    b = store.begin_listing(dsid)
    reader = store.listing(dsid, b.gen)
    completed = set()
    for i in range(0, len(events), batch):
        store.add_to_listing(b, events[i : i + batch])
        with store.env.begin() as txn:
            # Every directory in the index so far: one that is not tentative is final.
            stack = [(ROOT_INODE, "")]
            while stack:
                ino, path = stack.pop()
                for _, name, child in reader.children(txn, ino):
                    e = reader.get(txn, child)
                    assert e is not None
                    if e.is_dir:
                        sub = (path + "/" if path else "") + name.decode()
                        assert sub in final_dirs or reader.tentative(txn, ino, child), sub
                        stack.append((child, sub))
            for p, n in final_dirs.items():
                if reader.complete(txn, n.inode):
                    got = [name for _, name, _ in reader.children(txn, n.inode)]
                    assert set(names[p]) <= set(got), p
                    for name in set(got) - set(names[p]):
                        e = reader.lookup(txn, n.inode, name)
                        assert e is not None and e.is_dir, (p, name)
                        assert reader.tentative(txn, n.inode, e.inode), (p, name)
                        under = e.path.decode() + "/"
                        assert all(not o.key.startswith(under) for o in serial)
                    if reader.settled(txn, n.inode):
                        assert sorted(got) == sorted(names[p]), p
                    completed.add(p)
    record = store.finish_listing(b, {"uri": f"file:///d{dsid}/"})
    m = ListingView(store, dsid, record)
    assert _tree(m) == _tree(final)
    assert (m.files, m.inode_count) == (final.files, final.inode_count)
    assert {p: n.inode for p, n in walk_paths(m).items()} == {
        p: n.inode for p, n in walk_paths(final).items()
    }
    # Every prefix was listed to its end, so every directory got its row, except one
    # under a name a file had when its prefix was listed (the file is shadowed only by
    # an object under it): those are complete with the whole listing.
    files = {o.key for o in serial}

    def behind_a_file(path: str) -> bool:
        parts = path.split("/")
        return any("/".join(parts[:i]) in files for i in range(1, len(parts) + 1))

    expected = {p for p in final_dirs if not behind_a_file(p)}
    if workers == 1:
        # A serial listing completes a directory at the first key past it: the root and
        # the directories of the last key are complete with the whole listing.
        last = max((o.key for o in serial), default="").split("/")[:-1]
        expected -= {"", *("/".join(last[:i]) for i in range(1, len(last) + 1))}
    assert completed >= expected


def test_content_ids_are_stored_without_repeating_the_version() -> None:
    from silofs.cache.listing import pack_cid, unpack_cid

    cases = [
        (b"d41d8cd98f00b204e9800998ecf8427e", b"s3:d41d8cd98f00b204e9800998ecf8427e:10"),
        (b"1-2-3-4", b"local:1-2-3-4"),
        (b"v", b"vvv"),
        (b"", b"anything"),
        (b"abc", b"no version here"),
        (b"abc", b"\x01abc starts like a template"),
        (b"abc", b"\x02abc starts like an escape"),
        (b"x", b"\x01 raw"),
        (b"x", b""),
    ]
    for version, cid in cases:
        stored = pack_cid(version, cid)
        assert unpack_cid(version, stored) == cid, (version, cid)
    assert pack_cid(*cases[0]) == b"\x01s3:\x01:10"  # 8 bytes for 38


def test_readdir_rows_carry_what_getattr_and_open_read(store: WritableStore) -> None:
    """entries() reads a file's attributes from its directory's rows; they are the ones
    get() (an inode number alone) and lookup() give, and iter_files walks the same."""
    listing = [
        obj("a/x", 1, 1.5),
        obj("a/y", 22, 2.5),
        obj("a/b/z", 333, 3.5),
        obj("top", 4, 4.5),
        obj("a/" + "L" * 600, 5, 5.5),  # a hashed long name
    ]
    m = build(store, listing)
    with store.env.begin() as txn:
        seen = 0
        for node in [m.get(ROOT_INODE), *(n for n in walk_paths(m).values() if n.is_dir)]:
            assert node is not None
            for _, name, ino, e in m.reader.entries(txn, node.inode):
                full = m.reader.get(txn, ino)
                assert full is not None and full.name == name
                if e is None:
                    assert full.is_dir
                    continue
                seen += 1
                assert (e.inode, e.size, e.mtime, e.since, e.version, e.content_id) == (
                    full.inode,
                    full.size,
                    full.mtime,
                    full.since,
                    full.version,
                    full.content_id,
                )
                assert m.lookup(node.inode, name) == full
        assert seen == len(listing)
        files = sorted((e.obj for e in m.reader.iter_files(txn)), key=lambda o: o.key)  # type: ignore[union-attr]
        assert files == sorted(listing, key=lambda o: o.key)


def test_a_listing_of_another_row_format_is_not_served(store: WritableStore) -> None:
    dsid = next(_ids)
    store.replace_listing(dsid, LISTING, {})
    assert store.current_generation(dsid) is not None
    record = store.dataset_record(dsid)
    old = {k: v for k, v in record.items() if k != "listing_format"}  # as format 1 wrote it
    import json
    import struct

    with store.env.begin(write=True) as txn:
        txn.put(struct.pack(">Q", dsid), json.dumps(old).encode(), db=store.db(b"datasets"))
    assert store.current_generation(dsid) is None
    assert store.get_object(dsid, "README") is None
    with pytest.raises(SilofsError, match="another silofs version"):
        ListingView(store, dsid, old)  # a mount refuses to misread it


def test_a_prefix_of_only_markers_is_tentative_then_gone_before_the_listing_ends(
    store: WritableStore,
) -> None:
    """A fanned-out listing names "m/" (its keys: the markers "m/" and "m/n/") before it
    is listed: the directory is tentative, and removed as soon as its prefix and its
    sub-prefix are listed with no object, not shown empty until finish()."""
    from silofs.records import PrefixListed

    dsid = next(_ids)
    b = store.begin_listing(dsid)
    reader = store.listing(dsid, b.gen)

    def at(path: bytes) -> tuple[int, int] | None:
        with store.env.begin() as txn:
            e = reader.lookup(txn, ROOT_INODE, path)
            if e is None:
                return None
            return e.inode, reader.tentative(txn, ROOT_INODE, e.inode)

    store.add_to_listing(b, [ObjectInfo("f", 1, 1.0, "v", "c"), PrefixListed("", ("d/", "m/"))])
    d, m = at(b"d"), at(b"m")
    assert d is not None and d[1] and m is not None and m[1]
    with store.env.begin() as txn:
        assert not reader.settled(txn, ROOT_INODE)  # complete would not be enough: m may go
    store.add_to_listing(b, [ObjectInfo("d/x", 1, 1.0, "v", "c"), PrefixListed("d/", done=True)])
    assert at(b"d") == (d[0], False)  # holds an object: final
    store.add_to_listing(b, [PrefixListed("m/", ("m/n/",), done=True), PrefixListed("", done=True)])
    assert at(b"m") is not None  # m/n/ is still to be listed
    store.add_to_listing(b, [PrefixListed("m/n/", done=True)])
    assert at(b"m") is None  # nothing under it: gone before finish()
    with store.env.begin() as txn:
        assert reader.settled(txn, ROOT_INODE)
        assert [n for _, n, _ in reader.children(txn, ROOT_INODE)] == [b"d", b"f"]
        assert reader.get(txn, ROOT_INODE).aux == 1  # type: ignore[union-attr]
        assert reader.get(txn, ROOT_INODE).size == 2  # type: ignore[union-attr]  # m went
    record = store.finish_listing(b, {"uri": f"file:///d{dsid}/"})
    assert record["inodes"] == 4  # root, d, d/x, f


def test_a_directory_removed_after_its_lookup_is_not_served_from_that_lookup(
    store: WritableStore,
) -> None:
    """A lookup finds tentative directory m/ in its snapshot; before wait_resolved looks,
    the listing removes m/ (only markers under it). wait_resolved must say "look again"
    (the name is gone), not judge "not tentative" in a fresher snapshot and so let the
    caller answer with the entry it found: a marker-only directory shown to a reader."""
    import trio

    from silofs.records import PrefixListed

    dsid = next(_ids)
    b = store.begin_listing(dsid)
    store.add_to_listing(b, [PrefixListed("", ("m/",), done=True), PrefixListed("m/", ("m/n/",))])
    view = ListingView(store, dsid, {"gen": b.gen}, building=True)
    view.renew()
    found = view.lookup(ROOT_INODE, b"m")
    assert found is not None and found.is_dir
    store.add_to_listing(b, [PrefixListed("m/", done=True), PrefixListed("m/n/", done=True)])

    async def lookup_as_fs_does() -> Entry | None:
        node = found
        if await view.wait_resolved(ROOT_INODE, found.inode):
            view.renew()
            node = view.lookup(ROOT_INODE, b"m")
        return node

    assert trio.run(lookup_as_fs_does) is None
    view.close()


@pytest.mark.parametrize("limit", [1, 2, 1000])
def test_changed_entries_between_two_generations(store: WritableStore, limit: int) -> None:
    """What a mount tells the kernel to forget after a refresh (process.py _forget_walk):
    every file of the old listing whose size, mtime or version changed, or that went
    away or became a directory; every directory that went away or became a file; not
    one that is the same bar its listing order."""
    dsid = next(_ids)
    old = [obj("a/same"), obj("a/bigger"), obj("a/newer"), obj("a/gone"), obj("b/c")]
    old += [obj("turns/dir"), obj("z", 1, 1.0), obj("gone/deep/x"), obj("filed/y")]
    store.replace_listing(dsid, old, {})
    first = ListingView(store, dsid, store.dataset_record(dsid))
    new = [obj("new/file"), obj("z", 1, 1.0), obj("a/same"), obj("a/bigger", 11)]
    new += [obj("a/newer", 10, 101.0), obj("b/c"), obj("turns/dir/x"), obj("filed")]
    store.replace_listing(dsid, new, {})
    second = ListingView(store, dsid, store.dataset_record(dsid))
    before = walk_paths(first)
    before[""] = first.get(ROOT_INODE)
    got: list[tuple[int, int, bytes | None]] = []
    row: bytes | None = None
    with store.read_txn() as txn:
        while True:
            part, row = changed_entries(txn, first.reader, second.reader, row, limit)
            got += part
            if row is None:
                break
    want = {
        (before[p].inode, before[p].parent, gone)
        for p, gone in [("a/bigger", None), ("a/newer", None), ("a/gone", b"gone")]
    } | {
        (before[p].inode, before[parent].inode, name)
        for p, parent, name in [
            ("turns/dir", "turns", b"dir"),
            ("gone", "", b"gone"),  # a directory, gone with all it held
            ("gone/deep", "gone", b"deep"),
            ("gone/deep/x", "gone/deep", b"x"),
            ("filed", "", b"filed"),  # a directory that is a file now
            ("filed/y", "filed", b"y"),
        ]
    }
    assert sorted(got) == sorted(want)
    first.close()
    second.close()


def test_a_name_that_leads_to_another_inode_is_forgotten_by_name(
    store: WritableStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A listing written with whole-hash file numbers (before the directory's top bits),
    # then refreshed: each unchanged file has a new inode. The kernel must forget the
    # names, or it keeps opening the old inodes, which the new listing does not have.
    dsid = next(_ids)
    listing_ = [obj("a/same"), obj("a/other", 5), obj("top")]
    monkeypatch.setattr(listing_builder, "_dir_bits", lambda _path: 0)
    store.replace_listing(dsid, listing_, {})
    monkeypatch.undo()
    first = ListingView(store, dsid, store.dataset_record(dsid))
    store.replace_listing(dsid, listing_, {})
    second = ListingView(store, dsid, store.dataset_record(dsid))
    before, after = walk_paths(first), walk_paths(second)
    files = ["a/same", "a/other", "top"]
    assert all(before[p].inode != after[p].inode for p in files)
    with store.read_txn() as txn:
        got, row = changed_entries(txn, first.reader, second.reader)
    assert row is None
    assert sorted(got) == sorted(
        (before[p].inode, before[p].parent, p.rsplit("/", 1)[-1].encode()) for p in files
    )
    first.close()
    second.close()
