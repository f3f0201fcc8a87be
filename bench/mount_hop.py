"""The mount's hop to its daemon in one process: the CPU a chunk-sized answer costs the
daemon's side of the Unix socket and the mount's client, on the trio loop (h11) against
a connection moved to a thread of its own (control/thread_conn.py).

Owns one measurement: serve_unix in a child process (as the daemon is) with one route
answering 128 KiB (no handler work: what is measured is the hop), and the mount's
AsyncControlClient in this process's trio loop asking it `--requests` times from
`--concurrency` tasks, alternately with the route `threaded` and not. It prints, per
kind, the server's CPU per request (the child's, from /proc: 10 ms ticks), the
client's, their sum and the wall time per request, medians of --runs, and the ratio of
the sums. Never runs in CI and never changes silofs.

    python bench/mount_hop.py                    # 128 KiB, 3000 requests, 3 runs
    python bench/mount_hop.py --size 4M --requests 200 --concurrency 4

The machine is shared: the load average is printed; compare figures within one run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import socket
import statistics
import tempfile
import time
from pathlib import Path

import trio
from common import ProcTimes, load_average  # also puts this checkout first on sys.path

from silofs.control.client import AsyncControlClient
from silofs.control.router import Request, Response, Router
from silofs.control.server import serve_unix
from silofs.units import parse_size
from tests.support.poll import wait_for

TARGET = "/v1/chunks?mount=m1&key=train%2F00001.bin&index=0&version=null"


def make_router(size: int, threaded: bool) -> Router:
    body = os.urandom(size)
    router = Router()

    async def chunk(req: Request) -> Response:
        return Response(200, body, "application/octet-stream", {"x-silofs-source": "cache"})

    router.add("GET", "/v1/chunks", chunk, threaded=threaded)
    return router


async def ask(path: str, requests: int, concurrency: int) -> tuple[float, float]:
    """(this thread's CPU seconds, wall seconds) for `requests` chunk requests (the
    first, which connects and moves the connection, not counted)."""
    async with AsyncControlClient(path, max_connections=concurrency) as client:
        await client.request("GET", TARGET)  # connect (and move), outside the figures
        left = [requests]

        async def worker() -> None:
            while left[0] > 0:
                left[0] -= 1
                status, _, body = await client.request("GET", TARGET)
                assert status == 200 and body, status

        cpu0, t0 = time.thread_time(), time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker)
        return time.thread_time() - cpu0, time.perf_counter() - t0


def serve(path: str, size: int, threaded: bool) -> None:
    """The child: serve until SIGTERM."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    trio.run(lambda: serve_unix(path, make_router(size, threaded)))


def listening(path: str) -> bool:
    with socket.socket(socket.AF_UNIX) as probe:
        return probe.connect_ex(path) == 0


def one_run(tmp: Path, size: int, threaded: bool, args: argparse.Namespace) -> dict[str, float]:
    path = str(tmp / f"hop-{threaded}.sock")
    child = multiprocessing.get_context("fork").Process(target=serve, args=(path, size, threaded))
    child.start()
    try:
        wait_for(lambda: listening(path), 10.0, "the server's socket")
        assert child.pid is not None
        server0 = ProcTimes.of(child.pid)
        p0 = time.process_time()
        _, wall = trio.run(ask, path, args.requests, args.concurrency)
        client_cpu = time.process_time() - p0
        server_cpu = ProcTimes.of(child.pid).minus(server0).cpu_s
    finally:
        child.terminate()
        child.join()
    n = args.requests
    return {
        "server_us": server_cpu / n * 1e6,
        "client_us": client_cpu / n * 1e6,
        "sum_us": (server_cpu + client_cpu) / n * 1e6,
        "wall_us": wall / n * 1e6,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=parse_size, default=128 << 10)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    print(f"load before: {load_average()}")
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="silofs-hop-") as tmp:
        for _ in range(args.runs):
            for threaded in (False, True):
                runs[threaded].append(one_run(Path(tmp), args.size, threaded, args))
    med = {t: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for t, rs in runs.items()}
    for threaded, figures in med.items():
        kind = "thread" if threaded else "loop"
        text = ", ".join(f"{k} {v:.0f}" for k, v in figures.items())
        print(f"{kind:>6}: {text} (median of {args.runs}, per {args.size} B answer)")
    print(f"thread / loop, CPU of both sides: {med[True]['sum_us'] / med[False]['sum_us']:.2f}x")
    print(f"load after: {load_average()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
