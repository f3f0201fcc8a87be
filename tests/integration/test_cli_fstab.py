"""`mount -t silofs` and an fstab line, through the real mount(8) and the mount.silofs
helper linked at /sbin/mount.silofs as the README says."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from silofs.cli_mount import FLAG_OPTIONS, IGNORED, VALUE_OPTIONS, options_to_flags, parse_argv
from silofs.errors import UsageError
from tests.support.fixtures import needs_fuse
from tests.support.node import Node, mounted

HELPER_LINK = Path("/sbin/mount.silofs")


def test_helper_options_become_flags() -> None:
    flags = options_to_flags(
        "job=train,cache_size=500G,allow_other,_netdev,nofail,ro,x-systemd.a=1"
    )
    assert flags == ["--job", "train", "--cache-size", "500G", "--allow-other"]
    with pytest.raises(UsageError, match="unknown mount option 'frob'"):
        options_to_flags("job=a,frob")
    assert options_to_flags("job=a,frob", sloppy=True) == ["--job", "a"]
    assert options_to_flags("rw,job=a") == ["--job", "a"]  # mount(8) adds rw by default
    assert parse_argv(["s3://b/", "/mnt", "-sfnv", "-o", "job=a", "-oallow_other"]) == (
        "s3://b/", "/mnt", "job=a,allow_other", True, True, True,
    )  # fmt: skip


def test_every_mount_flag_is_an_option() -> None:
    """README: "`-o` takes the `silofs mount` flags with `_` for `-`": all of them, but
    --foreground (the helper's own business) and --help."""
    from silofs.cli import mount

    names = {p.name for p in mount.params if p.name and p.param_type_name == "option"}
    names -= {"foreground", "help"}
    missing = sorted(names - VALUE_OPTIONS - FLAG_OPTIONS - IGNORED)
    assert not missing, f"silofs mount flags mount.silofs does not take: {missing}"
    assert options_to_flags("list_in_background,no_start_daemon,read_only") == [
        "--list-in-background", "--no-start-daemon",
    ]  # fmt: skip


@pytest.fixture
def helper_link() -> Iterator[Path]:
    """/sbin/mount.silofs -> this venv's helper, for the test's duration only. A lock
    keeps two test runs (other worktrees) from swapping the link under each other."""
    if os.geteuid() != 0:
        pytest.skip("mount(8) with a helper in /sbin needs root")
    helper = Path(sys.executable).parent / "mount.silofs"
    if not helper.exists():
        pytest.skip("mount.silofs is not installed in this venv (pip install -e .)")
    with open("/tmp/silofs-test-sbin-helper.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        previous = os.readlink(HELPER_LINK) if HELPER_LINK.is_symlink() else None
        if HELPER_LINK.exists() and previous is None:
            pytest.skip(f"{HELPER_LINK} exists and is not a link: not touching it")
        HELPER_LINK.unlink(missing_ok=True)
        HELPER_LINK.symlink_to(helper)
        try:
            yield HELPER_LINK
        finally:
            HELPER_LINK.unlink(missing_ok=True)
            if previous is not None:
                HELPER_LINK.symlink_to(previous)


@needs_fuse
@pytest.mark.fuse
def test_mount_t_silofs_and_an_fstab_line(
    make_node, local_store, bucket_name, tmp_path: Path, monkeypatch, helper_link: Path
) -> None:
    if shutil.which("mount") is None:
        pytest.skip("mount(8) is not installed")
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"d/a.txt": b"hello", "b.bin": b"x" * 5000})
    node: Node = make_node()
    uri = local_store.uri(bucket_name)
    env = {**node.env, "PATH": os.environ.get("PATH", "/usr/bin:/bin")}

    mp = tmp_path / "by-mount"
    mp.mkdir()
    node.mountpoints.append(str(mp))
    res = subprocess.run(
        ["mount", "-t", "silofs", "-o", f"job=viamount,socket={node.socket},ro,_netdev",
         uri, str(mp)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert mounted(mp) and (mp / "d/a.txt").read_bytes() == b"hello"
    assert node.mount_status(str(mp))["job"] == "viamount"

    fstab = tmp_path / "fstab"
    mp2, mp3 = tmp_path / "by-fstab", tmp_path / "by-fstab-bad"
    mp2.mkdir()
    mp3.mkdir()
    node.mountpoints += [str(mp2), str(mp3)]
    fstab.write_text(
        "# a test fstab\n"
        f"{uri} {mp2} silofs job=fstab,socket={node.socket},allow_other,_netdev,nofail 0 0\n"
        f"{uri} {mp3} silofs noauto,job=never,socket={node.socket} 0 0\n"
    )
    res = subprocess.run(
        ["mount", "-a", "--fstab", str(fstab)], capture_output=True, text=True, env=env,
        timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert mounted(mp2) and (mp2 / "b.bin").read_bytes() == b"x" * 5000
    assert not mounted(mp3)  # noauto: mount -a leaves it
    m = node.mount_status(str(mp2))
    assert m["job"] == "fstab"
    # mount(8) reports a bad option from the helper with its "mount failure" code.
    res = subprocess.run(
        ["mount", "-t", "silofs", "-o", f"socket={node.socket},bogus", uri, str(mp3)],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert res.returncode != 0 and "unknown mount option 'bogus'" in res.stderr
    assert not mounted(mp3)
    for path in (mp, mp2):
        assert node.run("unmount", str(path)).returncode == 0
        assert not mounted(path)
