"""What checking each file as the peer costs an untrusted user's `silofs warm`, in-process.

A warm started by a user other than root or the admin group fetches only the local
files that user could read itself (node/warm.py `readable`). This script lists a local
tree of --files small files in --dirs directories (warm in the page cache), then times,
in one run:

    per object   check_peer_read of every object: a path walk from "/" per object
                 (openat(O_PATH | O_NOFOLLOW), fstat, getxattr per component), what
                 `readable` did before
    per dir      `readable`: check_peer_read_many, one walk per directory and an openat
                 per file through the directory's fd (what a warm does now)
    read         reading every file whole (what the warm then does for each: the floor
                 of its fetch cost, without LMDB, limiter or daemon)

and prints microseconds per object, wall and CPU (the host is shared: CPU is the steadier
figure), and the ratio of the two checks. The check runs once per warm, in a worker
thread, before the first fetch.

    python bench/warm_access.py [--files 20000] [--dirs 100] [--size 4096] [--uid 65534]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
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

        n = len(objects)

        def timed(fn: Callable[[], object]) -> tuple[float, float]:
            w0, c0 = time.perf_counter(), time.thread_time()
            fn()
            return time.perf_counter() - w0, time.thread_time() - c0

        def per_object() -> None:
            for o in objects:
                backend.check_peer_read(o, args.uid, gids)

        result: list[tuple[list, list]] = []
        old = timed(per_object)
        new = timed(lambda: result.append(readable(ds, objects, args.uid, gids)))  # type: ignore[arg-type]
        read = timed(lambda: [backend.get_range(o, 0, o.size) for o in objects])
        ok, denied = result[0]
        print(f"{n} files of {args.size} B in {args.dirs} dirs, as uid {args.uid}")
        for name, (wall, cpu) in (("per object", old), ("per dir", new), ("read whole", read)):
            print(
                f"  {name:<11}: {wall * 1e6 / n:7.1f} us/object wall, "
                f"{cpu * 1e6 / n:7.1f} us CPU ({wall:.2f} s wall)"
            )
        print(
            f"  per object / per dir: {old[0] / new[0]:.1f}x wall, {old[1] / new[1]:.1f}x CPU; "
            f"per dir / read: {new[1] / read[1]:.2f} CPU  ({len(ok)} readable, "
            f"{len(denied)} denied)"
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
