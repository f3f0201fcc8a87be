"""Prefetch by hint: cold epoch time with and without hints, against a store with 20 ms
first-byte latency (tests/support/faultproxy.py in front of moto), 1 and 4 reader workers.

    python bench/hints.py [--files 400] [--size 110K] [--first-byte-ms 20]
                          [--io-limit 30MB/s] [--readers 1,4] [--window 256M]

Each pass is a fresh node (empty cache) and a fresh mount, the job's IO allocation set
first. The readers take files from one shared iterator over a shuffled order (as a
DataLoader's workers take indices from its sampler); in the hinted passes that iterator
is silofs.torch.PrefetchSampler's, which sends the order to the daemon when the epoch
begins (its time counts in the epoch). Prints per pass: seconds, MB/s, files/s, the rate
as a share of the IO allocation, and the prefetch figures; then hinted/unhinted ratios.
Reader threads stand in for DataLoader workers (torch is not needed: the sampler wrapper
never imports it); `--dataloader` reads through torch's DataLoader instead, `--readers`
worker processes, batches of 8. Needs FUSE and moto[server]; leaves no mount, daemon or
server behind.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from common import ROOT, check_fuse, drain, read_path

from silofs.control.client import ControlClient
from silofs.hints import Hinter
from silofs.node.prefetch import concurrency
from silofs.torch import PrefetchSampler
from silofs.units import parse_rate, parse_size
from tests.support.node import Node
from tests.support.servers import S3Server, start_moto

AWS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}


def start_proxy(upstream: str, first_byte_ms: float) -> tuple[subprocess.Popen, str]:
    """The fault proxy in a process of its own (its CPU is the store's, not the readers'),
    holding every response's first byte for `first_byte_ms`."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.faultproxy", "--upstream",
         upstream.removeprefix("http://"), "--first-byte-ms", str(first_byte_ms)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
    )  # fmt: skip
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def upload(server: S3Server, bucket: str, files: int, size: int) -> dict[str, int]:
    client = server.client()
    client.create_bucket(Bucket=bucket)
    rnd = random.Random(5)
    sizes = {}
    for i in range(files):
        n = rnd.randrange(size // 2, size * 3 // 2)
        key = f"train/c{i % 10}/img{i:05d}.jpg"
        client.put_object(Bucket=bucket, Key=key, Body=rnd.randbytes(n))
        sizes[key] = n
    return sizes


def store_ceiling(endpoint: str, bucket: str, keys: list[str], threads: int) -> float:
    """MB/s of whole-object GETs straight from boto3 through the proxy, `threads` at a
    time (as many as the daemon's prefetch keeps in flight): what the store allows."""
    import boto3
    from botocore.config import Config

    client = boto3.session.Session(
        aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
    ).client("s3", endpoint_url=endpoint, config=Config(max_pool_connections=threads))

    def get(key: str) -> int:
        return len(client.get_object(Bucket=bucket, Key=key)["Body"].read())

    t0 = time.perf_counter()
    total = drain(keys, get, threads)
    return total / (time.perf_counter() - t0) / 1e6


def epoch(paths: Iterator[str], readers: int) -> int:
    """Read every file `paths` yields with `readers` threads sharing the iterator."""
    return drain(paths, read_path, readers)


class Files:
    """A map-style dataset of whole files (module level: DataLoader workers pickle it)."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> int:
        with open(self.paths[i], "rb") as f:
            return len(f.read())


def dataloader_epoch(paths: list[str], sampler: Any, workers: int) -> int:
    """One epoch through torch's DataLoader with `workers` worker processes."""
    import warnings

    from torch.utils.data import DataLoader

    with warnings.catch_warnings():  # "4 workers on 2 cores": asked for on purpose
        warnings.simplefilter("ignore", UserWarning)
        loader = DataLoader(
            Files(paths), sampler=sampler, batch_size=8, num_workers=workers, collate_fn=sum
        )
        return sum(loader)


def one_pass(
    args: argparse.Namespace, base: Path, proxy_url: str, uri: str, keys: list[str],
    readers: int, hinted: bool,
) -> dict:  # fmt: skip
    root = base / f"r{readers}-{'hint' if hinted else 'plain'}"
    with Node(root, 2 << 30, env=AWS) as node:
        node.start()
        with ControlClient(node.socket) as c:  # the job's allocation, before its first miss
            c.request("PUT", "/v1/jobs/train/io", {"bytes_per_s": args.io_limit})
        mp = str(root / "mnt")
        node.mount(uri, mp, "--job", "train", "--endpoint-url", proxy_url)
        order = list(range(len(keys)))
        random.Random(readers).shuffle(order)
        paths = [os.path.join(mp, k) for k in keys]
        t0 = time.perf_counter()
        sampler: Any = order
        if hinted:
            hinter = Hinter(mp, socket=node.socket, window=args.window)
            sampler = PrefetchSampler(order, paths, mp, hinter=hinter)
        if args.dataloader:
            total = dataloader_epoch(paths, sampler, readers)
        else:
            total = epoch((paths[i] for i in sampler), readers)
        seconds = time.perf_counter() - t0
        m = node.settle(mp, total)
        job = node.job_status("train")
        node.unmount(mp)
        return {
            "readers": readers,
            "hinted": hinted,
            "seconds": seconds,
            "bytes": total,
            "files": len(keys),
            "hit_ratio": m["hit_ratio"],
            "remote_bytes": job["remote_bytes"],
            "remote_gets": job["remote_gets"],
            "prefetched_bytes": job["prefetched_bytes"],
            "prefetch_hit_chunks": job["prefetch_hit_chunks"],
            "prefetch_missed_chunks": job["prefetch_missed_chunks"],
            "limiter_wait_s": job["limiter_wait_s"],
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=400)
    ap.add_argument("--size", default="110K", help="mean file size (uniform 0.5x-1.5x)")
    ap.add_argument("--first-byte-ms", type=float, default=20.0)
    ap.add_argument("--io-limit", default="30MB/s", help="the job's remote IO allocation")
    ap.add_argument("--readers", default="1,4")
    ap.add_argument("--window", default="256M", help="the hint's window")
    ap.add_argument(
        "--dataloader",
        action="store_true",
        help="read through torch's DataLoader, --readers worker processes (needs torch)",
    )
    args = ap.parse_args()
    check_fuse()
    rate = parse_rate(args.io_limit)
    assert rate, "--io-limit must be a rate"
    with tempfile.TemporaryDirectory(prefix="silofs-hints-", dir="/var/tmp") as tmp:
        base = Path(tmp)
        moto = start_moto(log_path=base / "moto.log")
        proxy = None
        try:
            sizes = upload(moto, "hints", args.files, parse_size(args.size))
            proxy, proxy_url = start_proxy(moto.endpoint_url, args.first_byte_ms)
            keys = sorted(sizes)
            size = sum(sizes.values())
            print(
                f"dataset: {len(keys)} files, {size / 1e6:.1f} MB "
                f"(mean {size / len(keys) / 1e3:.0f} kB);"
                f" store: moto behind a {args.first_byte_ms:g} ms first-byte delay;"
                f" IO allocation {rate / 1e6:.0f} MB/s; window {args.window}"
            )
            print(
                f"{'readers':>7} {'hints':>5} {'seconds':>8} {'MB/s':>7} {'files/s':>8} "
                f"{'of alloc':>8} {'hit':>5} {'GETs':>5} {'prefetched MB':>13} "
                f"{'pf hits':>7} {'pf missed':>9} {'limiter s':>9}"
            )
            ceiling = store_ceiling(proxy_url, "hints", keys, concurrency(16))
            print(
                f"store ceiling: {ceiling:.1f} MB/s with {concurrency(16)} GETs in flight "
                "(boto3 through the proxy, the prefetch's concurrency)"
            )
            results = {}
            for readers in (int(r) for r in args.readers.split(",")):
                for hinted in (False, True):
                    r = one_pass(args, base, proxy_url, "s3://hints/", keys, readers, hinted)
                    results[(readers, hinted)] = r
                    mbs = r["bytes"] / r["seconds"] / 1e6
                    print(
                        f"{readers:>7} {'yes' if hinted else 'no':>5} {r['seconds']:>8.2f} "
                        f"{mbs:>7.1f} {r['files'] / r['seconds']:>8.0f} "
                        f"{r['bytes'] / r['seconds'] / rate:>8.2f} {r['hit_ratio']:>5.2f} "
                        f"{r['remote_gets']:>5} {r['prefetched_bytes'] / 1e6:>13.1f} "
                        f"{r['prefetch_hit_chunks']:>7} {r['prefetch_missed_chunks']:>9} "
                        f"{r['limiter_wait_s']:>9.2f}",
                        flush=True,
                    )
            for readers in sorted({k[0] for k in results}):
                plain, hint = results[(readers, False)], results[(readers, True)]
                print(
                    f"{readers} reader(s): hinted epoch {plain['seconds'] / hint['seconds']:.2f}x "
                    f"faster ({plain['seconds']:.2f}s -> {hint['seconds']:.2f}s); hinted rate "
                    f"{hint['bytes'] / hint['seconds'] / rate:.2f} of the allocation, "
                    f"{hint['bytes'] / hint['seconds'] / 1e6 / ceiling:.2f} of the store ceiling"
                )
        finally:
            if proxy is not None:
                proxy.terminate()
                proxy.wait(10)
            moto.stop()


if __name__ == "__main__":
    main()
