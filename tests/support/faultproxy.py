"""A fault-injecting, latency-adding HTTP/1.1 reverse proxy on 127.0.0.1, stdlib only.

Sits in front of a storage emulator (moto, Azurite, fake-gcs-server) and forwards requests
unchanged: keep-alive, chunked and Content-Length bodies in both directions, Range, HEAD,
pipelined requests, `Expect: 100-continue` (the proxy answers the 100 itself and strips the
header upstream). The Host header is forwarded as the client sent it (the proxy's address).

    plan = FaultPlan(
        faults=[Fault("http_503", probability=0.2, methods="GET", has_range=True)],
        first_byte_delay=0.02,          # seconds, every response
        bandwidth=50e6,                 # bytes/s, one token bucket shared by all connections
    )
    with FaultProxy(upstream=("127.0.0.1", port), faults=plan, seed=1) as proxy:
        proxy.url                       # "http://127.0.0.1:NNNN": the client's endpoint_url
        proxy.stats                     # {"requests": .., "forwarded": .., "http_503": .., ...}
        proxy.set_plan(FaultPlan())     # takes effect from the next request
        proxy.wait_stats(lambda s: s["http_503"] >= 1, timeout=5)

Fault kinds (Fault.kind), at most one per request, the first rule whose filter matches and
whose probability draw succeeds (rules are tried in order):

    http_403               403 AccessDenied (S3 XML body): credentials revoked; not forwarded
    http_500               500 InternalError (S3 XML body); the request is not forwarded
    http_503               503 SlowDown (S3 XML body); the request is not forwarded
    reset_before_response  the request is read, then the connection is reset (RST)
    reset_mid_body         part of the body (`at` of it) is sent, then RST (SO_LINGER 0)
    truncate               part of the body is sent, then a clean close (FIN) while
                           Content-Length promised more
    wrong_content_length   Content-Length announces `at` of the body, the whole body is sent,
                           then the connection is closed
    delay                  `seconds` (or uniform in (lo, hi)) before forwarding the request
    corrupt                one byte of the body is flipped (xor 0xff); length and headers kept

Body faults (reset_mid_body, truncate, wrong_content_length, corrupt) need a body: on a
response without one (HEAD, 204, 304, empty) the fault is not injected and counted as
"not_applicable". A chunked or read-until-close upstream body that gets a body fault is read
whole first and sent with a Content-Length.

Latency: the first response byte leaves no earlier than `first_byte_delay` after the request
head arrived (the emulator's own time overlaps it). `bandwidth` caps everything the proxy
sends to clients (response heads and bodies); request bodies go upstream unthrottled.

Interim answers: the upstream's 1xx answers other than 100 Continue (which the proxy gives
itself) and 101 (an upgrade, which ends the exchange) are relayed as they come, before the
final one: a "102 Processing" from a busy server reaches the client as life.

Bounded: at most `max_connections` concurrent client connections, `max_requests` requests
per connection, 64 KiB request/response heads, `idle_timeout` on both sockets. `close()`
(context-manager exit) stops accepting, shuts every socket down, interrupts delays and
bandwidth waits, and joins every thread. Listens on 127.0.0.1 only and forwards to a
loopback upstream only, unless told a network namespace of this machine for either side
(`listen_netns`, `upstream_netns`, tests/support/net.py): inside a private namespace any
address of it is allowed, nothing leaves the machine.

TLS, for a server that speaks it (a silofs node's mutual-TLS listener): `tls_server` (an
SSLContext, server side) makes the proxy a TLS server to its clients, `tls_upstream` (client
side) a TLS client of its upstream, checked against `upstream_hostname`. The proxy then
sees and faults the HTTP inside (a flipped byte is a flipped byte of the body, not a TLS
record the client's TLS layer would refuse).

CLI, for benchmarks (prints the URL, runs until SIGINT/SIGTERM, prints stats to stderr):

    python -m tests.support.faultproxy --upstream 127.0.0.1:9000 --listen 127.0.0.1:0 \\
        --first-byte-ms 20 --bandwidth 50MB/s [--fault http_503=0.01,methods=GET] [--seed 1]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import fcntl
import ipaddress
import random
import re
import select
import signal
import socket
import ssl
import struct
import sys
import termios
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from tests.support.net import netns_socket

T = TypeVar("T")

__all__ = [
    "FAULT_KINDS",
    "Fault",
    "FaultPlan",
    "FaultProxy",
    "RequestRecord",
    "TokenBucket",
    "parse_fault",
    "parse_rate",
    "main",
]

FAULT_KINDS = (
    "http_403",
    "http_500",
    "http_503",
    "reset_before_response",
    "reset_mid_body",
    "truncate",
    "wrong_content_length",
    "delay",
    "corrupt",
)
_BODY_FAULTS = frozenset({"reset_mid_body", "truncate", "wrong_content_length", "corrupt"})
_COUNTERS = (
    "connections",
    "requests",
    "requests_done",  # requests whose handling ended (answered, refused or cut off)
    "forwarded",
    "not_applicable",
    "upstream_errors",
    "tls_errors",
    "interim",
)

MAX_LINE = 16 * 1024
MAX_HEAD = 64 * 1024
MAX_HEADERS = 200
MAX_TRAILERS = 100
MAX_BUFFERED_BODY = 256 * 1024 * 1024  # a chunked body read whole for a body fault
REPLAYABLE_BODY = 8 * 1024 * 1024  # request bodies up to this are buffered (retry on stale)
IO_CHUNK = 64 * 1024
_POLL_SLICE = 0.1  # seconds; waits also wake at once on close() (event / socket shutdown)

_REASONS = {
    403: "Forbidden",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Slow Down",
}


# ---------------------------------------------------------------------------------------
# Plan


@dataclass(frozen=True)
class Fault:
    """One fault rule: what to inject, how often, and on which requests.

    kind         one of FAULT_KINDS
    probability  chance per matching request, drawn from the proxy's seeded RNG
    methods      only these request methods (a string or a sequence), None = any
    path         only request targets (path and query) where this regex `re.search`es
    has_range    True = only requests with a Range header, False = only without, None = any
    header       (name, regex): only requests with that header (case-insensitive name) whose
                 value the regex `re.search`es, e.g. ("authorization", "Credential=AKIAOLD")
    times        inject at most this many times (per set_plan), None = unlimited
    seconds      for "delay": seconds, or (lo, hi) drawn uniformly
    at           for body faults: the fraction of the body sent (reset_mid_body, truncate)
                 or announced (wrong_content_length); always at least one byte short
    """

    kind: str
    probability: float = 1.0
    methods: tuple[str, ...] | str | None = None
    path: str | None = None
    has_range: bool | None = None
    header: tuple[str, str] | None = None
    times: int | None = None
    seconds: float | tuple[float, float] = 5.0
    at: float = 0.5

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; one of {', '.join(FAULT_KINDS)}")
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"probability {self.probability} not in [0, 1]")
        if not 0.0 <= self.at <= 1.0:
            raise ValueError(f"at {self.at} not in [0, 1]")
        if self.times is not None and self.times < 0:
            raise ValueError("times must be >= 0")
        if isinstance(self.methods, str):
            object.__setattr__(self, "methods", (self.methods,))
        if self.methods is not None:
            object.__setattr__(self, "methods", tuple(m.upper() for m in self.methods))
        if isinstance(self.seconds, (list, tuple)):
            lo, hi = (float(x) for x in self.seconds)
            if not 0 <= lo <= hi:
                raise ValueError(f"seconds range {self.seconds} must satisfy 0 <= lo <= hi")
            object.__setattr__(self, "seconds", (lo, hi))
        elif self.seconds < 0:
            raise ValueError("seconds must be >= 0")
        if self.path is not None:
            re.compile(self.path)
        if self.header is not None:
            name, pattern = self.header
            object.__setattr__(self, "header", (name.lower(), pattern))
            re.compile(pattern)

    def matches(self, method: str, target: str, headers: Iterable[tuple[str, str]]) -> bool:
        if self.methods is not None and method.upper() not in self.methods:
            return False
        if self.path is not None and not re.search(self.path, target):
            return False
        if self.has_range is not None:
            ranged = any(name.lower() == "range" for name, _ in headers)
            if ranged != self.has_range:
                return False
        if self.header is not None:
            name, pattern = self.header
            if not any(n.lower() == name and re.search(pattern, v) for n, v in headers):
                return False
        return True


@dataclass(frozen=True)
class FaultPlan:
    """What the proxy does to traffic: fault rules plus latency and a bandwidth cap.

    faults            Fault rules, tried in order; the first that matches and draws wins
    first_byte_delay  seconds between a request head arriving and the first response byte
    bandwidth         bytes/s for everything sent to clients, shared by all connections;
                      None = unlimited
    """

    faults: tuple[Fault, ...] = ()
    first_byte_delay: float = 0.0
    bandwidth: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "faults", tuple(self.faults))
        for f in self.faults:
            if not isinstance(f, Fault):
                raise TypeError(f"faults must be Fault objects, got {f!r}")
        if self.first_byte_delay < 0:
            raise ValueError("first_byte_delay must be >= 0")
        if self.bandwidth is not None and self.bandwidth <= 0:
            raise ValueError("bandwidth must be > 0 bytes/s (or None for unlimited)")


@dataclass(frozen=True)
class RequestRecord:
    """One request as the proxy saw it (proxy.history keeps the last 10,000)."""

    method: str
    target: str
    fault: str | None  # the fault injected, None if none
    status: int | None  # status sent to the client, None if reset/closed before a response
    client: str = ""  # the client's address (which host asked, behind one proxy)


# ---------------------------------------------------------------------------------------
# Bandwidth


class _Stopping(Exception):
    """The proxy is closing: unwind this connection."""


class _ClientGone(Exception):
    """The client closed its connection while we waited."""


class _ProtocolError(Exception):
    """Malformed HTTP from either side."""


class TokenBucket:
    """A thread-safe token bucket in bytes; `consume` reserves and waits off any debt.

    Starts empty, holds at most `burst` bytes (default 10 ms at the rate, at least one
    send step), so the long-run rate over all callers is `rate` bytes/s.
    """

    def __init__(self, rate: float, burst: float | None = None) -> None:
        self._lock = threading.Lock()
        self._tokens = 0.0
        self._last = time.monotonic()
        self.rate = 0.0
        self.burst = 0.0
        self.set_rate(rate, burst)

    @property
    def step(self) -> int:
        """Bytes per send: about 10 ms at the rate, within 1 KiB .. 64 KiB."""
        return int(min(IO_CHUNK, max(1024, self.rate / 100)))

    def set_rate(self, rate: float, burst: float | None = None) -> None:
        if rate <= 0:
            raise ValueError("rate must be > 0")
        with self._lock:
            self._refill()
            self.rate = float(rate)
            self.burst = float(burst) if burst is not None else max(self.step, rate / 100)
            self._tokens = min(self._tokens, self.burst)

    def _refill(self) -> None:
        now = time.monotonic()
        if self.rate:
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now

    def consume(self, n: int, stop: threading.Event | None = None) -> None:
        """Take `n` bytes; wait until the bucket is out of debt. Raises _Stopping on stop."""
        with self._lock:
            self._refill()
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            if stop is None:
                threading.Event().wait(wait)
            elif stop.wait(wait):
                raise _Stopping


# ---------------------------------------------------------------------------------------
# HTTP parsing helpers

Headers = list[tuple[str, str]]


def _header(headers: Headers, name: str) -> str | None:
    name = name.lower()
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


def _tokens(headers: Headers, name: str) -> list[str]:
    name = name.lower()
    out: list[str] = []
    for k, v in headers:
        if k.lower() == name:
            out.extend(t.strip().lower() for t in v.split(",") if t.strip())
    return out


def _without(headers: Headers, *names: str) -> Headers:
    drop = {n.lower() for n in names}
    return [(k, v) for k, v in headers if k.lower() not in drop]


def _read_line(rfile: Any) -> bytes:
    line = rfile.readline(MAX_LINE + 1)
    if len(line) > MAX_LINE:
        raise _ProtocolError("line too long")
    return line


def _read_head(rfile: Any) -> tuple[str, Headers] | None:
    """A start line and headers, or None on EOF before the first byte."""
    line = _read_line(rfile)
    for _ in range(4):  # RFC 9112 2.2: ignore empty lines before a request line
        if line not in (b"\r\n", b"\n"):
            break
        line = _read_line(rfile)
    if not line:
        return None
    if not line.endswith(b"\n"):
        raise _ProtocolError("EOF inside the start line")
    total = len(line)
    headers: Headers = []
    while True:
        raw = _read_line(rfile)
        total += len(raw)
        if not raw.endswith(b"\n"):
            raise _ProtocolError("EOF inside the header block")
        if raw in (b"\r\n", b"\n"):
            break
        if total > MAX_HEAD or len(headers) >= MAX_HEADERS:
            raise _ProtocolError("header block too large")
        if raw[:1] in (b" ", b"\t"):
            raise _ProtocolError("obsolete header line folding")
        name, sep, value = raw.decode("latin-1").partition(":")
        if not sep or not name or name != name.strip():
            raise _ProtocolError(f"bad header line {raw!r}")
        headers.append((name, value.strip()))
    return line.rstrip(b"\r\n").decode("latin-1"), headers


def _serialize_head(start: str, headers: Headers) -> bytes:
    lines = [start] + [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _content_length(headers: Headers) -> int | None:
    values = {v.strip() for k, v in headers if k.lower() == "content-length"}
    if not values:
        return None
    if len(values) != 1:
        raise _ProtocolError("conflicting Content-Length headers")
    value = values.pop()
    if not value.isdigit():
        raise _ProtocolError(f"bad Content-Length {value!r}")
    return int(value)


def _is_chunked(headers: Headers) -> bool:
    codings = _tokens(headers, "transfer-encoding")
    if not codings:
        return False
    if codings[-1] != "chunked":
        raise _ProtocolError(f"unsupported Transfer-Encoding {codings}")
    return True


def _iter_length(rfile: Any, n: int) -> Iterator[bytes]:
    while n > 0:
        data = rfile.read1(min(n, IO_CHUNK))
        if not data:
            raise _ProtocolError("EOF inside a Content-Length body")
        n -= len(data)
        yield data


def _iter_until_close(rfile: Any) -> Iterator[bytes]:
    while data := rfile.read1(IO_CHUNK):
        yield data


def _iter_chunked(rfile: Any, raw: bool) -> Iterator[bytes]:
    """A chunked body: raw=True yields the framing as read; raw=False yields only data."""
    while True:
        line = _read_line(rfile)
        if not line.endswith(b"\n"):
            raise _ProtocolError("EOF inside a chunk size line")
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise _ProtocolError(f"bad chunk size line {line!r}") from None
        if size < 0:
            raise _ProtocolError("negative chunk size")
        if raw:
            yield line
        if size == 0:
            for _ in range(MAX_TRAILERS + 1):
                trailer = _read_line(rfile)
                if not trailer.endswith(b"\n"):
                    raise _ProtocolError("EOF inside chunked trailers")
                if raw:
                    yield trailer
                if trailer in (b"\r\n", b"\n"):
                    return
            raise _ProtocolError("too many chunked trailers")
        yield from _iter_length(rfile, size)
        crlf = _read_line(rfile)
        if crlf not in (b"\r\n", b"\n"):
            raise _ProtocolError("chunk data not followed by CRLF")
        if raw:
            yield crlf


def _error_body(code: str, message: str, request_id: str) -> bytes:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        f"<RequestId>{request_id}</RequestId><HostId>faultproxy</HostId></Error>"
    ).encode()


def _http_date() -> str:
    return time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime())


def _loopback(host: str, netns: str | None = None) -> str:
    if netns is not None:  # a private namespace: any of its addresses
        return host
    if host == "localhost":
        return "127.0.0.1"
    try:
        ok = ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"upstream must be a loopback address, not {host!r}")
    return host


def _address(value: tuple[str, int] | str | int) -> tuple[str, int]:
    if isinstance(value, int):
        return "127.0.0.1", value
    if isinstance(value, str):
        host, sep, port = value.rpartition(":")
        if not sep:
            raise ValueError(f"expected HOST:PORT, got {value!r}")
        return host.strip("[]"), int(port)
    host, port = value
    return host, int(port)


# ---------------------------------------------------------------------------------------
# The proxy


class FaultProxy:
    """A reverse proxy on 127.0.0.1 in front of `upstream`, injecting `faults`.

    upstream          (host, port), "host:port" or a port; must be loopback
    faults            a FaultPlan (None = pass-through)
    seed              seeds the RNG behind probabilities, delays and corrupt positions
    listen            (host, port) to bind; host must be 127.0.0.1, port 0 = any free one
    max_connections   concurrent client connections; more wait in the listen backlog
    max_requests      requests per client connection before the proxy closes it
    idle_timeout      seconds a client or upstream socket may stay silent
    listen_netns      the network namespace to listen in (then any address of it)
    upstream_netns    the namespace to reach the upstream from (then any address)
    tls_server        an SSLContext (server side): clients speak TLS to the proxy
    tls_upstream      an SSLContext (client side): the proxy speaks TLS to the upstream
    upstream_hostname the name the upstream's certificate is checked against (its host)
    """

    def __init__(
        self,
        upstream: tuple[str, int] | str | int,
        faults: FaultPlan | None = None,
        seed: int | None = None,
        *,
        listen: tuple[str, int] | str = ("127.0.0.1", 0),
        max_connections: int = 256,
        max_requests: int = 100_000,
        idle_timeout: float = 120.0,
        listen_netns: str | None = None,
        upstream_netns: str | None = None,
        tls_server: ssl.SSLContext | None = None,
        tls_upstream: ssl.SSLContext | None = None,
        upstream_hostname: str | None = None,
    ) -> None:
        host, port = _address(upstream)
        self.upstream = (_loopback(host, upstream_netns), port)
        self.upstream_netns = upstream_netns
        self.tls_server = tls_server
        self.tls_upstream = tls_upstream
        self.upstream_hostname = upstream_hostname or host
        listen_host, listen_port = _address(listen)
        if listen_host != "127.0.0.1" and listen_netns is None:
            raise ValueError(f"the proxy listens on 127.0.0.1 only, not {listen_host!r}")
        self.max_requests = max_requests
        self.idle_timeout = idle_timeout
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._plan = FaultPlan()
        self._used: list[int] = []
        self._bucket: TokenBucket | None = None
        self._stats: collections.Counter[str] = collections.Counter()
        self._history: collections.deque[RequestRecord] = collections.deque(maxlen=10_000)
        self._changed = threading.Condition(self._lock)
        self._conns: dict[_Connection, threading.Thread] = {}
        self._slots = threading.BoundedSemaphore(max_connections)
        self._accept_thread: threading.Thread | None = None
        self._closed = False
        self.set_plan(faults or FaultPlan())
        self._lsock = netns_socket(listen_netns)
        try:
            self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._lsock.bind((listen_host, listen_port))
            self._lsock.listen(128)
        except BaseException:
            self._lsock.close()
            raise
        self._wake_r, self._wake_w = socket.socketpair()
        self.address: tuple[str, int] = self._lsock.getsockname()[:2]
        scheme = "https" if tls_server is not None else "http"
        self.url = f"{scheme}://{self.address[0]}:{self.address[1]}"

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> FaultProxy:
        if self._accept_thread is None:
            self._accept_thread = threading.Thread(
                target=self._accept_loop, name=f"faultproxy-accept-{self.address[1]}", daemon=True
            )
            self._accept_thread.start()
        return self

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, timeout: float = 10.0) -> None:
        """Stop accepting, abort every connection (also mid-delay), join every thread."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._accept_thread is not None:
            self._accept_thread.join(timeout)
        self._lsock.close()
        with self._lock:
            conns = dict(self._conns)
        for conn in conns:
            conn.abort()
        deadline = time.monotonic() + timeout
        stuck = []
        for thread in [*conns.values(), self._accept_thread]:
            if thread is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
                if thread.is_alive():
                    stuck.append(thread.name)
        self._wake_r.close()
        self._wake_w.close()
        if stuck:
            raise RuntimeError(f"faultproxy threads did not stop: {stuck}")

    # -- plan and observations -----------------------------------------------------------

    @property
    def plan(self) -> FaultPlan:
        return self._plan

    def set_plan(self, plan: FaultPlan) -> None:
        """Replace the plan; requests already in flight finish under the old one."""
        if not isinstance(plan, FaultPlan):
            raise TypeError("set_plan takes a FaultPlan")
        with self._lock:
            self._plan = plan
            self._used = [0] * len(plan.faults)
            if plan.bandwidth is None:
                self._bucket = None
            elif self._bucket is None:
                self._bucket = TokenBucket(plan.bandwidth)
            else:
                self._bucket.set_rate(plan.bandwidth)

    @property
    def stats(self) -> dict[str, int]:
        """Counters: requests, forwarded, connections, not_applicable, upstream_errors,
        bytes_to_client and one per fault kind injected."""
        with self._lock:
            out = dict.fromkeys((*_COUNTERS, "bytes_to_client", *FAULT_KINDS), 0)
            out.update(self._stats)
            return out

    @property
    def history(self) -> list[RequestRecord]:
        with self._lock:
            return list(self._history)

    def wait_stats(
        self, predicate: Callable[[Mapping[str, int]], bool], timeout: float = 10.0
    ) -> dict[str, int]:
        """Block until predicate(stats) holds (re-checked on every change) or TimeoutError."""

        def stats() -> dict[str, int]:
            out = dict.fromkeys((*_COUNTERS, "bytes_to_client", *FAULT_KINDS), 0)
            out.update(self._stats)
            return out

        return self._wait(stats, predicate, timeout, "stats")

    def wait_history(
        self, predicate: Callable[[list[RequestRecord]], bool], timeout: float = 10.0
    ) -> list[RequestRecord]:
        """Block until predicate(history) holds or TimeoutError. A request is recorded
        after its response went out (a relayed body included), so a client that has read
        the response may look before the proxy's thread has recorded it: wait, don't
        read ``history`` right after a response."""
        return self._wait(lambda: list(self._history), predicate, timeout, "history")

    def settled_history(self, timeout: float = 10.0) -> list[RequestRecord]:
        """The history once every request the proxy has begun is done with (recorded,
        when it is recorded at all): what a test reads after its client got its answers."""
        self.wait_stats(lambda s: s["requests_done"] == s["requests"], timeout)
        return self.history

    def _wait(
        self, read: Callable[[], T], predicate: Callable[[T], bool], timeout: float, what: str
    ) -> T:
        """read() under the lock until predicate holds, woken by every count or record."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                value = read()
                if predicate(value):
                    return value
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"faultproxy {what} never matched; last {value}")
                self._changed.wait(remaining)

    # -- internals used by connections ---------------------------------------------------

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats[key] += n
            self._changed.notify_all()

    def _record(self, record: RequestRecord) -> None:
        with self._lock:
            self._history.append(record)
            self._changed.notify_all()

    def _choose(self, method: str, target: str, headers: Headers) -> tuple[FaultPlan, Fault | None]:
        with self._lock:
            plan = self._plan
            for i, fault in enumerate(plan.faults):
                if not fault.matches(method, target, headers):
                    continue
                if fault.times is not None and self._used[i] >= fault.times:
                    continue
                if fault.probability < 1.0 and self._rng.random() >= fault.probability:
                    continue
                self._used[i] += 1
                return plan, fault
            return plan, None

    def _draw(self, fn: Callable[[random.Random], Any]) -> Any:
        with self._lock:
            return fn(self._rng)

    def _accept_loop(self) -> None:
        poller = select.poll()
        poller.register(self._lsock, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while not self._stop.is_set():
            while not self._slots.acquire(timeout=_POLL_SLICE):
                if self._stop.is_set():
                    return
            try:
                poller.poll()
                if self._stop.is_set():
                    self._slots.release()
                    return
                sock, peer = self._lsock.accept()
            except OSError:
                self._slots.release()
                if self._stop.is_set():
                    return
                continue
            conn = _Connection(self, sock)
            thread = threading.Thread(
                target=self._run_connection,
                args=(conn,),
                name=f"faultproxy-conn-{peer[1]}",
                daemon=True,
            )
            with self._lock:
                self._conns[conn] = thread
            self._count("connections")
            thread.start()

    def _run_connection(self, conn: _Connection) -> None:
        try:
            conn.run()
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            self._slots.release()


class _Connection:
    """One client connection and its (lazily opened, reused) upstream connection."""

    def __init__(self, proxy: FaultProxy, sock: socket.socket) -> None:
        self.p = proxy
        self.client = sock
        sock.settimeout(proxy.idle_timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.rfile: Any = None  # made once the client's TLS handshake (if any) is done
        try:
            self.client_host = str(sock.getpeername()[0])
        except OSError:
            self.client_host = ""
        self.up: socket.socket | None = None
        self.up_rfile: Any = None
        self._sock_lock = threading.Lock()
        self._aborted = False

    # -- lifecycle -----------------------------------------------------------------------

    def run(self) -> None:
        try:
            if self.p.tls_server is not None and not self._handshake(self.p.tls_server):
                return
            self.rfile = self.client.makefile("rb", buffering=IO_CHUNK)
            for _ in range(self.p.max_requests):
                if self.p._stop.is_set() or not self.handle_one():
                    break
        except (_Stopping, _ClientGone, _ProtocolError, OSError):
            pass
        finally:
            self._close_upstream()
            if self.rfile is not None:
                with contextlib.suppress(OSError):
                    self.rfile.close()
            with contextlib.suppress(OSError):
                self.client.close()

    def _record(self, record: RequestRecord) -> None:
        self.p._record(dataclasses.replace(record, client=self.client_host))

    def _handshake(self, context: ssl.SSLContext) -> bool:
        """The client's TLS handshake (in this connection's thread, not the accept loop);
        False, counted, if it failed."""
        try:
            wrapped = context.wrap_socket(self.client, server_side=True)
        except (ssl.SSLError, OSError):
            self.p._count("tls_errors")
            return False
        with self._sock_lock:
            self.client = wrapped
            aborted = self._aborted
        if aborted:
            raise _Stopping
        return True

    def abort(self) -> None:
        """From close(): wake this connection's blocking reads, writes and waits."""
        with self._sock_lock:
            self._aborted = True
            for sock in (self.client, self.up):
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)

    def _close_upstream(self) -> None:
        with self._sock_lock:
            up, self.up = self.up, None
            rfile, self.up_rfile = self.up_rfile, None
        if rfile is not None:
            with contextlib.suppress(OSError):
                rfile.close()
        if up is not None:
            with contextlib.suppress(OSError):
                up.close()

    def _open_upstream(self) -> None:
        self._close_upstream()
        sock = netns_socket(self.p.upstream_netns)
        try:
            sock.settimeout(self.p.idle_timeout)
            sock.connect(self.p.upstream)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.p.tls_upstream is not None:
                sock = self.p.tls_upstream.wrap_socket(
                    sock, server_hostname=self.p.upstream_hostname
                )
        except BaseException:
            sock.close()
            raise
        with self._sock_lock:
            self.up = sock
            self.up_rfile = sock.makefile("rb", buffering=IO_CHUNK)
            aborted = self._aborted
        if aborted:
            raise _Stopping

    def _upstream_reusable(self) -> bool:
        """An idle upstream connection is stale if it is readable (EOF or stray bytes)."""
        if self.up is None:
            return False
        if isinstance(self.up, ssl.SSLSocket) and self.up.pending():
            return False
        poller = select.poll()
        poller.register(self.up, select.POLLIN)
        return not poller.poll(0)

    # -- waiting and sending -------------------------------------------------------------

    def _pause(self, seconds: float) -> None:
        """Wait, waking at once on close(); raise _ClientGone if the client hangs up."""
        deadline = time.monotonic() + seconds
        # A TLS client cannot be peeked at (its bytes are records): just wait.
        watch = not isinstance(self.client, ssl.SSLSocket)
        poller = select.poll()
        poller.register(self.client, select.POLLIN)
        while (remaining := deadline - time.monotonic()) > 0:
            if self.p._stop.is_set():
                raise _Stopping
            if not watch:
                self.p._stop.wait(min(remaining, _POLL_SLICE))
                continue
            if poller.poll(max(1, int(min(remaining, _POLL_SLICE) * 1000))):
                try:
                    peek = self.client.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
                if not peek:
                    raise _ClientGone
                watch = False  # a pipelined request: stop watching, just wait
        if self.p._stop.is_set():
            raise _Stopping

    def _send(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        view = memoryview(data)
        bucket = self.p._bucket
        if bucket is None:
            self.client.sendall(view)
        else:
            step = bucket.step
            for i in range(0, len(view), step):
                piece = view[i : i + step]
                bucket.consume(len(piece), self.p._stop)
                self.client.sendall(piece)
        self.p._count("bytes_to_client", len(view))

    def _reset_client(self) -> None:
        """Close the client connection with RST (SO_LINGER 0) once sent data has left."""
        self._drain_sendq()
        with contextlib.suppress(OSError):
            self.client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        with contextlib.suppress(OSError):
            self.client.close()

    def _finish_client(self) -> None:
        """Close the client connection with FIN after everything sent."""
        with contextlib.suppress(OSError):
            self.client.shutdown(socket.SHUT_WR)

    def _drain_sendq(self, timeout: float = 1.0) -> None:
        """Let queued bytes reach the peer first, so a reset is seen after the partial body."""
        deadline = time.monotonic() + timeout
        buf = bytearray(4)
        while time.monotonic() < deadline:
            try:
                fcntl.ioctl(self.client.fileno(), termios.TIOCOUTQ, buf)
            except OSError:
                return
            if struct.unpack("i", buf)[0] == 0:
                return
            if self.p._stop.wait(0.002):
                return

    # -- one request ---------------------------------------------------------------------

    def handle_one(self) -> bool:
        """Serve one request; True to keep the client connection open."""
        head = _read_head(self.rfile)
        if head is None:
            return False
        t0 = time.monotonic()
        start, headers = head
        parts = start.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            self._send_synthetic(400, "Bad Request", "HEAD", close=True)
            return False
        method, target, version = parts
        self.p._count("requests")
        try:
            return self._handle_counted(t0, start, method, target, version, headers)
        finally:
            self.p._count("requests_done")

    def _handle_counted(
        self, t0: float, start: str, method: str, target: str, version: str, headers: Headers
    ) -> bool:
        try:
            chunked = _is_chunked(headers)
            length = 0 if chunked else (_content_length(headers) or 0)
        except _ProtocolError:
            self._send_synthetic(400, "Bad Request", method, close=True)
            self._record(RequestRecord(method, target, None, 400))
            return False
        conn_tokens = _tokens(headers, "connection")
        client_close = "close" in conn_tokens or (
            version == "HTTP/1.0" and "keep-alive" not in conn_tokens
        )
        plan, fault = self.p._choose(method, target, headers)
        kind = fault.kind if fault else None

        if "100-continue" in _tokens(headers, "expect"):
            self._send(b"HTTP/1.1 100 Continue\r\n\r\n")
            headers = _without(headers, "expect")

        if kind in ("http_403", "http_500", "http_503", "reset_before_response"):
            self._drain_request_body(chunked, length)
            self.p._count(kind)
            if kind == "reset_before_response":
                self._record(RequestRecord(method, target, kind, None))
                self._reset_client()
                return False
            status = {"http_403": 403, "http_500": 500}.get(kind, 503)
            self._pause(max(0.0, t0 + plan.first_byte_delay - time.monotonic()))
            self._send_synthetic(status, _REASONS[status], method, close=client_close)
            self._record(RequestRecord(method, target, kind, status))
            return not client_close

        if kind == "delay":
            seconds = fault.seconds
            if isinstance(seconds, tuple):
                lo, hi = seconds
                seconds = self.p._draw(lambda r: r.uniform(lo, hi))
            self.p._count("delay")
            self._pause(seconds)

        return self._forward(
            method, target, start, headers, chunked, length, client_close, plan, fault, t0
        )

    def _drain_request_body(self, chunked: bool, length: int) -> None:
        body = _iter_chunked(self.rfile, raw=False) if chunked else _iter_length(self.rfile, length)
        for _ in body:
            pass

    def _send_synthetic(self, status: int, reason: str, method: str, close: bool) -> None:
        request_id = uuid.uuid4().hex[:16].upper()
        if status == 503:
            body = _error_body("SlowDown", "Please reduce your request rate.", request_id)
        elif status == 403:
            body = _error_body("AccessDenied", "Access Denied", request_id)
        elif status == 500:
            body = _error_body(
                "InternalError", "We encountered an internal error. Please try again.", request_id
            )
        else:
            body = _error_body(reason.replace(" ", ""), f"faultproxy: {reason}", request_id)
        headers: Headers = [
            ("Content-Type", "application/xml"),
            ("Content-Length", str(len(body))),
            ("Date", _http_date()),
            ("x-amz-request-id", request_id),
            ("Server", "faultproxy"),
        ]
        if close:
            headers.append(("Connection", "close"))
        self._send(_serialize_head(f"HTTP/1.1 {status} {reason}", headers))
        if method != "HEAD":
            self._send(body)
        if close:
            self._finish_client()

    def _send_upstream_request(
        self, start: str, headers: Headers, chunked: bool, length: int, body: bytes | None
    ) -> None:
        assert self.up is not None
        self.up.sendall(_serialize_head(start, headers))
        if body is not None:
            self.up.sendall(body)
        elif chunked:
            for piece in _iter_chunked(self.rfile, raw=True):
                self.up.sendall(piece)
        else:
            for piece in _iter_length(self.rfile, length):
                self.up.sendall(piece)

    def _exchange(
        self, start: str, headers: Headers, chunked: bool, length: int
    ) -> tuple[str, Headers]:
        """Send the request upstream and read the final response head."""
        body: bytes | None = None
        if not chunked and length <= REPLAYABLE_BODY:
            body = b"".join(_iter_length(self.rfile, length))
        for attempt in range(2):
            reused = self._upstream_reusable()
            if not reused:
                self._open_upstream()
            try:
                self._send_upstream_request(start, headers, chunked, length, body)
                while True:
                    head = _read_head(self.up_rfile)
                    if head is None:
                        raise ConnectionResetError("upstream closed before a response")
                    status = int(head[0].split(" ", 2)[1])
                    if not 100 <= status < 200 or status == 101:
                        return head
                    if status != 100:  # we answered 100 Continue ourselves
                        self._send(_serialize_head(*head))
                        self.p._count("interim")
            except (OSError, _ProtocolError, ValueError, IndexError):
                self._close_upstream()
                if self.p._stop.is_set():
                    raise _Stopping from None
                if attempt == 0 and reused and body is not None:
                    continue  # a stale keep-alive connection: replay once on a fresh one
                raise
        raise AssertionError("unreachable")

    def _forward(
        self,
        method: str,
        target: str,
        start: str,
        headers: Headers,
        chunked: bool,
        length: int,
        client_close: bool,
        plan: FaultPlan,
        fault: Fault | None,
        t0: float,
    ) -> bool:
        kind = fault.kind if fault else None
        try:
            rstart, rheaders = self._exchange(start, headers, chunked, length)
            rparts = rstart.split(" ", 2)
            rversion, status = rparts[0], int(rparts[1])
        except (_Stopping, _ClientGone):
            raise
        except (OSError, _ProtocolError, ValueError, IndexError):
            self.p._count("upstream_errors")
            self._record(RequestRecord(method, target, kind, 502))
            self._send_synthetic(502, "Bad Gateway", method, close=True)
            return False
        self.p._count("forwarded")

        rtokens = _tokens(rheaders, "connection")
        upstream_close = "close" in rtokens or (
            rversion == "HTTP/1.0" and "keep-alive" not in rtokens
        )
        if method == "HEAD" or status in (204, 304) or status == 101:
            framing, rlength = "none", 0
        elif _is_chunked(rheaders):
            framing, rlength = "chunked", -1
        elif (cl := _content_length(rheaders)) is not None:
            framing, rlength = "length", cl
        else:
            framing, rlength = "close", -1
            upstream_close = True
        keep = not (client_close or upstream_close or status == 101)

        self._pause(max(0.0, t0 + plan.first_byte_delay - time.monotonic()))

        if kind in _BODY_FAULTS and framing in ("chunked", "close"):
            # Read the whole body to learn its length; send it with a Content-Length.
            data = bytearray()
            source = (
                _iter_chunked(self.up_rfile, raw=False)
                if framing == "chunked"
                else _iter_until_close(self.up_rfile)
            )
            for piece in source:
                data += piece
                if len(data) > MAX_BUFFERED_BODY:
                    raise _ProtocolError("body too large to buffer for a body fault")
            rheaders = _without(rheaders, "transfer-encoding", "content-length")
            rheaders.append(("Content-Length", str(len(data))))
            framing, rlength = "buffered", len(data)
            buffered: bytes | None = bytes(data)
            if upstream_close:
                self._close_upstream()
        else:
            buffered = None

        if kind in _BODY_FAULTS and rlength <= 0:
            self.p._count("not_applicable")
            kind = None

        if kind is None or kind == "delay":
            self._send(_serialize_head(rstart, rheaders))
            try:
                self._relay_body(framing, rlength, buffered)
            except (_ClientGone, OSError):
                # The client hung up mid-body (it closed an open-ended range GET it
                # no longer needs): the request still reached the store, so it counts.
                self._record(RequestRecord(method, target, kind, status))
                raise
            if upstream_close:
                self._close_upstream()
            self._record(RequestRecord(method, target, kind, status))
            if not keep:
                self._finish_client()
            return keep

        assert fault is not None
        n = rlength
        cut = min(n - 1, max(0, int(n * fault.at)))
        body = (
            iter([buffered])
            if buffered is not None
            else _iter_length(self.up_rfile, n)  # framing == "length"
        )
        self.p._count(kind)
        if kind == "wrong_content_length":
            rheaders = _without(rheaders, "content-length") + [("Content-Length", str(cut))]
        self._send(_serialize_head(rstart, rheaders))
        if kind == "corrupt":
            pos = self.p._draw(lambda r: r.randrange(n))
            offset = 0
            for piece in body:
                if offset <= pos < offset + len(piece):
                    flipped = bytearray(piece)
                    flipped[pos - offset] ^= 0xFF
                    piece = flipped
                self._send(piece)
                offset += len(piece)
            self._record(RequestRecord(method, target, kind, status))
            if upstream_close:
                self._close_upstream()
            if not keep:
                self._finish_client()
            return keep
        if kind == "wrong_content_length":
            for piece in body:
                self._send(piece)
            self._record(RequestRecord(method, target, kind, status))
            if upstream_close:
                self._close_upstream()
            self._finish_client()
            return False
        # truncate / reset_mid_body: `cut` bytes, then FIN or RST; the upstream body is unread
        sent = 0
        for piece in body:
            take = piece[: cut - sent]
            self._send(take)
            sent += len(take)
            if sent >= cut:
                break
        self._close_upstream()
        self._record(RequestRecord(method, target, kind, status))
        if kind == "reset_mid_body":
            self._reset_client()
        else:
            self._finish_client()
        return False

    def _relay_body(self, framing: str, length: int, buffered: bytes | None) -> None:
        if framing == "none":
            return
        if buffered is not None:
            self._send(buffered)
        elif framing == "length":
            for piece in _iter_length(self.up_rfile, length):
                self._send(piece)
        elif framing == "chunked":
            for piece in _iter_chunked(self.up_rfile, raw=True):
                self._send(piece)
        else:
            for piece in _iter_until_close(self.up_rfile):
                self._send(piece)


# ---------------------------------------------------------------------------------------
# CLI

_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKMGT]?)(i?)(B|bit|b)?\s*(?:/s|ps)?\s*$")


def parse_rate(text: str) -> float:
    """'50MB/s' -> 50e6 bytes/s. MB = 10**6 bytes, MiB = 2**20; 'bit'/'b' = bits."""
    m = _RATE.match(text)
    if not m:
        raise ValueError(f"bad rate {text!r}; e.g. 50MB/s, 20MiB/s, 400Mbit/s, 1000000")
    number, prefix, binary, unit = m.groups()
    base = 1024 if binary else 1000
    scale = base ** " kMGT".index(prefix.upper()) if prefix else 1
    value = float(number) * scale
    if unit in ("bit", "b"):
        value /= 8
    if value <= 0:
        raise ValueError("rate must be > 0")
    return value


def parse_fault(spec: str) -> Fault:
    """'KIND[=PROB][,methods=GET+HEAD][,path=REGEX][,range=yes|no][,times=N]
    [,seconds=S|LO-HI][,at=FRACTION]' -> Fault."""
    first, *rest = spec.split(",")
    kind, _, prob = first.partition("=")
    kwargs: dict[str, Any] = {"kind": kind.strip()}
    if prob:
        kwargs["probability"] = float(prob)
    for item in rest:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"expected key=value in fault spec, got {item!r}")
        if key == "methods":
            kwargs["methods"] = tuple(m for m in re.split(r"[+|/ ]", value) if m)
        elif key == "path":
            kwargs["path"] = value
        elif key == "range":
            kwargs["has_range"] = value.lower() in ("1", "yes", "true", "y")
        elif key == "times":
            kwargs["times"] = int(value)
        elif key == "seconds":
            lo, dash, hi = value.partition("-")
            kwargs["seconds"] = (float(lo), float(hi)) if dash else float(lo)
        elif key == "at":
            kwargs["at"] = float(value)
        else:
            raise ValueError(f"unknown fault option {key!r}")
    return Fault(**kwargs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tests.support.faultproxy",
        description="Latency/bandwidth/fault proxy on 127.0.0.1 in front of a local emulator.",
    )
    ap.add_argument("--upstream", required=True, help="HOST:PORT of the emulator (loopback)")
    ap.add_argument("--listen", default="127.0.0.1:0", help="127.0.0.1:PORT (default: any)")
    ap.add_argument("--first-byte-ms", type=float, default=0.0, help="first-byte delay, ms")
    ap.add_argument("--bandwidth", type=parse_rate, default=None, help="e.g. 50MB/s (shared)")
    ap.add_argument(
        "--fault",
        type=parse_fault,
        action="append",
        default=[],
        help="KIND[=PROB][,methods=GET][,path=RE][,range=yes][,times=N][,seconds=5-30][,at=F]",
    )
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    plan = FaultPlan(
        faults=tuple(args.fault),
        first_byte_delay=args.first_byte_ms / 1000.0,
        bandwidth=args.bandwidth,
    )
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    with FaultProxy(args.upstream, plan, seed=args.seed, listen=args.listen) as proxy:
        print(proxy.url, flush=True)
        while not done.wait(1.0):
            pass
        stats = proxy.stats
    print(" ".join(f"{k}={v}" for k, v in stats.items() if v), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
