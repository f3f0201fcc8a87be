"""An in-memory listing (the whole tree in dicts and lists), kept as the reference the
LMDB directory index must agree with (tests/unit/test_listing_view.py).

Owns nothing the product uses: the tree a mount served from memory, with the same
rules for directories, shadowed files and keys no path can name. Never imported by
silofs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from silofs.records import ObjectInfo

log = logging.getLogger(__name__)

ROOT_INODE = 1


class Node:
    __slots__ = ("inode", "parent", "name", "obj", "children", "names", "mtime", "size")

    def __init__(
        self, inode: int, parent: int, name: bytes, obj: ObjectInfo | None, mtime: float
    ) -> None:
        self.inode = inode
        self.parent = parent
        self.name = name
        self.obj = obj  # None for a directory
        self.children: dict[bytes, int] | None = None if obj else {}
        self.names: list[bytes] = []  # readdir order, filled by freeze()
        self.mtime = mtime
        self.size = obj.size if obj else 0

    @property
    def is_dir(self) -> bool:
        return self.obj is None


class InMemoryListing:
    def __init__(self, objects: Iterable[ObjectInfo]) -> None:
        self.nodes: list[Node | None] = [None]  # index = inode; inode 0 is unused
        self.total_bytes = 0
        self.files = 0
        self.shadowed: list[str] = []  # hidden behind a directory of the same name
        self.skipped: list[str] = []  # no path names them: empty, '.' or '..' parts, NUL
        root = Node(ROOT_INODE, ROOT_INODE, b"", None, 0.0)
        self.nodes.append(root)
        for obj in sorted(objects, key=lambda o: o.key):
            self._add(obj)
        self._freeze()
        if self.shadowed:
            log.warning(
                "%d keys are hidden behind a directory of the same name, e.g. %s",
                len(self.shadowed),
                self.shadowed[0],
            )
        if self.skipped:
            log.warning(
                "%d keys cannot be file paths (empty, '.' or '..' parts), e.g. %r",
                len(self.skipped),
                self.skipped[0],
            )

    def _new(self, parent: Node, name: bytes, obj: ObjectInfo | None, mtime: float) -> Node:
        node = Node(len(self.nodes), parent.inode, name, obj, mtime)
        self.nodes.append(node)
        assert parent.children is not None
        parent.children[name] = node.inode
        return node

    def _add(self, obj: ObjectInfo) -> None:
        parts = [p.encode() for p in obj.key.split("/")]
        if any(p in (b"", b".", b"..") or b"\0" in p for p in parts):
            # "a//b", "/a", "./a", "a/..": a directory entry named "", "." or ".." would
            # break readdir and lookup (and "." would make the tree a loop).
            self.skipped.append(obj.key)
            return
        cur = self.nodes[ROOT_INODE]
        for part in parts[:-1]:
            assert cur is not None and cur.children is not None
            ino = cur.children.get(part)
            child = self.nodes[ino] if ino else None
            if child is None:
                child = self._new(cur, part, None, obj.mtime)
            elif not child.is_dir:
                # A file "a" and a key "a/b": a directory must win or "a/b" is unreachable.
                self.shadowed.append(child.obj.key)  # type: ignore[union-attr]
                self.files -= 1
                self.total_bytes -= child.size
                child.obj, child.children, child.size = None, {}, 0
                child.mtime = 0.0  # a directory's mtime is its newest visible entry's
            child.mtime = max(child.mtime, obj.mtime)
            cur = child
        assert cur is not None and cur.children is not None
        if parts[-1] in cur.children:
            self.shadowed.append(obj.key)
            return
        self._new(cur, parts[-1], obj, obj.mtime)
        self.files += 1
        self.total_bytes += obj.size

    def _freeze(self) -> None:
        root = self.nodes[ROOT_INODE]
        assert root is not None
        root.mtime = max((n.mtime for n in self.nodes[2:] if n), default=0.0)
        for node in self.nodes[1:]:
            if node is not None and node.children is not None:
                node.names = sorted(node.children)

    def get(self, inode: int) -> Node | None:
        if 0 < inode < len(self.nodes):
            return self.nodes[inode]
        return None

    def lookup(self, parent: int, name: bytes) -> Node | None:
        node = self.get(parent)
        if node is None or node.children is None:
            return None
        if name == b".":
            return node
        if name == b"..":
            return self.get(node.parent)
        ino = node.children.get(name)
        return self.nodes[ino] if ino else None

    def path(self, node: Node) -> str:
        parts = []
        while node.inode != ROOT_INODE:
            parts.append(node.name.decode(errors="surrogateescape"))
            parent = self.nodes[node.parent]
            assert parent is not None
            node = parent
        return "/".join(reversed(parts))

    @property
    def inode_count(self) -> int:
        return len(self.nodes) - 1
