"""A user who may not open /dev/fuse is told so, in one line that says what to do.

libfuse opens /dev/fuse itself before it would ask the setuid fusermount3 to mount; a
host whose device is 0600 (root only) stops every other user with libfuse's bare
"fuse_session_mount failed". Run as another user (fork + setuid), against a stand-in
device file of root's with mode 0600.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from silofs import cli, demo, mountinfo
from silofs.mount import process
from tests.support.asuser import Identity, as_user

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")


@pytest.fixture
def device(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    where = tempfile.mkdtemp(dir="/var/tmp")  # a directory another user can enter
    os.chmod(where, 0o755)
    path = os.path.join(where, "fuse")
    with open(path, "w"):
        pass
    os.chmod(path, 0o600)
    monkeypatch.setattr(mountinfo, "FUSE_DEVICE", path)
    yield path
    shutil.rmtree(where)


def _message() -> str:
    return process._mount_error(RuntimeError("fuse_session_mount failed"), "/mnt/x")


def test_a_device_this_user_may_not_open_is_named_with_its_mode(device: str) -> None:
    got = as_user(Identity.nobody(), _message)
    assert got.startswith(f"cannot mount at /mnt/x: {device} is mode -rw-------"), got
    assert "0666" in got and "\n" not in got


def test_a_missing_device_says_so(device: str) -> None:
    os.remove(device)
    got = as_user(Identity.nobody(), _message)
    assert got == f"cannot mount at /mnt/x: {device}: No such file or directory (modprobe fuse)"


def test_a_device_this_user_may_open_keeps_the_general_hint(device: str) -> None:
    os.chmod(device, 0o666)
    got = as_user(Identity.nobody(), _message)
    assert "is /dev/fuse available and the mountpoint an empty" in got


def _mount(source: str, mountpoint: str, socket: str) -> tuple[object, str]:
    """`silofs mount SOURCE MOUNTPOINT --socket SOCKET` in this process: (exit code,
    stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            cli.main(["mount", source, mountpoint, "--socket", socket])
        except SystemExit as exc:
            return exc.code, err.getvalue()
    return 0, err.getvalue()


def test_silofs_mount_refuses_before_starting_a_daemon(device: str) -> None:
    """The refusal comes first: no daemon is started (and left idle) and no bucket is
    listed for a mount the device makes impossible."""
    where = tempfile.mkdtemp(dir="/var/tmp")
    try:
        os.chmod(where, 0o777)
        mp = os.path.join(where, "mnt")
        os.mkdir(mp)
        os.chmod(mp, 0o777)
        socket = os.path.join(where, "ctl.sock")
        code, err = as_user(Identity.nobody(), _mount, where, mp, socket)
        assert code == 1, err
        assert err == f"silofs: error: cannot mount at {mp}: {device} is mode -rw-------, " + (
            "which this user may not open: an administrator can make it 0666 (Debian's "
            "default; fusermount3 still decides who may mount where), or mount as root\n"
        )
        assert not os.path.exists(socket)  # no daemon was started for it
    finally:
        shutil.rmtree(where)


def _demo(root: str) -> str:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            demo.run_demo(Path(root), 1)
        except click.ClickException as exc:
            return exc.format_message()
    return "ran"


def test_the_demo_refuses_before_writing_its_sample(device: str) -> None:
    where = tempfile.mkdtemp(dir="/var/tmp")
    try:
        os.chmod(where, 0o777)
        root = os.path.join(where, "demo")
        got = as_user(Identity.nobody(), _demo, root)
        assert got.startswith(f"cannot mount at {root}/mnt: {device} is mode -rw-------"), got
        assert not os.path.exists(os.path.join(root, "bucket"))
    finally:
        shutil.rmtree(where)
