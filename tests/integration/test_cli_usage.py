"""What a user types: versions, units, one error style, URI hints, one line on success."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from silofs import __version__
from silofs.records import shown
from tests.support.fixtures import needs_fuse
from tests.support.node import Node, mounted, silofs_cmd

from .test_bad_input import assert_one_line_error


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(silofs_cmd(*args), capture_output=True, text=True, timeout=60)


def test_version_of_every_command() -> None:
    res = run("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"silofs {__version__}"
    ctl = subprocess.run(
        [sys.executable, "-m", "silofs_ctl", "--version"], capture_output=True, text=True
    )
    assert ctl.returncode == 0 and ctl.stdout.strip() == f"silofs-ctl {__version__}"
    for flag in ("--version", "-V"):  # mount(8)'s helper answers as mount does
        helper = subprocess.run(
            [sys.executable, "-m", "silofs.cli_mount", flag], capture_output=True, text=True
        )
        assert helper.returncode == 0 and helper.stdout.strip() == f"mount.silofs {__version__}"


def test_usage_errors_have_our_prefix_and_exit_2(tmp_path: Path) -> None:
    for args, needle in (
        (("mount",), "missing argument"),
        (("mount", "--no-such-flag", "a", "b"), "no such option"),
        (("frobnicate",), "no such command"),
        # JuiceFS users mean Mbps, rclone users KiB/s: a bare number is refused.
        (("mount", "--io-limit", "100", str(tmp_path), str(tmp_path)), "needs a unit"),
        # An empty --socket (a variable that was not set) was the default daemon's.
        (("mount", "--socket", "", str(tmp_path), str(tmp_path)), "--socket is empty"),
        (("unmount", "--socket", "", str(tmp_path)), "--socket is empty"),
        (("daemon", "--socket", ""), "--socket is empty"),
    ):
        res = run(*args)
        line = assert_one_line_error(res, needle)
        assert res.returncode == 2, (args, line)
        assert "Usage:" not in res.stderr and "Error:" not in res.stderr


def test_an_owner_or_group_out_of_range_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """A negative --uid once mounted, and the mount process died of the first stat."""
    sock = str(tmp_path / "ctl.sock")
    for flag in ("--uid=-5", "--gid=-1", "--uid=4294967295", "--gid=99999999999"):
        res = run("mount", flag, "--socket", sock, str(tmp_path), str(tmp_path))
        line = assert_one_line_error(res, "not in the range")
        assert res.returncode == 2, (flag, line)
    assert not (tmp_path / "ctl.sock").exists()  # no daemon was started


def test_bare_command_prints_its_help() -> None:
    res = run()
    assert res.returncode == 2 and res.stderr.startswith("Usage: ") and "warm" in res.stderr


def test_bucket_names_and_scheme_typos_suggest_the_uri(tmp_path: Path) -> None:
    res = run("mount", "my-bucket", str(tmp_path))
    assert_one_line_error(res, "s3://my-bucket/", "gs://my-bucket/")
    res = run("mount", "s3//x/p", str(tmp_path))
    assert_one_line_error(res, "did you mean s3://x/p?")
    res = run("mount", "gs:/b", str(tmp_path))
    assert_one_line_error(res, "did you mean gs://b?")
    res = run("mount", "file:/data/x", str(tmp_path))
    assert_one_line_error(res, "did you mean file:///data/x?")


@needs_fuse
@pytest.mark.fuse
def test_mount_and_unmount_say_one_line_and_jobs_differ_by_path(
    make_node, local_store, bucket_name, tmp_path: Path, monkeypatch
) -> None:
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"a": b"1"})
    node: Node = make_node()
    uri = local_store.uri(bucket_name)
    mps = []
    for user in ("alice", "bob"):  # two unrelated ~/data mounts
        mp = tmp_path / user / "data"
        mp.mkdir(parents=True)
        node.mountpoints.append(str(mp))
        res = node.run("mount", uri, str(mp), "--socket", node.socket)
        assert res.returncode == 0, res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and f"mounted at {mp}" in lines[0], res.stderr
        mps.append(mp)
    jobs = {node.mount_status(str(mp))["job"] for mp in mps}
    assert len(jobs) == 2 and all(j.startswith("data-") for j in jobs), jobs
    for mp in mps:
        res = node.run("unmount", str(mp), "--socket", node.socket)
        assert res.returncode == 0 and res.stderr.strip() == f"silofs: unmounted {mp}"
        assert not mounted(mp)


def test_mount_and_unmount_lines_show_names_escaped(make_node, tmp_path: Path) -> None:
    """The user's own directory and mountpoint may hold anything a terminal acts on (a
    bidi override, an escape sequence): `silofs mount`'s and `silofs unmount`'s lines
    show them escaped, as its error lines do (records.shown), and on one line."""
    node: Node = make_node()
    data = tmp_path / "d\u202eata"
    data.mkdir()
    (data / "a").write_bytes(b"1")
    mp = tmp_path / "mnt\x1b[2J\x1b]0;title\x07"
    mp.mkdir()
    node.mountpoints.append(str(mp))
    res = node.run("mount", str(data), str(mp), "--socket", node.socket)
    assert res.returncode == 0, res.stderr
    line = res.stderr.rstrip("\n")
    assert res.stderr.count("\n") == 1 and line.isprintable(), repr(res.stderr)
    assert line.startswith(f"silofs: file://{shown(str(data))}/ mounted at {shown(str(mp))} ")
    res = node.run("unmount", str(mp), "--socket", node.socket)
    assert res.returncode == 0 and res.stderr == f"silofs: unmounted {shown(str(mp))}\n"
    assert not mounted(mp)


def test_a_log_dir_that_cannot_be_written_is_one_line_and_starts_nothing(
    tmp_path: Path,
) -> None:
    """A daemon started in the background writes its first words to the log dir: one
    that cannot be made (a file in its place, a HOME that is not writable) was a
    traceback from os.makedirs."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("a")
    mp = tmp_path / "mp"
    mp.mkdir()
    blocker = tmp_path / "state"
    blocker.write_text("a file where the log dir would be")
    sock = tmp_path / "run" / "ctl.sock"
    for log_dir in (blocker, blocker / "silofs"):
        env = {**os.environ, "SILOFS_LOG_DIR": str(log_dir),
               "SILOFS_CACHE_DIR": str(tmp_path / "cache")}  # fmt: skip
        for args in (("mount", str(data), str(mp)), ("warm", str(data))):
            res = subprocess.run(silofs_cmd(*args, "--socket", str(sock)), capture_output=True,
                                 text=True, timeout=60, env=env)  # fmt: skip
            line = assert_one_line_error(res, "cannot write logs in", "SILOFS_LOG_DIR")
            assert res.returncode == 1 and "Traceback" not in res.stderr, line
            assert not sock.exists()  # no daemon was started
    assert not os.path.ismount(mp)
