"""A streamed chunk handed to a mount as a sealed memory file (silofs/sealed.py): the
file refuses every change once sealed, a Unix connection's answers carry its
descriptor (on the loop and in the connection's thread), the client maps what a
descriptor names and refuses a file that is not sealed or a descriptor no answer names,
and no descriptor is left open. Who may receive one is the chunk route's
(tests/unit/test_routes_access.py).

Real sockets and a real serve_unix in a thread of its own; no sleeps.
"""

from __future__ import annotations

import array
import ctypes
import errno
import functools
import gc
import mmap
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio

from silofs import sealed
from silofs.cache.format import ChunkValue, encode_chunk, verify_chunk
from silofs.control.client import AsyncControlClient, ControlError
from silofs.control.router import Request, Response, Router
from silofs.control.server import ConnectionLimits, serve_unix
from tests.unit.serving import next_head, serving

DEADLINE = 10.0
N = 1 << 20


def open_fds() -> list[str]:
    gc.collect()  # what earlier tests left to the collector
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own
            pass
    return sorted(out)


def built(data: bytes) -> sealed.SealedValue:
    b = ChunkValue(len(data), "dir/a.bin", "etag:1", sealed.buffer)
    assert isinstance(b.value, sealed.SealedValue)
    b.data[:] = data
    value = b.seal(3, 0, 4 << 20)
    del b
    assert isinstance(value, sealed.SealedValue)
    return sealed.seal(value, len(data))


@pytest.fixture(params=["future write", "write"])
def seal_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways of sealing: F_SEAL_FUTURE_WRITE keeping the daemon's mapping (where
    the kernel's holds), and F_SEAL_WRITE after closing it."""
    if request.param == "future write":
        if not sealed._keeps_map():
            pytest.skip("this kernel's F_SEAL_FUTURE_WRITE lets mprotect add write access")
    else:
        monkeypatch.setattr(sealed, "_KEEPS_MAP", False)
    return str(request.param)


def test_a_sealed_value_is_the_encoded_value_and_refuses_every_change(seal_mode: str) -> None:
    data = os.urandom(N)
    value = built(data)
    assert bytes(value) == encode_chunk(3, 0, 4 << 20, "dir/a.bin", "etag:1", data)
    view = memoryview(value)[len(value) - N :].toreadonly()  # as node/fetch.py hands it on
    assert sealed.passable(view) == (value, len(value) - N)
    assert sealed.passable(view[1:]) is None  # only the whole data part is handed on
    assert sealed.passable(memoryview(bytes(view))) is None
    assert bytes(verify_chunk(value, "etag:1", 4 << 20, 0, N)) == data
    fd = value.fileno()
    with pytest.raises(PermissionError):
        os.pwrite(fd, b"x", 100)
    for size in (10, len(value) + 4096):  # shrinking or growing
        with pytest.raises(PermissionError):
            os.ftruncate(fd, size)
    with pytest.raises(PermissionError):
        mmap.mmap(fd, len(value), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    # A read-only shared mapping of it cannot be made writable either.
    ro = mmap.mmap(fd, len(value), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    lo, hi = _read_only_mapping(len(value))
    libc = ctypes.CDLL(None, use_errno=True)
    rw = mmap.PROT_READ | mmap.PROT_WRITE
    assert libc.mprotect(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), rw) != 0
    assert ctypes.get_errno() == errno.EACCES
    ro.close()
    assert bytes(value) == encode_chunk(3, 0, 4 << 20, "dir/a.bin", "etag:1", data)


def _read_only_mapping(size: int) -> tuple[int, int]:
    """A read-only shared mapping of a chunk file in this process (/proc/self/maps:
    ctypes takes the address of no read-only buffer)."""
    for line in open("/proc/self/maps"):
        fields = line.split()
        if "silofs-chunk" in line and fields[1] == "r--s":
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if hi - lo >= size:
                return lo, hi
    raise AssertionError("no read-only mapping of a chunk file")


def test_a_small_value_is_built_on_the_heap_and_nothing_stays_open(seal_mode: str) -> None:
    assert isinstance(sealed.buffer(sealed.MIN_BYTES - 1), bytearray)
    before = open_fds()
    for _ in range(8):
        value = built(os.urandom(N))
        view = memoryview(value)[len(value) - N :]
        got = sealed.map_received(os.dup(value.fileno()), f"{len(value) - N} {N}")
        assert got == view
        del value, view, got
    gc.collect()
    assert open_fds() == before
    assert sealed._live == 0


def test_a_received_file_must_be_sealed_and_hold_what_the_header_names() -> None:
    fd = os.memfd_create("x", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, N)
    value = built(os.urandom(N))
    before = open_fds()
    with pytest.raises(ValueError, match="not sealed"):
        sealed.map_received(os.dup(fd), f"0 {N}")
    for where in (f"0 {len(value) + 1}", f"{len(value)} 1", "0 0", "a b", "-1 5", ""):
        with pytest.raises(ValueError):
            sealed.map_received(os.dup(value.fileno()), where)
    assert open_fds() == before  # each descriptor handed in was closed
    os.close(fd)


def chunk_router(values: list[sealed.SealedValue]) -> Router:
    router = Router()

    async def chunk(req: Request) -> Response:
        value = values[0]
        view = memoryview(value)[len(value) - N :]
        if req.passes_fds and sealed.passable(view) is not None:
            where = f"{len(value) - N} {N}"
            return Response(
                200, b"", "application/octet-stream", {sealed.FD_HEADER: where}, fd=value
            )
        return Response(200, view, "application/octet-stream")

    router.add("GET", "/v1/chunks", chunk, threaded=True)
    return router


def test_a_unix_connection_hands_the_file_and_the_client_maps_it(
    tmp_path: Path, seal_mode: str
) -> None:
    before = open_fds()
    data = os.urandom(N)
    values = [built(data)]
    path = str(tmp_path / "s.sock")
    conns = ConnectionLimits(trusted=lambda peer: False)
    serve = functools.partial(serve_unix, path, chunk_router(values), connections=conns)

    async def main() -> list[tuple[int, dict[str, str], bytes]]:
        async with AsyncControlClient(path, timeout=DEADLINE) as client:
            return [await client.request("GET", "/v1/chunks") for _ in range(4)]

    with serving(serve):
        got = trio.run(main)
    # The first request is served on the loop, the next ones from the thread the
    # connection then moves to: every answer carries the file.
    assert [type(body) for _, _, body in got] == [memoryview] * 4
    for status, _, body in got:
        assert status == 200 and bytes(body) == data
    assert all(body.readonly for _, _, body in got)  # type: ignore[union-attr]
    values.clear()  # the router's
    del got, body
    gc.collect()
    assert open_fds() == before


@contextmanager
def sending_fd(tmp_path: Path, head: bytes, fd: int) -> Iterator[str]:
    """A scripted daemon answering each GET with `head` and the descriptor `fd`."""
    path = str(tmp_path / "d.sock")
    lsock = socket.socket(socket.AF_UNIX)
    lsock.bind(path)
    lsock.listen()
    lsock.settimeout(DEADLINE)

    def run() -> None:
        for _ in range(2):  # a GET dropped mid-answer is retried once
            try:
                conn, _ = lsock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(DEADLINE)
                if next_head(conn, b"") is None:
                    return
                rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
                conn.sendmsg([head], rights)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield path
    finally:
        with socket.socket(socket.AF_UNIX) as waker:
            waker.connect_ex(path)
        t.join(DEADLINE)
        lsock.close()


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nx-silofs-fd: 0 4096\r\n\r\n",  # not sealed
        b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello",  # a descriptor no answer names
    ],
)
def test_the_client_refuses_a_file_not_sealed_or_not_named(tmp_path: Path, head: bytes) -> None:
    fd = os.memfd_create("x", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    before = open_fds()

    async def main() -> None:
        async with AsyncControlClient(str(path), timeout=DEADLINE) as client:
            await client.request("GET", "/v1/chunks")

    with sending_fd(tmp_path, head, fd) as path:
        with pytest.raises(ControlError):
            trio.run(main)
    assert open_fds() == before  # what came was closed
    os.close(fd)
