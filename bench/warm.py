"""`silofs warm` on a local dataset with a cache allocation of half its size, then one
full read through a mount: prints what the warm fetched and the hit ratio of the read.

    python bench/warm.py [--files 200] [--share 0.5]

Expected: fetched ~= share x dataset (not the whole dataset), hit ratio ~= share (the warm
took a uniform sample; a full dataset admits nothing more). Needs FUSE; cleans up after
itself (mount, daemon, temp dir).
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from silofs.control.client import ControlClient, ControlError, quote_segment


def silofs(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "silofs", *args], env=env, capture_output=True, text=True
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=200)
    ap.add_argument("--share", type=float, default=0.5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="silofs-warm-") as tmp:
        root = Path(tmp)
        data, mnt, sock = root / "data", root / "mnt", str(root / "ctl.sock")
        data.mkdir()
        mnt.mkdir()
        rnd = random.Random(1)
        size = 0
        for i in range(args.files):
            blob = rnd.randbytes(rnd.randrange(100_000, 300_000))
            (data / f"f{i:04d}.bin").write_bytes(blob)
            size += len(blob)
        env = {**os.environ, "SILOFS_SOCKET": sock, "SILOFS_LOG_DIR": str(root)}
        daemon = subprocess.Popen(
            [sys.executable, "-m", "silofs", "daemon", "--cache-dir", str(root / "cache"),
             "--cache-size", "1G"],
            env=env, stderr=open(root / "daemon.log", "w"),
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    with ControlClient(sock) as c:
                        c.request("GET", "/v1/status")
                    break
                except ControlError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            uri = f"file://{data}/"
            share = int(size * args.share)
            with ControlClient(sock) as c:
                c.request("PUT", f"/v1/datasets/{quote_segment(uri)}/cache", {"bytes": share})
            t0 = time.monotonic()
            res = silofs("warm", uri, "--job", "prep", env=env)
            print(res.stderr.strip() or res.stdout.strip(), f"[{time.monotonic() - t0:.1f}s]")
            res = silofs("mount", uri, str(mnt), "--job", "train", env=env)
            assert res.returncode == 0, res.stderr
            total = 0
            try:
                for path in sorted(mnt.iterdir()):
                    total += len(path.read_bytes())
                with ControlClient(sock) as c:
                    while True:
                        status = c.request("GET", "/v1/status")
                        m = status["mounts"][0]
                        if m["bytes_read"] >= total:
                            break
                        time.sleep(0.05)
            finally:
                silofs("unmount", str(mnt), env=env)
            d = status["datasets"][0]
            w = d["warm"]
            print(
                f"dataset {size / 1e6:.1f} MB, allocation {share / 1e6:.1f} MB: warm fetched "
                f"{w['fetched_bytes'] / 1e6:.1f} MB, cached {d['cached_bytes'] / 1e6:.1f} MB; "
                f"full read {m['bytes_read'] / 1e6:.1f} MB, hit ratio {m['hit_ratio']:.3f} "
                f"(share {args.share:.3f}); served {m['served_bytes']}"
            )
        finally:
            daemon.terminate()
            daemon.wait(30)


if __name__ == "__main__":
    main()
