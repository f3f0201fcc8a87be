"""Prefetch by hint without FUSE: a real Daemon (LMDB, writer, fetcher) and the real
router over a local store, with peers' credentials as the routes see them.

Owns what docs/ARCHITECTURE.md and docs/SECURITY.md promise for hints: fetched chunks
are charged to the job's limiter, at most `window` bytes ahead of the reader, never
beyond the dataset's cache allocation; the position follows the mount's reports and
misses; a hint is refused for another uid's mount, bad bodies are 400, paths the peer
may not read are never fetched; a failing hint task marks the hint, not the daemon.
The PrefetchSampler's own behaviour (order kept, pieces sent ahead of the reader, a
failed hint never fails an epoch) is tested with a recording Hinter.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import trio

from silofs.control.peer import Peer
from silofs.hints import Hinter, HintError, mount_key, pieces
from silofs.node import prefetch as prefetch_mod
from silofs.node.daemon import Daemon
from silofs.node.routes import build_router
from silofs.torch import PrefetchSampler
from tests.support.trees import patterned_files, write_tree

from .test_routes_access import ALICE, BOB, ROOT, route_caller

KiB, MiB = 1 << 10, 1 << 20
CHUNK = 256 * KiB
FILE = 300 * KiB  # two chunks: 256 KiB + 44 KiB
FILES = 24


def run(
    tmp_path: Path, root: Path, test: Callable[..., Any], cache_size: int = 64 * MiB, **kw: Any
) -> None:
    from silofs.config import NodeSettings

    settings = NodeSettings(
        socket=str(tmp_path / "s.sock"),
        cache_dir=str(tmp_path / "cache"),
        cache_size=cache_size,
        chunk_size=CHUNK,
        **kw,
    )
    d = Daemon(settings)
    call = route_caller(build_router(d))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            d.nursery = nursery
            nursery.start_soon(d.writer.run)
            status, ds = await call(ROOT, "POST", "/v1/datasets", {"uri": str(root)})
            assert status == 200, ds
            with trio.fail_after(10):
                while d.datasets[ds["id"]].state != "ready":
                    await trio.sleep(0.01)
            await test(d, call, ds)
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        d.store.close()
        os.close(d.lock_fd)


@pytest.fixture
def bucket(world: Path) -> Path:
    """FILES patterned files under `world`, where every peer may look."""
    return write_tree(world / "data", patterned_files(FILES, FILE, "f{i:02d}.bin"))


NAMES = [f"f{i:02d}.bin" for i in range(FILES)]


async def register(call: Any, peer: Peer, ds: dict, job: str = "train") -> str:
    reg = {"dataset": ds["id"], "job": job, "mountpoint": "/m", "chunk_size": CHUNK}
    status, m = await call(peer, "POST", "/v1/mounts", reg)
    assert status == 201, m
    return m["id"]


async def until(pred: Callable[[], Any], what: str, timeout: float = 10) -> Any:
    with trio.fail_after(timeout):
        while not (value := pred()):
            await trio.sleep(0.005)
    return value


async def report(call: Any, mid: str, bytes_read: int) -> None:
    counters = {"bytes_read": bytes_read, "hit_bytes": 0, "miss_bytes": 0, "hits": 0}
    body = {**counters, "misses": 0, "corrupt_chunks": 0}
    status, out = await call(ROOT, "PUT", f"/v1/mounts/{mid}/stats", body)
    assert status == 200, out


def settled(d: Daemon, mid: str) -> Callable[[], Any]:
    """The hint has stopped moving: its walk waits on the window (nothing in flight),
    or it ended."""

    def check() -> Any:
        h = d.prefetch.hints[mid]
        return (h.state != "running" or (h.waiting and h.in_flight == 0)) and h

    return check


# -- the daemon side -------------------------------------------------------------------
def test_hint_is_charged_to_the_job_bounded_by_the_window_and_follows_the_reader(
    tmp_path: Path, bucket: Path
) -> None:
    async def test(d: Daemon, call: Any, ds: dict) -> None:
        mid = await register(call, ROOT, ds)
        status, view = await call(
            ROOT, "POST", f"/v1/mounts/{mid}/hints", {"paths": NAMES, "window": "1M"}
        )
        assert status == 202, view
        assert view["window"] == MiB and view["hinted"] == FILES
        h = await until(settled(d, mid), "the window to fill")
        job = d.jobs["train"]
        # Never more than the window ahead of a reader that has read nothing.
        assert 0 < h.counters.bytes <= MiB, h.view()
        assert h.ahead_bytes == h.counters.bytes == job.prefetch.bytes
        # Charged to the job's limiter, and counted as the job's remote bytes.
        assert job.limiter.charged_bytes == job.fetch.remote_bytes == h.counters.bytes

        # The reader reports 2 MiB read: the window moves with it, and the chunks it
        # passed without asking the daemon count as hits.
        before = h.counters.bytes
        await report(call, mid, 2 * MiB)
        await until(
            lambda: settled(d, mid)() and d.prefetch.hints[mid].counters.bytes > before,
            "the prefetch to move on",
        )
        h = d.prefetch.hints[mid]
        assert h.position == 2 * MiB
        assert h.ahead_bytes <= MiB
        assert h.counters.hit_chunks >= 1 and h.counters.missed_chunks == 0
        assert job.prefetch.hit_chunks == h.counters.hit_chunks
        # Files wholly behind the reader when the walk reached them were skipped.
        assert all(c.end > 2 * MiB for c in h.ahead)

        # A miss on a prefetched chunk counts as missed, not hit; a miss further on in
        # the hint moves the position to it.
        m = d.mounts[mid]
        chunk = h.ahead[0]
        gets = job.fetch.remote_gets
        data, _ = await d.get_chunk(m, chunk.key, chunk.index, False)
        assert h.counters.missed_chunks == job.prefetch.missed_chunks == 1
        # Served from the cache (or the writer's queue, not committed yet): no GET again.
        assert job.fetch.remote_gets == gets and len(data) == chunk.length
        far, (start, _) = list(h.starts.items())[-1]
        await d.get_chunk(m, far, 1, False)
        assert h.position == start + CHUNK > 2 * MiB

        # Reading to the end finishes the hint; every prefetched chunk was charged.
        await report(call, mid, FILES * FILE)
        h = await until(
            lambda: d.prefetch.hints[mid].state == "done" and d.prefetch.hints[mid], "done"
        )
        assert job.limiter.charged_bytes == job.fetch.remote_bytes
        status, st = await call(ROOT, "GET", "/v1/status")
        jv = next(j for j in st["jobs"] if j["name"] == "train")
        assert jv["prefetched_bytes"] == job.prefetch.bytes > 0
        assert jv["prefetch_hit_chunks"] == job.prefetch.hit_chunks
        mv = next(x for x in st["mounts"] if x["id"] == mid)
        assert mv["prefetch"]["state"] == "done"

    run(tmp_path, bucket, test)


def test_hint_never_fetches_beyond_the_cache_allocation(tmp_path: Path, bucket: Path) -> None:
    allocation = 2 * MiB

    async def test(d: Daemon, call: Any, ds: dict) -> None:
        status, out = await call(
            ROOT, "PUT", f"/v1/datasets/{ds['id']}/cache", {"bytes": allocation}
        )
        assert status == 200, out
        mid = await register(call, ROOT, ds)
        status, view = await call(ROOT, "POST", f"/v1/mounts/{mid}/hints", {"paths": NAMES})
        assert status == 202, view
        h = await until(
            lambda: d.prefetch.hints[mid].state != "running" and d.prefetch.hints[mid], "full"
        )
        assert h.state == "full", h.view()
        await d.writer.flush()
        held = d.usage[ds["id"]].bytes
        # Uniform admission holds: the dataset is within its allocation, and the hint
        # fetched nothing the writer then refused.
        assert held <= allocation
        assert h.counters.bytes == held
        assert d.writer.stats.rejected_chunks == 0
        assert allocation - FILE < held

        # Chunks the dataset already holds are not fetched again.
        status, view = await call(ROOT, "POST", f"/v1/mounts/{mid}/hints", {"paths": NAMES[:4]})
        h = await until(
            lambda: d.prefetch.hints[mid].state != "running" and d.prefetch.hints[mid], "done"
        )
        assert h.counters.bytes == 0 and h.cached_bytes == 4 * FILE

    run(tmp_path, bucket, test)


def test_hints_are_refused_for_another_uids_mount_and_bad_bodies(
    tmp_path: Path, bucket: Path
) -> None:
    (bucket / "secret.bin").write_bytes(b"s" * 1000)
    (bucket / "secret.bin").chmod(0o600)

    async def test(d: Daemon, call: Any, ds: dict) -> None:
        # The listing was made before secret.bin existed: list again.
        status, out = await call(
            ROOT, "POST", "/v1/datasets", {"uri": str(bucket), "refresh": True}
        )
        await until(lambda: d.datasets[ds["id"]].state == "ready", "listed")
        mid = await register(call, ALICE, ds)
        url = f"/v1/mounts/{mid}/hints"
        status, out = await call(BOB, "POST", url, {"paths": NAMES})
        assert status == 403, out
        assert mid not in d.prefetch.hints
        for body in (
            b"not json",
            b"[1, 2]",
            {"paths": "f00.bin"},
            {"paths": [1, 2]},
            {"paths": [""]},
            {"paths": ["x" * 5000]},
            {"paths": ["a\u0000b"]},
            {"paths": ["a"] * (prefetch_mod.MAX_HINT_PATHS + 1)},
            {"paths": NAMES, "window": -5},
            {"paths": NAMES, "window": "lots"},
            {"paths": NAMES, "append": "yes"},
            {},
        ):
            status, out = await call(ALICE, "POST", url, body)
            assert status == 400 and set(out) == {"error"}, (body, out)
            assert "\n" not in out["error"]
        assert mid not in d.prefetch.hints

        # Alice's own hint: the file she may not read is never fetched, nor one that is
        # not in the listing.
        status, out = await call(ALICE, "POST", url, {"paths": ["secret.bin", "nope", *NAMES[:2]]})
        assert status == 202, out
        h = await until(
            lambda: d.prefetch.hints[mid].state == "done" and d.prefetch.hints[mid], "done"
        )
        assert (h.denied, h.unknown) == (1, 1)
        assert h.counters.bytes == 2 * FILE
        await d.writer.flush()
        counters = d.datasets[ds["id"]].fetch
        assert d.fetcher.cached(_ref(d, ds, "secret.bin"), counters) == (None, False)

        # A mount limit holds: more paths not walked yet than a hint may hold is a 429;
        # and one per uid, over all its mounts. (One path per resolve step and a 1-byte
        # window: the walk takes one path and waits, 2 stay pending.)
        saved = (
            prefetch_mod.MAX_HINT_PENDING,
            prefetch_mod.MAX_HINT_PENDING_PER_UID,
            prefetch_mod.RESOLVE_BATCH,
        )
        prefetch_mod.MAX_HINT_PENDING, prefetch_mod.MAX_HINT_PENDING_PER_UID = 4, 5
        prefetch_mod.RESOLVE_BATCH = 1
        try:
            status, out = await call(ALICE, "POST", url, {"paths": NAMES[4:7], "window": 1})
            assert status == 202, out
            h = await until(settled(d, mid), "the window to fill")
            assert len(h.paths) == 2
            status, out = await call(ALICE, "POST", url, {"paths": NAMES[:3], "append": True})
            assert status == 429 and "limit 4" in out["error"], out
            other = await register(call, ALICE, ds)
            ourl = f"/v1/mounts/{other}/hints"
            status, out = await call(ALICE, "POST", ourl, {"paths": NAMES[:4]})
            assert status == 429 and "per uid" in out["error"], out
            status, out = await call(ROOT, "POST", ourl, {"paths": NAMES[:4]})
            assert status == 202, out  # root is exempt from the per-uid limit
        finally:
            (
                prefetch_mod.MAX_HINT_PENDING,
                prefetch_mod.MAX_HINT_PENDING_PER_UID,
                prefetch_mod.RESOLVE_BATCH,
            ) = saved
        # Bob cannot see it stopped either; Alice can stop it.
        assert (await call(BOB, "DELETE", url))[0] == 403
        status, out = await call(ALICE, "DELETE", url)
        assert status == 200 and out["state"] in ("cancelled", "done")
        await until(lambda: not d.prefetch.hints[mid].running, "the hint to stop")

    run(tmp_path, bucket, test)


def _ref(d: Daemon, ds: dict, key: str) -> Any:
    from silofs.cache.format import ChunkRef

    obj = d.store.get_object(ds["id"], key)
    assert obj is not None
    return ChunkRef.of(obj, CHUNK, 0)


def test_a_failing_hint_task_marks_the_hint_not_the_daemon(
    tmp_path: Path, bucket: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*_a: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(prefetch_mod.Prefetcher, "_resolve", broken)

    async def test(d: Daemon, call: Any, ds: dict) -> None:
        mid = await register(call, ROOT, ds)
        status, _ = await call(ROOT, "POST", f"/v1/mounts/{mid}/hints", {"paths": NAMES})
        assert status == 202
        h = await until(
            lambda: d.prefetch.hints[mid].state == "error" and d.prefetch.hints[mid], "error"
        )
        assert "boom" in h.error and not h.running
        status, _ = await call(ROOT, "GET", "/v1/status")
        assert status == 200
        # The mount's reads go on.
        data, _ = await d.get_chunk(d.mounts[mid], NAMES[0], 0, False)
        assert len(data) == CHUNK

    run(tmp_path, bucket, test)
    failed = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(failed) == 1 and "prefetch of mount" in failed[0].getMessage()


def test_a_new_hint_replaces_the_old_and_unmount_forgets_it(tmp_path: Path, bucket: Path) -> None:
    async def test(d: Daemon, call: Any, ds: dict) -> None:
        mid = await register(call, ROOT, ds)
        url = f"/v1/mounts/{mid}/hints"
        await call(ROOT, "POST", url, {"paths": NAMES, "window": CHUNK})
        first = await until(settled(d, mid), "the window to fill")
        status, view = await call(ROOT, "POST", url, {"paths": NAMES[::-1], "window": CHUNK})
        assert status == 202 and view["hinted"] == FILES
        await until(lambda: first.state == "cancelled", "the old hint to stop")
        second = d.prefetch.hints[mid]
        assert second is not first
        await until(settled(d, mid), "the new window to fill")
        assert second.ahead[0].key == NAMES[-1]
        status, _ = await call(ROOT, "DELETE", f"/v1/mounts/{mid}")
        assert status == 200 and mid not in d.prefetch.hints
        await until(lambda: second.state == "cancelled", "the hint to stop with its mount")

    run(tmp_path, bucket, test)


# -- the client side ---------------------------------------------------------------------
class Recorder:
    def __init__(self, fail: bool = False) -> None:
        self.sent: list[tuple[list[str], bool]] = []
        self.fail = fail

    def send(self, paths: list[str], *, append: bool = False) -> dict:
        if self.fail:
            raise HintError("no silofs mount at /m")
        self.sent.append((list(paths), append))
        return {}


def test_prefetch_sampler_sends_the_order_ahead_and_keeps_it() -> None:
    order = [5, 3, 9, 0, 1, 2, 4, 6, 8, 7]
    rec = Recorder()
    sampler = PrefetchSampler(
        order, [f"f{i}" for i in range(10)], "/m", piece=4, background=False, hinter=rec
    )  # type: ignore[arg-type]
    assert len(sampler) == 10
    seen = []
    for n, i in enumerate(sampler):
        sent = [p for paths, _ in rec.sent for p in paths]
        # Before each index is yielded, its path was sent, and the hint stays at least
        # half a piece (2) ahead of it until the whole order is sent.
        assert f"f{i}" in sent
        assert len(sent) == len(order) or len(sent) - (n + 1) >= 2, (n, sent)
        seen.append(i)
    assert seen == order
    assert rec.sent[0] == (["f5", "f3", "f9", "f0"], False)
    assert all(append for _, append in rec.sent[1:])
    assert [p for paths, _ in rec.sent for p in paths] == [f"f{i}" for i in order]
    # The next epoch replaces the hint.
    list(sampler)
    assert rec.sent[len(rec.sent) - 3][1] is False


def test_prefetch_sampler_flattens_batches_and_survives_a_failed_hint(
    caplog: pytest.LogCaptureFixture,
) -> None:
    batches = [[0, 1], [2, 3], [4]]
    rec = Recorder()
    sampler = PrefetchSampler(batches, lambda i: f"/m/d/{i}.jpg", "/m", hinter=rec)  # type: ignore[arg-type]
    assert list(sampler) == batches
    sampler.flush(10)
    assert sampler.sent == 5
    assert rec.sent == [
        (["/m/d/0.jpg", "/m/d/1.jpg", "/m/d/2.jpg", "/m/d/3.jpg", "/m/d/4.jpg"], False)
    ]
    broken = PrefetchSampler(range(5), lambda i: str(i), "/m", hinter=Recorder(fail=True))  # type: ignore[arg-type]
    assert list(broken) == [0, 1, 2, 3, 4]
    broken.flush(10)
    assert broken.failed and "no silofs mount" in caplog.text


def test_hint_paths_and_pieces() -> None:
    assert mount_key("/mnt/d", "/mnt/d/a/b.jpg") == "a/b.jpg"
    assert mount_key("/mnt/d", "a/./c/../b.jpg") == "a/b.jpg"
    for bad in ("/elsewhere/x", "/mnt/d", "../x", "."):
        with pytest.raises(HintError):
            mount_key("/mnt/d", bad)
    keys = [f"k{i:05d}" for i in range(10)]
    assert [len(p) for p in pieces(keys, max_paths=4)] == [4, 4, 2]
    assert [len(p) for p in pieces(keys, max_body=30)] == [3, 3, 3, 1]


class BodyRecorder(Hinter):
    """A real Hinter (paths to keys, pieces) whose requests are recorded, not sent."""

    def __init__(self) -> None:
        super().__init__("/m", socket="/nonexistent.sock")
        self.bodies: list[dict] = []

    def _post(self, body: dict) -> dict:
        self.bodies.append(body)
        return {}


def test_pathlib_paths_are_hinted_and_bytes_only_stop_the_hints(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A relative pathlib.Path reached path.replace(os.sep, "/"), Path.replace: TypeError,
    which PrefetchSampler did not catch: with background=False it ended the epoch, in the
    background thread it vanished without a warning."""
    assert mount_key("/m", PurePosixPath("d/a.jpg")) == "d/a.jpg"  # type: ignore[arg-type]
    assert mount_key("/m", Path("/m/d/b.jpg")) == "d/b.jpg"
    rec = BodyRecorder()
    paths = [Path("d") / f"{i}.jpg" for i in range(3)]
    sampler = PrefetchSampler([2, 0, 1], paths, "/m", background=False, hinter=rec)
    assert list(sampler) == [2, 0, 1]
    assert sampler.failed is None
    assert rec.bodies == [{"paths": ["d/2.jpg", "d/0.jpg", "d/1.jpg"], "append": False}]
    for background in (False, True):
        bad = PrefetchSampler(
            range(3),
            [b"d/0.jpg", b"d/1.jpg", b"d/2.jpg"],
            "/m",
            background=background,
            hinter=BodyRecorder(),
        )  # type: ignore[arg-type]
        assert list(bad) == [0, 1, 2]
        bad.flush(10)
        assert bad.failed is not None and "is not a file path" in bad.failed
    assert "no prefetch hints this epoch: b'd/0.jpg' is not a file path" in caplog.text


def test_a_chunk_offered_and_not_committed_is_served_without_a_second_get(
    tmp_path: Path, bucket: Path
) -> None:
    """A reader right behind the prefetch misses a chunk whose batch is not committed yet:
    the daemon answers from the writer's queue instead of fetching it again."""

    async def test(d: Daemon, call: Any, ds: dict) -> None:
        from silofs.cache.format import encode_chunk
        from silofs.node.fetch import FetchCounters
        from silofs.node.store_write import PendingChunk

        ref = _ref(d, ds, NAMES[3])
        data = bytes([3]) * ref.length
        value = encode_chunk(ds["id"], 0, CHUNK, NAMES[3], ref.obj.content_id, data)
        d.writer.batch_seconds = 60  # hold the batch: nothing is committed meanwhile
        assert d.writer.offer(PendingChunk(ds["id"], ref.key, value, ref.length))
        assert d.fetcher.cached(ref, FetchCounters()) == (None, False)  # not cached yet
        dset = d.datasets[ds["id"]]

        class NoGets:
            def get_range(self, *_a: Any) -> bytes:
                raise AssertionError("fetched again")

        limiter = d.job("train").limiter
        got = await d.fetcher.fetch(ds["id"], NoGets(), limiter, ref)  # type: ignore[arg-type]
        assert got == (data, False) and limiter.charged_bytes == 0
        await d.writer.flush()
        assert d.writer.pending(ref.key) is None
        assert d.fetcher.cached(ref, dset.fetch) == (data, False)  # from LMDB now

    run(tmp_path, bucket, test)


def test_in_lru_mode_the_window_is_capped_by_the_quota(tmp_path: Path, bucket: Path) -> None:
    """An lru dataset admits by evicting: the walk waits for the reader at the quota
    rather than evict its own prefetched chunks before they are read."""
    allocation = MiB

    async def test(d: Daemon, call: Any, ds: dict) -> None:
        url = f"/v1/datasets/{ds['id']}"
        assert (await call(ROOT, "PUT", f"{url}/cache", {"bytes": allocation}))[0] == 200
        assert (await call(ROOT, "PUT", f"{url}/admission", {"mode": "lru"}))[0] == 200
        mid = await register(call, ROOT, ds)
        status, _ = await call(ROOT, "POST", f"/v1/mounts/{mid}/hints", {"paths": NAMES})
        assert status == 202
        h = await until(settled(d, mid), "the window to fill")
        assert h.state == "running" and 0 < h.ahead_bytes <= allocation
        await report(call, mid, 4 * MiB)
        await until(lambda: settled(d, mid)() and h.position == 4 * MiB, "the walk to move on")
        assert h.state == "running" and h.ahead_bytes <= allocation

    run(tmp_path, bucket, test)


def test_prefetch_sampler_never_waits_on_the_daemon_and_drops_stale_pieces() -> None:
    """A daemon that does not answer holds up the sender thread, never the epoch; when a
    new epoch begins, the old epoch's pieces not sent yet are dropped."""
    import threading

    gate = threading.Event()
    started = threading.Event()

    class Slow(Recorder):
        def send(self, paths: list[str], *, append: bool = False) -> dict:
            started.set()
            assert gate.wait(10)
            return super().send(paths, append=append)

    rec = Slow()
    sampler = PrefetchSampler(range(10), str, "/m", piece=2, hinter=rec)  # type: ignore[arg-type]
    assert list(sampler) == list(range(10))  # while the first send is stuck
    assert started.wait(10) and rec.sent == []
    assert list(sampler) == list(range(10))  # epoch 2 queues its own pieces
    gate.set()
    sampler.flush(10)
    firsts = [paths for paths, append in rec.sent if not append]
    # Epoch 1's first piece was already being sent; its other pieces were dropped.
    assert firsts == [["0", "1"], ["0", "1"]]
    assert [p for paths, _ in rec.sent[1:] for p in paths] == [str(i) for i in range(10)]
    assert sampler.sent == 10 and sampler.failed is None
