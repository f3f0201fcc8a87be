"""A one-node Slurm cluster (slurmctld + slurmd + munge from Debian's packages) in a
directory, with configs/slurm/prolog.sh and epilog.sh as its Prolog and Epilog, and what
a node of an operator has around it: a real job user, silofs installed for every user,
/dev/fuse usable by every user.

Owns starting and stopping those daemons (polling until the node is idle, no fixed
sleeps), creating and removing the job user, building the operator's venv, widening
/dev/fuse's mode for the duration and restoring it, and reading what a job left behind
(mounts in the mount table, mount processes in /proc). Skips, with the reason, where
Slurm, munge, root or Debian's venv are missing; removes everything it made even when
a test fails. Used by tests/integration/test_slurm.py.
"""

from __future__ import annotations

import os
import pwd
import random
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from silofs.jobend import mount_process_claims
from silofs.mountinfo import mounts
from tests.support.node import Node
from tests.support.poll import wait_for

REPO = Path(__file__).resolve().parents[2]
TOOLS = ("slurmctld", "slurmd", "munged", "sbatch", "squeue", "scontrol", "sinfo")
SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's, as an operator's venv starts from


class Slurm:
    """A one-node Slurm cluster in a directory; every command gets SLURM_CONF."""

    def __init__(self, root: Path, node: Node, public: Path) -> None:
        self.root = root
        self.node = node
        self.public = public
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: list[subprocess.Popen] = []
        self.mount_root = public / "mnt"
        self.mount_root.mkdir(mode=0o755)
        self.log = root / "silofs-slurm.log"
        self.host = socket.gethostname().split(".")[0]

    def run(self, *cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=timeout)

    def spawn(self, *cmd: str) -> None:
        out = open(self.root / f"{Path(cmd[0]).name}.out", "ab")
        self.procs.append(
            subprocess.Popen(cmd, stdout=out, stderr=out, env=self.env, start_new_session=True)
        )

    def sbatch(self, *args: str, user: str | None = None) -> str:
        """Submit as root, or as `user` (runuser: that user's own sbatch and munge
        credential, as when the user types it)."""
        cmd = ["sbatch", "--parsable", *args]
        if user is not None:
            cmd = ["runuser", "-u", user, "--", "env", f"SLURM_CONF={self.conf}", *cmd]
        res = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=60, cwd="/")
        assert res.returncode == 0, res.stderr
        return res.stdout.strip().split(";")[0]

    def state(self, job: str) -> str:
        res = self.run("scontrol", "show", "job", "-o", job)
        for field in res.stdout.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "GONE"

    def node_state(self) -> str:
        res = self.run("sinfo", "-h", "-N", "-o", "%T")
        return res.stdout.strip() if res.returncode == 0 else f"sinfo failed: {res.stderr}"

    def log_lines(self, kind: str, job: str) -> list[str]:
        """What the prolog or epilog logged for `job`, without the time and node."""
        text = self.log.read_text() if self.log.exists() else ""
        mark = f" {kind} job {job} on "
        return [ln.split(": ", 1)[1] for ln in text.splitlines() if mark in ln]

    def daemon_log(self) -> str:
        return "".join(
            p.read_text(errors="replace")[-3000:] for p in self.root.glob("*.out") if p.is_file()
        )

    # -- what a job leaves ----------------------------------------------------------
    def job_mounts(self, job: str) -> list[str]:
        """Mounts under the job's directory, from the kernel's mount table (root may not
        stat another user's FUSE mount)."""
        top = str(self.mount_root / job)
        return [e.mountpoint for e in mounts() if e.mountpoint.startswith(top + "/")]

    def mount_processes(self, job: str) -> list[int]:
        """Background silofs mount processes of silofs job slurm-JOB of this Slurm (its
        mount root: other tests on the host number their jobs from 1 too)."""
        top = str(self.mount_root / job) + "/"
        out = []
        for pid, mountpoint in mount_process_claims():
            if not mountpoint.startswith(top):
                continue
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    if f.read().rsplit(b")", 1)[1].split()[0] != b"Z":
                        out.append(pid)
            except OSError:
                continue
        return out


def start(cluster: Slurm, settings: str, munge_mode: int = 0o700) -> None:
    """munged, then slurmctld and slurmd with the prolog and epilog of this checkout
    reading `settings` (the slurm.env an operator writes); pytest.skip, after
    stopping what started, where they cannot start. munge_mode 0o755 lets other users
    reach munged's socket (their own sbatch)."""
    root = cluster.root
    for sub in ("state", "spool", "munge", "bin"):
        (root / sub).mkdir(parents=True)
    os.chmod(root / "munge", munge_mode)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    munge_socket = root / "munge" / "munge.socket"
    m = root / "munge"
    cluster.spawn(
        "munged", "--foreground", "--force", f"--key-file={key}", f"--socket={munge_socket}",
        f"--pid-file={m / 'munged.pid'}", f"--log-file={m / 'munged.log'}",
        f"--seed-file={m / 'munged.seed'}",
    )  # fmt: skip
    try:
        wait_for(munge_socket.exists, timeout=20, what="munged's socket")
    except AssertionError:
        stop(cluster)
        pytest.skip(f"munged did not start: {cluster.daemon_log()[-500:]}")

    env_file = root / "silofs-slurm.env"
    env_file.write_text(
        f"{settings}SILOFS_SLURM_LOG={cluster.log}\nexport SLURM_CONF={cluster.conf}\n"
    )
    for kind in ("prolog", "epilog"):
        wrapper = root / "bin" / f"{kind}.sh"
        wrapper.write_text(
            f"#!/bin/sh\nSILOFS_SLURM_ENV={env_file} exec {REPO}/configs/slurm/{kind}.sh\n"
        )
        wrapper.chmod(0o755)
    for attempt in range(3):
        _write_conf(cluster, munge_socket, _listen_ports(2))
        daemons = len(cluster.procs)
        cluster.spawn("slurmctld", "-D", "-f", str(cluster.conf))
        cluster.spawn("slurmd", "-D", "-f", str(cluster.conf), "-N", cluster.host)
        try:
            wait_for(lambda: cluster.node_state() in ("idle", "mixed"), timeout=60,
                     what="the Slurm node to be idle")  # fmt: skip
            return
        except AssertionError:
            logs = "".join(
                (root / n).read_text(errors="replace")[-1500:]
                for n in ("slurmctld.log", "slurmd.log")
                if (root / n).exists()
            )
        if "Address already in use" not in logs or attempt == 2:
            stop(cluster)
            pytest.skip(f"Slurm did not start on this machine: {logs[-1500:]}")
        # A port checked free was taken before Slurm bound it: other ports, fresh logs.
        stop(cluster, cluster.procs[daemons:])
        del cluster.procs[daemons:]
        for n in ("slurmctld.log", "slurmd.log"):
            (root / n).unlink(missing_ok=True)


def _listen_ports(n: int) -> list[int]:
    """`n` distinct ports free on every address (slurmctld and slurmd bind the wildcard),
    below the kernel's ephemeral range: a port from that range checked free can be taken
    by any outgoing connection before the daemon binds it."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    ports: list[int] = []
    rnd = random.Random()
    while len(ports) < n:
        port = rnd.randrange(max(1024, low - 8000), low)
        if port in ports:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                continue
        ports.append(port)
    return ports


def _write_conf(cluster: Slurm, munge_socket: Path, ports: list[int]) -> None:
    root, host = cluster.root, cluster.host
    cluster.conf.write_text(
        textwrap.dedent(f"""\
            ClusterName=silofstest
            SlurmctldHost={host}(127.0.0.1)
            SlurmctldPort={ports[0]}
            SlurmdPort={ports[1]}
            SlurmUser=root
            SlurmdUser=root
            AuthType=auth/munge
            CredType=cred/munge
            AuthInfo=socket={munge_socket}
            StateSaveLocation={root}/state
            SlurmdSpoolDir={root}/spool
            SlurmctldPidFile={root}/slurmctld.pid
            SlurmdPidFile={root}/slurmd.pid
            SlurmctldLogFile={root}/slurmctld.log
            SlurmdLogFile={root}/slurmd.log
            ProctrackType=proctrack/linuxproc
            TaskPlugin=task/none
            JobAcctGatherType=jobacct_gather/none
            AccountingStorageType=accounting_storage/none
            SchedulerType=sched/builtin
            # Slurm starts jobs in priority order only with this (sched/builtin with
            # priority/basic starts them in job id order, whatever their priority)
            PriorityType=priority/multifactor
            SelectType=select/cons_tres
            SelectTypeParameters=CR_Core
            MpiDefault=none
            ReturnToService=2
            GresTypes=gpu
            Prolog={root}/bin/prolog.sh
            Epilog={root}/bin/epilog.sh
            PrologFlags=Alloc
            SlurmdTimeout=60
            NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} Gres=gpu:2 State=UNKNOWN
            PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
        """)
    )
    # Two "GPUs": character devices like /dev/null (Slurm ignores gres without files).
    null = os.stat("/dev/null").st_rdev
    for i in range(2):
        if not (root / f"gpu{i}").exists():  # written again when Slurm starts again
            os.mknod(root / f"gpu{i}", 0o600 | stat.S_IFCHR, null)
    (root / "gres.conf").write_text(f"NodeName={host} Name=gpu File={root}/gpu[0-1]\n")


def stop(cluster: Slurm, procs: list[subprocess.Popen] | None = None) -> None:
    for proc in reversed(cluster.procs if procs is None else procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def skip_without_slurm() -> None:
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        pytest.skip(
            f"Slurm/munge not installed ({', '.join(missing)}): apt-get install slurm-wlm munge"
        )
    if os.geteuid() != 0:
        pytest.skip("a slurmd that runs prologs needs root")


# -- what an operator's node has ---------------------------------------------------------
@contextmanager
def job_user() -> Iterator[pwd.struct_passwd]:
    """A real local user with a group of its own and a home, removed afterwards with
    every process it still runs (all of them started by the tests)."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("a job user needs root and useradd (Debian's passwd package)")
    home = Path(tempfile.mkdtemp(prefix="silofs-home-", dir="/var/tmp"))
    home.chmod(0o755)  # the way to the user's home, as /home is
    name = f"silofs-{os.urandom(3).hex()}"
    res = subprocess.run(
        ["useradd", "--user-group", "--create-home", "--home-dir", str(home / name),
         "--shell", "/bin/sh", name],
        capture_output=True, text=True,
    )  # fmt: skip
    if res.returncode != 0:
        shutil.rmtree(home, ignore_errors=True)
        pytest.skip(f"useradd failed: {res.stderr.strip()}")
    try:
        yield pwd.getpwnam(name)
    finally:
        uid = pwd.getpwnam(name).pw_uid
        try:
            for pid in _pids_of(uid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            wait_for(lambda: not _pids_of(uid), what=f"{name}'s processes to end")
        finally:
            # The user goes even when a process of it outlived the wait (userdel removes
            # the account of a user still running something): a run that failed here
            # left a silofs-XXXX user on the host.
            subprocess.run(["userdel", "--force", "--remove", name], capture_output=True)
            shutil.rmtree(home, ignore_errors=True)


def _pids_of(uid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    out.append(int(entry))
            except OSError:
                pass
    return out


@contextmanager
def operator_venv() -> Iterator[Path]:
    """silofs installed as the README tells an operator: a venv of Debian's python3
    under /opt, readable by every user, and `pip install` of this checkout (a copy of
    its sources: pip builds in the tree it is given). Yields the venv's bin/."""
    probe = subprocess.run([SYSTEM_PYTHON, "-c", "import ensurepip, venv"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"{SYSTEM_PYTHON} cannot make a venv: apt-get install python3-venv")
    top = Path(tempfile.mkdtemp(prefix="silofs-test-", dir="/opt"))
    try:
        top.chmod(0o755)
        src = top / "src"
        shutil.copytree(
            REPO, src,
            ignore=shutil.ignore_patterns(".git", ".ci", "build", "*.egg-info", "__pycache__",
                                          "node_modules", ".*_cache", ".hypothesis"),
        )  # fmt: skip
        venv = top / "silofs"
        for cmd in (
            [SYSTEM_PYTHON, "-m", "venv", str(venv)],
            [str(venv / "bin" / "pip"), "install", "-q", str(src)],
        ):
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if res.returncode != 0:
                pytest.skip(f"{' '.join(cmd[:3])} failed: {res.stderr.strip()[-500:]}")
        shutil.rmtree(src)
        yield venv / "bin"
    finally:
        shutil.rmtree(top, ignore_errors=True)


@contextmanager
def fuse_for_everyone() -> Iterator[None]:
    """/dev/fuse mode 0666, as Debian's udev rule leaves it (some hosts have 0600);
    the old mode back afterwards."""
    old = stat.S_IMODE(os.stat("/dev/fuse").st_mode)
    os.chmod("/dev/fuse", old | 0o666)
    try:
        yield
    finally:
        os.chmod("/dev/fuse", old)
