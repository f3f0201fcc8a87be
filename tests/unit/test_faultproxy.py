"""tests/support/faultproxy.py against a tiny stdlib http.server upstream on 127.0.0.1.

The upstream serves a deterministic body per size (GET/HEAD /obj/SIZE, with Range), the same
body chunked (/chunked/SIZE) or read-until-close (/close/SIZE), and echoes request bodies
(PUT /echo). Every fault kind is checked from the client's side, over raw sockets where the
exact bytes matter and with http.client / requests where a real client's view matters.
Timing: lower bounds only; waiting is done by polling with a deadline (proxy.wait_stats).
"""

from __future__ import annotations

import hashlib
import http.client
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from tests.support.faultproxy import (
    Fault,
    FaultPlan,
    FaultProxy,
    TokenBucket,
    parse_fault,
    parse_rate,
)

REPO = Path(__file__).resolve().parents[2]


def body_of(size: int) -> bytes:
    """Deterministic, non-repeating-looking bytes for an object of `size`."""
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += hashlib.sha256(counter.to_bytes(8, "big")).digest()
        counter += 1
    return bytes(out[:size])


def parse_range(header: str, size: int) -> tuple[int, int] | None:
    m = re.fullmatch(r"bytes=(\d*)-(\d*)", header.strip())
    if not m or (not m[1] and not m[2]):
        return None
    if not m[1]:
        n = int(m[2])
        return max(0, size - n), size - 1
    start = int(m[1])
    end = int(m[2]) if m[2] else size - 1
    return start, min(end, size - 1)


class Upstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # else head and body writes meet delayed ACKs: 40 ms each

    def log_message(self, *args: object) -> None:
        pass

    def _size(self) -> int:
        return int(self.path.rsplit("/", 1)[1].split("?")[0])

    def do_HEAD(self) -> None:
        self.do_GET(head=True)

    def do_GET(self, head: bool = False) -> None:
        self.server.hits += 1  # type: ignore[attr-defined]
        if self.path.startswith("/obj/"):
            data = body_of(self._size())
            rng = self.headers.get("Range")
            span = parse_range(rng, len(data)) if rng else None
            if span:
                start, end = span
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
                data = data[start : end + 1]
            else:
                self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("ETag", '"x"')
            self.end_headers()
            if not head:
                self.wfile.write(data)
        elif self.path.startswith("/chunked/"):
            data = body_of(self._size())
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(0, len(data), 1000):
                piece = data[i : i + 1000]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
        elif self.path.startswith("/close/"):
            data = body_of(self._size())
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
            self.close_connection = True
        else:
            self.send_error(404)

    def do_PUT(self) -> None:
        self.server.hits += 1  # type: ignore[attr-defined]
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                data += self.rfile.read(size)
                self.rfile.readline()
        else:
            data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(bytes(data))


def serve_upstream(server: ThreadingHTTPServer) -> Iterator[tuple[str, int]]:
    """Serve the Upstream handler on `server` in a thread until the fixture ends."""
    server.daemon_threads = True
    server.hits = 0  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[:2]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[str, int]]:
    yield from serve_upstream(ThreadingHTTPServer(("127.0.0.1", 0), Upstream))


def raw_exchange(proxy: FaultProxy, request: bytes, timeout: float = 10.0) -> tuple[bytes, bool]:
    """Send `request` on a fresh connection; read to EOF. Returns (bytes, reset_seen)."""
    with socket.create_connection(proxy.address, timeout=timeout) as s:
        s.sendall(request)
        data = bytearray()
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                return bytes(data), True
            if not chunk:
                return bytes(data), False
            data += chunk


def split_response(data: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    return status, headers, body


def get(path: str, extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n{extra}Connection: close\r\n\r\n".encode()


def proxy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("faultproxy-")]


# ---------------------------------------------------------------------------------------
# Pass-through


def test_pass_through_is_byte_identical_with_keep_alive(upstream: tuple[str, int]) -> None:
    size = 300_000
    expected = body_of(size)
    with FaultProxy(upstream, seed=1) as proxy:
        conn = http.client.HTTPConnection(*proxy.address, timeout=10)
        conn.request("GET", f"/obj/{size}")
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read() == expected
        for rng, want in [
            ("bytes=0-0", expected[:1]),
            ("bytes=1000-70999", expected[1000:71000]),
            ("bytes=299990-", expected[299990:]),
            ("bytes=-17", expected[-17:]),
        ]:
            conn.request("GET", f"/obj/{size}", headers={"Range": rng})
            resp = conn.getresponse()
            assert resp.status == 206, rng
            assert resp.read() == want, rng
        conn.request("HEAD", f"/obj/{size}")
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.getheader("Content-Length") == str(size)
        assert resp.read() == b""
        conn.request("GET", "/chunked/12345")
        resp = conn.getresponse()
        assert resp.getheader("Transfer-Encoding") == "chunked"
        assert resp.read() == body_of(12345)
        upload = body_of(5000)[::-1]
        conn.request("PUT", "/echo", body=upload)
        assert conn.getresponse().read() == upload
        conn.request("PUT", "/echo", body=iter([upload[:10], upload[10:]]), encode_chunked=True)
        assert conn.getresponse().read() == upload
        conn.request("GET", "/close/777")  # read-until-close body: the proxy closes too
        resp = conn.getresponse()
        assert resp.read() == body_of(777)
        conn.close()
        stats = proxy.wait_stats(lambda s: s["forwarded"] >= 10)
        assert stats["connections"] == 1  # keep-alive: every request on one connection
        assert stats["requests"] == 10
        assert not any(stats[k] for k in ("http_500", "corrupt", "truncate", "upstream_errors"))
        history = proxy.wait_history(lambda h: len(h) >= 10)
        assert {r.client for r in history} == {"127.0.0.1"}  # who asked, per request


def test_pipelined_requests_and_expect_continue(upstream: tuple[str, int]) -> None:
    with FaultProxy(upstream) as proxy:
        with socket.create_connection(proxy.address, timeout=10) as s:
            s.sendall(
                b"GET /obj/10 HTTP/1.1\r\nHost: x\r\n\r\n"
                b"GET /obj/20 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            )
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        assert data.count(b"HTTP/1.1 200") == 2
        assert data.endswith(body_of(20))
        with socket.create_connection(proxy.address, timeout=10) as s:
            s.sendall(
                b"PUT /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                b"Expect: 100-continue\r\nConnection: close\r\n\r\n"
            )
            interim = s.recv(100)
            assert interim.startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
            s.sendall(b"hello")
            data = interim[len(b"HTTP/1.1 100 Continue\r\n\r\n") :]
            while chunk := s.recv(65536):
                data += chunk
        status, _, body = split_response(data)
        assert (status, body) == (200, b"hello")


def test_requests_session_through_proxy(upstream: tuple[str, int]) -> None:
    with FaultProxy(upstream) as proxy, requests.Session() as session:
        session.trust_env = False
        for _ in range(3):
            r = session.get(f"{proxy.url}/obj/4096", headers={"Range": "bytes=100-199"})
            assert r.status_code == 206 and r.content == body_of(4096)[100:200]
        assert proxy.stats["connections"] == 1


# ---------------------------------------------------------------------------------------
# Faults


def test_http_500_and_503_slowdown(upstream: tuple[str, int]) -> None:
    plan = FaultPlan([Fault("http_500", times=1), Fault("http_503", times=1)])
    with FaultProxy(upstream, plan, seed=1) as proxy:
        conn = http.client.HTTPConnection(*proxy.address, timeout=10)
        conn.request("GET", "/obj/100")
        resp = conn.getresponse()
        assert resp.status == 500
        assert b"<Code>InternalError</Code>" in resp.read()
        conn.request("GET", "/obj/100")
        resp = conn.getresponse()
        assert resp.status == 503
        assert resp.getheader("Content-Type") == "application/xml"
        assert b"<Code>SlowDown</Code>" in resp.read()
        conn.request("GET", "/obj/100")  # both rules used up: passes, same connection
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read() == body_of(100)
        conn.close()
        stats = proxy.stats
        assert (stats["http_500"], stats["http_503"], stats["forwarded"]) == (1, 1, 1)
        assert stats["connections"] == 1
        # The third request is recorded once its relayed body is out, which a loaded
        # host may let the client read first: wait for three records, then compare.
        history = proxy.wait_history(lambda h: len(h) >= 3)
        assert [(r.fault, r.status) for r in history] == [
            ("http_500", 500),
            ("http_503", 503),
            (None, 200),
        ]


def test_reset_before_response(upstream: tuple[str, int]) -> None:
    with FaultProxy(upstream, FaultPlan([Fault("reset_before_response")])) as proxy:
        data, reset = raw_exchange(proxy, get("/obj/100"))
        assert reset and data == b""
        conn = http.client.HTTPConnection(*proxy.address, timeout=10)
        conn.request("GET", "/obj/100")
        with pytest.raises(ConnectionResetError):
            conn.getresponse()
        assert proxy.stats["reset_before_response"] == 2
        assert proxy.stats["forwarded"] == 0


def test_reset_mid_body(upstream: tuple[str, int]) -> None:
    size = 100_000
    with FaultProxy(upstream, FaultPlan([Fault("reset_mid_body", at=0.25)])) as proxy:
        data, reset = raw_exchange(proxy, get(f"/obj/{size}"))
        assert reset
        status, headers, body = split_response(data)
        assert status == 200 and headers["content-length"] == str(size)
        assert len(body) <= size // 4
        assert body == body_of(size)[: len(body)]
        with requests.Session() as session:
            session.trust_env = False
            with pytest.raises(requests.exceptions.ChunkedEncodingError):
                session.get(f"{proxy.url}/obj/{size}")


def test_truncate(upstream: tuple[str, int]) -> None:
    size = 100_000
    with FaultProxy(upstream, FaultPlan([Fault("truncate", at=0.5)])) as proxy:
        data, reset = raw_exchange(proxy, get(f"/obj/{size}"))
        assert not reset
        status, headers, body = split_response(data)
        assert headers["content-length"] == str(size)
        assert body == body_of(size)[: size // 2]
        conn = http.client.HTTPConnection(*proxy.address, timeout=10)
        conn.request("GET", f"/obj/{size}")
        resp = conn.getresponse()
        with pytest.raises(http.client.IncompleteRead) as info:
            resp.read()
        assert len(info.value.partial) == size // 2
        # A chunked upstream body is read whole and sent with a Content-Length, then cut.
        data, _ = raw_exchange(proxy, get("/chunked/5000"))
        _, headers, body = split_response(data)
        assert headers["content-length"] == "5000" and "transfer-encoding" not in headers
        assert body == body_of(5000)[:2500]
        assert proxy.stats["truncate"] == 3


def test_wrong_content_length(upstream: tuple[str, int]) -> None:
    size = 10_000
    with FaultProxy(upstream, FaultPlan([Fault("wrong_content_length", at=0.9)])) as proxy:
        data, _ = raw_exchange(proxy, get(f"/obj/{size}"))
        _, headers, body = split_response(data)
        assert headers["content-length"] == "9000"
        assert body == body_of(size)  # the whole body follows the short promise
        conn = http.client.HTTPConnection(*proxy.address, timeout=10)
        conn.request("GET", f"/obj/{size}")
        assert conn.getresponse().read() == body_of(size)[:9000]


def test_corrupt_flips_one_byte_keeps_length(upstream: tuple[str, int]) -> None:
    size = 50_000
    expected = body_of(size)
    with FaultProxy(upstream, FaultPlan([Fault("corrupt", times=1)]), seed=7) as proxy:
        conn = http.client.HTTPConnection(*proxy.address, timeout=10)
        conn.request("GET", f"/obj/{size}")
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("Content-Length") == str(size)
        got = resp.read()
        assert len(got) == size
        diffs = [i for i in range(size) if got[i] != expected[i]]
        assert len(diffs) == 1 and got[diffs[0]] == expected[diffs[0]] ^ 0xFF
        conn.request("GET", f"/obj/{size}")  # keep-alive intact; times=1 used up
        assert conn.getresponse().read() == expected
        conn.request("HEAD", f"/obj/{size}")
        conn.getresponse().read()
        assert proxy.stats["corrupt"] == 1


def test_body_fault_on_head_is_not_applicable(upstream: tuple[str, int]) -> None:
    with FaultProxy(upstream, FaultPlan([Fault("truncate")])) as proxy:
        conn = http.client.HTTPConnection(*proxy.address, timeout=10)
        conn.request("HEAD", "/obj/1000")
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("Content-Length") == "1000"
        resp.read()
        assert proxy.stats["not_applicable"] == 1 and proxy.stats["truncate"] == 0


def test_filters_method_and_range(upstream: tuple[str, int]) -> None:
    plan = FaultPlan([Fault("http_503", methods="GET", has_range=True, path=r"^/obj/")])
    with FaultProxy(upstream, plan) as proxy:
        conn = http.client.HTTPConnection(*proxy.address, timeout=10)
        cases = [
            ("GET", "/obj/64", {}, 200),
            ("HEAD", "/obj/64", {"Range": "bytes=0-1"}, 206),
            ("GET", "/chunked/64", {"Range": "bytes=0-1"}, 200),
            ("GET", "/obj/64", {"Range": "bytes=0-1"}, 503),
        ]
        for method, path, headers, want in cases:
            conn.request(method, path, headers=headers)
            resp = conn.getresponse()
            resp.read()
            assert resp.status == want, (method, path, headers)


def test_filters_by_a_header_s_value(upstream: tuple[str, int]) -> None:
    plan = FaultPlan([Fault("http_403", header=("Authorization", r"Credential=OLD/"))])
    with FaultProxy(upstream, plan) as proxy:
        conn = http.client.HTTPConnection(*proxy.address, timeout=10)
        cases = [
            ({"authorization": "AWS4-HMAC-SHA256 Credential=OLD/20260101/..."}, 403),
            ({"Authorization": "AWS4-HMAC-SHA256 Credential=NEW/20260101/..."}, 200),
            ({}, 200),
        ]
        for headers, want in cases:
            conn.request("GET", "/obj/64", headers=headers)
            resp = conn.getresponse()
            resp.read()
            assert resp.status == want, headers


def test_probability_is_seeded(upstream: tuple[str, int]) -> None:
    def outcomes(seed: int) -> list[int]:
        with FaultProxy(upstream, FaultPlan([Fault("http_500", 0.5)]), seed=seed) as proxy:
            conn = http.client.HTTPConnection(*proxy.address, timeout=10)
            statuses = []
            for _ in range(40):
                conn.request("GET", "/obj/10")
                resp = conn.getresponse()
                resp.read()
                statuses.append(resp.status)
            conn.close()
            assert proxy.stats["http_500"] == statuses.count(500)
            return statuses

    first = outcomes(3)
    assert first == outcomes(3)
    assert 0 < first.count(500) < 40


def test_set_plan_at_runtime(upstream: tuple[str, int]) -> None:
    with FaultProxy(upstream) as proxy, requests.Session() as session:
        session.trust_env = False
        assert session.get(f"{proxy.url}/obj/10").status_code == 200
        proxy.set_plan(FaultPlan([Fault("http_500")]))
        assert session.get(f"{proxy.url}/obj/10").status_code == 500
        proxy.set_plan(FaultPlan())
        assert session.get(f"{proxy.url}/obj/10").status_code == 200


# ---------------------------------------------------------------------------------------
# Latency, bandwidth, shutdown


def test_delay_fault_is_at_least_configured(upstream: tuple[str, int]) -> None:
    plan = FaultPlan([Fault("delay", seconds=(0.3, 0.4), times=1)])
    with FaultProxy(upstream, plan) as proxy:
        conn = http.client.HTTPConnection(*proxy.address, timeout=10)
        start = time.monotonic()
        conn.request("GET", "/obj/10")
        assert conn.getresponse().read() == body_of(10)
        assert time.monotonic() - start >= 0.3
        assert proxy.stats["delay"] == 1


def test_first_byte_delay_per_request(upstream: tuple[str, int]) -> None:
    with FaultProxy(upstream, FaultPlan(first_byte_delay=0.05)) as proxy:
        conn = http.client.HTTPConnection(*proxy.address, timeout=10)
        for method in ("GET", "HEAD", "GET"):
            start = time.monotonic()
            conn.request(method, "/obj/1000", headers={"Range": "bytes=0-99"})
            resp = conn.getresponse()
            assert time.monotonic() - start >= 0.05
            resp.read()
        proxy.set_plan(FaultPlan([Fault("http_503")], first_byte_delay=0.05))
        start = time.monotonic()
        conn.request("GET", "/obj/1000")
        assert conn.getresponse().status == 503
        assert time.monotonic() - start >= 0.05


def test_bandwidth_cap_is_shared(upstream: tuple[str, int]) -> None:
    rate, size, clients = 1_000_000, 300_000, 2
    with FaultProxy(upstream, FaultPlan(bandwidth=rate)) as proxy:
        results: list[bytes] = []

        def fetch() -> None:
            conn = http.client.HTTPConnection(*proxy.address, timeout=30)
            conn.request("GET", f"/obj/{size}")
            results.append(conn.getresponse().read())
            conn.close()

        threads = [threading.Thread(target=fetch) for _ in range(clients)]
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - start
    assert results == [body_of(size)] * clients
    burst = TokenBucket(rate).burst
    assert elapsed >= (size * clients - burst) / rate


def test_close_interrupts_a_long_delay_and_joins_threads(upstream: tuple[str, int]) -> None:
    outcome: list[object] = []

    def client(proxy: FaultProxy) -> None:
        conn = http.client.HTTPConnection(*proxy.address, timeout=60)
        try:
            conn.request("GET", "/obj/10")
            outcome.append(conn.getresponse().status)
        except (OSError, http.client.HTTPException) as exc:
            outcome.append(exc)

    proxy = FaultProxy(upstream, FaultPlan([Fault("delay", seconds=30)]))
    with proxy:
        thread = threading.Thread(target=client, args=(proxy,))
        thread.start()
        proxy.wait_stats(lambda s: s["delay"] >= 1)
        start = time.monotonic()
    stopped_in = time.monotonic() - start
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert stopped_in < 25  # well inside the 30 s delay: the wait was interrupted
    assert isinstance(outcome[0], (OSError, http.client.HTTPException))
    assert proxy_threads() == []
    with pytest.raises(OSError):
        socket.create_connection(proxy.address, timeout=2).close()


def test_upstream_down_gives_502() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    with FaultProxy(("127.0.0.1", dead_port)) as proxy:
        data, _ = raw_exchange(proxy, get("/x"))
        assert split_response(data)[0] == 502
        assert proxy.stats["upstream_errors"] == 1


def test_only_loopback() -> None:
    with pytest.raises(ValueError):
        FaultProxy(("10.0.0.1", 80))
    with pytest.raises(ValueError):
        FaultProxy(("127.0.0.1", 80), listen=("0.0.0.0", 0))


def test_parsers() -> None:
    assert parse_rate("50MB/s") == 50e6
    assert parse_rate("2MiB/s") == 2 * 2**20
    assert parse_rate("400Mbit/s") == 50e6
    assert parse_rate("1000") == 1000
    with pytest.raises(ValueError):
        parse_rate("fast")
    fault = parse_fault("delay=0.1,methods=GET+HEAD,range=yes,seconds=5-30,times=3")
    assert fault == Fault(
        "delay", 0.1, methods=("GET", "HEAD"), has_range=True, seconds=(5.0, 30.0), times=3
    )
    with pytest.raises(ValueError):
        parse_fault("explode")


def test_cli_prints_url_and_proxies(upstream: tuple[str, int]) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.faultproxy",
            "--upstream",
            f"{upstream[0]}:{upstream[1]}",
            "--listen",
            "127.0.0.1:0",
            "--first-byte-ms",
            "20",
            "--bandwidth",
            "50MB/s",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url), url
        with requests.Session() as session:
            session.trust_env = False
            start = time.monotonic()
            r = session.get(f"{url}/obj/2048", headers={"Range": "bytes=10-19"})
            assert time.monotonic() - start >= 0.02
        assert r.status_code == 206 and r.content == body_of(2048)[10:20]
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=15)
    assert proc.returncode == 0
    assert "forwarded=1" in err


# ---------------------------------------------------------------------------------------
# Interim answers, TLS on both sides, a listener in another network namespace


def test_interim_answers_are_relayed_before_the_final_one() -> None:
    """An upstream that says "102 Processing" while it works: the client hears the 102
    at once (life, to a client with a first-byte deadline), then the answer."""
    with socket.socket() as lsock:
        lsock.bind(("127.0.0.1", 0))
        lsock.listen()
        release = threading.Event()

        def upstream() -> None:
            conn, _ = lsock.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 102 Processing\r\n\r\n")
                release.wait(10)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                conn.recv(1)

        thread = threading.Thread(target=upstream, daemon=True)
        thread.start()
        with FaultProxy(lsock.getsockname()) as proxy:
            with socket.create_connection(proxy.address, timeout=10) as s:
                s.sendall(get("/slow"))
                first = s.recv(65536)
                assert first.startswith(b"HTTP/1.1 102 Processing\r\n\r\n"), first
                release.set()
                rest = first[len(b"HTTP/1.1 102 Processing\r\n\r\n") :]
                while b"ok" not in rest:
                    rest += s.recv(65536)
            assert split_response(rest)[0] == 200
            assert proxy.wait_stats(lambda st: st["interim"] == 1)
        thread.join(10)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from silofs_ctl.certs_cmd import init_ca, node_cert

    d = tmp_path_factory.mktemp("pki")
    init_ca(str(d))
    node_cert(str(d), "upstream", ["127.0.0.1"])
    return d


@pytest.fixture(scope="module")
def tls_upstream(pki: Path) -> Iterator[tuple[str, int]]:
    """The Upstream handler over TLS, requiring a client certificate of the CA."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pki / "upstream.pem", pki / "upstream.key")
    ctx.load_verify_locations(pki / "ca.pem")
    ctx.verify_mode = ssl.CERT_REQUIRED
    server = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    yield from serve_upstream(server)


def _client_ctx(pki: Path, cert: bool = True) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(pki / "ca.pem")
    if cert:
        ctx.load_cert_chain(pki / "controller.pem", pki / "controller.key")
    return ctx


def _tls_get(pki: Path, address: tuple[str, int], path: str) -> tuple[int, bytes]:
    ctx = _client_ctx(pki, cert=False)
    conn = http.client.HTTPSConnection(*address, timeout=10, context=ctx)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_tls_on_both_sides_faults_the_plain_body(pki: Path, tls_upstream: tuple[str, int]) -> None:
    """A TLS server in front of a TLS upstream (a client certificate towards it): bytes
    pass unchanged, and a corrupt fault flips one byte of the HTTP body itself, which
    the client's TLS layer delivers as it is."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(pki / "upstream.pem", pki / "upstream.key")
    plan = FaultPlan(faults=[Fault("corrupt", path="^/obj/4096$")])
    with FaultProxy(
        tls_upstream, plan, seed=3, tls_server=server_ctx, tls_upstream=_client_ctx(pki)
    ) as proxy:
        assert proxy.url.startswith("https://127.0.0.1:")
        status, body = _tls_get(pki, proxy.address, "/obj/1000")
        assert status == 200 and body == body_of(1000)
        status, body = _tls_get(pki, proxy.address, "/obj/4096")
        assert status == 200 and len(body) == 4096
        diff = [i for i in range(4096) if body[i] != body_of(4096)[i]]
        assert len(diff) == 1
        assert proxy.stats["corrupt"] == 1
        # A plaintext client gets no answer: the handshake fails, counted.
        data, _ = raw_exchange(proxy, get("/obj/10"))
        assert b"HTTP/1.1 200" not in data
        proxy.wait_stats(lambda st: st["tls_errors"] >= 1)


def test_listens_in_another_network_namespace(upstream: tuple[str, int]) -> None:
    """Listening on a namespace's own address (root only): a process in another
    namespace of that subnet reaches the upstream on this host's loopback through it."""
    from tests.support.net import NetnsUnavailable, bridge

    try:
        ctx = bridge("hub", ["leaf"])
        net = ctx.__enter__()
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    try:
        hub = net.address("hub")
        with FaultProxy(upstream, listen=(hub, 0), listen_netns=net.names["hub"]) as proxy:
            assert proxy.url.startswith(f"http://{hub}:")
            code = (
                "import http.client,sys;c=http.client.HTTPConnection(sys.argv[1],int(sys.argv[2]),"
                "timeout=10);c.request('GET','/obj/3000');r=c.getresponse();"
                "sys.stdout.buffer.write(r.read())"
            )
            res = subprocess.run(
                [*net.exec_prefix("leaf"), sys.executable, "-c", code, hub, str(proxy.address[1])],
                capture_output=True,
                timeout=60,
            )
            assert res.returncode == 0, res.stderr
            assert res.stdout == body_of(3000)
        # From this host's own namespace, that address is not there.
        with pytest.raises(OSError):
            socket.create_connection((hub, proxy.address[1]), timeout=1).close()
    finally:
        ctx.__exit__(None, None, None)
