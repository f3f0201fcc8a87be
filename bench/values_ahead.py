"""A sequential reader's cached big values, read ahead direct, in one process: no FUSE.

Prints, per pass, what a ChunkReader (silofs/mount/reader.py) does reading a cached file
of --values 4 MiB values from start to end in 1 MiB requests, as fs.py asks for them
(a hit on the serving thread if it can, else chunk(); read-ahead after each request),
with data.mdb's pages dropped from the page cache first (fadvise DONTNEED: no root, and
no other process's pages dropped): GB/s, the process's CPU-s, the values read direct
(mount/ahead.py), how many requests waited for their value's read, and how many direct
reads were in flight when each began (a wrapper around DirectFile.read). With --git-rev
REV each round runs REV's reader too, interleaved, each pass a fresh process; medians
and ranges at the end. Never changes silofs.

    python bench/values_ahead.py [--values 128] [--rounds 8] [--git-rev main]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import common  # noqa: F401 - this checkout (or a baseline) first on sys.path
import trio

from silofs.cache.format import ChunkRef, encode_chunk
from silofs.cache.store import CacheStore
from silofs.mount.reader import ChunkReader, OpenFile
from silofs.node.store_write import PendingChunk, WritableStore
from silofs.records import ObjectInfo
from tests.support import baseline

CHUNK = 4 << 20
REQUEST = 1 << 20


def big(values: int) -> ObjectInfo:
    return ObjectInfo("big.bin", values * CHUNK, 1.0, "v1", "cid-big")


def build(env: str, values: int) -> None:
    """An env caching `values` 4 MiB values of one object, written back to the disk."""
    os.makedirs(env)
    store = WritableStore(env, values * (CHUNK + (64 << 10)) + (64 << 20))
    obj, rng, usage = big(values), random.Random(1), {}
    for i in range(values):
        value = encode_chunk(1, i, CHUNK, obj.key, obj.content_id, rng.randbytes(CHUNK))
        item = PendingChunk(1, ChunkRef.of(obj, CHUNK, i).key, value, CHUNK)
        store.admit([item], usage, lambda _d, _u: 1 << 40)
    store.sync()
    store.close()


async def _never() -> None:
    raise AssertionError("every value is cached")


def one_pass(env: str, values: int) -> dict[str, float]:
    """One sequential read of the cached file, its pages dropped first."""
    fd = os.open(os.path.join(env, "data.mdb"), os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    size = os.path.getsize(os.path.join(env, "data.mdb"))
    r = ChunkReader(
        CacheStore(env, size + (64 << 20)),
        None,  # type: ignore[arg-type]  # hits never ask the daemon
        dataset_id=1,
        chunk_size=CHUNK,
        buffer_bytes=None,
        readahead_bytes=16 << 20,
        reregister=_never,
    )
    flights = {"now": 0, "sum": 0, "reads": 0}
    lock = threading.Lock()
    if r.direct is not None:
        real = r.direct.read

        def counted(*args):  # type: ignore[no-untyped-def]
            with lock:
                flights["now"] += 1
                flights["sum"] += flights["now"]
                flights["reads"] += 1
            try:
                return real(*args)
            finally:
                with lock:
                    flights["now"] -= 1

        r.direct.read = counted  # type: ignore[method-assign]
    obj, out = big(values), {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            r.start(nursery)
            f = OpenFile(obj)
            t0, c0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            served = 0
            for off in range(0, obj.size, REQUEST):
                end = off + REQUEST
                index, lo, hi = off // CHUNK, off % CHUNK, end - off // CHUNK * CHUNK
                r.begin_read()
                sequential = f.advance(off, end)
                view = r.hit(f, index, lo, hi)
                if view is None:
                    view, hit, _ = await r.chunk(f, index, lo, hi, kept=False)
                    assert hit
                served += len(view)
                if sequential:
                    r.prefetch(f, index)
            t1, c1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            cpu = c1.ru_utime - c0.ru_utime + c1.ru_stime - c0.ru_stime
            ahead = r.ahead
            out.update(
                gbps=served / (t1 - t0) / 1e9,
                cpu=cpu,
                direct=ahead.read if ahead else 0,
                waited=ahead.waited if ahead else 0,
                in_flight=flights["sum"] / max(1, flights["reads"]),
                corrupt=r.counters.corrupt_chunks,
            )
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        r.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--values", type=int, default=128, help="4 MiB values in the file")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--pass-of", metavar="ENV", help=argparse.SUPPRESS)
    baseline.add_argument(ap, "reader (interleaved, a process per pass)")
    args = ap.parse_args()
    if args.pass_of:  # one pass, in a process of its own
        print(json.dumps(one_pass(args.pass_of, args.values)))
        return
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="silofs-values-ahead-") as d:
        env = os.path.join(d, "env")
        build(env, args.values)
        argv = [__file__, "--values", str(args.values), "--pass-of", env]
        trees: list[tuple[str, Path | None]] = [("this tree", None)]
        other = baseline.baseline_tree(args.git_rev) if args.git_rev else nullcontext(None)
        with other as tree:
            if tree is not None:
                trees.append((baseline.describe(args.git_rev), tree))
            figures: dict[str, list[dict[str, float]]] = {name: [] for name, _ in trees}
            for _ in range(args.rounds):
                for name, t in trees:
                    run = (
                        subprocess.run([sys.executable, *argv], capture_output=True, check=True)
                        if t is None
                        else baseline.run(t, argv, capture_output=True, check=True)
                    )
                    fig = json.loads(run.stdout.decode().strip().splitlines()[-1])
                    figures[name].append(fig)
                    print(
                        f"{name:24} {fig['gbps']:.2f} GB/s  {fig['cpu']:.3f} CPU-s  "
                        f"read direct {fig['direct']:.0f}, waited {fig['waited']:.0f}, "
                        f"{fig['in_flight']:.2f} in flight at a read's start, "
                        f"damaged {fig['corrupt']:.0f}",
                        flush=True,
                    )
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    for name, figs in figures.items():
        parts = []
        for key, unit in (("gbps", "GB/s"), ("cpu", "CPU-s"), ("in_flight", "in flight")):
            xs = [f[key] for f in figs]
            parts.append(f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f}) {unit}")
        print(f"{name:24} median " + ", ".join(parts))


if __name__ == "__main__":
    main()
