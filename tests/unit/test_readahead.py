"""Cold-read machinery without FUSE: the mount's adaptive read-ahead window and the
daemon's span GETs (one GET per span, charged to the job before it, streamed on)."""

from __future__ import annotations

import errno
import io
import threading
from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing

from silofs.cache.format import ChunkRef
from silofs.mount.reader import ChunkReader, MissError, OpenFile
from silofs.node.backends.base import RangeStream, StoreCounters
from silofs.node.fetch import PARK_SECONDS, SPAN_SECONDS, Fetcher
from silofs.node.limiter import TokenBucket
from silofs.records import ObjectInfo

CS = 1 << 20  # chunk size


# -- the mount's window ---------------------------------------------------------------
class _Store:
    path = "/nonexistent"  # no env: the reader's ValuePages stay disabled

    def db(self, name: bytes) -> None:
        return None

    def owns(self, txn: Any, dsid: int, key: bytes) -> bool:
        return False


class _Nursery:
    """Records what read-ahead asks for; each ask is served at once."""

    def __init__(self, reader: ChunkReader) -> None:
        self.reader = reader
        self.spans: list[tuple[int, int]] = []
        self.asked: list[int] = []

    def start_soon(self, fn: Any, ref: ChunkRef, span: tuple[int, int]) -> None:
        self.asked.append(ref.index)
        self.reader.ahead_bytes -= ref.length
        if not self.spans or self.spans[-1] != span:
            self.spans.append(span)


async def _never() -> None:
    raise AssertionError("no re-registration here")


def _reader(readahead_bytes: int = 16 * CS, buffer_bytes: int = 128 * CS) -> ChunkReader:
    reader = ChunkReader(
        _Store(),  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        dataset_id=1,
        chunk_size=CS,
        buffer_bytes=buffer_bytes,
        readahead_bytes=readahead_bytes,
        reregister=_never,
    )
    reader._nursery = _Nursery(reader)  # type: ignore[assignment]
    reader._snapshot = lambda: None  # type: ignore[method-assign]
    return reader


def _read(reader: ChunkReader, f: OpenFile, off: int, size: int) -> None:
    """What fs.read does for read-ahead: note the read, prefetch after a sequential one."""
    end = min(off + size, f.obj.size)
    if f.advance(off, end):
        reader.prefetch(f, (end - 1) // CS)


def test_the_window_doubles_on_sequential_reads_up_to_its_limit() -> None:
    reader = _reader(readahead_bytes=16 * CS)
    f = OpenFile(ObjectInfo("big", 100 * CS, 0.0, "v", "c"))
    for off in range(0, f.obj.size, 256 << 10):  # 256 KiB reads, 4 per chunk
        _read(reader, f, off, 256 << 10)
        # Never more than 1.5 windows asked beyond the reader's chunk: they wait in the
        # buffer, which holds two windows.
        assert f.ahead - 1 - off // CS <= 1.5 * reader.max_window
    spans = reader._nursery.spans  # type: ignore[attr-defined]
    sizes = [b - a + 1 for a, b in spans]
    assert sizes[:5] == [1, 2, 4, 8, 16]
    assert max(sizes) == 16  # readahead_bytes
    assert spans[-1][1] == 99  # up to the last chunk, never past it
    asked = reader._nursery.asked  # type: ignore[attr-defined]
    assert sorted(asked) == list(range(1, 100))  # every chunk after the first, once


def test_a_seek_resets_the_window_and_random_reads_never_read_ahead() -> None:
    reader = _reader()
    nursery = reader._nursery
    f = OpenFile(ObjectInfo("big", 100 * CS, 0.0, "v", "c"))
    for off in range(0, 8 * CS, CS):
        _read(reader, f, off, CS)
    assert [b - a + 1 for a, b in nursery.spans] == [1, 2, 4, 8]  # type: ignore[attr-defined]
    before = list(nursery.asked)  # type: ignore[attr-defined]
    for off in (50 * CS + 5, 20 * CS, 70 * CS + 123, 3 * CS):  # random reads: nothing
        _read(reader, f, off, 64 << 10)
    assert nursery.asked == before  # type: ignore[attr-defined]
    assert f.window == 0
    _read(reader, f, 60 * CS, CS)  # a seek, then sequential again: one chunk first
    _read(reader, f, 61 * CS, CS)
    assert nursery.spans[-1] == (62, 62)  # type: ignore[attr-defined]
    # The kernel's read-ahead requests may arrive out of order: one inside what the run
    # asked for is still the run (the window keeps growing), one outside it is a seek.
    _read(reader, f, 62 * CS + (512 << 10), 512 << 10)
    _read(reader, f, 62 * CS, 512 << 10)
    assert nursery.spans[-1] == (63, 64) and f.window == 4  # type: ignore[attr-defined]
    _read(reader, f, 63 * CS, CS)
    assert nursery.spans[-1] == (65, 68)  # type: ignore[attr-defined]
    _read(reader, f, 90 * CS, CS)
    assert f.window == 0


def test_the_kernels_read_ahead_of_a_files_head_is_not_a_sequential_reader() -> None:
    """With the bdi read-ahead at 1 MiB the kernel reads 2 MiB of a file whose head
    alone is read (the first request, and the window after it): no span for that; a
    third request in sequence is a reader, and read-ahead starts."""
    reader = _reader()
    reader.head_bytes = 2 * CS
    f = OpenFile(ObjectInfo("big.jpg", 40 * CS, 0.0, "v", "c"))
    _read(reader, f, 0, CS)
    _read(reader, f, CS, CS)
    assert reader._nursery.asked == []  # type: ignore[attr-defined]
    _read(reader, f, 2 * CS, CS)
    assert reader._nursery.spans == [(3, 3)]  # type: ignore[attr-defined]
    # Past the head, half a chunk in sequence is enough again (a reader after a seek).
    g = OpenFile(ObjectInfo("other", 40 * CS, 0.0, "v", "c"))
    _read(reader, g, 10 * CS, 300 << 10)
    _read(reader, g, 10 * CS + (300 << 10), 300 << 10)
    assert reader._nursery.spans[-1] == (11, 11)  # type: ignore[attr-defined]


def test_files_of_one_chunk_and_a_full_buffer_ask_for_nothing() -> None:
    reader = _reader()
    small = OpenFile(ObjectInfo("img.jpg", 110 << 10, 0.0, "v", "c"))
    for off in range(0, small.obj.size, 32 << 10):
        _read(reader, small, off, 32 << 10)
    # The head of a big file read in the kernel's own small requests (an image header).
    head = OpenFile(ObjectInfo("big.jpg", 3 * CS, 0.0, "v", "c"))
    for off in range(0, 128 << 10, 32 << 10):
        _read(reader, head, off, 32 << 10)
    assert reader._nursery.asked == []  # type: ignore[attr-defined]
    _read(reader, head, 128 << 10, CS // 2)  # half a chunk read in order: a reader
    assert reader._nursery.asked == [1]  # type: ignore[attr-defined]
    reader._nursery.asked.clear()  # type: ignore[attr-defined]
    # The window is at most half the buffer, and asks wait while read-ahead already
    # holds that much.
    tight = _reader(readahead_bytes=64 * CS, buffer_bytes=8 * CS)
    assert tight.max_window == 4
    tight.ahead_bytes = tight.ahead_limit
    f = OpenFile(ObjectInfo("big", 100 * CS, 0.0, "v", "c"))
    _read(tight, f, 0, CS)
    _read(tight, f, CS, CS)
    assert tight._nursery.asked == []  # type: ignore[attr-defined]


# -- the daemon's span GETs -----------------------------------------------------------
class _Backend:
    """A store of one object that records each GET and what the job was charged when
    it began; streams ranges when `streams`."""

    uri = "test://b/"

    def __init__(self, data: bytes, limiter: TokenBucket, streams: bool) -> None:
        self.data = data
        self.limiter = limiter
        self.streams = streams
        self.gets: list[tuple[str, int, int, int]] = []  # kind, start, length, charged
        self.hold_at: int | None = None  # a GET starting here waits for `release`
        self.release = threading.Event()

    def get_range(self, info: ObjectInfo, start: int, length: int) -> bytes:
        self.gets.append(("get", start, length, self.limiter.charged_bytes))
        if start == self.hold_at:
            self.release.wait(30)
        return self.data[start : start + length]

    def open_range(
        self, info: ObjectInfo, start: int, length: int, whole: bool = False
    ) -> RangeStream | None:
        if not self.streams:
            return None
        end = min(start + length, info.size)
        self.gets.append(("open", start, end - start, self.limiter.charged_bytes))
        body = io.BytesIO(self.data[start:end])
        if start == self.hold_at:  # its first read waits for `release`
            first_read = body.read

            def held_read(n: int = -1) -> bytes:
                self.release.wait(30)
                return first_read(n)

            body.read = held_read  # type: ignore[method-assign]
        return RangeStream(body, start, end, "test://b/big", StoreCounters())


OBJ = ObjectInfo("big", 32 * CS + 7, 0.0, "v1", "etag:big")
DATA = bytes(range(256)) * ((OBJ.size + 255) // 256)


def _refs(first: int, last: int) -> list[ChunkRef]:
    return [ChunkRef.of(OBJ, CS, i) for i in range(first, last + 1)]


async def _span(fetcher: Fetcher, backend: _Backend, limiter: TokenBucket, span: list[ChunkRef]):
    """Ask for every chunk of `span` at once, as a mount's read-ahead does."""
    got: dict[int, bytes] = {}
    fetched = []

    async def ask(ref: ChunkRef) -> None:
        data, f = await fetcher.fetch_span(1, backend, limiter, ref, span, readahead=True)  # type: ignore[arg-type]
        got[ref.index] = data
        fetched.append(f)

    async with trio.open_nursery() as n:
        for ref in span:
            n.start_soon(ask, ref)
    return got, fetched


@pytest.mark.parametrize("streams", [False, True])
def test_a_span_is_one_get_charged_before_it(
    make_fetcher: Callable[[], Fetcher], streams: bool
) -> None:
    async def main() -> None:
        fetcher = make_fetcher()
        limiter = TokenBucket(None)
        backend = _Backend(DATA, limiter, streams)
        span = _refs(4, 11)
        got, fetched = await _span(fetcher, backend, limiter, span)
        assert got == {r.index: DATA[r.start : r.start + r.length] for r in span}
        assert len(backend.gets) == 1
        kind, start, length, charged_before = backend.gets[0]
        assert (kind, start) == ("open" if streams else "get", 4 * CS)
        # The whole span was charged before the GET began (promise 2); a stream of the
        # rest of the object stays open, and what it has not read is not charged.
        assert charged_before == limiter.charged_bytes == 8 * CS
        assert length == (OBJ.size - 4 * CS if streams else 8 * CS)
        assert sum(f.chunks for f in fetched) == 8 and sum(f.requests for f in fetched) == 1

        # The reader's next span continues the open GET: no GET of its own, charged.
        got, fetched = await _span(fetcher, backend, limiter, _refs(12, 19))
        assert got[19] == DATA[19 * CS : 20 * CS]
        assert len(backend.gets) == (1 if streams else 2)
        assert limiter.charged_bytes == 16 * CS
        # What no span continues is closed once it has waited PARK_SECONDS.
        assert len(fetcher._parked) == (1 if streams else 0)
        fetcher.sweep_parked(trio.current_time() + PARK_SECONDS / 2)
        assert len(fetcher._parked) == (1 if streams else 0)
        fetcher.sweep_parked(trio.current_time() + PARK_SECONDS + 1)
        assert not fetcher._parked

    trio.run(main)


def test_with_a_rate_a_get_covers_what_was_charged_and_no_more(
    make_fetcher: Callable[[], Fetcher],
) -> None:
    async def main() -> None:
        fetcher = make_fetcher()
        rate = 4 * CS / SPAN_SECONDS  # at most 4 chunks per GET
        limiter = TokenBucket(rate, burst_seconds=100)
        limiter._tokens = 64.0 * CS  # a full bucket: the test does not wait on the rate
        backend = _Backend(DATA, limiter, streams=True)
        got, _ = await _span(fetcher, backend, limiter, _refs(0, 11))
        assert got == {i: DATA[i * CS : (i + 1) * CS] for i in range(12)}
        assert len(backend.gets) >= 3  # runs of at most four chunks
        begun = 0
        for _kind, _start, length, charged_before in backend.gets:  # in the order begun
            # The GET asks for exactly its run, charged before it began: no byte that
            # was not charged crosses the wire, even though the range could stream on.
            assert length <= 4 * CS
            begun += length
            assert charged_before >= begun
        assert sum(g[2] for g in backend.gets) == limiter.charged_bytes == 12 * CS

    trio.run(main)


def test_chunks_held_or_in_flight_are_not_fetched_again(
    make_fetcher: Callable[[], Fetcher],
) -> None:
    async def main() -> None:
        fetcher = make_fetcher()
        limiter = TokenBucket(None)
        backend = _Backend(DATA, limiter, streams=False)
        backend.hold_at = 5 * CS
        span = _refs(0, 7)
        results = []

        async def whole_span() -> None:
            results.append(await _span(fetcher, backend, limiter, span))

        async with trio.open_nursery() as n:
            # chunk 5 alone first, held in its GET: the span's runs stop at it
            n.start_soon(fetcher.fetch_span, 1, backend, limiter, span[5], [span[5]])
            await trio.testing.wait_all_tasks_blocked()
            n.start_soon(whole_span)
            await trio.testing.wait_all_tasks_blocked()
            backend.release.set()
        got, _ = results[0]
        assert got == {i: DATA[i * CS : (i + 1) * CS] for i in range(8)}
        assert sorted((s, n) for _, s, n, _ in backend.gets) == [
            (0, 5 * CS),
            (5 * CS, CS),
            (6 * CS, 2 * CS),
        ]
        assert limiter.charged_bytes == 8 * CS

    trio.run(main)


def test_spans_asked_while_the_stream_is_busy_all_continue_it(
    make_fetcher: Callable[[], Fetcher],
) -> None:
    """A reader with three spans in flight: the second waits for the first's stream, and
    the third must wait for the second's, not open a stream of its own (it did: one GET
    more, and the stream left for it was closed by the reaper PARK_SECONDS later)."""

    async def main() -> None:
        fetcher = make_fetcher()
        limiter = TokenBucket(None)
        backend = _Backend(DATA, limiter, streams=True)
        backend.hold_at = 0  # the first span's stream is slow to read
        results: list[dict[int, bytes]] = []

        async def span(first: int, last: int) -> None:
            results.append((await _span(fetcher, backend, limiter, _refs(first, last)))[0])

        async with trio.open_nursery() as n:
            for first in (0, 8, 16):
                n.start_soon(span, first, first + 7)
                await trio.testing.wait_all_tasks_blocked()
            backend.release.set()
        assert {i: d for got in results for i, d in got.items()} == {
            i: DATA[i * CS : (i + 1) * CS] for i in range(24)
        }
        assert [(kind, start) for kind, start, _, _ in backend.gets] == [("open", 0)]
        # The one stream is left where the third span ended, for the reader's next.
        assert list(fetcher._parked) == [(OBJ.key, OBJ.content_id, 24 * CS)]
        assert not fetcher._busy

    trio.run(main)


# -- failures: a read-ahead's is a warning, a reader's an error ------------------------
class _FailingClient:
    """Answers every chunk request 502 once `release` is set."""

    def __init__(self) -> None:
        self.release = trio.Event()

    async def request(self, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
        await self.release.wait()
        return 502, {}, b'{"error": "GCS response for k broke off"}'


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]


def test_a_failed_read_ahead_is_a_warning_and_a_reader_joining_it_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reader = _reader()
    client = reader.client = _FailingClient()  # type: ignore[assignment]
    ref = ChunkRef.of(ObjectInfo("k", 4 * CS, 0.0, "v", "c"), CS, 1)
    outcomes: list[str] = []

    async def read() -> None:
        try:
            await reader._miss(ref, False)
        except MissError as exc:
            outcomes.append(f"reader {exc.errno}")

    async def main() -> None:
        client.release.set()
        await reader._prefetch_one(ref, (1, 1))  # alone: a warning, nothing raised
        assert _errors(caplog) == []
        assert any("broke off" in r.getMessage() for r in caplog.records)
        client.release = trio.Event()
        async with trio.open_nursery() as n:
            n.start_soon(reader._prefetch_one, ref, (1, 1))
            await trio.testing.wait_all_tasks_blocked()
            n.start_soon(read)  # joins the read-ahead's ask
            await trio.testing.wait_all_tasks_blocked()
            client.release.set()

    reader.ahead_bytes = 2 * ref.length  # what prefetch() would have counted
    with caplog.at_level("WARNING", logger="silofs.mount.reader"):
        trio.run(main)
    assert outcomes == [f"reader {errno.EIO}"]
    assert _errors(caplog) == ["reading k chunk 1: GCS response for k broke off"]
