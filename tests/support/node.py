"""A private silofs node for tests and benchmarks: a daemon subprocess and its mounts.

Owns starting `silofs daemon` on a socket and cache dir of its own under a root
directory (never the host's default daemon), mounting and unmounting with the real
`silofs` command, reading the node's status over its control socket, and a cleanup that
leaves no FUSE mount and no process of the node behind, whatever happened. Also reads
the node's daemon and mount logs for records a test did not expect (ERROR, CRITICAL,
tracebacks). The daemon and the mounts run this checkout's code: the checkout (and its
silofs-ctl) come first on their PYTHONPATH, after any `pythonpath` given (a baseline
tree), and they run from the node's root, so `python -m silofs` does not put the
caller's directory (perhaps another checkout) first on sys.path. Never decides what is
asserted or measured.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from silofs.control.client import ControlClient, ControlError
from silofs.mountinfo import is_mounted
from tests.support.poll import DEADLINE, wait_for

REPO = Path(__file__).resolve().parents[2]

FUSE_MISSING: str | None = None
if not os.path.exists("/dev/fuse"):
    FUSE_MISSING = "/dev/fuse is missing"
elif shutil.which("fusermount3") is None:
    FUSE_MISSING = "fusermount3 is not installed (apt-get install fuse3)"


def silofs_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "silofs", *args]


def mounted(path: Path | str) -> bool:
    return is_mounted(os.path.realpath(path))


def force_unmount(path: Path | str) -> None:
    """Unmount `path` if it is mounted: plainly, then lazily if it is busy."""
    if not mounted(path):
        return
    subprocess.run(["fusermount3", "-u", str(path)], capture_output=True)
    if mounted(path):
        subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True)


def pids_with(text: str) -> list[int]:
    """Processes (not this one) whose command line contains `text`, e.g. a socket path
    unique to one node."""
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


def drop_file_cache(path: Path | str) -> None:
    """Evict a file's pages from the page cache so the next read reaches FUSE."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class Node:
    """One silofs node under `root`: its daemon, cache dir, socket, logs and mounts.

    `env` is added to this process's environment; `pythonpath` entries come before this
    checkout on the daemon's and mounts' PYTHONPATH; `config` is the daemon's --config;
    `prefix` runs the daemon under another command (e.g. a network namespace's
    `ip netns exec NAME`)."""

    def __init__(
        self,
        root: Path,
        cache_size: str | int = "64M",
        env: Mapping[str, str] | None = None,
        socket: str | None = None,
        *,
        chunk_size: str | None = None,
        config: Path | None = None,
        prefix: Sequence[str] = (),
        pythonpath: Sequence[str] = (),
    ) -> None:
        self.root = root
        self.socket = socket or str(root / "ctl.sock")
        self.cache_dir = str(root / "cache")
        self.cache_size = str(cache_size)
        self.chunk_size = chunk_size
        self.config = config
        self.prefix = list(prefix)
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        path = [*pythonpath, str(REPO), str(REPO / "silofs-ctl"), os.environ.get("PYTHONPATH", "")]
        self.env = {
            **os.environ,
            **(env or {}),
            "SILOFS_LOG_DIR": str(self.logs),
            "SILOFS_SOCKET": self.socket,
            "PYTHONPATH": os.pathsep.join(p for p in path if p),
        }
        self.proc: subprocess.Popen | None = None
        self.mountpoints: list[str] = []
        self.expected: list[re.Pattern[str]] = []

    def __enter__(self) -> Node:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.cleanup()

    # -- logs ----------------------------------------------------------------------
    def expect_errors(self, *patterns: str) -> None:
        """Declare ERROR records (regexes searched in the record's first line) a test
        provokes on purpose; their tracebacks, if any, are expected with them."""
        self.expected.extend(re.compile(p) for p in patterns)

    def log_problems(self) -> list[str]:
        """Log records (daemon and mounts) with a traceback or at ERROR/CRITICAL level
        that no expect_errors() pattern covers."""
        problems = []
        for path in sorted(self.logs.iterdir()):
            for record in _records(path.read_text(errors="replace")):
                first = record.splitlines()[0]
                bad = _LEVEL.search(first) or "Traceback (most recent call last)" in record
                if bad and not any(p.search(first) for p in self.expected):
                    problems.append(f"{path.name}: {record.strip()[:2000]}")
        return problems

    # -- daemon --------------------------------------------------------------------
    def start(self, *extra: str) -> None:
        args = ["daemon", "--socket", self.socket, "--cache-dir", self.cache_dir]
        args += ["--cache-size", self.cache_size]
        if self.chunk_size:
            args += ["--chunk-size", self.chunk_size]
        if self.config:
            args += ["--config", str(self.config)]
        with open(self.logs / "daemon.log", "ab") as log:
            self.proc = subprocess.Popen(
                [*self.prefix, *silofs_cmd(*args, *extra)],
                stdout=log,
                stderr=log,
                env=self.env,
                cwd=self.root,
                start_new_session=True,
            )
        wait_for(self._answers, what=f"the daemon on {self.socket} (log: {self.logs})")

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(
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

    def stop(self) -> None:
        """SIGTERM the daemon and wait for it (SIGKILL after 15 s)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    # -- control API ---------------------------------------------------------------
    def request(self, method: str, path: str, body: dict | None = None) -> Any:
        with ControlClient(self.socket, timeout=10) as c:
            return c.request(method, path, body)

    def status(self) -> dict:
        return self.request("GET", "/v1/status")

    def mount_status(self, mountpoint: Path | str) -> dict:
        """The newest mount registered at `mountpoint`. An older one may still be listed:
        a mount namespace another process made (unshare, `ip netns exec`) while it was
        mounted keeps its copy of the mount, and so the mount process, alive after the
        unmount here, until that namespace ends."""
        path = os.path.realpath(mountpoint)
        found = [m for m in self.status()["mounts"] if m["mountpoint"] == path]
        if not found:
            raise AssertionError(f"no mount at {mountpoint} in the daemon's status")
        return found[-1]

    def job_status(self, job: str) -> dict:
        for j in self.status()["jobs"]:
            if j["name"] == job:
                return j
        raise AssertionError(f"no job {job} in the daemon's status")

    def mount_pid(self, mountpoint: Path | str) -> int:
        return int(self.mount_status(mountpoint)["pid"])

    def settle(self, mountpoint: Path | str, bytes_read: int, timeout: float = DEADLINE) -> dict:
        """The mount's status once its reported bytes_read reaches `bytes_read` (mounts
        report their counters every 0.25 s)."""
        return wait_for(
            lambda: (m := self.mount_status(mountpoint))["bytes_read"] >= bytes_read and m,
            timeout,
            f"the counters of {mountpoint} to reach {bytes_read} bytes",
        )

    # -- mounts --------------------------------------------------------------------
    def run(
        self, *args: str, env: Mapping[str, str] | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess:
        """`silofs ARGS` with the node's environment; its output captured as text."""
        return subprocess.run(
            silofs_cmd(*args),
            capture_output=True,
            text=True,
            env={**self.env, **(env or {})},
            cwd=self.root,
            timeout=timeout,
        )

    def mount(
        self,
        uri: str,
        mountpoint: Path | str,
        *args: str,
        env: Mapping[str, str] | None = None,
        timeout: float = 120,
    ) -> Path:
        """`silofs mount URI MOUNTPOINT ARGS` through this node's daemon; the mountpoint
        once it is mounted (AssertionError with silofs's stderr otherwise)."""
        mp = Path(os.path.abspath(mountpoint))  # the node's processes run from its root
        mp.mkdir(parents=True, exist_ok=True)
        self.mountpoints.append(str(mp))
        args = ("mount", uri, str(mp), "--socket", self.socket, *args)
        res = self.run(*args, env=env, timeout=timeout)
        if res.returncode != 0 or not mounted(mp):
            raise AssertionError(
                f"silofs mount failed ({res.returncode}): {res.stderr.strip()} (logs: {self.logs})"
            )
        return mp

    def unmount(self, mountpoint: Path | str) -> None:
        """`silofs unmount`, then fusermount3 if the mount is still there."""
        res = self.run("unmount", str(mountpoint), "--socket", self.socket, timeout=60)
        if res.returncode != 0:
            print(f"warning: silofs unmount {mountpoint}: {res.stderr.strip()}", file=sys.stderr)
        force_unmount(mountpoint)

    def cleanup(self) -> None:
        """No mount and no process of this node survives this, whatever happened: every
        mount is unmounted, every process with the node's socket on its command line
        (mount processes, a daemon started by `silofs mount`) is killed."""
        for mp in self.mountpoints:
            try:
                force_unmount(mp)
            except OSError:
                pass
        for pid in pids_with(self.socket):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.stop()


_START = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ \d+ [A-Z]+ ")
_LEVEL = re.compile(r"^\S+ \S+ \d+ (ERROR|CRITICAL) ")


def _records(text: str) -> list[str]:
    """A log file cut into records: a line with the log format's prefix starts one; other
    lines (a traceback, stray stderr) belong to the record before them."""
    records: list[str] = []
    for line in text.splitlines(keepends=True):
        if _START.match(line) or not records:
            records.append(line)
        else:
            records[-1] += line
    return records
