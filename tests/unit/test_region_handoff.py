"""A peer-served chunk named in its mount connection's hand-off region (silofs/sealed.py
Region), not sent as bytes: the region sealed against the mount, passed once, copied out
by the mount's client before its request ends, so reused for the connection's next answer
without ever changing bytes a read already holds; dropped with the connection.

The server is serve_unix in a thread of its own (tests/unit/serving.py) with one threaded
route whose inline answer fills the region as node/api/chunks.py peer_chunk does (the
connection's first call of it is answered on the loop, which moves the connection to its
thread: `moved` below); the client is the mount's AsyncControlClient. No sleeps: waits
poll with a deadline.
"""

from __future__ import annotations

import errno
import functools
import gc
import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio

from silofs import sealed
from silofs.control.client import AsyncControlClient
from silofs.control.router import EVERYONE, Request, Response, Route, Router
from silofs.control.server import ConnectionLimits, serve_unix
from tests.support.poll import wait_for
from tests.unit.serving import serving

pytestmark = pytest.mark.skipif(
    not sealed.Region.usable(), reason="the kernel lacks F_SEAL_FUTURE_WRITE"
)

SIZE = 128 << 10
HEAD = 64  # a value's header stands before its data, as in a chunk value


class Served:
    """What the route's inline answers saw: the regions it used, descriptors sent."""

    def __init__(self) -> None:
        self.regions: list[sealed.Region] = []
        self.sent_fds = 0


def fill_answer(served: Served, req: Request) -> Response | None:
    """As peer_chunk: the value received into the region (here: byte `fill` HEAD + SIZE
    times), its data named there, the region's descriptor with the first answer."""
    region = req.region
    if region is None:
        return None
    value = region.view(HEAD + SIZE)
    assert value is not None
    value[:] = bytes([int(req.query["fill"])]) * (HEAD + SIZE)
    if req.query.get("bad") == "outside":
        at = f"{HEAD} {SIZE + 1}"
    else:
        at = region.where(value[HEAD:])
    assert at is not None
    if region not in served.regions:
        served.regions.append(region)
    fd = None if region.sent or req.query.get("bad") == "nofd" else region.value
    region.sent = True
    if fd is not None:
        served.sent_fds += 1
    return Response(200, b"", "application/octet-stream", {sealed.REGION_HEADER: at}, fd=fd)


def make_router(served: Served) -> Router:
    router = Router()

    async def chunk(req: Request) -> Response:
        return Response(200, b"from the loop", "application/octet-stream")

    inline = functools.partial(fill_answer, served)
    router.add_route(Route("GET", "/v1/chunks", chunk, EVERYONE, threaded=True, inline=inline))
    return router


@contextmanager
def server(tmp_path: Path, served: Served) -> Iterator[str]:
    path = str(tmp_path / "s.sock")
    conns = ConnectionLimits(trusted=lambda peer: True)
    serve = functools.partial(
        serve_unix, path, make_router(served), connections=conns, max_header=4096
    )
    with serving(serve):
        yield path


async def moved(client: AsyncControlClient) -> None:
    """The connection's first call, answered on the loop: its thread answers the next."""
    status, headers, body = await client.request("GET", "/v1/chunks?fill=0")
    assert (status, body) == (200, b"from the loop")
    assert sealed.REGION_HEADER not in headers


def test_region_is_sealed_against_others_and_named_by_its_tail() -> None:
    region = sealed.Region()
    value = region.view(HEAD + SIZE)
    assert value is not None and region.value is not None
    value[:] = b"x" * (HEAD + SIZE)  # the daemon's own mapping stays writable
    assert region.where(value[HEAD:]) == f"{HEAD} {SIZE}"
    assert region.where(memoryview(b"y" * SIZE)) is None  # not the region's
    fd = os.dup(region.value.fd)
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(fd, HEAD + SIZE, flags=mmap.MAP_SHARED)  # a writable mapping
        with pytest.raises(OSError) as raised:
            os.pwrite(fd, b"z", 0)
        assert raised.value.errno == errno.EPERM
        mapped = sealed.map_region(os.dup(fd))
        assert mapped[HEAD : HEAD + 4] == b"xxxx"
        mapped.close()
    finally:
        os.close(fd)
    before = sealed.live()["count"]
    value.release()
    region.close()
    assert sealed.live()["count"] == before - 1


def test_region_is_made_once_for_a_connections_values_of_one_chunk_size() -> None:
    """A short chunk's value first: the region is made for a full chunk's all the same,
    so the next, longer value needs no new region (and no new descriptor)."""
    region = sealed.Region()
    short = region.view(HEAD + 1000, least=HEAD + SIZE)
    assert short is not None and short.nbytes == HEAD + 1000
    first, region.sent = region.value, True
    full = region.view(HEAD + SIZE, least=HEAD + SIZE)
    assert full is not None and region.value is first and region.sent
    assert region.where(full[HEAD:]) == f"{HEAD} {SIZE}"
    short.release()
    full.release()
    bigger = region.view(2 * SIZE)  # longer than any: a region anew, to be passed again
    assert bigger is not None and region.value is not first and not region.sent
    bigger.release()
    region.close()


def test_regions_are_bounded_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_REGION_BYTES a connection gets no region (its chunks come as bytes);
    a region dropped gives its bytes back."""
    before = sealed.region_bytes()
    monkeypatch.setattr(sealed, "MAX_REGION_BYTES", before + 2 * SIZE)
    one, two, three = sealed.Region(), sealed.Region(), sealed.Region()
    for region in (one, two):
        view = region.view(SIZE)
        assert view is not None
        view.release()
    assert sealed.region_bytes() == before + 2 * SIZE
    assert three.view(SIZE) is None and three.value is None
    one.close()
    assert sealed.region_bytes() == before + SIZE
    view = three.view(SIZE)
    assert view is not None
    view.release()
    two.close()
    three.close()
    assert sealed.region_bytes() == before


def test_unsealed_file_is_refused_as_a_region() -> None:
    fd = os.memfd_create("not-sealed", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    with pytest.raises(ValueError, match="not sealed"):
        sealed.map_region(fd)


def test_next_answer_never_changes_bytes_a_read_holds(tmp_path: Path) -> None:
    """The region is written again for the connection's next answer; the first answer's
    bytes, copied out before its request ended, stay what they were."""
    served = Served()
    with server(tmp_path, served) as path:

        async def main() -> None:
            client = AsyncControlClient(path, max_connections=1)
            try:
                await moved(client)
                s1, h1, first = await client.request("GET", "/v1/chunks?fill=1")
                s2, h2, second = await client.request("GET", "/v1/chunks?fill=2")
                s3, _, third = await client.request("GET", "/v1/chunks?fill=3")
            finally:
                await client.aclose()
            assert (s1, s2, s3) == (200, 200, 200)
            assert h1[sealed.REGION_HEADER] == h2[sealed.REGION_HEADER] == f"{HEAD} {SIZE}"
            assert first == b"\x01" * SIZE  # not 2s or 3s: its own bytes
            assert second == b"\x02" * SIZE
            assert third == b"\x03" * SIZE
            assert client.connections_opened == 1

        trio.run(main)
    assert len(served.regions) == 1  # one region for the connection
    assert served.sent_fds == 1  # its descriptor passed once


def test_closed_connection_frees_its_region(tmp_path: Path) -> None:
    """A mount that leaves (killed, or its client closed) with its region passed: the
    daemon's side drops the region with the connection."""
    served = Served()
    with server(tmp_path, served) as path:
        # The count is the process's: values of earlier tests left in reference cycles
        # are freed whenever the collector runs, so collect them before counting.
        gc.collect()
        before = sealed.live()["count"]

        async def main() -> None:
            client = AsyncControlClient(path, max_connections=1)
            await moved(client)
            status, _, data = await client.request("GET", "/v1/chunks?fill=7")
            assert status == 200 and data == b"\x07" * SIZE
            assert sealed.live()["count"] == before + 1  # the region, alive
            await client.aclose()

        trio.run(main)
        assert wait_for(lambda: sealed.live()["count"] == before, timeout=10.0)
        assert served.regions and served.regions[0].value is None


@pytest.mark.parametrize("bad", ["outside", "nofd"])
def test_answer_that_does_not_fit_its_region_is_dropped(tmp_path: Path, bad: str) -> None:
    """An answer naming bytes outside its region, or a region whose descriptor never
    came, is not served: the client drops the connection, and the request (a GET, so
    repeated once on a new connection) is answered there by the loop's handler."""
    served = Served()
    with server(tmp_path, served) as path:

        async def main() -> None:
            client = AsyncControlClient(path, max_connections=1, timeout=5.0)
            try:
                await moved(client)
                if bad == "outside":
                    status, _, data = await client.request("GET", "/v1/chunks?fill=1")
                    assert status == 200 and data == b"\x01" * SIZE
                status, headers, data = await client.request("GET", f"/v1/chunks?fill=2&bad={bad}")
            finally:
                await client.aclose()
            assert (status, data) == (200, b"from the loop")
            assert sealed.REGION_HEADER not in headers
            assert client.connections_opened == 2

        trio.run(main)
