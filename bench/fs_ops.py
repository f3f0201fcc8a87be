"""What one warm small file costs silofs's FUSE handlers, without FUSE: lookup, open, read, release.

Prints the mean Python cost of the four handlers a warm 110 KiB file needs (SilofsFS.lookup,
open, read of the whole file, release; all hits from a real LMDB env, values warm in the
page cache), best and median of several runs, and the same four handlers of the pyfuse3
ceiling (bench/rawfuse.py MemFS) for scale; then each handler's own thread CPU (median
over the runs after the first). It leaves out what FUSE itself costs (the kernel round
trip, pyfuse3's dispatch, trio's wakeups: bench/throughput.py measures those with the
real thing). A handler on FUSE starts with caches that the round trip before it (the
reply's copy, the reader's copy, the kernel, the reader) has used: --pollute KIB copies
that many KiB between any two handlers, outside the timings, to show what that costs
each one. --git-rev REV runs the same first with REV's silofs, in a process of its own
(tests/support/baseline.py):

    python bench/fs_ops.py [--files 2000] [--runs 7] [--pollute 256] [--git-rev HEAD~3]

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


HANDLERS = ("lookup", "open", "read", "release")


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


class Polluter:
    """Copies `kib` KiB between handlers (nothing if 0): what a FUSE round trip's copies
    do to the CPU's caches before the next handler runs."""

    def __init__(self, kib: int) -> None:
        self._src = bytearray(os.urandom(kib << 10))
        self._dst = bytearray(kib << 10)

    def __call__(self) -> None:
        if self._src:
            self._dst[:] = self._src


async def per_handler(
    fs: pyfuse3.Operations, names: list[bytes], parent: int, pollute: Polluter
) -> dict[str, float]:
    """Each handler's own thread CPU per file (us), `pollute` run before each handler."""
    ctx = None
    clock = time.thread_time_ns
    spent = dict.fromkeys(HANDLERS, 0)
    for name in names:
        pollute()
        t0 = clock()
        attr = await fs.lookup(parent, name, ctx)
        t1 = clock()
        pollute()
        t2 = clock()
        fi = await fs.open(attr.st_ino, os.O_RDONLY, ctx)
        t3 = clock()
        pollute()
        t4 = clock()
        assert len(await fs.read(fi.fh, 0, 112 << 10)) == SMALL
        t5 = clock()
        pollute()
        t6 = clock()
        await fs.release(fi.fh)
        t7 = clock()
        for h, ns in zip(HANDLERS, (t1 - t0, t3 - t2, t5 - t4, t7 - t6), strict=True):
            spent[h] += ns
    return {h: ns / len(names) / 1e3 for h, ns in spent.items()}


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


def retire(reader: ChunkReader) -> None:
    """End a fresh mount's read snapshot and close its descriptor of data.mdb, leaving
    the env open for the next fresh mount (one env per path per process)."""
    reader._cursor = None
    if reader._txn is not None:
        reader._txn.abort()
        reader._txn = None
    reader.pages.close()


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
    ap.add_argument(
        "--pollute",
        type=int,
        default=0,
        metavar="KIB",
        help="copy KIB KiB between handlers in the per-handler figures (outside their "
        "timings), as a FUSE round trip's copies use the caches: 256 is about a 110 KiB "
        "reply written and read",
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

        pollute = Polluter(args.pollute)

        async def run() -> tuple[list[float], list[float], list[dict[str, float]]]:
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
            # Per handler, each run a fresh mount's (every file looked up and decoded
            # once, as in a pass after a mount starts); the env stays open.
            handlers = []
            for _ in range(args.runs):
                view, fresh_reader, fs = fresh_mount(ro, record)
                small = view.lookup(ROOT_INODE, b"small")
                assert small is not None
                handlers.append(await per_handler(fs, names, small.inode, pollute))
                view.close()
                retire(fresh_reader)
            reader.close()
            return ours, theirs, handlers

        ours, theirs, handlers = trio.run(run)
        for who, fig in (("silofs", ours), ("ceiling (MemFS)", theirs)):
            print(
                f"{who:16} lookup+open+read+release of a warm 110 KiB file: "
                f"first {fig[0]:.1f} us, best {min(fig):.1f} us, "
                f"median {statistics.median(fig):.1f} us "
                f"({args.runs} runs of {args.files})"
            )
        later = handlers[1:] or handlers
        each = ", ".join(f"{h} {statistics.median(r[h] for r in later):.1f}" for h in HANDLERS)
        polluted = f", {args.pollute} KiB copied between handlers" if args.pollute else ""
        print(f"silofs per handler, us of thread CPU per file (fresh mounts{polluted}): {each}")


if __name__ == "__main__":
    main()
