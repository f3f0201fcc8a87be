"""Listing rows in-process: write rate, env bytes per object, lookups/s, walk entries/s.

Owns the in-process half of issue 10's "env bytes per object" and "find" figures (the
FUSE half is bench/metadata.py): a generated listing of --objects files (S3-like: a
32-hex ETag version, content id "s3:ETAG:size", directories of 1000) written with the
daemon's batch code (CacheStore.begin_listing/add_to_listing/finish_listing; objects
written per second, the objects made before timing), then
--lookups random path lookups through the mount's ListingView (two levels, the entry cache
kept small so each lookup reads LMDB) and a walk of every directory with the attributes
READDIRPLUS needs. Each checkout named runs in its own interpreter with that checkout
first on sys.path; the best of three rounds is printed. Never changes silofs.
    python bench/listing_rows.py [--objects 200000] [--lookups 20000] [CHECKOUT ...]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PER_DIR = 1000


def measure(n: int, lookups: int) -> None:
    """In the checkout's interpreter: build, then time lookups and a walk."""
    from silofs.node.store_write import LISTING_BATCH, WritableStore, env_map_size

    try:  # as the daemon runs (a checkout from before stop 21 has no tune_gc)
        from silofs.node.service import tune_gc

        tune_gc()
    except ImportError:
        pass
    from silofs.mount.listing_view import ListingView
    from silofs.records import ObjectInfo

    d = tempfile.mkdtemp(prefix="listing-rows-", dir="/var/tmp")
    try:
        s = WritableStore(d, env_map_size(max(2 << 30, n * 1024)))  # ~320-450 B per object
        dsid = s.dataset_id("file:///bench/", create=True)
        assert dsid is not None
        b = s.begin_listing(dsid)
        objs: list[ObjectInfo] = []
        for i in range(n):
            v = f"{i:032x}"
            key = f"d{i // PER_DIR:05d}/img_{i:08d}.jpg"
            objs.append(ObjectInfo(key, 110_000, 1.7e9 + i, v, f"s3:{v}:110000"))
        t = time.perf_counter()
        for i in range(0, n, LISTING_BATCH):
            s.add_to_listing(b, objs[i : i + LISTING_BATCH])
        rec = s.finish_listing(b, {"uri": "file:///bench/"})
        write = n / (time.perf_counter() - t)
        del objs
        per_obj = os.stat(os.path.join(d, "data.mdb")).st_blocks * 512 / n
        idx = random.Random(1).sample(range(n), min(lookups, n))
        best_look = best_walk = 0.0
        for _ in range(3):
            m = ListingView(s, dsid, rec, cache_entries=16)
            t = time.perf_counter()
            for i in idx:
                m.renew()
                dnode = m.lookup(1, f"d{i // PER_DIR:05d}".encode())
                assert dnode is not None
                e = m.lookup(dnode.inode, f"img_{i:08d}.jpg".encode())
                assert e is not None and e.size == 110_000
            best_look = max(best_look, len(idx) / (time.perf_counter() - t))
            t, seen = time.perf_counter(), 0
            txn = m.txn
            entries = getattr(m.reader, "entries", None)
            for _, _, dino in m.reader.children(txn, 1):
                if entries is not None:  # attributes from the directory's rows
                    for _, _, ino, e in entries(txn, dino):
                        if e is None:
                            e = m.reader.get(txn, ino)
                        seen += 1
                else:  # before: one inodes get per entry
                    for _, _, ino in m.reader.children(txn, dino):
                        m.reader.get(txn, ino)
                        seen += 1
            assert seen == n
            best_walk = max(best_walk, seen / (time.perf_counter() - t))
            m.close()
        s.close()
        print(f"{write:.0f} {per_obj:.0f} {best_look:.0f} {best_walk:.0f}")
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--objects", type=int, default=200_000)
    ap.add_argument("--lookups", type=int, default=20_000)
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("checkouts", nargs="*", default=[str(ROOT)])
    args = ap.parse_args()
    if args.measure:
        measure(args.objects, args.lookups)
        return
    print(f"{args.objects:,} objects in directories of {PER_DIR}; best of 3 rounds")
    print(
        f"{'checkout':<40} {'written/s':>10} {'env B/object':>12} {'lookups/s':>10} "
        f"{'walk entries/s':>15}"
    )
    for code in args.checkouts:
        rev = subprocess.run(
            ["git", "-C", code, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        out = subprocess.run(
            [sys.executable, __file__, "--measure", "--objects", str(args.objects),
             "--lookups", str(args.lookups)],
            capture_output=True, text=True, check=True, cwd="/",
            env={**os.environ, "PYTHONPATH": code},
        ).stdout.split()  # fmt: skip
        write, per_obj, look, walk = (float(x) for x in out[-4:])
        label = f"{code} ({rev})"
        print(
            f"{label:<40} {write:>10,.0f} {per_obj:>12,.0f} {look:>10,.0f} {walk:>15,.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
