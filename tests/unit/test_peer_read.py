"""The asking side of the peer path (node/cluster.py, node/peer_client.py) against a fake
member on 127.0.0.1: a real Daemon in this process asks a TLS server of the test's for
the chunks homed there, and gets right bytes whatever the member answers.

The fake member is a thread with a stdlib TLS socket (the cluster CA, the node
certificate n1; it requires the asker's certificate) that answers per `mode`: the right
value, flipped bytes, a short body, another chunk's value, nothing at all (no TLS
handshake, or no byte after a head, one that claims 64 MiB too), a body slower than the
floor rate, 102s for longer than the timeout and then the value, and
the charge round trip (428). Each bad answer must be detected, counted by reason, the
member marked down, and the chunk served right from the store (a local directory).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pytest
import trio

from silofs import sealed
from silofs.cache.format import ChunkRef, encode_chunk
from silofs.config import ClusterSettings, MemberSpec
from silofs.node import membership, peer_client
from silofs.node.daemon import Daemon
from silofs.node.peer_ask import PeerRead
from silofs.node.peer_wire import ChunkAsk
from tests.unit.inprocess import MEMBER_ME, member_daemon, mounted, running
from tests.unit.serving import next_head

CHUNK = 256 << 10
TIMEOUT = 0.5
SLOW_SECONDS = 4.0  # "slow_right": how long each answer takes (102s meanwhile)


class FakeMember:
    """A member's TLS listener that answers chunk requests as `mode` says."""

    def __init__(self, pki: Path, bucket: Path) -> None:
        self.bucket = bucket
        self.mode = "ok"
        self.asks: list[dict[str, str]] = []
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(pki / "n1.pem", pki / "n1.key")
        ctx.load_verify_locations(pki / "ca.pem")
        ctx.verify_mode = ssl.CERT_REQUIRED
        self.ctx = ctx
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.left = threading.Event()  # an asker closed a connection mid-answer
        # table_bytes: each ping says this member's share table differs (a new digest),
        # and a pull of it is answered with that many bytes of JSON junk.
        self.table_bytes = 0
        self.pings = self.pulls = self.tables_sent = 0
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self.sock.close()
        self.thread.join(5)

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        if self.mode == "no_tls":  # accepts TCP, never answers the handshake
            self.stop.wait(10)
            raw.close()
            return
        with contextlib.suppress(OSError, ssl.SSLError):
            tls = self.ctx.wrap_socket(raw, server_side=True)
            buf = b""
            while (got := next_head(tls, buf)) is not None:
                head, buf = got
                target = head.split(b"\r\n")[0].split()[1].decode()
                query = dict(parse_qsl(urlsplit(target).query))
                if urlsplit(target).path == "/v1/peer/ping":
                    self.pings += 1
                    body = b'{"name":"c","allocations_version":0}'
                    if self.table_bytes:
                        body = b'{"name":"c","allocations_digest":"d%d"}' % self.pings
                    tls.sendall(_head(200, len(body), "application/json") + body)
                    continue
                if urlsplit(target).path == "/v1/peer/allocations":
                    self.pulls += 1
                    tls.sendall(_head(200, self.table_bytes, "application/json"))
                    tls.sendall(_junk_table(self.table_bytes))
                    self.tables_sent += 1
                    continue
                if urlsplit(target).path == "/v1/peer/datasets":  # "introduce": then stall
                    tls.sendall(_head(200, 64 << 20, "application/json"))
                    self.stop.wait(30)
                    return
                self.asks.append(query)
                if not self._answer(tls, query):
                    return

    def _answer(self, tls: ssl.SSLSocket, query: dict[str, str]) -> bool:
        """Answer one chunk request; False to close the connection."""
        ask = ChunkAsk.from_query(query)
        ref = ask.ref()
        data = (self.bucket / ask.key).read_bytes()[ref.start : ref.start + ref.length]
        value = encode_chunk(1, ref.index, ref.chunk_size, ask.key, ask.content_id, data)
        mode = self.mode
        if mode == "charge" and not ask.charged:
            body = b'{"charge":%d}' % ref.length
            extra = f"x-silofs-charge: {ref.length}\r\n"
            tls.sendall(_head(428, len(body), "application/json", extra) + body)
            return True
        if mode == "flip":
            value = bytearray(value)
            value[-100] ^= 0xFF
        elif mode == "foreign":
            other = ChunkRef.of(ref.obj, ref.chunk_size, 0 if ref.index else 1)
            value = encode_chunk(1, other.index, other.chunk_size, ask.key, ask.content_id,
                                 data[: other.length].ljust(other.length, b"x"))  # fmt: skip
        elif mode == "short":
            tls.sendall(_head(200, len(value)) + bytes(value[: len(value) // 2]))
            return False
        elif mode == "silent":
            self.stop.wait(10)
            return False
        elif mode in ("head_stall", "long_head_stall"):  # the head, then not a byte more
            n = len(value) if mode == "head_stall" else 64 << 20
            tls.sendall(_head(200, n))
            self.stop.wait(10)
            return False
        elif mode == "trickle":
            tls.sendall(_head(200, len(value)))
            for i in range(0, len(value), 4096):
                if self.stop.wait(0.05):
                    return False
                tls.sendall(value[i : i + 4096])
            return True
        elif mode == "chunked":  # a body framed as HTTP/1.1 allows, but not as members do
            tls.sendall(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                        + b"%x\r\n" % len(value) + bytes(value) + b"\r\n0\r\n\r\n")  # fmt: skip
            return False
        elif mode == "redirect":  # elsewhere: a member that points at another host
            tls.sendall(b"HTTP/1.1 302 Found\r\nlocation: https://127.0.0.2/x\r\n"
                        b"content-length: 0\r\n\r\n")  # fmt: skip
            return True
        elif mode in ("error_stall", "charge_stall"):  # a 4xx claiming 64 MiB, then nothing
            status = 428 if mode == "charge_stall" else 409
            extra = f"x-silofs-charge: {ref.length}\r\n" if status == 428 else ""
            tls.sendall(_head(status, 64 << 20, "application/json", extra))
            self.stop.wait(30)
            return False
        elif mode == "introduce":  # this dataset is new to me: introduce it (see _serve)
            body = b'{"error":"introduce it"}'
            extra = "x-silofs-unknown-dataset: 1\r\n"
            tls.sendall(_head(404, len(body), "application/json", extra) + body)
            return True
        elif mode == "huge":  # a length past any chunk value, then nothing
            tls.sendall(_head(200, 10**15))
            self.stop.wait(10)
            return False
        elif mode == "stalling":  # a store that never answers: 102s until the asker leaves
            try:
                while not self.stop.wait(0.1):
                    tls.sendall(b"HTTP/1.1 102 Processing\r\n\r\n")
            except OSError:
                self.left.set()
            return False
        elif mode == "slow_right":  # right, every time, just inside the bounds: 102s first
            for _ in range(int(SLOW_SECONDS / 0.2)):
                tls.sendall(b"HTTP/1.1 102 Processing\r\n\r\n")
                time.sleep(0.2)
        elif mode == "processing" and len(self.asks) == 1:
            for _ in range(int(3 * TIMEOUT / 0.2)):  # 102s for 3 timeouts, then the value
                tls.sendall(b"HTTP/1.1 102 Processing\r\n\r\n")
                time.sleep(0.2)
        source = "remote" if mode == "remote" else "cache"  # "remote": a GET made for it
        tls.sendall(_head(200, len(value), extra=f"x-silofs-source: {source}\r\n") + bytes(value))
        return True


def _junk_table(n: int) -> bytes:
    """n bytes of JSON as a share table a member never has: its shares valid (none), and
    a key beside them holding a dict of tiny entries, the slowest JSON to read."""
    head, tail = b'{"version":1,"shares":{},"stamps":{},"x":{', b"}}"
    entries = b",".join(b'"%x":0' % i for i in range(n // 8))
    body = head + entries
    return body[: n - len(tail)].rsplit(b",", 1)[0].ljust(n - len(tail)) + tail


def _head(
    status: int, length: int, ctype: str = "application/octet-stream", extra: str = ""
) -> bytes:
    return (
        f"HTTP/1.1 {status} X\r\ncontent-type: {ctype}\r\ncontent-length: {length}\r\n{extra}\r\n"
    ).encode()


# Placement hashes content ids (inode and mtime, new each run) and the member's port:
# each full-size chunk is homed at the fake member with probability 1/2. Most tests read
# three of them (read_all, read_from_threads): with 8 files (24 chunks) fewer than three
# were the member's in 1.8e-5 of runs (about 25 tests each run: ~4e-4 a suite run);
# 16 files (48 chunks) make it 4e-12.
FILES = 16


@pytest.fixture
def bucket(tmp_path: Path) -> Path:
    root = tmp_path / "bucket"
    root.mkdir()
    for i in range(FILES):
        (root / f"f{i}.bin").write_bytes(os.urandom(3 * CHUNK + 1000 * i + 1))
    return root


@pytest.fixture
def member(pki: Path, bucket: Path) -> Iterator[FakeMember]:
    fake = FakeMember(pki, bucket)
    yield fake
    fake.close()


@contextlib.contextmanager
def daemon_of(tmp_path: Path, pki: Path, port: int) -> Iterator[Daemon]:
    """This node asks only (its address is never listened on); the fake is the other
    member."""
    cluster = ClusterSettings(
        name="c",
        address=MEMBER_ME,
        members=(MemberSpec(MEMBER_ME), MemberSpec(f"tls://127.0.0.1:{port}")),
        peer_timeout_seconds=TIMEOUT,
        peer_backoff_seconds=30.0,
        peer_floor_rate=1 << 20,
    )
    with member_daemon(tmp_path, pki, cluster, CHUNK) as d:
        yield d


def remote_chunks(d: Daemon, ds: object, bucket: Path) -> list[tuple[str, int]]:
    """(key, index) of the full-size chunks whose home is the fake member (a file's last
    chunk is a few bytes: a trickle would deliver it in time)."""
    out = []
    for i in range(len(list(bucket.glob("f*.bin")))):
        key = f"f{i}.bin"
        obj = d.store.get_object(ds.id, key)  # type: ignore[attr-defined]
        for index in range(3):
            if not d.cluster.is_home(ChunkRef.of(obj, CHUNK, index).key):
                out.append((key, index))
    assert out, "no chunk is homed at the member"
    return out


def read_all(d: Daemon, bucket: Path, mode: str, member: FakeMember) -> dict:
    """Read every chunk homed at the member with it in `mode`: the bytes must be right.
    The member's and the dataset's peer counters, and whether it is up, after."""

    async def main() -> dict:
        async with running(d):
            ds, m = await mounted(d, bucket)
            member.mode = mode
            chunks = remote_chunks(d, ds, bucket)
            for key, index in chunks[:3]:
                data, _ = await d.get_chunk(m, key, index, False)
                want = (bucket / key).read_bytes()[index * CHUNK : (index + 1) * CHUNK]
                assert bytes(data) == want, (mode, key, index)
            peer = next(p for p in d.cluster.membership.peers())  # type: ignore[union-attr]
            return {
                "member": peer.counters.view(),
                "dataset": d.cluster.datasets[ds.uri.canonical].view(),
                "up": peer.up,
                "remote_gets": ds.fetch.remote_gets,
            }

    return trio.run(main)


def test_a_good_member_serves_the_chunks_it_is_home_of(
    tmp_path: Path, pki: Path, bucket: Path, member: FakeMember
) -> None:
    with daemon_of(tmp_path, pki, member.port) as d:
        got = read_all(d, bucket, "ok", member)
    assert got["up"] and got["member"]["errors"] == {}
    assert got["member"]["requests_out"] == 3 and got["member"]["bytes_in"] > 0
    assert got["remote_gets"] == 0  # no store GET here
    # A job without an IO allocation is charged up front: one round trip per chunk.
    assert [a["charged"] for a in member.asks] == ["1", "1", "1"]


def test_readers_joining_one_ask_count_its_store_get_once(
    tmp_path: Path, pki: Path, bucket: Path, member: FakeMember
) -> None:
    """Three readers of one chunk homed at the member: one ask, whose store GET (made by
    the home for this node's job) is counted once, not once per reader that joined it."""

    async def main() -> tuple[int, int, int]:
        async with running(d):
            ds, m = await mounted(d, bucket)
            member.mode = "remote"
            key, index = remote_chunks(d, ds, bucket)[0]
            got: list[bytes] = []

            async def read() -> None:
                data, _ = await d.get_chunk(m, key, index, False)
                got.append(bytes(data))

            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(read)
            want = (bucket / key).read_bytes()[index * CHUNK : (index + 1) * CHUNK]
            assert got == [want] * 3
            return ds.fetch.remote_gets, ds.fetch.remote_bytes, len(member.asks)

    with daemon_of(tmp_path, pki, member.port) as d:
        gets, nbytes, asks = trio.run(main)
    assert asks == 1
    assert (gets, nbytes) == (1, CHUNK)


def test_a_buffered_chunk_offered_after_a_restart_is_kept_only_where_it_is_homed(
    tmp_path: Path, pki: Path, bucket: Path, member: FakeMember
) -> None:
    """A mount re-offers its buffer to a restarted daemon: a chunk homed at another member
    that is up is not admitted here (the cluster would hold it twice, and no stand-in
    sweep deletes a copy whose home never went down); one homed here is."""

    async def main() -> None:
        async with running(d):
            ds, m = await mounted(d, bucket)
            key, index = remote_chunks(d, ds, bucket)[0]
            obj = d.store.get_object(ds.id, key)
            data = (bucket / key).read_bytes()[index * CHUNK : (index + 1) * CHUNK]
            assert d.offer_chunk(m, key, index, obj.content_id, data) == "elsewhere"
            own = next(
                (f"f{i}.bin", j)
                for i in range(FILES)
                for j in range(3)
                if d.cluster.is_home(
                    ChunkRef.of(d.store.get_object(ds.id, f"f{i}.bin"), CHUNK, j).key
                )
            )
            obj = d.store.get_object(ds.id, own[0])
            mine = (bucket / own[0]).read_bytes()[own[1] * CHUNK : (own[1] + 1) * CHUNK]
            assert d.offer_chunk(m, own[0], own[1], obj.content_id, mine) == "queued"
            with trio.fail_after(30):
                while d.usage.get(ds.id) is None or d.usage[ds.id].chunks < 1:
                    await trio.sleep(0.01)
            assert d.usage[ds.id].chunks == 1

    with daemon_of(tmp_path, pki, member.port) as d:
        trio.run(main)


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("flip", "corrupt"),
        ("short", "short"),
        ("foreign", "foreign"),
        ("silent", "timeout"),
        ("trickle", "timeout"),
        ("no_tls", "timeout"),
        ("head_stall", "timeout"),
        ("long_head_stall", "foreign"),
    ],
)
def test_a_bad_answer_is_counted_the_member_marked_down_and_the_store_serves(
    tmp_path: Path, pki: Path, bucket: Path, member: FakeMember, mode: str, reason: str
) -> None:
    t0 = time.monotonic()
    with daemon_of(tmp_path, pki, member.port) as d:
        got = read_all(d, bucket, mode, member)
    assert got["member"]["errors"] == {reason: 1}, got
    assert got["dataset"]["errors"] == {reason: 1} and got["dataset"]["store_fallbacks"] == 1
    assert not got["up"]  # down for its backoff: the other chunks were not asked of it
    assert len(member.asks) == (0 if mode == "no_tls" else 1)
    assert got["remote_gets"] == 3  # this node read all three from the store
    # The wait is bounded by the timeout plus a chunk's value at the floor rate (1 MiB/s
    # here: 0.75 s), whatever length the member's head claims (64 MiB: 64 s).
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("mode", ["chunked", "redirect", "huge"])
def test_an_answer_no_member_sends_is_an_http_failure_and_the_store_serves(
    tmp_path: Path, pki: Path, bucket: Path, member: FakeMember, mode: str
) -> None:
    """A chunked body, a redirect (never followed), a content-length of a petabyte:
    each read is right, from the store, at once; the member is not waited for."""
    t0 = time.monotonic()
    with daemon_of(tmp_path, pki, member.port) as d:
        got = read_all(d, bucket, mode, member)
    assert set(got["member"]["errors"]) == {"http"}, got
    assert got["dataset"]["store_fallbacks"] == got["member"]["errors"]["http"] >= 1
    assert got["remote_gets"] == 3
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize(
    ("mode", "reason"),
    [("error_stall", "http"), ("charge_stall", "http"), ("introduce", "foreign")],
)
def test_an_answer_that_is_no_chunk_claiming_a_long_body_is_not_waited_for(
    tmp_path: Path, pki: Path, bucket: Path, member: FakeMember, mode: str, reason: str
) -> None:
    """An error answer (409), a charge (428) or the answer to an introduction, each
    claiming a 64 MiB body and then sending nothing: none is the chunk's value, whose
    length alone bounds what a member may make a read wait (the timeout plus the value
    at the floor rate). Each read is right, from the store, without waiting for the
    body (at 1 MiB/s the bound of 64 MiB is a minute)."""
    t0 = time.monotonic()
    with daemon_of(tmp_path, pki, member.port) as d:
        got = read_all(d, bucket, mode, member)
    assert time.monotonic() - t0 < 10
    assert set(got["member"]["errors"]) == {reason}, got
    assert got["dataset"]["store_fallbacks"] == got["member"]["errors"][reason] >= 1
    assert got["remote_gets"] == 3


def test_reads_queued_behind_a_slow_members_exchanges_wait_at_most_the_bound_for_one(
    tmp_path: Path, pki: Path, bucket: Path, member: FakeMember
) -> None:
    """A member answering every chunk right but only after 4 s of 102s (a compromised
    one, just inside its bounds; or one whose store is slow), asked for ~11 chunks at
    once: PEER_POOL (4) exchanges at a time, the others wait for one to free. Each
    waits at most the peer bound (0.5 s) before the store serves it ("busy", the member
    left up); before, they queued, the 9th read waiting 12 s (with a minute of 102s
    each: minutes), and nothing was counted."""
    # Placement hashes content ids (new each run): 24 chunks put <= 8 at the member
    # about one run in 13, 48 (the fixture's) 1.7e-6 of runs; 72 make it 3e-12.
    for i in range(FILES, FILES + 8):
        (bucket / f"f{i}.bin").write_bytes(os.urandom(3 * CHUNK + 1000 * i + 1))

    async def main() -> tuple[list[float], dict, bool]:
        async with running(d):
            ds, m = await mounted(d, bucket)
            member.mode = "slow_right"
            chunks = remote_chunks(d, ds, bucket)
            assert len(chunks) > 2 * peer_client.PEER_POOL, chunks
            waits: list[float] = []

            async def read(key: str, index: int) -> None:
                t0 = time.monotonic()
                data, _ = await d.get_chunk(m, key, index, False)
                want = (bucket / key).read_bytes()[index * CHUNK : (index + 1) * CHUNK]
                assert bytes(data) == want, (key, index)
                waits.append(time.monotonic() - t0)

            async with trio.open_nursery() as nursery:
                for key, index in chunks:
                    nursery.start_soon(read, key, index)
            peer = next(p for p in d.cluster.membership.peers())  # type: ignore[union-attr]
            return waits, peer.counters.view(), peer.up

    with daemon_of(tmp_path, pki, member.port) as d:
        waits, counters, up = trio.run(main)
    assert len(waits) > 2 * peer_client.PEER_POOL
    # One exchange (4 s) and the slot's bound, not three exchanges one after another.
    assert max(waits) < 2 * SLOW_SECONDS, sorted(waits)
    busy = counters["errors"].get("busy", 0)
    assert busy >= len(waits) - 2 * peer_client.PEER_POOL and set(counters["errors"]) == {"busy"}
    assert counters["store_fallbacks"] == busy and up, counters


def test_a_member_whose_table_always_differs_is_pulled_from_rarely_and_never_at_length(
    tmp_path: Path, pki: Path, bucket: Path, member: FakeMember, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member whose every ping says its share table differs, and whose table is 20 MiB
    of JSON that reads as no news (a compromised member: the ping is all it takes). The
    pull is refused at its head (more than MAX_SHARES_ANSWER), and the member is pulled
    from once per PULL_BACKOFF. Before, each ping (every 5 s) was a pull read whole and
    parsed on the loop: 64 MiB of it held every mount's misses for seconds."""
    monkeypatch.setattr(membership, "PING_SECONDS", 0.2)
    member.table_bytes = 20 << 20
    assert json.loads(_junk_table(1 << 20))["shares"] == {}

    async def main() -> None:
        async with running(d), trio.open_nursery() as nursery:
            nursery.start_soon(d.cluster.probe_loop)
            with trio.fail_after(60):
                while member.pings < 6:
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()

    with daemon_of(tmp_path, pki, member.port) as d:
        trio.run(main)
    assert member.pulls == 1 and member.tables_sent == 0, vars(member)


def test_a_refused_connection_is_a_failure_too(tmp_path: Path, pki: Path, bucket: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fake = FakeMember.__new__(FakeMember)
    fake.mode = "ok"
    with daemon_of(tmp_path, pki, port) as d:
        got = read_all(d, bucket, "ok", fake)
    assert got["member"]["errors"] == {"refused": 1} and not got["up"]


def test_102_processing_is_life_past_the_timeout(
    tmp_path: Path, pki: Path, bucket: Path, member: FakeMember
) -> None:
    with daemon_of(tmp_path, pki, member.port) as d:
        got = read_all(d, bucket, "processing", member)
    assert got["up"] and got["member"]["errors"] == {} and got["remote_gets"] == 0


def test_102s_forever_are_life_only_for_a_bounded_time(
    tmp_path: Path, pki: Path, bucket: Path, member: FakeMember, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member that answers 102 Processing and never the chunk (its GET hangs, or it
    is hostile) holds a read for MAX_PROGRESS_SECONDS at most: then it is down
    ("timeout") and the chunk is read from the store, right."""
    monkeypatch.setattr(peer_client, "MAX_PROGRESS_SECONDS", 2.0)
    t0 = time.monotonic()
    with daemon_of(tmp_path, pki, member.port) as d:
        got = read_all(d, bucket, "stalling", member)
    assert got["member"]["errors"] == {"timeout": 1}, got
    assert got["dataset"]["store_fallbacks"] == 1 and not got["up"]
    assert got["remote_gets"] == 3 and len(member.asks) == 1
    assert member.left.wait(10)  # the asker closed the member's connection
    assert time.monotonic() - t0 < 20  # 2 s of 102s, not until the member stops


def test_a_job_with_a_rate_is_charged_after_428_and_before_the_homes_get(
    tmp_path: Path, pki: Path, bucket: Path, member: FakeMember
) -> None:
    with daemon_of(tmp_path, pki, member.port) as d:

        async def main() -> tuple[int, int]:
            async with running(d):
                await d.set_io_allocation("j", 100 << 20)
                ds, m = await mounted(d, bucket)
                member.mode = "charge"
                key, index = remote_chunks(d, ds, bucket)[0]
                data, source = await d.get_chunk(m, key, index, False)
                want = (bucket / key).read_bytes()[index * CHUNK : (index + 1) * CHUNK]
                assert bytes(data) == want
                return d.job("j").limiter.charged_bytes, len(want)

        charged, length = trio.run(main)
    assert [a["charged"] for a in member.asks] == ["0", "1"]
    assert charged == length


def read_from_threads(
    d: Daemon, bucket: Path, mode: str, member: FakeMember, region: sealed.Region | None = None
) -> dict:
    """Ask for the member's chunks as a mount connection's thread does (peer_ask.py),
    each then read through the loop's handler path as the connection does when the
    thread hands a chunk over: the bytes must be right either way. With `region` (the
    connection's hand-off region), a chunk the thread serves must lie in it."""

    async def main() -> dict:
        async with running(d), trio.open_nursery() as nursery:
            nursery.start_soon(d.cluster.probe_loop)
            while d.cluster.thread_asks.token is None:
                await trio.sleep(0)
            ds, m = await mounted(d, bucket)
            member.mode = mode
            served = []
            for key, index in remote_chunks(d, ds, bucket)[:3]:
                want = (bucket / key).read_bytes()[index * CHUNK : (index + 1) * CHUNK]
                read = functools.partial(d.cluster.thread_asks.read, region=region)
                got = await trio.to_thread.run_sync(read, ds, m, key, index, None)
                if got is None:  # handed to the loop: the handler joins its flight
                    data, _ = await d.get_chunk(m, key, index, False)
                else:
                    data = got.data
                    if region is not None:  # named where it lies, as peer_chunk does
                        assert region.where(data) == f"{region.filled - len(want)} {len(want)}"
                served.append(got is not None)
                assert bytes(data) == want, (mode, key, index)
            assert not d.cluster.thread_asks.flights and not d.cluster.asks._flights
            peer = next(p for p in d.cluster.membership.peers())  # type: ignore[union-attr]
            nursery.cancel_scope.cancel()
            return {
                "served": served,
                "member": peer.counters.view(),
                "dataset": d.cluster.datasets[ds.uri.canonical].view(),
                "up": peer.up,
                "remote_gets": ds.fetch.remote_gets,
            }

    return trio.run(main)


def test_a_connection_thread_asks_the_home_and_checks_the_answer_off_the_loop(
    tmp_path: Path, pki: Path, bucket: Path, member: FakeMember
) -> None:
    with daemon_of(tmp_path, pki, member.port) as d:
        got = read_from_threads(d, bucket, "ok", member)
    assert got["served"] == [True, True, True]  # no chunk needed the loop
    assert got["up"] and got["member"]["errors"] == {}
    assert got["member"]["requests_out"] == 3 and got["dataset"]["requests_out"] == 3
    assert got["member"]["bytes_in"] > 3 * CHUNK and got["remote_gets"] == 0
    assert [a["charged"] for a in member.asks] == ["1", "1", "1"]  # unlimited: up front


@pytest.mark.parametrize(("mode", "reason"), [("flip", "corrupt"), ("short", "short")])
def test_a_bad_answer_to_a_thread_is_counted_once_and_the_loop_reads_the_store(
    tmp_path: Path, pki: Path, bucket: Path, member: FakeMember, mode: str, reason: str
) -> None:
    with daemon_of(tmp_path, pki, member.port) as d:
        got = read_from_threads(d, bucket, mode, member)
    assert got["served"] == [False, False, False]  # the first failed, then it was down
    assert got["member"]["errors"] == {reason: 1}, got
    assert got["dataset"]["errors"] == {reason: 1} and got["dataset"]["store_fallbacks"] == 1
    assert not got["up"] and len(member.asks) == 1  # never asked again while down
    assert got["remote_gets"] == 3


@pytest.mark.skipif(not sealed.Region.usable(), reason="no F_SEAL_FUTURE_WRITE")
def test_a_thread_receives_the_answer_into_the_mount_connections_region(
    tmp_path: Path, pki: Path, bucket: Path, member: FakeMember
) -> None:
    region = sealed.Region()
    with daemon_of(tmp_path, pki, member.port) as d:
        got = read_from_threads(d, bucket, "ok", member, region)
    assert got["served"] == [True, True, True] and got["member"]["errors"] == {}
    assert region.value is not None  # one region, reused for each
    region.close()


@pytest.mark.skipif(not sealed.Region.usable(), reason="no F_SEAL_FUTURE_WRITE")
@pytest.mark.parametrize(("mode", "reason"), [("flip", "corrupt"), ("short", "short")])
def test_a_bad_answer_in_the_region_is_never_served_from_it(
    tmp_path: Path, pki: Path, bucket: Path, member: FakeMember, mode: str, reason: str
) -> None:
    """The bad answer lands in the region, fails its check there, and the loop reads the
    chunk from the store: right bytes, counted once, as without a region."""
    region = sealed.Region()
    with daemon_of(tmp_path, pki, member.port) as d:
        got = read_from_threads(d, bucket, mode, member, region)
    assert got["served"] == [False, False, False]
    assert got["member"]["errors"] == {reason: 1} and got["remote_gets"] == 3
    region.close()


def test_a_rated_job_is_never_asked_for_from_a_thread(
    tmp_path: Path, pki: Path, bucket: Path, member: FakeMember
) -> None:
    with daemon_of(tmp_path, pki, member.port) as d:

        async def main() -> None:
            async with running(d), trio.open_nursery() as nursery:
                nursery.start_soon(d.cluster.probe_loop)
                ds, m = await mounted(d, bucket)
                d.job("j").limiter.set_rate(1 << 30)
                while d.cluster.thread_asks.token is None:
                    await trio.sleep(0)
                key, index = remote_chunks(d, ds, bucket)[0]
                got = await trio.to_thread.run_sync(
                    d.cluster.thread_asks.read, ds, m, key, index, None
                )
                assert got is None and not member.asks  # its charge is the loop's
                nursery.cancel_scope.cancel()

        trio.run(main)


async def join_a_threads_ask(
    d: Daemon,
    nursery: trio.Nursery,
    ds: Any,
    m: Any,
    key: str,
    index: int,
    ref: ChunkRef,
    region: sealed.Region | None = None,
) -> tuple[Any, PeerRead | None]:
    """A connection thread asks for the chunk (the member answering slowly); once its
    flight is there, a reader on the loop joins it: (the loop's data, the thread's)."""
    box: list[PeerRead | None] = []
    read = functools.partial(d.cluster.thread_asks.read, region=region)

    async def from_thread() -> None:
        box.append(await trio.to_thread.run_sync(read, ds, m, key, index, None))

    nursery.start_soon(from_thread)
    with trio.fail_after(10):
        while ref.key not in d.cluster.thread_asks.flights:
            await trio.sleep(0.005)
    data, _ = await d.get_chunk(m, key, index, False)
    with trio.fail_after(10):
        while not box:
            await trio.sleep(0.005)
    return data, box[0]


@pytest.mark.parametrize("in_region", [False, True], ids=["bytes", "region"])
def test_one_ask_per_chunk_whether_a_thread_or_the_loop_asks_first(
    tmp_path: Path, pki: Path, bucket: Path, member: FakeMember, in_region: bool
) -> None:
    """A reader on the loop joins a chunk a connection thread is asking for (the member
    answers slowly: 102s first), and a thread leaves a chunk the loop asks for to it.
    A thread receiving into its connection's region: the loop's reader gets bytes of its
    own, which the region written again for the connection's next answer never changes."""
    if in_region and not sealed.Region.usable():
        pytest.skip("no F_SEAL_FUTURE_WRITE")
    region = sealed.Region() if in_region else None
    with daemon_of(tmp_path, pki, member.port) as d:

        async def main() -> None:
            async with running(d), trio.open_nursery() as nursery:
                nursery.start_soon(d.cluster.probe_loop)
                ds, m = await mounted(d, bucket)
                key, index = remote_chunks(d, ds, bucket)[0]
                ref = ChunkRef.of(d.store.get_object(ds.id, key), CHUNK, index)  # type: ignore[arg-type]
                want = (bucket / key).read_bytes()[index * CHUNK : (index + 1) * CHUNK]
                # The loop's flight first: a thread does not ask for it.
                d.cluster.asks.claim([ref.key])
                while d.cluster.thread_asks.token is None:
                    await trio.sleep(0)
                got = await trio.to_thread.run_sync(
                    d.cluster.thread_asks.read, ds, m, key, index, None
                )
                assert got is None and not member.asks
                d.cluster.asks.abandon(ref.key)
                # The thread's flight first: the loop's reader joins it.
                member.mode = "processing"
                data, got = await join_a_threads_ask(d, nursery, ds, m, key, index, ref, region)
                assert got is not None and bytes(got.data) == want
                if region is not None:
                    assert region.where(got.data) is not None  # type: ignore[arg-type]
                    again = region.view(region.filled)  # the connection's next answer
                    assert again is not None
                    again[:] = b"\0" * len(again)
                    again.release()
                assert bytes(data) == want
                assert len(member.asks) == 1
                assert d.cluster.datasets[ds.uri.canonical].requests_out == 1
                nursery.cancel_scope.cancel()

        trio.run(main)
    if region is not None:
        region.close()


def test_a_thread_whose_mount_left_drops_its_ask_and_frees_the_home(
    tmp_path: Path, pki: Path, bucket: Path, member: FakeMember
) -> None:
    """The home works on, sending 102s (its store does not answer); the mount that asked
    closes its connection: the thread gives up within a 102's interval, closes the
    member connection (the home sees it), and the member is not counted as failing."""
    with daemon_of(tmp_path, pki, member.port) as d:

        async def main() -> None:
            async with running(d), trio.open_nursery() as nursery:
                nursery.start_soon(d.cluster.probe_loop)
                ds, m = await mounted(d, bucket)
                while d.cluster.thread_asks.token is None:
                    await trio.sleep(0)
                member.mode = "stalling"
                key, index = remote_chunks(d, ds, bucket)[0]
                left = threading.Event()
                box: list[object] = []

                def ask() -> None:
                    box.append(
                        d.cluster.thread_asks.read(ds, m, key, index, None, gone=left.is_set)
                    )

                nursery.start_soon(trio.to_thread.run_sync, ask)
                with trio.fail_after(10):
                    while not member.asks:
                        await trio.sleep(0.01)
                left.set()  # the mount closed its connection
                start = time.monotonic()
                with trio.fail_after(10):
                    while not box:
                        await trio.sleep(0.01)
                assert box == [None] and time.monotonic() - start < 2 * TIMEOUT
                assert await trio.to_thread.run_sync(member.left.wait, 10)
                peer = next(p for p in d.cluster.membership.peers())  # type: ignore[union-attr]
                assert peer.up and peer.counters.view()["errors"] == {}
                assert not d.cluster.thread_asks.flights
                nursery.cancel_scope.cancel()

        trio.run(main)


def test_a_down_member_is_pinged_at_once_when_a_warm_rechecks_it(
    tmp_path: Path, pki: Path, member: FakeMember
) -> None:
    """recheck() pings a member in its backoff (30 s here) now, and it is up again by its
    answer (a down member's exchange is refused unless it is a probe's)."""
    with daemon_of(tmp_path, pki, member.port) as d:

        async def main() -> list[tuple[bool, bool]]:
            membership = d.cluster.membership
            assert membership is not None
            async with running(d):
                peer = membership.peers()[0]
                membership.mark_down(peer.address, "refused", probe=True)
                seen = [(peer.up, peer.probing)]
                await d.cluster.recheck({peer.address})
                seen.append((peer.up, peer.probing))
            return seen

        assert trio.run(main) == [(False, False), (True, False)]


def test_a_recheck_while_the_prober_pings_counts_one_failure(
    tmp_path: Path, pki: Path, member: FakeMember
) -> None:
    """The prober's ping of a down member is in flight when a warm rechecks it: the
    recheck waits for that ping's answer rather than pinging again, so the outage is one
    failure (the backoff doubles once) and one error, not two."""
    member.mode = "no_tls"  # the ping gets no answer: it fails after the peer timeout
    with daemon_of(tmp_path, pki, member.port) as d:

        async def main() -> tuple[int, dict[str, int]]:
            membership = d.cluster.membership
            assert membership is not None
            async with running(d), trio.open_nursery() as nursery:
                nursery.start_soon(d.cluster.probe_loop)
                peer = membership.peers()[0]
                membership.mark_down(peer.address, "refused", probe=True)
                peer.down_until = 0.0  # due for the prober's ping at its next tick
                with trio.fail_after(10):
                    while not peer.probing:
                        await trio.sleep(0.01)
                await d.cluster.recheck({peer.address})
                assert not peer.up and not peer.probing
                nursery.cancel_scope.cancel()
                return peer.failures, peer.counters.view()["errors"]

        failures, errors = trio.run(main)
        assert failures == 2, "one failure for the mark_down, one for the failed ping"
        assert sum(errors.values()) == 1, errors


def test_a_member_name_dns_does_not_answer_for_is_a_timeout_within_the_bound(
    pki: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """getaddrinfo takes no timeout (glibc: 5 s a try, two tries, with DNS down): the
    connect's bound covers the lookup of a member's name too."""
    real = socket.getaddrinfo
    stop = threading.Event()

    def slow(host: str, *args: Any, **kw: Any) -> Any:
        if host == "member.example":
            stop.wait(30)  # a DNS server that does not answer
        return real(host, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", slow)
    ctx = peer_client.client_context(str(pki / "n0.pem"), str(pki / "n0.key"), str(pki / "ca.pem"))
    pool = peer_client.PeerPool("tls://member.example:7001", "member.example", 7001, ctx, "c")
    t0 = time.monotonic()
    with pytest.raises(peer_client.PeerError) as err:
        pool.request("GET", "/v1/peer/ping", peer_client.Bounds(TIMEOUT, 1 << 20))
    stop.set()
    assert err.value.reason == "timeout" and time.monotonic() - t0 < TIMEOUT + 1


def test_each_address_of_a_members_name_is_tried_in_turn() -> None:
    """A name whose first address takes no connection (::1, with the member on
    127.0.0.1 only; here another port) still reaches the member, as
    socket.create_connection did."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        with socket.socket() as closed:  # a port nothing listens on
            closed.bind(("127.0.0.1", 0))
            dead = closed.getsockname()[1]
        addresses = [("127.0.0.1", dead), ("127.0.0.1", port)]
        conn = peer_client._connect_any(addresses, time.monotonic() + TIMEOUT)
        with conn:
            assert conn.getpeername() == ("127.0.0.1", port)
        with pytest.raises(OSError):
            peer_client._connect_any(addresses[:1], time.monotonic() + TIMEOUT)
