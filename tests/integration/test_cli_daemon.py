"""The daemon `silofs mount` starts: idle exit, `silofs daemon stop`, who started it, and
mounts whose flags or credentials the running daemon would ignore."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from silofs.pids import pid_alive
from tests.support.fixtures import needs_fuse
from tests.support.node import Node, mounted
from tests.support.poll import wait_for

from .test_bad_input import assert_one_line_error

pytestmark = [needs_fuse, pytest.mark.fuse]


@pytest.fixture
def auto(make_node, local_store, bucket_name, monkeypatch) -> tuple[Node, str]:
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"a/x.bin": os.urandom(100_000), "b.txt": b"hello"})
    return make_node(start=False), local_store.uri(bucket_name)


def test_an_auto_started_daemon_exits_after_its_last_mount(auto, tmp_path: Path) -> None:
    node, uri = auto
    # Started from inside a unit (silofs-mount@.service sets INVOCATION_ID): still an
    # auto daemon with an idle exit, not the service.
    mp = node.mount(
        uri, tmp_path / "mnt", "--cache-dir", node.cache_dir, "--cache-size", "32M",
        "--idle-exit", "2", env={"INVOCATION_ID": "0123456789abcdef"},
    )  # fmt: skip
    status = node.status()["node"]
    pid = status["pid"]
    assert status["started_by"] == "auto" and status["started_by_uid"] == os.getuid()
    assert status["idle_exit_seconds"] == 2 and status["cache_dir"] == node.cache_dir
    # A mounted daemon outlives its idle time several times over.
    wait_for(lambda: node.status()["node"]["uptime_s"] >= 6, what="6 s of uptime")
    assert (mp / "b.txt").read_bytes() == b"hello"
    res = node.run("unmount", str(mp))
    assert res.returncode == 0, res.stderr
    wait_for(lambda: not pid_alive(pid), timeout=20, what="the idle daemon to exit")
    assert not os.path.exists(node.socket)


def test_a_running_daemon_refuses_flags_it_would_ignore(auto, tmp_path: Path) -> None:
    node, uri = auto
    node.mount(uri, tmp_path / "m1", "--cache-dir", node.cache_dir, "--cache-size", "32M")
    for args, needle in (
        (("--cache-size", "50M"), "--cache-size 50.0MiB would be ignored"),
        (("--cache-dir", str(tmp_path / "other")), "would be ignored"),
    ):
        mp = tmp_path / "m2"
        mp.mkdir(exist_ok=True)
        res = node.run("mount", uri, str(mp), *args)
        line = assert_one_line_error(res, needle, "silofs daemon stop", "32.0MiB")
        assert res.returncode == 2, line
        assert not mounted(mp)
    res = node.run("mount", uri, str(tmp_path / "m2"), env={"AWS_PROFILE": "other"})
    assert_one_line_error(res, "AWS_PROFILE", "silofs daemon stop")
    # The same flags as the daemon's are fine.
    node.mount(uri, tmp_path / "m3", "--cache-size", "32M")


def test_daemon_stop(auto, tmp_path: Path) -> None:
    node, uri = auto
    res = node.run("daemon", "stop")
    assert_one_line_error(res, "no silofs daemon answers")
    mp = node.mount(uri, tmp_path / "mnt", "--cache-dir", node.cache_dir, "--cache-size", "32M")
    pid = node.status()["node"]["pid"]
    res = node.run("daemon", "stop")
    assert_one_line_error(res, "still serves 1 mount", str(mp))
    assert pid_alive(pid)
    assert node.run("unmount", str(mp)).returncode == 0
    res = node.run("daemon", "stop")
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip() == f"silofs: stopped the daemon (pid {pid}) on {node.socket}"
    assert not pid_alive(pid)
