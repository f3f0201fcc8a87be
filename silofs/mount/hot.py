"""A kept small file's hot record: what a warm hit of it needs, made once.

A file listed when the mount started, of one chunk of at most ChunkReader.whole_max
bytes, opened while no handle of another version of it is counted, is opened again and
again the same way: the same ObjectInfo and chunk ref, the same FileInfo (its pages
kept), and read whole from the same LMDB value at the same place. fs.open() makes one
HotFile per such inode on its first open (SilofsFS._hot), each handle opened from it
carries it (OpenFile.hot), and ChunkReader.whole() fills in where the value lies and
what it holds the first time it serves it (`placed`). From then on OPEN, READ and
RELEASE of that file are a few attribute loads and two integer compares each.

Two guards, one integer compare each, decide whether a record may be used at all:

- `epoch` against SilofsFS._epoch: bumped by every switch() (a relist, a version
  change, the listing completed), which also empties SilofsFS._hot. What OPEN and
  RELEASE skip for a hot handle (the version counts, direct_io, the paged sizes, the
  handle's listing generation) holds only within one listing generation.
- `placed` against ChunkReader._placed: bumped whenever the read snapshot the reader
  begins is not the one the location was found in as far as LMDB can tell (another
  committed write txn: an admission, an eviction, an allocation's shrink, a delete of
  a dataset) or the map moved (a remap). Within one txn id nothing in data.mdb was
  committed, so no page was freed or reused: the value is where it was found.

Neither guard is what keeps a wrong byte from a reader: every read still copies the
header and the whole data out of the map into buffers of the mount's own, after
mincore says every page is in the page cache, and checks that copy (the header byte
for byte the one checked in full when the record was filled, and every block's xxh3
against that header's sums) before serving it, as whole() always did. A record that
is stale but passes its guard (a page rewritten under the mount) therefore fails its
check and the read goes the general way (hit(), chunk(): the damage is counted and the
chunk refetched). Permissions are the kernel's (default_permissions) and the daemon's
(misses only): nothing in a record decides who may read.
"""

from __future__ import annotations

from collections.abc import Callable

from silofs.cache.format import ChunkRef
from silofs.mount.listing_view import Entry
from silofs.records import ObjectInfo


class HotFile:
    """One kept file's record (module docstring). Slots: every field is read on the hit
    path; the location fields are written once per `placed`."""

    __slots__ = (
        "epoch",
        "node",
        "inode",
        "obj",
        "ref",
        "gen",
        "size",
        "placed",
        "at",
        "mid",
        "end",
        "page",
        "span",
        "pages",
        "head",
        "data",
        "blocks",
        "pack",
        "header",
        "sums",
    )

    def __init__(self, epoch: int, node: Entry, ref: ChunkRef, gen: int) -> None:
        self.epoch = epoch  # SilofsFS._epoch when made
        self.node = node  # the listing's entry (switch() compares it with the next)
        self.inode = node.inode
        self.obj: ObjectInfo = ref.obj
        self.ref = ref  # chunk 0 (ChunkRef.of), whose value whole() reads
        self.gen = gen  # the listing generation its handles are opened in
        self.size = ref.obj.size
        # Where the value lies and what it holds, as whole() last found and checked it
        # in a snapshot of ChunkReader._placed == placed (0: never yet, or stale).
        self.placed = 0
        self.at = self.mid = self.end = 0  # header, data, end: offsets in the map
        self.page = self.span = self.pages = 0  # mincore's range of it
        self.head = bytearray()  # the header's copy (whole()'s plan: one per size)
        self.data: memoryview = memoryview(b"")  # the data's copy (the scratch buffer)
        self.blocks: list[memoryview] = []  # data's 64 KiB blocks
        self.pack: Callable[..., bytes] | None = None  # packs their sums
        self.header = b""  # the header as checked in full
        self.sums = b""  # the block sums it holds, packed
