"""A job's epoch as the controller and the simulator count it: one dataset's worth of
bytes read, whatever files were read.

Owns Daemon.report's epoch rule, tested on a real Daemon (a real LMDB env in tmp_path)
without FUSE or a socket: a job reading a subset of the files still advances, a
one-shard dataset read in many opens advances once per shard's worth, and the
effective cache is what was cached when the epoch began.
"""

from __future__ import annotations

from pathlib import Path

import trio

from silofs.cache.store import Usage
from silofs.config import NodeSettings
from silofs.node.daemon import Daemon
from silofs.node.state import DatasetState, MountState
from silofs.records import MountCounters
from silofs.uri import parse_uri

SIZE = 10_000


def _daemon(tmp_path: Path) -> Daemon:
    settings = NodeSettings(
        socket=str(tmp_path / "ctl.sock"), cache_dir=str(tmp_path / "cache"), cache_size=64 << 20
    )
    return Daemon(settings)


def _run(tmp_path: Path, reads: list[int]) -> list[int]:
    """Epochs of the job after each cumulative mount report of `reads` bytes."""
    out: list[int] = []

    async def main() -> None:
        d = _daemon(tmp_path)
        ds = DatasetState(1, parse_uri(str(tmp_path)), "data", backend=None)  # type: ignore[arg-type]
        ds.record = {"size": SIZE, "objects": 1}
        d.datasets[1] = ds
        m = MountState("m1", "job", 1, "/mnt", 1, 0, 4 << 20)
        total = 0
        for n in reads:
            total += n
            await d.report(m, MountCounters(bytes_read=total), [])
            out.append(d.jobs["job"].epoch)
        d.store.close()

    trio.run(main)
    return out


def test_an_epoch_is_one_dataset_of_bytes_read(tmp_path: Path) -> None:
    # A job reading a subset (a tenth each report) advances after ten reports.
    assert _run(tmp_path, [SIZE // 10] * 25) == [0] * 9 + [1] * 10 + [2] * 6


def test_one_shard_read_in_many_opens_advances_once_per_shard(tmp_path: Path) -> None:
    # Four readers of the same shard, each reading a quarter: one epoch, not four.
    assert _run(tmp_path, [SIZE // 4] * 4) == [0, 0, 0, 1]


def test_the_effective_cache_is_what_was_cached_when_the_epoch_began(tmp_path: Path) -> None:
    async def main() -> None:
        d = _daemon(tmp_path)
        ds = DatasetState(1, parse_uri(str(tmp_path)), "data", backend=None)  # type: ignore[arg-type]
        ds.record = {"size": SIZE, "objects": 1}
        d.datasets[1] = ds
        m = MountState("m1", "job", 1, "/mnt", 1, 0, 4 << 20)
        d.usage[1] = Usage(3000, 1)
        await d.report(m, MountCounters(bytes_read=100), [])
        job = d.jobs["job"]
        assert job.epoch == 0 and d.effective_cache(job) == 0  # nothing cached at its start
        d.usage[1] = Usage(6000, 2)
        await d.report(m, MountCounters(bytes_read=SIZE), [])
        assert job.epoch == 1 and d.effective_cache(job) == 6000
        d.usage[1] = Usage(2000, 1)  # shrunk during the epoch: only what is left counts
        assert d.effective_cache(job) == 2000
        d.store.close()

    trio.run(main)
