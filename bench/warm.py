"""`silofs warm` on a local dataset with a cache allocation of half its size, then one
full read through a mount: prints what the warm fetched and the hit ratio of the read.

    python bench/warm.py [--files 200] [--share 0.5]

Expected: fetched ~= share x dataset (not the whole dataset), hit ratio ~= share (the warm
took a uniform sample; a full dataset admits nothing more). Needs FUSE; cleans up after
itself (mount, daemon, temp dir).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from silofs.control.client import quote_segment  # noqa: E402
from tests.support.node import Node  # noqa: E402
from tests.support.trees import random_files, write_tree  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=200)
    ap.add_argument("--share", type=float, default=0.5)
    args = ap.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="silofs-warm-") as tmp,
        Node(Path(tmp) / "node", "1G") as node,
    ):
        root = Path(tmp)
        files = random_files(1, args.files, range(100_000, 300_000), "f{i:04d}.bin")
        data = write_tree(root / "data", files)
        size = sum(map(len, files.values()))
        node.start()
        uri = f"file://{data}/"
        share = int(size * args.share)
        node.request("PUT", f"/v1/datasets/{quote_segment(uri)}/cache", {"bytes": share})
        t0 = time.monotonic()
        res = node.run("warm", uri, "--job", "prep", "--socket", node.socket, timeout=600)
        print(res.stderr.strip() or res.stdout.strip(), f"[{time.monotonic() - t0:.1f}s]")
        mnt = node.mount(uri, root / "mnt", "--job", "train")
        total = sum(len(path.read_bytes()) for path in sorted(mnt.iterdir()))
        m = node.settle(mnt, total)
        node.unmount(mnt)
        d = node.status()["datasets"][0]
        w = d["warm"]
        print(
            f"dataset {size / 1e6:.1f} MB, allocation {share / 1e6:.1f} MB: warm fetched "
            f"{w['fetched_bytes'] / 1e6:.1f} MB, cached {d['cached_bytes'] / 1e6:.1f} MB; "
            f"full read {m['bytes_read'] / 1e6:.1f} MB, hit ratio {m['hit_ratio']:.3f} "
            f"(share {args.share:.3f}); served {m['served_bytes']}"
        )


if __name__ == "__main__":
    main()
