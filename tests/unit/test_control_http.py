"""The control HTTP layer over real Unix sockets: server, routing, limits, both clients.

Servers run either inside the test's own trio.run (async client tests) or in a
thread with its own trio loop (blocking client, raw sockets, curl). Nothing here
waits with sleeps: every wait is a poll or a blocking read with a deadline.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import resource
import shutil
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import silofs.control.peer as control_peer
from silofs.control.client import (
    AsyncControlClient,
    ControlClient,
    ControlError,
    _peer_closed,
    quote_segment,
)
from silofs.control.peer import Peer, peer_may_change
from silofs.control.router import HTTPError, Request, Response, Router, json_response, text_response
from silofs.control.server import AddressInUseError, serve_unix
from tests.support.poll import wait_for
from tests.unit.serving import serving

BLOB = os.urandom(32 << 20)
DEADLINE = 10.0


# ------------------------------------------------------------------ fixtures


def make_router(threaded: bool = False) -> Router:
    """Every route `threaded` or none: a connection then moves to a thread of its own
    after its first request (control/thread_conn.py), and the tests that use the
    `server` fixture run both ways."""
    router = Router()
    add = functools.partial(router.add, threaded=threaded)

    async def dataset(req: Request, name: str) -> Response:
        return json_response({"name": name, "query": req.query, "method": req.method})

    async def dataset_stats(req: Request) -> Response:
        return json_response({"stats": True})

    async def echo(req: Request) -> Response:
        return json_response(req.json())

    async def size(req: Request) -> Response:
        return json_response({"size": len(req.body)})

    async def boom(req: Request) -> Response:
        raise RuntimeError("kaboom\nsecond line never shown")

    async def teapot(req: Request) -> Response:
        raise HTTPError(418, "short and stout")

    async def blob(req: Request, size: str) -> Response:
        return Response(body=memoryview(BLOB)[: int(size)], content_type="application/octet-stream")

    async def peer(req: Request) -> Response:
        return json_response(vars(req.peer))

    async def metrics(req: Request) -> Response:
        return text_response("silofs_up 1\n")

    add("GET", "/v1/datasets/{name}/cache", dataset)
    add("PUT", "/v1/datasets/{name}/cache", dataset)
    add("DELETE", "/v1/datasets/{name}/cache", dataset)
    add("GET", "/v1/datasets/{name}", dataset)
    add("GET", "/v1/datasets/stats", dataset_stats)
    add("POST", "/v1/echo", echo)
    add("POST", "/v1/size", size)
    add("GET", "/v1/boom", boom)
    add("GET", "/v1/teapot", teapot)
    add("GET", "/v1/blob/{size}", blob)
    add("GET", "/v1/peer", peer)
    add("GET", "/metrics", metrics)
    return router


@contextmanager
def server_thread(path: str, router: Router | None = None, **kw: Any) -> Iterator[str]:
    """serve_unix in a thread with its own trio loop; cancelled on exit."""
    with serving(functools.partial(serve_unix, path, router or make_router(), **kw)):
        yield path


@pytest.fixture(autouse=True)
def no_connection_bugs(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """A connection task must never die of an unexpected exception, whatever it is sent."""
    caplog.set_level(logging.DEBUG, logger="silofs.control")
    yield
    bugs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("bug:")]
    assert not bugs, bugs


@pytest.fixture
def sock_path(tmp_path: Path) -> str:
    return str(tmp_path / "run" / "silofs.sock")


@pytest.fixture(params=[False, True], ids=["loop", "threaded"])
def server(sock_path: str, request: pytest.FixtureRequest) -> Iterator[str]:
    with server_thread(sock_path, make_router(request.param)) as path:
        yield path


def raw_connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(DEADLINE)
    sock.connect(path)
    return sock


def recv_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP response with Content-Length framing, read off a raw socket."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = sock.recv(65536)
        assert data, f"connection closed before a full response: {buf!r}"
        buf += data
    head, body = buf.split(b"\r\n\r\n", 1)
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    length = int(headers["content-length"])
    while len(body) < length:
        data = sock.recv(65536)
        assert data, "connection closed mid-body"
        body += data
    return int(status_line.split()[1]), headers, body[:length]


def read_until_eof(sock: socket.socket) -> bytes:
    chunks = []
    while data := sock.recv(65536):
        chunks.append(data)
    return b"".join(chunks)


def raw_exchange(path: str, data: bytes) -> bytes:
    """Send ``data``, half-close, and return everything the server sends back."""
    with raw_connect(path) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may reject before we finished sending
        try:
            return read_until_eof(sock)
        except ConnectionResetError:
            return b""


def assert_alive(path: str) -> None:
    with ControlClient(path) as client:
        assert client.request("GET", "/v1/datasets/x/cache")["name"] == "x"


def error_of(body: bytes) -> str:
    assert body.endswith(b"\n") and body.count(b"\n") == 1, body
    return json.loads(body)["error"]


# ------------------------------------------------------------------- routing


def test_quoted_uri_arrives_as_one_param_with_query(server: str) -> None:
    uri = "s3://bucket/some prefix/ä/"
    with ControlClient(server) as client:
        got = client.request("GET", f"/v1/datasets/{quote_segment(uri)}/cache?x=1&y=&z=a%20b")
    assert got == {"name": uri, "query": {"x": "1", "y": "", "z": "a b"}, "method": "GET"}


def test_literal_segment_beats_param(server: str) -> None:
    with ControlClient(server) as client:
        assert client.request("GET", "/v1/datasets/stats") == {"stats": True}
        assert client.request("GET", "/v1/datasets/other")["name"] == "other"


def test_unknown_path_is_404_and_wrong_method_405_with_allow(server: str) -> None:
    with raw_connect(server) as sock:
        sock.sendall(b"GET /v1/nope HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, body = recv_response(sock)
        assert status == 404 and "no such endpoint" in error_of(body)
        sock.sendall(b"POST /v1/datasets/a/cache HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        status, headers, body = recv_response(sock)
        assert status == 405
        assert headers["allow"] == "DELETE, GET, PUT"
        assert "POST" in error_of(body)


def test_empty_param_segment_does_not_match(server: str) -> None:
    with ControlClient(server) as client, pytest.raises(ControlError) as err:
        client.request("GET", "/v1/datasets//cache")
    assert err.value.status == 404


def test_head_answers_like_get_without_body(server: str) -> None:
    with raw_connect(server) as sock:
        sock.sendall(b"HEAD /v1/blob/1000 HTTP/1.1\r\nHost: x\r\n\r\n")
        buf = b""
        while b"\r\n\r\n" not in buf:
            buf += sock.recv(65536)
        assert buf.startswith(b"HTTP/1.1 200 ")
        assert b"content-length: 1000\r\n" in buf and buf.endswith(b"\r\n\r\n")
        sock.sendall(b"GET /v1/peer HTTP/1.1\r\nHost: x\r\n\r\n")  # framing still intact
        assert recv_response(sock)[0] == 200


def test_router_rejects_bad_and_duplicate_patterns() -> None:
    router = Router()

    async def handler(req: Request) -> Response:
        return Response()

    router.add("GET", "/v1/a/{x}", handler)
    with pytest.raises(ValueError, match="duplicate"):
        router.add("get", "/v1/a/{x}", handler)
    with pytest.raises(ValueError, match="start with"):
        router.add("GET", "v1/a", handler)
    with pytest.raises(ValueError, match="bad parameter"):
        router.add("GET", "/v1/{x", handler)


# ------------------------------------------------------------------ failures


def test_http_error_and_handler_exception_then_keeps_serving(server: str) -> None:
    with ControlClient(server) as client:
        with pytest.raises(ControlError) as err:
            client.request("GET", "/v1/teapot")
        assert (err.value.status, str(err.value)) == (418, "short and stout")
        with pytest.raises(ControlError) as err:
            client.request("GET", "/v1/boom")
        assert err.value.status == 500
        assert str(err.value) == "internal error: RuntimeError: kaboom"
        assert client.request("GET", "/v1/datasets/a/cache")["name"] == "a"
        assert client.connections_opened == 1  # errors do not cost the connection


def test_bad_json_and_non_object_are_400(server: str) -> None:
    with raw_connect(server) as sock:
        for body, expected in [
            (b"{nope", "request body is not valid JSON: "),
            (b"[1]", "JSON object"),
        ]:
            head = f"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
            sock.sendall(head.encode() + body)
            status, _, reply = recv_response(sock)
            assert status == 400 and expected in error_of(reply)
    with ControlClient(server) as client:
        assert client.request("POST", "/v1/echo", {"a": [1, "b"]}) == {"a": [1, "b"]}


def test_request_json_unit() -> None:
    def req(body: bytes) -> Request:
        return Request("POST", "/", {}, {}, body, Peer(1, 2, 3))

    assert req(b'{"a": 1}').json() == {"a": 1}
    for bad in (b"", b"\xff", b"{", b'"str"'):
        with pytest.raises(HTTPError) as err:
            req(bad).json()
        assert err.value.status == 400


def test_garbage_bytes_get_400_and_close(server: str) -> None:
    reply = raw_exchange(server, b"\x00\x01garbage\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 400 ")
    assert b"malformed HTTP request" in reply
    assert_alive(server)


def test_body_over_limit_is_413_without_reading_it(sock_path: str) -> None:
    with server_thread(sock_path, max_body=1000) as path:
        with raw_connect(path) as sock:
            # Announce 100 MiB, send 10 bytes: the answer must come anyway.
            sock.sendall(b"POST /v1/size HTTP/1.1\r\nHost: x\r\nContent-Length: 104857600\r\n\r\n")
            sock.sendall(b"0123456789")
            status, headers, body = recv_response(sock)
            assert status == 413 and "too large" in error_of(body)
            assert headers["connection"] == "close"
        chunked = b"POST /v1/size HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        reply = raw_exchange(path, chunked + b"800\r\n" + b"a" * 0x800 + b"\r\n0\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 413 ")
        with ControlClient(path) as client:
            with pytest.raises(ControlError) as err:  # lingering close lets it see the 413
                client.request("POST", "/v1/echo", {"pad": "x" * 5000})
            assert err.value.status == 413
            assert client.request("POST", "/v1/size", {"a": 1}) == {"size": 7}


def test_chunked_request_body_within_limit(server: str) -> None:
    with raw_connect(server) as sock:
        head = b"POST /v1/size HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        sock.sendall(head + b"5\r\nhello\r\n3\r\nabc\r\n0\r\n\r\n")
        status, _, body = recv_response(sock)
        assert status == 200 and json.loads(body) == {"size": 8}


@pytest.mark.parametrize("split", [False, True])
def test_header_over_limit_is_431(sock_path: str, split: bool) -> None:
    with server_thread(sock_path, max_header=4096) as path:
        big = b"GET /v1/peer HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8000
        # split: the server sees an incomplete oversized block (h11's own limit);
        # whole: a complete oversized block arrives in one read (our check).
        with raw_connect(path) as sock:
            sock.sendall(big)
            if not split:
                sock.sendall(b"\r\n\r\n")
            status, _, body = recv_response(sock)
        assert status == 431 and "header too large" in error_of(body)
        assert_alive(path)


# ---------------------------------------------------------------- keep-alive


def test_keep_alive_serves_many_requests_on_one_socket(server: str) -> None:
    with raw_connect(server) as sock:
        for i in range(5):
            sock.sendall(f"GET /v1/datasets/d{i}/cache HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            status, _, body = recv_response(sock)
            assert status == 200 and json.loads(body)["name"] == f"d{i}"
    with ControlClient(server) as client:
        for _ in range(5):
            client.request("GET", "/v1/peer")
        assert client.connections_opened == 1


def test_http10_and_connection_close_end_the_connection(server: str) -> None:
    for request in (
        b"GET /v1/peer HTTP/1.0\r\n\r\n",
        b"GET /v1/peer HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    ):
        with raw_connect(server) as sock:
            sock.sendall(request)
            reply = read_until_eof(sock)  # returns only because the server closes
            assert reply.split(b" ", 2)[1] == b"200"


def test_sync_client_reconnects_after_idle_close(sock_path: str) -> None:
    with server_thread(sock_path, idle_timeout=0.2) as path:
        with ControlClient(path) as client:
            assert client.request("GET", "/v1/datasets/a/cache")["name"] == "a"
            sock = client._conn.sock  # type: ignore[union-attr]
            wait_for(lambda: _peer_closed(sock), DEADLINE, "the idle close")
            assert client.request("POST", "/v1/echo", {"again": 1}) == {"again": 1}
            assert client.connections_opened == 2


def test_idle_check_works_above_fd_setsize() -> None:
    """A busy mount process can hold >1024 fds; select() would fail there."""
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] <= 1500:
        pytest.skip("RLIMIT_NOFILE too low to place an fd above 1024")
    a, b = socket.socketpair()
    high = socket.socket(fileno=os.dup2(a.fileno(), 1500))
    try:
        assert not _peer_closed(high)
        b.close()
        assert _peer_closed(high)
    finally:
        high.close()
        a.close()


def test_sync_client_raw_bytes_and_text(server: str) -> None:
    with ControlClient(server) as client:
        assert client.request("GET", "/v1/blob/5000") == BLOB[:5000]
        status, headers, body = client.request_raw("GET", "/metrics")
        assert (status, body) == (200, b"silofs_up 1\n")
        assert headers["content-type"] == "text/plain; version=0.0.4"
        status, _, body = client.request_raw("GET", "/v1/nope")
        assert status == 404 and b"no such endpoint" in body


def test_clients_report_an_absent_daemon(tmp_path: Path) -> None:
    path = str(tmp_path / "absent.sock")
    expected = (
        f"cannot reach the silofs daemon at {path} (is it running? start it with `silofs daemon`)"
    )
    with pytest.raises(ControlError) as err:
        ControlClient(path).request("GET", "/v1/status")
    assert err.value.status is None and str(err.value) == expected

    async def main() -> None:
        async with AsyncControlClient(path) as client:
            with pytest.raises(ControlError) as err:
                await client.json("GET", "/v1/status")
            assert err.value.status is None and str(err.value) == expected

    trio.run(main)


def test_a_socket_path_that_is_no_socket_is_named_as_what_it_is(tmp_path: Path) -> None:
    """A regular file or a directory where the socket should be: no daemon can listen
    there, so "is it running? start it" would send the user the wrong way."""
    (tmp_path / "file.sock").write_text("")
    (tmp_path / "dir.sock").mkdir()
    for name, kind in (("file.sock", "a regular file"), ("dir.sock", "a directory")):
        path = str(tmp_path / name)
        with pytest.raises(ControlError) as err:
            ControlClient(path).request("GET", "/v1/status")
        assert str(err.value) == (
            f"{path} is {kind}, not a silofs daemon's socket: point --socket "
            "(or SILOFS_SOCKET) at the daemon's socket"
        )


def test_an_address_of_another_scheme_is_named_as_no_daemon_address() -> None:
    """http://HOST or unix:///PATH was taken as a relative socket path, and the user told
    to start a daemon that was not the problem."""
    for address in ("http://x", "unix:///run/silofs.sock"):
        with pytest.raises(ControlError) as err:
            ControlClient(address).request("GET", "/v1/status")
        assert str(err.value).startswith(f"{address!r} is no daemon address"), err.value
        assert "tls://HOST:PORT" in str(err.value)


# ----------------------------------------------------------------- async client


async def start_server(nursery: trio.Nursery, path: str, **kw: Any) -> None:
    await nursery.start(functools.partial(serve_unix, path, make_router(), **kw))


def test_async_client_concurrent_large_bodies_intact(sock_path: str) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await start_server(nursery, sock_path)
            async with AsyncControlClient(sock_path, max_connections=3) as client:
                results: dict[int, tuple[int, bytes]] = {}

                async def fetch(i: int, size: int) -> None:
                    status, headers, body = await client.request("GET", f"/v1/blob/{size}")
                    assert headers["content-length"] == str(size)
                    results[i] = (status, body)

                sizes = [len(BLOB), 1, len(BLOB), 3 << 20, 0, len(BLOB) - 7]
                async with trio.open_nursery() as fetches:
                    for i, size in enumerate(sizes):
                        fetches.start_soon(fetch, i, size)
                for i, size in enumerate(sizes):
                    status, body = results[i]
                    assert status == 200 and len(body) == size
                    assert body == BLOB[:size]
                assert client.connections_opened <= 3
                got = await client.json("GET", f"/v1/datasets/{quote_segment('gs://b/')}/cache")
                assert got["name"] == "gs://b/"
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_async_client_reads_large_bodies_directly_and_keeps_the_connection(
    sock_path: str,
) -> None:
    """Bodies of 64 KiB and more bypass h11 (one recv_into buffer); the connection then
    serves the next requests, large and small, with a fresh h11 state."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await start_server(nursery, sock_path)
            async with AsyncControlClient(sock_path, max_connections=1) as client:
                for size in (len(BLOB), 64 << 10, (64 << 10) - 1, 3 << 20, 5):
                    status, headers, body = await client.request("GET", f"/v1/blob/{size}")
                    assert (status, bytes(body)) == (200, BLOB[:size])
                    assert await client.json("POST", "/v1/echo", {"n": size}) == {"n": size}
                assert client.connections_opened == 1
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_async_client_reuses_connections_and_raises_on_errors(sock_path: str) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await start_server(nursery, sock_path)
            async with AsyncControlClient(sock_path) as client:
                for i in range(5):
                    assert (await client.json("POST", "/v1/echo", {"i": i})) == {"i": i}
                assert client.connections_opened == 1
                with pytest.raises(ControlError) as err:
                    await client.json("GET", "/v1/teapot")
                assert (err.value.status, str(err.value)) == (418, "short and stout")
                status, _, body = await client.request("GET", "/v1/boom")
                assert status == 500 and error_of(body).startswith("internal error:")
                status, _, body = await client.request(
                    "POST", "/v1/size", b"\x00" * 1000, headers={"x-trace": "1"}
                )
                assert (status, json.loads(body)) == (200, {"size": 1000})
                assert client.connections_opened == 1
            nursery.cancel_scope.cancel()

    trio.run(main)


async def flaky_server(path: str, seen: list[bytes], task_status: Any) -> None:
    """Drops the first connection after reading its request; answers {} afterwards."""
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await sock.bind(path)
    sock.listen()
    task_status.started()

    async def handle(stream: trio.SocketStream) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            data += await stream.receive_some(65536)
        seen.append(data.split(b" ", 1)[0])
        if len(seen) > 1:
            await stream.send_all(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: 3\r\n\r\n{}\n"
            )
        await stream.aclose()

    await trio.serve_listeners(handle, [trio.SocketListener(sock)])


@pytest.mark.parametrize("method, retried", [("GET", True), ("PUT", True), ("POST", False)])
def test_async_client_retries_only_idempotent_methods(
    tmp_path: Path, method: str, retried: bool
) -> None:
    path = str(tmp_path / "flaky.sock")

    async def main() -> None:
        seen: list[bytes] = []
        async with trio.open_nursery() as nursery:
            await nursery.start(flaky_server, path, seen)
            async with AsyncControlClient(path) as client:
                if retried:
                    assert await client.json(method, "/v1/x", {}) == {}
                    assert seen == [method.encode()] * 2
                else:
                    with pytest.raises(ControlError) as err:
                        await client.json(method, "/v1/x", {})
                    assert err.value.status is None and "failed" in str(err.value)
                    assert seen == [method.encode()]
            nursery.cancel_scope.cancel()

    trio.run(main)


# ------------------------------------------------------------- socket lifecycle


def test_live_socket_is_refused_and_stale_socket_taken_over(sock_path: str) -> None:
    with server_thread(sock_path):
        with pytest.raises(AddressInUseError) as err:
            with server_thread(sock_path):
                pass
        assert str(err.value) == f"another silofs daemon is already listening on {sock_path}"
        assert_alive(sock_path)  # the refused attempt did not touch the live socket

    # A crashed daemon leaves its socket file behind with nobody listening.
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(sock_path)
    stale.close()
    assert stat.S_ISSOCK(os.lstat(sock_path).st_mode)
    with server_thread(sock_path):
        assert_alive(sock_path)
    assert not os.path.exists(sock_path)  # removed on cancel


def test_non_socket_file_is_never_replaced(sock_path: str) -> None:
    os.makedirs(os.path.dirname(sock_path))
    Path(sock_path).write_text("precious")
    with pytest.raises(AddressInUseError, match="not a socket"):
        with server_thread(sock_path):
            pass
    assert Path(sock_path).read_text() == "precious"


def test_parent_dir_mode_and_owner(tmp_path: Path) -> None:
    path = str(tmp_path / "a" / "b" / "silofs.sock")
    with server_thread(path, mode=0o660, uid=os.getuid(), gid=os.getgid()):
        st_ = os.lstat(path)
        assert stat.S_ISSOCK(st_.st_mode) and stat.S_IMODE(st_.st_mode) == 0o660
        assert (st_.st_uid, st_.st_gid) == (os.getuid(), os.getgid())
    assert os.listdir(os.path.dirname(path)) == []  # no socket, no lock file left


# ------------------------------------------------------------------- peers


def test_peer_credentials_are_ours(server: str) -> None:
    with ControlClient(server) as client:
        got = client.request("GET", "/v1/peer")
    assert got == {
        "pid": os.getpid(),
        "uid": os.getuid(),
        "gid": os.getgid(),
        "remote": None,  # a local peer: no certificate, so no names and no node role
        "names": [],
        "node": False,
    }


def test_peer_may_change(monkeypatch: pytest.MonkeyPatch) -> None:
    assert peer_may_change(Peer(pid=1, uid=0, gid=0), None)
    assert peer_may_change(Peer(pid=1, uid=0, gid=5), 1234)
    assert not peer_may_change(Peer(pid=1, uid=1000, gid=1000), None)
    assert peer_may_change(Peer(pid=1, uid=1000, gid=1234), 1234)

    class FakeUser:
        pw_name = "alice"
        pw_gid = 1000

    def getpwuid(uid: int) -> FakeUser:
        if uid != 1000:
            raise KeyError(uid)
        return FakeUser()

    monkeypatch.setattr(control_peer.pwd, "getpwuid", getpwuid)
    monkeypatch.setattr(
        control_peer.os, "getgrouplist", lambda name, gid: [gid, 1234] if name == "alice" else [gid]
    )
    control_peer._groups_cache.clear()
    assert peer_may_change(Peer(pid=1, uid=1000, gid=1000), 1234)  # supplementary group
    assert not peer_may_change(Peer(pid=1, uid=1000, gid=1000), 999)
    assert not peer_may_change(Peer(pid=1, uid=4242, gid=4242), 1234)  # no passwd entry


# -------------------------------------------------------------------- curl


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_unix_socket(sock_path: str, tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"pad": "x" * (1536 * 1024)}))  # > 1 MiB: curl sends Expect
    with server_thread(sock_path, max_body=4 << 20) as path:

        def curl(*args: str) -> str:
            cmd = ["curl", "-sS", "--max-time", "10", "--unix-socket", path, *args]
            return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout

        got = curl("http://x/v1/datasets/s3%3A%2F%2Fb%2Fp%2F/cache")
        assert json.loads(got)["name"] == "s3://b/p/"
        assert json.loads(curl("-d", '{"k": "v"}', "http://x/v1/echo")) == {"k": "v"}
        assert json.loads(curl("--data-binary", f"@{big}", "http://x/v1/size")) == {
            "size": big.stat().st_size
        }
        assert curl("http://x/metrics") == "silofs_up 1\n"
        status = curl("-o", "/dev/null", "-w", "%{http_code}", "http://x/v1/nope")
        assert status == "404"


# --------------------------------------------------------------- robustness

HTTPISH = st.one_of(
    st.binary(max_size=300),
    st.tuples(
        st.sampled_from([b"GET ", b"POST ", b"PUT /v1/echo HTTP/1.1\r\n", b"GET / HTTP/1.1\r\n"]),
        st.binary(max_size=200),
    ).map(b"".join),
    st.lists(
        st.sampled_from(
            [
                b"Host: x\r\n",
                b"Content-Length: 3\r\n",
                b"Content-Length: -1\r\n",
                b"Transfer-Encoding: chunked\r\n",
                b"Expect: 100-continue\r\n",
                b"\r\n",
                b"zz\r\n",
                b"{}",
                b"\x00",
            ]
        ),
        max_size=8,
    ).map(lambda parts: b"POST /v1/echo HTTP/1.1\r\n" + b"".join(parts)),
)


def test_random_bytes_never_kill_the_server(sock_path: str) -> None:
    with server_thread(sock_path, idle_timeout=5.0) as path:

        @settings(
            max_examples=150,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture],
        )
        @given(HTTPISH)
        def check(data: bytes) -> None:
            reply = raw_exchange(path, data)
            assert reply == b"" or reply.startswith(b"HTTP/1.1 "), reply[:200]
            with raw_connect(path) as sock:
                sock.sendall(b"GET /v1/datasets/ok/cache HTTP/1.1\r\nHost: x\r\n\r\n")
                status, _, body = recv_response(sock)
                assert status == 200 and json.loads(body)["name"] == "ok"

        check()


# --------------------------------------------------------------- throughput


BENCH_SERVER = """
import sys, trio
from silofs.control.router import Response, Router
from silofs.control.server import serve_unix
blob = bytes(range(256)) * (8 << 12)  # 8 MiB

async def handler(req):
    return Response(body=blob, content_type="application/octet-stream")

router = Router()
router.add("GET", "/blob", handler)
trio.run(serve_unix, sys.argv[1], router)
"""


@pytest.mark.skipif(not os.environ.get("SILOFS_BENCH"), reason="set SILOFS_BENCH=1 to measure")
@pytest.mark.parametrize("concurrency", [1, 4])
def test_throughput_8mib_get_loop(sock_path: str, concurrency: int) -> None:
    """Daemon in its own process (as in production), mount-side client here."""
    size, count = 8 << 20, 240
    repo = Path(__file__).resolve().parents[2]
    server = subprocess.Popen([sys.executable, "-c", BENCH_SERVER, sock_path], cwd=repo)
    try:
        wait_for(lambda: os.path.exists(sock_path), DEADLINE, "the benchmark server")

        async def main() -> None:
            async with AsyncControlClient(sock_path) as client:
                while True:  # the file exists before listen(): poll until it answers
                    try:
                        await client.request("GET", "/blob")
                        break
                    except ControlError:
                        await trio.sleep(0.01)  # polling interval, not synchronisation
                start, cpu = time.perf_counter(), time.process_time()

                async def worker() -> None:
                    for _ in range(count // concurrency):
                        status, _, body = await client.request("GET", "/blob")
                        assert status == 200 and len(body) == size

                async with trio.open_nursery() as nursery:
                    for _ in range(concurrency):
                        nursery.start_soon(worker)
                elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
            print(
                f"\n{count} x 8 MiB GET, concurrency {concurrency}: "
                f"{count * size / elapsed / 2**20:.0f} MiB/s, "
                f"client CPU {cpu / count * 1e3:.2f} ms per 8 MiB"
            )

        trio.run(main)
    finally:
        server.terminate()
        server.wait(DEADLINE)


def test_decoded_query_fields_are_remembered_within_bounds() -> None:
    """Escaped fields decoded once are remembered for the next request (a content id's
    quotes on every chunk ask), but any peer's request reaches that memo: long fields
    are never kept, and however many distinct ones come it holds a bounded number."""
    from silofs.control import router as router_module
    from silofs.control.router import parse_query

    memo = router_module._UNQUOTED
    memo.clear()
    assert parse_query("cid=%22abc%22&k=a+b") == {"cid": '"abc"', "k": "a b"}
    assert memo == {"%22abc%22": '"abc"'}
    long = "%41" * 1000  # 3,000 characters
    assert parse_query(f"x={long}") == {"x": "A" * 1000}
    assert long not in memo
    for i in range(router_module._MAX_UNQUOTED + 10):
        assert parse_query(f"v=%2F{i}") == {"v": f"/{i}"}
        assert len(memo) <= router_module._MAX_UNQUOTED
    with pytest.raises(UnicodeDecodeError):
        parse_query("x=%FF")
    assert "%FF" not in memo
