"""Logs where their tools look: syslog/the journal for background processes, a log file
that survives logrotate and SIGHUP, JSON lines, SDK loggers at WARNING."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from silofs.logsetup import setup_logging
from tests.support.fixtures import needs_fuse
from tests.support.node import Node
from tests.support.poll import wait_for


def test_sdk_loggers_are_held_at_warning() -> None:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        setup_logging("debug")
        assert root.getEffectiveLevel() == logging.DEBUG
        for name in ("azure.core.pipeline.policies.http_logging_policy", "botocore.auth"):
            assert logging.getLogger(name).getEffectiveLevel() == logging.WARNING, name
    finally:
        root.handlers[:], root.level = saved


@needs_fuse
@pytest.mark.fuse
def test_background_daemon_and_mount_log_to_syslog(
    make_node, local_store, bucket_name, tmp_path: Path, monkeypatch
) -> None:
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"a.txt": b"hi"})
    path = str(tmp_path / "syslog.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        node: Node = make_node(start=False, env={"SILOFS_SYSLOG_SOCKET": path})
        mp = node.mount(local_store.uri(bucket_name), tmp_path / "mnt", "--cache-dir",
                        node.cache_dir, "--cache-size", "32M")  # fmt: skip
        assert (mp / "a.txt").read_bytes() == b"hi"
        seen: list[str] = []
        sock.settimeout(1)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (
            any("silofs-daemon[" in m and "daemon ready" in m for m in seen)
            and any("silofs-mount[" in m for m in seen)
        ):
            try:
                seen.append(sock.recv(65536).decode())
            except TimeoutError:
                pass
        assert node.run("unmount", str(mp)).returncode == 0
        assert node.run("daemon", "stop").returncode == 0  # while syslog still answers
    ready = next(m for m in seen if "daemon ready" in m)
    # <PRI> of facility daemon (3): 3*8 + severity info (6) = 30.
    assert ready.startswith("<30>silofs-daemon["), ready
    assert any(m.startswith("<30>silofs-mount[") for m in seen), seen


@needs_fuse
@pytest.mark.fuse
def test_log_file_in_json_survives_logrotate_and_sighup(make_node, tmp_path: Path) -> None:
    log = tmp_path / "daemon.json.log"
    node: Node = make_node(args=("--log-file", str(log), "--log-format", "json"))
    ready = wait_for(
        lambda: [
            d for d in map(json.loads, log.read_text().splitlines()) if "ready" in d["message"]
        ],
        what="the ready record",
    )[0]
    assert ready["level"] == "info" and ready["pid"] == node.proc.pid
    assert ready["logger"] == "silofs.node.service" and ready["time"].endswith("Z")

    # logrotate: move the file away; the next record goes to a new file at the path.
    log.rename(tmp_path / "daemon.json.log.1")
    node.request("PUT", "/v1/jobs/rotated/io", {"bytes_per_s": "1MB/s"})
    wait_for(lambda: log.exists() and "job rotated" in log.read_text(), what="a new log file")

    # copytruncate + SIGHUP: the daemon keeps running and reopens the file.
    os.kill(node.proc.pid, signal.SIGHUP)
    node.request("PUT", "/v1/jobs/hupped/io", {"bytes_per_s": "1MB/s"})
    wait_for(lambda: "job hupped" in log.read_text(), what="a record after SIGHUP")
    assert node.proc.poll() is None
    for line in log.read_text().splitlines():
        json.loads(line)  # every line one JSON object


@needs_fuse
@pytest.mark.fuse
def test_sighup_without_a_log_file_is_logged_and_survived(make_node) -> None:
    # The fixture's daemon logs to stderr (redirected to daemon.log): no file to reopen.
    # Python's default action for SIGHUP is to end the process.
    node: Node = make_node()
    daemon_log = node.logs / "daemon.log"
    line = "received SIGHUP: no log file to reopen; ignored"
    for n in (1, 2, 3):  # one at a time: signals that arrive together are one
        os.kill(node.proc.pid, signal.SIGHUP)
        wait_for(lambda n=n: daemon_log.read_text().count(line) == n, what=f"SIGHUP line {n}")
    assert node.proc.poll() is None
    node.request("PUT", "/v1/jobs/after-hup/io", {"bytes_per_s": "1MB/s"})
    assert node.status()["node"]["pid"] == node.proc.pid
    node.stop()
    assert node.proc.returncode == 0 and "shutting down" in daemon_log.read_text()


@needs_fuse
@pytest.mark.fuse
def test_a_background_mount_reopens_its_log_on_sighup_and_stays_mounted(
    make_node, local_store, bucket_name, tmp_path: Path, monkeypatch
) -> None:
    # logrotate's postrotate `kill -HUP` must not unmount the dataset under a training job.
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"a.bin": b"a" * 5000})
    node: Node = make_node()
    log = tmp_path / "mount.log"
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "mnt", "--log-file", str(log))
    pid = node.mount_status(str(mp))["pid"]
    log.rename(tmp_path / "mount.log.1")  # rotated
    os.kill(pid, signal.SIGHUP)
    wait_for(
        lambda: log.exists() and "received SIGHUP: " in log.read_text(),
        what="the SIGHUP record in a new log file",
    )
    assert (mp / "a.bin").read_bytes() == b"a" * 5000
    assert os.path.ismount(mp) and node.mount_status(str(mp))["pid"] == pid
