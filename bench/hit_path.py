"""The mount's hit path without FUSE: begin a read, look the chunk up, return it.

Prints the mean cost of one hit (what fs.read does before the kernel copy: begin_read() and
ChunkReader.chunk() of a verified chunk) over many iterations, best of several runs. Run
it against two trees to compare them, e.g. before and after a change to mount/reader.py:

    PYTHONPATH=/work/main python bench/hit_path.py
    PYTHONPATH=. python bench/hit_path.py

Needs no root and no FUSE; the env lives in a temp dir.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import trio

from silofs.cache.format import ChunkRef, encode_chunk
from silofs.cache.store import CacheStore
from silofs.mount.reader import ChunkReader, OpenFile
from silofs.node.store_write import PendingChunk, WritableStore
from silofs.records import ObjectInfo


async def _never() -> None:
    raise AssertionError("a hit never re-registers")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=200_000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--chunk-kib", type=int, default=128)
    args = ap.parse_args()
    size = args.chunk_kib << 10
    with tempfile.TemporaryDirectory(prefix="silofs-hitbench-") as d:
        store = WritableStore(d, 256 << 20)
        obj = ObjectInfo("f.bin", size, 0.0, "v1", "c1")
        ref = ChunkRef.of(obj, size, 0)
        value = encode_chunk(1, 0, size, obj.key, obj.content_id, b"x" * size)
        store.admit([PendingChunk(1, ref.key, value, size)], {}, lambda _d, _u: 1 << 30)
        store.close()  # LMDB allows one env per path per process: reopen it as a mount does
        reader_store = CacheStore(d, 256 << 20)

        async def run() -> list[float]:
            reader = ChunkReader(
                reader_store,
                None,  # type: ignore[arg-type]  # a hit never asks the daemon
                dataset_id=1,
                chunk_size=size,
                buffer_bytes=1 << 20,
                readahead_bytes=0,
                reregister=_never,
            )
            f = OpenFile(obj)
            reader.renew()
            figures = []
            for _ in range(args.runs):
                t0 = time.perf_counter()
                for _ in range(args.iterations):
                    reader.begin_read()
                    data, hit, _source = await reader.chunk(f, 0)
                    assert hit
                figures.append((time.perf_counter() - t0) / args.iterations * 1e6)
            return figures

        figures = trio.run(run)
        print(
            f"hit path (begin_read + chunk, {args.chunk_kib} KiB chunk): "
            f"best {min(figures):.2f} us, "
            f"median {sorted(figures)[len(figures) // 2]:.2f} us over {args.runs} runs "
            f"of {args.iterations}"
        )
        reader_store.close()


if __name__ == "__main__":
    main()
