"""A mount's Unix-socket connection moved to a thread of its own after it called a
route marked `threaded` (control/server.py, control/thread_conn.py): the same answers,
limits, cancellation and eviction as on the loop.

The server runs serve_unix in a thread with its own trio loop; clients are raw stdlib
Unix sockets, so every byte on the wire is the test's. No sleeps: waits poll with a
deadline.
"""

from __future__ import annotations

import functools
import json
import socket
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from silofs.control import server as control_server
from silofs.control import thread_conn
from silofs.control.peer import Peer
from silofs.control.router import (
    EVERYONE,
    Caller,
    Request,
    Response,
    Route,
    Router,
    json_response,
)
from silofs.control.server import ConnectionLimits, serve_unix
from tests.support.poll import wait_for
from tests.unit.serving import Reader, serving

DEADLINE = 10.0
BIG = bytes(range(256)) * 1024  # 256 KiB: more than one send


class Probe:
    def __init__(self) -> None:
        self.started = threading.Event()
        self.cancelled = threading.Event()


def make_router(probe: Probe) -> Router:
    router = Router()

    async def chunk(req: Request) -> Response:
        return Response(200, BIG, "application/octet-stream", {"x-pid": str(req.peer.pid)})

    async def slow(req: Request) -> Response:
        probe.started.set()
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            probe.cancelled.set()
            raise
        raise AssertionError("unreachable")

    async def plain(req: Request) -> Response:
        return json_response({"plain": True, "query": req.query})

    async def echo(req: Request) -> Response:
        return Response(200, req.body, "application/octet-stream")

    async def headers(req: Request) -> Response:
        # Its own copy: what a handler did to an earlier request's is not here.
        seen = dict(req.headers)
        req.headers["x-changed-by-handler"] = "1"
        return json_response(seen)

    router.add("GET", "/v1/chunks", chunk, threaded=True)
    router.add("GET", "/v1/slow", slow)
    router.add("GET", "/v1/plain", plain)
    router.add("GET", "/v1/headers", headers)
    router.add("PUT", "/v1/echo", echo, body_limit=1024)
    router.add("PUT", "/v1/offer", echo, body_limit=64 << 20)
    return router


@pytest.fixture
def moved(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every connection served from a thread, as it starts."""
    seen: list[Any] = []
    run = thread_conn.ThreadConnection.run

    def recording(self: Any) -> None:
        seen.append(self)
        run(self)

    monkeypatch.setattr(thread_conn.ThreadConnection, "run", recording)
    return seen


@contextmanager
def server(tmp_path: Path, probe: Probe, **limits: Any) -> Iterator[str]:
    path = str(tmp_path / "s.sock")
    conns = ConnectionLimits(trusted=lambda peer: False, **limits)
    serve = functools.partial(
        serve_unix, path, make_router(probe), connections=conns, max_header=4096
    )
    with serving(serve):
        yield path


class Client(Reader):
    """Raw HTTP/1.1 over one Unix socket."""

    def __init__(self, path: str) -> None:
        sock = socket.socket(socket.AF_UNIX)
        sock.settimeout(DEADLINE)
        sock.connect(path)
        super().__init__(sock)

    def send(self, method: str, path: str, extra: str = "", body: bytes = b"") -> None:
        self.sock.sendall(f"{method} {path} HTTP/1.1\r\nhost: x\r\n{extra}\r\n".encode() + body)

    def get(self, path: str, extra: str = "") -> tuple[int, dict[str, str], bytes]:
        self.send("GET", path, extra)
        return self.answer()

    def close(self) -> None:
        self.sock.close()


def test_a_chunk_request_moves_the_connection_and_it_keeps_answering(
    tmp_path: Path, moved: list[Any]
) -> None:
    with server(tmp_path, Probe()) as path:
        c = Client(path)
        assert c.get("/v1/plain")[0] == 200
        assert moved == []  # a route not marked threaded leaves it on the loop
        status, headers, body = c.get("/v1/chunks?key=a")
        assert (status, body) == (200, BIG)
        wait_for(lambda: len(moved) == 1, DEADLINE, "the connection's thread")
        for _ in range(20):  # every route, on the moved connection, judged the same
            status, headers, body = c.get("/v1/chunks?key=b")
            assert (status, body, headers["x-pid"]) == (200, BIG, str(moved[0].peer.pid))
            status, _, body = c.get("/v1/plain?x=%2F")
            assert status == 200 and json.loads(body)["query"] == {"x": "/"}
        assert c.get("/v1/nothing")[0] == 404
        # Pipelined: both answered, in order.
        c.send("GET", "/v1/plain?n=1")
        c.send("GET", "/v1/chunks")
        assert json.loads(c.answer()[2])["query"] == {"n": "1"}
        assert c.answer()[2] == BIG
        c.close()


def test_each_request_on_a_moved_connection_has_its_own_headers(
    tmp_path: Path, moved: list[Any]
) -> None:
    """A header block the connection parsed before is not parsed again (a mount sends the
    same lines with every miss), but each request gets its own copy, and another block
    is parsed and checked as any."""
    with server(tmp_path, Probe()) as path:
        c = Client(path)
        assert c.get("/v1/chunks")[0] == 200
        wait_for(lambda: len(moved) == 1, DEADLINE, "the connection's thread")
        for extra in ("x-a: 1\r\n",) * 3 + ("x-b: 2\r\n", "", "x-a: 1\r\n"):
            status, _, body = c.get("/v1/headers", extra)
            got = json.loads(body)
            assert status == 200
            want = {"host": "x"} | dict([extra.strip().split(": ")] if extra else [])
            assert got == want
        assert c.get("/v1/headers", "bad header\r\n")[0] == 400
        c.close()


def test_a_large_body_arrives_whole_on_a_moved_connection(tmp_path: Path, moved: list[Any]) -> None:
    body = bytes(range(251)) * (160 << 10)  # ~39 MiB: a chunk offered back, in many reads
    with server(tmp_path, Probe()) as path:
        c = Client(path)
        assert c.get("/v1/chunks")[0] == 200
        c.send("PUT", "/v1/offer", f"content-length: {len(body)}\r\n", body)
        status, _, got = c.answer()
        assert status == 200 and got == body
        assert c.get("/v1/chunks")[2] == BIG  # the connection goes on
        assert len(moved) == 1
        c.close()


def test_limits_hold_on_a_moved_connection(tmp_path: Path, moved: list[Any]) -> None:
    with server(tmp_path, Probe()) as path:
        c = Client(path)
        assert c.get("/v1/chunks")[0] == 200
        c.send("PUT", "/v1/echo", "content-length: 5\r\n", b"hello")
        status, _, body = c.answer()
        assert (status, body) == (200, b"hello")
        c.close()
        c = Client(path)
        assert c.get("/v1/chunks")[0] == 200
        c.send("PUT", "/v1/echo", "content-length: 2048\r\n")
        status, _, body = c.answer()
        assert status == 413 and b"limit 1024" in body
        assert c.closed()
        c = Client(path)
        assert c.get("/v1/chunks")[0] == 200
        status, _, body = c.get("/v1/plain", "x-big: " + "a" * 5000 + "\r\n")
        assert status == 431
        assert c.closed()
        assert len(moved) == 3


def test_a_client_that_leaves_cancels_its_handler(tmp_path: Path, moved: list[Any]) -> None:
    probe = Probe()
    with server(tmp_path, probe) as path:
        c = Client(path)
        assert c.get("/v1/chunks")[0] == 200
        wait_for(lambda: moved, DEADLINE, "the connection's thread")
        c.send("GET", "/v1/slow")
        assert probe.started.wait(DEADLINE)
        c.close()
        assert probe.cancelled.wait(DEADLINE), "the handler outlived its client"


def test_an_idle_moved_connection_is_evicted_for_a_newcomer_of_its_uid(
    tmp_path: Path, moved: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(control_server, "_EVICT_IDLE_SECONDS", 0.0)
    with server(tmp_path, Probe(), per_uid=2) as path:
        first, second = Client(path), Client(path)
        assert first.get("/v1/chunks")[0] == 200
        # Its thread marks it idle after the answer is sent: wait for that before the
        # second's request, so the first is the longer idle whatever the scheduling.
        wait_for(lambda: len(moved) == 1 and moved[0].idle_since, DEADLINE, "the first idle")
        assert second.get("/v1/chunks")[0] == 200
        wait_for(lambda: len(moved) == 2 and all(m.idle_since for m in moved), DEADLINE, "idle")
        third = Client(path)
        assert third.get("/v1/chunks")[0] == 200  # not 429: the longest idle made room
        wait_for(lambda: first.closed(), DEADLINE, "the first connection's close")
        assert second.get("/v1/chunks")[0] == 200  # the other is left alone
        for c in (first, second, third):
            c.close()


def test_a_busy_moved_connection_is_never_evicted(
    tmp_path: Path, moved: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(control_server, "_EVICT_IDLE_SECONDS", 0.0)
    probe = Probe()
    with server(tmp_path, probe, per_uid=1) as path:
        busy = Client(path)
        assert busy.get("/v1/chunks")[0] == 200
        wait_for(lambda: moved, DEADLINE, "the connection's thread")
        busy.send("GET", "/v1/slow")
        assert probe.started.wait(DEADLINE)
        newcomer = Client(path)
        status, _, body = newcomer.get("/v1/plain")
        assert status == 429 and b"too many connections from uid" in body
        assert not probe.cancelled.is_set()
        busy.close()
        newcomer.close()


def test_with_no_thread_free_a_connection_stays_on_the_loop(
    tmp_path: Path, moved: list[Any]
) -> None:
    with server(tmp_path, Probe(), threads=1) as path:
        a, b = Client(path), Client(path)
        assert a.get("/v1/chunks")[0] == 200
        wait_for(lambda: len(moved) == 1, DEADLINE, "the first connection's thread")
        for _ in range(5):
            assert b.get("/v1/chunks")[2] == BIG
            assert a.get("/v1/chunks")[2] == BIG
        assert len(moved) == 1
        a.close()
        b.close()


def test_a_request_read_after_the_connections_nursery_closed_ends_it_not_the_loop() -> None:
    # When the daemon stops, a moved connection's nursery closes without waiting for its
    # thread; a request the thread read just then must close that connection, and the
    # loop must carry on (starting the handler in the closed nursery raised on the loop
    # and ended the whole daemon with a traceback).
    ours, client = socket.socketpair()
    client.settimeout(DEADLINE)

    async def main() -> str:
        async with trio.open_nursery() as closed:
            pass
        limits = thread_conn.ConnLimits(1024, 8192, DEADLINE, lambda headers: 1.0)
        conn = thread_conn.ThreadConnection(
            thread_conn.PlainChannel(ours), make_router(Probe()), Peer(1, 0, 0), closed, limits
        )
        client.sendall(b"GET /v1/plain HTTP/1.1\r\nhost: silofs\r\n\r\n")
        with trio.fail_after(DEADLINE):  # a thread never woken fails here, not hangs
            await trio.to_thread.run_sync(conn.run, abandon_on_cancel=True)
        await trio.sleep(0)  # the loop still schedules
        return "alive"

    assert trio.run(main) == "alive"
    assert client.recv(1) == b""  # closed, no answer
    client.close()


def test_an_inline_answers_release_runs_once_it_is_sent_in_the_connections_thread(
    tmp_path: Path, moved: list[Any]
) -> None:
    """A body lent until release() (a held chunk's LMDB txn): the answer is sent whole
    first, release() runs once per answer, in the thread that answered, and a client
    that left before its answer still gets it released."""
    released: list[str] = []
    sent: list[threading.Event] = []  # one per answer made

    def lent(req: Request) -> Response:
        done = threading.Event()
        sent.append(done)

        def release() -> None:
            released.append(threading.current_thread().name)
            done.set()

        return Response(200, memoryview(BIG), "application/octet-stream", release=release)

    async def never(req: Request) -> Response:
        raise AssertionError("the inline answer is the one sent")

    router = make_router(Probe())
    router.add_route(Route("GET", "/v1/lent", never, EVERYONE, threaded=True, inline=lent))
    path = str(tmp_path / "s.sock")
    conns = ConnectionLimits(trusted=lambda peer: False)
    with serving(functools.partial(serve_unix, path, router, connections=conns)):
        c = Client(path)
        assert c.get("/v1/chunks")[0] == 200
        wait_for(lambda: moved, DEADLINE, "the connection's thread")
        for _ in range(3):
            status, _, body = c.get("/v1/lent")
            assert (status, body) == (200, BIG)
            # Released after the last byte went out, so possibly after it arrived here.
            wait_for(lambda: len(released) == len(sent), DEADLINE, "the answer's release")
        assert len(released) == 3
        assert threading.current_thread().name not in released
        c.send("GET", "/v1/lent")  # and leaves before reading the answer
        c.close()
        wait_for(lambda: len(released) == 4, DEADLINE, "the last answer's release")


def test_a_moved_connection_is_judged_by_the_roles_its_peer_holds_now(
    tmp_path: Path, moved: list[Any]
) -> None:
    """A moved connection remembers the routes it called, but by the roles its peer held:
    roles taken away meanwhile (a member removed from the list, a user out of the admin
    group) refuse the next request of the same route, as on a new connection."""
    admin = [True]

    def roles(peer: Any) -> Caller:
        return Caller.LOCAL | (Caller.ADMIN if admin[0] else Caller(0))

    router = Router(roles=roles, refusal=lambda route, peer: "admins only")

    async def chunk(req: Request) -> Response:
        return Response(200, b"chunk", "application/octet-stream")

    router.add("GET", "/v1/chunks", chunk, who=Caller.ADMIN, threaded=True)
    path = str(tmp_path / "s.sock")
    conns = ConnectionLimits(trusted=lambda peer: False)
    with serving(functools.partial(serve_unix, path, router, connections=conns)):
        c = Client(path)
        for _ in range(3):  # the first moves the connection, the rest are remembered
            assert c.get("/v1/chunks?key=a")[0] == 200
        wait_for(lambda: len(moved) == 1, DEADLINE, "the connection's thread")
        admin[0] = False
        status, _, body = c.get("/v1/chunks?key=a")
        assert status == 403 and b"admins only" in body
        admin[0] = True
        assert c.get("/v1/chunks?key=a")[0] == 200
        c.close()


class _CountingSocket(socket.socket):
    """A socket that counts the wait limits set on it, by kind."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock.family, sock.type, fileno=sock.detach())
        self.sets: list[int] = []

    def setsockopt(self, level: int, option: int, value: Any) -> None:  # type: ignore[override]
        self.sets.append(option)
        super().setsockopt(level, option, value)


def test_receive_and_send_limits_are_kept_apart_across_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The idle wait between requests sets only the receives' limit, and answers with the
    same bound as the last one set nothing: a member's chunk asks cost no setsockopt each
    (four before). A wait still ends by its deadline. (The clock thread_conn reads is
    the test's, so each request's bound is counted from the same point of its cycle.)"""
    now = [1000.0]
    monkeypatch.setattr(thread_conn, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    a, b = socket.socketpair()
    sock = _CountingSocket(a)
    ch = thread_conn.PlainChannel(sock)
    try:
        for _ in range(3):  # a request's cycle: idle wait, its read, its answer
            ch.deadline = float("inf")
            ch.wait_at_most(300.0, sends=False)
            b.sendall(b"ask")
            assert ch.recv() == b"ask"
            now[0] += 0.5
            ch.deadline = now[0] + 2.0
            ch.send(b"answer")
            assert b.recv(16) == b"answer"
        # The first idle wait bounds sends too (none waits without a limit), the first
        # answer sets its own; nothing after that.
        assert sock.sets == [socket.SO_RCVTIMEO, socket.SO_SNDTIMEO, socket.SO_SNDTIMEO]
        # A receive whose deadline is sooner than the kept limit gets its own (the
        # kernel's clock counts it), and ends by it.
        ch.deadline = now[0] + 0.05
        with pytest.raises(thread_conn._Closed):
            ch.recv()
        assert sock.sets[-1] == socket.SO_RCVTIMEO
    finally:
        sock.close()
        b.close()
