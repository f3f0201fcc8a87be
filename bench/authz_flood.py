"""One unprivileged user floods a root daemon: what it holds, what it costs, who is served.

Needs root (it starts a root daemon and drops a forked child to an unprivileged uid).
Starts `silofs daemon` on a private socket and cache under /tmp, then as uid --uid
(default 65534, nobody):

1. opens --n distinct local datasets, registers --n mounts under --n job names;
2. holds --conns idle control connections open;

and prints, each time: how many requests were answered 2xx and 429 (refused by a
per-uid limit), the daemon's RSS, and the size and latency of GET /v1/status as root.
While the connections are held it also times a root status and a miss (GET /v1/chunks)
by a root mount. Before the per-uid limits, 2,000 of each took the daemon from
32 to 153 MB and status to 2 MB / 0.8 s; 1,124 idle connections starved status and made
misses fail with EMFILE tracebacks every 0.1 s.

    sudo python bench/authz_flood.py [--n 2000] [--conns 1200] [--uid 65534]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from silofs.control.client import ControlClient  # noqa: E402
from tests.support.asuser import AsUserError, Identity, as_user, start_as  # noqa: E402
from tests.support.node import Node  # noqa: E402
from tests.support.poll import wait_for  # noqa: E402


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def status_figures(sock: str) -> tuple[int, float]:
    t0 = time.perf_counter()
    with ControlClient(sock, timeout=60) as c:
        _, _, body = c.request_raw("GET", "/v1/status")
    return len(body), time.perf_counter() - t0


def flood_api(sock: str, base: str, n: int) -> dict:
    counts: dict[str, dict[int, int]] = {"datasets": {}, "mounts": {}}
    ready = None
    with ControlClient(sock, timeout=60) as c:
        for i in range(n):
            status, _, body = c.request_raw("POST", "/v1/datasets", {"uri": f"{base}/d{i}"})
            counts["datasets"][status] = counts["datasets"].get(status, 0) + 1
            if status == 200:  # the last one: older idle ones are forgotten at the limit
                ready = json.loads(body)["id"]

        def listed() -> bool:
            _, _, body = c.request_raw("GET", f"/v1/datasets/{ready}")
            return json.loads(body)["state"] == "ready"

        wait_for(listed, 30, "the last dataset to be listed")
        for i in range(n):
            body = {"dataset": ready, "job": f"job{i}", "mountpoint": f"/m/{i}"}
            status, _, _ = c.request_raw("POST", "/v1/mounts", body)
            counts["mounts"][status] = counts["mounts"].get(status, 0) + 1
    return counts


def hold_connections(sock: str, n: int, ready_w: int, release_r: int) -> dict:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    held, lines = [], {}
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        try:
            s.connect(sock)
            s.sendall(b"GET /v1/status HTTP/1.1\r\nhost: x\r\n\r\n")
            head = s.recv(200).split(b"\r\n", 1)[0].decode() or "closed"
        except OSError as exc:
            head = type(exc).__name__
        lines[head[:12]] = lines.get(head[:12], 0) + 1
        held.append(s)
    os.write(ready_w, b"x")
    os.read(release_r, 1)
    for s in held:
        s.close()
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--conns", type=int, default=1200)
    ap.add_argument("--uid", type=int, default=65534)
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root")
    base = Path(tempfile.mkdtemp(prefix="silofs-flood-", dir="/tmp"))
    base.chmod(0o755)
    data = base / "data"
    data.mkdir()
    for i in range(args.n):
        (data / f"d{i}").mkdir()
        (data / f"d{i}" / "f").write_bytes(b"x" * 4096)
    (base / "run").mkdir(mode=0o755)
    node = Node(base / "node", "256M", socket=str(base / "run" / "ctl.sock"))
    sock = node.socket
    try:
        node.start()
        pid = node.daemon_pid
        print(f"daemon idle: RSS {rss_mb(pid):.0f} MB")
        t0 = time.perf_counter()
        try:
            counts = as_user(Identity.nobody(args.uid), flood_api, sock, str(data), args.n)
        except AsUserError as exc:
            sys.exit(str(exc))
        size, took = status_figures(sock)
        print(
            f"uid {args.uid}: {args.n} dataset opens -> {counts['datasets']}, "
            f"{args.n} mounts under {args.n} jobs -> {counts['mounts']} "
            f"({time.perf_counter() - t0:.1f}s)"
        )
        print(
            f"after: RSS {rss_mb(pid):.0f} MB, status {size / 1024:.0f} KiB in {took * 1000:.0f} ms"
        )
        # A root mount registration to time a miss with during the connection flood.
        with ControlClient(sock) as c:
            ds = c.request("POST", "/v1/datasets", {"uri": str(data / "d0")})
            path = f"/v1/datasets/{ds['id']}"
            wait_for(lambda: c.request("GET", path)["state"] == "ready", 30, "d0's listing")
            m = c.request(
                "POST", "/v1/mounts", {"dataset": ds["id"], "job": "root", "mountpoint": "/r"}
            )
        ready_r, ready_w = os.pipe()
        release_r, release_w = os.pipe()
        child = start_as(
            Identity.nobody(args.uid), hold_connections, sock, args.conns, ready_w, release_r
        )
        os.close(ready_w)  # the child's copy is the one that signals
        if not os.read(ready_r, 1):  # the child died before holding its connections
            sys.exit(f"uid {args.uid} could not hold connections: {child.result()}")
        size, took = status_figures(sock)
        t1 = time.perf_counter()
        with ControlClient(sock, timeout=30) as c:
            st, _, body = c.request_raw("GET", f"/v1/chunks?mount={m['id']}&key=f&index=0")
        miss = time.perf_counter() - t1
        os.write(release_w, b"x")
        lines = child.result()
        print(f"uid {args.uid} holding {args.conns} connections: first lines {lines}")
        print(
            f"  meanwhile root: status {took * 1000:.0f} ms, miss {st} ({len(body)} B) in "
            f"{miss * 1000:.0f} ms; daemon RSS {rss_mb(pid):.0f} MB"
        )
        text = (node.logs / "daemon.log").read_text(errors="replace")
        print(
            f"daemon log: {text.count('Traceback')} tracebacks, "
            f"{text.count('EMFILE') + text.count('Too many open files')} EMFILE lines"
        )
    finally:
        node.cleanup()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
