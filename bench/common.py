"""What the benchmarks share beyond tests/support: the checkout on sys.path, timed reads,
CPU and memory of processes, profiles, and the formatting of figures.

Owns putting this checkout (and its silofs-ctl) first on sys.path when a script is run
from it, so a script measures the tree it sits in; under --git-rev a script re-run for
the baseline has SILOFS_BASELINE set (tests/support/baseline.py) and its PYTHONPATH
already decides. Also: dropping the page cache, timed whole-file reads with N reader
threads, /proc CPU and RSS accounting, py-spy profiles and their summary, medians with
ranges. Nodes, servers, polling and the fault proxy come from tests/support. Never
measures anything itself and never changes silofs.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parent.parent
if "SILOFS_BASELINE" not in os.environ:
    sys.path[1:1] = [str(ROOT), str(ROOT / "silofs-ctl")]  # after the script's own dir

from tests.support.node import FUSE_MISSING  # noqa: E402

READ_BUF = 1 << 20
T = TypeVar("T")


def drop_caches() -> None:
    """Write back dirty pages and drop the page cache, dentries and inodes (needs root)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def rewarm(path: Path | str) -> int:
    """Read every allocated extent of `path` (SEEK_DATA to SEEK_HOLE: data.mdb is as large
    as the LMDB map, mostly holes) so that all of it is in the page cache again; returns
    the bytes read. drop_caches keeps only the pages some process has mapped, and a
    silofs mount copies values out of data.mdb by preadv without mapping them: after a
    drop a kept mount's values are partly on the SSD again (bench/README.md, "What a kept
    mount's pass read from the SSD")."""
    fd = os.open(path, os.O_RDONLY)
    buf = bytearray(READ_BUF)
    done = 0
    try:
        size = os.fstat(fd).st_size
        off = 0
        while off < size:
            try:
                off = os.lseek(fd, off, os.SEEK_DATA)
            except OSError:  # ENXIO: no data past off
                break
            end = os.lseek(fd, off, os.SEEK_HOLE)
            while off < end:
                n = os.preadv(fd, [memoryview(buf)[: min(READ_BUF, end - off)]], off)
                if n <= 0:
                    break
                off += n
                done += n
    finally:
        os.close(fd)
    return done


def resident_bytes(path: Path | str) -> int | None:
    """Bytes of `path` in the page cache (util-linux fincore), None without fincore."""
    exe = shutil.which("fincore")
    if exe is None:
        return None
    out = subprocess.run(
        [exe, "--bytes", "--noheadings", "--raw", "--output", "RES", str(path)],
        capture_output=True,
        text=True,
    )
    try:
        return int(out.stdout.split()[0])
    except (IndexError, ValueError):
        return None


def check_root() -> None:
    if os.geteuid() != 0:
        sys.exit("this benchmark drops the page cache: run it as root")
    check_fuse()


def check_fuse() -> None:
    if FUSE_MISSING:
        sys.exit(f"FUSE is missing: {FUSE_MISSING}")


def need_tools(wanted: dict[str, str | None]) -> None:
    """Exit with one line, before any work, if a tool an option asked for is not on
    PATH: {option: tool, or None where the option was not given}. Checked where it
    was used, a missing py-spy or perf ended a run after its passes."""
    for option, tool in wanted.items():
        if tool is not None and shutil.which(tool) is None:
            hint = {"py-spy": "pip install py-spy", "perf": "apt-get install linux-perf"}
            sys.exit(f"{option} needs {tool}, not on PATH ({hint.get(tool, 'install it')})")


def start_server(start: Callable[[], T], what: str, made: Path | None = None) -> T:
    """start() (a tests/support/servers.py server), or exit with one line saying why
    not: npm's s3rver or Azurite, or fake-gcs-server, missing and not installable raised
    ServerError, a traceback. `made`: the run's directory, removed first."""
    from tests.support.servers import ServerError

    try:
        return start()
    except ServerError as exc:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        sys.exit(f"cannot start {what}: {exc}")


# -- timed reads -------------------------------------------------------------------------
def read_whole(path: str, buf: bytearray) -> int:
    """Read a file to its end in len(buf)-sized reads; the bytes read."""
    n = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        view = memoryview(buf)
        while got := os.readv(fd, [view]):
            n += got
    finally:
        os.close(fd)
    return n


_buffers = threading.local()


def read_path(path: str) -> int:
    """read_whole with this thread's own READ_BUF-sized buffer."""
    buf = getattr(_buffers, "buf", None)
    if buf is None:
        buf = _buffers.buf = bytearray(READ_BUF)
    return read_whole(path, buf)


def drain(items: Iterable[T], fn: Callable[[T], int], workers: int) -> int:
    """The sum of fn(item) over `items`, with `workers` threads each taking the next item
    from one shared iterator (as a data loader's workers take the next index)."""
    it = iter(items)
    lock = threading.Lock()

    def worker() -> int:
        n = 0
        while True:
            with lock:
                item = next(it, _END)
            if item is _END:
                return n
            n += fn(item)  # type: ignore[arg-type]

    if workers <= 1:
        return worker()
    with ThreadPoolExecutor(workers) as pool:
        return sum(f.result() for f in [pool.submit(worker) for _ in range(workers)])


_END = object()


def read_files(paths: Sequence[str], readers: int) -> tuple[float, int]:
    """(seconds, bytes) to read every file once with `readers` threads (drain)."""
    t0 = time.perf_counter()
    total = drain(paths, read_path, readers)
    return time.perf_counter() - t0, total


# -- profiles ---------------------------------------------------------------------------
class Profiler:
    """`py-spy record` of one process while a block runs, as raw collapsed stacks.

    --nonblocking: the target is never paused, so it runs at its normal speed, but py-spy
    itself takes CPU (on 2 cores, figures measured under it are not comparable)."""

    def __init__(self, pid: int, out: str, rate: int = 250) -> None:
        self.pid, self.out, self.rate = pid, out, rate
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Profiler:
        # The interpreter's own environment first: a venv's python run by its path
        # leaves the venv's bin off PATH.
        exe = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")
        if exe is None:
            sys.exit("profiling needs py-spy: pip install py-spy")
        args = [exe, "record", "-p", str(self.pid), "-r", str(self.rate), "--format", "raw"]
        self.proc = subprocess.Popen(
            [*args, "-o", self.out, "--nonblocking"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1.0)  # py-spy attaches
        return self

    def __exit__(self, *_exc: object) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        print(f"  profile: {self.out}")


# Leaf frames of a thread that waits for work: the trio loop in epoll, an idle trio
# worker thread (also any stack in WorkerThread._work outside _handle_job). py-spy
# --nonblocking cannot tell idle threads apart, so we do.
IDLE_LEAVES = ("EpollIOManager.get_events", "WorkerThread._work", "epoll_wait")


def profile_summary(path: str, top: int = 12) -> str:
    """The functions with the most busy samples in a raw py-spy profile, self and
    inclusive, as shares of the busy (not idle) samples."""
    own: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = idle = 0
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return f"  (no profile at {path})"
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [f.strip() for f in stack.split(";") if f.strip()]
        names = [f.split(" (", 1)[0] for f in frames]
        waiting_worker = "WorkerThread._work" in names and "WorkerThread._handle_job" not in names
        if not frames or frames[-1].startswith(IDLE_LEAVES) or waiting_worker:
            idle += n
            continue
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for f in set(frames):
            incl[f] = incl.get(f, 0) + n
    busy = total - idle
    if not busy:
        return f"  {total} samples, all idle"
    out = [f"  {total} samples, {busy} busy ({100 * busy / total:.0f}%); self time of busy:"]
    for f, n in sorted(own.items(), key=lambda kv: -kv[1])[:top]:
        out.append(f"    {100 * n / busy:5.1f}%  {f}")
    out.append("  inclusive:")
    for f, n in sorted(incl.items(), key=lambda kv: -kv[1])[:top]:
        out.append(f"    {100 * n / busy:5.1f}%  {f}")
    return "\n".join(out)


# -- figures -----------------------------------------------------------------------------
@dataclass
class Samples:
    """Repeated measurements of one figure; reported as the median and the range."""

    values: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")

    def text(self, fmt: str = "{:.2f}") -> str:
        if len(self.values) <= 1:
            return fmt.format(self.median)
        lo, hi = min(self.values), max(self.values)
        return f"{fmt.format(self.median)} ({fmt.format(lo)}-{fmt.format(hi)})"


def child_cpu(pid: int) -> float:
    """CPU seconds (user + system) a child process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_tls_home(pki: Path, cmd: list[str], port_file: Path) -> tuple[subprocess.Popen, int]:
    """A CA in `pki` with node certificates "home" and "asker" (127.0.0.1), then `cmd`
    started (a bench's home, writing its listening port to `port_file`) and its port.
    The caller kills the child; one that dies or never says its port ends the bench."""
    from silofs_ctl.certs_cmd import init_ca, node_cert

    init_ca(str(pki))
    node_cert(str(pki), "home", ["127.0.0.1"])
    node_cert(str(pki), "asker", ["127.0.0.1"])
    child = subprocess.Popen(cmd)
    deadline = time.monotonic() + 30
    while not port_file.exists() or not port_file.read_text():
        if time.monotonic() > deadline or child.poll() is not None:
            child.kill()
            child.wait()
            raise SystemExit("the home's listener did not start")
        time.sleep(0.05)
    return child, int(port_file.read_text())


def load_average() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def busy_processes(min_cpu: float = 20.0, interval: float = 1.0) -> list[str]:
    """Other processes using more than `min_cpu`% of a core now: a shared-machine warning."""

    def ticks() -> dict[int, tuple[int, str]]:
        out = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:90]
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            out[int(entry)] = (int(fields[11]) + int(fields[12]), cmd)
        return out

    before = ticks()
    time.sleep(interval)
    after = ticks()
    hz = os.sysconf("SC_CLK_TCK")
    busy = []
    for pid, (t, cmd) in after.items():
        if pid in before and pid != os.getpid():
            cpu = 100.0 * (t - before[pid][0]) / hz / interval
            if cpu >= min_cpu:
                busy.append(f"{cpu:4.0f}% pid {pid} {cmd.strip() or '[kernel]'}")
    return busy


@dataclass
class ProcTimes:
    """CPU seconds (user, system) and major page faults of a process (all its threads)."""

    user_s: float
    sys_s: float
    major_faults: int

    @property
    def cpu_s(self) -> float:
        return self.user_s + self.sys_s

    @classmethod
    def of(cls, pid: int, tid: int | None = None) -> ProcTimes:
        """All of `pid`'s threads, or only its thread `tid`."""
        path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        hz = os.sysconf("SC_CLK_TCK")
        return cls(int(fields[11]) / hz, int(fields[12]) / hz, int(fields[9]))

    def minus(self, other: ProcTimes) -> ProcTimes:
        return ProcTimes(
            self.user_s - other.user_s,
            self.sys_s - other.sys_s,
            self.major_faults - other.major_faults,
        )


class RssPeak:
    """Peak resident memory of a process while a block runs, split the way `top` cannot:
    anonymous (RssAnon: what the process itself allocated) and file-backed (RssFile: for
    a mount process, pages of the mapped LMDB env it touched; shared with every process
    mapping the env and reclaimable by the kernel). Sampled every `interval` seconds."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self.pid, self.interval = pid, interval
        self.anon = self.file = 0  # peak KiB
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now(pid: int) -> tuple[int, int]:
        """(RssAnon, RssFile) of `pid` in KiB now; (0, 0) once it has gone."""
        anon = file = 0
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        anon = int(line.split()[1])
                    elif line.startswith("RssFile:"):
                        file = int(line.split()[1])
        except OSError:
            pass
        return anon, file

    def _sample(self) -> None:
        anon, file = self.now(self.pid)
        self.anon, self.file = max(self.anon, anon), max(self.file, file)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> RssPeak:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def text(self) -> str:
        return (
            f"peak RSS anon {self.anon / 1024:.0f} MiB, LMDB-mapped/file {self.file / 1024:.0f} MiB"
        )


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")
