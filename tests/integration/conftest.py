"""Fixtures for tests on real FUSE mounts served by a real silofs daemon.

Owns starting `silofs daemon` as a subprocess on a socket in tmp_path, mounting with the
real `silofs mount` command, and a teardown that leaves no mount and no process behind,
even when a test fails or a process was killed. The teardown also reads every daemon and
mount log of the test: a traceback or an ERROR line fails the test unless the test
declared it (node.expect_errors(pattern, ...)). Skips (with the reason) only where FUSE
itself is missing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from silofs.control.client import ControlClient, ControlError
from silofs.mountinfo import is_mounted

FUSE_MISSING = None
if not os.path.exists("/dev/fuse"):
    FUSE_MISSING = "/dev/fuse is missing"
elif shutil.which("fusermount3") is None:
    FUSE_MISSING = "fusermount3 is not installed (apt-get install fuse3)"

needs_fuse = pytest.mark.skipif(FUSE_MISSING is not None, reason=FUSE_MISSING or "")
DEADLINE = 30.0


def wait_for(pred: Callable[[], Any], timeout: float = DEADLINE, what: str = "condition") -> Any:
    """Poll `pred` until it returns a truthy value; fail with `what` at the deadline."""
    end = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.02)


def silofs_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "silofs", *args]


def mounted(path: Path | str) -> bool:
    target = os.path.realpath(path) if not isinstance(path, Path) else str(path)
    return is_mounted(target)


def force_unmount(path: str) -> None:
    if not mounted(path):
        return
    subprocess.run(["fusermount3", "-u", path], capture_output=True)
    if mounted(path):
        subprocess.run(["fusermount3", "-u", "-z", path], capture_output=True)


class Node:
    """One silofs node: a daemon subprocess, its cache dir and socket, and its mounts."""

    def __init__(
        self, root: Path, cache_size: str, env: dict[str, str], socket: str | None = None
    ) -> None:
        self.root = root
        self.socket = socket or str(root / "ctl.sock")
        self.cache_dir = str(root / "cache")
        self.cache_size = cache_size
        self.logs = root / "logs"
        self.logs.mkdir(exist_ok=True)
        self.env = {**env, "SILOFS_LOG_DIR": str(self.logs), "SILOFS_SOCKET": self.socket}
        self.proc: subprocess.Popen | None = None
        self.mountpoints: list[str] = []
        self.expected: list[re.Pattern[str]] = []

    # -- logs ----------------------------------------------------------------------
    def expect_errors(self, *patterns: str) -> None:
        """Declare ERROR records (regexes searched in the record's first line) this test
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
        log = open(self.logs / "daemon.log", "ab")
        self.proc = subprocess.Popen(
            silofs_cmd(
                "daemon",
                "--socket",
                self.socket,
                "--cache-dir",
                self.cache_dir,
                "--cache-size",
                self.cache_size,
                *extra,
            ),
            stdout=log,
            stderr=log,
            env=self.env,
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

    def stop(self) -> None:
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

    def status(self) -> dict:
        with ControlClient(self.socket, timeout=10) as c:
            return c.request("GET", "/v1/status")

    def request(self, method: str, path: str, body: dict | None = None) -> Any:
        with ControlClient(self.socket, timeout=10) as c:
            return c.request(method, path, body)

    def mount_status(self, mountpoint: str) -> dict:
        for m in self.status()["mounts"]:
            if m["mountpoint"] == os.path.realpath(mountpoint):
                return m
        raise AssertionError(f"no mount at {mountpoint} in status")

    def settle(self, mountpoint: str, bytes_read: int) -> dict:
        """The mount's status once its reported bytes_read reaches `bytes_read`."""
        return wait_for(
            lambda: (m := self.mount_status(mountpoint))["bytes_read"] >= bytes_read and m,
            what=f"mount counters to reach {bytes_read} bytes",
        )

    # -- mounts --------------------------------------------------------------------
    def run(
        self, *args: str, env: dict[str, str] | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            silofs_cmd(*args),
            capture_output=True,
            text=True,
            env={**self.env, **(env or {})},
            timeout=timeout,
        )

    def mount(
        self, uri: str, mountpoint: Path | str, *args: str, env: dict[str, str] | None = None
    ) -> Path:
        mp = Path(mountpoint)
        mp.mkdir(parents=True, exist_ok=True)
        self.mountpoints.append(str(mp))
        res = self.run("mount", uri, str(mp), "--socket", self.socket, *args, env=env)
        assert res.returncode == 0, f"mount failed: {res.stderr}"
        assert mounted(mp)
        return mp

    def cleanup(self) -> None:
        for mp in self.mountpoints:
            force_unmount(mp)
        for pid in _pids_with(self.socket):
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


def _pids_with(text: str) -> list[int]:
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


@pytest.fixture
def make_node(tmp_path: Path) -> Iterator[Callable[..., Node]]:
    """make_node(cache_size="64M", env=None, start=True) -> a running Node (root: its
    directory, for one other users must reach; default under tmp_path)."""
    if FUSE_MISSING:
        pytest.skip(FUSE_MISSING)
    nodes: list[Node] = []

    def factory(
        cache_size: str = "64M",
        env: dict[str, str] | None = None,
        start: bool = True,
        name: str = "node",
        args: tuple[str, ...] = (),
        socket: str | None = None,
        root: Path | None = None,
    ) -> Node:
        root = root or tmp_path / f"{name}{len(nodes)}"
        root.mkdir()
        node = Node(root, cache_size, {**os.environ, **(env or {})}, socket)
        nodes.append(node)
        if start:
            node.start(*args)
        return node

    yield factory
    for node in nodes:
        node.cleanup()
    problems = [p for node in nodes for p in node.log_problems()]
    if problems:
        pytest.fail(
            "unexpected errors in the silofs logs (declare expected ones with "
            "node.expect_errors):\n" + "\n".join(problems),
            pytrace=False,
        )


def drop_file_cache(path: Path | str) -> None:
    """Evict a file's pages from the page cache so the next read reaches FUSE."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=1, default=str)
