"""Helpers the control-socket unit tests share: a trio server in a thread of its own,
and a reader of raw HTTP/1.1 answers.

Owns running one `serve_*` task (control/server.py: it calls task_status.started() once
listening) on its own trio loop in a thread, so a test can talk to it with the blocking
ControlClient or raw sockets, and stopping it at the end with any error it died of
raised in the test; Reader, the answers off such a raw socket; next_head, the requests
a scripted raw server reads. Never decides what is
served (the caller's router) and never sleeps to synchronise (tests/support/poll.py's
wait_for polls with a deadline).
"""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import trio

DEADLINE = 10.0


def next_head(sock: socket.socket | ssl.SSLSocket, buf: bytes) -> tuple[bytes, bytes] | None:
    """(the next request head, what followed it) off `sock`, `buf` being what was
    received and not yet consumed; None if the client closed first."""
    while b"\r\n\r\n" not in buf:
        data = sock.recv(65536)
        if not data:
            return None
        buf += data
    head, _, rest = buf.partition(b"\r\n\r\n")
    return head, rest


@contextmanager
def serving(serve: Callable[..., Awaitable[Any]]) -> Iterator[None]:
    """`serve` started in a trio nursery on a thread; cancelled on exit. An error it
    raised while starting (e.g. AddressInUseError) or while serving is raised here."""
    started = threading.Event()
    state: dict[str, Any] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            state["token"] = trio.lowlevel.current_trio_token()
            state["nursery"] = nursery
            try:
                await nursery.start(serve)
            except BaseException as exc:
                state["start_error"] = exc
                raise
            finally:
                started.set()

    def run() -> None:
        try:
            trio.run(main)
        except BaseException as exc:
            state["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(DEADLINE), "server did not start"
    if "start_error" in state:
        thread.join(DEADLINE)
        raise state["start_error"]
    try:
        yield
        assert thread.is_alive(), f"server died: {state.get('error')!r}"
    finally:
        trio.from_thread.run_sync(state["nursery"].cancel_scope.cancel, trio_token=state["token"])
        thread.join(DEADLINE)
        assert not thread.is_alive()
    if "error" in state:
        raise state["error"]


class Reader:
    """HTTP/1.1 answers off one blocking socket (plain or TLS), every byte the test's."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, b""

    def answer(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buf:
            self._more()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {
            k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])
        }
        n = int(headers.get("content-length", "0"))
        while len(self.buf) < n:
            self._more()
        body, self.buf = self.buf[:n], self.buf[n:]
        return status, headers, body

    def closed(self) -> bool:
        try:
            return not self.buf and self.sock.recv(1) == b""
        except (ConnectionResetError, ssl.SSLError):
            return True

    def _more(self) -> None:
        data = self.sock.recv(1 << 20)
        assert data, f"closed; had {self.buf[:200]!r}"
        self.buf += data
