"""What verifying every served byte costs on the mount's hit path, in-process.

The hit path of one FUSE read is: renew the LMDB read txn, get the chunk's value as a
memoryview, verify, slice the requested bytes. This script times exactly that, with the
values warm in the page cache (no FUSE, no daemon), for:

    128 KiB and 1 MiB requests inside a 4 MiB chunk (a large file read sequentially)
    one 110 KiB small file read whole (one chunk, one request)

and three ways of verifying:

    before      format 1 as the mount used it: the whole chunk checked once per open
                handle, later requests served unchecked (cost of a later request shown;
                for a small file, read once per open, the one check is in every read)
    whole       the whole 4 MiB chunk checked on every request (what the issue measured
                at +40%: shown for scale)
    after       format 2: header and the 64 KiB blocks the request covers, every request

It prints microseconds per request (median of --repeat runs), the added cost, and the
ratio; and the added cost as a share of one FUSE request (60-80 us of Python measured in
bench/README.md). Run: python bench/verify_cost.py [--repeat 7] [--n 2000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import struct
import tempfile
import time
from collections.abc import Callable

import lmdb
import xxhash

from silofs.cache.format import ChunkRef, checked_chunk, chunk_key, encode_chunk
from silofs.records import ObjectInfo

CHUNK = 4 << 20
SMALL = 110 << 10
FUSE_REQUEST_US = 70.0  # middle of the 60-80 us measured per FUSE request


class Counts:
    corrupt_chunks = 0


def encode_v1(index: int, cid: str, data: bytes) -> bytes:
    """A format-1 value (one xxh3_64 over header and data), as the old code wrote it."""
    k, c = b"key", cid.encode()
    var = struct.pack("<H", len(k)) + k + struct.pack("<H", len(c)) + c
    fixed = struct.pack("<4sHHQQQIQ", b"SLFC", 1, 44 + len(var), 1, index, CHUNK, len(data), 0)
    h = xxhash.xxh3_64(fixed)
    h.update(var)
    h.update(data)
    return fixed[:36] + struct.pack("<Q", h.intdigest()) + var + data


def verify_v1(value: memoryview, length: int) -> memoryview:
    """Format 1's check: the whole value hashed (header fields parsed as before)."""
    (checksum,) = struct.unpack_from("<Q", value, 36)
    h = xxhash.xxh3_64(value[:36])
    h.update(b"\0" * 8)
    h.update(value[44:])
    if h.intdigest() != checksum:
        raise ValueError("checksum")
    return value[len(value) - length :]


def timed(fn: Callable[[], object], n: int, repeat: int) -> float:
    """Median microseconds per call."""
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter_ns() - t0) / n / 1000)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--n", type=int, default=2000, help="requests per run")
    args = ap.parse_args()

    big = os.urandom(CHUNK)
    small = os.urandom(SMALL)
    big_obj = ObjectInfo("big.bin", 16 * CHUNK, 0.0, "v", "cid-big")
    small_obj = ObjectInfo("small.bin", SMALL, 0.0, "v", "cid-small")
    big_ref = ChunkRef.of(big_obj, CHUNK, 1)
    small_ref = ChunkRef.of(small_obj, CHUNK, 0)
    k1_big, k1_small = b"v1-big" + bytes(10), b"v1-small" + bytes(8)

    with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
        env = lmdb.open(d, map_size=1 << 30, max_dbs=1, readahead=True)
        chunks = env.open_db(b"chunks")
        with env.begin(write=True) as txn:
            txn.put(big_ref.key, encode_chunk(1, 1, CHUNK, "big.bin", "cid-big", big), db=chunks)
            txn.put(
                small_ref.key, encode_chunk(1, 0, CHUNK, "small.bin", "cid-small", small), db=chunks
            )
            txn.put(k1_big, encode_v1(1, "cid-big", big), db=chunks)
            txn.put(k1_small, encode_v1(0, "cid-small", small), db=chunks)
        assert chunk_key("cid-big", CHUNK, 1) == big_ref.key
        counts = Counts()
        state: dict[str, lmdb.Transaction] = {"txn": env.begin(buffers=True)}

        def renew() -> lmdb.Transaction:
            state["txn"].abort()
            state["txn"] = env.begin(buffers=True)
            return state["txn"]

        def case(size: int) -> dict[str, Callable[[], object]]:
            lo = 5 * size if 6 * size <= CHUNK else 0  # an aligned request mid-chunk
            hi = lo + size

            def before() -> object:  # served unchecked after the handle's first check
                value = renew().get(k1_big, db=chunks)
                return memoryview(value)[len(value) - CHUNK :][lo:hi]

            def whole() -> object:
                value = renew().get(k1_big, db=chunks)
                return verify_v1(memoryview(value), CHUNK)[lo:hi]

            def after() -> object:
                value = renew().get(big_ref.key, db=chunks)
                data = checked_chunk(value, big_ref, counts, lo, hi)
                assert data is not None
                return data[lo:hi]

            return {"before": before, "whole": whole, "after": after}

        def small_case() -> dict[str, Callable[[], object]]:
            def before() -> object:  # one open, one read: the one check is in the read
                value = renew().get(k1_small, db=chunks)
                return verify_v1(memoryview(value), SMALL)

            def after() -> object:
                value = renew().get(small_ref.key, db=chunks)
                data = checked_chunk(value, small_ref, counts, 0, SMALL)
                assert data is not None
                return data

            return {"before": before, "after": after}

        rows = [
            ("128 KiB request, 4 MiB chunk", case(128 << 10)),
            ("1 MiB request, 4 MiB chunk", case(1 << 20)),
            ("110 KiB small file, whole", small_case()),
        ]
        print(f"hit path per request, median of {args.repeat} x {args.n} requests (us)")
        print(f"{'case':32} {'before':>8} {'whole':>8} {'after':>8} {'added':>8} "
              f"{'after/before':>12} {'added/FUSE req':>15}")  # fmt: skip
        for name, fns in rows:
            for fn in fns.values():  # warm up: values faulted in, code paths hot
                for _ in range(50):
                    fn()
            t = {k: timed(fn, args.n, args.repeat) for k, fn in fns.items()}
            added = t["after"] - t["before"]
            whole = f"{t['whole']:8.1f}" if "whole" in t else f"{'-':>8}"
            print(
                f"{name:32} {t['before']:8.1f} {whole} {t['after']:8.1f} {added:8.1f} "
                f"{t['after'] / t['before']:11.2f}x {added / FUSE_REQUEST_US:14.0%}"
            )
        assert counts.corrupt_chunks == 0
        state["txn"].abort()
        env.close()
    print(f"(added/FUSE req: the added cost over one {FUSE_REQUEST_US:.0f} us FUSE request)")


if __name__ == "__main__":
    main()
