"""A read waiting on its job's remote IO allocation stays a well-behaved POSIX read.

`allocate-io JOB 0` pauses a job's misses (promise 2); a reader waiting under it must
still die when it is killed (SIGKILL, SIGTERM) and raise KeyboardInterrupt on Ctrl-C
(SIGINT), within a few seconds, leaving nothing behind in the mount or the daemon: no
waiter in the job's limiter, no byte charged for the abandoned read, other readers of
the job still waiting and served at the raise (docs/SEMANTICS.md, promise 2).
"""

from __future__ import annotations

import random
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from silofs.control.client import ControlClient, quote_segment
from tests.support.fixtures import needs_fuse
from tests.support.node import Node
from tests.support.poll import wait_for

pytestmark = [needs_fuse, pytest.mark.fuse]

SIZE = 300_000  # one chunk each: a read is one miss, charged once

# A reader the way a training script is one: a Python process reading a file.
READER = """
import sys
with open(sys.argv[1], "rb") as f:
    data = f.read()
sys.stdout.write(str(len(data)))
"""
# One that asks the kernel not to use its page cache: its read is a FUSE request it
# waits on itself (uninterruptible once sent: SIGKILL alone never ended it).
DIRECT_READER = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECT)
buf = mmap.mmap(-1, 1 << 20)  # page-aligned
sys.stdout.write(str(os.readv(fd, [buf])))
"""


def put_io(node: Node, job: str, rate: int | None) -> None:
    node.request("PUT", f"/v1/jobs/{quote_segment(job)}/io", {"bytes_per_s": rate})


def in_read(pid: int) -> bool:
    """Whether `pid`'s main thread is blocked in read(2) or readv(2) (x86_64: 0, 19)."""
    try:
        return Path(f"/proc/{pid}/syscall").read_text().split()[0] in ("0", "19")
    except (OSError, IndexError):
        return False


def waiting(node: Node, job: str) -> int:
    return node.job_status(job)["limiter_waiting"]


@pytest.fixture(params=[1, 2], ids=["one-process", "serve-processes-2"])
def paused(request, make_node, local_store, monkeypatch, bucket_name, tmp_path: Path):
    """A mount of job j paused by allocate-io 0, a.bin cached before the pause; with
    --serve-processes 2 a read may land in a process other than its open's."""
    local_store.apply_env(monkeypatch)
    files = {f"{n}.bin": random.Random(n).randbytes(SIZE) for n in "abc"}
    local_store.create(bucket_name, files)
    node = make_node()
    extra = ("--serve-processes", str(request.param)) if request.param > 1 else ()
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "mnt", "--job", "j", *extra)
    assert (mp / "a.bin").read_bytes() == files["a.bin"]
    put_io(node, "j", 0)
    return node, mp, files


def start_reader(mp: Path, name: str, direct: bool) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", DIRECT_READER if direct else READER, str(mp / name)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "O_DIRECT"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=str)
def test_a_reader_signalled_while_paused_ends_and_leaves_nothing_behind(
    paused, sig: signal.Signals, direct: bool
) -> None:
    node, mp, files = paused
    base = node.job_status("j")["limiter_charged_bytes"]  # a.bin's, before the pause
    reader = start_reader(mp, "b.bin", direct)
    got: list[bytes] = []
    other = threading.Thread(target=lambda: got.append((mp / "c.bin").read_bytes()))
    try:
        wait_for(lambda: in_read(reader.pid), 10, what="the reader to block in read()")
        # The mount looks at a waiting read's process once it waited 0.25 s (a process
        # gone before that first look is not taken for the reader: mount/waits.py).
        wait_for(
            lambda: node.job_status("j")["limiter_oldest_wait_s"] >= 1,
            10,
            what="the reader to wait a second",
        )
        # Another reader of the same job, waiting too: it must not be disturbed.
        other.start()
        wait_for(lambda: waiting(node, "j") == 2, 10, what="both readers to wait")
        reader.send_signal(sig)
        # Ends within a few seconds (the mount looks at waiting reads every 0.25 s).
        wait_for(lambda: reader.poll() is not None, 10, what=f"the reader to end on {sig!r}")
    finally:
        if reader.poll() is None:
            reader.kill()
        _, err = reader.communicate(timeout=30)
    # Python ends on an uncaught KeyboardInterrupt by SIGINT too, after its traceback.
    assert reader.returncode == -sig, (reader.returncode, err)
    assert ("KeyboardInterrupt" in err) == (sig == signal.SIGINT), err
    # Its wait left the daemon's limiter; the other reader still waits, unserved.
    wait_for(lambda: waiting(node, "j") == 1, 10, what="the ended reader's wait to go")
    assert other.is_alive() and not got
    assert node.job_status("j")["limiter_charged_bytes"] == base
    put_io(node, "j", None)
    other.join(30)
    assert got == [files["c.bin"]]
    # Nothing was fetched for the reader that went: only c's bytes were charged.
    assert node.job_status("j")["limiter_charged_bytes"] == base + SIZE
    # The file it was reading reads right, and is charged once.
    assert (mp / "b.bin").read_bytes() == files["b.bin"]
    assert node.job_status("j")["limiter_charged_bytes"] == base + 2 * SIZE
    assert waiting(node, "j") == 0
    assert (mp / "a.bin").read_bytes() == files["a.bin"]  # hits were served throughout
    # Counted in the mount's status (each serving process reports within 0.25 s).
    wait_for(
        lambda: node.mount_status(mp)["interrupted_reads"] >= 1,
        10,
        what="the mount to count the ended read",
    )


def test_a_paused_jobs_waiting_reader_shows_in_status(paused) -> None:
    """Not silent: `silofs-ctl status` shows the job's waiting fetch and its age, and
    /metrics the gauge; the raise serves it."""
    node, mp, files = paused
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append((mp / "b.bin").read_bytes()))
    reader.start()
    wait_for(lambda: waiting(node, "j") == 1, 10, what="the reader to wait")
    res = subprocess.run(
        [sys.executable, "-m", "silofs_ctl", "status", "--socket", node.socket],
        capture_output=True,
        text=True,
        timeout=60,
        env=node.env,
    )
    assert res.returncode == 0, res.stderr
    header = next(line for line in res.stdout.splitlines() if "limiter wait" in line)
    row = next(line for line in res.stdout.splitlines() if line.split()[:1] == ["j"])
    assert "waiting" in header.split("limiter wait", 1)[1], header
    assert re.search(r"\s1 \(\d+(\.\d)?s\)\s", row), row  # one fetch waiting, and its age
    with ControlClient(node.socket) as c:
        _, _, body = c.request_raw("GET", "/metrics")
    assert re.search(r'^silofs_job_limiter_waiting\{job="j"\} 1(\.0)?$', body.decode(), re.M)
    assert 'silofs_job_limiter_oldest_wait_seconds{job="j"}' in body.decode()
    put_io(node, "j", None)
    reader.join(30)
    assert got == [files["b.bin"]]


# A parent that opens the file and hands it to a child as its stdin (subprocess's
# stdin=f, a fork after open): the child is the reader; the parent, the file's opener,
# only waits. The child calls read(2) itself, as C programs do: Python would retry a
# read that ended with EINTR (PEP 475), and coreutils' cat too; a reader that does not
# fails, as the child here does (exit 1, errno on stderr).
CHILD_READER = """
import ctypes, fcntl, mmap, os, sys
if sys.argv[1] == "O_DIRECT":  # its read is then the FUSE request: an EINTR reaches it
    fcntl.fcntl(0, fcntl.F_SETFL, fcntl.fcntl(0, fcntl.F_GETFL) | os.O_DIRECT)
libc = ctypes.CDLL(None, use_errno=True)
buf = mmap.mmap(-1, 1 << 20)  # page-aligned
addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
while (n := libc.read(0, ctypes.c_void_p(addr), len(buf))) != 0:
    if n < 0:
        sys.exit(f"read: {os.strerror(ctypes.get_errno())}")
    sys.stdout.buffer.write(buf[:n])
"""
PARENT_OF_READER = """
import signal, subprocess, sys, time
signal.signal(signal.SIGINT, lambda *a: None)  # it catches SIGINT, as many programs do
with open(sys.argv[1], "rb") as f, open(sys.argv[2], "wb") as out:
    child = subprocess.Popen([sys.executable, "-c", *sys.argv[3:]], stdin=f, stdout=out)
print(child.pid, file=sys.stderr, flush=True)
sys.exit(child.wait())
"""


def gone_or_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "O_DIRECT"])
@pytest.mark.parametrize("befalls", ["killed", "stopped-then-SIGINT"])
def test_a_reader_of_a_file_its_parent_opened_reads_on_whatever_befalls_the_parent(
    paused, befalls: str, direct: bool, tmp_path: Path
) -> None:
    """The opener stands for the reader (read() has no pid), but the opener's fate is
    not the reader's when they differ: a parent killed, or stopped with a caught SIGINT
    pending, must not end its child's read with EINTR (mount/waits.py)."""
    node, mp, files = paused
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            PARENT_OF_READER,
            str(mp / "b.bin"),
            str(tmp_path / "out"),
            CHILD_READER,
            "O_DIRECT" if direct else "buffered",
        ],
        stderr=subprocess.PIPE,
    )
    try:
        assert parent.stderr is not None
        child = int(parent.stderr.readline())
        wait_for(lambda: in_read(child), 10, what="the child to block in read()")
        wait_for(
            lambda: node.job_status("j")["limiter_oldest_wait_s"] >= 1,
            10,
            what="the child's read to wait a second",
        )
        if befalls == "killed":
            parent.kill()
            wait_for(lambda: parent.poll() is not None, 10, what="the parent to die")
        else:
            parent.send_signal(signal.SIGSTOP)
            parent.send_signal(signal.SIGINT)  # stays pending while it is stopped
        # Two seconds more (eight looks): the child still waits, its read never ended
        # (an ended one starts again: the oldest wait's age would start from 0).
        deadline = node.job_status("j")["limiter_oldest_wait_s"] + 2
        wait_for(
            lambda: node.job_status("j")["limiter_oldest_wait_s"] >= deadline,
            10,
            what="two more seconds of waiting",
        )
        assert not gone_or_zombie(child) and waiting(node, "j") == 1
        put_io(node, "j", None)
        wait_for(lambda: gone_or_zombie(child), 30, what="the child to finish")
    finally:
        parent.kill()
        _, err = parent.communicate(timeout=30)
    assert (tmp_path / "out").read_bytes() == files["b.bin"], err.decode(errors="replace")
    assert node.mount_status(mp)["interrupted_reads"] == 0
