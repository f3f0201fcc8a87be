"""`silofs unmount` of another user's mount says whose it is, and who may unmount it.

fusermount3 refuses a user another user's mount with "entry for PATH not found in
/etc/mtab" (its own table of user mounts): true of fusermount3's bookkeeping, and no
help to a user looking at that mount in `mount`. Real FUSE: a second user against a
job's mount under Slurm (attack15 by hand); here the mount table and fusermount3 are
stand-ins, the decision is silofs.unmount's."""

from __future__ import annotations

import subprocess

import pytest

from silofs import unmount as um
from silofs.errors import SilofsError
from silofs.mountinfo import MountEntry

PATH = "/mnt/silofs/101/ds"
REFUSED = f"fusermount3: entry for {PATH} not found in /etc/mtab\n"


@pytest.fixture
def table(monkeypatch: pytest.MonkeyPatch) -> None:
    entry = MountEntry("0:99", PATH, "fuse.silofs", "silofs:file:///d/", "ro,user_id=4242")
    monkeypatch.setattr(um, "silofs_mounts", lambda: {PATH: entry})
    monkeypatch.setattr(um, "mount_pid", lambda _socket, _path: None)
    monkeypatch.setattr(um, "_mounts_inside", lambda _path: [])
    monkeypatch.setattr(
        um.subprocess,
        "run",
        lambda cmd, **_kw: subprocess.CompletedProcess(cmd, 1, "", REFUSED),
    )


def test_another_users_mount_is_named_as_theirs(
    table: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(um.os, "geteuid", lambda: 1000)
    with pytest.raises(SilofsError) as exc:
        um.unmount(PATH, "/nonexistent.sock", lazy=False)
    msg = str(exc.value)
    assert "uid 4242" in msg and "only that user or root may unmount it" in msg, msg
    assert "/etc/mtab" not in msg and "\n" not in msg


def test_ones_own_mount_keeps_fusermounts_reason(
    table: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(um.os, "geteuid", lambda: 4242)
    with pytest.raises(SilofsError) as exc:
        um.unmount(PATH, "/nonexistent.sock", lazy=False)
    assert "not found in /etc/mtab" in str(exc.value)
