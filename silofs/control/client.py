"""Clients for the node daemon's HTTP/1.1 + JSON Unix socket (and, for remote
controllers, its optional mutual-TLS TCP listener: an address "tls://HOST:PORT").

Owns: ControlClient (blocking, stdlib only, for the CLI and the controller's
agents; Unix socket or tls://), client_tls_context (the controller's certificate, the
CA that issued the nodes') and own_certificate_problem (its dates, its key's mode),
and AsyncControlClient (trio, a keep-alive connection pool, for mount processes
fetching chunk bytes), plus turning transport failures and error
answers into ControlError with a one-line message, and refusing a Unix socket served
by a uid the client does not trust (DaemonNotTrusted, checked on every new connection
before a byte is sent: control/peer.py ``check_daemon_peer``).

Never: interprets what an endpoint means, retries a non-idempotent request that
may have reached the daemon, or imports trio at module level (the CLI imports
this module and should not pay ~100 ms for a trio it never uses).
"""

from __future__ import annotations

import array
import contextvars
import functools
import http.client
import json
import logging
import math
import os
import select
import socket
import ssl
import stat
from time import perf_counter as _perf_counter
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from silofs.control.peer import UntrustedDaemonError, check_daemon_peer
from silofs.control.tls import (
    NO_PASSPHRASE,
    TLS_PREFIX,
    ca_load_problem,
    certificate_dates_problem,
    chain_load_problem,
    key_file_problem,
    parse_tls_url,
    socket_path_too_long,
)
from silofs.sealed import FD_HEADER, REGION_HEADER, map_received, map_region
from silofs.units import count, is_digits

if TYPE_CHECKING:
    from collections.abc import Callable

    import trio

log = logging.getLogger(__name__)

# Methods whose repeat has the same effect as one call (RFC 9110 9.2.2); only
# these are retried after a connection failed mid-request.
IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})
# Read size for response bodies. Measured on 8 MiB bodies: 256 KiB and 1 MiB
# perform alike, 4 MiB is ~40% slower (each recv allocates the full size, then
# shrinks it).
_RECV_SIZE = 256 * 1024
# Same reasoning as the server's SOCKET_BUFFER (fewer wakeups per chunk body).
_SOCKET_BUFFER = 4 * 1024 * 1024
_COALESCE_LIMIT = 256 * 1024
# The longest answer head the async client reads, and the longest answer without a
# content-length (read to the close): a daemon never sends either.
_MAX_HEAD = 64 * 1024
_MAX_UNFRAMED = 64 << 20
# An answer at least this long (chunk bytes) is returned as the bytearray it was read
# into; a shorter one as bytes.
_LARGE_BODY = 64 * 1024
_FRAMING = frozenset({"content-length", "transfer-encoding", "host"})
# How much of an answer the async client takes per receive until it has the head (a
# daemon's head is ~100 bytes; the body's first bytes that came with it are copied into
# the body's buffer, the rest is received there directly).
_HEAD_READ = 4096
# A keep-alive connection that finished an answer this recently is reused without
# looking whether the daemon closed it (a poll per request otherwise).
REUSE_UNPOLLED = 1.0
# A request's timeout measures silence to within this factor: the connect's scope, and
# the watchdog's lateness (AsyncControlClient._watch wakes at the first deadline).
SILENCE_SLACK = 1.1
# Room for the ancillary data of four descriptors where an answer takes one, so that
# more than it takes are seen (and closed) rather than silently cut (MSG_CTRUNC).
_FD_SPACE = socket.CMSG_SPACE(4 * 4)
# As plain ints: `flags & socket.MSG_CTRUNC` runs enum.Flag's Python __and__ per answer.
_MSG_CTRUNC = int(socket.MSG_CTRUNC)
_SOL_SOCKET = int(socket.SOL_SOCKET)
_SCM_RIGHTS = int(socket.SCM_RIGHTS)


class ControlError(Exception):
    """A request to the daemon failed. ``status`` is None when no HTTP answer came."""

    def __init__(self, message: str, status: int | None = None, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        # The daemon accepted the request and then said nothing for the timeout: it is
        # frozen or overloaded, not gone (a restarted daemon refuses or resets instead).
        self.timed_out = timed_out

    def __str__(self) -> str:
        return self.message


class Aborted(BaseException):
    """A request its caller ended through ABORT_HOOK: its connection was closed, as a
    cancellation closes it. A BaseException, as trio.Cancelled is, so that it passes
    every `except Exception` on its way out as a cancellation would (a single flight
    it led ends with no outcome: its waiters lead a new call)."""


# Set by a caller around requests it may have to end while they wait, without a cancel
# scope per request (mount/waits.py Waits.watch): called with the request's abort (which
# closes its connection: the request raises Aborted) while it waits for its answer, and
# with None once it no longer does.
ABORT_HOOK: contextvars.ContextVar[Callable[[Callable[[], None] | None], None] | None] = (
    contextvars.ContextVar("silofs_client_abort_hook", default=None)
)


class DaemonNotTrusted(ControlError):
    """The control socket is served by a process of a uid this client does not trust
    (control/peer.py ``check_daemon_peer``): nothing was sent, and starting another
    daemon or retrying would not help."""


@functools.lru_cache(maxsize=4096)
def quote_segment(s: str) -> str:
    """Percent-encode ``s`` as one path segment ("/" included), e.g. a dataset URI.
    Memoized: a mount quotes its object's key and version for every miss of it (a
    chunk at a time), ~300 bytecodes in urllib's quote against one look-up."""
    return quote(s, safe="")


def unreachable(socket_path: str) -> str:
    scheme = socket_path.partition("://")[0]
    if scheme != socket_path and "/" not in scheme:  # http://x, unix:///run/..., TLS://
        return (
            f"{socket_path!r} is no daemon address: --socket (or SILOFS_SOCKET) takes a "
            "Unix socket's path or tls://HOST:PORT"
        )
    kind = _not_a_socket(socket_path)
    if kind is not None:  # no daemon can listen there: starting one would not help
        return (
            f"{socket_path} is {kind}, not a silofs daemon's socket: point --socket "
            "(or SILOFS_SOCKET) at the daemon's socket"
        )
    return (
        f"cannot reach the silofs daemon at {socket_path} "
        "(is it running? start it with `silofs daemon`)"
    )


def _not_a_socket(path: str) -> str | None:
    """What `path` is if it exists and is no socket ("a directory", ...); else None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISSOCK(mode):
        return None
    return (
        "a directory"
        if stat.S_ISDIR(mode)
        else "a regular file"
        if stat.S_ISREG(mode)
        else "another kind of file"
    )


def _connect_error(socket_path: str, exc: OSError) -> ControlError:
    if too_long := socket_path_too_long(socket_path):
        return ControlError(too_long)
    if isinstance(exc, ssl.SSLError | ssl.CertificateError):
        reason = getattr(exc, "verify_message", None) or getattr(exc, "reason", None) or exc
        return ControlError(f"TLS handshake with the daemon at {socket_path} failed: {reason}")
    if socket_path.startswith(TLS_PREFIX):
        return ControlError(
            f"cannot reach the silofs daemon at {socket_path}: {exc.strerror or _describe(exc)}"
        )
    if isinstance(exc, PermissionError):
        return ControlError(f"no permission to connect to the silofs daemon at {socket_path}")
    return ControlError(unreachable(socket_path))


def _error_text(status: int, body: bytes) -> str:
    """The server's {"error"} text, else the first line of whatever it sent."""
    try:
        message = json.loads(body)["error"]
        if isinstance(message, str) and message:
            return message.splitlines()[0]
    except (ValueError, KeyError, TypeError):
        pass
    lines = body.decode("utf-8", "replace").strip().splitlines()
    return f"HTTP {status}: {lines[0]}" if lines else f"HTTP {status}"


def _decode(headers: dict[str, str], body: bytes) -> Any:
    """Parsed JSON for JSON answers, the raw bytes otherwise."""
    if not headers.get("content-type", "").startswith("application/json"):
        return body
    return json.loads(body) if body else None


def _encode(body: dict | bytes | None) -> tuple[bytes | None, str | None]:
    if body is None:
        return None, None
    if isinstance(body, bytes | bytearray | memoryview):
        return bytes(body), "application/octet-stream"
    return json.dumps(body, separators=(",", ":")).encode(), "application/json"


_BODY_METHODS = ("POST", "PUT", "PATCH")  # a content-length even without a payload


def _request_headers(
    method: str, payload: bytes | None, ctype: str | None, extra: dict[str, str]
) -> list[tuple[str, str]]:
    headers = [("host", "localhost")]
    if payload is not None or method in _BODY_METHODS:
        headers.append(("content-length", str(len(payload or b""))))
    given = {k.lower() for k in extra}
    if ctype and "content-type" not in given:
        headers.append(("content-type", ctype))
    # Framing is decided from the payload, never from caller-supplied headers.
    headers.extend((k, v) for k, v in extra.items() if k.lower() not in _FRAMING)
    return headers


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _peer_closed(sock: Any) -> bool:
    """An idle keep-alive socket that is readable has been closed (or sent junk).

    poll, not select: a mount process may hold more than FD_SETSIZE (1024) fds.
    """
    poller = select.poll()
    try:
        poller.register(sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):  # closed socket (fileno -1) or similar
        return True


# ------------------------------------------------------------------ blocking


class _ConnectFailed(Exception):
    def __init__(self, exc: OSError) -> None:
        super().__init__(str(exc))
        self.exc = exc


def parse_tls_address(address: str) -> tuple[str, int]:
    """(host, port) of "tls://HOST:PORT" or "tls://[V6]:PORT" (port default 7470);
    ValueError with one line otherwise (control/tls.py parse_tls_url)."""
    return parse_tls_url(address)


def client_tls_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    """A controller's context: its client certificate and key, and the CA that issued the
    nodes' certificates; a node must present one for the host name or address in its
    tls:// URI (hostname checking stays on). OSError/ssl.SSLError if a file is bad."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key, password=NO_PASSPHRASE)
    ctx.load_verify_locations(cafile=ca)
    return ctx


def tls_files_problem(cert: str, key: str, ca: str, exc: BaseException) -> str:
    """Why client_tls_context(cert, key, ca) raised `exc`, naming the file at fault."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert, key, password=NO_PASSPHRASE)
    except (OSError, ssl.SSLError) as err:
        return chain_load_problem(cert, key, err)
    return ca_load_problem(ca, exc)


def own_certificate_problem(cert: str, key: str) -> str | None:
    """What keeps a controller's own certificate from working, in one line, else None:
    a key other users may read (an admin of every node to whoever reads it), or dates
    that do not hold (every node refuses it, and a node closes such a connection
    without a word: the controller would only see "closed without response")."""
    if problem := key_file_problem(key):
        return problem
    if dates := certificate_dates_problem(cert):
        return (
            f"{cert} {dates}: every node refuses it; a new one comes with a new CA "
            "(`silofs-ctl certs init --force`, then every node's `certs node`)"
        )
    return None


class _UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over AF_UNIX, or over TCP + TLS for a tls:// address: only connect()
    differs."""

    def __init__(
        self,
        socket_path: str,
        timeout: float,
        owner: ControlClient,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path
        self.owner = owner
        self.tls = tls

    def connect(self) -> None:
        if self.socket_path.startswith(TLS_PREFIX):
            self.sock = self._connect_tls()
            self.owner.connections_opened += 1
            return
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError as exc:
            sock.close()
            raise _ConnectFailed(exc) from exc
        try:
            check_daemon_peer(sock, self.socket_path)
        except UntrustedDaemonError as exc:
            sock.close()
            raise DaemonNotTrusted(str(exc)) from None
        self.sock = sock
        self.owner.connections_opened += 1

    def _connect_tls(self) -> ssl.SSLSocket:
        if self.tls is None:
            raise _ConnectFailed(
                OSError(f"{self.socket_path} needs a TLS client certificate (no [tls] given)")
            )
        host, port = parse_tls_address(self.socket_path)
        try:
            raw = socket.create_connection((host, port), timeout=self.timeout)
        except OSError as exc:
            raise _ConnectFailed(exc) from exc
        try:
            # The handshake runs under the same timeout as the request.
            return self.tls.wrap_socket(raw, server_hostname=host)
        except TimeoutError:
            raw.close()
            # Accepted and silent: Python says only "_ssl.c:989: The handshake operation
            # timed out".
            silent = TimeoutError(
                f"it accepted the connection and finished no TLS handshake within "
                f"{self.timeout:g}s (a silofs TLS listener on that port? overloaded?)"
            )
            raise _ConnectFailed(silent) from None
        except OSError as exc:
            raw.close()
            raise _ConnectFailed(exc) from exc


class ControlClient:
    """Blocking client with one keep-alive connection, reopened when dropped.

    Not thread-safe: use one per thread.
    """

    def __init__(
        self, socket_path: str, timeout: float = 10.0, tls: ssl.SSLContext | None = None
    ) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self.tls = tls  # for a tls:// address: client_tls_context()
        self.connections_opened = 0
        self._conn: _UnixHTTPConnection | None = None

    def request(self, method: str, path: str, body: dict | None = None) -> Any:
        """Parsed JSON (or bytes for other content types); ControlError on failure,
        including an answer labelled JSON that is not (something else on the socket, or
        a broken daemon: one line, never a traceback)."""
        status, headers, data = self.request_raw(method, path, body)
        if status >= 400:
            raise ControlError(_error_text(status, data), status)
        try:
            answer = _decode(headers, data)
        except ValueError as exc:  # json's errors, and bytes that are not UTF-8
            raise ControlError(
                f"the silofs daemon at {self.socket_path} answered {method.upper()} {path} "
                f"with bad JSON ({exc}): is a silofs daemon of this version listening there?"
            ) from None
        ANSWERED.set(f"{self.socket_path} ({method.upper()} {path})")
        return answer

    def request_raw(
        self, method: str, path: str, body: dict | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        """(status, lower-cased headers, body) for any status; ControlError if no answer."""
        method = method.upper()
        payload, ctype = _encode(body)
        headers = {"content-type": ctype} if ctype else {}
        attempts = 2 if method in IDEMPOTENT else 1
        for attempt in range(attempts):
            conn = self._connection()
            try:
                conn.request(method, path, body=payload, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
            except _ConnectFailed as exc:
                self.close()
                raise _connect_error(self.socket_path, exc.exc) from None
            except DaemonNotTrusted:
                self.close()
                raise
            except TimeoutError:
                self.close()
                raise ControlError(self._too_slow(method, path), timed_out=True) from None
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                if attempt + 1 < attempts:
                    log.debug("retrying %s %s on a new connection after %r", method, path, exc)
                    continue
                raise ControlError(self._failed(exc)) from None
            if resp.will_close:
                self.close()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
        raise AssertionError("unreachable")

    def _connection(self) -> _UnixHTTPConnection:
        conn = self._conn
        if conn is not None and conn.sock is not None and _peer_closed(conn.sock):
            self.close()  # the daemon closed it while idle (idle timeout, restart)
            conn = None
        if conn is None:
            conn = self._conn = _UnixHTTPConnection(self.socket_path, self.timeout, self, self.tls)
        return conn

    def _too_slow(self, method: str, path: str) -> str:
        return (
            f"the silofs daemon at {self.socket_path} did not answer "
            f"{method} {path} within {self.timeout:g}s"
        )

    def _failed(self, exc: BaseException) -> str:
        line = f"connection to the silofs daemon at {self.socket_path} failed: {_describe(exc)}"
        if self.socket_path.startswith(TLS_PREFIX) and isinstance(
            exc, http.client.RemoteDisconnected
        ):
            # A daemon that refuses a client's certificate (expired, another CA, a name
            # not allowed) closes after the handshake without an alert the client sees.
            line += (
                " (after the TLS handshake: does the daemon refuse this certificate? "
                "Its log names why)"
            )
        return line

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# The last daemon answer a request() decoded in this context, "ADDRESS (METHOD PATH)":
# the CLIs' one-line handlers name it when reading an answer fails (a field missing or
# of another type: a daemon of another version, or not a silofs daemon), where a
# KeyError or TypeError with no request behind it stays a traceback (a bug).
ANSWERED: contextvars.ContextVar[str | None] = contextvars.ContextVar("answered", default=None)

# What reading a decoded answer raises when it is not what this client expects.
ANSWER_ERRORS = (KeyError, TypeError, IndexError, AttributeError, ValueError)


def unreadable_answer(exc: BaseException, program: str) -> str | None:
    """The one line for `exc` raised while reading a daemon's answer (None if no answer
    was decoded in this context, or `exc` is no such error): the daemon and the request,
    and what was wrong."""
    answered = ANSWERED.get()
    if answered is None or not isinstance(exc, ANSWER_ERRORS):
        return None
    return (
        f"the silofs daemon at {answered} answered something this {program} cannot read "
        f"({type(exc).__name__}: {exc}): is it a silofs daemon of this version?"
    )


# ---------------------------------------------------------------------- trio


class _Dropped(Exception):
    """The connection failed mid-request; the request may be retried if idempotent."""


class _AsyncConnection:
    """One keep-alive connection; used by one request at a time.

    HTTP/1.1 is framed here by hand, not by h11: a mount asks its daemon for every
    chunk it misses, and h11's events, state machine and header validation cost more
    CPU than the rest of the request (bench/mount_hop.py). What a silofs daemon
    answers is simple: a head, then a body of content-length bytes (none for 1xx, 204,
    304 and HEAD); an answer without a length is read to the connection's close, and
    anything else (a chunked answer, a malformed head) drops the connection.

    The socket is the stdlib's, non-blocking, waited on with trio's wait_readable and
    wait_writable (each a checkpoint): trio's socket wrapper would try a recv that
    fails (the answer is not there yet) and yield once more per call. A head is taken
    in one receive of at most _HEAD_READ bytes (no peek first: a system call more per
    answer), so at most that much of a chunk's bytes passes through the head's buffer;
    the rest goes from the kernel straight into the body's one buffer."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.sock = socket.socket(fileno=stream.socket.detach())
        self.sock.setblocking(False)
        self.buf = bytearray()  # received and not yet consumed (a head's tail)
        # The request's timeout measures silence: a request in flight whose connection
        # heard nothing (not even a 102 Processing heartbeat) for `silence` seconds since
        # `heard_at` (time.perf_counter()) is failed by its client's watchdog, which
        # closes the connection (`silenced`): no cancel scope per request (~750 Python
        # bytecodes each, a third of a mount's miss: bench/miss_ir.py).
        self.heard_at = 0.0
        self.silence = math.inf
        self.silenced = False
        self.aborted = False  # ended by its caller (abort(), ABORT_HOOK)
        self.closed = False
        # When this connection last finished an answer (time.perf_counter()): a
        # keep-alive connection used this recently is reused without a poll (looks_dead).
        self.used_at = -math.inf
        # Descriptors that came with a head (SCM_RIGHTS) and no answer has taken yet.
        self.fds: list[int] = []
        # The daemon's hand-off region for this connection (silofs/sealed.py Region),
        # mapped read-only once its descriptor came: answers naming REGION_HEADER are
        # copied out of it before their request ends, so before this connection's next
        # request lets the daemon write the region again.
        self.region: Any = None
        # The last head parsed, as received and as parsed: a mount's misses are
        # answered with the same head over and over (a region answer names the same
        # place for every chunk of one size), parsed once (_head).
        self._last_head = b""
        self._last_parsed: tuple[bytes, int, dict[str, str]] = (b"", 0, {})

    def close(self) -> None:
        # Synchronous on purpose: safe to call while being cancelled; a second call
        # (the watchdog's, then the request's) does nothing.
        if self.closed:
            return
        self.closed = True
        import trio

        try:  # a task waiting on it (none, normally) hears of it first
            trio.lowlevel.notify_closing(self.sock)
        except RuntimeError:  # outside trio's run
            pass
        self.sock.close()
        self._close_fds()
        self._drop_region()

    def abort(self) -> None:
        """End the request waiting on this connection: it raises Aborted."""
        self.aborted = True
        self.close()

    def _drop_region(self) -> None:
        region, self.region = self.region, None
        if region is not None:
            region.close()

    def _close_fds(self) -> None:
        while self.fds:
            os.close(self.fds.pop())

    def looks_dead(self, now: float) -> bool:
        """Whether the daemon closed this idle connection. One used in the last
        REUSE_UNPOLLED seconds is taken as alive without a poll (a system call and a
        poll object per request otherwise): the daemon closes only connections idle far
        longer, or one it must drop to make room, which the caller may only use for a
        request it can repeat on a new connection."""
        return now - self.used_at > REUSE_UNPOLLED and _peer_closed(self.sock)

    async def roundtrip(
        self, method: str, target: str, headers: list[tuple[str, str]] | str, body: bytes | None
    ) -> tuple[int, dict[str, str], bytes, bool]:
        """(status, headers, body, reusable) for one request."""
        await self._send(_request_bytes(method, target, headers), body)
        return await self._receive_response(bodiless=method == "HEAD")

    async def _send(self, head: bytes, body: bytes | None) -> None:
        import trio

        if not body:  # a request's head alone (a mount's miss): one send, nearly always
            try:
                sent = self.sock.send(head)
            except BlockingIOError:
                sent = 0
            if sent == len(head):
                return
            head = head[sent:]
        parts = [head + body] if body and len(body) <= _COALESCE_LIMIT else [head, body]
        for part in parts:
            view = memoryview(part or b"")
            while view:
                try:
                    view = view[self.sock.send(view) :]
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(self.sock)

    async def _readable(self) -> None:
        import trio

        await trio.lowlevel.wait_readable(self.sock)

    async def _receive(self) -> int:
        """More bytes of a head into self.buf (how many: up to _HEAD_READ, which may
        include what follows the head); _Dropped at the daemon's close."""
        while True:
            try:
                # A descriptor rides with a head's first byte (a chunk's sealed file,
                # silofs/sealed.py): taken with it, or the kernel would close it.
                data, ancillary, flags, _ = self.sock.recvmsg(_HEAD_READ, _FD_SPACE)
                break
            except BlockingIOError:
                await self._readable()
        if not data:
            raise _Dropped("the daemon closed the connection")
        for level, kind, payload in ancillary:
            if level == _SOL_SOCKET and kind == _SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
                self.fds.extend(got)
        if flags & _MSG_CTRUNC:
            raise _Dropped("the daemon sent more descriptors than an answer takes")
        self.heard_at = _perf_counter()
        self.buf += data
        return len(data)

    async def _receive_response(
        self, bodiless: bool = False
    ) -> tuple[int, dict[str, str], bytes, bool]:
        import trio

        await trio.lowlevel.wait_readable(self.sock)  # the answer cannot be there yet
        while True:
            version, status, headers = await self._head()
            if status >= 200:
                break  # 1xx (102 Processing while the daemon works): the next head
        reusable = version == b"HTTP/1.1" and "close" not in headers.get("connection", "")
        if bodiless or status in (204, 304):
            return status, headers, b"", reusable and not self.buf
        if "transfer-encoding" in headers:
            raise _Dropped("a chunked answer from the daemon (it never sends one)")
        length = headers.get("content-length")
        at = headers.get(REGION_HEADER)
        if at is not None:
            return status, headers, self._from_region(at, length), reusable and not self.buf
        where = headers.get(FD_HEADER)
        if where is not None or self.fds:
            return status, headers, self._mapped(where, length), reusable and not self.buf
        if length is None:
            return status, headers, await self._until_close(), False
        if not is_digits(length) or len(length) > 19:
            raise _Dropped(f"a bad content-length from the daemon: {length[:40]!r}")
        body = await self._body(int(length))
        return status, headers, body, reusable and not self.buf

    def _mapped(self, where: str | None, length: str | None) -> bytes:
        """The chunk data of the sealed file that came with this answer's head, mapped
        read-only (silofs/sealed.py); _Dropped if the answer and the descriptors that
        came do not go together."""
        if where is None or len(self.fds) != 1 or length != "0":
            raise _Dropped(
                f"{count(len(self.fds), 'descriptor')} with an answer naming {where!r} "
                f"(content-length {length})"
            )
        try:
            return map_received(self.fds.pop(), where)  # type: ignore[return-value]
        except (OSError, ValueError) as exc:
            raise _Dropped(f"the daemon's chunk file: {exc}") from None

    def _from_region(self, at: str, length: str | None) -> bytes:
        """A copy of the chunk data this answer names in the connection's hand-off
        region (its descriptor came with this head, the first time); _Dropped if the
        answer, the descriptors and the region do not go together."""
        if len(self.fds) > 1 or length != "0":
            raise _Dropped(f"{count(len(self.fds), 'descriptor')} with an answer naming a region "
                           f"(content-length {length})")  # fmt: skip
        if self.fds:
            self._drop_region()
            try:
                self.region = map_region(self.fds.pop())
            except (OSError, ValueError) as exc:
                raise _Dropped(f"the daemon's hand-off region: {exc}") from None
        offset_text, _, length_text = at.partition(" ")
        region = self.region
        if region is None or not (is_digits(offset_text) and is_digits(length_text)):
            raise _Dropped(f"an answer naming {REGION_HEADER} {at[:40]!r} without a region")
        offset, n = int(offset_text), int(length_text)
        if n == 0 or offset + n > len(region):
            raise _Dropped(f"{REGION_HEADER} {at!r} is outside a region of {len(region)} bytes")
        with memoryview(region) as view:  # released at once: the region may be closed
            return bytes(view[offset : offset + n])

    async def _head(self) -> tuple[bytes, int, dict[str, str]]:
        """The next head: (HTTP version, status, lower-cased headers)."""
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            if len(self.buf) > _MAX_HEAD:
                raise _Dropped("the daemon's answer head is too large")
            await self._receive()
        raw = bytes(self.buf[:end])
        del self.buf[: end + 4]
        if raw == self._last_head:
            version, status, headers = self._last_parsed
            return version, status, headers.copy()  # the caller's to keep
        lines = raw.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise _Dropped(f"a malformed answer from the daemon: {lines[0][:80]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise _Dropped(f"a malformed header from the daemon: {line[:80]!r}")
            key = name.strip().decode("latin-1").lower()
            text = value.strip(b" \t").decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        self._last_head, self._last_parsed = raw, (parts[0], int(parts[1]), headers.copy())
        return parts[0], int(parts[1]), headers

    async def _body(self, length: int) -> bytes:
        """`length` bytes: what the head's read brought, then straight into one buffer
        (a chunk's bytes are copied once, by the kernel)."""
        if len(self.buf) >= length:
            # A chunk's bytes copied once (a bytearray, as a body read below is); a
            # small answer (JSON) as bytes.
            body = self.buf[:length] if length >= _LARGE_BODY else bytes(self.buf[:length])
            del self.buf[:length]
            return body  # type: ignore[return-value]
        from silofs import heap  # ctypes: not for the CLI's start

        # Not zeroed first: every byte of it is received below, or the answer dropped.
        out = heap.uninitialized(length)
        view = memoryview(out)
        got = len(self.buf)
        view[:got] = self.buf
        self.buf.clear()
        while got < length:
            try:
                n = self.sock.recv_into(view[got:], length - got)
            except BlockingIOError:
                await self._readable()
                continue
            if n == 0:
                raise _Dropped(f"the daemon closed the connection after {got} of {length} bytes")
            got += n
            self.heard_at = _perf_counter()
        return out if length >= _LARGE_BODY else bytes(out)  # type: ignore[return-value]

    async def _until_close(self) -> bytes:
        try:
            while len(self.buf) <= _MAX_UNFRAMED:
                await self._receive()
        except _Dropped:
            return bytes(self.buf)
        raise _Dropped("an unframed answer from the daemon is too large")


def _header_lines(headers: list[tuple[str, str]]) -> str:
    return "".join(f"{k}: {v}\r\n" for k, v in headers)


def _request_bytes(method: str, target: str, headers: list[tuple[str, str]] | str) -> bytes:
    """The request's head (`headers` as pairs, or as their lines already joined);
    ControlError if a part would break the framing (a line break or NUL in the target or
    a header, a space in the target)."""
    lines = headers if isinstance(headers, str) else _header_lines(headers)
    head = f"{method} {target} HTTP/1.1\r\n{lines}"
    bare = head.replace("\r\n", "")
    if "\r" in bare or "\n" in bare or "\0" in bare or " " in target:
        raise ControlError(f"refusing to send a malformed request: {method} {target[:80]!r}")
    try:
        return (head + "\r\n").encode("latin-1")
    except UnicodeEncodeError:
        raise ControlError(f"refusing to send a non-latin-1 request: {target[:80]!r}") from None


class AsyncControlClient:
    """trio client with a pool of up to ``max_connections`` keep-alive connections.

    ``timeout`` is the longest silence the client accepts after sending a request: the
    daemon sends "102 Processing" three times per ``timeout`` (at least every 5 s) while a
    handler waits, so a request that the
    daemon is slowing down on purpose (a limiter) waits as long as it takes, and a frozen
    daemon (SIGSTOP, a stuck loop) fails the request after ``timeout`` seconds (at most a
    tenth more: SILENCE_SLACK).

    The silence is watched by one task per client and trio run (_watch, a system task
    started with the first request), not by a cancel scope per request: each request's
    connection is in `_inflight` while it waits, with the time it last heard something,
    and the watchdog, asleep until the first such deadline, closes a connection that
    reached its own; the request then fails as timed out."""

    def __init__(self, socket_path: str, max_connections: int = 16, timeout: float = 30.0) -> None:
        import trio

        self.socket_path = socket_path
        self.timeout = timeout
        self.connections_opened = 0
        # When an answer (any status) last came (trio's clock): a mount asks whether the
        # daemon has said anything since one of its requests timed out.
        self.answered_at = -math.inf
        self._idle: list[_AsyncConnection] = []
        self._slots = trio.Semaphore(max_connections)
        self._closed = False
        # The connections whose requests wait for an answer, and the watchdog that fails
        # the silent ones: when it looks next (time.perf_counter(); inf while parked, or
        # not started in this run), the scope of its sleep (cancelled to wake it
        # earlier) and the run it belongs to.
        self._inflight: dict[_AsyncConnection, None] = {}
        self._watch_at = math.inf
        self._watch_sleep: trio.CancelScope | None = None
        self._watch_run: object = None
        # The header lines of a request with no body and no headers of the caller's (a
        # mount's miss), joined once.
        self._plain = _header_lines(
            _request_headers("GET", None, None, {"x-silofs-progress": f"{timeout:g}"})
        )

    async def json(self, method: str, path: str, body: dict | bytes | None = None) -> Any:
        """Parsed JSON (bytes for other content types); ControlError on >= 400."""
        status, headers, data = await self.request(method, path, body)
        if status >= 400:
            raise ControlError(_error_text(status, data), status)
        return _decode(headers, data)

    async def request(
        self,
        method: str,
        path: str,
        body: dict | bytes | None = None,
        *,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        """(status, lower-cased headers, body) for any status; ControlError if no answer.
        `timeout`: the silence this request accepts, instead of the client's."""
        if self._closed:
            raise ControlError("AsyncControlClient is closed")
        method = method.upper()
        silence = self.timeout if timeout is None else timeout
        payload, ctype = _encode(body)
        request_headers: list[tuple[str, str]] | str
        if (
            payload is None
            and headers is None
            and method not in _BODY_METHODS
            and silence == self.timeout
        ):
            request_headers = self._plain
        else:
            # Ask for "102 Processing" while the daemon works (control/server.py): a wait
            # it chose, such as a rate limiter, is then never cut by the silence allowed.
            extra = {"x-silofs-progress": f"{silence:g}", **(headers or {})}
            request_headers = _request_headers(method, payload, ctype, extra)
        await self._take_slot()
        try:
            try:
                return await self._attempt(
                    method, path, request_headers, payload, fresh=False, silence=silence
                )
            except _Dropped as exc:
                if method not in IDEMPOTENT:  # it may have reached the daemon: never repeat
                    raise ControlError(self._failed(exc)) from None
                log.debug("retrying %s %s on a new connection after %s", method, path, exc)
            try:
                return await self._attempt(
                    method, path, request_headers, payload, fresh=True, silence=silence
                )
            except _Dropped as exc:
                raise ControlError(self._failed(exc)) from None
        finally:
            self._slots.release()

    async def _take_slot(self) -> None:
        """One of the max_connections slots. A free one is taken without a checkpoint
        (the semaphore's acquire yields to trio's scheduler even then): the request
        waits for its answer through trio anyway, and a cancellation is seen there."""
        import trio

        try:
            self._slots.acquire_nowait()
        except trio.WouldBlock:
            await self._slots.acquire()

    async def _attempt(
        self,
        method: str,
        path: str,
        headers: list[tuple[str, str]] | str,
        payload: bytes | None,
        *,
        fresh: bool,
        silence: float,
    ) -> tuple[int, dict[str, str], bytes]:
        import trio

        conn = await self._checkout(fresh, method, silence)
        now = conn.heard_at = _perf_counter()
        conn.silence = silence
        inflight = self._inflight
        inflight[conn] = None
        if now + silence < self._watch_at:  # sooner than the watchdog looks (or parked)
            self._wake_watch(now + silence)
        hook = ABORT_HOOK.get()
        if hook is not None:
            hook(conn.abort)  # may abort at once: the send below then fails
        try:
            status, rheaders, data, reusable = await conn.roundtrip(method, path, headers, payload)
        except BaseException as exc:  # the connection's state is unknown: never reused
            conn.close()
            if conn.aborted:
                raise Aborted(f"{method} {path} ended by its caller") from None
            if conn.silenced:  # the watchdog closed it (_watch)
                raise ControlError(
                    f"the silofs daemon at {self.socket_path} said nothing for "
                    f"{silence:g}s after {method} {path} (frozen or overloaded?)",
                    timed_out=True,
                ) from None
            if isinstance(exc, (OSError, trio.BrokenResourceError, trio.ClosedResourceError)):
                raise _Dropped(_describe(exc)) from None
            raise  # _Dropped, ControlError, cancellation
        finally:
            inflight.pop(conn, None)
            if hook is not None:
                hook(None)
        self.answered_at = trio.current_time()
        if reusable and not self._closed:
            conn.used_at = _perf_counter()
            self._idle.append(conn)
        else:
            conn.close()
        return status, rheaders, data

    def _wake_watch(self, at: float) -> None:
        """Have the watchdog look at `at` (time.perf_counter()) at the latest: started
        in this run if it is not yet, else woken from a longer sleep."""
        import trio

        run = trio.lowlevel.current_root_task()
        if self._watch_run is not run:  # first request in this trio run
            self._watch_run = run
            self._watch_at = at
            trio.lowlevel.spawn_system_task(self._watch, run, name="silofs client watchdog")
        elif self._watch_sleep is not None:
            self._watch_at = at
            self._watch_sleep.cancel()

    async def _watch(self, run: object) -> None:
        """Fail the requests whose connection heard nothing for their silence: close it
        (a wait on it raises, _attempt sees `silenced`). Asleep until the first deadline
        of the connections in flight; parked (woken by _wake_watch) while none is."""
        import trio

        while self._watch_run is run:
            now = _perf_counter()
            first = math.inf
            for conn in list(self._inflight):
                at = conn.heard_at + conn.silence
                if at <= now:
                    del self._inflight[conn]
                    conn.silenced = True
                    conn.close()
                elif at < first:
                    first = at
            self._watch_at = first
            # A bare scope: its deadline on trio's clock, from perf_counter's
            # (SystemClock is perf_counter plus an offset; an autojump clock in a test
            # runs no faster than this, and a later wake only looks again).
            deadline = trio.current_time() + (first - _perf_counter())
            with trio.CancelScope(deadline=deadline) as self._watch_sleep:
                await trio.sleep_forever()
            self._watch_sleep = None

    async def _checkout(self, fresh: bool, method: str, silence: float) -> _AsyncConnection:
        """An idle connection (unless ``fresh``) or a new one; ControlError if unreachable
        (or if connecting takes longer than `silence`)."""
        import trio

        # Only a request that may be repeated on a new connection (_Dropped) takes a
        # recently used connection unpolled.
        now = _perf_counter() if method in IDEMPOTENT else math.inf
        while self._idle and not fresh:
            conn = self._idle.pop()  # LIFO: the warmest connection, least likely timed out
            if not conn.looks_dead(now):
                return conn
            conn.close()
        # A new connection is rare (the pool keeps them): the silence of its connect is
        # watched by a scope of its own, the requests' by the watchdog.
        with trio.move_on_after(SILENCE_SLACK * silence) as scope:
            try:
                stream = await trio.open_unix_socket(self.socket_path)
            except OSError as exc:
                raise _connect_error(self.socket_path, exc) from None
        if scope.cancelled_caught:
            raise ControlError(
                f"the silofs daemon at {self.socket_path} said nothing for {silence:g}s "
                "while connecting (frozen or overloaded?)",
                timed_out=True,
            )
        try:
            check_daemon_peer(stream.socket, self.socket_path)
        except UntrustedDaemonError as exc:
            stream.socket.close()
            raise DaemonNotTrusted(str(exc)) from None
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                stream.socket.setsockopt(socket.SOL_SOCKET, opt, _SOCKET_BUFFER)
            except OSError:
                pass  # best effort, as on the server
        self.connections_opened += 1
        return _AsyncConnection(stream)

    def _failed(self, exc: BaseException) -> str:
        return f"connection to the silofs daemon at {self.socket_path} failed: {exc}"

    async def aclose(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().close()

    async def __aenter__(self) -> AsyncControlClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
