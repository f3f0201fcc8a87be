"""Shared helpers of the silofs benchmarks: a private node, timed reads, figures.

Owns starting a silofs daemon on a socket and cache dir of its own (never the node's
default daemon), mounting and unmounting with the real `silofs` command, a cleanup that
leaves no FUSE mount and no process of ours behind, dropping the page cache, timed
whole-file reads with N reader threads, a local S3 server process (moto or s3rver) and
its boto3 client, and the formatting of figures. Never measures anything itself
(throughput.py, limiter.py, cold.py do) and never changes silofs.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from silofs.control.client import ControlClient, ControlError  # noqa: E402
from silofs.mountinfo import is_mounted  # noqa: E402

READ_BUF = 1 << 20
# A local S3 server's credentials (s3rver's fixed pair; moto takes any).
CREDS = {
    "AWS_ACCESS_KEY_ID": "S3RVER",
    "AWS_SECRET_ACCESS_KEY": "S3RVER",
    "AWS_DEFAULT_REGION": "us-east-1",
}
S3RVER = ROOT / ".ci" / "node" / "node_modules" / ".bin" / "s3rver"


def silofs_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "silofs", *args]


def mounted(path: str) -> bool:
    target = os.path.abspath(path)
    return is_mounted(target)


def force_unmount(path: str) -> None:
    """Unmount `path` if it is mounted: plainly, then lazily if it is busy."""
    if not mounted(path):
        return
    subprocess.run(["fusermount3", "-u", path], capture_output=True)
    if mounted(path):
        subprocess.run(["fusermount3", "-u", "-z", path], capture_output=True)


def drop_caches() -> None:
    """Write back dirty pages and drop the page cache, dentries and inodes (needs root)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def check_root() -> None:
    if os.geteuid() != 0:
        sys.exit("this benchmark drops the page cache: run it as root")
    check_fuse()


def check_fuse() -> None:
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        sys.exit("FUSE is missing: /dev/fuse and fusermount3 (apt-get install fuse3)")


def wait_for(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    end = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > end:
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.02)


class Node:
    """A silofs daemon of our own under `root`, and the mounts we made through it."""

    def __init__(
        self,
        root: Path,
        cache_size: int,
        env: dict[str, str] | None = None,
        chunk_size: str | None = None,
        extra_path: list[str] | None = None,
    ) -> None:
        self.root = root
        self.socket = str(root / "ctl.sock")
        self.cache_dir = str(root / "cache")
        self.cache_size = cache_size
        self.chunk_size = chunk_size
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.env = {
            **os.environ,
            **(env or {}),
            "SILOFS_LOG_DIR": str(self.logs),
            "SILOFS_SOCKET": self.socket,
            "PYTHONPATH": os.pathsep.join(
                [*(extra_path or []), str(ROOT), os.environ.get("PYTHONPATH", "")]
            ),
        }
        self.proc: subprocess.Popen | None = None
        self.mountpoints: list[str] = []

    def __enter__(self) -> Node:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.cleanup()

    def start(self) -> None:
        args = [
            "daemon",
            "--socket",
            self.socket,
            "--cache-dir",
            self.cache_dir,
            "--cache-size",
            str(self.cache_size),
        ]
        if self.chunk_size:
            args += ["--chunk-size", self.chunk_size]
        with open(self.logs / "daemon.log", "ab") as log:
            self.proc = subprocess.Popen(
                silofs_cmd(*args), stdout=log, stderr=log, env=self.env, start_new_session=True
            )
        wait_for(self._answers, 30, f"the daemon on {self.socket} (log: {self.logs})")

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"daemon exited {self.proc.returncode}: "
                f"{(self.logs / 'daemon.log').read_text()[-2000:]}"
            )
        try:
            self.status()
            return True
        except ControlError:
            return False

    @property
    def daemon_pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def status(self) -> dict:
        with ControlClient(self.socket, timeout=10) as c:
            return c.request("GET", "/v1/status")

    def mount_status(self, mountpoint: str) -> dict:
        """The newest mount registered at `mountpoint`. An older one may still be listed:
        a mount namespace another process made (unshare, `ip netns exec`) while it was
        mounted keeps its copy of the mount, and so the mount process, alive after the
        unmount here, until that namespace ends."""
        found = [
            m for m in self.status()["mounts"] if m["mountpoint"] == os.path.abspath(mountpoint)
        ]
        if not found:
            raise RuntimeError(f"no mount at {mountpoint} in the daemon's status")
        return found[-1]

    def job_status(self, job: str) -> dict:
        for j in self.status()["jobs"]:
            if j["name"] == job:
                return j
        raise RuntimeError(f"no job {job} in the daemon's status")

    def settled(self, mountpoint: str, bytes_read: int, timeout: float = 10) -> dict:
        """The mount's status once its reported bytes_read reaches `bytes_read` (mounts
        report counters every 0.25 s)."""
        return wait_for(
            lambda: (m := self.mount_status(mountpoint))["bytes_read"] >= bytes_read and m,
            timeout,
            f"the counters of {mountpoint} to reach {bytes_read}",
        )

    def mount(self, uri: str, mountpoint: str, *args: str) -> None:
        os.makedirs(mountpoint, exist_ok=True)
        self.mountpoints.append(mountpoint)
        res = subprocess.run(
            silofs_cmd("mount", uri, mountpoint, "--socket", self.socket, *args),
            capture_output=True,
            text=True,
            env=self.env,
            timeout=600,
        )
        if res.returncode != 0 or not mounted(mountpoint):
            raise RuntimeError(
                f"silofs mount failed ({res.returncode}): {res.stderr.strip()} (logs: {self.logs})"
            )

    def mount_pid(self, mountpoint: str) -> int:
        return int(self.mount_status(mountpoint)["pid"])

    def unmount(self, mountpoint: str) -> None:
        res = subprocess.run(
            silofs_cmd("unmount", mountpoint, "--socket", self.socket),
            capture_output=True,
            text=True,
            env=self.env,
            timeout=60,
        )
        if res.returncode != 0:
            print(f"warning: silofs unmount {mountpoint}: {res.stderr.strip()}", file=sys.stderr)
        force_unmount(mountpoint)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def cleanup(self) -> None:
        """No mount and no process of this node survives this, whatever happened."""
        for mp in self.mountpoints:
            try:
                force_unmount(mp)
            except OSError:
                pass
        # Mount processes carry our private socket path on their command line.
        for pid in pids_with(self.socket):
            if self.proc is not None and pid == self.proc.pid:
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.stop()


def pids_with(text: str) -> list[int]:
    """Processes whose command line contains `text` (a path unique to this run)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        out.append(int(entry))
            except OSError:
                pass
    return out


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


def read_files(paths: Sequence[str], readers: int) -> tuple[float, int]:
    """(seconds, bytes) to read every file once with `readers` threads, each taking the
    next file from a shared list (as a data loader's workers do)."""
    if readers <= 1:
        buf = bytearray(READ_BUF)
        t0 = time.perf_counter()
        total = sum(read_whole(p, buf) for p in paths)
        return time.perf_counter() - t0, total
    it = iter(paths)
    lock = threading.Lock()

    def worker() -> int:
        buf = bytearray(READ_BUF)
        n = 0
        while True:
            with lock:
                p = next(it, None)
            if p is None:
                return n
            n += read_whole(p, buf)

    with ThreadPoolExecutor(readers) as pool:
        t0 = time.perf_counter()
        futures = [pool.submit(worker) for _ in range(readers)]
        total = sum(f.result() for f in futures)
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
        exe = shutil.which("py-spy")
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
    def of(cls, pid: int) -> ProcTimes:
        with open(f"/proc/{pid}/stat") as f:
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """A local S3 server process on 127.0.0.1 (moto, s3rver), stopped on exit."""

    def __init__(self, name: str, argv: list[str], port: int, log: Path, env: dict) -> None:
        self.name = name
        self.url = f"http://127.0.0.1:{port}"
        self.port = port
        self.logf = open(log, "ab")
        self.proc = subprocess.Popen(
            argv,
            stdout=self.logf,
            stderr=self.logf,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **env},
        )
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                sys.exit(f"{name} exited {self.proc.returncode}; see {log}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    sys.exit(f"{name} did not listen on {self.url} within 60 s; see {log}")
                time.sleep(0.1)  # polling for the port, not synchronisation

    def client(self):  # type: ignore[no-untyped-def]
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id=CREDS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDS["AWS_SECRET_ACCESS_KEY"],
            region_name=CREDS["AWS_DEFAULT_REGION"],
            config=Config(max_pool_connections=16, s3={"addressing_style": "path"}),
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.logf.close()


def start_s3rver(directory: Path, log: Path) -> S3Server:
    """s3rver with its data in `directory` (npm install --prefix .ci/node s3rver)."""
    if not S3RVER.exists():
        sys.exit(f"s3rver is missing: npm install --prefix {ROOT / '.ci' / 'node'} s3rver")
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [str(S3RVER), "-d", str(directory), "-a", "127.0.0.1", "-p", str(port)]
    # s3rver signs ListObjectsV2 continuation tokens with DES, which OpenSSL 3 only has
    # in its legacy provider: without it every truncated listing (silofs's bucket check
    # asks for max-keys=1) is an HTTP 500.
    return S3Server("s3rver", argv, port, log, {"NODE_OPTIONS": "--openssl-legacy-provider"})
