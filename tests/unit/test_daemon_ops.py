"""The Daemon's operations without FUSE and without a socket: a local store in tmp_path.

Owns what the daemon must survive and refuse, tested where /dev/fuse is missing: a task
that fails unexpectedly marks its dataset failed and the daemon goes on; background loops
restart; two daemons never share a cache dir; a damaged env is moved aside; concurrent
allocations cannot together exceed the cache; a mount that re-registers with its own id is
the same mount (its counters are not counted twice); dead mounts are reaped.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import grp
import logging
import os
import re
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import lmdb
import pytest
import trio
import trio.testing

from silofs.cache.store import meta_pages_damaged
from silofs.errors import UsageError
from silofs.node.cachedir import LOCK_FILE, check_cache_dir
from silofs.node.daemon import Daemon
from silofs.node.supervise import REPEAT_SUMMARY, RESTART_MAX, run_forever
from silofs.records import MountCounters
from tests.support.clock import patch_time
from tests.support.node import REPO
from tests.unit.inprocess import listed, mounted, ready, running, settings

MiB = 1 << 20


# -- supervision -------------------------------------------------------------------------
def test_a_dataset_is_listed_and_served(daemon: Daemon, bucket: Path) -> None:
    async def main() -> None:
        async with running(daemon) as d:
            ds = await ready(d, f"file://{bucket}/")
            assert ds.state == "ready", ds.error
            m = d.register_mount(ds, "j", "/mnt/x", os.getpid(), os.getuid(), None)
            data, source = await d.get_chunk(m, "f2.bin", 1, False)
            assert data == bytes([2]) * ((300 << 10) - (256 << 10))
            assert source == "remote"

    trio.run(main)


def test_a_path_longer_than_path_max_is_skipped_not_the_dataset(
    daemon: Daemon, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A chain nested past PATH_MAX (made with mkdirat) cannot be named by a path: it
    is skipped with a warning, and the rest of the tree is listed (it failed the whole
    dataset, so nobody could mount a tree holding one)."""
    deep = tmp_path / "deep"
    deep.mkdir()
    (deep / "a.bin").write_bytes(b"x")
    fd = os.open(deep, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(20):  # 20 x 250 characters: past PATH_MAX (4096) from the root
            os.mkdir("d" * 250, dir_fd=fd)
            nfd = os.open("d" * 250, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        os.close(os.open("f.bin", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
    finally:
        os.close(fd)

    async def main() -> None:
        async with running(daemon) as d:
            ds = await ready(d, f"file://{deep}/")
            assert ds.state == "ready", ds.error
            assert listed(d, ds, "a.bin").size == 1
            assert d.store.get_object(ds.id, ("d" * 250 + "/") * 20 + "f.bin") is None

    with caplog.at_level(logging.WARNING):
        trio.run(main)
    assert any("longer than PATH_MAX" in r.getMessage() for r in caplog.records)
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_an_error_while_listing_fails_the_dataset_not_the_daemon(
    daemon: Daemon, bucket: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from silofs.node.backends import local

    real_list = local.LocalBackend.list_events

    def vanishing(self: local.LocalBackend) -> Iterator:
        for n, info in enumerate(real_list(self)):
            if n == 1:  # an unexpected error from the listing thread
                raise FileNotFoundError(2, "No such file or directory", "f1.bin")
            yield info

    monkeypatch.setattr(local.LocalBackend, "list_events", vanishing)

    async def main() -> None:
        async with running(daemon) as d:
            ds = await ready(d, f"file://{bucket}/")
            assert ds.state == "error" and "No such file" in ds.error
            monkeypatch.setattr(local.LocalBackend, "list_events", real_list)
            again = await ready(d, f"file://{bucket}/")  # an errored dataset may be retried
            assert again.state == "ready"

    trio.run(main)


def test_an_endpoint_that_is_not_a_url_fails_the_dataset_not_the_daemon(daemon: Daemon) -> None:
    pytest.importorskip("boto3")

    async def main() -> None:
        async with running(daemon) as d:
            ds = await ready(d, "s3://bucket/prefix/", endpoint_url="notaurl")
            assert ds.state == "error" and "notaurl" in ds.error

    trio.run(main)


def test_a_failing_loop_is_restarted(caplog: pytest.LogCaptureFixture) -> None:
    calls = []

    async def flaky() -> None:
        calls.append(trio.current_time())
        if len(calls) < 3:
            raise lmdb.MapFullError("mdb_put: MDB_MAP_FULL")
        await trio.sleep_forever()

    async def main() -> None:
        with trio.move_on_after(100):
            await run_forever("the enforcer", flaky)

    caplog.set_level(logging.DEBUG, logger="silofs.node.supervise")
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert len(calls) == 3
    assert calls[2] - calls[1] > calls[1] - calls[0] >= 1  # backoff
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "MapFullError" in errors[0]  # the same failure again:
    again = [r.getMessage() for r in caplog.records if "failed again" in r.getMessage()]
    assert len(again) == 1 and "MapFullError" in again[0]  # DEBUG


def _supervised_log(
    caplog: pytest.LogCaptureFixture,
    minutes: float,
    failure: Callable[[int], Exception],
    progress: Callable[[int], int] | None = None,
) -> tuple[int, list[str]]:
    """Run a loop that fails at once on every start (failure(n) for the n-th) under
    run_forever for `minutes` of mock time; its starts and the ERROR lines logged."""
    starts = [0]

    async def loop() -> None:
        starts[0] += 1
        raise failure(starts[0])

    async def main() -> None:
        with trio.move_on_after(minutes * 60):
            hook = None if progress is None else lambda: progress(starts[0])
            await run_forever("the writer", loop, progress=hook)

    caplog.clear()
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    return starts[0], errors


def test_a_full_disk_is_one_error_line_then_a_summary_every_ten_minutes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The writer fails each restart while the disk stays full and nothing commits: one
    ERROR line when it starts, then one per REPEAT_SUMMARY (not one per restart, ~60 an
    hour at the backoff's ceiling); once a batch committed between two failures, the
    next failure is an ERROR line again, as is another failure."""
    full = lambda n: OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # noqa: E731
    starts, errors = _supervised_log(caplog, 60, full, progress=lambda n: 0)
    # 3,600 s: a summary at most every REPEAT_SUMMARY, at least every REPEAT_SUMMARY
    # plus a restart's backoff (60 s)
    most, least = 3600 // REPEAT_SUMMARY, 3600 // (REPEAT_SUMMARY + RESTART_MAX)
    assert starts > 60 and 1 + least <= len(errors) <= 1 + most, (starts, errors)
    assert "No space left on device" in errors[0] and "still fails" not in errors[0]
    assert all("still fails" in e and "No space left on device" in e for e in errors[1:])
    summed = sum(int(re.search(r"fails, (\d+) more times", e)[1]) for e in errors[1:])
    # they count the restarts between (those after the last summary are not said yet)
    assert starts - 1 - (REPEAT_SUMMARY + RESTART_MAX) // RESTART_MAX <= summed < starts

    # Recovered between failures (a batch committed: the count moved): each an ERROR.
    starts, errors = _supervised_log(caplog, 3, full, progress=lambda n: n)
    assert len(errors) == starts > 3
    # Another failure is said at once, and the first one again after it.
    other = lambda n: lmdb.MapFullError("x") if n == 3 else full(n)  # noqa: E731
    starts, errors = _supervised_log(caplog, 3, other, progress=lambda n: 0)
    assert len(errors) == 3 and "MapFullError" in errors[1], errors


@pytest.mark.slow
def test_the_enforcer_survives_a_failed_shrink(
    daemon: Daemon, bucket: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_shrink = daemon.writer.shrink
    failures = []

    async def shrink(dsid: int, target: int, lru: bool = False) -> int:
        if not failures:
            failures.append(dsid)
            raise lmdb.MapFullError("mdb_put: MDB_MAP_FULL")
        return await real_shrink(dsid, target, lru)

    monkeypatch.setattr(daemon.writer, "shrink", shrink)
    monkeypatch.setattr("silofs.node.supervise.RESTART_MIN", 0.05)

    async def main() -> None:
        async with running(daemon) as d:
            ds, m = await mounted(d, bucket)
            for name in ("f0.bin", "f1.bin", "f2.bin"):
                await d.get_chunk(m, name, 0, False)
            with trio.fail_after(10):
                while d.usage.get(ds.id) is None or d.usage[ds.id].bytes < 3 * (256 << 10):
                    await trio.sleep(0.01)
            await d.set_cache_allocation(ds.uri.canonical, 256 << 10)
            with trio.fail_after(20):
                while d.usage[ds.id].bytes > 256 << 10:
                    await trio.sleep(0.05)
            assert failures == [ds.id]

    trio.run(main)


# -- one daemon per cache dir, damaged envs ----------------------------------------------
def test_a_second_daemon_on_the_same_cache_dir_refuses(daemon: Daemon, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=f"another silofs daemon \\(pid {os.getpid()}\\)"):
        Daemon(settings(tmp_path))


def test_a_second_daemon_refused_leaves_the_first_ones_cache_modes(
    daemon: Daemon, tmp_path: Path
) -> None:
    """A second daemon on a running daemon's cache dir, with another socket_group (or
    none), refuses before it touches the directory: it set its own modes first, so
    socket_group = "root" against a private cache (0700) opened the cached bytes to that
    group (0750, 0640) while the first ran, and the reverse shut the first daemon's
    socket_group mounts out of its env."""
    cache = tmp_path / "cache"
    paths = (cache, cache / "data.mdb", cache / "lock.mdb")
    before = [(os.stat(p).st_mode, os.stat(p).st_gid) for p in paths]
    assert stat.S_IMODE(before[0][0]) == 0o700
    other = dataclasses.replace(settings(tmp_path), socket_group=grp.getgrgid(0).gr_name)
    with pytest.raises(UsageError, match="another silofs daemon"):
        Daemon(other)
    assert [(os.stat(p).st_mode, os.stat(p).st_gid) for p in paths] == before


def test_a_cache_dir_others_could_swap_is_refused(tmp_path: Path) -> None:
    """A directory on the way to the cache dir that others may write (not sticky) or
    that another uid owns lets them move the cache dir away and put their own in its
    place, whose env every later mount reads (listings and chunk values): refused in
    one line, as the socket's directory is. A sticky one (like /tmp) is fine."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UsageError, match=r"writable by others \(mode 0777, not sticky\)"):
        check_cache_dir(str(shared / "cache"))
    shared.chmod(0o1777)
    check_cache_dir(str(shared / "cache"))  # a sticky /tmp-like parent
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
        with pytest.raises(UsageError, match="owned by uid 65534"):
            check_cache_dir(str(theirs / "cache"))


def _lock_is_free(tmp_path: Path) -> bool:
    """Whether another open file description can take the cache dir's daemon lock now
    (flock locks belong to open file descriptions, so this process counts as another)."""
    fd = os.open(tmp_path / "cache" / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_the_lock_goes_with_the_daemon(tmp_path: Path) -> None:
    d = Daemon(settings(tmp_path))
    assert not _lock_is_free(tmp_path)  # held while the daemon lives
    lock_text = (tmp_path / "cache" / LOCK_FILE).read_text()
    assert lock_text == f"{os.getpid()}\n"  # names its holder for the refusal message
    d.store.close()
    os.close(d.lock_fd)
    assert _lock_is_free(tmp_path)  # and dropped with its fd
    again = Daemon(settings(tmp_path))
    assert not _lock_is_free(tmp_path)
    again.store.close()
    os.close(again.lock_fd)


def test_a_cache_with_damaged_meta_pages_is_moved_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    d = Daemon(settings(tmp_path))
    trio.run(d.writer.call, d.store.put_meta, "cache:file:///x/", 1 << 20)
    d.store.close()
    os.close(d.lock_fd)
    data = tmp_path / "cache" / "data.mdb"
    assert not meta_pages_damaged(str(data))  # a healthy env is never moved aside
    psize = os.sysconf("SC_PAGE_SIZE")
    with open(data, "r+b") as f:
        for page in (0, 1):  # both meta pages
            f.seek(page * psize + 16)
            f.write(bytes(b ^ 0xFF for b in f.read(64)).ljust(64, b"\xff"))
    fresh = Daemon(settings(tmp_path))
    try:
        assert fresh.allocs.cache == {}  # an empty cache
        broken = [p for p in (tmp_path / "cache").iterdir() if p.name.startswith("broken-")]
        assert len(broken) == 1 and (broken[0] / "data.mdb").exists()
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert len(errors) == 1 and "moved it to" in errors[0] and "\n" not in errors[0]
    finally:
        fresh.store.close()
        os.close(fresh.lock_fd)


# -- allocations ---------------------------------------------------------------------------
def test_concurrent_allocations_cannot_exceed_the_cache(daemon: Daemon) -> None:
    outcomes: dict[str, str] = {}

    async def put(uri: str) -> None:
        try:
            await daemon.set_cache_allocation(uri, 80 * MiB)
            outcomes[uri] = "ok"
        except UsageError:
            outcomes[uri] = "refused"

    async def main() -> None:
        async with running(daemon):
            async with trio.open_nursery() as n:
                n.start_soon(put, "file:///a/")
                n.start_soon(put, "file:///b/")

    trio.run(main)
    assert sorted(outcomes.values()) == ["ok", "refused"]
    assert sum(daemon.allocs.cache.values()) <= daemon.cache_size


def test_allocations_set_under_a_larger_cache_are_scaled_to_a_smaller_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Allocations persist; a restart with a smaller cache_size left them as set, so the
    allocated datasets were let hold (and kept) more than the whole cache, with no word
    of it, and none of them could be lowered (each PUT was refused while the others
    still exceeded the cache). Now one WARNING at start, each applied in proportion
    (evicted down to it), and lowering one is let through."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    ua, ub = f"file://{a}/", f"file://{b}/"
    d = Daemon(settings(tmp_path, cache_size=100 * MiB))

    async def allocate() -> None:
        async with running(d):
            await d.set_cache_allocation(ua, 60 * MiB)
            await d.set_cache_allocation(ub, 20 * MiB)

    trio.run(allocate)
    d.store.close()
    os.close(d.lock_fd)
    caplog.clear()
    small = Daemon(settings(tmp_path, cache_size=40 * MiB))
    try:
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 1 and "more than the cache (40.0MiB)" in warnings[0], warnings

        async def check() -> None:
            async with running(small) as sd:
                da, db = await ready(sd, ua), await ready(sd, ub)
                policy = sd.quota_policy()
                assert policy.quota(da.id, sd.usage) == 30 * MiB
                assert policy.quota(db.id, sd.usage) == 10 * MiB
                assert policy.quota(da.id, sd.usage) + policy.quota(db.id, sd.usage) <= 40 * MiB
                with pytest.raises(UsageError, match="more than the cache"):
                    await sd.set_cache_allocation(ub, 30 * MiB)  # raising one: refused
                await sd.set_cache_allocation(ua, 40 * MiB)  # lowering one: let through
                await sd.set_cache_allocation(ub, 0)
                assert sd.allocs.cache == {ua: 40 * MiB, ub: 0}
                assert sd.quota_policy().quota(da.id, sd.usage) == 40 * MiB  # fits again

        trio.run(check)
    finally:
        small.store.close()
        os.close(small.lock_fd)


# -- mounts --------------------------------------------------------------------------------
def test_a_dead_mount_is_reaped(daemon: Daemon, bucket: Path) -> None:
    async def main() -> None:
        async with running(daemon) as d:
            ds = await ready(d, f"file://{bucket}/")
            d.register_mount(ds, "j", "/mnt/x", 2**22 + 12345, os.getuid(), None)  # no such pid
            alive = d.register_mount(ds, "j", "/mnt/y", os.getpid(), os.getuid(), None)
            await d.reap_once()
            assert list(d.mounts) == [alive.id]

    trio.run(main)


def test_report_counts_deltas(daemon: Daemon, bucket: Path) -> None:
    async def main() -> None:
        async with running(daemon) as d:
            ds, m = await mounted(d, bucket)
            await d.report(m, MountCounters(bytes_read=100), [])
            await d.report(m, MountCounters(bytes_read=250), [])
            assert ds.reads.bytes_read == 250 and d.jobs["j"].reads.bytes_read == 250

    trio.run(main)


def test_a_mount_registering_again_with_its_id_is_the_same_mount(
    daemon: Daemon, bucket: Path
) -> None:
    async def main() -> None:
        async with running(daemon) as d:
            ds = await ready(d, f"file://{bucket}/")
            pid, uid = os.getpid(), os.getuid()
            m = d.register_mount(ds, "j", "/mnt/x", pid, uid, None, mount_id="00ff00ff00ff")
            await d.report(m, MountCounters(bytes_read=1000), [])
            # a slow answer made the mount give up and register again
            again = d.register_mount(ds, "j", "/mnt/x", pid, uid, None, mount_id="00ff00ff00ff")
            assert again is m and len(d.mounts) == 1
            await d.report(again, MountCounters(bytes_read=1500), [])
            assert d.jobs["j"].reads.bytes_read == 1500  # not 2500
            with pytest.raises(UsageError, match="taken"):
                d.register_mount(ds, "other", "/mnt/y", pid, uid, None, mount_id="00ff00ff00ff")

    trio.run(main)


# -- store errors and retries in status and /metrics ---------------------------------------
def test_retries_are_counted_per_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    from silofs.errors import TransientError
    from silofs.node.backends import base

    patch_time(monkeypatch, base, sleep=lambda _s: None)
    counters = base.StoreCounters()
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise TransientError("503 slow down")
        return "ok"

    assert base.retry_call(flaky, base.BackendOptions(), "t", counters) == "ok"
    assert counters.retries == 2


def test_store_errors_show_in_status_and_metrics(daemon: Daemon, bucket: Path) -> None:
    from silofs.node.metrics import render
    from silofs.node.views import dataset_view, status_view

    async def main() -> None:
        async with running(daemon) as d:
            missing = await ready(d, f"file://{bucket}-missing/")
            assert missing.state == "error"
            assert dataset_view(d, missing)["store_errors"] == 1
            ds, m = await mounted(d, bucket)
            (bucket / "f3.bin").unlink()  # gone after the listing: the GET fails
            with pytest.raises(Exception, match="f3.bin"):
                await d.get_chunk(m, "f3.bin", 0, False)
            view = dataset_view(d, ds)
            assert view["store_errors"] == 1 and view["store_retries"] == 0
            text = render(status_view(d))
            uri = ds.uri.canonical
            assert f'silofs_dataset_store_errors_total{{dataset="{uri}"}} 1' in text
            assert f'silofs_dataset_store_retries_total{{dataset="{uri}"}} 0' in text

    trio.run(main)


def test_an_offered_chunk_is_checked_against_the_listing_then_admitted(
    daemon: Daemon, bucket: Path
) -> None:
    async def main() -> None:
        async with running(daemon) as d:
            ds, m = await mounted(d, bucket)
            obj = listed(d, ds, "f1.bin")
            good = bytes([1]) * (256 << 10)
            with pytest.raises(UsageError, match="changed"):
                d.offer_chunk(m, "f1.bin", 0, "another-version", good)
            with pytest.raises(UsageError, match="not 10"):
                d.offer_chunk(m, "f1.bin", 0, obj.content_id, b"x" * 10)
            with pytest.raises(UsageError, match="no chunk 9"):
                d.offer_chunk(m, "f1.bin", 9, obj.content_id, good)
            with pytest.raises(UsageError, match="not in the listing"):
                d.offer_chunk(m, "nope.bin", 0, obj.content_id, good)
            assert d.offer_chunk(m, "f1.bin", 0, obj.content_id, good) == "queued"
            with trio.fail_after(10):
                while d.usage.get(ds.id) is None or d.usage[ds.id].chunks < 1:
                    await trio.sleep(0.01)
            assert d.offer_chunk(m, "f1.bin", 0, obj.content_id, good) == "present"
            data, source = await d.get_chunk(m, "f1.bin", 0, False)
            assert data == good and source == "cache"
            assert ds.fetch.remote_gets == 0

    trio.run(main)


def test_the_writer_is_restarted_after_a_failed_batch(
    daemon: Daemon, bucket: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_admit = daemon.store.admit
    failures = []

    def admit(*args: object) -> object:
        if not failures:
            failures.append(1)
            raise lmdb.MapFullError("mdb_put: MDB_MAP_FULL")
        return real_admit(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(daemon.store, "admit", admit)
    monkeypatch.setattr("silofs.node.supervise.RESTART_MIN", 0.05)

    async def main() -> None:
        async with running(daemon) as d:
            ds, m = await mounted(d, bucket)
            await d.get_chunk(m, "f0.bin", 0, False)  # its batch fails: lost, not fatal
            with trio.fail_after(10):
                while not failures:
                    await trio.sleep(0.01)
            await d.get_chunk(m, "f1.bin", 0, False)  # offered to the restarted writer
            with trio.fail_after(10):
                while d.usage.get(ds.id) is None or d.usage[ds.id].chunks < 1:
                    await trio.sleep(0.01)

    trio.run(main)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0].startswith("writer failed: MapFullError")


# -- job registrations (a Slurm prolog) ----------------------------------------------------
def test_a_job_registration_survives_a_restart_and_goes_when_the_job_is_forgotten(
    tmp_path: Path, bucket: Path
) -> None:
    info = {"gpus": 4, "ideal_io": 10**8, "datasets": [f"file://{bucket}/"], "nodes": ["n1"]}

    async def register(d: Daemon) -> None:
        async with running(d):
            await d.register_job("slurm-7", info)
            assert "slurm-7" in d.jobs  # listed in status before it mounts

    async def forget(d: Daemon) -> None:
        async with running(d):
            d.job("slurm-7")
            d.job("idle")
            d.forget_idle_jobs(keep=0)  # a registered job is not idle
            assert "slurm-7" in d.jobs and "idle" not in d.jobs
            ds = await ready(d, f"file://{bucket}/")
            m = d.register_mount(ds, "slurm-7", "/mnt/x", os.getpid(), os.getuid(), None)
            with pytest.raises(UsageError, match="unmount it first"):
                await d.forget_job("slurm-7")
            d.mounts.pop(m.id)
            await d.forget_job("slurm-7")
            assert "slurm-7" not in d.allocs.registrations

    d = Daemon(settings(tmp_path))
    trio.run(register, d)
    d.store.close()
    os.close(d.lock_fd)
    d = Daemon(settings(tmp_path))  # a restart: the registration is read back
    try:
        assert d.allocs.registrations == {"slurm-7": info}
        trio.run(forget, d)
    finally:
        d.store.close()
        os.close(d.lock_fd)
    d = Daemon(settings(tmp_path))
    try:
        assert d.allocs.registrations == {}
    finally:
        d.store.close()
        os.close(d.lock_fd)


@pytest.mark.parametrize("pages", [2, 12, 16])
def test_a_truncated_cache_is_moved_aside(tmp_path: Path, pages: int) -> None:
    """data.mdb cut short while no daemon ran (a copy that ran out of room, a truncate):
    its meta pages name pages past its end, which LMDB maps anyway. The first read of
    one was a SIGBUS (or an LMDB assertion: abort) that ended the daemon with no error
    to catch, and a cut that left the trees' pages in the file made the daemon grow it
    back with zeros (its sparse map) and end in a traceback from load_usage. Now moved
    aside, one ERROR line. Run in a child, so that a crash fails the test, not the run."""
    d = Daemon(settings(tmp_path))
    for i in range(300):  # enough txns that the dbs' pages reach past the cuts
        trio.run(d.writer.call, d.store.put_meta, f"cache:file:///x{i}/", 1 << 20)
    d.store.close()
    os.close(d.lock_fd)
    data = tmp_path / "cache" / "data.mdb"
    with open(data, "r+b") as f:
        f.truncate(pages * os.sysconf("SC_PAGE_SIZE") + 100)
    code = (
        "import logging\n"
        "logging.basicConfig(format='%(levelname)s %(message)s')\n"
        "from pathlib import Path\n"
        "from silofs.node.daemon import Daemon\n"
        "from tests.unit.inprocess import settings\n"
        f"d = Daemon(settings(Path({str(tmp_path)!r})))\n"
        "assert d.allocs.cache == {}, d.allocs.cache\n"
        "print('started')\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert res.returncode == 0 and "started" in res.stdout, (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("ERROR ")]
    assert len(errors) == 1 and "not a whole LMDB file" in errors[0], res.stderr
    broken = [p for p in (tmp_path / "cache").iterdir() if p.name.startswith("broken-")]
    assert len(broken) == 1 and (broken[0] / "data.mdb").exists()
