"""The asker's side of a peer exchange: a member's PeerPool asking chunk-sized answers
from several connection threads at once, against a home's listener in another process.

Owns one measurement: serve_tls in a child process (the home: one route answering a
chunk-sized body from the member connection's thread, Route.inline, no cache work) and
in this process PeerPool.request from --threads threads at once (as a daemon's mount
connection threads ask: each thread an exchange at a time, the pool's connections
shared). It prints per exchange: this process's CPU (the asker's), its context
switches (each a thread that slept: a wait for the answer, or for the GIL another
connection thread holds), the child's CPU (the home's), and the wall time, medians of
--runs. `--tree DIR` imports silofs from DIR (another checkout: compare two revisions
run by run). Never runs in CI and never changes silofs.

    python bench/peer_exchange.py                    # 128 KiB answers, 4 threads
    python bench/peer_exchange.py --threads 1 --tree /path/to/other/checkout

The machine is shared: the load average is printed; compare figures within one run.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import (  # also puts this checkout first on sys.path
    child_cpu,
    load_average,
    start_tls_home,
)

TARGET = (
    "/v1/peer/chunk?ds=s3%3A%2F%2Fbucket%2F&key=train%2F00001.bin&cid=%22abcdef0123456789%22"
    "&size=131072&version=null&cs=131072&i=0&job=default&charged=1&warm=0"
)


def serve(pki: Path, size: int, port_file: Path) -> None:
    """The child: serve_tls with one inline route until killed."""
    import trio

    from silofs.control.router import Caller, Request, Response, Route, Router
    from silofs.control.server import TLSLimits, bind_tcp, serve_tls
    from silofs.control.tls import server_context

    body = os.urandom(size)

    def answer(req: Request) -> Response:
        return Response(200, body, "application/octet-stream", {"x-silofs-source": "cache"})

    async def on_loop(req: Request) -> Response:
        return answer(req)

    router = Router()
    who = Caller.PEER | Caller.CONTROLLER
    router.add_route(Route("GET", "/v1/peer/chunk", on_loop, who, inline=answer))
    ctx = server_context(str(pki / "home.pem"), str(pki / "home.key"), str(pki / "ca.pem"))
    sock = bind_tcp("127.0.0.1", 0)
    port_file.write_text(str(sock.getsockname()[1]))

    async def main() -> None:
        await serve_tls(sock, router, ctx, tls_limits=TLSLimits())

    trio.run(main)


def run_once(pool: object, threads: int, per_thread: int, size: int) -> tuple[float, ...]:
    from silofs.node.peer_client import Bounds

    bounds = Bounds(5.0, 1e6)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(per_thread):
                reply = pool.request("GET", TARGET, bounds)  # type: ignore[attr-defined]
                assert reply.status == 200 and len(reply.body) == size, reply.status
        except BaseException as exc:  # reported after the run
            errors.append(exc)

    r0 = resource.getrusage(resource.RUSAGE_SELF)
    w0 = time.perf_counter()
    workers = [threading.Thread(target=worker) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    wall = time.perf_counter() - w0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    if errors:
        raise errors[0]
    n = threads * per_thread
    cpu = (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / n
    switches = (r1.ru_nvcsw + r1.ru_nivcsw - r0.ru_nvcsw - r0.ru_nivcsw) / n
    return cpu, switches, wall / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=128 << 10, help="answer body bytes")
    ap.add_argument("--threads", type=int, default=4, help="asking threads at once")
    ap.add_argument("--requests", type=int, default=400, help="exchanges per thread per run")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tree", default=None, help="import silofs from this checkout")
    ap.add_argument("--serve", nargs=3, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tree:
        sys.path[0:0] = [args.tree, str(Path(args.tree) / "silofs-ctl")]
    if args.serve:
        serve(Path(args.serve[0]), int(args.serve[1]), Path(args.serve[2]))
        return 0
    import silofs
    from silofs.node.peer_client import PeerPool, client_context

    print(f"load average {load_average()}; silofs from {Path(silofs.__file__).parent.parent}")
    with tempfile.TemporaryDirectory(prefix="silofs-bench-") as tmp:
        pki = Path(tmp)
        port_file = pki / "port"
        cmd = [sys.executable, __file__, "--serve", str(pki), str(args.size), str(port_file)]
        if args.tree:
            cmd += ["--tree", args.tree]
        child, port = start_tls_home(pki, cmd, port_file)
        try:
            pem, key, ca = (str(pki / n) for n in ("asker.pem", "asker.key", "ca.pem"))
            ctx = client_context(pem, key, ca)
            pool = PeerPool(f"tls://127.0.0.1:{port}", "127.0.0.1", port, ctx, "bench")
            run_once(pool, args.threads, 20, args.size)  # warm: connections, imports
            rows = []
            for _ in range(args.runs):
                h0 = child_cpu(child.pid)
                cpu, switches, wall = run_once(pool, args.threads, args.requests, args.size)
                home = (child_cpu(child.pid) - h0) / (args.threads * args.requests)
                rows.append((cpu, switches, home, wall))
            pool.close()
        finally:
            child.kill()
            child.wait()
    cpu, switches, home, wall = (statistics.median(col) for col in zip(*rows, strict=True))
    print(
        f"{args.size} B answers, {args.threads} threads: asker CPU {1e6 * cpu:.0f} us, "
        f"{switches:.1f} context switches; home CPU {1e6 * home:.0f} us; "
        f"wall {1e6 * wall:.0f} us per exchange (medians of {args.runs} runs)"
    )
    print("asker CPU per run (us): " + ", ".join(f"{1e6 * r[0]:.0f}" for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
