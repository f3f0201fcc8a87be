"""What the mutual-TLS listener costs, and what refused clients cost the daemon.

Starts `silofs daemon` on a private socket and cache under /tmp with [control]
tcp_listen on 127.0.0.1 (certificates from `silofs-ctl certs`), then prints:

1. GET /v1/status latency (median and p99 of --n requests) over the Unix socket, over
   TLS on one keep-alive connection, and over TLS with a new connection (full
   handshake) per request: what a controller poll costs per node;
2. a flood of refused clients (--flood connections from --threads threads: plaintext,
   certificate from a foreign CA, alternating) and, meanwhile, the latency of status
   over the Unix socket and over TLS with the controller's certificate: refusals must
   not hurt the daemon.

    python bench/remote_control.py [--n 300] [--flood 600] [--threads 8] [--rate 20]

(--rate 1000000 shows the flood without the handshake rate limit.) "tls, new connection
each" is paced under the rate limit (at most 100 of them).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import ProcTimes  # also puts this checkout first on sys.path

from silofs.control.client import ControlClient, ControlError, client_tls_context
from tests.support.net import free_port
from tests.support.node import Node


def figures(samples: list[float]) -> str:
    ms = sorted(1000 * s for s in samples)
    p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
    return f"median {statistics.median(ms):6.2f} ms  p99 {p99:6.2f} ms  (n={len(ms)})"


def timed(fn, n: int) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--flood", type=int, default=600)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--rate", type=float, default=20.0, help="[control] tls_handshakes_per_second")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="silofs-bench-tls-") as d:
        run(args, Path(d))


def run(args: argparse.Namespace, tmp: Path) -> None:
    ctl = [sys.executable, "-m", "silofs_ctl"]
    pki, foreign = tmp / "pki", tmp / "foreign"
    for a in (["certs", "init", str(pki)], ["certs", "node", str(pki), "bench", "--address",
              "127.0.0.1"], ["certs", "init", str(foreign)]):  # fmt: skip
        subprocess.run([*ctl, *a], check=True, capture_output=True)
    port = free_port()
    conf = tmp / "silofs.toml"
    conf.write_text(
        f'[control]\ntcp_listen = "127.0.0.1:{port}"\n'
        f'tls_cert = "{pki}/bench.pem"\ntls_key = "{pki}/bench.key"\n'
        f'tls_client_ca = "{pki}/ca.pem"\ntls_client_names = ["controller"]\n'
        f"tls_handshakes_per_second = {args.rate}\n"
    )
    with Node(tmp / "node", "64M", config=conf) as node:
        node.start()
        sock = node.socket
        good = client_tls_context(f"{pki}/controller.pem", f"{pki}/controller.key", f"{pki}/ca.pem")
        bad = client_tls_context(
            f"{foreign}/controller.pem", f"{foreign}/controller.key", f"{pki}/ca.pem"
        )
        addr = f"tls://127.0.0.1:{port}"

        print("== GET /v1/status (daemon with no datasets)")
        for what, target in (("unix, keep-alive", sock), ("tls, keep-alive", addr)):
            with ControlClient(target, timeout=10, tls=good) as c:
                print(f"{what:24} {figures(timed(lambda: c.request('GET', '/v1/status'), args.n))}")

        def fresh() -> None:
            with ControlClient(addr, timeout=10, tls=good) as c:
                c.request("GET", "/v1/status")

        paced = []  # one new connection per 1.2/rate s: within the handshake rate limit
        for _ in range(min(args.n, 100)):
            paced += timed(fresh, 1)
            time.sleep(1.2 / args.rate)
        print(f"tls, new connection each {figures(paced)}")

        print(f"== {args.flood} refused clients from {args.threads} threads, meanwhile status")
        stop = threading.Event()
        during: dict[str, list[float]] = {"unix": [], "tls": []}

        def watch() -> None:
            with (
                ControlClient(sock, timeout=10) as u,
                ControlClient(addr, timeout=10, tls=good) as t,
            ):
                while not stop.is_set():
                    during["unix"] += timed(lambda: u.request("GET", "/v1/status"), 1)
                    during["tls"] += timed(lambda: t.request("GET", "/v1/status"), 1)
                    time.sleep(0.01)  # a paced poller, not synchronisation

        def refused(i: int) -> bool:
            if i % 2:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                        s.sendall(b"GET /v1/status HTTP/1.1\r\nhost: x\r\n\r\n")
                        return b"200" not in s.recv(100)
                except OSError:
                    return True
            try:
                ControlClient(addr, timeout=10, tls=bad).request("POST", "/v1/status")
                return False
            except ControlError as exc:
                return exc.status is None

        watcher = threading.Thread(target=watch)
        watcher.start()
        cpu0 = ProcTimes.of(node.daemon_pid).cpu_s
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.threads) as pool:
            outcomes = list(pool.map(refused, range(args.flood)))
        elapsed = time.perf_counter() - t0
        cpu = ProcTimes.of(node.daemon_pid).cpu_s - cpu0
        stop.set()
        watcher.join()
        print(
            f"refused {sum(outcomes)}/{len(outcomes)} in {elapsed:.1f}s "
            f"({len(outcomes) / elapsed:.0f}/s); daemon CPU {cpu:.2f}s "
            f"({100 * cpu / elapsed:.0f}% of one core, status polls included)"
        )
        print(f"unix status meanwhile    {figures(during['unix'])}")
        print(f"tls status meanwhile     {figures(during['tls'])}")
        with ControlClient(sock, timeout=10) as c:
            assert c.request("GET", "/v1/status")["node"]
        warnings = (node.logs / "daemon.log").read_text().count("TLS listener refused")
        print(f"daemon log lines about refusals: {warnings} (at most one a minute)")


if __name__ == "__main__":
    main()
