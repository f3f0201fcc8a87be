"""How long a mount takes to end: `silofs unmount`, SIGTERM to the mount process and
`fusermount3 -u` each finish within the bound docs/SEMANTICS.md states, with readers
holding files open and a cold read in flight behind a store that does not answer (a
fault proxy delaying every ranged GET), and with a daemon that is frozen or gone.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from silofs.pids import pid_alive
from tests.support.faultproxy import Fault, FaultPlan, FaultProxy
from tests.support.fixtures import needs_fuse
from tests.support.node import Node, mounted
from tests.support.poll import wait_for

pytestmark = [needs_fuse, pytest.mark.fuse]

# The stated bounds (docs/SEMANTICS.md, "Unmounting"), with room for a loaded host.
EXIT_BOUND = 15.0
STALL = 120.0  # the store's silence: longer than any bound here


class BlockedRead:
    """A thread reading a cold file through the mount; its result or error, once done."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        self.error: OSError | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            os.pread(self.fd, 1 << 20, 20 << 20)
        except OSError as exc:
            self.error = exc
        finally:
            self.done.set()

    def close(self) -> None:
        self.done.wait(EXIT_BOUND)
        try:
            os.close(self.fd)
        except OSError as exc:  # the mount's connection is gone: its FLUSH fails
            assert exc.errno == errno.ENOTCONN


@pytest.fixture
def stalled(make_node, s3_server, monkeypatch, bucket_name, tmp_path: Path) -> Iterator:
    """(node, mountpoint, proxy): a mount of a moto bucket whose ranged GETs the proxy
    holds for STALL seconds once set_plan(STALLED) is given."""
    s3_server.apply_env(monkeypatch)
    s3_server.create(bucket_name, {f"f{i}.bin": os.urandom(24 << 20) for i in range(3)})
    up = urlsplit(s3_server.endpoint_url)
    with FaultProxy(upstream=(up.hostname or "127.0.0.1", up.port or 80), faults=FaultPlan()) as p:
        node: Node = make_node(cache_size="64M")
        mp = node.mount(s3_server.uri(bucket_name), tmp_path / "mnt", "--endpoint-url", p.url)
        p.set_plan(STALLED)
        yield node, mp, p


STALLED = FaultPlan(faults=[Fault("delay", methods="GET", seconds=STALL)])


def _stall_a_read(mp: Path, proxy: FaultProxy) -> BlockedRead:
    reader = BlockedRead(mp / "f2.bin")
    proxy.wait_stats(lambda s: s.get("delay", 0) >= 1, timeout=30)
    assert not reader.done.is_set()
    return reader


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_an_idle_mount_process_unmounts_it(make_node, tmp_path: Path, sig) -> None:
    """kill (or Ctrl-C of a foreground mount) leaves no dead mountpoint behind: the
    directory is a plain directory again, not ENOTCONN until someone unmounts it."""
    (tmp_path / "bucket").mkdir()
    (tmp_path / "bucket" / "a.txt").write_bytes(b"a")
    node: Node = make_node(cache_size="64M")
    mp = node.mount(str(tmp_path / "bucket"), tmp_path / "mnt")
    assert (mp / "a.txt").read_bytes() == b"a"
    pid = node.mount_pid(mp)
    os.kill(pid, sig)
    wait_for(lambda: not pid_alive(pid), timeout=EXIT_BOUND, what="the mount process's exit")
    assert not mounted(mp)
    assert os.listdir(mp) == []  # the empty directory under it, not ENOTCONN


def test_sigterm_ends_a_mount_with_a_cold_read_in_flight(stalled) -> None:
    node, mp, proxy = stalled
    pid = node.mount_pid(mp)
    reader = _stall_a_read(mp, proxy)
    try:
        start = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: not pid_alive(pid), timeout=EXIT_BOUND, what="the mount process's exit")
        elapsed = time.monotonic() - start
        assert reader.done.wait(5), "the blocked read still waits after the mount ended"
        assert reader.error is not None
        assert reader.error.errno in (errno.ENOTCONN, errno.EIO, errno.EINTR, errno.ECONNABORTED)
    finally:
        _kill(pid)  # never leave a mount no request reaches for the teardown to stat
        reader.close()
    assert not mounted(mp)
    print(f"exit {elapsed:.1f}s after SIGTERM")


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _silofs_unmount(node: Node, mp: Path, *args: str) -> tuple[int, str, float]:
    start = time.monotonic()
    res = node.run("unmount", str(mp), "--socket", node.socket, *args, timeout=60)
    return res.returncode, res.stderr.strip(), time.monotonic() - start


def test_unmount_with_a_cold_read_in_flight_says_busy_then_detaches_in_bounded_time(
    stalled,
) -> None:
    node, mp, proxy = stalled
    pid = node.mount_pid(mp)
    reader = _stall_a_read(mp, proxy)
    try:
        code, err, elapsed = _silofs_unmount(node, mp)
        assert code == 1 and err.startswith(f"silofs: error: cannot unmount {mp}: "), err
        assert "busy" in err and len(err.splitlines()) == 1
        assert err.endswith("or `silofs unmount --lazy` to detach now)"), err  # what next
        assert elapsed < EXIT_BOUND and mounted(mp) and not reader.done.is_set()
        code, err, elapsed = _silofs_unmount(node, mp, "--lazy")
        assert code == 0 and elapsed < EXIT_BOUND + 5, (err, elapsed)
        assert err == (
            f"silofs: detached {mp}; its mount process {pid} ends when the files open "
            "in it are closed"
        )
        assert not mounted(mp) and pid_alive(pid)  # lazily: still serving the open file
        os.kill(pid, signal.SIGTERM)  # what `silofs end-job` sends next
        wait_for(lambda: not pid_alive(pid), timeout=EXIT_BOUND, what="the mount process's exit")
        assert reader.done.wait(5) and reader.error is not None
    finally:
        _kill(pid)
        reader.close()


def test_unmount_with_the_daemon_frozen_or_gone_still_waits_for_the_process(
    make_node, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.bin").write_bytes(os.urandom(1 << 20))
    node: Node = make_node()
    frozen = node.mount(str(data), tmp_path / "frozen")
    gone = node.mount(str(data), tmp_path / "gone")
    pids = {mp: node.mount_pid(mp) for mp in (frozen, gone)}
    assert node.proc is not None
    node.proc.send_signal(signal.SIGSTOP)
    try:
        code, err, elapsed = _silofs_unmount(node, frozen)
    finally:
        node.proc.send_signal(signal.SIGCONT)
    assert (code, err) == (0, f"silofs: unmounted {frozen}") and elapsed < EXIT_BOUND
    assert not pid_alive(pids[frozen]) and not mounted(frozen)
    node.kill9()
    code, err, elapsed = _silofs_unmount(node, gone)
    assert (code, err) == (0, f"silofs: unmounted {gone}") and elapsed < EXIT_BOUND
    assert not pid_alive(pids[gone]) and not mounted(gone)


def test_unmount_of_a_stopped_mount_process_returns_and_says_it_still_runs(
    make_node, tmp_path: Path
) -> None:
    """A mount whose process answers nothing: `silofs unmount` must not ask it anything
    (a stat of the mountpoint would hang) and must say the process is still there."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.bin").write_bytes(b"x" * 4096)
    node: Node = make_node()
    mp = node.mount(str(data), tmp_path / "m", "--metadata-ttl", "1")
    pid = node.mount_pid(mp)
    os.kill(pid, signal.SIGSTOP)
    time.sleep(1.5)  # not a wait for anything: the kernel's attributes of the root expire
    try:
        code, err, elapsed = _silofs_unmount(node, mp)
        assert code == 0 and elapsed < EXIT_BOUND + 5, (err, elapsed)
        assert err == (
            f"silofs: unmounted {mp}; its mount process {pid} is still running after 10s"
        )
        assert not mounted(mp)
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: not pid_alive(pid), timeout=EXIT_BOUND, what="the mount process's exit")


@pytest.fixture
def other_namespace() -> Iterator[Callable[[], None]]:
    """start() runs a process in a new mount namespace: a copy of every mount there is
    then, which the kernel keeps (and with it each FUSE connection) while it lives."""
    procs: list[subprocess.Popen] = []

    def start() -> None:
        proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sleep", "300"],
            stdout=subprocess.DEVNULL,
        )
        procs.append(proc)
        own = os.readlink("/proc/self/ns/mnt")
        wait_for(lambda: os.readlink(f"/proc/{proc.pid}/ns/mnt") != own, what="the new namespace")

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("processes", ["1", "2"])
def test_a_copy_in_another_mount_namespace_does_not_keep_an_unmounted_mount(
    make_node, tmp_path: Path, other_namespace, processes: str
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.bin").write_bytes(os.urandom(1 << 20))
    node: Node = make_node()
    mp = node.mount(str(data), tmp_path / "m", "--serve-processes", processes)
    pid = node.mount_pid(mp)
    assert (mp / "a.bin").read_bytes()  # a file opened and closed: no handle left
    other_namespace()
    code, err, elapsed = _silofs_unmount(node, mp)
    assert (code, err) == (0, f"silofs: unmounted {mp}") and elapsed < EXIT_BOUND
    assert not pid_alive(pid) and not mounted(mp)


def test_a_detached_mount_serves_its_open_file_then_ends_when_it_is_closed(
    make_node, tmp_path: Path, other_namespace
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    body = os.urandom(1 << 20)
    (data / "a.bin").write_bytes(body)
    node: Node = make_node()
    mp = node.mount(str(data), tmp_path / "m")
    pid = node.mount_pid(mp)
    other_namespace()
    held = os.open(mp / "a.bin", os.O_RDONLY)
    try:
        code, err, _ = _silofs_unmount(node, mp, "--lazy")
        assert code == 0 and err.startswith(f"silofs: detached {mp}; "), err
        assert not mounted(mp) and pid_alive(pid)
        os.posix_fadvise(held, 0, 0, os.POSIX_FADV_DONTNEED)
        assert os.pread(held, len(body), 0) == body  # still served
    finally:
        os.close(held)
    wait_for(lambda: not pid_alive(pid), timeout=EXIT_BOUND, what="the mount process's exit")
