"""This node's client of the other members' peer routes: mutual TLS, pooled keep-alive
connections, and deadlines that keep a read from waiting on a dead member.

Owns, per member, a pool of at most PEER_POOL blocking TLS connections (this node's
certificate as the client's, the cluster CA checking the member's, which must carry the
node role), HTTP/1.1 framing of one request and its answer (bodies read straight into
one buffer with recv_into, no copy through a parser; TLS driven through memory BIOs,
TLSPipe, so ciphertext is read in large pieces), and the bounds every exchange
keeps: connect, TLS handshake and the answer's first byte within peer_timeout_seconds
(a "102 Processing" counts as life and starts the bound again, for at most
MAX_PROGRESS_SECONDS in all), then the body at
peer_floor_rate at least. A failure is a PeerError naming its reason (REASONS).
Blocking, for worker threads (node/cluster.py runs each exchange in one, so TLS and
copies run outside the trio loop, in parallel); thread-safe. Never decides what a
failure means for the member, never verifies chunk bytes (node/cluster.py does both).
"""

from __future__ import annotations

import concurrent.futures
import ipaddress
import logging
import math
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from silofs.control.thread_conn import RECV_LIMIT, SEND_LIMIT, wait_until
from silofs.control.tls import NO_PASSPHRASE, certificate_identity
from silofs.units import is_digits

log = logging.getLogger(__name__)

# Connections to one member open at once (in use or idle). The members' TLS listeners
# take tcp_max_connections each (docs/SECURITY.md): every member may hold this many.
PEER_POOL = 4
# An idle connection older than this is closed, not reused: it holds a slot of the
# member's listener.
IDLE_CLOSE_SECONDS = 30.0
# The member's listener closes a member connection idle this long (node/service.py
# member_bounds): after its pool would have (the prober sweeps every 0.5 s), so the
# listener never closes one a pool is about to reuse, but long before the controller's
# 300 s, so a member that died or was cut off holds no slot of tcp_max_connections
# longer than this.
LISTENER_IDLE_SECONDS = IDLE_CLOSE_SECONDS + 15.0
# A connection checked in this recently is reused without looking whether the member
# closed it meanwhile (a poll: a system call, which in a connection thread lets the
# others take the GIL, and a wake-up more per exchange). A member that did is found out
# before any byte of the answer, and the request sent again on a new connection
# (_StaleConnection); bytes a member sent unasked are read as an answer, which the
# asker checks as any other (a chunk's every block and its identity).
LOOK_AFTER_SECONDS = 1.0
MAX_HEAD = 16 << 10  # a peer's answer head (status line and headers)
# A member's "102 Processing" answers extend the first-byte bound for at most this long
# in all: an honest home sends them while its own store GET runs (connect 10 s, read
# 30 s a try) or while it waits on its serve cap, but a home whose GET hangs, or a
# member that sends 102s forever, would otherwise hold the read for good. Past it the
# member is down ("timeout") and the asker reads the chunk from the store itself.
MAX_PROGRESS_SECONDS = 60.0
# The largest body a member may answer: a chunk value (64 MiB chunk and its header).
MAX_BODY = (64 << 20) + (1 << 20)
# The largest answer that is no chunk's value and no share table: an error or a charge
# (any status but 200: one line of JSON), a ping's or an introduction's. A body's length
# sets how long it may take (at the floor rate): a member claiming 64 MiB for a 409 held
# the read it was asked for a minute, where a chunk's own answer is held to its length.
MAX_SMALL_ANSWER = 64 << 10
_RECV = 256 << 10
# The most ciphertext of one TLS record (header, 2**14 bytes, TLS 1.2's largest
# expansion): what the SSL object may hold of a record it has not decrypted yet.
_MAX_RECORD = 5 + (1 << 14) + 2048
# A request's bytes are encrypted this much at a time before they are sent.
_WRITE_SLICE = 1 << 20

# Name lookups of members' hosts run here, so that a connect waits for one no longer
# than its bound (getaddrinfo takes no timeout: with DNS not answering, glibc's is 5 s a
# try, tried twice). A lookup past the bound is left to end in its thread.
_LOOKUPS = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="silofs-peer-dns")

# Why an exchange or its answer failed, as counted in status and /metrics.
REASONS = ("refused", "timeout", "short", "http", "corrupt", "foreign", "busy")


class PeerError(Exception):
    """An exchange with a member failed; `reason` is one of REASONS."""

    def __init__(self, reason: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.status = status  # the member's HTTP answer, for reason "http"

    def __str__(self) -> str:
        return self.message


class Abandoned(Exception):
    """The asker's own client left while a member worked on its request: the exchange
    was dropped (its connection closed, so the member stops too). No member failure."""


@dataclass
class PeerReply:
    status: int
    headers: dict[str, str]  # read, never changed: shared by answers with one head
    body: bytearray | memoryview  # a view: received where the caller's `into` said


@dataclass(frozen=True)
class Bounds:
    """How long an exchange may take: `timeout` seconds to connect, handshake and hear
    the first byte of the answer (each 102 starts it again), then the body at
    `floor_rate` bytes/s at least (plus `timeout` of slack)."""

    timeout: float
    floor_rate: float


def client_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    """This node as a client of the other members: its certificate (which needs the
    clientAuth purpose and the node role: `silofs-ctl certs node`) and the cluster CA,
    which must have issued the member's certificate for the host of its address."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key, password=NO_PASSPHRASE)
    ctx.load_verify_locations(cafile=ca)
    return ctx


class TLSPipe:
    """A client's TLS session over a blocking socket, through memory BIOs: ciphertext is
    read up to _RECV bytes per recv, so a chunk-sized answer costs a few recv calls and
    one SSLObject.read per 16 KiB record, where an SSLSocket makes a poll and a recv for
    every record. Reads and sends are bounded by `deadline` (monotonic): the socket
    blocks, each wait limited by the kernel (control/thread_conn.py wait_limit: no poll
    before each call, as a Python socket timeout makes), the limit set again only when
    it would overrun the deadline; records already received are decrypted without a
    system call. What _exchange calls: sendall, recv_into and
    read_exactly (short at the member's close, with or without its close_notify, as
    SSLSocket's default; TimeoutError past the deadline)."""

    def __init__(
        self,
        raw: socket.socket,
        obj: ssl.SSLObject,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
    ) -> None:
        self.raw, self.obj, self.incoming, self.outgoing = raw, obj, incoming, outgoing
        self.deadline = math.inf  # monotonic: reads and sends past it raise TimeoutError
        self._ciphertext = memoryview(bytearray(_RECV))  # what _fill receives into
        # The socket blocks, each wait limited by the kernel (wait_limit), as last set:
        # the receives' and the sends' apart.
        raw.settimeout(None)
        self.recv_limit: float | None = None
        self.send_limit: float | None = None

    @classmethod
    def connect(
        cls, raw: socket.socket, context: ssl.SSLContext, host: str, deadline: float
    ) -> TLSPipe:
        """The handshake over `raw`, within `deadline`; ssl.SSLError, TimeoutError or
        OSError if it fails."""
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        pipe = cls(raw, context.wrap_bio(incoming, outgoing, server_hostname=host),
                   incoming, outgoing)  # fmt: skip
        pipe.deadline = deadline
        while True:
            try:
                pipe.obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                pipe._flush()
                if not pipe._fill():
                    raise ConnectionResetError("closed during the TLS handshake") from None
        pipe._flush()
        return pipe

    def fileno(self) -> int:
        return self.raw.fileno()

    def pending(self) -> int:
        """Bytes received and not yet read: decrypted, or ciphertext not decrypted."""
        return self.obj.pending() + self.incoming.pending

    def getpeercert(self) -> dict | None:
        return self.obj.getpeercert()  # type: ignore[return-value]

    def close(self) -> None:
        self.raw.close()

    def sendall(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        for at in range(0, len(view), _WRITE_SLICE):
            self.obj.write(view[at : at + _WRITE_SLICE])
            if self.outgoing.pending >= _WRITE_SLICE:
                self._flush()
        self._flush()

    def recv_into(self, view: memoryview, nbytes: int = 0) -> int:
        """Decrypted bytes into `view` (one record's at most); 0 at the close."""
        nbytes = nbytes or len(view)
        while True:
            if self.pending():  # else SSLWantReadError, raised and caught for nothing
                try:
                    return self.obj.read(nbytes, view)
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLZeroReturnError:
                    return 0
            if self.outgoing.pending:
                self._flush()  # a post-handshake message wants an answer
            if not self._fill():
                return 0

    def read_exactly(self, view: memoryview) -> tuple[int, BaseException | None]:
        """Fill `view`, record after record, the socket only when they run out: (bytes
        read, None), fewer at the member's close; or (bytes read, the error that
        stopped it: TimeoutError past the deadline, ssl.SSLError, OSError)."""
        have, n, read, incoming = 0, len(view), self.obj.read, self.incoming
        try:
            while have < n:
                if incoming.pending or self.obj.pending():  # else it would raise, for nothing
                    try:
                        have += read(n - have, view[have:])
                        continue
                    except ssl.SSLWantReadError:
                        pass
                    except ssl.SSLZeroReturnError:
                        break
                if self.outgoing.pending:
                    self._flush()  # a post-handshake message wants an answer
                if not self._fill(n - have):
                    break
        except (ssl.SSLError, OSError) as exc:  # TimeoutError included
            return have, exc
        return have, None

    def _bound_recv(self) -> None:
        """The next receive ends by the deadline (wait_until), or TimeoutError if it has
        passed: a chunk's few reads cost no system call each beyond the read, and the
        sends' limit (an exchange's timeout, the same every time) is not set again."""
        if self.deadline == math.inf:
            return
        limit = wait_until(self.raw, self.deadline, self.recv_limit, RECV_LIMIT)
        if limit is None:
            raise TimeoutError("timed out")
        self.recv_limit = limit

    def _bound_send(self) -> None:
        """The next send ends by the deadline, as _bound_recv."""
        if self.deadline == math.inf:
            return
        limit = wait_until(self.raw, self.deadline, self.send_limit, SEND_LIMIT)
        if limit is None:
            raise TimeoutError("timed out")
        self.send_limit = limit

    def _fill(self, plaintext: int = 0) -> bool:
        """More ciphertext, waited for until the deadline (TimeoutError after it). With
        `plaintext`, the bytes still to be read: at least that much ciphertext, less what
        is buffered (in the BIO, and one record at most inside the SSL object, which
        takes a record's bytes from the BIO before it has all of them), is yet to come
        (a record is longer than its plaintext), so the recv waits for all of it at once
        (MSG_WAITALL; less at the deadline or the close): one wake-up for most of a
        chunk's body, not one per burst of segments."""
        self._bound_recv()
        need = plaintext - self.incoming.pending - _MAX_RECORD
        need = min(need, len(self._ciphertext))
        try:
            if need > 0:
                n = self.raw.recv_into(self._ciphertext, need, socket.MSG_WAITALL)
            else:
                n = self.raw.recv_into(self._ciphertext)
        except BlockingIOError:  # the wait's limit ran out
            raise TimeoutError("timed out") from None
        if n:
            self.incoming.write(self._ciphertext[:n])
        return n > 0

    def _flush(self) -> None:
        data = self.outgoing.read()
        view = memoryview(data)
        try:
            while view:
                self._bound_send()
                view = view[self.raw.send(view) :]
        except BlockingIOError:
            raise TimeoutError("timed out") from None


class _Connection:
    """One TLS connection and the buffer its answers' heads are read into."""

    def __init__(self, sock: TLSPipe) -> None:
        self.sock = sock
        self.used = time.monotonic()
        # An answer's head is read into this (each exchange's, in turn): no buffer
        # allocated per exchange.
        self.head = bytearray(MAX_HEAD)
        self.head_view = memoryview(self.head)
        self.poller = select.poll()  # looks_closed's, registered once
        self.poller.register(sock.fileno(), select.POLLIN)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def looks_closed(self) -> bool:
        """An idle keep-alive connection that is readable has been closed by the member
        (or sent junk): not reused."""
        try:
            return bool(self.poller.poll(0)) or self.sock.pending() > 0
        except (OSError, ValueError):
            return True


class PeerPool:
    """The connections to one member, and one exchange at a time on each."""

    def __init__(
        self, address: str, host: str, port: int, context: ssl.SSLContext, cluster: str
    ) -> None:
        self.address = address
        self.host = host
        self.port = port
        self.context = context
        self.cluster = cluster
        self._fixed = f"host: {host}\r\nx-silofs-cluster: {cluster}\r\n"  # every request's
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()
        self._closed = False
        self.opened = 0  # connections made (tests, status)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def request(
        self,
        method: str,
        target: str,
        bounds: Bounds,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        gone: Callable[[], bool] | None = None,
        most: int | None = None,
        into: Callable[[int], memoryview | None] | None = None,
    ) -> PeerReply:
        """One exchange; PeerError if it fails, Abandoned if `gone()` turned true while
        the member sent 102s. A connection from the pool that turns out dead before any
        byte of the answer is replaced once by a new one (the request is idempotent:
        GET or PUT). `into(n)`: where a 200 answer's n-byte body is received (a view of
        the caller's), else (None) a buffer of its own."""
        head = self._head(method, target, bounds, body, headers or {})
        for attempt in (1, 2):
            conn, reused = self._checkout(bounds)
            try:
                reply, keep = _exchange(
                    conn, head, body, bounds, reused, self.address, gone, most, into
                )
            except _StaleConnection:
                conn.close()
                if attempt == 1:
                    continue
                raise PeerError("refused", f"{self.address} closed the connection") from None
            except BaseException:
                conn.close()
                raise
            self._checkin(conn, keep)
            return reply
        raise AssertionError("unreachable")

    def request_checked(
        self,
        method: str,
        target: str,
        bounds: Bounds,
        body: bytes,
        check: Callable[[PeerReply], memoryview] | None,
        gone: Callable[[], bool] | None = None,
        most: int | None = None,
        into: Callable[[int], memoryview | None] | None = None,
    ) -> tuple[PeerReply, memoryview | None]:
        """One exchange and `check` of its 200 answer, in the same thread (a chunk's
        blocks are checked where it was received); PeerError if either fails. `most`:
        the longest 200 answer that can be right (a chunk's value), else "foreign" before
        its body is waited for; `into`: as for request()."""
        reply = self.request(method, target, bounds, body, gone=gone, most=most, into=into)
        return reply, check(reply) if check is not None and reply.status == 200 else None

    def _head(
        self, method: str, target: str, bounds: Bounds, body: bytes, headers: dict[str, str]
    ) -> bytes:
        # The member sends "102 Processing" while it works (a store GET, its serve cap):
        # three within our timeout, so a slow store is not a dead member.
        head = (f"{method} {target} HTTP/1.1\r\n{self._fixed}"
                f"x-silofs-progress: {bounds.timeout:g}\r\n")  # fmt: skip
        if body or method in ("PUT", "POST"):
            head += f"content-length: {len(body)}\r\ncontent-type: application/json\r\n"
        for k, v in headers.items():
            head += f"{k}: {v}\r\n"
        return (head + "\r\n").encode("latin-1")

    def _checkout(self, bounds: Bounds) -> tuple[_Connection, bool]:
        now = time.monotonic()
        with self._lock:
            if self._closed:
                raise PeerError("refused", f"the pool of {self.address} is closed")
            while self._idle:
                conn = self._idle.pop()  # LIFO: the warmest
                idle = now - conn.used
                if idle < LOOK_AFTER_SECONDS or (
                    idle < IDLE_CLOSE_SECONDS and not conn.looks_closed()
                ):
                    return conn, True
                conn.close()
        return self._connect(bounds), False

    def _checkin(self, conn: _Connection, keep: bool) -> None:
        conn.used = time.monotonic()
        with self._lock:
            if keep and not self._closed and len(self._idle) < PEER_POOL:
                self._idle.append(conn)
                return
        conn.close()

    def sweep(self) -> None:
        """Close idle connections older than IDLE_CLOSE_SECONDS (the prober calls this)."""
        now = time.monotonic()
        with self._lock:
            old = [c for c in self._idle if now - c.used >= IDLE_CLOSE_SECONDS]
            self._idle = [c for c in self._idle if c not in old]
        for conn in old:
            conn.close()

    def _connect(self, bounds: Bounds) -> _Connection:
        deadline = time.monotonic() + bounds.timeout
        try:
            raw = _connect_any(_lookup(self.host, self.port, bounds.timeout), deadline)
        except TimeoutError:
            raise PeerError("timeout", f"{self.address}: no connection within "
                            f"{bounds.timeout:g}s") from None  # fmt: skip
        except OSError as exc:
            raise PeerError("refused", f"{self.address}: {exc.strerror or exc}") from None
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock = TLSPipe.connect(raw, self.context, self.host, deadline)
        except TimeoutError:
            raw.close()
            raise PeerError("timeout", f"{self.address}: no TLS handshake within "
                            f"{bounds.timeout:g}s") from None  # fmt: skip
        except (ssl.SSLError, ssl.CertificateError, OSError) as exc:
            raw.close()
            reason = getattr(exc, "verify_message", None) or getattr(exc, "reason", None) or exc
            raise PeerError("refused", f"{self.address}: TLS handshake failed: {reason}") from None
        _, _, node = certificate_identity(sock)
        if not node:
            sock.close()
            raise PeerError(
                "refused",
                f"{self.address} presents a certificate without the node role "
                "(`silofs-ctl certs node` issues one)",
            )
        self.opened += 1
        return _Connection(sock)


def _lookup(host: str, port: int, timeout: float) -> list[tuple[str, int]]:
    """The (address, port)s to try: `host` itself if it is an IP address, else its
    addresses, looked up within `timeout` (TimeoutError past it; OSError if the name
    does not resolve)."""
    try:
        ipaddress.ip_address(host)
        return [(host, port)]
    except ValueError:
        pass
    future = _LOOKUPS.submit(socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM)
    try:
        infos = future.result(timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"no address for {host} within {timeout:g}s") from None
    found = list(dict.fromkeys((str(i[4][0]), port) for i in infos))
    if not found:
        raise OSError(f"no address for {host}")
    return found


def _connect_any(addresses: list[tuple[str, int]], deadline: float) -> socket.socket:
    """A connection to the first of `addresses` that takes one by `deadline`, as
    socket.create_connection tries a name's addresses (a name whose first address is
    ::1 and a member listening on 127.0.0.1 only); the last error if none does."""
    error: OSError = OSError("no address to connect to")
    for where in addresses:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        try:
            return socket.create_connection(where, timeout=left)
        except OSError as exc:  # TimeoutError included: the next address gets what is left
            error = exc
    raise error


class _StaleConnection(Exception):
    """A reused connection failed before any byte of the answer: it was closed while
    idle, and the request may be sent again on a new one."""


def _exchange(
    conn: _Connection,
    head: bytes,
    body: bytes,
    bounds: Bounds,
    reused: bool,
    address: str,
    gone: Callable[[], bool] | None = None,
    most: int | None = None,
    into: Callable[[int], memoryview | None] | None = None,
) -> tuple[PeerReply, bool]:
    """Send one request and read its answer: (reply, whether the connection may be
    reused). Between 102s, Abandoned once `gone()` says the asker's client left. A 200
    answer longer than `most`, or any other longer than MAX_SMALL_ANSWER, is refused
    before its body is read: its length sets how long the body may take (at the floor
    rate), and no right answer is that long."""
    sock = conn.sock
    sock.deadline = time.monotonic() + bounds.timeout
    try:
        sock.sendall(head + body if len(body) < _RECV else head)
        if len(body) >= _RECV:
            sock.sendall(body)
    except (ssl.SSLError, OSError) as exc:  # TimeoutError included
        if reused and not isinstance(exc, TimeoutError):
            raise _StaleConnection() from None
        raise _transport_error(exc, address, "sending") from None
    buf, view = conn.head, conn.head_view
    got = 0
    progress_end = sock.deadline + MAX_PROGRESS_SECONDS
    processing = False
    while True:  # skip 1xx answers; each starts the first-byte bound again
        try:
            status, headers, end, got = _read_head(sock, view, got, address, reused)
        except PeerError as exc:
            if processing and exc.reason == "timeout" and time.monotonic() >= progress_end:
                raise PeerError("timeout", f"{address}: 102 Processing for "
                                f"{MAX_PROGRESS_SECONDS:g}s and no answer") from None  # fmt: skip
            raise
        if status >= 200:
            break
        processing = True
        buf[: got - end] = view[end:got]  # what followed the 102 (usually nothing)
        got -= end
        reused = False  # the member answered: a failure from here is not a stale pool
        if gone is not None and gone():
            raise Abandoned(f"{address}: the asker left while the member worked")
        sock.deadline = min(time.monotonic() + bounds.timeout, progress_end)
    length = headers.get("content-length", "")
    if not is_digits(length) or int(length) > MAX_BODY:
        raise PeerError("http", f"{address}: an answer without a usable content-length")
    n = int(length)
    if status != 200 and n > MAX_SMALL_ANSWER:  # refused before its body is waited for
        raise PeerError("http", f"{address}: a {status} answer of {n} bytes (at most "
                        f"{MAX_SMALL_ANSWER})", status)  # fmt: skip
    if most is not None and status == 200 and n > most:
        raise PeerError("foreign", f"{address}: an answer of {n} bytes for a value of at "
                        f"most {most}")  # fmt: skip
    target = into(n) if into is not None and status == 200 else None
    data = target if target is not None else bytearray(n)
    have = min(n, got - end)
    data[:have] = view[end : end + have]
    sock.deadline = time.monotonic() + bounds.timeout + n / bounds.floor_rate
    more, exc = sock.read_exactly(memoryview(data)[have:])
    have += more
    if isinstance(exc, TimeoutError):
        raise PeerError("timeout", f"{address}: body slower than the floor rate "
                        f"({have} of {n} bytes)") from None  # fmt: skip
    if exc is not None:
        raise PeerError("short", f"{address}: the body broke off after {have} of {n} "
                        f"bytes: {exc}") from None  # fmt: skip
    if have < n:
        raise PeerError("short", f"{address}: the body ended after {have} of {n} bytes")
    keep = "close" not in headers.get("connection", "").lower() and got - end <= n
    return PeerReply(status, headers, data), keep


# Answer heads parsed, by their bytes: a member's chunk answers repeat one head per
# value length and source, and a parse is ~3.4 us of an asking thread's CPU per chunk
# (a look-up here ~0.1). A bound, emptied when full; any thread reads and fills it (a
# dict's get and set are atomic). The headers dicts are shared by every answer with
# that head: PeerReply.headers is read, never changed.
_HEADS: dict[bytes, tuple[int, dict[str, str]]] = {}
_HEADS_MAX = 256


def _read_head(
    sock: TLSPipe, view: memoryview, got: int, address: str, reused: bool
) -> tuple[int, dict[str, str], int, int]:
    """(status, headers, offset of the body in the buffer, bytes in the buffer), within
    the pipe's deadline."""
    buf = view.obj
    while True:
        end = buf.find(b"\r\n\r\n", 0, got) if got else -1  # type: ignore[attr-defined]
        if end >= 0:
            raw = bytes(view[:end])
            parsed = _HEADS.get(raw)
            if parsed is None:
                parsed = _parse_head(raw, address)
                if len(_HEADS) >= _HEADS_MAX:
                    _HEADS.clear()
                _HEADS[raw] = parsed
            return (*parsed, end + 4, got)
        if got >= len(view):
            raise PeerError("http", f"{address}: an answer head over {len(view)} bytes")
        try:
            r = sock.recv_into(view[got:])
        except TimeoutError:
            raise PeerError("timeout", f"{address}: no answer in time") from None
        except (ssl.SSLError, OSError) as exc:
            if reused and got == 0:
                raise _StaleConnection() from None
            raise _transport_error(exc, address, "reading the answer") from None
        if r == 0:
            if reused and got == 0:
                raise _StaleConnection()
            raise PeerError("refused", f"{address} closed the connection without an answer")
        got += r


def _parse_head(raw: bytes, address: str) -> tuple[int, dict[str, str]]:
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not is_digits(parts[1]):
        raise PeerError("http", f"{address}: not an HTTP answer: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise PeerError("http", f"{address}: a malformed header line")
        key = name.strip().lower()
        value = value.strip()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return int(parts[1]), headers


def _transport_error(exc: BaseException, address: str, doing: str) -> PeerError:
    if isinstance(exc, TimeoutError):
        return PeerError("timeout", f"{address}: timed out {doing}")
    return PeerError("refused", f"{address}: connection failed {doing}: {exc}")
