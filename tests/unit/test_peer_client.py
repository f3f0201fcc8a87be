"""The peer client's exchange (node/peer_client.py PeerPool) against a member whose
ciphertext arrives in small pieces: a chunk's body is read whole and in time, however
its TLS records are cut by the network. And the listing rows an asking thread
remembers (node/peer_ask.py): only the current generation's, of the same dataset state.

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
from typing import Any

import pytest

from silofs.node.peer_client import Bounds, PeerError, PeerPool, client_context

BODY = 300_000  # ~19 records of 16 KiB
PIECE = 3000  # bytes of ciphertext per send: a record's bytes come in ~6 pieces
PAUSE = 0.002


class TricklingMember:
    """Answers every request with BODY random bytes (or `answer`, whole), its ciphertext
    sent PIECE bytes at a time with a pause after each piece."""

    def __init__(self, pki: Path, answer: bytes | None = None) -> None:
        self.answer = answer
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
                    if self.answer is not None:
                        obj.write(self.answer)
                    else:
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


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 2\xb2\xb2 OK\r\ncontent-length: 0\r\n\r\n",  # "\xb2": "²" in latin-1
        b"HTTP/1.1 200 OK\r\ncontent-length: \xb2\r\n\r\n",
    ],
)
def test_a_member_answering_digits_int_refuses_is_a_peer_error(pki: Path, answer: bytes) -> None:
    """Garbage from a member is a PeerError (counted, the chunk read from the store),
    never another exception: str.isdigit() said yes to "²" and int() then raised
    ValueError, which failed the mount's read with EIO."""
    m = TricklingMember(pki, answer=answer)
    ctx = client_context(str(pki / "n0.pem"), str(pki / "n0.key"), str(pki / "ca.pem"))
    pool = PeerPool(f"tls://127.0.0.1:{m.port}", "127.0.0.1", m.port, ctx, "c")
    try:
        with pytest.raises(PeerError) as err:
            pool.request("GET", "/v1/peer/chunk", Bounds(timeout=5.0, floor_rate=1 << 20))
        assert err.value.reason == "http"
    finally:
        pool.close()
        m.close()


def _thread_asks(tmp_path: Path) -> tuple[Any, int, Any]:
    """A cache with dataset s3://b/ and the ThreadAsks of a daemon over it."""
    from silofs.node.peer_ask import ThreadAsks
    from silofs.node.store_write import WritableStore

    store = WritableStore(str(tmp_path / "cache"), 1 << 26)
    dsid = store.dataset_id("s3://b/", create=True)
    assert dsid is not None

    class Cluster:
        class d:  # noqa: N801 (the Daemon's attribute)
            pass

    Cluster.d.store = store  # type: ignore[attr-defined]
    return store, dsid, ThreadAsks(Cluster())


def test_a_remembered_listing_row_is_the_current_generations_only(tmp_path: Path) -> None:
    """ThreadAsks' rows found in a dataset's listing (node/peer_ask.py _named): a relist
    (the next generation) names the new version at once, and a dataset opened again
    (a new DatasetState, the same id) never gets the rows of the one before."""
    from silofs.node.state import DatasetState
    from silofs.records import ObjectInfo
    from silofs.uri import parse_uri

    store, dsid, asks = _thread_asks(tmp_path)

    def listed(version: str) -> DatasetState:
        obj = ObjectInfo("a/b.bin", 10, 0.0, version, f"cid-{version}")
        record = store.replace_listing(dsid, [obj], {})
        uri = parse_uri("s3://b/")
        return DatasetState(dsid, uri, "b", None, record=record)  # type: ignore[arg-type]

    ds = listed("v1")
    for _ in range(2):  # found, then remembered
        obj = asks._named(ds, "a/b.bin", None)
        assert obj is not None and obj.version == "v1"
    assert len(asks.objects) == 1
    fresh = listed("v2")  # the next generation
    ds.record = fresh.record
    obj = asks._named(ds, "a/b.bin", None)
    assert obj is not None and obj.version == "v2"
    again = listed("v3")  # opened again: a new state of the same id
    obj = asks._named(again, "a/b.bin", None)
    assert obj is not None and obj.version == "v3"
    ds.building_gen = 99  # while a listing is built, nothing more is remembered
    count = len(asks.objects)
    asks._named(ds, "a/b.bin", None)
    assert len(asks.objects) == count
    store.close()


def test_a_remembered_row_keeps_no_forgotten_dataset_alive(tmp_path: Path) -> None:
    import gc
    import weakref

    from silofs.node.state import DatasetState
    from silofs.records import ObjectInfo
    from silofs.uri import parse_uri

    store, dsid, asks = _thread_asks(tmp_path)
    record = store.replace_listing(dsid, [ObjectInfo("k", 1, 0.0, "v", "c")], {})
    ds = DatasetState(dsid, parse_uri("s3://b/"), "b", None, record=record)  # type: ignore[arg-type]
    assert asks._named(ds, "k", None) is not None
    assert len(asks.objects) == 1
    gone = weakref.ref(ds)
    del ds
    gc.collect()
    assert gone() is None  # the backend and its store client go with it
    store.close()


class _Heads:
    """A pipe with nothing more to receive (the head is in the buffer already)."""

    def recv_into(self, view: memoryview) -> int:
        return 0


def _head(raw: bytes) -> tuple[int, dict[str, str]]:
    from silofs.node.peer_client import _read_head

    buf = bytearray(4096)
    view = memoryview(buf)
    view[: len(raw)] = raw
    status, headers, end, got = _read_head(_Heads(), view, len(raw), "tls://m:1", False)
    assert (end, got) == (raw.index(b"\r\n\r\n") + 4, len(raw))
    return status, headers


def test_an_answer_head_seen_before_reads_as_parsed_and_a_bad_one_fails_every_time() -> None:
    good = b"HTTP/1.1 200 OK\r\ncontent-length: 7\r\nx-silofs-source: cache\r\n\r\nbody..."
    first = _head(good)
    assert first == (200, {"content-length": "7", "x-silofs-source": "cache"})
    assert _head(good) == first  # from the parsed heads, the same
    other = good.replace(b"cache", b"remote")
    assert _head(other)[1]["x-silofs-source"] == "remote"  # its own bytes, its own parse
    bad = b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n"
    for _ in range(2):  # a refused head is never kept as parsed
        with pytest.raises(PeerError) as err:
            _head(bad)
        assert err.value.reason == "http"
