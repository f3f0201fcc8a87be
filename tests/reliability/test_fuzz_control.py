"""Fuzzed control requests against a real daemon over its Unix socket: never a 5xx, never dead.

A seeded generator (SILOFS_FUZZ_SEED, default 1: every run sends the same bytes) writes raw
HTTP/1.1 to the socket: random methods, every route of the table with mutated parameters,
JSON bodies that are random, deeply nested, huge, hold lone surrogates, 5,000-digit or
negative numbers, NaN; bad percent-encoding; bad framing (bad or conflicting Content-Length,
broken chunked bodies, bare LF, header folding, NUL bytes, HTTP/2.0, `HEAD *`, truncated
requests, oversized heads). The daemon serves one real FUSE mount meanwhile, so real
dataset and mount ids are among the mutated parameters.

The promise checked ("the daemon never dies of a request"): every answer is below
500, except 502 from GET /v1/chunks where the store itself failed and 501 for a transfer
coding the server does not implement (RFC 9112 6.1 asks for exactly that); the daemon never exits
and answers GET /v1/status afterwards; a whole request (`HEAD *` included) always gets an
answer; its RSS grows by a bounded amount (reported).
Half the requests come from a forked child that became uid 65534 (a local user with no
rights: everything it may not do must be a 4xx, never a 5xx), half from root (trusted, so
its requests may change state). Short form 500 requests, long form (SILOFS_LONG=1) 10,000.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from tests.support.asuser import Identity, as_user
from tests.support.fixtures import needs_fuse
from tests.support.node import drop_file_cache
from tests.support.poll import wait_for

from .conftest import scale

pytestmark = [needs_fuse, pytest.mark.fuse]

REQUESTS = scale(500, 10_000)
SEED = int(os.environ.get("SILOFS_FUZZ_SEED", "1"))
ANSWER_TIMEOUT = 30.0  # seconds for one answer; a hang is counted and fails the check
RSS_GROWTH_LIMIT = 64 << 20  # bytes; the daemon holds no per-request state it keeps

ROUTES = [
    ("GET", "/v1/status"),
    ("POST", "/v1/datasets"),
    ("GET", "/v1/datasets/{name}"),
    ("POST", "/v1/mounts"),
    ("DELETE", "/v1/mounts/{mount}"),
    ("PUT", "/v1/mounts/{mount}/stats"),
    ("GET", "/v1/chunks"),
    ("GET", "/v1/datasets/{name}/cache"),
    ("PUT", "/v1/datasets/{name}/cache"),
    ("GET", "/v1/datasets/{name}/admission"),
    ("PUT", "/v1/datasets/{name}/admission"),
    ("GET", "/v1/jobs/{job}/io"),
    ("PUT", "/v1/jobs/{job}/io"),
    ("GET", "/v1/allocations"),
    ("GET", "/metrics"),
]
METHODS = ["GET", "PUT", "POST", "DELETE", "PATCH", "HEAD", "OPTIONS", "TRACE", "CONNECT"]
FIELDS = [
    "uri", "refresh", "endpoint_url", "dataset", "job", "mountpoint", "chunk_size",
    "io_limit", "admission", "bytes", "bytes_per_s", "mode", "epoch", "touched",
    "bytes_read", "hits", "misses", "hit_bytes", "miss_bytes", "corrupt_chunks", "x",
]  # fmt: skip
BAD_SEGMENTS = [
    "", ".", "..", "%", "%zz", "%2", "%00", "%C0%AF", "%ED%A0%80", "%FF%FE", "a%2Fb",
    "%2E%2E%2F%2E%2E%2Fetc%2Fpasswd", "\u2603", "x" * 5000, "9" * 5000, "-1", "0",
    "18446744073709551617", "NaN", "1e999", "%25", "?", "#", ";", "a b", "\t",
]  # fmt: skip


def _req(method: str, target: str, body: bytes | None = None) -> tuple[str, bytes, bool]:
    head = f"{method} {target} HTTP/1.1\r\nHost: localhost\r\n"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return f"{method} {target[:40]}", head.encode() + b"\r\n" + (body or b""), True


def corpus(known: dict[str, list[str]]) -> list[tuple[str, bytes, bool]]:
    """Requests every run sends first: what earlier long runs found."""
    deep = b"[" * 100_000 + b"]" * 100_000
    uri = quote(known["uri"][0], safe="")
    return [
        ("HEAD *", b"HEAD * HTTP/1.1\r\nHost: x\r\n\r\n", True),
        _req("HEAD", "/v1/status"),
        _req("POST", "/v1/datasets", deep),
        _req("POST", "/v1/mounts", b'{"a":' * 50_000 + b"1" + b"}" * 50_000),
        _req("PUT", f"/v1/datasets/{uri}/cache", b'{"bytes": ' + b"9" * 5000 + b"}"),
        _req("PUT", f"/v1/datasets/{uri}/cache", b'{"bytes": -1}'),
        _req("PUT", "/v1/jobs/fuzzjob/io", b'{"bytes_per_s": -5}'),
        _req("PUT", "/v1/jobs/fuzzjob/io", b'{"bytes_per_s": ' + b"9" * 5000 + b"}"),
        _req("PUT", "/v1/jobs/%ED%A0%80/io", b'{"bytes_per_s": 1}'),
        _req("POST", "/v1/mounts", b'{"dataset": 1, "job": "\\ud800", "mountpoint": "/x"}'),
        _req("POST", "/v1/datasets", b'{"uri": "\\udfff"}'),
        _req(
            "POST", "/v1/datasets", b'{"uri": "' + uri.encode() + b'", "endpoint_url": "notaurl"}'
        ),
        _req("GET", "/v1/datasets/http%3A%2F%2F%5B%3A%3A1"),
        _req("GET", "/v1/datasets/http%3A%2F%2F%5B%3A%3A1/cache"),
        _req("GET", "/v1/datasets/%zz"),
        _req("GET", "/v1/chunks?mount=%zz&key=%ED%A0%80&index=" + "9" * 5000),
        _req("GET", "/v1/status?" + "a=1&" * 2000),
    ]


class Fuzzer:
    """Builds raw requests from a seeded RNG; `known` holds real ids to mutate."""

    def __init__(self, rnd: random.Random, known: dict[str, list[str]]) -> None:
        self.rnd = rnd
        self.known = known
        self._corpus = corpus(known)

    # -- values ----------------------------------------------------------------------
    def text(self) -> str:
        r = self.rnd
        choice = r.randrange(9)
        if choice == 0:
            return "".join(chr(r.randrange(0x20, 0x7F)) for _ in range(r.randrange(20)))
        if choice == 1:
            return "".join(chr(r.randrange(0x80, 0x3000)) for _ in range(r.randrange(1, 10)))
        if choice == 2:
            return "x" * r.choice([255, 256, 4097, 70_000])
        if choice == 3:
            return r.choice(["10GB", "-5M", "1.5GiB", "200MB/s", "0", "unlimited", "1e9", "lru"])
        if choice == 4:
            return r.choice(["uniform", "lru", "fast", "", " ", "\x00", "../../etc/shadow"])
        if choice == 5:
            return r.choice(self.known["uri"]) + r.choice(["", "x", "/..", "%00", "?a=b"])
        if choice == 6:
            return r.choice(["notaurl", "http://127.0.0.1:1", "ftp://x", "http://[::1", "file:///"])
        return r.choice(sum(self.known.values(), []))

    def number(self) -> int | float:
        r = self.rnd
        return r.choice(
            [
                0, -1, 1, -(2**63), 2**63, 2**64 + 1, 65536, 1 << 30, -(1 << 40),
                r.randrange(-(10**6), 10**6), 0.5, -0.0, 1e308, 64 << 10,
            ]
        )  # fmt: skip

    def value(self, depth: int = 0) -> str:
        """A JSON text (not always valid JSON on purpose: NaN, surrogates, huge numbers)."""
        r = self.rnd
        choice = r.randrange(14 if depth < 3 else 9)
        if choice == 0:
            return "null"
        if choice == 1:
            return r.choice(["true", "false"])
        if choice == 2:
            return json.dumps(self.number())
        if choice == 3:
            return r.choice(["-", ""]) + "".join(r.choice("123456789") for _ in range(5000))
        if choice == 4:
            return r.choice(["NaN", "Infinity", "-Infinity", "1e99999", "-0", "01", "1.", ".5"])
        if choice == 5:
            return '"' + r.choice(["\\ud800", "\\udfff", "a\\ud83d", "\\udc00x"]) + '"'
        if choice == 6:
            return '"' + r.choice(["\\u0000", "\\n", "\\\\", "%zz", "\\u2028"]) + '"'
        if choice in (7, 8):
            return json.dumps(self.text())
        if choice == 9:
            return "[" + ",".join(self.value(depth + 1) for _ in range(r.randrange(4))) + "]"
        return self.obj(depth + 1)

    def obj(self, depth: int = 0) -> str:
        r = self.rnd
        keys = r.sample(FIELDS, r.randrange(0, 6))
        if r.random() < 0.1:
            keys.append(self.text())
        parts = [f"{json.dumps(k)}:{self.value(depth)}" for k in keys]
        return "{" + ",".join(parts) + "}"

    def body(self) -> bytes:
        r = self.rnd
        choice = r.randrange(12)
        if choice == 0:
            return b""
        if choice == 1:  # deeply nested: a recursion limit must be a 400, not a 500
            n = r.choice([100, 1000, 100_000, 400_000])
            opener, closer = r.choice([("[", "]"), ('{"a":', "}")])
            return (opener * n + "1" + closer * n).encode()
        if choice == 2:  # near and over the 1 MiB body limit
            n = r.choice([(1 << 20) - 200, (1 << 20) + 1, 3 << 20])
            return ('{"uri":"' + "a" * n + '"}').encode()
        if choice == 3:
            return bytes(r.randrange(256) for _ in range(r.randrange(1, 200)))
        if choice == 4:
            return b'{"uri": "\xff\xfe\xed\xa0\x80"}'  # not UTF-8
        if choice == 5:
            return r.choice([b"[]", b'"x"', b"1", b"null", b"{", b'{"a":1}{', b"{}"])
        if choice == 6:  # a big flat object with many keys
            return json.dumps({f"k{i}": i for i in range(r.choice([1000, 30_000]))}).encode()
        return self.obj().encode()

    # -- targets ---------------------------------------------------------------------
    def segment(self) -> str:
        r = self.rnd
        choice = r.randrange(6)
        if choice == 0:
            return r.choice(BAD_SEGMENTS)  # raw, possibly bad percent-encoding
        if choice == 1:
            return quote(self.text(), safe="")
        if choice == 2:  # a real name, mutated
            name = r.choice(sum(self.known.values(), []))
            return quote(name, safe="") + r.choice(["", "x", "%", "%2", "/..", "/extra"])
        return quote(r.choice(sum(self.known.values(), [])), safe="")

    def query(self) -> str:
        r = self.rnd
        params = []
        for name in r.sample(["mount", "key", "index", "refetch", "content_id", "x"], 3):
            value = r.choice(
                [
                    r.choice(self.known["mount"]) if self.known["mount"] else "m",
                    "0" * 32, "f" * 32, "zz", "-1", "9" * 5000, "%", "%zz", "%00",
                    "1", "", str(r.randrange(10**6)), "%ED%A0%80",
                ]
            )  # fmt: skip
            params.append(f"{name}={value}" if r.random() < 0.9 else name)
        if r.random() < 0.1:
            params.append("&&==&")
        return "?" + "&".join(params)

    def target(self) -> tuple[str, str]:
        """(route method, target) from the route table with mutated parameters."""
        r = self.rnd
        if r.random() < 0.05:
            return "GET", r.choice(
                [
                    "*",
                    "//",
                    "/v1/",
                    "/v1/../v1/status",
                    "http://x/v1/status",
                    "/" + "a/" * 3000,
                    "/%",
                    "/v1/status%00",
                    "/metrics?%zz",
                ]
            )
        method, template = r.choice(ROUTES)
        path = template
        for param in ("{name}", "{mount}", "{job}"):
            if param in path:
                path = path.replace(param, self.segment())
        if template == "/v1/chunks" or r.random() < 0.1:
            path += self.query()
        return method, path

    # -- whole requests --------------------------------------------------------------
    def request(self) -> tuple[str, bytes, bool]:
        """The fixed corpus first (every form sends it), then random requests."""
        if self._corpus:
            return self._corpus.pop(0)
        return self.random_request()

    def random_request(self) -> tuple[str, bytes, bool]:
        """(kind, raw bytes, complete): complete=False means the client half-closes
        after sending, so a request the daemon waits to complete ends."""
        r = self.rnd
        route_method, target = self.target()
        method = route_method if r.random() < 0.6 else r.choice(METHODS)
        body = self.body() if method in ("PUT", "POST", "PATCH") or r.random() < 0.1 else b""
        kind = r.choices(["good", "framing"], weights=[85, 15])[0]
        if kind == "good":
            head = [f"{method} {target} HTTP/1.1", "Host: localhost"]
            if body or method in ("PUT", "POST", "PATCH"):
                head.append(f"Content-Length: {len(body)}")
                head.append("Content-Type: application/json")
            if r.random() < 0.05:
                head.append("Expect: 100-continue")
            raw = ("\r\n".join(head) + "\r\n\r\n").encode("utf-8", "surrogateescape") + body
            return f"{method} {target.split('?')[0][:40]}", raw, True
        return self.bad_framing(method, target, body)

    def bad_framing(self, method: str, target: str, body: bytes) -> tuple[str, bytes, bool]:
        r = self.rnd
        t = target.encode("utf-8", "surrogateescape")
        body = body[:4096]
        cases: list[tuple[str, bytes, bool]] = [
            ("HEAD *", b"HEAD * HTTP/1.1\r\nHost: x\r\n\r\n", True),
            ("OPTIONS *", b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n", True),
            ("no host", b"GET " + t + b" HTTP/1.1\r\n\r\n", True),
            ("http/2.0", b"GET " + t + b" HTTP/2.0\r\nHost: x\r\n\r\n", True),
            ("http/1.0", b"GET " + t + b" HTTP/1.0\r\n\r\n", True),
            ("bare LF", b"GET " + t + b" HTTP/1.1\nHost: x\n\n", True),
            ("garbage line", bytes(r.randrange(256) for _ in range(60)) + b"\r\n\r\n", False),
            ("NUL in target", b"GET /v1/sta\x00tus HTTP/1.1\r\nHost: x\r\n\r\n", True),
            ("space in target", b"GET /v1/ status HTTP/1.1\r\nHost: x\r\n\r\n", True),
            ("header no colon", b"GET /v1/status HTTP/1.1\r\nHost: x\r\nBroken\r\n\r\n", True),
            ("obs-fold", b"GET /v1/status HTTP/1.1\r\nHost: x\r\nA: b\r\n c\r\n\r\n", True),
            ("CL not a number", b"PUT " + t + b" HTTP/1.1\r\nHost: x\r\nContent-Length: abc"
             b"\r\n\r\n" + body, True),
            ("CL negative", b"PUT " + t + b" HTTP/1.1\r\nHost: x\r\nContent-Length: -5"
             b"\r\n\r\n" + body, True),
            ("CL 5000 digits", b"POST " + t + b" HTTP/1.1\r\nHost: x\r\nContent-Length: "
             + b"9" * 5000 + b"\r\n\r\n", True),
            ("CL conflicting", b"POST " + t + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
             b"Content-Length: 3\r\n\r\n{}", True),
            ("CL and chunked", b"POST " + t + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
             b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", True),
            ("CL too long", b"POST " + t + b" HTTP/1.1\r\nHost: x\r\nContent-Length: "
             + str(len(body) + 100).encode() + b"\r\n\r\n" + body, False),
            ("bad chunk size", b"POST " + t + b" HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: "
             b"chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", True),
            ("chunked ok", b"PUT " + t + b" HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
             b"\r\n\r\n" + f"{len(body):x}".encode() + b"\r\n" + body + b"\r\n0\r\n\r\n", True),
            ("chunked truncated", b"POST " + t + b" HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: "
             b"chunked\r\n\r\n10\r\nabc", False),
            ("unknown TE", b"POST " + t + b" HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip"
             b"\r\n\r\n", True),
            ("head truncated", b"GET /v1/status HTTP/1.1\r\nHost: x\r\n", False),
            ("huge header", b"GET /v1/status HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 70_000
             + b"\r\n\r\n", True),
            ("many headers", b"GET /v1/status HTTP/1.1\r\nHost: x\r\n"
             + b"".join(b"X-%d: y\r\n" % i for i in range(2000)) + b"\r\n", True),
            ("pipelined", b"GET /v1/status HTTP/1.1\r\nHost: x\r\n\r\n" * 3
             + method.encode() + b" " + t + b" HTTP/1.1\r\nHost: x\r\n\r\n", True),
            ("lowercase method", b"get /v1/status HTTP/1.1\r\nHost: x\r\n\r\n", True),
            ("long method", b"G" * 5000 + b" /v1/status HTTP/1.1\r\nHost: x\r\n\r\n", True),
            ("empty", b"", False),
        ]  # fmt: skip
        return r.choice(cases)


def send(sock_path: str, raw: bytes, complete: bool) -> list[int] | None:
    """Send one raw request; the statuses the daemon answered (several when pipelined),
    [] when it closed without an answer, None when it did not answer in time."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(ANSWER_TIMEOUT)
    try:
        s.connect(sock_path)
        try:
            s.sendall(raw)
            if not complete:
                s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon refused early (413/431) and closed: read what it said
        data = b""
        deadline = time.monotonic() + ANSWER_TIMEOUT
        while True:
            statuses = _statuses(data, raw.startswith(b"HEAD"))
            if statuses is not None and _answered_all(raw, statuses, data):
                return statuses
            if time.monotonic() > deadline:
                return None
            try:
                got = s.recv(1 << 16)
            except TimeoutError:
                return None
            except ConnectionResetError:
                got = b""
            if not got:
                return _statuses(data, raw.startswith(b"HEAD")) or []
            data += got
    finally:
        s.close()


def _statuses(data: bytes, head: bool) -> list[int] | None:
    """Final status codes of the complete-headed responses in `data` (1xx skipped);
    `head`: the answers to HEAD carry no body whatever their Content-Length says."""
    out = []
    pos = 0
    while True:
        end = data.find(b"\r\n\r\n", pos)
        if end < 0:
            return out or None
        line = data[pos : data.find(b"\r\n", pos)]
        parts = line.split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
            return out or None
        status = int(parts[1])
        length = 0
        for header in data[pos:end].split(b"\r\n")[1:]:
            name, _, value = header.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        pos = end + 4 + (0 if status < 200 or head else length)
        if status >= 200:
            out.append(status)
        if pos > len(data):
            return out or None


def _answered_all(raw: bytes, statuses: list[int], data: bytes) -> bool:
    # One answer per request; pipelined cases send four. After an error the daemon closes,
    # so fewer answers then EOF is also a finished exchange (handled by the caller).
    return len(statuses) >= max(1, raw.count(b" HTTP/1.1\r\nHost: x\r\n\r\n"))


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def fuzz(sock_path: str, fuzzer: Fuzzer, n: int, daemon_pid: int, who: str) -> dict[str, Any]:
    """Send `n` fuzzed requests; tallies as plain data (a forked child sends them back)."""
    answers: Counter[str] = Counter()
    bad: list[str] = []
    hangs: list[str] = []
    dropped: list[str] = []
    dead = ""
    for i in range(n):
        kind, raw, complete = fuzzer.request()
        statuses = send(sock_path, raw, complete)
        if statuses is None:
            answers["no answer in time"] += 1
            hangs.append(f"{who} #{i} {kind}: {raw[:120]!r}")
        elif not statuses:
            answers["closed without answer"] += 1
            if complete:  # the daemon had the whole request: it owes an answer
                dropped.append(f"{who} #{i} {kind}: {raw[:120]!r}")
        for st in statuses or []:
            answers[f"{st // 100}xx"] += 1
            # 502: the store failed a chunk GET (the daemon is a gateway there); 501: RFC
            # 9112 6.1 asks for it on a transfer coding the server does not implement.
            allowed = (st == 502 and kind.startswith("GET /v1/chunks")) or (
                st == 501 and kind == "unknown TE"
            )
            if st >= 500 and not allowed:
                bad.append(f"{who} #{i} {kind} -> {st}: {raw[:120]!r}")
        if i % 50 == 49 and not os.path.exists(f"/proc/{daemon_pid}"):
            dead = f"after {who} request #{i} {kind}: {raw[:200]!r}"
            break
    return {"answers": dict(answers), "bad": bad, "hangs": hangs, "dropped": dropped, "dead": dead}


def fuzz_as_nobody(sock_path: str, fuzzer: Fuzzer, n: int, daemon_pid: int) -> dict[str, Any]:
    """`fuzz` in a forked child that became uid/gid 65534: a local user with no rights."""
    return as_user(Identity.nobody(), fuzz, sock_path, fuzzer, n, daemon_pid, "uid 65534")


@pytest.fixture
def sock_dir() -> Iterator[str]:
    """A socket directory uid 65534 can reach (tmp_path's parents are 0700)."""
    path = tempfile.mkdtemp(prefix="silofs-fuzz-")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_fuzzed_control_requests(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path, sock_dir: str, figures
) -> None:
    local_store.apply_env(monkeypatch)
    # No store SDK may wander off to a real cloud or a metadata service.
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("NO_GCE_CHECK", "true")
    rnd = random.Random(SEED)
    local_store.create(bucket_name, {f"d/{i}.bin": rnd.randbytes(5000) for i in range(20)})
    uri = local_store.uri(bucket_name)
    node = make_node(cache_size="64M", socket=os.path.join(sock_dir, "ctl.sock"))
    # Fuzzed URIs name datasets that cannot be listed: the daemon logs each failure once,
    # as it should. Nothing else may be an ERROR (a 500's traceback is one).
    node.expect_errors(r"ERROR silofs\.node\.datasets: dataset ")
    mp = node.mount(uri, tmp_path / "mnt", "--job", "fuzzjob")
    status = node.status()
    ds = status["datasets"][0]
    known = {
        "uri": [ds["uri"], uri, str(local_store.root / bucket_name), "/etc", "/nonexistent",
                "s3://silofs-fuzz/p/", "gs://silofs-fuzz/", "az://acct/cont/", "file:///etc/passwd",
                "/etc/shadow", "file:///root/"],
        "name": [str(ds["id"]), ds.get("name", "") or "x"],
        "mount": [m["id"] for m in status["mounts"]],
        "job": ["fuzzjob", "other"],
    }  # fmt: skip
    assert node.proc is not None
    pid = node.proc.pid
    rss_before = rss(pid)
    started = time.monotonic()
    # Half as root (trusted: may change state), half as uid 65534 (hostile) when we are root.
    as_nobody = REQUESTS // 2 if os.geteuid() == 0 else 0
    results = [fuzz(node.socket, Fuzzer(rnd, known), REQUESTS - as_nobody, pid, "root")]
    if as_nobody:
        results.append(fuzz_as_nobody(node.socket, Fuzzer(random.Random(SEED + 1), known),
                                      as_nobody, pid))  # fmt: skip
    elapsed = time.monotonic() - started
    answers: Counter[str] = Counter()
    for res in results:
        answers.update(res["answers"])
    bad = [b for res in results for b in res["bad"]]
    hangs = [h for res in results for h in res["hangs"]]
    dropped = [d for res in results for d in res["dropped"]]
    died = [res["dead"] for res in results if res["dead"]]

    alive = node.proc.poll() is None
    rss_after = rss(pid) if alive else 0
    figures.update(
        seed=SEED,
        requests=REQUESTS,
        as_uid_65534=as_nobody,
        answers=dict(answers),
        server_errors=len(bad),
        server_error_examples=[b[:160] for b in bad[:5]],
        hangs=len(hangs),
        dropped=len(dropped),
        dropped_examples=[d[:160] for d in dropped[:5]],
        daemon_deaths=0 if alive else 1,
        rss_before_mb=round(rss_before / 2**20, 1),
        rss_after_mb=round(rss_after / 2**20, 1),
        rss_growth_mb=round((rss_after - rss_before) / 2**20, 1),
        seconds=round(elapsed, 1),
        # Reported, not asserted here (the suite's log fixture judges logs): a traceback
        # means a request reached code that did not expect it.
        daemon_log_tracebacks=(node.logs / "daemon.log").read_bytes().count(b"Traceback"),
    )
    assert alive and not died, (
        f"the daemon died {died}: {(node.logs / 'daemon.log').read_text()[-2000:]}"
    )
    assert "datasets" in wait_for(node.status, what="status after the fuzz")
    # The mount still reads (it re-registers if the fuzz deleted its registration).
    source = local_store.root / bucket_name / "d/0.bin"
    drop_file_cache(mp / "d/0.bin")
    assert (mp / "d/0.bin").read_bytes() == source.read_bytes()
    assert not bad, f"{len(bad)} answers were 5xx:\n" + "\n".join(bad[:20])
    assert not hangs, f"{len(hangs)} requests got no answer in {ANSWER_TIMEOUT}s:\n" + "\n".join(
        hangs[:10]
    )
    assert not dropped, f"{len(dropped)} whole requests got no answer:\n" + "\n".join(dropped[:10])
    assert rss_after - rss_before < RSS_GROWTH_LIMIT, figures
