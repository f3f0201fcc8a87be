"""The control transport: HTTP/1.1 over a Unix socket, on trio and h11; and the
optional mutual-TLS TCP listener for remote controllers (serve_tls).

Owns: binding the daemon's socket (stale-socket takeover, refusing a live one, refusing
a directory someone else controls), the accept loop and its connection limits (per uid
and in total; EMFILE backs off quietly), the TLS listener's own limits (connections,
handshake time) and its refusal of clients without a valid certificate, request
framing and limits (header size, body size as the request's route allows its peer,
asked of the router before the body is read; idle timeout), keep-alive, and turning
every failure into a one-line ``{"error": ...}`` JSON answer. Routing and who may call
a route live in control/router.py, peer credentials in control/peer.py.

Never: contains silofs business logic (the daemon registers routes), trusts a
peer without its credentials, or lets one connection's failure (malformed bytes,
a handler bug, a vanished client) end the server.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import errno
import fcntl
import functools
import http
import logging
import math
import os
import select
import socket
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11
import trio

from silofs.control.peer import Peer, peer_credentials, remote_peer
from silofs.control.router import (
    HTTPError,
    Match,
    Request,
    Response,
    Router,
    error_response,
    one_line,
    parse_target,
)
from silofs.control.thread_conn import (
    LINGER_BYTES,
    LINGER_SECONDS,
    ConnLimits,
    ThreadConnection,
    serve_member,
    serve_plain,
)
from silofs.errors import SilofsError
from silofs.units import count

log = logging.getLogger(__name__)

# Requests are small (JSON), so a modest read size is enough on the server side.
_RECV_SIZE = 65536
# Bodies up to this size are glued to the header block and sent in one syscall;
# larger ones are sent as they are (a memoryview, never copied).
_COALESCE_LIMIT = 256 * 1024
# Unix stream sockets default to ~208 KiB of buffer. 4 MiB (capped by
# net.core.wmem_max/rmem_max) cut server CPU per 8 MiB reply by ~30% in our
# measurements: fewer wakeups and partial sends per chunk reply.
SOCKET_BUFFER = 4 * 1024 * 1024
# A client that asks for progress (header x-silofs-progress: the seconds of silence it
# accepts) hears "102 Processing" at least this often while its handler waits (e.g. on a
# rate limiter), and 3 times within its silence: only a frozen daemon stays silent.
PROGRESS_SECONDS = 5.0


class AddressInUseError(SilofsError):
    """Another process is accepting connections on the socket path."""


class SocketDirError(SilofsError):
    """The socket's directory is controlled by someone we must not trust."""


# ------------------------------------------------------------ one connection


@dataclass
class Limits:
    max_body: int = 1 << 20  # a route's entry may allow more to the peers that may call it
    max_header: int = 16384
    idle_timeout: float = 300.0


class _Reject(Exception):
    """A request we answer with an error and then close the connection."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _ServerConnection:
    """One accepted connection: read a request, dispatch, answer, repeat (keep-alive)."""

    def __init__(
        self,
        stream: trio.SocketStream | trio.SSLStream,
        router: Router,
        limits: Limits,
        peer: Peer | None = None,
        threads: trio.CapacityLimiter | None = None,
        trusted: bool = True,
    ) -> None:
        self.stream = stream
        self.router = router
        self.limits = limits
        # The listener trusts the peer (ConnectionLimits.trusted): its requests, once
        # served from a thread, keep the idle timeout (_thread_limits).
        self.trusted = trusted
        # Threads a connection calling a route marked `threaded` may move to (None:
        # never moves: the TLS listener's controllers).
        self.threads = threads
        self.threaded: ThreadConnection | None = None  # serving it now, in its thread
        self.move = False  # the last request's route asked for a thread
        # max_incomplete_event_size bounds the buffered, not-yet-parsed header
        # block; h11 reports overflow as RemoteProtocolError with hint 431.
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_header)
        if peer is None:
            assert isinstance(stream, trio.SocketStream)
            peer = peer_credentials(stream.socket)
        self.peer = peer
        self.head = False  # the current request is HEAD: its answers carry no body
        # Set while waiting for a request with no byte of it received: the acceptor may
        # then close this connection to make room for another of the same uid.
        self.idle_scope: trio.CancelScope | None = None
        self.idle_since = 0.0
        # Set while a request is being read (from its first byte until it is whole): its
        # scope and when it began; the acceptor may close a slow one
        # (_EVICT_SLOW_REQUEST_SECONDS).
        self.request_scope: trio.CancelScope | None = None
        self.request_since = 0.0

    async def run(self) -> None:
        while True:
            event = await self._wait_for_request()
            if event is None or not await self._serve_one(event):
                return
            self.conn.start_next_cycle()
            if self.move and self._may_move():
                await self._serve_in_thread()
                return

    def _may_move(self) -> bool:
        """A thread is free and nothing of the next request is in h11's buffer (the
        thread reads the socket from its first byte on)."""
        assert self.threads is not None
        data, closed = self.conn.trailing_data
        return not data and not closed and self.threads.available_tokens >= 1

    async def _serve_in_thread(self) -> None:
        """The rest of the connection, served from a worker thread (control/
        thread_conn.py): its requests are many and small, their answers chunk-sized,
        which the loop would pay more for in framing than in the handler."""
        assert self.threads is not None and isinstance(self.stream, trio.SocketStream)

        def started(conn: ThreadConnection | None) -> None:
            self.threaded = conn

        await serve_plain(
            self.stream.socket, self.router, self.peer, self.threads,
            _thread_limits(self.limits, self.trusted), started,
        )  # fmt: skip

    async def _wait_for_request(self) -> Any:
        """The first event of the next request; None on EOF, idle timeout or garbage."""
        rejected: _Reject | None = None
        with trio.move_on_after(self.limits.idle_timeout) as scope:
            self.idle_scope, self.idle_since = scope, time.monotonic()
            try:
                event = await self._next_event(idle=True)
            except h11.RemoteProtocolError as exc:
                rejected = _reject_for(exc)
            else:
                return None if isinstance(event, h11.ConnectionClosed) else event
            finally:
                self.idle_scope = None
        if rejected is not None:  # answered outside the idle scope: it has its own limits
            await self._reject(rejected)
        return None

    async def _serve_one(self, event: h11.Event) -> bool:
        """Serve the request that begins with ``event``; False if we must close."""
        try:
            with trio.CancelScope() as scope:
                if self.request_scope is None:  # already buffered: no read began it
                    self.request_since = time.monotonic()
                self.request_scope = scope
                try:
                    with trio.fail_after(self.limits.idle_timeout):
                        req, match = await self._read_request(event)
                finally:
                    self.request_scope = None
            if scope.cancelled_caught:
                log.debug("closing connection from pid %d: evicted mid-request", self.peer.pid)
                return False
        except h11.RemoteProtocolError as exc:
            await self._reject(_reject_for(exc))
            return False
        except _Reject as exc:
            await self._reject(exc)
            return False
        except trio.TooSlowError:
            log.debug("closing connection from pid %d: request not finished in time", self.peer.pid)
            return False
        resp = await self._dispatch(req, match)
        if resp is None:
            return False  # the client left while its handler ran: nobody to answer
        log.debug("%s %s -> %d", req.method, req.path, resp.status)
        route = match.route
        self.move = self.threads is not None and route is not None and route.threaded
        with trio.fail_after(self.limits.idle_timeout):
            await self._send(resp, with_body=req.method != "HEAD")
        return self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE

    async def _dispatch(self, req: Request, match: Match) -> Response | None:
        """Run the handler while watching the connection. A client that closes it (or
        half-closes it after its request, which HTTP/1.1 clients here never do) cancels
        the handler: a mount that gave up must not keep a limiter slot or a GET. A client
        that sent `x-silofs-progress: SECONDS` gets `102 Processing` three times within
        SECONDS (at least every PROGRESS_SECONDS) while the handler waits, so its timeout
        measures silence (a frozen daemon), not a wait the daemon chose (a rate limiter).
        None if the client left."""
        answer: list[Response] = []
        interval = _progress_interval(req.headers) if "x-silofs-progress" in req.headers else None
        # The handler runs in the nursery's body (one task fewer per request); the
        # watcher cancels the nursery, and so the handler, if the client leaves.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_peer, nursery.cancel_scope, interval)
            answer.append(await self.router.dispatch(req, match=match))
            nursery.cancel_scope.cancel()
        if not answer:
            log.debug("%s %s: the client left; handler cancelled", req.method, req.path)
        return answer[0] if answer else None

    async def _watch_peer(self, scope: trio.CancelScope, interval: float | None) -> None:
        """Cancel `scope` if the client closes the connection (a pipelined request is
        kept for the next cycle, and not read further); every `interval` seconds (None:
        never) send 102 Processing meanwhile."""
        event = h11.InformationalResponse(status_code=102, headers=[])
        reading = True
        while True:
            with trio.move_on_after(interval if interval is not None else math.inf):
                if not reading:
                    await trio.sleep_forever()
                try:
                    data = await self.stream.receive_some(_RECV_SIZE)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    data = b""
                self.conn.receive_data(data)
                if not data:
                    scope.cancel()
                    return
                reading = False
                continue
            # Shielded: a send cut short by the handler finishing would corrupt the
            # stream; 102 is a few bytes, bounded by the idle timeout all the same.
            with trio.CancelScope(shield=True) as shielded:
                shielded.deadline = trio.current_time() + self.limits.idle_timeout
                await self.stream.send_all(self.conn.send(event))

    async def _next_event(self, *, idle: bool = False) -> Any:
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            try:
                data = await self.stream.receive_some(_RECV_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""  # a reset peer is the same as a closed one here
            if idle and data and self.idle_scope is not None:
                # A request has begun: evictable from here only if it is slow to arrive.
                self.request_scope, self.request_since = self.idle_scope, time.monotonic()
                self.idle_scope = None
            self.conn.receive_data(data)

    def evictable(self, now: float, min_idle: float | None = None) -> bool:
        """Idle for `min_idle` seconds (default _EVICT_IDLE_SECONDS) with nothing of a
        next request received, not even in the kernel's buffer (a request we have not
        read yet would be lost); or a request begun _EVICT_SLOW_REQUEST_SECONDS ago (at
        least `min_idle`) that has not arrived whole."""
        least = _EVICT_IDLE_SECONDS if min_idle is None else min_idle
        if self.threaded is not None:
            return self.threaded.evictable(now, least)
        if self.request_scope is not None:
            slow = now - self.request_since >= max(least, _EVICT_SLOW_REQUEST_SECONDS)
            return slow and isinstance(self.stream, trio.SocketStream)
        if self.idle_scope is None or now - self.idle_since < least:
            return False
        if not isinstance(self.stream, trio.SocketStream):
            return False  # TLS: decrypted bytes may wait in the stream's own buffer
        poller = select.poll()
        poller.register(self.stream.socket.fileno(), select.POLLIN)
        return not poller.poll(0)

    async def _read_request(self, event: Any) -> tuple[Request, Match]:
        """The request, read up to the body limit its route's entry sets for this peer,
        and what the router decided for it before the body (answered after it)."""
        assert isinstance(event, h11.Request), event
        self.head = event.method == b"HEAD"
        self._check_header_size(event)
        method = event.method.decode("ascii", "replace")
        headers = _header_dict(event.headers)
        try:
            path, parts, query = parse_target(event.target)
        except HTTPError as exc:
            raise _Reject(exc.status, exc.message) from None
        match = self.router.match(method, parts, self.peer)
        limit = match.body_limit(self.limits.max_body)
        length = headers.get("content-length")
        if length is not None and int(length) > limit:
            raise _Reject(413, self._too_large(limit))
        if self.conn.they_are_waiting_for_100_continue:
            await self.stream.send_all(
                self.conn.send(h11.InformationalResponse(status_code=100, headers=[]))
            )
        body = await self._read_body(limit)
        return Request(method, path, query, headers, body, self.peer, self._unix), match

    @property
    def _unix(self) -> bool:
        """A Unix socket's connection: an answer may carry a descriptor (Response.fd)."""
        stream = self.stream
        return isinstance(stream, trio.SocketStream) and stream.socket.family == socket.AF_UNIX

    def waiting_since(self) -> float:
        """When it began waiting for its next request (as evictable() found it)."""
        if self.threaded is not None:
            return self.threaded.idle_since or time.monotonic()
        if self.request_scope is not None:
            return self.request_since
        return self.idle_since

    def evict(self) -> bool:
        """Close this connection, which evictable() found waiting for a request; False
        if a request began meanwhile (a thread-served connection's may)."""
        if self.threaded is not None:
            return self.threaded.evict()
        scope = self.idle_scope or self.request_scope
        assert scope is not None
        scope.cancel()  # it closes at its next checkpoint
        self.idle_scope = self.request_scope = None
        return True

    def _check_header_size(self, event: h11.Request) -> None:
        # h11 only limits the *incomplete* buffer; a complete oversized header
        # block that arrives in one read must be caught here.
        size = len(event.target) + sum(len(k) + len(v) + 4 for k, v in event.headers)
        if size > self.limits.max_header:
            raise _Reject(431, f"request header too large (limit {self.limits.max_header} bytes)")

    async def _read_body(self, limit: int) -> bytes:
        chunks: list[bytes] = []
        total = 0
        while True:
            event = await self._next_event()
            if isinstance(event, h11.EndOfMessage):
                return b"".join(chunks)  # one join: no quadratic concatenation
            if isinstance(event, h11.Data):
                total += len(event.data)
                if total > limit:  # chunked bodies have no length up front
                    raise _Reject(413, self._too_large(limit))
                chunks.append(event.data)
            elif isinstance(event, h11.ConnectionClosed):
                raise h11.RemoteProtocolError("peer closed connection mid-request")

    def _too_large(self, limit: int) -> str:
        return f"request body too large (limit {limit} bytes)"

    async def _send(self, resp: Response, *, with_body: bool = True) -> None:
        body = memoryview(resp.body).cast("B")
        if resp.status < 200 or resp.status in (204, 304):
            body = memoryview(b"")
        head = self.conn.send(_response_event(resp, len(body)))
        if resp.fd is not None and self._unix:
            await self._send_fd(head, resp.fd.fileno())  # resp holds the file meanwhile
            head = b""
        if not with_body or not body:
            await self.stream.send_all(head + self.conn.send(h11.EndOfMessage()))
            return
        # One Data event for the whole body; passthrough hands our memoryview
        # back untouched instead of joining it into a fresh bytes object.
        (payload,) = self.conn.send_with_data_passthrough(h11.Data(data=body))
        tail = self.conn.send(h11.EndOfMessage())  # b"" with Content-Length framing
        if len(body) <= _COALESCE_LIMIT:
            await self.stream.send_all(b"".join((head, payload, tail)))  # one copy
        else:
            await self.stream.send_all(head)
            await self.stream.send_all(payload)
            if tail:
                await self.stream.send_all(tail)

    async def _send_fd(self, head: bytes, fd: int) -> None:
        """`head`, the descriptor `fd` riding with its first byte (SCM_RIGHTS), as
        control/thread_conn.py sends it; nothing else sends on the stream meanwhile (the
        handler's watcher has ended)."""
        assert isinstance(self.stream, trio.SocketStream)
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
        sent = await self.stream.socket.sendmsg([head], rights)
        await self.stream.send_all(head[sent:])

    async def _reject(self, exc: _Reject) -> None:
        """Answer an error and close; the client is still sending, so linger first."""
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return  # mid-response already: nothing sensible can be sent
        log.debug("rejecting request from pid %d: %d %s", self.peer.pid, exc.status, exc.message)
        resp = error_response(exc.status, exc.message)
        resp.headers["connection"] = "close"
        try:
            with trio.fail_after(self.limits.idle_timeout):
                # h11 refuses a body after HEAD: a rejected HEAD gets its answer without one.
                await self._send(resp, with_body=not self.head)
            if isinstance(self.stream, trio.abc.HalfCloseableStream):  # not TLS
                await self.stream.send_eof()
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, OSError):
            return
        await _drain(self.stream)


def _thread_limits(limits: Limits, trusted: bool = True) -> ConnLimits:
    bounds: dict[str, float] = {}
    if not trusted:
        bounds = {"request_seconds": _THREAD_REQUEST_SECONDS, "floor_rate": _THREAD_FLOOR_RATE}
    return ConnLimits(
        limits.max_body, limits.max_header, limits.idle_timeout, _progress_interval, **bounds
    )


def _progress_interval(headers: dict[str, str]) -> float:
    """How often to send 102: a third of the silence the client accepts (the header's
    value, in seconds), at most PROGRESS_SECONDS, at least 0.1 s."""
    try:
        silence = float(headers["x-silofs-progress"])
    except ValueError:
        silence = 3 * PROGRESS_SECONDS
    if not silence > 0:  # also NaN
        silence = 3 * PROGRESS_SECONDS
    return max(0.1, min(PROGRESS_SECONDS, silence / 3))


def _reject_for(exc: h11.RemoteProtocolError) -> _Reject:
    status = exc.error_status_hint
    if status == 431:
        return _Reject(431, "request header too large")
    return _Reject(status, f"malformed HTTP request: {one_line(exc)}")


async def _drain(stream: trio.abc.ReceiveStream) -> None:
    received = 0
    with trio.move_on_after(LINGER_SECONDS):
        while received < LINGER_BYTES:
            try:
                data = await stream.receive_some(_RECV_SIZE * 16)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                return
            if not data:
                return
            received += len(data)


def _header_dict(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for name, value in raw:
        key = name.decode("ascii", "replace").lower()
        text = value.decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    return headers


def _response_event(resp: Response, length: int) -> h11.Response:
    try:
        reason = http.HTTPStatus(resp.status).phrase.encode()
    except ValueError:
        reason = b""
    headers = [(b"content-type", resp.content_type.encode("latin-1"))]
    if not (resp.status < 200 or resp.status == 204):
        headers.append((b"content-length", str(length).encode()))
    for name, value in resp.headers.items():
        # Framing is ours to decide: a handler cannot desynchronise the stream.
        if name.lower() not in ("content-length", "transfer-encoding", "content-type"):
            headers.append((name.encode("latin-1"), value.encode("latin-1")))
    return h11.Response(status_code=resp.status, headers=headers, reason=reason)


# A client that went away or stalled: routine, not worth more than a debug line.
_DISCONNECTS = (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, OSError)


async def _serve_connection(
    stream: trio.SocketStream | trio.SSLStream,
    router: Router,
    limits: Limits,
    peer: Peer | None = None,
    live: set[_ServerConnection] | None = None,
    threads: trio.CapacityLimiter | None = None,
    trusted: bool = True,
) -> None:
    """Connection task: never lets an exception escape into the server's nursery.
    ``live`` holds the connection while it runs (the acceptor's view of a uid's);
    ``threads``, those it may move to (_ServerConnection); ``trusted``, whether the
    listener trusts the peer."""
    conn: _ServerConnection | None = None
    try:
        if isinstance(stream, trio.SocketStream):  # a TLS stream was tuned before it
            tune_socket(stream.socket)
        conn = _ServerConnection(stream, router, limits, peer, threads, trusted)
        if live is not None:
            live.add(conn)
        await conn.run()
    except _DISCONNECTS as exc:
        log.debug("connection ended: %r", exc)
    except Exception as exc:
        log.exception("bug: unexpected error serving a control connection")
        if conn is not None:  # a 500 tells the client more than a dropped connection
            with contextlib.suppress(Exception):
                await conn._reject(_Reject(500, f"internal error: {one_line(exc)}"))
    finally:
        if live is not None and conn is not None:
            live.discard(conn)
        await trio.aclose_forcefully(stream)


def tune_socket(sock: Any) -> None:
    """Large send/receive buffers for chunk-sized bodies (best effort)."""
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        except OSError:
            pass  # the default buffers still work, only with more wakeups


# ---------------------------------------------------------------- listening


def _check_existing(path: str) -> None:
    """Remove a stale socket at ``path``; AddressInUseError if one is alive."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise AddressInUseError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        log.info("removing stale socket %s (nothing is listening on it)", path)
        os.unlink(path)
        return
    except FileNotFoundError:
        return
    except OSError as exc:
        # EAGAIN (backlog full), a timeout, EACCES: someone may well be alive.
        if exc.errno not in (errno.EAGAIN, errno.EACCES, None):
            raise
    finally:
        probe.close()
    raise AddressInUseError(f"another silofs daemon is already listening on {path}")


def untrusted_ancestor(directory: str) -> str | None:
    """Why someone else controls `directory` or a directory on its way from "/", or None.

    Each must be owned by root or by our uid, and one that others may write must be
    sticky (like /tmp). Otherwise its owner, or anyone who may write it, could rename
    what we keep there away and put their own in its place between our checks and our
    use (a socket clients then talk to, a cache env every mount then reads)."""
    euid = os.geteuid()
    where = "/"
    for name in [n for n in os.path.realpath(directory).split("/") if n] + [""]:
        st = os.lstat(where)
        if st.st_uid not in (0, euid):
            return f"{where} is owned by uid {st.st_uid}, not by uid {euid} or root"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            mode = stat.S_IMODE(st.st_mode)
            return f"{where} is writable by others (mode {mode:04o}, not sticky)"
        where = os.path.join(where, name)
    return None


def check_socket_dir(parent: str) -> None:
    """SocketDirError unless no one but us and root controls the socket's directory
    (untrusted_ancestor): its owner, or anyone who can write it, could otherwise replace our
    socket (clients would talk to them) or swap it for a link between bind() and chmod()
    (a root daemon would chmod the link's target)."""
    reason = untrusted_ancestor(parent)
    if reason is not None:
        raise SocketDirError(f"socket directory {reason}: choose another --socket")


def bind_unix(
    path: str, *, mode: int, uid: int | None, gid: int | None
) -> tuple[socket.socket, int]:
    """The listening socket at ``path`` and the socket file's inode (blocking; startup only)."""
    from silofs.control.tls import socket_path_too_long  # as below: ssl only when used

    if too_long := socket_path_too_long(path):
        raise SocketDirError(too_long)
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, mode=0o755, exist_ok=True)
    except OSError as exc:
        raise SocketDirError(f"cannot create socket directory {parent}: {exc.strerror}") from None
    check_socket_dir(parent)
    # Locking the parent directory makes check-unlink-bind atomic between two
    # daemons starting at once (else both could see a stale file and one would
    # unlink the other's fresh socket), without leaving a lock file behind.
    try:
        lock_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise SocketDirError(f"cannot open socket directory {parent}: {exc.strerror}") from None
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        _check_existing(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            # Permissions are set before listen(): until then every connect is
            # refused, so there is no window with the umask's looser mode.
            os.chmod(path, mode)
            if uid is not None or gid is not None:
                os.chown(path, -1 if uid is None else uid, -1 if gid is None else gid)
            ino = os.lstat(path).st_ino
            sock.listen(socket.SOMAXCONN)
        except BaseException:
            sock.close()
            raise
        return sock, ino
    except OSError as exc:
        # A directory the daemon may not write (a read-only file system: under systemd's
        # ProtectSystem=strict, anything outside ReadWritePaths), /proc, a stale socket
        # it may not remove: one line naming the socket, not a traceback in the journal.
        raise SocketDirError(f"cannot listen on {path}: {exc.strerror or exc}") from None
    finally:
        os.close(lock_fd)


def _remove_if_ours(path: str, ino: int) -> None:
    try:
        if os.lstat(path).st_ino == ino:
            os.unlink(path)
    except FileNotFoundError:
        pass


@dataclass
class ConnectionLimits:
    """Open connections at once: `per_uid` for one untrusted uid, `total` for all
    untrusted peers together; trusted peers (root, admins) are exempt from `per_uid`
    and may use `reserve` more than `total`, so status answers during a flood."""

    per_uid: int = 64
    total: int = 1024
    reserve: int = 64
    trusted: Callable[[Peer], bool] = lambda peer: peer.uid == 0
    # Of those, how many may be served from a worker thread at once (a route marked
    # `threaded`, a mount's chunk misses), each holding an eventfd too; 0: none.
    threads: int = 64


# Errors that mean "out of file descriptors or memory for now", not a broken listener.
_ACCEPT_CAPACITY = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
_REFUSALS_AT_ONCE = 64  # connections being told "too many" at once; beyond, just closed
# A connection idle this long may be closed to make room for a new one of its uid.
_EVICT_IDLE_SECONDS = 1.0
# A connection whose request began this long ago and has not arrived whole may be closed
# as an idle one may (its request is lost): a local client writes a request at once, so
# this is a client that trickles it. Otherwise a request's first byte made a connection
# unevictable for the idle timeout (300 s): a few local users holding their per-uid
# limits of connections that each sent one byte locked every other user out.
_EVICT_SLOW_REQUEST_SECONDS = 5.0
# An untrusted peer's connection served from a thread holds one of the node's
# ConnectionLimits.threads (64, shared by every mount) for as long as a request takes
# to arrive or its answer to leave: that is bounded like a cluster member's (ConnLimits),
# not by the idle timeout. Its request must be whole within _THREAD_REQUEST_SECONDS of
# its first byte (a local client writes a request at once: the loop's connections are
# evicted for one slower than that, _EVICT_SLOW_REQUEST_SECONDS), and its answer gone
# within that plus its size at _THREAD_FLOOR_RATE (a local reader takes a chunk at GB/s;
# a member's floor over the network is the same 1 MiB/s). Otherwise one user's mount
# trickling a byte of a request, or never reading a chunk's answer, on each of 64
# connections held every thread for 300 s. The handler's own wait (a slow store GET
# under a low IO allocation) is not bounded by these: a waiting client hears 102s.
# Trusted peers keep the idle timeout: a mount's offer of a 64 MiB chunk on a busy host
# is never cut (as on the loop, where a trusted request is never evicted).
_THREAD_REQUEST_SECONDS = _EVICT_SLOW_REQUEST_SECONDS
_THREAD_FLOOR_RATE = float(1 << 20)


class Throttled:
    """A warning at most once a minute, saying how many were held back since the last
    one (those go to DEBUG): a port scan or a shortage of fds must not flood the log."""

    def __init__(self, seconds: float = 60.0) -> None:
        self.seconds = seconds
        self.last: float | None = None
        self.held = 0

    def __call__(self, message: str) -> None:
        now = time.monotonic()
        if self.last is not None and now - self.last < self.seconds:
            self.held += 1
            log.debug("%s", message)
            return
        suffix = f" ({self.held} more since the last line)" if self.held else ""
        log.warning("%s%s", message, suffix)
        self.last, self.held = now, 0


async def accept_forever(
    sock: trio.socket.SocketType,
    accepted: Callable[[trio.socket.SocketType, Any], None],
    warn: Callable[[str], None],
) -> None:
    """Hand each accepted connection (and its address) to `accepted` until cancelled.
    Out of fds or memory, the pending connection waits in the backlog and accept is
    tried again every 0.1 s: `warn` hears of it, never a traceback. Every listener of
    the daemon accepts this way (the control socket, the TLS listener, /metrics)."""
    while True:
        try:
            conn, addr = await sock.accept()
        except OSError as exc:
            if exc.errno not in _ACCEPT_CAPACITY:
                raise
            warn(f"accept: {os.strerror(exc.errno)}; waiting for connections to close")
            await trio.sleep(0.1)
            continue
        accepted(conn, addr)


class _Acceptor:
    """The accept loop: counts open connections per uid. Over a limit it first closes
    the longest-idle connection of that uid (of any untrusted uid for the total), so
    keep-alive pools (a mount holds up to 32) never lock their own user out, and refuses
    with a one-line 429 only when every one of them is busy."""

    def __init__(self, router: Router, limits: Limits, conns: ConnectionLimits) -> None:
        self.router = router
        self.limits = limits
        self.conns = conns
        self.open: dict[int, int] = {}  # uid -> open connections
        self.live: dict[int, set[_ServerConnection]] = {}  # uid -> its connections
        self.untrusted = 0
        self.everyone = 0
        self.refusing = 0
        self.warn = Throttled()
        # Connections served from a thread hold one each: their own limiter, never the
        # one of trio's other worker threads (a full one leaves them on the loop).
        self.threads = trio.CapacityLimiter(conns.threads) if conns.threads else None

    async def run(self, sock: trio.socket.SocketType, nursery: trio.Nursery) -> None:
        await accept_forever(sock, functools.partial(self._accepted, nursery), self.warn)

    def _accepted(self, nursery: trio.Nursery, conn: trio.socket.SocketType, _addr: Any) -> None:
        try:
            peer = peer_credentials(conn)
        except OSError:
            conn.close()
            return
        stream = trio.SocketStream(conn)
        refusal = self._admit(peer)
        if refusal is None:
            nursery.start_soon(self._serve, stream, peer)
        elif self.refusing < _REFUSALS_AT_ONCE:
            self.refusing += 1
            nursery.start_soon(self._refuse, stream, refusal)
        else:
            conn.close()

    def _admit(self, peer: Peer) -> str | None:
        if self.conns.trusted(peer):
            # Over the total, a trusted newcomer (status, a root mount's miss) takes the
            # place of the longest-idle connection of anyone, its own kind included:
            # idle connections of a trusted client must not lock out the next request
            # (1,124 idle root connections at NOFILE 1024 once made status time out and
            # misses fail with EIO). Only a fully busy daemon refuses it.
            if self.everyone >= self.conns.total + self.conns.reserve and not self._evict(
                list(self.live), trusted_too=True
            ):
                return f"too many connections ({self.everyone} open)"
            return None
        mine = self.open.get(peer.uid, 0)
        if mine >= self.conns.per_uid and not self._evict([peer.uid]):
            self.warn(f"uid {peer.uid} has {mine} busy connections open; refusing more")
            return f"too many connections from uid {peer.uid} (limit {self.conns.per_uid})"
        if self.untrusted >= self.conns.total and not self._evict(list(self.live)):
            self.warn(f"{count(self.untrusted, 'connection')} open; refusing more")
            return f"too many connections to the daemon (limit {self.conns.total})"
        return None

    def _evict(self, uids: list[int], *, trusted_too: bool = False) -> bool:
        """Close the longest-idle evictable connection of these uids (only untrusted
        ones, unless `trusted_too`: then any connection waiting for its next request,
        however briefly); False if none."""
        now = time.monotonic()
        min_idle = 0.0 if trusted_too else _EVICT_IDLE_SECONDS
        idle = [
            c
            for uid in uids
            for c in self.live.get(uid, ())
            if c.evictable(now, min_idle)
            and (trusted_too or not self.conns.trusted(c.peer))
            # A trusted client's slow request (a mount's big offer on a busy host) is
            # never cut: only an untrusted one's.
            and not (c.request_scope is not None and self.conns.trusted(c.peer))
        ]
        # Longest idle first; a thread-served one whose request began meanwhile is passed.
        for victim in sorted(idle, key=lambda c: c.waiting_since()):
            if victim.evict():
                return True
        return False

    async def _serve(self, stream: trio.SocketStream, peer: Peer) -> None:
        trusted = self.conns.trusted(peer)
        self.open[peer.uid] = self.open.get(peer.uid, 0) + 1
        self.everyone += 1
        self.untrusted += not trusted
        live = self.live.setdefault(peer.uid, set())
        try:
            await _serve_connection(
                stream, self.router, self.limits, peer, live, self.threads, trusted
            )
        finally:
            if not live:
                self.live.pop(peer.uid, None)
            self.everyone -= 1
            self.untrusted -= not trusted
            left = self.open[peer.uid] - 1
            if left:
                self.open[peer.uid] = left
            else:
                del self.open[peer.uid]

    async def _refuse(self, stream: trio.SocketStream, message: str) -> None:
        resp = error_response(429, message)
        head = (
            f"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
            f"content-length: {len(resp.body)}\r\nconnection: close\r\n\r\n"
        ).encode()
        try:
            with trio.move_on_after(1.0):
                await stream.send_all(head + bytes(resp.body))
                await stream.send_eof()
                await _drain_briefly(stream)
        except _DISCONNECTS:
            pass
        finally:
            self.refusing -= 1
            await trio.aclose_forcefully(stream)


async def _drain_briefly(stream: trio.SocketStream) -> None:
    """Read what the refused client already sent, so closing does not reset the
    connection before it reads our answer."""
    while await stream.receive_some(_RECV_SIZE):
        pass


async def serve_unix(
    path: str,
    router: Router,
    *,
    mode: int = 0o666,
    uid: int | None = None,
    gid: int | None = None,
    max_body: int = 1 << 20,
    max_header: int = 16384,
    idle_timeout: float = 300.0,
    connections: ConnectionLimits | None = None,
    bound: tuple[socket.socket, int] | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``router`` on a Unix socket at ``path`` until cancelled.

    ``bound`` is a socket already bound by bind_unix() (a daemon binds before it starts
    any task, so a busy socket is one plain AddressInUseError); otherwise this binds,
    raising AddressInUseError if another process is listening on ``path``. ``mode``,
    ``uid`` and ``gid`` are the socket file's, for binding again (_SocketKeeper).
    Removes the socket file on the way out (only if it is still ours).
    """
    sock, ino = bound or bind_unix(path, mode=mode, uid=uid, gid=gid)
    limits = Limits(max_body=max_body, max_header=max_header, idle_timeout=idle_timeout)
    acceptor = _Acceptor(router, limits, connections or ConnectionLimits())
    keeper = _SocketKeeper(path, mode, uid, gid, ino)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(keeper.run, sock, acceptor, nursery)
            log.info("control API listening on %s", path)
            task_status.started()
    finally:
        _remove_if_ours(path, keeper.ino)


# How often the socket file is looked at: a cheap lstat.
SOCKET_CHECK_SECONDS = 2.0


class _SocketKeeper:
    """Keeps the daemon reachable at its socket path. The listening socket is reached
    only through its file: once that is unlinked (systemd-tmpfiles ageing a socket under
    /tmp after 10 days, logind removing $XDG_RUNTIME_DIR at a user's last logout, an
    operator's `rm -rf /run/silofs`), no client could connect again, mounts could not
    reconnect, and `silofs mount` started a second daemon at the path while this one went
    on serving its mounts. So the path is checked every SOCKET_CHECK_SECONDS; a path
    with nothing at it is bound again (bind_unix: the same checks, mode and group as at
    start; its directory made again), one WARNING line, and the old listener is closed.
    A path holding something else (another daemon's socket, a file) is left alone: one
    WARNING line, repeated only when what is there changes; it is not ours to remove."""

    def __init__(self, path: str, mode: int, uid: int | None, gid: int | None, ino: int) -> None:
        self.path = path
        self.mode, self.uid, self.gid = mode, uid, gid
        self.ino = ino  # the inode of our socket file (removed on the way out if still ours)
        self.said: str | None = None  # the last problem warned of (each said once)

    async def run(
        self,
        sock: socket.socket,
        acceptor: _Acceptor,
        nursery: trio.Nursery,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        listener = self._listen(sock, acceptor, nursery)
        task_status.started()
        while True:
            await trio.sleep(SOCKET_CHECK_SECONDS)
            fresh = await trio.to_thread.run_sync(self._check)
            if fresh is not None:
                listener.cancel()
                listener = self._listen(fresh, acceptor, nursery)

    def _listen(
        self, sock: socket.socket, acceptor: _Acceptor, nursery: trio.Nursery
    ) -> trio.CancelScope:
        scope = trio.CancelScope()
        tsock = trio.socket.from_stdlib_socket(sock)

        async def accept() -> None:
            try:
                with scope:
                    await acceptor.run(tsock, nursery)
            finally:
                tsock.close()

        nursery.start_soon(accept)
        return scope

    def _check(self) -> socket.socket | None:
        """A new listening socket if ours was gone from the path and is bound again."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            st = None
        except OSError as exc:  # its directory made unreadable, say: keep listening
            self._say(f"control socket {self.path}: {exc.strerror}; still listening on it")
            return None
        if st is not None:
            if st.st_ino == self.ino and stat.S_ISSOCK(st.st_mode):
                self.said = None
                return None
            self._say(
                f"control socket {self.path} was replaced by another file (inode {st.st_ino}); "
                f"clients reach that, not this daemon: remove it and this daemon listens "
                f"there again"
            )
            return None
        try:
            sock, ino = bind_unix(self.path, mode=self.mode, uid=self.uid, gid=self.gid)
        except (SocketDirError, AddressInUseError) as exc:
            self._say(f"control socket {self.path} was removed and cannot be made again: {exc}")
            return None
        self.ino, self.said = ino, None
        log.warning("control socket %s was removed; listening on it again", self.path)
        return sock

    def _say(self, message: str) -> None:
        if message != self.said:
            log.warning("%s", message)
            self.said = message


# ------------------------------------------------------------ the TLS listener


@dataclass
class TLSLimits:
    """The TCP listener's limits: connections open at once (a handshake in progress
    counts), the time a client has to complete its handshake, and the certificate
    names allowed (empty: any certificate the client CA issued for client auth)."""

    max_connections: int = 64
    handshake_seconds: float = 10.0
    allowed_names: frozenset[str] = frozenset()
    # New connections accepted per second (a burst of this many at once). A handshake
    # costs the daemon's loop ~1-2 ms of CPU whether it succeeds or not; beyond the
    # rate a connection is closed at accept, before any TLS, so a flood of refused
    # clients costs bounded CPU. A controller keeps one keep-alive connection per node.
    handshakes_per_second: float = 20.0
    # A cluster member's request and answer are held to the peer bounds (ConnLimits);
    # None: the idle timeout, as for a controller. `member_bounds`, when given, is asked
    # at each member's connection instead: the bounds of the member list in force, which
    # a push may change (or bring, to a node started without [cluster]).
    member_request_seconds: float | None = None
    member_floor_rate: float | None = None
    member_bounds: Callable[[], tuple[float, float]] | None = None
    # How long a member's connection may wait for its next request (None: the idle
    # timeout). Its pool closes connections idle 30 s (node/peer_client.py); one the
    # member never closes (it died, or the network between went away) must not hold a
    # slot of max_connections for the controller's 300 s.
    member_idle_seconds: float | None = None


def bind_tcp(host: str, port: int) -> socket.socket:
    """The listening TCP socket (blocking; startup only, so a busy port is one line)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        raise AddressInUseError(
            f"cannot listen on {host}:{port} for TLS: {exc.strerror or exc}"
        ) from None
    return sock


class _TLSAcceptor:
    """Accepts TCP connections, completes the TLS handshake within its limit, and serves
    only peers whose certificate the client CA issued (and, if configured, whose name
    is allowed), as a remote admin peer. Everything else is closed: a plaintext client,
    one without a certificate or with a wrong one, one that never finishes its
    handshake. A refusal costs one connection slot for at most handshake_seconds and
    never reaches a handler."""

    def __init__(self, router: Router, limits: Limits, context: Any, tls_limits: TLSLimits) -> None:
        self.router = router
        self.limits = limits
        self.context = context
        self.tls_limits = tls_limits
        self.open = 0
        self.refused = 0  # connections closed without being served (tests, logs)
        self.served = 0
        self.warn = Throttled()
        self.tokens = tls_limits.handshakes_per_second
        self.refilled = time.monotonic()
        # Per source address: its handshakes in progress and its own bucket, so that one
        # source (an outsider opening connections as fast as it can) never holds more
        # than SOURCE_SHARE of the slots or of the rate, and members and controllers
        # elsewhere still get in.
        self.sources: dict[str, _Source] = {}
        # A member's connection holds a thread while it is open (control/thread_conn.py):
        # their own limiter, never the one of trio's other worker threads.
        self.member_threads = trio.CapacityLimiter(tls_limits.max_connections)

    def _may_handshake(self, source: _Source) -> bool:
        """Token buckets of handshakes_per_second (every source's, holding at most one
        second's worth) and of SOURCE_SHARE of it (this source's, as large a burst)."""
        rate = self.tls_limits.handshakes_per_second
        now = time.monotonic()
        self.tokens = min(rate, self.tokens + (now - self.refilled) * rate)
        self.refilled = now
        source.tokens = min(rate, source.tokens + (now - source.refilled) * rate * SOURCE_SHARE)
        source.refilled = now
        if self.tokens < 1 or source.tokens < 1:
            return False
        self.tokens -= 1
        source.tokens -= 1
        return True

    def _source(self, host: str) -> _Source:
        src = self.sources.get(host)
        if src is None:
            if len(self.sources) >= _SOURCES_MAX:  # those with no handshake under way go
                # (at most max_connections stay; a source seen again starts full)
                self.sources = {h: s for h, s in self.sources.items() if s.handshaking}
            src = self.sources[host] = _Source(self.tls_limits.handshakes_per_second)
        return src

    async def run(self, sock: trio.socket.SocketType, nursery: trio.Nursery) -> None:
        await accept_forever(sock, functools.partial(self._accepted, nursery), self._refusal)

    def _accepted(self, nursery: trio.Nursery, conn: trio.socket.SocketType, addr: Any) -> None:
        limit = self.tls_limits.max_connections
        source = self._source(str(addr[0]) if isinstance(addr, tuple) else str(addr))
        if self.open >= limit:
            conn.close()
            self._refusal(
                f"TLS listener: {count(self.open, 'connection')} open (limit {limit}); "
                f"refusing {_host(addr)}"
            )
        elif source.handshaking >= max(1, math.ceil(limit * SOURCE_SHARE)):
            conn.close()
            self._refusal(
                f"TLS listener: {count(source.handshaking, 'handshake')} in progress from one "
                f"address; refusing {_host(addr)}"
            )
        elif not self._may_handshake(source):
            conn.close()
            self._refusal(
                f"TLS listener: more than {self.tls_limits.handshakes_per_second:g} "
                f"new connections a second (or {SOURCE_SHARE:.0%} of them from one "
                f"address); refusing {_host(addr)}"
            )
        else:
            self.open += 1
            source.handshaking += 1
            nursery.start_soon(self._serve, conn, addr, source)

    async def _serve(self, conn: trio.socket.SocketType, addr: Any, source: _Source) -> None:
        stream = trio.SocketStream(conn)
        try:
            tune_socket(conn)
            tls = trio.SSLStream(stream, self.context, server_side=True)
            try:
                peer = await self._handshake(tls, addr)
            finally:
                source.handshaking -= 1
            if peer is None:
                return
            self.served += 1
            # A member's connections are pooled and long-lived: not worth a line each.
            (log.debug if peer.node else log.info)(
                "remote %s %r connected from %s",
                "cluster member" if peer.node else "controller",
                peer.remote,
                _host(addr),
            )
            own = self.limits
            if peer.node and self.tls_limits.member_idle_seconds is not None:
                own = dataclasses.replace(own, idle_timeout=self.tls_limits.member_idle_seconds)
            request_seconds, floor_rate = self._member_bounds()
            limits = dataclasses.replace(
                _thread_limits(own), request_seconds=request_seconds, floor_rate=floor_rate
            )
            if peer.node and await serve_member(
                tls, conn, self.router, peer, self.member_threads, limits
            ):
                return
            await _serve_connection(tls, self.router, own, peer)
        except Exception:  # one connection never ends the listener
            log.exception("bug: unexpected error on a TLS control connection")
        finally:
            self.open -= 1
            await trio.aclose_forcefully(stream)

    def _member_bounds(self) -> tuple[float | None, float | None]:
        live = self.tls_limits.member_bounds
        if live is not None:
            return live()
        return self.tls_limits.member_request_seconds, self.tls_limits.member_floor_rate

    async def _handshake(self, tls: trio.SSLStream, addr: Any) -> Peer | None:
        """The peer its verified certificate proves, or None (logged, counted) if
        refused. A certificate with the node role is not judged by tls_client_names:
        the routes judge it (a member of this node's cluster, or nothing)."""
        from silofs.control.tls import certificate_identity

        reason = ""
        with trio.move_on_after(self.tls_limits.handshake_seconds) as scope:
            try:
                await tls.do_handshake()
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                cause = exc.__cause__ or exc
                reason = getattr(cause, "verify_message", None) or one_line(cause)
        if scope.cancelled_caught:
            reason = f"no TLS handshake within {self.tls_limits.handshake_seconds:g}s"
        name, names, node = None, frozenset[str](), False
        if not reason:
            name, names, node = certificate_identity(tls)  # SSLStream forwards getpeercert
        allowed = self.tls_limits.allowed_names
        if not reason and (name is None or (allowed and not node and name not in allowed)):
            reason = f"certificate name {name!r} is not in tls_client_names"
        if reason:
            self._refusal(f"TLS listener refused {_host(addr)}: {reason}")
            return None
        assert name is not None
        return remote_peer(name, names, node)

    def _refusal(self, message: str) -> None:
        """Counted, and logged through the listener's throttle."""
        self.refused += 1
        self.warn(message)


# The most of the TLS listener's connection slots in handshake, and of its handshake
# rate, that one source address may hold: the rest stays for the others (a member's
# pool, a controller), whatever one address sends.
SOURCE_SHARE = 0.75
_SOURCES_MAX = 4096  # source addresses remembered at once


@dataclass
class _Source:
    """One source address at the TLS listener: its handshakes in progress and its bucket."""

    tokens: float
    refilled: float = 0.0
    handshaking: int = 0

    def __post_init__(self) -> None:
        self.refilled = time.monotonic()


def _host(addr: Any) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"[{addr[0]}]:{addr[1]}" if ":" in str(addr[0]) else f"{addr[0]}:{addr[1]}"
    return str(addr)


async def serve_tls(
    sock: socket.socket,
    router: Router,
    context: Any,
    *,
    tls_limits: TLSLimits | None = None,
    max_body: int = 1 << 20,
    max_header: int = 16384,
    idle_timeout: float = 300.0,
    acceptor: list[_TLSAcceptor] | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``router`` to mutual-TLS clients on a socket from bind_tcp() until
    cancelled. ``context`` is control/tls.py server_context(). Request limits are the
    Unix socket's; a remote peer finds only the routes its role may call (control/
    router.py). ``acceptor`` (a list) receives the acceptor, for tests that count
    refusals."""
    limits = Limits(max_body=max_body, max_header=max_header, idle_timeout=idle_timeout)
    acc = _TLSAcceptor(router, limits, context, tls_limits or TLSLimits())
    if acceptor is not None:
        acceptor.append(acc)
    tsock = trio.socket.from_stdlib_socket(sock)
    host, port = sock.getsockname()[:2]
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(acc.run, tsock, nursery)
            log.info("control API listening for mutual TLS on %s", _host((host, port)))
            task_status.started()
    finally:
        tsock.close()
