"""Mounts a job makes in a mount namespace of its own are no dead mounts of the node:
why the epilog's `silofs end-dead-mounts` looks at the node's mount table only.
(The dead mounts it does end, of real users' jobs under Slurm: tests/integration/
test_slurm.py.)

A job's mount namespace (`unshare -m`, a container runtime) is freed with its last
process, and its mounts with it: a mount process killed with the job leaves nothing.
A mount made there reaches the node's table only by propagation from a shared mount of
the node, and then it is a mount of the user in the node's table like any other, which
end-dead-mounts ends when it is dead. A user without root gets a mount namespace only
with a user namespace of its own (`unshare -Urm`), whose mounts never propagate back
to the node's (its copies of the node's shared mounts are slaves).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from silofs.jobend import mount_process_claims
from silofs.mountinfo import mounts
from tests.support.fixtures import needs_fuse
from tests.support.node import silofs_cmd
from tests.support.poll import wait_for

pytestmark = [needs_fuse, pytest.mark.fuse]

FUSECTL = Path("/sys/fs/fuse/connections")


def _in_table(path: Path) -> bool:
    return any(e.mountpoint == str(path) for e in mounts())


@pytest.fixture
def site(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        pytest.skip("unshare -m and a shared mount need root")
    data = tmp_path / "data"
    data.mkdir()
    (data / "f.bin").write_bytes(os.urandom(64 << 10))
    return tmp_path


def test_a_mount_in_a_jobs_own_mount_namespace_ends_with_the_namespace(
    site: Path, make_node
) -> None:  # type: ignore[no-untyped-def]
    """`unshare -m` (private propagation, util-linux's default), `silofs mount` in it:
    the node's table never has the mount; kill -9 of its mount process, the namespace's
    last process, and the kernel lets go of the FUSE connection (its /sys/fs/fuse/
    connections entry goes, as it does only when the mount is gone): nothing is dead
    anywhere for the epilog to find."""
    node = make_node()
    mp = site / "own"
    mp.mkdir()
    res = subprocess.run(
        ["unshare", "-m", "--", *silofs_cmd("mount", str(site / "data"), str(mp),
                                             "--socket", node.socket)],
        capture_output=True, text=True, env=node.env, cwd=site, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    (pid,) = [p for p, claimed in mount_process_claims() if claimed == str(mp)]
    try:
        assert os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
        theirs = [ln.split() for ln in open(f"/proc/{pid}/mountinfo") if f" {mp} " in ln]
        assert theirs and not _in_table(mp)
        connection = FUSECTL / theirs[0][2].split(":")[1]
        watched = FUSECTL.is_dir() and any(e.mountpoint == str(FUSECTL) for e in mounts())
        assert connection.exists() or not watched
    finally:
        os.kill(pid, signal.SIGKILL)
    if watched:
        wait_for(lambda: not connection.exists(), timeout=10, what="the connection to go")
    wait_for(lambda: not node.status()["mounts"], timeout=10, what="the daemon's reaper")
    assert not _in_table(mp)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A shared mount of the node (as systemd makes /), every user may write in, under
    a directory every user may search (tmp_path is root's alone)."""
    if os.geteuid() != 0:
        pytest.skip("a shared mount needs root")
    top = Path(tempfile.mkdtemp(prefix="silofs-ns-"))
    top.chmod(0o755)
    path = top / "shared"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=1777", "a9", str(path)],
                   check=True)  # fmt: skip
    try:
        subprocess.run(["mount", "--make-shared", str(path)], check=True)
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
        shutil.rmtree(top, ignore_errors=True)


def test_an_unprivileged_users_namespace_mounts_nothing_into_the_nodes_table(
    shared: Path,
) -> None:
    """`unshare -Urm --propagation unchanged` as a user without root, under a shared
    mount of the node: its mount there is its namespace's alone (the node's shared
    mount is a slave in it), never in the node's table."""
    site = shared / "job"
    site.mkdir(mode=0o777)
    site.chmod(0o777)
    nobody = pwd.getpwnam("nobody").pw_name
    res = subprocess.run(
        ["runuser", "-u", nobody, "--", "unshare", "-Urm", "--propagation", "unchanged",
         "sh", "-c", f"mount -t tmpfs a9 {site} && grep ' {shared} ' /proc/self/mountinfo"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if res.returncode != 0 and "unshare failed" in res.stderr:
        pytest.skip(f"no unprivileged user namespaces here: {res.stderr.strip()}")
    assert res.returncode == 0, res.stderr
    assert " master:" in res.stdout  # a slave of the node's shared mount: nothing back
    assert not _in_table(site)
