"""The tree a mount serves (silofs/manifest.py), built from listings in memory.

Owns: directories from '/', inode numbers that do not depend on listing order, readdir
order, lookup of '.' and '..', the file-versus-directory-prefix conflict (the directory
wins and the file is reported), keys no POSIX path can name, and the totals.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from silofs.mount.manifest import ROOT_INODE, Manifest, Node
from silofs.records import ObjectInfo


def obj(key: str, size: int = 10, mtime: float = 100.0) -> ObjectInfo:
    return ObjectInfo(key, size, mtime, f"v-{key}", f"c-{key}")


LISTING = [
    obj("train/cats/1.jpg", 100, 10.0),
    obj("train/cats/2.jpg", 200, 20.0),
    obj("train/dogs/1.jpg", 300, 30.0),
    obj("val/1.jpg", 400, 5.0),
    obj("README", 5, 1.0),
]


def node_at(m: Manifest, path: str) -> Node | None:
    node = m.get(ROOT_INODE)
    for part in path.split("/") if path else []:
        assert node is not None
        node = m.lookup(node.inode, part.encode())
        if node is None:
            return None
    return node


def walk_paths(m: Manifest) -> dict[str, Node]:
    """Every path reachable from the root via lookup of readdir names."""
    out: dict[str, Node] = {}
    stack = [(m.get(ROOT_INODE), "")]
    while stack:
        node, path = stack.pop()
        assert node is not None
        for name in node.names:
            child = m.lookup(node.inode, name)
            assert child is not None
            assert child.inode not in {n.inode for n in out.values()}, f"{name!r} loops"
            p = f"{path}/{name.decode()}" if path else name.decode()
            out[p] = child
            if child.is_dir:
                stack.append((child, p))
    return out


def test_directories_come_from_slashes() -> None:
    m = Manifest(LISTING)
    root = m.get(ROOT_INODE)
    assert root is not None and root.is_dir and root.inode == ROOT_INODE
    assert root.names == [b"README", b"train", b"val"]
    train = node_at(m, "train")
    assert train is not None and train.is_dir and train.names == [b"cats", b"dogs"]
    cat = node_at(m, "train/cats/2.jpg")
    assert cat is not None and not cat.is_dir
    assert cat.obj == LISTING[1] and cat.size == 200 and cat.mtime == 20.0
    assert m.path(cat) == "train/cats/2.jpg"
    paths = walk_paths(m)
    files = {p for p, n in paths.items() if not n.is_dir}
    assert files == {o.key for o in LISTING}
    assert {p for p, n in paths.items() if n.is_dir} == {"train", "train/cats", "train/dogs", "val"}
    assert m.inode_count == len(paths) + 1


def test_totals() -> None:
    m = Manifest(LISTING)
    assert m.files == 5
    assert m.total_bytes == 100 + 200 + 300 + 400 + 5
    assert m.shadowed == []
    empty = Manifest([])
    assert (empty.files, empty.total_bytes, empty.inode_count) == (0, 0, 1)
    root = empty.get(ROOT_INODE)
    assert root is not None and root.names == [] and root.mtime == 0.0


def test_directory_mtime_is_the_newest_inside() -> None:
    m = Manifest(LISTING)
    assert node_at(m, "train/cats").mtime == 20.0  # type: ignore[union-attr]
    assert node_at(m, "train").mtime == 30.0  # type: ignore[union-attr]
    assert node_at(m, "val").mtime == 5.0  # type: ignore[union-attr]
    assert m.get(ROOT_INODE).mtime == 30.0  # type: ignore[union-attr]


def test_inode_numbers_do_not_depend_on_listing_order() -> None:
    base = Manifest(LISTING)
    expected = {p: n.inode for p, n in walk_paths(base).items()}
    rng = random.Random(3)
    for _ in range(20):
        shuffled = LISTING[:]
        rng.shuffle(shuffled)
        m = Manifest(shuffled)
        assert {p: n.inode for p, n in walk_paths(m).items()} == expected


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.lists(st.sampled_from(["a", "b", "c", "dd", "é", "日"]), min_size=1, max_size=4).map(
            "/".join
        ),
        max_size=25,
        unique=True,
    ),
    st.randoms(use_true_random=False),
)
def test_inode_numbers_property(keys: list[str], rnd: random.Random) -> None:
    listing = [obj(k, size=len(k)) for k in keys]
    a = Manifest(listing)
    shuffled = listing[:]
    rnd.shuffle(shuffled)
    b = Manifest(shuffled)
    pa, pb = walk_paths(a), walk_paths(b)
    assert {p: n.inode for p, n in pa.items()} == {p: n.inode for p, n in pb.items()}
    assert a.shadowed == b.shadowed
    # Every inode number is used once and get() returns that node.
    inodes = [n.inode for n in pa.values()]
    assert len(set(inodes)) == len(inodes)
    for p, n in pa.items():
        assert a.get(n.inode) is n
        assert a.path(n) == p
    # Visible files plus shadowed keys account for the whole listing.
    visible = {p for p, n in pa.items() if not n.is_dir}
    assert visible | set(a.shadowed) == set(keys)
    assert not visible & set(a.shadowed)
    assert a.files == len(visible)
    assert a.total_bytes == sum(len(k) for k in visible)


def test_readdir_order_is_sorted_bytes() -> None:
    names = ["b", "B", "a", "_", "Z", "10", "9", "é", "e", "a.b", "a-b"]
    m = Manifest([obj(f"d/{n}") for n in names])
    d = node_at(m, "d")
    assert d is not None
    assert d.names == sorted(n.encode() for n in names)
    assert d.names[0] == b"10" and d.names[-1] == "é".encode()


def test_lookup_dot_and_dotdot() -> None:
    m = Manifest(LISTING)
    root = m.get(ROOT_INODE)
    cats = node_at(m, "train/cats")
    train = node_at(m, "train")
    assert root is not None and cats is not None and train is not None
    assert m.lookup(cats.inode, b".") is cats
    assert m.lookup(cats.inode, b"..") is train
    assert m.lookup(train.inode, b"..") is root
    assert m.lookup(ROOT_INODE, b"..") is root  # the root is its own parent
    assert m.lookup(ROOT_INODE, b".") is root


def test_lookup_misses() -> None:
    m = Manifest(LISTING)
    readme = node_at(m, "README")
    assert readme is not None
    assert m.lookup(ROOT_INODE, b"nope") is None
    assert m.lookup(ROOT_INODE, b"train/cats") is None  # one component at a time
    assert m.lookup(readme.inode, b"x") is None  # a file has no children
    assert m.lookup(readme.inode, b".") is None
    assert m.lookup(10_000, b"x") is None
    assert m.get(0) is None and m.get(-1) is None and m.get(10_000) is None


def test_file_and_directory_prefix_the_directory_wins() -> None:
    m = Manifest([obj("a", 7, 50.0), obj("a/b", 3, 1.0), obj("c", 1)])
    a = node_at(m, "a")
    assert a is not None and a.is_dir and a.names == [b"b"]
    assert a.size == 0 and a.obj is None
    b = node_at(m, "a/b")
    assert b is not None and b.obj is not None and b.obj.key == "a/b"
    assert m.shadowed == ["a"]
    assert m.files == 2 and m.total_bytes == 3 + 1
    # The hidden file's mtime does not leak into the directory.
    assert a.mtime == 1.0


def test_shadowing_is_the_same_whatever_the_order() -> None:
    listing = [obj("x/y"), obj("x"), obj("x/y/z"), obj("x/w")]
    for order in (listing, listing[::-1]):
        m = Manifest(order)
        assert sorted(m.shadowed) == ["x", "x/y"]
        assert node_at(m, "x/y/z") is not None
        assert node_at(m, "x/w") is not None
        assert m.files == 2


def test_duplicate_keys_are_reported_once_visible() -> None:
    m = Manifest([obj("k", 1), obj("k", 2)])
    assert m.files == 1 and len(m.shadowed) == 1
    root = m.get(ROOT_INODE)
    assert root is not None and root.names == [b"k"]


def test_keys_no_path_can_name_are_left_out_and_reported() -> None:
    bad = ["a//b", "/lead", "./x", "d/../y", "d/.", "..", "nul\0byte"]
    good = [obj("d/ok", 4), obj("fine", 6)]
    m = Manifest([*good, *(obj(k) for k in bad)])
    paths = walk_paths(m)
    assert set(paths) == {"d", "d/ok", "fine"}
    for node in paths.values():
        assert node.name not in (b"", b".", b"..") and b"\0" not in node.name
    assert m.files == 2 and m.total_bytes == 10
    assert sorted(m.skipped) == sorted(bad)
    # '.' and '..' still mean the directory and its parent.
    d = node_at(m, "d")
    assert d is not None and m.lookup(d.inode, b"..") is m.get(ROOT_INODE)


def test_unicode_names() -> None:
    m = Manifest([obj("日本/ファイル.txt"), obj("ñ/ü 1.jpg")])
    f = node_at(m, "日本/ファイル.txt")
    assert f is not None and f.name == "ファイル.txt".encode()
    assert m.path(f) == "日本/ファイル.txt"
