"""The peer client's exchange (node/peer_client.py PeerPool) against a member whose
ciphertext arrives in small pieces: a chunk's body is read whole and in time, however
its TLS records are cut by the network.

The member is a thread driving TLS through memory BIOs over a plain socket, so the test
decides how its ciphertext is sent: in pieces smaller than a record, with a pause after
each, so the asker often holds part of a record it cannot decrypt yet. A read that
waited for more ciphertext than the member still has to send would wait out the body's
deadline; the exchange must instead end as soon as the last byte is there.
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import threading
import time
from pathlib import Path

import pytest

from silofs.node.peer_client import Bounds, PeerPool, client_context

BODY = 300_000  # ~19 records of 16 KiB
PIECE = 3000  # bytes of ciphertext per send: a record's bytes come in ~6 pieces
PAUSE = 0.002


class TricklingMember:
    """Answers every request with BODY random bytes, its ciphertext sent PIECE bytes at a
    time with a pause after each piece."""

    def __init__(self, pki: Path) -> None:
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(pki / "n1.pem", pki / "n1.key")
        self.ctx.load_verify_locations(pki / "ca.pem")
        self.ctx.verify_mode = ssl.CERT_REQUIRED
        self.body = os.urandom(BODY)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(5)

    def _serve(self) -> None:
        try:
            raw, _ = self.sock.accept()
        except OSError:
            return
        with raw, contextlib.suppress(OSError, ssl.SSLError):
            incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
            obj = self.ctx.wrap_bio(incoming, outgoing, server_side=True)
            buf = b""
            while True:
                try:
                    if b"\r\n\r\n" not in buf:
                        buf += obj.read(65536)
                        continue
                    head, _, buf = buf.partition(b"\r\n\r\n")
                    obj.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % BODY)
                    obj.write(self.body)
                    self._trickle(raw, outgoing.read())
                except ssl.SSLWantReadError:
                    self._trickle(raw, outgoing.read())  # the handshake's answers
                    data = raw.recv(65536)
                    if not data:
                        return
                    incoming.write(data)

    def _trickle(self, raw: socket.socket, data: bytes) -> None:
        for at in range(0, len(data), PIECE):
            raw.sendall(data[at : at + PIECE])
            time.sleep(PAUSE)


@pytest.fixture
def member(pki: Path):
    m = TricklingMember(pki)
    yield m
    m.close()


def test_a_body_cut_into_pieces_is_read_whole_as_soon_as_it_is_there(
    pki: Path, member: TricklingMember
) -> None:
    ctx = client_context(str(pki / "n0.pem"), str(pki / "n0.key"), str(pki / "ca.pem"))
    pool = PeerPool(f"tls://127.0.0.1:{member.port}", "127.0.0.1", member.port, ctx, "c")
    # The body's deadline is the timeout plus its length at the floor rate: 10 s here,
    # far beyond the ~0.5 s the pieces take to come.
    bounds = Bounds(timeout=5.0, floor_rate=BODY / 5.0)
    try:
        for _ in range(3):  # the second and third on the kept connection
            t0 = time.monotonic()
            reply = pool.request("GET", "/v1/peer/chunk", bounds)
            took = time.monotonic() - t0
            assert reply.status == 200
            assert bytes(reply.body) == member.body
            assert took < 4.0, f"the exchange took {took:.1f} s: it waited for bytes never sent"
    finally:
        pool.close()
