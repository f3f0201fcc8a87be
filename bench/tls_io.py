"""A chunk-sized TLS answer's CPU at each end: memory BIOs (what silofs runs) against
blocking SSLSockets (OpenSSL reading and writing the socket itself, the GIL released).

Owns one measurement: a peer exchange's transport alone, no HTTP and no cache work. The
home (a child process) answers each small request with --size bytes; this process asks
from one thread, one exchange at a time, over one connection. Two ways at each end,
alternating run by run over the same connections:

- asker `pipe`: silofs.node.peer_client.TLSPipe.read_exactly (the body's ciphertext
  received with MSG_WAITALL into one buffer, one SSLObject.read per record);
  asker `sslsocket`: SSLSocket.recv_into until the body is in (one SSL_read per record,
  OpenSSL's own recv calls on the socket).
- home `bio`: as control/thread_conn.py TLSChannel.send (SSLObject.write of the whole
  body into the outgoing BIO, one sendall of its ciphertext); home `sslsocket`:
  SSLSocket.sendall.
- the `sliced` ways: the home's BIO sends every --slice of plaintext (the asker may
  decrypt the first records while the home encrypts the rest), the asker's pipe
  receives at most --slice of ciphertext at a time (decrypting what came while the rest
  is on its way).

Prints per exchange the asking thread's CPU (time.thread_time) and the home's (its
process's, from /proc), medians of --runs, and the wall time. Both ends negotiate what
the members negotiate (TLS 1.3, AES-256-GCM). Never runs in CI and never changes silofs.

    python bench/tls_io.py [--size 128K] [--exchanges 1500] [--runs 5]

The machine is shared: the load average is printed; compare figures within one run.
"""

from __future__ import annotations

import argparse
import os
import socket
import ssl
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

from silofs.units import parse_size

_HOME_WAYS = ("bio", "bio-sliced", "sslsocket")
_ASKER_WAYS = ("pipe", "pipe-sliced", "sslsocket")


def serve(pki: Path, size: int, port_file: Path, slice_bytes: int) -> None:
    """The child: one thread per connection, each answering every request with `size`
    bytes, the way its first byte names (b"b": memory BIOs, the whole body's ciphertext
    sent at once; b"c": the same, sent every `slice_bytes` of plaintext; b"s":
    SSLSocket)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(pki / "home.pem"), str(pki / "home.key"))
    ctx.load_verify_locations(str(pki / "ca.pem"))
    ctx.verify_mode = ssl.CERT_REQUIRED
    body = os.urandom(size)
    listener = socket.create_server(("127.0.0.1", 0))
    port_file.write_text(str(listener.getsockname()[1]))

    def bio(conn: socket.socket, slice_bytes: int) -> None:
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        obj = ctx.wrap_bio(incoming, outgoing, server_side=True)
        while True:  # the handshake
            try:
                obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                conn.sendall(outgoing.read())
                incoming.write(conn.recv(1 << 16))
        conn.sendall(outgoing.read())
        while True:
            try:
                request = obj.read(1 << 16)
            except ssl.SSLWantReadError:
                data = conn.recv(1 << 16)
                if not data:
                    return
                incoming.write(data)
                continue
            if not request:
                return
            for at in range(0, size, slice_bytes):
                obj.write(body[at : at + slice_bytes])
                conn.sendall(outgoing.read())

    def plain(conn: socket.socket) -> None:
        s = ctx.wrap_socket(conn, server_side=True)
        while s.recv(1 << 16):
            s.sendall(body)

    def one(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        way = conn.recv(1)  # before the handshake: which way this connection answers
        try:
            if way == b"s":
                plain(conn)
            else:
                bio(conn, size if way == b"b" else slice_bytes)
        except (OSError, ssl.SSLError):
            pass

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=one, args=(conn,), daemon=True).start()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=parse_size, default=128 << 10, help="answer body bytes")
    ap.add_argument("--exchanges", type=int, default=1500, help="per run and way")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--slice", type=parse_size, default=32 << 10,
                    help="the sliced ways: plaintext per send at the home, most ciphertext "
                    "per receive at the asker")  # fmt: skip
    ap.add_argument("--serve", nargs=4, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(Path(args.serve[0]), int(args.serve[1]), Path(args.serve[2]), int(args.serve[3]))
        return 0
    from silofs.node.peer_client import TLSPipe, client_context

    size = args.size
    print(f"load average {load_average()}; {size} bytes an answer")
    with tempfile.TemporaryDirectory(prefix="silofs-bench-") as tmp:
        pki = Path(tmp)
        port_file = pki / "port"
        cmd = [sys.executable, __file__, "--serve", tmp, str(size), str(port_file), str(args.slice)]
        child, port = start_tls_home(pki, cmd, port_file)
        try:
            ctx = client_context(*(str(pki / n) for n in ("asker.pem", "asker.key", "ca.pem")))
            view = memoryview(bytearray(size))

            def connect(home: str, asker: str) -> object:
                raw = socket.create_connection(("127.0.0.1", port))
                raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                raw.sendall({"bio": b"b", "bio-sliced": b"c", "sslsocket": b"s"}[home])
                if asker.startswith("pipe"):
                    pipe = TLSPipe.connect(raw, ctx, "127.0.0.1", time.monotonic() + 10)
                    if asker == "pipe-sliced":  # _fill waits for at most this much
                        pipe._ciphertext = memoryview(bytearray(args.slice))
                    return pipe
                return ctx.wrap_socket(raw, server_hostname="127.0.0.1")

            def exchange(conn: object) -> None:
                if isinstance(conn, TLSPipe):
                    conn.deadline = time.monotonic() + 10
                    conn.sendall(b"x" * 100)
                    n, exc = conn.read_exactly(view)
                    assert n == size and exc is None, (n, exc)
                    return
                assert isinstance(conn, ssl.SSLSocket)
                conn.sendall(b"x" * 100)
                have = 0
                while have < size:
                    got = conn.recv_into(view[have:], size - have)
                    assert got, "closed"
                    have += got

            ways = [(h, a) for h in _HOME_WAYS for a in _ASKER_WAYS]
            conns = {w: connect(*w) for w in ways}
            some = conns[("sslsocket", "sslsocket")]
            assert isinstance(some, ssl.SSLSocket)
            print(f"negotiated: {some.version()} {(some.cipher() or ('?',))[0]}")
            figures: dict[tuple[str, str], list[tuple[float, float, float]]] = {w: [] for w in ways}
            for _ in range(args.runs):
                for w in ways:
                    conn = conns[w]
                    for _ in range(50):
                        exchange(conn)
                    h0, a0, w0 = child_cpu(child.pid), time.thread_time(), time.perf_counter()
                    for _ in range(args.exchanges):
                        exchange(conn)
                    h1, a1, w1 = child_cpu(child.pid), time.thread_time(), time.perf_counter()
                    n = args.exchanges
                    figures[w].append(((a1 - a0) / n * 1e6, (h1 - h0) / n * 1e6,
                                       (w1 - w0) / n * 1e6))  # fmt: skip
            print(f"{'home / asker':24s} {'asker CPU us':>13s} {'home CPU us':>12s} {'wall us':>8s}"
                  "   (medians of the runs; the asker's runs)")  # fmt: skip
            for w, runs in figures.items():
                med = [statistics.median(r[i] for r in runs) for i in range(3)]
                each = ", ".join(f"{r[0]:.0f}" for r in runs)
                print(f"{w[0] + ' / ' + w[1]:24s} {med[0]:13.1f} {med[1]:12.1f} {med[2]:8.0f}"
                      f"   ({each})")  # fmt: skip
        finally:
            child.kill()
            child.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
