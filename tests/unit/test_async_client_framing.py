"""AsyncControlClient's own HTTP/1.1 framing against a scripted daemon: every byte the
daemon sends is the test's, so what the client does with 102 heads, an answer without
a length, a malformed or oversized head, a chunked answer and a short body is pinned.
No sleeps: the scripted side blocks on its socket with a deadline.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio

from silofs.control.client import AsyncControlClient, ControlError, _peer_closed
from tests.support.poll import wait_for
from tests.unit.serving import next_head

DEADLINE = 10.0


@contextmanager
def scripted(tmp_path: Path, answers: list[bytes]) -> Iterator[tuple[str, list[bytes]]]:
    """A Unix socket that answers each request it reads (up to its blank line) with the
    next of `answers` on one connection, then closes it; the requests' heads are
    recorded."""
    path = str(tmp_path / "d.sock")
    lsock = socket.socket(socket.AF_UNIX)
    lsock.bind(path)
    lsock.listen()
    lsock.settimeout(DEADLINE)
    heads: list[bytes] = []

    def one(conn: socket.socket) -> None:
        conn.settimeout(DEADLINE)
        with conn:
            buf = b""
            for answer in answers:
                got = next_head(conn, buf)
                if got is None:
                    return
                head, buf = got
                heads.append(head)
                conn.sendall(answer)

    def run() -> None:
        # Two connections: a GET that failed mid-answer is retried once on a fresh one.
        for _ in range(2):
            try:
                conn, _ = lsock.accept()
            except OSError:  # closed: the test is over
                return
            one(conn)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield path, heads
    finally:
        for _ in range(2):  # wake an accept still waiting: a connection that says nothing
            with socket.socket(socket.AF_UNIX) as waker:
                waker.connect_ex(path)
        t.join(DEADLINE)
        lsock.close()


def ask(path: str, *requests: tuple[str, str]) -> list[tuple[int, dict[str, str], bytes]]:
    async def main() -> list[tuple[int, dict[str, str], bytes]]:
        async with AsyncControlClient(path, timeout=DEADLINE) as client:
            return [await client.request(m, p) for m, p in requests]

    return trio.run(main)


def test_progress_heads_are_skipped_and_the_connection_kept(tmp_path: Path) -> None:
    body = bytes(range(256)) * 512
    answers = [
        b"HTTP/1.1 102 Processing\r\n\r\nHTTP/1.1 102 Processing\r\n\r\n"
        b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n"
        b"x-silofs-source: cache\r\nX-Two: a\r\nx-two: b\r\ncontent-length: %d\r\n\r\n"
        % len(body)
        + body,
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b'HTTP/1.1 404 Not Found\r\ncontent-length: 15\r\n\r\n{"error":"no"}\n',
    ]
    with scripted(tmp_path, answers) as (path, heads):
        got = ask(path, ("GET", "/v1/chunks?key=a%2Fb"), ("DELETE", "/v1/x"), ("GET", "/v1/y"))
    (s1, h1, b1), (s2, _, b2), (s3, _, b3) = got
    assert (s1, bytes(b1), h1["x-silofs-source"], h1["x-two"]) == (200, body, "cache", "a, b")
    assert (s2, b2) == (204, b"")
    assert (s3, b3) == (404, b'{"error":"no"}\n')
    assert len(heads) == 3  # one connection for all three
    assert heads[0].startswith(b"GET /v1/chunks?key=a%2Fb HTTP/1.1\r\nhost: localhost\r\n")


def test_an_answer_without_a_length_is_read_to_the_close(tmp_path: Path) -> None:
    with scripted(tmp_path, [b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\nall of it"]) as (
        path,
        _,
    ):
        [(status, _, body)] = ask(path, ("GET", "/v1/z"))
    assert (status, body) == (200, b"all of it")


@pytest.mark.parametrize(
    "answer",
    [
        b"SPDY/3 200 OK\r\n\r\n",
        b"HTTP/1.1 abc OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nshort",
        b"HTTP/1.1 200 OK\r\nx: " + b"a" * (80 << 10),
    ],
    ids=["not-http", "bad-status", "bad-header", "chunked", "bad-length", "short", "huge-head"],
)
def test_a_bad_answer_is_one_clear_error(tmp_path: Path, answer: bytes) -> None:
    with scripted(tmp_path, [answer]) as (path, _), pytest.raises(ControlError) as exc:
        ask(path, ("GET", "/v1/z"))
    assert "connection to the silofs daemon" in str(exc.value) or "cannot reach" in str(exc.value)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("path", ["/v1/x HTTP/1.1\r\nx-evil: 1", "/v1/x\nfoo", "/v1/x y", "/v1/\0"])
def test_a_request_that_would_break_the_framing_is_refused_unsent(
    tmp_path: Path, path: str
) -> None:
    with scripted(tmp_path, []) as (sock, heads), pytest.raises(ControlError) as exc:
        ask(sock, ("GET", path))
    assert "malformed request" in str(exc.value)
    assert heads == []


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_a_connection_the_daemon_closed_is_not_reused_for_a_request_it_cannot_repeat(
    tmp_path: Path, method: str
) -> None:
    """A connection used in the last second is reused without a poll: a GET on one the
    daemon closed meanwhile is asked again on a new one; a POST (which may not be
    repeated) polls first and is sent once, on a new connection."""
    ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"

    async def main(path: str) -> tuple[list[tuple[int, bytes]], int]:
        async with AsyncControlClient(path, timeout=DEADLINE) as client:
            status, _, body = await client.request("GET", "/v1/a")
            [conn] = client._idle
            # The scripted daemon closes the connection after its one answer.
            wait_for(lambda: _peer_closed(conn.sock), DEADLINE, "the daemon's close")
            again = await client.request(method, "/v1/b", b"{}" if method == "POST" else None)
            return [(status, bytes(body)), (again[0], bytes(again[2]))], client.connections_opened

    with scripted(tmp_path, [ok]) as (path, heads):
        answers, opened = trio.run(main, path)
    assert answers == [(200, b"ok"), (200, b"ok")]
    assert opened == 2
    assert [h.split(b" ", 1)[0] for h in heads] == [b"GET", method.encode()]
