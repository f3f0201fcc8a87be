"""The home's side of a peer exchange in one process: the CPU the mutual-TLS listener
spends per chunk answer on a member's connection (served from a thread after the
handshake) against a controller's (served on the trio loop with SSLStream and h11).

Owns one measurement: serve_tls on 127.0.0.1 with one route answering a chunk-sized
body (no cache, no handler work: what is measured is the listener), and a blocking TLS
client sending the request a member sends (`GET /v1/peer/chunk?...` with its headers)
on one keep-alive connection, alternately with a node certificate and a controller's.
It prints, per kind, the server's CPU per answer (the process's CPU less the client
thread's) and the wall time per exchange, medians of --runs, and their ratio. Never
runs in CI and never changes silofs.

    python bench/peer_listener.py                 # 128 KiB answers, 1000 per run, 3 runs
    python bench/peer_listener.py --size 4M --requests 200

The machine is shared: the load average is printed; compare figures within one run.
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import socket
import ssl
import statistics
import tempfile
import time
from pathlib import Path

from common import load_average  # also puts this checkout first on sys.path
from silofs_ctl.certs_cmd import client_cert, init_ca, node_cert

from silofs.control.router import Caller, Request, Response, Router
from silofs.control.server import TLSLimits, bind_tcp, serve_tls
from silofs.control.tls import server_context
from silofs.units import parse_size
from tests.unit.serving import serving

TARGET = (
    "/v1/peer/chunk?ds=s3%3A%2F%2Fbucket%2F&key=train%2F00001.bin&cid=%22abcdef0123456789%22"
    "&size=131072&version=null&cs=131072&i=0&job=default&charged=1&warm=0"
)


def request_bytes() -> bytes:
    return (
        f"GET {TARGET} HTTP/1.1\r\nhost: 127.0.0.1\r\nx-silofs-cluster: bench\r\n"
        "x-silofs-progress: 5\r\n\r\n"
    ).encode()


def client_context(pki: Path, name: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_cert_chain(str(pki / f"{name}.pem"), str(pki / f"{name}.key"))
    ctx.load_verify_locations(str(pki / "ca.pem"))
    return ctx


def exchanges(port: int, ctx: ssl.SSLContext, n: int, size: int) -> None:
    """n requests on one connection, each answer read whole into one buffer."""
    req = request_bytes()
    raw = socket.create_connection(("127.0.0.1", port))
    with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
        buf = bytearray(size + (64 << 10))
        view = memoryview(buf)
        for _ in range(n):
            s.sendall(req)
            got, need = 0, None
            while need is None or got < need:
                r = s.recv_into(view[got:])
                assert r, "the server closed the connection"
                got += r
                if need is None and (end := bytes(view[:got]).find(b"\r\n\r\n")) >= 0:
                    assert view[9:12] == b"200", bytes(view[:end])
                    need = end + 4 + size


def process_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=parse_size, default=128 << 10, help="answer body size")
    ap.add_argument("--requests", type=int, default=1000, help="exchanges per run")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    print(f"load average {load_average()}")
    body = os.urandom(args.size)

    async def chunk(req: Request) -> Response:
        return Response(200, body, "application/octet-stream", {"x-silofs-source": "cache"})

    router = Router()
    router.add("GET", "/v1/peer/chunk", chunk, who=Caller.PEER | Caller.CONTROLLER)
    with tempfile.TemporaryDirectory(prefix="silofs-bench-") as tmp:
        pki = Path(tmp)
        init_ca(str(pki))
        node_cert(str(pki), "node-a", ["127.0.0.1"])
        node_cert(str(pki), "node-b", ["127.0.0.1"])
        client_cert(str(pki), "controller")
        ctx = server_context(str(pki / "node-a.pem"), str(pki / "node-a.key"), str(pki / "ca.pem"))
        sock = bind_tcp("127.0.0.1", 0)
        port = sock.getsockname()[1]
        kinds = {"member (thread)": "node-b", "controller (loop)": "controller"}
        cpu: dict[str, list[float]] = {k: [] for k in kinds}
        wall: dict[str, list[float]] = {k: [] for k in kinds}
        with serving(functools.partial(serve_tls, sock, router, ctx, tls_limits=TLSLimits())):
            for _ in range(args.runs):
                for kind, name in kinds.items():
                    cctx = client_context(pki, name)
                    exchanges(port, cctx, 20, args.size)  # warm: imports, first handshake
                    c0, t0, w0 = process_cpu(), time.thread_time(), time.perf_counter()
                    exchanges(port, cctx, args.requests, args.size)
                    client = time.thread_time() - t0
                    cpu[kind].append((process_cpu() - c0 - client) / args.requests)
                    wall[kind].append((time.perf_counter() - w0) / args.requests)
    for kind in kinds:
        print(
            f"{kind:18s} server CPU {1e6 * statistics.median(cpu[kind]):6.0f} us per answer, "
            f"wall {1e6 * statistics.median(wall[kind]):6.0f} us per exchange"
        )
    member, loop = (statistics.median(cpu[k]) for k in kinds)
    print(f"server CPU per answer, member over controller: {member / loop:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
