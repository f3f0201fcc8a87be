"""What one warm small file costs silofs's FUSE handlers, without FUSE: lookup, open, read, release.

Prints the mean Python cost of the four handlers a warm 110 KiB file needs (SilofsFS.lookup,
open, read of the whole file, release; all hits from a real LMDB env, values warm in the
page cache), best and median of several runs, and the same four handlers of the pyfuse3
ceiling (bench/rawfuse.py MemFS) for scale. It leaves out what FUSE itself costs (the
kernel round trip, pyfuse3's dispatch, trio's wakeups: bench/throughput.py measures those
with the real thing). --git-rev REV runs the same first with REV's silofs, in a process
of its own (tests/support/baseline.py):

    python bench/fs_ops.py [--files 2000] [--runs 7] [--git-rev HEAD~3]

Needs no root and no FUSE; the env lives in a temp dir.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import common  # noqa: F401 - this checkout (or a baseline) first on sys.path
import pyfuse3
import trio
from rawfuse import MemFS

from silofs.cache.format import ChunkRef, encode_chunk
from silofs.cache.store import CacheStore
from silofs.mount.fs import Presentation, SilofsFS
from silofs.mount.listing_view import ROOT_INODE, ListingView
from silofs.mount.reader import ChunkReader
from silofs.node.store_write import PendingChunk, WritableStore
from silofs.records import ObjectInfo
from tests.support import baseline

SMALL = 110 << 10
CHUNK = 4 << 20


async def _never() -> None:
    raise AssertionError("a hit never re-registers")


async def per_file(fs: pyfuse3.Operations, names: list[bytes], parent: int) -> float:
    """Seconds for lookup + open + read + release of every name once."""
    ctx = None
    t0 = time.perf_counter()
    for name in names:
        attr = await fs.lookup(parent, name, ctx)
        fi = await fs.open(attr.st_ino, os.O_RDONLY, ctx)
        data = await fs.read(fi.fh, 0, 112 << 10)
        assert len(data) == SMALL
        await fs.release(fi.fh)
    return time.perf_counter() - t0


def cached_files(d: str, files: int, with_tree: bool = False) -> tuple[dict, list[bytes]]:
    """An env in d/env caching `files` 110 KiB files listed under small/ (with
    `with_tree`, the same bytes as files under d/tree/small too, for the ceiling): the
    listing's record and the files' names."""
    env, tree = os.path.join(d, "env"), os.path.join(d, "tree", "small")
    os.makedirs(env)
    store = WritableStore(env, 1 << 30)
    objs = [ObjectInfo(f"small/{i:06d}.bin", SMALL, 100.0, f"v{i}", f"c{i}") for i in range(files)]
    body = os.urandom(SMALL)
    pending = []
    for o in objs:
        value = encode_chunk(1, 0, CHUNK, o.key, o.content_id, body)
        pending.append(PendingChunk(1, ChunkRef.of(o, CHUNK, 0).key, value, SMALL))
    if with_tree:
        os.makedirs(tree)
        for o in objs:
            with open(os.path.join(tree, o.key.split("/")[1]), "wb") as f:
                f.write(body)
    store.admit(pending, {}, lambda _d, _u: 1 << 40)
    record = store.replace_listing(1, objs, {"uri": "file:///bench/"})
    store.close()
    return record, [o.key.split("/")[1].encode() for o in objs]


def fresh_mount(store: CacheStore, record: dict) -> tuple[ListingView, ChunkReader, SilofsFS]:
    """A mount's handlers over `store` as a fresh mount has them: empty caches."""
    view = ListingView(store, 1, record)
    reader = ChunkReader(
        store,
        None,  # type: ignore[arg-type]  # hits never ask the daemon
        dataset_id=1,
        chunk_size=CHUNK,
        buffer_bytes=CHUNK,
        readahead_bytes=4 * CHUNK,
        reregister=_never,
    )
    return view, reader, SilofsFS(view, reader, Presentation(0, 0, 0o444, 0o555, 3600.0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument(
        "--drop",
        action="store_true",
        help="drop the page cache after writing the env (needs root): the first run then "
        "reads the env from disk, as a fresh mount after drop_caches does",
    )
    baseline.add_argument(ap, "handlers (run first, in a process of their own)")
    args = ap.parse_args()
    if args.git_rev:
        baseline.run_self_first(args.git_rev, __file__)
    with tempfile.TemporaryDirectory(prefix="silofs-fsops-") as d:
        record, names = cached_files(d, args.files, with_tree=True)
        if args.drop:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        ro = CacheStore(os.path.join(d, "env"), 1 << 30)

        async def run() -> tuple[list[float], list[float]]:
            view, reader, fs = fresh_mount(ro, record)
            small = view.lookup(ROOT_INODE, b"small")
            assert small is not None
            raw = MemFS(os.path.join(d, "tree"))
            raw_small = raw.children[pyfuse3.ROOT_INODE][b"small"]
            ours, theirs = [], []
            for _ in range(args.runs):
                ours.append(await per_file(fs, names, small.inode) / args.files * 1e6)
                theirs.append(await per_file(raw, names, raw_small) / args.files * 1e6)
            view.close()
            reader.close()
            return ours, theirs

        ours, theirs = trio.run(run)
        for who, fig in (("silofs", ours), ("ceiling (MemFS)", theirs)):
            print(
                f"{who:16} lookup+open+read+release of a warm 110 KiB file: "
                f"first {fig[0]:.1f} us, best {min(fig):.1f} us, "
                f"median {statistics.median(fig):.1f} us "
                f"({args.runs} runs of {args.files})"
            )


if __name__ == "__main__":
    main()
