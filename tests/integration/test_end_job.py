"""`silofs end-job` (what a scheduler's epilog runs, as root) on real FUSE mounts with a
real daemon: the job's mounts in its directory and the daemon's other mounts of the job
end, a reader holding a file open does not keep one, the job is forgotten, and a daemon
that is dead or frozen costs seconds, not minutes, and is named in what is left.
(Under a real Slurm, with mounts of a real second user: tests/integration/test_slurm.py.)
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from silofs.control.client import ControlClient
from silofs.mountinfo import mounts
from silofs.pids import pid_alive
from tests.support.asuser import Identity, Session
from tests.support.fixtures import needs_fuse
from tests.support.node import Node, mounted, silofs_cmd
from tests.support.poll import wait_for

pytestmark = [needs_fuse, pytest.mark.fuse]

JOB = "slurm-7"


@pytest.fixture
def site(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        pytest.skip("end-job unmounts other users' mounts: it runs as root")
    data = tmp_path / "data"
    data.mkdir()
    for i in range(3):
        (data / f"f{i}.bin").write_bytes(os.urandom(256 << 10))
    return tmp_path


def end_job(node: Node, directory: Path) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    res = subprocess.run(
        silofs_cmd("end-job", "--dir", str(directory), "--", JOB),
        capture_output=True, text=True, env=node.env, timeout=120,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    print(res.stdout, res.stderr, f"{elapsed:.1f}s")
    return res, elapsed


def mount_processes(node: Node) -> list[int]:
    """Live (not zombie) mount processes of this node's socket."""
    out = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if b"mount-process" in argv and node.socket.encode() in argv and state != b"Z":
            out.append(int(entry))
    return out


def assert_held_read_fails(held: int) -> None:
    """The held file's next read that reaches the mount fails; nothing waits on it."""
    os.posix_fadvise(held, 0, 0, os.POSIX_FADV_DONTNEED)
    with pytest.raises(OSError) as err:
        os.pread(held, 4096, 200 << 10)
    assert err.value.errno in (errno.ENOTCONN, errno.ENODEV, errno.ECONNABORTED)


def test_the_jobs_mounts_end_wherever_they_are_and_the_job_is_forgotten(
    site: Path, make_node
) -> None:  # type: ignore[no-untyped-def]
    node = make_node()
    job_dir = site / "jobs" / "7"
    inside = node.mount(str(site / "data"), job_dir / "data", "--job", JOB)
    second = node.mount(str(site / "data"), job_dir / "more", "--job", JOB)
    elsewhere = node.mount(str(site / "data"), site / "elsewhere", "--job", JOB)
    other = node.mount(str(site / "data"), site / "other", "--job", "another")
    node.request("PUT", f"/v1/jobs/{JOB}", {"gpus": 2, "datasets": [f"file://{site}/data/"]})
    processes = set(mount_processes(node))
    assert len(processes) == 4
    held = os.open(inside / "f1.bin", os.O_RDONLY)  # a reader that outlived the job
    try:
        assert os.read(held, 4096)
        res, _ = end_job(node, job_dir)
        assert res.returncode == 0, res.stderr
        lines = res.stdout.splitlines()
        assert f"{inside} is busy (a process holds files open in it): detached it" in lines
        assert any(ln.startswith("SIGTERM to ") and str(inside) in ln for ln in lines), lines
        for mp in (second, elsewhere):
            assert f"unmounted {mp}" in lines
        assert f"removed {job_dir}" in lines and f"forgot job {JOB}" in lines
        assert_held_read_fails(held)
    finally:
        os.close(held)
    assert not [m for m in (inside, second, elsewhere) if mounted(m)]
    assert mounted(other) and (other / "f0.bin").read_bytes()  # another job's: untouched
    assert mount_processes(node) == [node.mount_status(str(other))["pid"]]
    assert not job_dir.exists() and elsewhere.is_dir()  # only the job's directory goes
    status = node.status()
    assert JOB not in {j["name"] for j in status["jobs"]}
    assert [m["job"] for m in status["mounts"]] == ["another"]
    # Again: nothing of the job is left, and that is no error.
    res, _ = end_job(node, job_dir)
    assert res.returncode == 0 and f"job {JOB} was not registered on the daemon" in res.stdout


def test_a_held_mount_of_several_serving_processes_ends_on_sigterm(site: Path, make_node) -> None:  # type: ignore[no-untyped-def]
    """Detached lazily, a mount stays connected while any serving process holds the
    device: the supervisor's SIGTERM must end them all, not leave them to SIGKILL."""
    node = make_node()
    job_dir = site / "jobs" / "7"
    mp = node.mount(str(site / "data"), job_dir / "data", "--job", JOB, "--serve-processes", "2")
    assert len(mount_processes(node)) == 3  # the supervisor and two serving processes
    held = os.open(mp / "f1.bin", os.O_RDONLY)
    try:
        assert os.read(held, 4096)
        res, _ = end_job(node, job_dir)
        assert res.returncode == 0, res.stderr
        assert f"{mp} is busy (a process holds files open in it): detached it" in res.stdout
        assert "SIGKILL" not in res.stdout, res.stdout
        assert_held_read_fails(held)
    finally:
        os.close(held)
    assert mount_processes(node) == [] and not job_dir.exists()


def test_a_dead_daemon_costs_no_time_and_is_named_in_what_is_left(site: Path, make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node()
    job_dir = site / "jobs" / "7"
    mp = node.mount(str(site / "data"), job_dir / "data", "--job", JOB)
    node.kill9()
    res, elapsed = end_job(node, job_dir)
    assert res.returncode == 1
    assert f"unmounted {mp}" in res.stdout and f"kept {job_dir}" in res.stdout  # for a rerun
    (error,) = res.stderr.splitlines()
    assert error.startswith(f"silofs: error: left of job {JOB}: job {JOB} on the daemon")
    assert "cannot reach the silofs daemon" in error
    assert not mounted(mp) and not mount_processes(node)
    assert elapsed < 10  # no retries against a daemon that is not there


def test_a_frozen_daemon_is_waited_for_seconds_and_the_mounts_end_anyway(
    site: Path, make_node
) -> None:  # type: ignore[no-untyped-def]
    node = make_node()
    job_dir = site / "jobs" / "7"
    mp = node.mount(str(site / "data"), job_dir / "data", "--job", JOB)
    assert node.proc is not None
    node.proc.send_signal(signal.SIGSTOP)
    try:
        res, elapsed = end_job(node, job_dir)
    finally:
        node.proc.send_signal(signal.SIGCONT)
    assert res.returncode == 1
    assert "did not answer GET /v1/status within 2s" in res.stdout
    assert f"unmounted {mp}" in res.stdout and f"kept {job_dir}" in res.stdout  # for a rerun
    assert "did not answer" in res.stderr and f"left of job {JOB}" in res.stderr
    assert not mounted(mp) and not mount_processes(node)
    assert elapsed < 15  # one 2 s request, and the mount process's few seconds


def test_an_unmounted_mount_exits_in_seconds_while_its_daemon_is_frozen(
    site: Path, make_node
) -> None:  # type: ignore[no-untyped-def]
    """The mount's last report after the kernel ends its session is bounded: a frozen
    daemon kept the ended mount's process (and whoever waits for it) for the client's
    whole 30 s timeout."""
    node = make_node()
    mp = node.mount(str(site / "data"), site / "m", "--job", JOB)
    pid = node.mount_pid(mp)
    assert node.proc is not None
    node.proc.send_signal(signal.SIGSTOP)
    try:
        subprocess.run(["fusermount3", "-u", str(mp)], check=True, capture_output=True)
        wait_for(lambda: not pid_alive(pid), timeout=10, what="the mount process's exit")
    finally:
        node.proc.send_signal(signal.SIGCONT)
    assert not mounted(mp)


def _open_and_register(sock: str, uri: str, job: str, mountpoint: str) -> str:
    """As another user: open a dataset and register a mount of `job` that names
    `mountpoint`, a path this process does not serve. The registration's id."""
    with ControlClient(sock, timeout=30) as client:
        ds = client.request("POST", "/v1/datasets", {"uri": uri})
        while ds["state"] in ("checking", "listing"):
            time.sleep(0.05)
            ds = client.request("GET", f"/v1/datasets/{ds['id']}")
        body = {"dataset": ds["id"], "job": job, "mountpoint": mountpoint}
        return client.request("POST", "/v1/mounts", body)["id"]


@pytest.fixture
def public() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="silofs-endjob-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_row_naming_another_users_mount_does_not_get_it_unmounted(
    public: Path, make_node
) -> None:  # type: ignore[no-untyped-def]
    """A mount row says what its process claimed: a user who registers a mount of the
    job naming root's mount does not get root's mount ended (nor is it the job's)."""
    data = public / "data"
    data.mkdir(mode=0o755)
    (data / "f.bin").write_bytes(b"x" * 4096)
    node = make_node(socket=str(public / "ctl.sock"))
    roots = node.mount(str(data), public / "roots", "--job", "root-job")
    liar = Session(Identity.nobody())
    # The job is the liar's own, as its prolog registers it (a slurm-N name is usable
    # only by the uid its registration names).
    node.request("PUT", f"/v1/jobs/{JOB}", {"gpus": 0, "uid": liar.who.uid})
    try:
        liar.call(_open_and_register, node.socket, str(data), JOB, str(roots))
        res, _ = end_job(node, public / "jobs" / "7")
        assert res.returncode == 1
        assert f"not unmounting {roots}" in res.stdout
        assert mounted(roots) and any(e.mountpoint == str(roots) for e in mounts())
        assert f"{roots} still uses it" in res.stderr  # the row is still there, and said
    finally:
        liar.close()


def _tmpfs(path: Path) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "a9", str(path)], check=True)


def _table_has(path: Path) -> bool:
    return any(e.mountpoint == str(path) for e in mounts())


def test_a_directory_swapped_for_a_symlink_after_the_scan_leads_to_no_other_mount(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The directories on the way to a job's mount are its user's (the mountpoint the
    prolog chowned to them): once end-job has read the mount table, the user renames
    one and puts a symlink to another job's directory in its place. Root's unmount must
    not follow it and detach the other job's mount (or /run, or any mount the link
    leads to); the job's own mount is named as left, for a person to look at."""
    from silofs import jobend

    job = site / "mnt" / "42"
    (job / "ds" / "a" / "run").mkdir(parents=True)
    victim = site / "mnt" / "43" / "ds" / "run"  # another user's job, the same shape
    victim.mkdir(parents=True)
    done: list[Path] = []
    try:
        for path in (job / "ds" / "a" / "run", victim):
            _tmpfs(path)
            done.append(path)
        read_table = jobend.mounts

        def table_then_swap() -> list:
            table = read_table()
            if not (job / "ds" / "b").exists():  # the user's move, after the scan
                (job / "ds" / "a").rename(job / "ds" / "b")
                (job / "ds" / "a").symlink_to(victim.parent)
                done[0] = job / "ds" / "b" / "run"
            return table

        monkeypatch.setattr(jobend, "mounts", table_then_swap)
        said: list[str] = []
        left = jobend.end_job("slurm-42", str(job), str(site / "no-daemon.sock"), said.append)
        print("\n".join(said))
        assert _table_has(victim), "the other job's mount was unmounted through the symlink"
        assert f"mount {job}/ds/b/run" in left  # the job's mount is left and said so
        assert any("not following it as root" in line for line in said)
    finally:
        for path in reversed(done):
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_a_mount_nested_in_the_jobs_directory_is_still_unmounted(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The unmount opens each directory on the way without following symlinks: a
    plain nested mount (the user's own, inside its mountpoint) still ends."""
    from silofs import jobend

    job = site / "mnt" / "44"
    inner = job / "ds" / "sub dir" / "m"  # a space: the mount table escapes it
    inner.mkdir(parents=True)
    _tmpfs(inner)
    try:
        said: list[str] = []
        left = jobend.end_job("slurm-44", str(job), str(site / "no-daemon.sock"), said.append)
        print("\n".join(said))
        assert not _table_has(inner)
        assert f"unmounted {inner}" in said
        assert not [x for x in left if x.startswith("mount ")]
    finally:
        subprocess.run(["umount", "-l", str(inner)], capture_output=True)


def test_run_again_once_the_daemon_is_back_it_forgets_the_job(site: Path, make_node) -> None:  # type: ignore[no-untyped-def]
    """The epilog ran while the node daemon was down (exit 1, the node drained); the
    operator starts the daemon and runs the epilog again, as Slurm's docs say to. The
    job's directory is what tells the epilog a job is silofs's: had the first run
    removed it, the second would exit 0 at once and the job's registration and its IO
    allocation (persisted) would stay on the daemon for good."""
    node = make_node()
    job_dir = site / "jobs" / "7"
    mp = node.mount(str(site / "data"), job_dir / "data", "--job", JOB)
    node.request("PUT", f"/v1/jobs/{JOB}", {"gpus": 1, "datasets": [f"file://{site}/data/"]})
    node.request("PUT", f"/v1/jobs/{JOB}/io", {"bytes_per_s": 100_000_000})
    node.kill9()
    res, _ = end_job(node, job_dir)
    assert res.returncode == 1 and not mounted(mp)
    assert job_dir.is_dir(), "the job's directory went while the job is still on the daemon"
    assert f"kept {job_dir}" in res.stdout
    node.start()
    assert JOB in {j["name"] for j in node.status()["jobs"]}  # persisted: still there
    res, _ = end_job(node, job_dir)
    assert res.returncode == 0, res.stderr
    assert f"forgot job {JOB}" in res.stdout and f"removed {job_dir}" in res.stdout
    assert not job_dir.exists()
    assert JOB not in {j["name"] for j in node.status()["jobs"]}
