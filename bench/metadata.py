"""Metadata at scale: first listing, env bytes, mount start, lookups, mount memory.

Owns the metadata-at-scale figures, for this checkout and, with --git-rev, for another
revision's daemon and mounts on the same local tree in the same run:
  1. a local store tree of --objects files (default 1 M, 0-byte files in directories of
     1000, written once under --data-dir and reused): first-listing rate through the
     daemon (`silofs mount` of a new dataset), daemon peak RSS (VmHWM) while listing, env
     bytes per object, mount-ready time from the saved listing (`silofs mount` wall time),
     mount-process RSS after 10 k random stats (lookups/s) and after `find` over the tree;
  2. a generated listing of --generated objects (default 10 M; this checkout only)
     written with the daemon's own listing code (WritableStore.begin_listing,
     add_to_listing, finish_listing: the path backends feed), then the mount-ready time
     and mount RSS from it.
Never changes silofs; every daemon and mount it starts is private and gone at exit.
Run as root (FUSE, dropping dentries between phases):
    python bench/metadata.py [--objects 1000000] [--generated 10000000] [--git-rev REV]
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
from collections.abc import Iterator
from pathlib import Path

from common import check_fuse

from silofs.control.client import ControlClient
from tests.support import baseline
from tests.support.node import Node

PER_DIR = 1000


def proc_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def mib(kb: int) -> str:
    return f"{kb / 1024:,.0f} MiB"


def drop_dentries() -> None:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("2\n")
    except OSError:
        pass


def make_tree(root: Path, n: int) -> Path:
    tree = root / f"tree-{n}"
    done = tree / ".complete"
    if done.exists():
        return tree
    print(f"writing {n:,} empty files under {tree} (once) ...", flush=True)
    shutil.rmtree(tree, ignore_errors=True)
    for i in range(0, n, PER_DIR):
        d = tree / f"d{i // PER_DIR:05d}"
        d.mkdir(parents=True)
        for j in range(i, min(n, i + PER_DIR)):
            os.close(os.open(d / f"img_{j:08d}.jpg", os.O_CREAT | os.O_WRONLY, 0o644))
    done.touch()
    return tree


def tree_paths(n: int, k: int, rng: random.Random) -> list[str]:
    return [f"d{i // PER_DIR:05d}/img_{i:08d}.jpg" for i in rng.sample(range(n), min(k, n))]


def env_bytes(cache_dir: str) -> int:
    return os.stat(os.path.join(cache_dir, "data.mdb")).st_blocks * 512


def first_listing(node: Node, uri: str, n: int) -> dict:
    """POST the dataset and poll until listed, sampling the daemon's memory."""
    before = env_bytes(node.cache_dir)
    t0 = time.monotonic()
    anon = 0
    with ControlClient(node.socket, timeout=60) as c:
        ds = c.request("POST", "/v1/datasets", {"uri": uri, "refresh": False})
        while ds["state"] in ("checking", "listing"):
            time.sleep(0.2)
            anon = max(anon, proc_kb(node.daemon_pid, "RssAnon"))
            ds = c.request("GET", f"/v1/datasets/{ds['id']}")
    elapsed = time.monotonic() - t0
    if ds["state"] != "ready":
        raise RuntimeError(f"listing failed: {ds}")
    return {
        "list_s": elapsed,
        "list_rate": n / elapsed,
        "daemon_peak_kb": proc_kb(node.daemon_pid, "VmHWM"),
        "daemon_anon_kb": anon,  # sampled every 0.2 s while listing
        "env_per_obj": (env_bytes(node.cache_dir) - before) / n,
    }


def mount_figures(node: Node, uri: str, mp: str, paths: list[str], find: bool) -> dict:
    out: dict[str, float] = {}
    t0 = time.monotonic()
    node.mount(uri, mp)
    out["mount_s"] = time.monotonic() - t0
    pid = node.mount_pid(mp)
    # RssAnon: memory the mount process holds itself. Its RssFile is mostly LMDB pages
    # it faulted in, the node's shared page cache (readahead included), not per mount.
    out["rss_mounted_kb"] = proc_kb(pid, "RssAnon")
    out["file_mounted_kb"] = proc_kb(pid, "RssFile")
    drop_dentries()
    t0 = time.monotonic()
    for p in paths:
        os.stat(os.path.join(mp, p))
    el = time.monotonic() - t0
    # Each stat of a cold path is one FUSE LOOKUP per component not yet known.
    out["stats_per_s"] = len(paths) / el
    out["rss_lookups_kb"] = proc_kb(pid, "RssAnon")
    out["file_lookups_kb"] = proc_kb(pid, "RssFile")
    if find:
        t0 = time.monotonic()
        res = subprocess.run(["find", mp], capture_output=True, check=True)
        out["find_s"] = time.monotonic() - t0
        out["find_entries"] = res.stdout.count(b"\n")
        out["rss_find_kb"] = proc_kb(pid, "RssAnon")
        out["file_find_kb"] = proc_kb(pid, "RssFile")
    node.unmount(mp)
    return out


def run_tree(label: str, code: Path | None, work: Path, tree: Path, n: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix=f"{label}-", dir=work))
    rng = random.Random(1)
    paths = tree_paths(n, 10_000, rng)
    pythonpath = baseline.pythonpath(code) if code else []
    with Node(root, 8 << 30, pythonpath=pythonpath) as node:
        node.start()
        uri = f"file://{tree}/"
        fig = first_listing(node, uri, n)
        fig |= mount_figures(node, uri, str(root / "mnt"), paths, find=True)
        node.stop()
    shutil.rmtree(root, ignore_errors=True)
    return fig


def run_generated(work: Path, n: int) -> dict:
    """A generated listing written with the daemon's listing code, then mounted."""
    from silofs.cache.store import CacheStore
    from silofs.node.store_write import LISTING_BATCH, WritableStore, env_map_size
    from silofs.records import ObjectInfo

    root = Path(tempfile.mkdtemp(prefix="generated-", dir=work))
    empty = root / "bucket"
    empty.mkdir()
    uri = f"file://{empty}/"
    cache_size = 8 << 30
    (root / "cache").mkdir()
    store = WritableStore(str(root / "cache"), env_map_size(cache_size))
    dsid = store.dataset_id(uri, create=True)
    assert dsid is not None
    t0 = time.monotonic()
    b = store.begin_listing(dsid)
    batch: list[ObjectInfo] = []
    for i in range(n):
        key = f"shard{i // 1_000_000:03d}/d{i // PER_DIR:05d}/img_{i:08d}.jpg"
        batch.append(ObjectInfo(key, 110_000, 1.7e9 + i, f"etag{i:x}", f"etag{i:x}-110000"))
        if len(batch) >= LISTING_BATCH:
            store.add_to_listing(b, batch)
            batch = []
    store.add_to_listing(b, batch)
    store.finish_listing(b, {"uri": uri, "listed_at": time.time()})
    fig: dict[str, float] = {"write_s": time.monotonic() - t0}
    fig["env_per_obj"] = env_bytes(str(root / "cache")) / n
    store.close()
    # The part of mount start that depends on the listing: open the env read-only, read
    # the record, look up one path (the rest is two Python interpreters starting).
    from silofs.mount.listing_view import ListingView

    t0 = time.monotonic()
    ro = CacheStore(str(root / "cache"), env_map_size(cache_size))
    m = ListingView(ro, dsid, ro.dataset_record(dsid))
    ino = 1
    for part in (b"shard009", b"d09999", b"img_09999999.jpg"):
        e = m.lookup(ino, part)
        ino = e.inode if e else 0
    fig["open_s"] = time.monotonic() - t0
    m.close()
    ro.close()
    rng = random.Random(2)
    idx = rng.sample(range(n), min(n, 10_000))
    paths = [f"shard{i // 1_000_000:03d}/d{i // PER_DIR:05d}/img_{i:08d}.jpg" for i in idx]
    with Node(root, cache_size) as node:
        node.start()
        fig |= mount_figures(node, uri, str(root / "mnt"), paths, find=False)
        node.stop()
    shutil.rmtree(root, ignore_errors=True)
    return fig


def run_refresh(work: Path, n: int) -> dict:
    """A refresh of `n` generated objects with 1% changed, 0.5% new and 0.5% deleted,
    through the daemon's listing code: delete stale rows, write, swap."""
    from silofs.node.store_write import LISTING_BATCH, WritableStore, env_map_size
    from silofs.records import ObjectInfo

    root = Path(tempfile.mkdtemp(prefix="refresh-", dir=work))
    store = WritableStore(str(root), env_map_size(4 << 30))
    dsid = store.dataset_id("file:///refresh/", create=True)
    assert dsid is not None

    def listing(gen: int) -> Iterator[ObjectInfo]:
        for i in range(n + (n // 200 if gen else 0)):
            if gen and i % 200 == 7:
                continue  # deleted
            v = f"e{i:x}" + ("-2" if gen and i % 100 == 3 else "")
            key = f"d{i // PER_DIR:05d}/img_{i:08d}.jpg"
            yield ObjectInfo(key, 110_000, 1.7e9 + i, v, v)

    def relist(gen: int) -> float:
        t0 = time.monotonic()
        current = store.current_generation(dsid)
        keep = {current} if current is not None else set()
        while store.delete_stale_generations(dsid, keep) >= LISTING_BATCH:
            pass
        b = store.begin_listing(dsid)
        batch: list[ObjectInfo] = []
        for o in listing(gen):
            batch.append(o)
            if len(batch) >= LISTING_BATCH:
                store.add_to_listing(b, batch)
                batch = []
        store.add_to_listing(b, batch)
        store.finish_listing(b, {"listed_at": time.time()})
        return time.monotonic() - t0

    first = relist(0)
    second = relist(1)
    third = relist(1)  # also deletes the first generation's rows
    store.close()
    shutil.rmtree(root, ignore_errors=True)
    return {"first_s": first, "refresh_s": second, "refresh_delete_s": third}


def show(label: str, f: dict) -> None:
    def g(k: str, fmt: str) -> str:
        return fmt.format(f[k]) if k in f else "-"

    print(f"  {label}")
    if "refresh_s" in f:
        print(
            f"    first listing       {f['first_s']:.1f} s; refresh (1% changed) "
            f"{f['refresh_s']:.1f} s; refresh that also deletes a generation "
            f"{f['refresh_delete_s']:.1f} s"
        )
        return
    if "list_s" in f:
        print(
            f"    first listing       {g('list_s', '{:.1f}')} s  "
            f"({g('list_rate', '{:,.0f}')} objects/s), daemon peak RSS "
            f"{mib(int(f['daemon_peak_kb']))} (private, sampled: "
            f"{mib(int(f['daemon_anon_kb']))})"
        )
    if "write_s" in f:
        print(f"    listing written     {g('write_s', '{:.1f}')} s (daemon batch path)")
    print(f"    env bytes/object    {g('env_per_obj', '{:.0f}')}")
    print(f"    mount ready         {g('mount_s', '{:.2f}')} s (`silofs mount` wall time)")
    if "open_s" in f:
        print(f"    listing open        {f['open_s'] * 1000:.1f} ms (env + record + one lookup)")
    print(
        f"    mount RSS           {mib(int(f['rss_mounted_kb']))} private "
        f"(+{mib(int(f['file_mounted_kb']))} shared env pages) after mounting"
    )
    print(
        f"    10k random stats    {g('stats_per_s', '{:,.0f}')} paths/s, "
        f"RSS {mib(int(f['rss_lookups_kb']))} private (+{mib(int(f['file_lookups_kb']))})"
    )
    if "find_s" in f:
        print(
            f"    find (whole tree)   {g('find_s', '{:.1f}')} s, {int(f['find_entries']):,} "
            f"entries, RSS {mib(int(f['rss_find_kb']))} private (+{mib(int(f['file_find_kb']))})"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--objects", type=int, default=1_000_000, help="files in the local tree")
    ap.add_argument("--generated", type=int, default=10_000_000, help="0: skip")
    ap.add_argument("--refresh-objects", type=int, default=1_000_000, help="0: skip")
    ap.add_argument("--data-dir", default="/var/tmp/silofs-bench-meta")
    baseline.add_argument(ap, "daemon and mounts on the local tree")
    args = ap.parse_args()
    check_fuse()
    data = Path(args.data_dir)
    data.mkdir(parents=True, exist_ok=True)
    tree = make_tree(data, args.objects)
    results: list[tuple[str, dict]] = []
    if args.git_rev:
        name = baseline.describe(args.git_rev)
        print(f"baseline {name}: {args.objects:,} objects ...", flush=True)
        with baseline.baseline_tree(args.git_rev) as code:
            fig = run_tree("base", code, data, tree, args.objects)
        results.append((f"baseline {name}, {args.objects:,} objects", fig))
    print(f"this checkout: {args.objects:,} objects ...", flush=True)
    results.append(
        (
            f"this checkout, {args.objects:,} objects",
            run_tree("this", None, data, tree, args.objects),
        )
    )
    if args.generated:
        print(f"this checkout: generated listing of {args.generated:,} objects ...", flush=True)
        results.append(
            (f"this checkout, generated {args.generated:,}", run_generated(data, args.generated))
        )
    if args.refresh_objects:
        print(f"this checkout: refresh of {args.refresh_objects:,} objects ...", flush=True)
        results.append(
            (
                f"this checkout, refresh of {args.refresh_objects:,}",
                run_refresh(data, args.refresh_objects),
            )
        )
    print()
    for label, fig in results:
        show(label, fig)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
