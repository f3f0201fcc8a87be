"""What checking each file as the peer costs an untrusted user's `silofs warm`, in-process.

A warm started by a user other than root or the admin group fetches only the local
files that user could read itself (node/warm.py `readable`: one path walk per object
with openat(O_PATH | O_NOFOLLOW) and fstat per component, as GET /v1/chunks checks it).
This script lists a local tree of --files small files in --dirs directories (warm in
the page cache), then times:

    check    `readable` over every object as uid --uid (the added planning cost)
    read     reading every file whole (what the warm then does for each: the floor of
             its fetch cost, without LMDB, limiter or daemon)

and prints microseconds per object, and the check as a share of the read. The check
runs once per warm, in a worker thread, before the first fetch.

    python bench/warm_access.py [--files 20000] [--dirs 100] [--size 4096] [--uid 65534]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from silofs.node.backends.base import BackendOptions  # noqa: E402
from silofs.node.backends.local import LocalBackend  # noqa: E402
from silofs.node.warm import readable  # noqa: E402
from silofs.uri import parse_uri  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=20_000)
    ap.add_argument("--dirs", type=int, default=100)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--uid", type=int, default=65534)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="silofs-warm-access-", dir="/tmp"))
    try:
        base.chmod(0o755)
        blob = os.urandom(args.size)
        for i in range(args.files):
            d = base / f"d{i % args.dirs:04d}"
            d.mkdir(mode=0o755, exist_ok=True)
            (d / f"f{i:07d}").write_bytes(blob)
        uri = parse_uri(str(base))
        backend = LocalBackend(uri, BackendOptions())
        objects = list(backend.list())
        ds = SimpleNamespace(backend=backend, uri=uri)
        gids = frozenset({args.uid})
        readable(ds, objects, args.uid, gids)  # warm the dentry and inode caches

        t0 = time.perf_counter()
        ok, denied = readable(ds, objects, args.uid, gids)  # type: ignore[arg-type]
        check = time.perf_counter() - t0
        t0 = time.perf_counter()
        for o in objects:
            backend.get_range(o, 0, o.size)
        read = time.perf_counter() - t0
        n = len(objects)
        print(f"{n} files of {args.size} B in {args.dirs} dirs, as uid {args.uid}")
        print(f"  check (readable): {check * 1e6 / n:7.1f} us/object, {check:.2f} s total")
        print(f"  read whole      : {read * 1e6 / n:7.1f} us/object, {read:.2f} s total")
        print(f"  check / read    : {check / read:.2f}  ({len(ok)} readable, {len(denied)} denied)")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
