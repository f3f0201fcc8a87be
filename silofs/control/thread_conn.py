"""A keep-alive control connection served from a worker thread: a cluster member's
connection to the mutual-TLS listener, or a mount's Unix-socket connection once it has
asked for a chunk.

Both carry many small requests, each answered with a chunk's bytes. On the trio loop
every such exchange costs the loop more CPU than the answer's bytes (h11 framing both
ways, a watcher task and its cancel scopes, and for TLS SSLStream pumping its memory
BIOs in Python), and the loop is the one every mount and store fetch of the node
shares. Here one thread reads and frames HTTP/1.1 by hand over the blocking socket and
sends the answer's bytes from C: for a member, once control/server.py has completed the
handshake and found a certificate with the node role, the same TLS session (its
SSLObject and memory BIOs); for a mount, the plain socket, whose peer credentials were
taken at accept.

Owns that framing and its limits (the same as control/server.py's: the header block
size, the body size the route's entry allows this peer, asked before the body is read;
the idle timeout, each wait limited by the kernel (wait_limit: one system call per read
or write, where a Python socket timeout polls first) and the request's deadline
checked between them; no chunked bodies), a "102 Processing" while a handler waits when
the client asked for progress, cancelling the handler when the client closes, and
closing an idle connection when the listener evicts it. Never: decides who may call
what (each request goes through the router's match, as on every other connection,
then its route's inline answer here if it has one, else its handler on the trio loop),
runs a handler off the loop, or lets one connection's failure reach the listener.
"""

from __future__ import annotations

import array
import http
import logging
import math
import os
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from silofs import sealed, trace
from silofs.control.peer import Peer
from silofs.control.router import (
    HTTPError,
    Match,
    Request,
    Response,
    Router,
    error_response,
    parse_query,
    parse_target,
)
from silofs.units import is_digits

log = logging.getLogger(__name__)

_RECV = 256 << 10
# An answer's bytes are encrypted this much at a time: the outgoing BIO holds at most
# this much ciphertext, whatever the body's size.
_WRITE_SLICE = 1 << 20
_PROGRESS_HEADER = "x-silofs-progress"
_FRAMING = ("content-length", "transfer-encoding", "content-type")
# After an error that forces a close, read and discard what the client is still
# sending for a little while (on the loop and in a thread alike): closing with its bytes
# unread resets the connection, and the reset can reach the client before our answer.
LINGER_SECONDS = 2.0
# How long after its deadline a wait may end: a socket timeout set for an earlier
# deadline is kept while it overshoots the current one by at most this.
_TIMEOUT_SLACK = 0.01
LINGER_BYTES = 64 * 1024 * 1024
# Routes a connection remembers (ThreadConnection._route), each by a path of at most
# _MAX_ROUTE_CHARS bytes; emptied when full.
_MAX_ROUTES = 64
_MAX_ROUTE_CHARS = 256


class _Closed(Exception):
    """The client closed the connection, stalled past a limit, or broke TLS."""


class _Reject(Exception):
    """A request answered with an error, after which the connection is closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def handoff(tls: trio.SSLStream) -> tuple[ssl.SSLObject, ssl.MemoryBIO, ssl.MemoryBIO] | None:
    """The TLS session of a handshaken SSLStream (its SSLObject, incoming and outgoing
    BIOs), or None if this trio keeps it otherwise (the connection then stays on the
    loop). Bytes already received and not yet decrypted stay in the incoming BIO."""
    parts = tuple(getattr(tls, name, None) for name in ("_ssl_object", "_incoming", "_outgoing"))
    if not isinstance(parts[0], ssl.SSLObject) or getattr(tls, "_delayed_outgoing", None):
        return None
    if not all(isinstance(p, ssl.MemoryBIO) for p in parts[1:]) or parts[2].pending:
        return None
    return parts  # type: ignore[return-value]


# The kernel's limits on one blocking wait (a recv's, a send's): each kind is set on its
# own, so that a limit a connection's receives keep (the idle timeout between requests)
# is not set again because its sends needed another (an answer's deadline), and back.
RECV_LIMIT = socket.SO_RCVTIMEO
SEND_LIMIT = socket.SO_SNDTIMEO


def wait_limit(sock: socket.socket, seconds: float, kind: int | None = None) -> None:
    """Each recv (kind RECV_LIMIT) or send (SEND_LIMIT), or both (None), on the blocking
    `sock` waits at most `seconds`, counted by the kernel (SO_RCVTIMEO, SO_SNDTIMEO; a
    wait that runs out raises BlockingIOError): one system call per read or write, where
    a Python socket timeout polls before each."""
    whole = int(seconds)
    micros = max(int((seconds - whole) * 1_000_000), 0 if whole else 1)  # 0 0: forever
    value = struct.pack("@ll", whole, micros)
    for option in (RECV_LIMIT, SEND_LIMIT) if kind is None else (kind,):
        sock.setsockopt(socket.SOL_SOCKET, option, value)


def wait_until(
    sock: socket.socket, deadline: float, limit: float | None, kind: int
) -> float | None:
    """Make each wait of `kind` (RECV_LIMIT, SEND_LIMIT) on `sock` end by `deadline` (at
    most _TIMEOUT_SLACK after it), where `limit` is the one of that kind set on it last:
    the limit in force after this call, or None if the deadline has passed. The limit is
    set again only when the one in force would not end a wait in time, so the reads and
    sends of one request, and of the next ones with the same bound, cost no call each:
    it is set half the slack past the deadline, so that the next request's (its bound
    counted from a moment a few microseconds later or sooner in its cycle) finds it
    within the slack too."""
    left = deadline - time.monotonic()
    if left <= 0:
        return None
    if limit is None or not left <= limit <= left + _TIMEOUT_SLACK:
        limit = left + _TIMEOUT_SLACK / 2
        wait_limit(sock, limit, kind)
    return limit


class _Bounded:
    """A blocking socket and the deadline of the current request."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        # When the current request must be read, or its answer sent, by (monotonic):
        # a client that trickles bytes is cut there, as on the loop (fail_after).
        self.deadline = math.inf
        # Each wait's limit, receives' and sends' apart, as last set (wait_limit).
        self.recv_limit: float | None = None
        self.send_limit: float | None = None
        # What a read lands in (then copied out at its length): a recv of _RECV bytes
        # into a new object maps and unmaps that much memory on every call (~20 us,
        # more than the rest of a small request's read).
        self.landing = memoryview(bytearray(_RECV))

    def wait_at_most(self, seconds: float, *, sends: bool = True) -> None:
        """Each wait while there is no deadline ends after `seconds`: the receives' (the
        idle timeout between requests), and with `sends` the sends' too (while a handler
        runs: its 102s). Between requests nothing is sent but a TLS session's own
        message, which the limit of the last answer's sends bounds (this one, before
        the first answer: no send ever waits without a limit)."""
        if self.recv_limit != seconds:
            wait_limit(self.sock, seconds, RECV_LIMIT)
            self.recv_limit = seconds
        if (sends or self.send_limit is None) and self.send_limit != seconds:
            wait_limit(self.sock, seconds, SEND_LIMIT)
            self.send_limit = seconds

    def _bound_recv(self) -> None:
        """The next receive ends by the deadline (wait_until), or the connection closes
        once it has passed."""
        if self.deadline == math.inf:
            return
        limit = wait_until(self.sock, self.deadline, self.recv_limit, RECV_LIMIT)
        if limit is None:
            raise _Closed("timed out")
        self.recv_limit = limit

    def _bound_send(self) -> None:
        """The next send ends by the deadline, as _bound_recv."""
        if self.deadline == math.inf:
            return
        limit = wait_until(self.sock, self.deadline, self.send_limit, SEND_LIMIT)
        if limit is None:
            raise _Closed("timed out")
        self.send_limit = limit

    def _sendall(self, data: bytes | memoryview) -> None:
        """sendall, bounded by the deadline as a whole (a client reading a byte at a
        time is cut there, however much each send moves)."""
        view = memoryview(data).cast("B")
        try:
            while view:
                self._bound_send()
                view = view[self.sock.send(view) :]
        except BlockingIOError:
            raise _Closed("timed out") from None
        except OSError as exc:
            raise _Closed(str(exc)) from None


class PlainChannel(_Bounded):
    """A Unix-socket connection's bytes, as they are."""

    def recv(self) -> bytes:
        """Some bytes; b"" at the client's close."""
        try:
            self._bound_recv()
            n = self.sock.recv_into(self.landing)
            return bytes(self.landing[:n])
        except BlockingIOError:
            raise _Closed("timed out") from None
        except OSError as exc:
            raise _Closed(str(exc)) from None

    def send(self, *parts: bytes | memoryview) -> None:
        """All of `parts`, gathered into as few sendmsg calls as the socket takes."""
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        try:
            while views:
                self._bound_send()
                sent = self.sock.sendmsg(views)
                while views and sent >= len(views[0]):
                    sent -= len(views.pop(0))
                if sent:
                    views[0] = views[0][sent:]
        except BlockingIOError:
            raise _Closed("timed out") from None
        except OSError as exc:
            raise _Closed(str(exc)) from None

    def send_fd(self, head: bytes, fd: int) -> None:
        """`head`, the descriptor `fd` riding with its first byte (SCM_RIGHTS): the
        client's receive of that byte takes the descriptor too."""
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
        try:
            self._bound_send()
            sent = self.sock.sendmsg([head], rights)
        except BlockingIOError:
            raise _Closed("timed out") from None
        except OSError as exc:
            raise _Closed(str(exc)) from None
        self.send(head[sent:])


class TLSChannel(_Bounded):
    """The TLS session over the blocking socket: decrypted bytes in, plaintext out."""

    def __init__(
        self, sock: socket.socket, obj: ssl.SSLObject, incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
    ) -> None:  # fmt: skip
        super().__init__(sock)
        self.obj, self.incoming, self.outgoing = obj, incoming, outgoing

    def recv(self) -> bytes:
        """Some decrypted bytes; b"" at the client's close."""
        while True:
            # With nothing received (decrypted or not), a read would only raise
            # SSLWantReadError: the socket first.
            if self.incoming.pending or self.obj.pending():
                try:
                    n = self.obj.read(_RECV, self.landing)
                    return bytes(self.landing[:n])
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLZeroReturnError:
                    return b""
                except ssl.SSLError as exc:
                    raise _Closed(f"TLS: {exc}") from None
            if self.outgoing.pending:
                self._flush()  # a post-handshake message wants an answer
            try:
                self._bound_recv()
                n = self.sock.recv_into(self.landing)
            except BlockingIOError:
                raise _Closed("timed out") from None
            except OSError as exc:
                raise _Closed(str(exc)) from None
            if not n:
                return b""
            self.incoming.write(self.landing[:n])

    def send(self, *parts: bytes | memoryview) -> None:
        """All of `parts` encrypted and sent in one sendall per _WRITE_SLICE of them: an
        answer's head and a chunk up to that size leave in one send, not one per part."""
        try:
            for part in parts:
                view = memoryview(part).cast("B")
                for at in range(0, len(view), _WRITE_SLICE):
                    self.obj.write(view[at : at + _WRITE_SLICE])
                    if self.outgoing.pending >= _WRITE_SLICE:
                        self._flush()
            self._flush()
        except ssl.SSLError as exc:
            raise _Closed(f"TLS: {exc}") from None

    def _flush(self) -> None:
        data = self.outgoing.read()
        if data:
            self._sendall(data)


Channel = PlainChannel | TLSChannel


class ThreadConnection:
    """One connection: requests read and answered in this thread, each handler run on
    the trio loop in `nursery`."""

    def __init__(
        self,
        channel: Channel,
        router: Router,
        peer: Peer,
        nursery: trio.Nursery,
        limits: ConnLimits,
    ) -> None:
        self.ch = channel
        self.progress = limits.progress
        self.router = router
        self.peer = peer
        self.nursery = nursery
        self.max_body, self.max_header = limits.max_body, limits.max_header
        self.idle_timeout = limits.idle_timeout
        # The time a request has from its first byte, and a write of the answer.
        self.request_seconds = limits.request_seconds or limits.idle_timeout
        self.floor_rate = limits.floor_rate
        self.buf = b""
        # Routes this connection's requests found: _route.
        self._routes: dict[tuple[str, bytes, int], tuple[str, Match]] = {}
        # The last header block parsed and its headers (_request): a member's chunk asks,
        # and a mount's misses, send the same header lines every time.
        self._last_block: bytes | None = None
        self._last_headers: dict[str, str] = {}
        self.token = trio.lowlevel.current_trio_token()
        # The handler's end, signalled from the loop; polled with the socket (its close).
        self.wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        # A handler may end after this thread did (cancelled with the connection): it
        # signals only while the eventfd is open, never a number the kernel reused.
        self.wake_lock = threading.Lock()
        self.wake_open = True
        self.poller = select.poll()
        self.poller.register(self.wake, select.POLLIN)
        self.started = False  # run() began (in its thread): it closes the socket
        # The hand-off region of a Unix connection (silofs/sealed.py Region): made at its
        # first use, dropped with the connection (run()'s end).
        usable = isinstance(channel, PlainChannel) and sealed.Region.usable()
        self.region: sealed.Region | None = sealed.Region() if usable else None
        # Since when the connection waits for a request with nothing of it received
        # (None: a request is being served). The listener may then evict it (evict()).
        self.state_lock = threading.Lock()
        self.idle_since: float | None = None
        self.evicted = False

    def run(self) -> None:
        """Serve requests until the client closes or a limit ends the connection; then
        close it."""
        self.started = True
        try:
            while self._serve_one():
                pass
        except _Closed as exc:
            who = self.peer.remote or f"pid {self.peer.pid}"
            log.debug("connection of %r ended: %s", who, exc)
        except (trio.RunFinishedError, trio.Cancelled):
            pass
        finally:
            self.ch.sock.close()
            self.close_wake()
            if self.region is not None:
                self.region.close()

    def close_wake(self) -> None:
        with self.wake_lock:
            if self.wake_open:
                self.wake_open = False
                os.close(self.wake)

    def _serve_one(self) -> bool:
        """One request and its answer; False if the connection is to be closed."""
        self.ch.deadline = math.inf  # waiting for a request: the idle timeout
        self.ch.wait_at_most(self.idle_timeout, sends=False)
        with self.state_lock:
            self.idle_since = None if self.buf else time.monotonic()
        try:
            head = self._read_head()
            if head is None:
                return False
            req, match, close = self._request(head)
            if trace.ON:  # a chunk route names its chunk by key and index ("i": a member's)
                chunk = trace.chunk_id(
                    req.query.get("key", ""), req.query.get("i", req.query.get("index"))
                )
                trace.mark(f"head:{req.path}", chunk)
        except _Reject as exc:
            self.ch.deadline = time.monotonic() + self.request_seconds
            self._answer(error_response(exc.status, exc.message), close=True)
            self._linger()
            return False
        resp = self._inline(req, match)
        if resp is None:
            resp = self._dispatch(req, match)
        if resp is None:
            return False  # the client left while its handler ran
        try:
            self.ch.deadline = self._answer_deadline(resp)
            close = close or self.evicted  # evicted as its request came: answered, closed
            self._answer(resp, close=close, with_body=req.method != "HEAD")
            if trace.ON:
                trace.mark(f"sent:{req.path}", chunk)
        finally:
            if resp.release is not None:
                resp.release()
        return not close

    def _answer_deadline(self, resp: Response) -> float:
        """When the answer must have left: the request time, plus its body at the
        floor rate where there is one (else the idle timeout for the whole answer)."""
        now = time.monotonic()
        if self.floor_rate is None:
            return now + self.idle_timeout
        return now + self.request_seconds + memoryview(resp.body).nbytes / self.floor_rate

    def evictable(self, now: float, min_idle: float) -> bool:
        """Waiting for a request for `min_idle` seconds with nothing of it received,
        not even in the kernel's buffer. Called on the loop."""
        since = self.idle_since
        if since is None or now - since < min_idle or self.evicted:
            return False
        poller = select.poll()
        poller.register(self.ch.sock, select.POLLIN)
        return not poller.poll(0)

    def evict(self) -> bool:
        """Close the connection if it still waits for a request (its thread sees the
        end of input and leaves); False if a request began meanwhile. A request read
        in the same instant is answered, and the connection closed after it."""
        with self.state_lock:
            if self.idle_since is None or self.evicted:
                return False
            self.evicted = True
            try:
                self.ch.sock.shutdown(socket.SHUT_RD)
            except OSError:
                pass
            return True

    def _read_head(self) -> bytes | None:
        """The request's head (request line and headers); None at a close between
        requests."""
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            if len(self.buf) > self.max_header:
                raise _Reject(431, "request header too large")
            data = self.ch.recv()
            if self.ch.deadline == math.inf:  # the request began: read it in time
                self.ch.deadline = time.monotonic() + self.request_seconds
                with self.state_lock:
                    self.idle_since = None
            if not data:
                if self.buf:
                    raise _Closed("closed mid-request")
                return None
            self.buf += data
        if end > self.max_header:
            raise _Reject(431, "request header too large")
        head, self.buf = self.buf[:end], self.buf[end + 4 :]
        return head

    def _request(self, head: bytes) -> tuple[Request, Match, bool]:
        """(the request, its route's decision, whether to close after the answer)."""
        line, _, block = head.partition(b"\r\n")
        parts = line.split(b" ")
        if len(parts) != 3 or parts[2] != b"HTTP/1.1" or not parts[0].isalpha():
            raise _Reject(400, "malformed HTTP request: want METHOD TARGET HTTP/1.1")
        if block == self._last_block:  # checked and parsed before: a copy of its headers
            headers = self._last_headers.copy()
        else:
            headers = _headers(block.split(b"\r\n") if block else [])
            self._last_block, self._last_headers = block, headers.copy()
        method = parts[0].decode("ascii")
        path, query, match = self._route(method, parts[1])
        if "transfer-encoding" in headers:
            raise _Reject(501, "a chunked request body is not accepted here")
        length_text = headers.get("content-length", "0")
        if not is_digits(length_text) or len(length_text) > 19:
            raise _Reject(400, "malformed HTTP request: bad content-length")
        limit = match.body_limit(self.max_body)
        length = int(length_text)
        if length > limit:
            raise _Reject(413, f"request body too large (limit {limit} bytes)")
        if self.floor_rate is not None:
            self.ch.deadline += length / self.floor_rate  # a member's body, at the floor
        if headers.get("expect", "").lower() == "100-continue" and length > len(self.buf):
            self.ch.send(b"HTTP/1.1 100 Continue\r\n\r\n")
        body = self._read_body(length)
        close = "close" in headers.get("connection", "").lower()
        passes_fds = isinstance(self.ch, PlainChannel)
        req = Request(method, path, query, headers, body, self.peer, passes_fds)
        req.region = self.region
        req.gone = self._client_closed
        return req, match, close

    def _route(self, method: str, target: bytes) -> tuple[str, dict[str, str], Match]:
        """(decoded path, query, the router's decision) for a request target. A route
        found by its literal path and admitted is remembered per (method, path, the
        peer's roles as the router's `roles` says now): a connection's next requests of
        it (a mount's misses, a member's chunk asks) skip the path's decoding and the
        match, and a change of roles (a member removed) is a key never seen before."""
        raw_path, _, raw_query = target.partition(b"?")
        key = (method, raw_path, self.router.roles(self.peer).value)
        known = self._routes.get(key)
        if known is not None:
            try:
                return known[0], parse_query(raw_query.decode("ascii")), known[1]
            except UnicodeDecodeError:
                pass  # parse_target names what is wrong
        try:
            path, segments, query = parse_target(target)
        except HTTPError as exc:
            raise _Reject(exc.status, exc.message) from None
        match = self.router.match(method, segments, self.peer)
        if (
            match.error is None
            and match.route is not None
            and not match.params
            and len(raw_path) <= _MAX_ROUTE_CHARS  # a route's path, as a client spells it
        ):
            if len(self._routes) >= _MAX_ROUTES:
                self._routes.clear()
            self._routes[key] = (path, match)
        return path, query, match

    def _read_body(self, length: int) -> bytes:
        # Parts joined once: a mount's offer is up to a 64 MiB chunk, and adding each
        # read to the buffer would copy it over and over.
        parts, have = [self.buf], len(self.buf)
        while have < length:
            data = self.ch.recv()
            if not data:
                raise _Closed("closed mid-request")
            parts.append(data)
            have += len(data)
        data = b"".join(parts) if len(parts) > 1 else self.buf
        body, self.buf = data[:length], data[length:]
        return body

    def _inline(self, req: Request, match: Match) -> Response | None:
        """The route's inline answer, in this thread (control/router.py Route.inline), if
        it has one and the route's entry admitted the peer; None: the loop's handler."""
        route = match.route
        if match.error is not None or route is None or route.inline is None:
            return None
        try:
            return route.inline(req, **match.params)
        except Exception:  # the handler answers what the inline could not
            log.exception("inline answer for %s %s failed", req.method, req.path)
            return None

    # -- the handler, on the loop ------------------------------------------------------
    def _dispatch(self, req: Request, match: Match) -> Response | None:
        """The handler's answer; None if the client closed meanwhile (the handler is
        cancelled then). While it runs, "102 Processing" every interval the client asked
        for (the listener's `progress`: how often, from the header's value)."""
        interval = self.progress(req.headers) if _PROGRESS_HEADER in req.headers else None
        box: list[Response | None] = []
        scope = trio.CancelScope()
        self.ch.deadline = math.inf  # a handler may wait (each 102 has the request time)
        self.ch.wait_at_most(self.request_seconds)

        async def handler() -> None:
            try:
                with scope:
                    box.append(await self.router.dispatch(req, match=match))
            finally:
                self._signal()

        self.token.run_sync_soon(self._start, handler)
        watching = not self.buf  # a pipelined request is left for the next cycle
        if watching:
            self.poller.register(self.ch.sock, select.POLLIN | select.POLLRDHUP)
        timeout = -1 if interval is None else int(interval * 1000)
        done = False
        try:
            while True:
                ready = {fd for fd, _ in self.poller.poll(timeout)}
                if self.wake in ready:
                    os.eventfd_read(self.wake)
                    done = True
                    return box[0] if box else None
                if not ready:
                    self.ch.send(b"HTTP/1.1 102 Processing\r\n\r\n")
                    continue
                if self._client_closed():
                    self.token.run_sync_soon(scope.cancel)
                    timeout = -1
                self.poller.unregister(self.ch.sock)  # closed, or the next request began
                watching = False
        finally:
            if watching:
                self.poller.unregister(self.ch.sock)
            if not done:  # this thread is leaving (a 102 failed): the handler goes too
                self.token.run_sync_soon(scope.cancel)

    def _start(self, handler: Callable[[], Awaitable[None]]) -> None:
        """On the loop: the handler in the connection's nursery. That nursery closes
        under a thread still reading a request when the daemon stops (the thread is
        abandoned, not waited for); the thread is then woken with no answer and closes
        the connection, where start_soon's error would have ended the whole loop."""
        try:
            self.nursery.start_soon(handler)
        except RuntimeError:
            self._signal()

    def _signal(self) -> None:
        """Wake the thread waiting in _dispatch (the handler ended, or never started)."""
        with self.wake_lock:
            if self.wake_open:
                os.eventfd_write(self.wake, 1)

    def _linger(self) -> None:
        """Read and drop what the client still sends (its ciphertext as it comes, not
        decrypted), up to LINGER_SECONDS and LINGER_BYTES, so that the close after an
        error answer does not reset the connection before the client reads it."""
        end, got = time.monotonic() + LINGER_SECONDS, 0
        try:
            if isinstance(self.ch, PlainChannel):
                self.ch.sock.shutdown(socket.SHUT_WR)  # the answer is all it gets
            while got < LINGER_BYTES and (left := end - time.monotonic()) > 0:
                self.ch.sock.settimeout(left)
                data = self.ch.sock.recv(_RECV)
                if not data:
                    return
                got += len(data)
        except OSError:  # TimeoutError included: the linger is over
            return

    def _client_closed(self) -> bool:
        try:
            return not self.ch.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            return True

    def _answer(self, resp: Response, *, close: bool, with_body: bool = True) -> None:
        body = memoryview(resp.body).cast("B")
        if resp.status < 200 or resp.status in (204, 304):
            body = memoryview(b"")
        head = _response_head(resp, len(body), close)
        if resp.fd is not None and isinstance(self.ch, PlainChannel):
            self.ch.send_fd(head, resp.fd.fileno())  # resp holds the file meanwhile
            head = b""
        self.ch.send(head, *((body,) if with_body else ()))


def _headers(lines: list[bytes]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for line in lines:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip() or not _is_token(name):
            raise _Reject(400, "malformed HTTP request: a bad header line")
        if b"\r" in value or b"\n" in value or b"\0" in value:
            raise _Reject(400, "malformed HTTP request: a bad header value")
        key = name.decode("ascii").lower()
        text = value.strip(b" \t").decode("latin-1")
        if key == "content-length" and key in headers and headers[key] != text:
            raise _Reject(400, "malformed HTTP request: conflicting content-length")
        if key == "content-length" and key in headers:
            continue
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    return headers


_TOKEN = b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _is_token(name: bytes) -> bool:
    return not name.translate(None, _TOKEN)  # nothing left once the token bytes go


_REASONS = {int(s): s.phrase for s in http.HTTPStatus}


def _response_head(resp: Response, length: int, close: bool) -> bytes:
    reason = _REASONS.get(resp.status, "")
    lines = [f"HTTP/1.1 {resp.status} {reason}", f"content-type: {resp.content_type}"]
    if not (resp.status < 200 or resp.status == 204):
        lines.append(f"content-length: {length}")
    for name, value in resp.headers.items():
        # Framing is ours to decide: a handler cannot desynchronise the stream.
        if name.lower() not in _FRAMING and name.lower() != "connection":
            lines.append(f"{name}: {value}")
    if close:
        lines.append("connection: close")
    head = "\r\n".join(lines) + "\r\n\r\n"
    if "\0" in head or head.count("\r\n") != len(lines) + 1 or "\n" in head.replace("\r\n", ""):
        raise ValueError("a response header holds a line break")
    return head.encode("latin-1")


@dataclass
class ConnLimits:
    """What a thread-served connection keeps to: the listener's request limits and how
    often a waiting handler's client hears 102 (from its header's value)."""

    max_body: int
    max_header: int
    idle_timeout: float
    progress: Callable[[dict[str, str]], float]
    # A cluster member's connection is held to the peer bounds instead: a request whole
    # within `request_seconds` of its first byte, an answer gone within that plus its
    # size at `floor_rate` (what the asking member itself waits, docs/SEMANTICS.md). A
    # member that trickles its request or never reads its answer holds no thread longer.
    request_seconds: float | None = None
    floor_rate: float | None = None


async def serve_member(
    tls: trio.SSLStream,
    conn: Any,
    router: Router,
    peer: Peer,
    limiter: trio.CapacityLimiter,
    limits: ConnLimits,
) -> bool:
    """Serve a member's handshaken connection from a worker thread until it ends;
    False (nothing done) if the TLS session cannot be handed over, and the caller
    serves it on the loop."""
    session = handoff(tls)
    if session is None:
        return False
    sock = _take_socket(conn)
    await _serve(TLSChannel(sock, *session), router, peer, limiter, limits)
    return True


async def serve_plain(
    conn: Any,
    router: Router,
    peer: Peer,
    limiter: trio.CapacityLimiter,
    limits: ConnLimits,
    started: Callable[[ThreadConnection | None], None] = lambda c: None,
) -> None:
    """Serve a Unix-socket connection (nothing of a next request received yet) from a
    worker thread until it ends. `started` hears of the connection while its thread
    serves it, and of None when it has ended (the listener's eviction)."""
    await _serve(PlainChannel(_take_socket(conn)), router, peer, limiter, limits, started)


def _take_socket(conn: Any) -> socket.socket:
    """The thread owns the socket from here (trio's object is left without its fd, so
    closing the stream later touches nothing) and closes it when it ends."""
    sock = socket.socket(conn.family, conn.type, fileno=conn.detach())
    sock.setblocking(True)
    return sock


async def _serve(
    channel: Channel,
    router: Router,
    peer: Peer,
    limiter: trio.CapacityLimiter,
    limits: ConnLimits,
    started: Callable[[ThreadConnection | None], None] = lambda c: None,
) -> None:
    sock = channel.sock
    served: ThreadConnection | None = None
    try:
        async with trio.open_nursery() as nursery:
            served = ThreadConnection(channel, router, peer, nursery, limits)
            started(served)
            try:
                await trio.to_thread.run_sync(served.run, limiter=limiter, abandon_on_cancel=True)
            finally:
                started(None)
                nursery.cancel_scope.cancel()
    finally:
        if served is None or not served.started:
            sock.close()
            if served is not None:
                served.close_wake()
        else:  # still running if cancelled (the daemon stops): wake it, it closes
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
