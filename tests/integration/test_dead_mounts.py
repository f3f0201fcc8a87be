"""`silofs end-dead-mounts` (silofs/deadmounts.py) on real FUSE mounts, without Slurm:
a path the user swaps after the probes leads root's detach to no other mount; and
mounts a job makes in a mount namespace of its own are no dead mounts of the node, why
it looks at the node's mount table only. (The dead mounts it ends, of real users' jobs
under Slurm: tests/integration/test_slurm.py.)

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
    pids = [p for p, claimed in mount_process_claims() if claimed == str(mp)]
    try:
        (pid,) = pids
        assert os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
        theirs = [ln.split() for ln in open(f"/proc/{pid}/mountinfo") if f" {mp} " in ln]
        assert theirs and not _in_table(mp)
        connection = FUSECTL / theirs[0][2].split(":")[1]
        watched = FUSECTL.is_dir() and any(e.mountpoint == str(FUSECTL) for e in mounts())
        assert connection.exists() or not watched
    finally:
        # Every claimant, whatever failed: nothing unmounts a namespace's mount for us.
        for p in pids:
            os.kill(p, signal.SIGKILL)
    # Waits for what the kernel and the daemon (its reaper ticks every 2 s) do
    # asynchronously: the default deadline, as their time is not what is asserted.
    if watched:
        wait_for(lambda: not connection.exists(), what="the connection to go")
    wait_for(lambda: not node.status()["mounts"], what="the daemon's reaper")
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


def test_a_path_swapped_after_the_probe_leads_the_detach_to_no_other_mount(
    site: Path, make_node, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """The directories on the way to a user's mount are the user's: after the probes
    said two mounts are dead, the user renames the way to one and puts another mount at
    its path, and swaps the way to the other for a symlink to a directory holding
    another mount. Root detaches neither other mount (the mount at the path is not the
    one probed; a symlink is not followed) and says so; a dead mount whose path stayed
    is detached, a live one is not. (Root's own mounts here, the candidates limited to
    this test's: other tests on this host have root's mounts too.)"""
    from silofs import deadmounts

    node = make_node()
    data = str(site / "data")
    moved, linked, plain, live = (node.mount(data, site / d / "m") for d in "acef")
    for mp in (moved, linked, plain):
        for pid in [p for p, claimed in mount_process_claims() if claimed == str(mp)]:
            os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not [c for c in mount_process_claims() if c[1] in {str(moved), str(linked),
             str(plain)}], what="the mount processes to die")  # fmt: skip
    ours = {str(moved), str(linked), str(plain), str(live)}
    real_candidates = deadmounts.candidates
    monkeypatch.setattr(
        deadmounts,
        "candidates",
        lambda uid: [e for e in real_candidates(uid) if e.mountpoint in ours],
    )
    others = [site / "a" / "m", site / "v" / "m"]  # the mounts the swaps lead to
    real_answers = deadmounts._answers

    def answers_then_swap(children: dict, timeout: float) -> dict:
        got = real_answers(children, timeout)
        if not (site / "b").exists():  # the user's moves, once the probes have answered
            (site / "a").rename(site / "b")
            (site / "c").rename(site / "d")
            for path in others:
                path.mkdir(parents=True)
                subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "a9", str(path)],
                               check=True)  # fmt: skip
            (site / "c").symlink_to(site / "v")
        return got

    monkeypatch.setattr(deadmounts, "_answers", answers_then_swap)
    try:
        said: list[str] = []
        left = deadmounts.end_dead_mounts(0, said.append)
        print("\n".join(said))
        assert said == [
            f"cannot detach {moved}, a dead silofs mount of uid 0: the path leads to another "
            "mount now",
            f"cannot detach {linked}, a dead silofs mount of uid 0: a directory on its path is "
            "no longer one (a symlink?); not following it",
            f"detached {plain}, a dead silofs mount of uid 0 (its mount process is gone)",
        ]
        assert left == [str(moved), str(linked)]
        assert all(_in_table(p) for p in others)  # the mounts the swaps led to
        assert _in_table(site / "b" / "m") and _in_table(site / "d" / "m")  # moved, kept
        assert not _in_table(plain) and _in_table(live)
        assert (live / "f.bin").read_bytes() == (site / "data" / "f.bin").read_bytes()
    finally:
        for path in (*others, site / "b" / "m", site / "d" / "m", plain):
            if _in_table(path):
                subprocess.run(["umount", "-l", str(path)], capture_output=True)
