"""bench/throughput.py: the ceilings are placed as a mount process is, the serving
thread's sleeps are counted from the right thread and fields, and which mounts a
pass keeps (--no-remount) or restarts, and that without --keep a run removes only the
data it wrote."""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import pytest

_BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def throughput() -> Any:
    sys.path.insert(0, str(_BENCH))
    try:
        import throughput as module
    finally:
        sys.path.remove(str(_BENCH))
    return module


class _Started:
    """What Ceiling.__enter__ sees of the process it starts: its first line, "ready"."""

    started: list[dict[str, Any]] = []

    def __init__(self, args: list[str], **kwargs: Any) -> None:
        self.started.append(kwargs)
        self.stdout = io.StringIO("ready\n")
        self.pid = 1

    def terminate(self) -> None:
        pass

    def wait(self, timeout: float | None = None) -> int:
        return 0


@pytest.mark.parametrize("own_session", [True, False])
def test_a_ceiling_starts_in_the_readers_session_unless_asked(
    throughput: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, own_session: bool
) -> None:
    # The contract's ceiling is the best placement known: in the readers' session, where
    # with the kernel's autogroups a reply's wakeup preempts it (a mount process runs in
    # a session of its own, `silofs mount`; --own-session-ceiling shows that placement).
    _Started.started = []
    monkeypatch.setattr(throughput.subprocess, "Popen", _Started)
    mp = str(tmp_path / "mnt")
    if own_session:
        ceiling = throughput.Ceiling(tmp_path, mp, loop="turns", own_session=True)
    else:
        ceiling = throughput.Ceiling(tmp_path, mp, loop="turns")
    with ceiling:
        pass
    assert [k.get("start_new_session") for k in _Started.started] == [own_session]


@contextmanager
def _child(code: str) -> Iterator[tuple[subprocess.Popen, IO[str], IO[str]]]:
    """A Python process of its own running `code`, talking over its stdin and stdout;
    closing its stdin ends it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        yield proc, proc.stdin, proc.stdout
    finally:
        proc.stdin.close()
        proc.wait(10)


def test_sleeps_are_counted_for_the_main_thread(throughput: Any) -> None:
    # A process of its own (with no children: the first child's main thread would be
    # counted, as a mount's serving process is), whose main thread sleeps 50 times
    # between the two readings.
    code = (
        "import sys, time\n"
        "print('go', flush=True); sys.stdin.readline()\n"
        "[time.sleep(0.001) for _ in range(50)]\n"
        "print('done', flush=True); sys.stdin.read()\n"
    )
    with _child(code) as (proc, stdin, stdout):
        assert stdout.readline().strip() == "go"
        before = throughput.thread_switches(proc.pid)
        stdin.write("\n")
        stdin.flush()
        assert stdout.readline().strip() == "done"
        after = throughput.thread_switches(proc.pid)
        assert after[0] - before[0] >= 50
        assert after[1] >= before[1]


def test_a_process_that_sleeps_in_another_thread_is_not_counted(throughput: Any) -> None:
    # Only the main thread serves FUSE requests: a worker thread's sleeps are not its.
    code = (
        "import sys, threading, time\n"
        "t = threading.Thread(target=lambda: [time.sleep(0.001) for _ in range(200)])\n"
        "t.start(); t.join(); print('done', flush=True); sys.stdin.read()\n"
    )
    with _child(code) as (proc, _, stdout):
        assert stdout.readline().strip() == "done"
        slept, _ = throughput.thread_switches(proc.pid)
        assert slept < 100  # the thread's 200 sleeps are not the main thread's


def test_a_gone_process_has_no_switches(throughput: Any) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(10)
    assert throughput.thread_switches(proc.pid) == (0, 0)


class _Mount:
    """What ready() sees of a Mount: its pid (0 when unmounted), open and close."""

    def __init__(self, name: str, log: list[str], pid: int = 0) -> None:
        self.name, self.log, self.pid = name, log, pid
        self.starts = 0

    def open(self) -> None:
        self.starts += 1
        self.pid = 100 + self.starts
        self.log.append(f"open {self.name}")

    def close(self) -> None:
        if self.pid:
            self.log.append(f"close {self.name}")
        self.pid = 0

    def fresh(self) -> None:
        self.close()
        self.open()


def _alternate(throughput: Any, keep: bool, passes: int) -> tuple[list[str], _Mount, _Mount]:
    log: list[str] = []
    ours, theirs = _Mount("ours", log, pid=7), _Mount("theirs", log, pid=9)
    for i in range(passes):
        this, other = (ours, theirs) if i % 2 == 0 else (theirs, ours)
        throughput.ready(this, other, keep)
        assert this.pid, "the pass's mount is mounted"
        log.append(f"pass {this.name} pid {this.pid}")
    return log, ours, theirs


def test_kept_mounts_serve_every_pass_side_by_side(throughput: Any) -> None:
    # --no-remount --git-rev: one mount of each tree for all its passes, both mounted.
    log, ours, theirs = _alternate(throughput, keep=True, passes=6)
    assert log == ["pass ours pid 7", "pass theirs pid 9"] * 3
    assert (ours.pid, theirs.pid) == (7, 9)


def test_without_keep_each_pass_is_a_fresh_mount_alone(throughput: Any) -> None:
    # The SSD-warm default: the other tree's mount is gone and this one restarted, so no
    # process holds the LMDB pages mapped across drop_caches.
    log, ours, theirs = _alternate(throughput, keep=False, passes=4)
    assert log == [
        "close theirs",
        "close ours",
        "open ours",
        "pass ours pid 101",
        "close ours",
        "open theirs",
        "pass theirs pid 101",
        "close theirs",
        "open ours",
        "pass ours pid 102",
        "close ours",
        "open theirs",
        "pass theirs pid 102",
    ]


def test_a_kept_mount_that_is_down_is_opened_once(throughput: Any) -> None:
    log: list[str] = []
    ours = _Mount("ours", log)
    for _ in range(3):
        throughput.ready(ours, None, True)
    assert log == ["open ours"] and ours.pid == 101


def test_a_pass_runs_its_warm_step_after_the_drop_and_before_the_clock(
    throughput: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A kept mount's pass re-reads data.mdb after drop_caches (the values it copies out
    # by preadv are mapped by no process, so the drop takes them), untimed: the read of
    # the files comes after it.
    log: list[str] = []
    monkeypatch.setattr(throughput, "drop_caches", lambda: log.append("drop"))

    def read(paths: list[str], readers: int) -> tuple[float, int]:
        log.append("read")
        return 1.0, 10

    monkeypatch.setattr(throughput, "read_files", read)
    p = throughput.small_pass(["a", "b"], 1, None, lambda: log.append("warm"))
    assert log == ["drop", "warm", "read"]
    assert p.secs == 1.0
    log.clear()
    throughput.small_pass(["a"], 1, None)
    assert log == ["drop", "read"]


def _bench_common() -> Any:
    sys.path.insert(0, str(_BENCH))
    try:
        import common as module
    finally:
        sys.path.remove(str(_BENCH))
    return module


def test_rewarm_reads_the_data_of_a_sparse_file_and_skips_its_holes(tmp_path: Path) -> None:
    # data.mdb is as large as the LMDB map and mostly holes: rewarm reads the data only.
    common = _bench_common()
    path = tmp_path / "sparse"
    block = bytes(range(256)) * 256  # 64 KiB
    with open(path, "wb") as f:
        f.write(block)
        f.seek(8 << 20)
        f.write(block)
        f.truncate(64 << 20)
    assert common.rewarm(path) == 2 * len(block)


def test_rewarm_of_an_empty_file_reads_nothing(tmp_path: Path) -> None:
    common = _bench_common()
    path = tmp_path / "empty"
    path.write_bytes(b"")
    assert common.rewarm(path) == 0


def _files_under(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*")}


def test_without_keep_a_reused_dataset_and_the_users_dir_are_left(
    throughput: Any, tmp_path: Path
) -> None:
    """--data-dir may be shared: a dataset an earlier run left (with its marker) and the
    user's own files in it are not this run's to remove."""
    base = tmp_path / "mine"
    base.mkdir()
    (base / "notes.txt").write_text("the user's")
    with throughput.dataset(base, 0, 2, keep=True) as d:
        assert len(list((d / "small").iterdir())) == 2
    before = _files_under(base)
    with throughput.dataset(base, 0, 2, keep=False) as again:
        assert again == d
    assert _files_under(base) == before


def test_without_keep_a_dataset_this_run_wrote_is_removed_with_its_marker(
    throughput: Any, tmp_path: Path
) -> None:
    base = tmp_path / "shared"
    base.mkdir()
    (base / "notes.txt").write_text("the user's")
    with throughput.dataset(base, 0, 1, keep=True) as other:  # another size, kept
        pass
    with throughput.dataset(base, 0, 2, keep=False) as d:
        assert d.is_dir() and d != other
    assert sorted(_files_under(base)) == sorted(
        ["notes.txt", other.name, f"{other.name}.complete", f"{other.name}/small"]
        + [f"{other.name}/big.bin", f"{other.name}/small/000000.bin"]
    )


def test_an_empty_data_dir_is_removed_only_if_the_run_made_it(
    throughput: Any, tmp_path: Path
) -> None:
    existing = tmp_path / "existing"
    existing.mkdir()
    with throughput.dataset(existing, 0, 1, keep=False):
        pass
    assert existing.is_dir() and not any(existing.iterdir())
    made = tmp_path / "made" / "here"
    with throughput.dataset(made, 0, 1, keep=False):
        pass
    assert not made.exists()


def test_an_interrupted_write_is_removed_without_keep(
    throughput: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(base: Path, size_mb: int, files: int) -> Path:
        d = throughput.dataset_dir(base, size_mb, files)
        (d / "small").mkdir(parents=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(throughput, "ensure_data", interrupted)
    base = tmp_path / "d"
    base.mkdir()
    with pytest.raises(KeyboardInterrupt), throughput.dataset(base, 0, 1, keep=False):
        pass
    assert not any(base.iterdir())
