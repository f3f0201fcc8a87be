"""A member's connection to the mutual-TLS listener, served from a worker thread
(control/thread_conn.py): the same routes, limits and answers as on the loop.

The server runs serve_tls on 127.0.0.1 in a thread with its own trio loop; the client
is a raw stdlib TLS socket with a node certificate, so every byte on the wire is the
test's to write and read. No sleeps: waits poll with a deadline.
"""

from __future__ import annotations

import dataclasses
import functools
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from silofs_ctl.certs_cmd import client_cert, init_ca, node_cert

from silofs.control.router import Caller, Request, Response, Router, json_response
from silofs.control.server import TLSLimits, bind_tcp, serve_tls
from silofs.control.tls import server_context
from tests.support.poll import wait_for
from tests.unit.serving import Reader, serving

DEADLINE = 10.0
BIG = bytes(range(256)) * 6000  # 1.5 MB: several write slices and TLS records


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("ca")
    init_ca(str(d))
    node_cert(str(d), "node-a", ["127.0.0.1"])
    node_cert(str(d), "node-b", ["127.0.0.1"])
    client_cert(str(d), "other-client")
    return d


class Probe:
    """What the slow handler saw: started, cancelled."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.cancelled = threading.Event()
        self.release: trio.Event | None = None
        self.token: trio.lowlevel.TrioToken | None = None


def make_router(probe: Probe) -> Router:
    router = Router()

    async def big(req: Request) -> Response:
        return Response(200, BIG, "application/octet-stream", {"x-who": req.peer.remote or ""})

    async def echo(req: Request) -> Response:
        return Response(200, req.body, "application/octet-stream")

    async def slow(req: Request) -> Response:
        probe.release = trio.Event()
        probe.token = trio.lowlevel.current_trio_token()
        probe.started.set()
        try:
            await probe.release.wait()
        except trio.Cancelled:
            probe.cancelled.set()
            raise
        return json_response({"slow": "done"})

    router.add("GET", "/v1/peer/big", big, who=Caller.PEER)
    router.add("PUT", "/v1/peer/echo", echo, who=Caller.PEER, body_limit=64 << 10)
    router.add("GET", "/v1/peer/slow", slow, who=Caller.PEER)
    router.add("GET", "/v1/admin", big, who=Caller.CONTROLLER)
    return router


@contextmanager
def server(
    pki: Path, probe: Probe, idle_timeout: float = 300.0, **tls: Any
) -> Iterator[tuple[int, Any]]:
    ctx = server_context(str(pki / "node-a.pem"), str(pki / "node-a.key"), str(pki / "ca.pem"))
    sock = bind_tcp("127.0.0.1", 0)
    port = sock.getsockname()[1]
    acceptor: list[Any] = []
    serve = functools.partial(
        serve_tls, sock, make_router(probe), ctx, tls_limits=TLSLimits(**tls), acceptor=acceptor,
        max_header=4096, idle_timeout=idle_timeout,
    )  # fmt: skip
    with serving(serve):
        yield port, acceptor[0]


def connect(pki: Path, port: int, name: str = "node-b", rcvbuf: int = 0) -> ssl.SSLSocket:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_cert_chain(str(pki / f"{name}.pem"), str(pki / f"{name}.key"))
    ctx.load_verify_locations(str(pki / "ca.pem"))
    raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:  # before connect: the window it offers is then small
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    raw.settimeout(DEADLINE)
    raw.connect(("127.0.0.1", port))
    return ctx.wrap_socket(raw, server_hostname="127.0.0.1")


def get(path: str, extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nhost: x\r\n{extra}\r\n".encode()


def test_keep_alive_answers_in_a_thread_and_pipelines(pki: Path) -> None:
    probe = Probe()
    with server(pki, probe) as (port, acc):
        s = connect(pki, port)
        r = Reader(s)
        s.sendall(get("/v1/peer/big"))
        assert r.answer() == (200, r_headers(len(BIG)), BIG)
        assert acc.member_threads.borrowed_tokens == 1  # this connection's thread
        # Two requests in one write: both answered, in order.
        body = b"z" * 1000
        s.sendall(
            get("/v1/peer/big")
            + b"PUT /v1/peer/echo HTTP/1.1\r\nhost: x\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert r.answer()[2] == BIG
        assert r.answer()[:3:2] == (200, body)
        # A node certificate reaches peer routes only: the router judges it as on the loop.
        s.sendall(get("/v1/admin"))
        assert r.answer()[0] in (403, 404)
        s.close()
        wait_for(lambda: acc.open == 0, DEADLINE, "the connection to end")
        wait_for(lambda: acc.member_threads.borrowed_tokens == 0, DEADLINE, "its thread to end")
        assert acc.served == 1


def r_headers(n: int) -> dict[str, str]:
    return {"content-type": "application/octet-stream", "content-length": str(n), "x-who": "node-b"}


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (get("/v1/peer/big", "x-pad: " + "a" * 5000 + "\r\n"), 431),
        (b"PUT /v1/peer/echo HTTP/1.1\r\nhost: x\r\ncontent-length: 70000\r\n\r\n", 413),
        (b"PUT /v1/peer/echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n", 501),
        (b"GET /v1/peer/big HTTP/1.0\r\nhost: x\r\n\r\n", 400),
        (b"GET /v1/peer/big HTTP/1.1\r\nbad header\r\n\r\n", 400),
        (b"GET /v1/peer/big HTTP/1.1\r\n x: folded\r\n\r\n", 400),
        (b"GET /v1/peer/big HTTP/1.1\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n", 400),
        # "\xb2" is "²" in latin-1: str.isdigit() says yes, int() refuses (was a traceback
        # and a connection dropped without an answer).
        (b"GET /v1/peer/big HTTP/1.1\r\ncontent-length: \xb2\r\n\r\n", 400),
        (get("/v1/peer/nothing"), 404),
    ],
)
def test_limits_and_malformed_requests(pki: Path, request_bytes: bytes, status: int) -> None:
    probe = Probe()
    with server(pki, probe) as (port, acc), connect(pki, port) as s:
        r = Reader(s)
        s.sendall(request_bytes)
        got, headers, body = r.answer()
        assert got == status and b'"error"' in body
        if status != 404:
            assert headers.get("connection") == "close" and r.closed()
        with connect(pki, port) as s2:  # the listener serves on
            s2.sendall(get("/v1/peer/big"))
            assert Reader(s2).answer()[2] == BIG


def test_a_refused_body_sent_whole_still_hears_its_answer(pki: Path) -> None:
    """As http.client does: the whole body is sent before the answer is read. The
    thread answers 413 after the head and must read on before it closes: a close with
    the body unread resets the connection, and the client saw no answer at all."""
    probe = Probe()
    body = b"z" * (4 << 20)
    head = f"PUT /v1/peer/echo HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n"
    for _ in range(3):
        with server(pki, probe) as (port, _), connect(pki, port) as s:
            s.sendall(head.encode() + body)
            got, headers, answer = Reader(s).answer()
            assert got == 413 and b"too large" in answer
            assert headers.get("connection") == "close"


def test_progress_while_the_handler_waits_then_the_answer(pki: Path) -> None:
    probe = Probe()
    with server(pki, probe) as (port, _), connect(pki, port) as s:
        r = Reader(s)
        s.sendall(get("/v1/peer/slow", "x-silofs-progress: 0.3\r\n"))
        assert r.answer()[0] == 102
        assert r.answer()[0] == 102  # every 0.1 s while it waits
        assert probe.started.is_set() and probe.release is not None
        trio.from_thread.run_sync(probe.release.set, trio_token=probe.token)
        while (answer := r.answer())[0] == 102:
            pass
        assert answer[0] == 200 and b"done" in answer[2]


def test_a_client_that_leaves_cancels_its_handler(pki: Path) -> None:
    probe = Probe()
    with server(pki, probe) as (port, acc):
        s = connect(pki, port)
        s.sendall(get("/v1/peer/slow"))
        assert probe.started.wait(DEADLINE)
        s.close()
        assert probe.cancelled.wait(DEADLINE)
        wait_for(lambda: acc.open == 0, DEADLINE, "the connection to end")


def test_a_controller_stays_on_the_loop(pki: Path) -> None:
    probe = Probe()
    with server(pki, probe) as (port, acc), connect(pki, port, "other-client") as s:
        s.sendall(get("/v1/admin"))
        status, _, body = Reader(s).answer()
        assert status == 200 and body == BIG
        assert acc.member_threads.borrowed_tokens == 0


def test_a_trickled_request_is_cut_at_the_idle_timeout(pki: Path) -> None:
    """A request whose bytes come one at a time is read within idle_timeout of its
    first byte, or the connection ends (a slow client holds a thread no longer)."""
    probe = Probe()
    with server(pki, probe, idle_timeout=0.5) as (port, acc), connect(pki, port) as s:
        start = time.monotonic()
        closed = False
        for byte in get("/v1/peer/big") * 10:
            s.sendall(bytes([byte]))
            if select.select([s], [], [], 0.05)[0]:  # the server's close (or an answer)
                closed = Reader(s).closed()
                break
        assert closed and time.monotonic() - start < DEADLINE
        wait_for(lambda: acc.open == 0, DEADLINE, "the connection to end")


# The peer bounds a member's connection is held to (what the asking member waits).
MEMBER = {"member_request_seconds": 0.5, "member_floor_rate": 16e6}


def _trickle_until_closed(s: ssl.SSLSocket, request: bytes) -> bool:
    """Send `request` a byte at a time; True once the server closed the connection."""
    for byte in request:
        try:
            s.sendall(bytes([byte]))
        except OSError:
            return True
        if select.select([s], [], [], 0.05)[0]:  # the server's close (or an answer)
            return Reader(s).closed()
    return False


def test_a_members_trickled_request_is_cut_at_the_peer_bound(pki: Path) -> None:
    """With the idle timeout at 300 s, a member that sends its request a byte at a time
    still holds its thread no longer than the peer bound (0.5 s here)."""
    probe = Probe()
    with server(pki, probe, **MEMBER) as (port, acc), connect(pki, port) as s:
        start = time.monotonic()
        assert _trickle_until_closed(s, get("/v1/peer/big") * 50)
        assert time.monotonic() - start < 5
        wait_for(lambda: acc.member_threads.borrowed_tokens == 0, DEADLINE, "its thread to end")


def test_the_bounds_in_force_at_a_members_connection_are_the_ones_it_is_held_to(
    pki: Path,
) -> None:
    """A member list pushed at runtime brings its peer_timeout_seconds to the listener:
    before, members' requests were held to silofs.toml's bounds of the daemon's start
    (none at all on a node started without [cluster]: the controller's 300 s)."""
    probe = Probe()
    in_force: list[tuple[float, float]] = [(300.0, 1.0)]
    with server(pki, probe, member_bounds=lambda: in_force[0]) as (port, acc):
        with connect(pki, port) as s:  # held to 300 s: a trickled request goes on
            start = time.monotonic()
            s.sendall(get("/v1/peer/big")[:10])
            for byte in b"x" * 10:
                s.sendall(bytes([byte]))
                assert not select.select([s], [], [], 0.1)[0]
            assert time.monotonic() - start > 1.0
        in_force[0] = (0.5, 16e6)  # a push: the next connection is held to 0.5 s
        with connect(pki, port) as s:
            start = time.monotonic()
            assert _trickle_until_closed(s, get("/v1/peer/big") * 50)
            assert time.monotonic() - start < 5
        wait_for(lambda: acc.member_threads.borrowed_tokens == 0, DEADLINE, "its thread to end")


def test_member_bounds_in_force_follow_a_pushed_list(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from silofs.config import ClusterSettings, MemberSpec
    from silofs.node.service import member_bounds_in_force

    config = ClusterSettings("c", (MemberSpec("tls://a:1"),))
    daemon = SimpleNamespace(cluster=SimpleNamespace(config=None), settings=SimpleNamespace(
        cluster=None))  # fmt: skip
    assert member_bounds_in_force(daemon) == (2.0, float(1 << 20))  # before any list
    daemon.settings.cluster = dataclasses.replace(config, peer_timeout_seconds=5.0)
    assert member_bounds_in_force(daemon) == (5.0, float(1 << 20))  # silofs.toml's
    daemon.cluster.config = dataclasses.replace(
        config, peer_timeout_seconds=1.0, peer_floor_rate=4 << 20
    )
    assert member_bounds_in_force(daemon) == (1.0, float(4 << 20))  # the pushed list's


def test_a_member_that_never_reads_its_answer_is_cut_at_the_peer_bound(pki: Path) -> None:
    probe = Probe()
    with server(pki, probe, **MEMBER) as (port, acc):
        s = connect(pki, port, rcvbuf=4096)
        try:
            start = time.monotonic()
            s.sendall(get("/v1/peer/big"))  # 1.5 MB it never reads: 0.5 s + 0.1 s allowed
            wait_for(lambda: acc.open == 0, DEADLINE, "the connection to end")
            wait_for(lambda: acc.member_threads.borrowed_tokens == 0, DEADLINE, "its thread")
            assert time.monotonic() - start < 5
        finally:
            s.close()


def test_a_flood_of_trickling_members_holds_the_listener_only_for_the_bound(pki: Path) -> None:
    """Members holding every slot of the listener with requests they never finish are
    cut at the peer bound; then a member is served again."""
    probe = Probe()
    with server(pki, probe, max_connections=4, **MEMBER) as (port, acc):
        flood = [connect(pki, port) for _ in range(4)]
        try:
            for s in flood:
                s.sendall(b"GET /v1/peer/big HTTP/1.1\r\n")  # and nothing more
            wait_for(lambda: acc.open == 0, DEADLINE, "the flood to be cut")
            with connect(pki, port) as s:
                s.sendall(get("/v1/peer/big"))
                assert Reader(s).answer()[2] == BIG
        finally:
            for s in flood:
                s.close()


def test_a_session_that_cannot_be_handed_over_stays_on_the_loop(
    pki: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If this trio's SSLStream keeps its session otherwise, a member is served on the
    loop as before: same answers, no thread."""
    from silofs.control import thread_conn

    monkeypatch.setattr(thread_conn, "handoff", lambda tls: None)
    probe = Probe()
    with server(pki, probe) as (port, acc), connect(pki, port) as s:
        r = Reader(s)
        for _ in range(2):
            s.sendall(get("/v1/peer/big"))
            assert r.answer()[2] == BIG
        assert acc.member_threads.borrowed_tokens == 0


def test_an_idle_member_connection_is_closed_at_the_member_idle_bound(pki: Path) -> None:
    """A member's connection waiting for its next request is closed at the listener's
    member idle bound (a member that died without closing it frees its slot), while a
    controller's idle connection keeps the idle timeout (300 s here)."""
    probe = Probe()
    with server(pki, probe, member_idle_seconds=0.5) as (port, acc):
        member, controller = connect(pki, port), connect(pki, port, "other-client")
        try:
            member.sendall(get("/v1/peer/big"))
            assert Reader(member).answer()[2] == BIG
            controller.sendall(get("/v1/admin"))
            assert Reader(controller).answer()[2] == BIG
            wait_for(lambda: acc.open == 1, DEADLINE, "the idle member's connection to end")
            assert Reader(member).closed()
            controller.sendall(get("/v1/admin"))  # the controller's is still served
            assert Reader(controller).answer()[2] == BIG
        finally:
            member.close()
            controller.close()


def test_the_listener_keeps_a_member_connection_just_past_its_pools_close(
    tmp_path: Path,
) -> None:
    """The two ends agree: a member's pool closes a connection idle IDLE_CLOSE_SECONDS,
    and the listener a little later (never one the pool is about to reuse), far below
    the controller's idle timeout, with or without a [cluster] in silofs.toml (a member
    list may be pushed later)."""
    from silofs.control.server import Limits
    from silofs.node.peer_client import IDLE_CLOSE_SECONDS
    from silofs.node.service import member_bounds
    from tests.unit.inprocess import settings

    idle = member_bounds(settings(tmp_path))["member_idle_seconds"]
    assert IDLE_CLOSE_SECONDS + 5 <= idle <= 2 * IDLE_CLOSE_SECONDS < Limits().idle_timeout
    assert TLSLimits(**member_bounds(settings(tmp_path))).member_idle_seconds == idle
