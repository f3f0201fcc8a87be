"""configs/slurm/ prolog and epilog under a real one-node Slurm (slurmctld + slurmd +
munge from Debian's packages), started by a fixture on this machine.

Jobs submitted with sbatch name their dataset in --comment; the prolog mounts it and
registers the job (GPUs from Slurm's gres, f*, epochs) with a real silofs daemon; the
job reads through its mount; `silofs-ctl controller run --once` plans with what the
registrations say; the epilog unmounts and forgets the job. With `[slurm]` the
controller also reads slurmctld's queue and sets pending jobs' priorities in SJF-SiloD
order, which Slurm then starts them in. Skipped, with the reason,
where Slurm or munge is not installed or cannot start (not root, no ports).

The Slurm node has two GPUs declared as gres on two character devices made like
/dev/null (there are no GPUs here): Slurm counts and allocates them all the same, and
the count is what the prolog reads.
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
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.fixtures import needs_fuse
from tests.support.net import free_port
from tests.support.node import Node, mounted
from tests.support.poll import wait_for
from tests.support.trees import random_files, write_tree

pytestmark = [needs_fuse, pytest.mark.fuse]

REPO = Path(__file__).resolve().parents[2]
TOOLS = ("slurmctld", "slurmd", "munged", "sbatch", "squeue", "scontrol", "sinfo")


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

    def run(self, *cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=timeout)

    def spawn(self, *cmd: str) -> None:
        out = open(self.root / f"{Path(cmd[0]).name}.out", "ab")
        self.procs.append(
            subprocess.Popen(cmd, stdout=out, stderr=out, env=self.env, start_new_session=True)
        )

    def sbatch(self, *args: str) -> str:
        res = self.run("sbatch", "--parsable", *args)
        assert res.returncode == 0, res.stderr
        return res.stdout.strip().split(";")[0]

    def state(self, job: str) -> str:
        res = self.run("scontrol", "show", "job", "-o", job)
        for field in res.stdout.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "GONE"

    def daemon_log(self) -> str:
        return "".join(
            p.read_text(errors="replace")[-3000:] for p in self.root.glob("*.out") if p.is_file()
        )


@pytest.fixture
def slurm(tmp_path: Path, make_node) -> Iterator[Slurm]:  # type: ignore[no-untyped-def]
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        pytest.skip(
            f"Slurm/munge not installed ({', '.join(missing)}): apt-get install slurm-wlm munge"
        )
    if os.geteuid() != 0:
        pytest.skip("a slurmd that runs prologs needs root")
    # What a job's user must reach (the daemon's socket, the mount root, datasets) lives
    # in a directory every user may search; tmp_path is root's alone.
    public = Path(tempfile.mkdtemp(prefix="silofs-slurm-"))
    public.chmod(0o755)
    node = make_node(cache_size="64M", socket=str(public / "ctl.sock"))
    root = tmp_path / "slurm"
    for sub in ("state", "spool", "munge", "bin"):
        (root / sub).mkdir(parents=True)
    os.chmod(root / "munge", 0o700)
    cluster = Slurm(root, node, public)

    # munge: a private key and socket for this cluster only.
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
        _stop(cluster)
        node.cleanup()
        shutil.rmtree(public, ignore_errors=True)
        pytest.skip(f"munged did not start: {cluster.daemon_log()[-500:]}")

    # silofs and silofs-ctl as the prolog finds them: this interpreter, this checkout.
    for name, module in (("silofs", "silofs"), ("silofs-ctl", "silofs_ctl")):
        path = root / "bin" / name
        path.write_text(f'#!/bin/sh\nexec {sys.executable} -m {module} "$@"\n')
        path.chmod(0o755)
    env_file = root / "silofs-slurm.env"
    env_file.write_text(
        textwrap.dedent(f"""\
            SILOFS={root}/bin/silofs
            SILOFS_CTL={root}/bin/silofs-ctl
            SILOFS_SOCKET={node.socket}
            SILOFS_MOUNT_ROOT={cluster.mount_root}
            SILOFS_SLURM_LOG={cluster.log}
            export SLURM_CONF={cluster.conf}
            export PYTHONPATH={REPO}
            export PATH={os.environ.get("PATH", "/usr/bin:/bin")}
        """)
    )
    for kind in ("prolog", "epilog"):
        wrapper = root / "bin" / f"{kind}.sh"
        wrapper.write_text(
            f"#!/bin/sh\nSILOFS_SLURM_ENV={env_file} exec {REPO}/configs/slurm/{kind}.sh\n"
        )
        wrapper.chmod(0o755)

    host = socket.gethostname().split(".")[0]
    ctld, slurmd = free_port(), free_port()
    cluster.conf.write_text(
        textwrap.dedent(f"""\
            ClusterName=silofstest
            SlurmctldHost={host}(127.0.0.1)
            SlurmctldPort={ctld}
            SlurmdPort={slurmd}
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
        os.mknod(root / f"gpu{i}", 0o600 | stat.S_IFCHR, null)
    (root / "gres.conf").write_text(f"NodeName={host} Name=gpu File={root}/gpu[0-1]\n")
    cluster.spawn("slurmctld", "-D", "-f", str(cluster.conf))
    cluster.spawn("slurmd", "-D", "-f", str(cluster.conf), "-N", host)

    def idle() -> bool:
        res = cluster.run("sinfo", "-h", "-N", "-o", "%T")
        return res.returncode == 0 and res.stdout.strip() in ("idle", "mixed")

    try:
        wait_for(idle, timeout=60, what="the Slurm node to be idle")
    except AssertionError:
        logs = "".join(
            (root / n).read_text(errors="replace")[-1500:]
            for n in ("slurmctld.log", "slurmd.log")
            if (root / n).exists()
        )
        _stop(cluster)
        node.cleanup()
        shutil.rmtree(public, ignore_errors=True)
        pytest.skip(f"Slurm did not start on this machine: {logs[-1500:]}")
    try:
        yield cluster
    finally:
        cluster.run("scancel", "--full", "--user=root")
        _stop(cluster)
        for mp in cluster.mount_root.glob("*/*"):
            if mounted(mp):
                subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)
        node.cleanup()  # the daemon's socket is in `public`
        shutil.rmtree(public, ignore_errors=True)


def _stop(cluster: Slurm) -> None:
    for proc in reversed(cluster.procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _dataset(root: Path, name: str, files: int) -> Path:
    return write_tree(root / name, random_files(random.Random(), files, 512 << 10, "f{i}.bin"))


JOB_SCRIPT = """\
#!/bin/sh
# Reads its dataset through the mount the prolog made, then waits for the test.
d={mount_root}/$SLURM_JOB_ID/{name}
ls -ln "$d" > {out}/$SLURM_JOB_ID.ls
cat "$d"/*.bin | sha256sum > {out}/$SLURM_JOB_ID.tmp
mv {out}/$SLURM_JOB_ID.tmp {out}/$SLURM_JOB_ID.sum
i=0
while [ ! -e {out}/release ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
"""


def test_sbatch_jobs_mount_register_and_unmount_through_the_prolog(
    slurm: Slurm, tmp_path: Path
) -> None:
    data = _dataset(tmp_path / "data", "imagenet", 6)
    wiki = _dataset(tmp_path / "data", "wiki", 3)
    out = tmp_path / "out"
    out.mkdir()
    jobs = {}
    for ds, gpus, extra in ((data, 2, "silofs.ideal_io=40MB/s silofs.epochs=3"), (wiki, 0, "")):
        script = tmp_path / f"{ds.name}.sh"
        script.write_text(JOB_SCRIPT.format(mount_root=slurm.mount_root, name=ds.name, out=out))
        args = [f"--comment=silofs={ds} {extra}".strip(), f"--output={out}/%j.out", str(script)]
        if gpus:
            args.insert(0, f"--gres=gpu:{gpus}")
        jobs[ds.name] = slurm.sbatch(*args)
    a, b = jobs["imagenet"], jobs["wiki"]

    # Both run; each read its dataset through its own mount, as the job's user.
    for job in (a, b):
        wait_for(lambda j=job: (out / f"{j}.sum").exists(), timeout=120, what=f"job {job} to read")
    expected = subprocess.run(
        f"cat {data}/*.bin | sha256sum", shell=True, capture_output=True, text=True
    ).stdout
    assert (out / f"{a}.sum").read_text() == expected
    assert mounted(slurm.mount_root / a / "imagenet") and mounted(slurm.mount_root / b / "wiki")

    status = slurm.node.status()
    by_name = {j["name"]: j for j in status["jobs"]}
    reg_a = by_name[f"slurm-{a}"]["registration"]
    assert reg_a["gpus"] == 2 and reg_a["ideal_io"] == 40 * 10**6 and reg_a["epochs"] == 3
    assert reg_a["scheduler"] == "slurm" and reg_a["scheduler_id"] == a
    assert by_name[f"slurm-{b}"]["registration"]["gpus"] == 0
    # The job's reads reach the daemon's per-job counters (mounts report every 250 ms).
    mp = slurm.mount_root / a / "imagenet"
    slurm.node.settle(str(mp), 6 * (512 << 10))

    # The controller plans with what the prolog registered (no jobs file).
    config = tmp_path / "controller.toml"
    config.write_text(
        f'policy = "gavel"\nremote_io = "100MB/s"\n[[nodes]]\nname = "n1"\n'
        f'socket = "{slurm.node.socket}"\n'
    )
    res = subprocess.run(
        [sys.executable, "-m", "silofs_ctl", "controller", "run", "--config", str(config),
         "--once"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    print(res.stdout)
    plan_line = next(line for line in res.stdout.splitlines() if line.startswith(f"slurm-{a}"))
    assert "40.0MB/s" in plan_line  # f* from the registration, not measured
    io = slurm.node.request("GET", f"/v1/jobs/slurm-{a}/io")["bytes_per_s"]
    assert io is not None and 0 < io <= 100 * 10**6

    # Jobs end: the epilog unmounts and forgets them.
    (out / "release").touch()
    for job in (a, b):
        wait_for(lambda j=job: slurm.state(j) in ("COMPLETED", "GONE"), timeout=120,
                 what=f"job {job} to complete")  # fmt: skip
    wait_for(lambda: not any(mounted(p) for p in slurm.mount_root.glob("*/*")), timeout=60,
             what="the epilog to unmount")  # fmt: skip
    wait_for(
        lambda: not {f"slurm-{a}", f"slurm-{b}"} & {j["name"] for j in slurm.node.status()["jobs"]},
        timeout=60,
        what="the epilog to forget the jobs",
    )
    assert not list(slurm.mount_root.iterdir())
    log = slurm.log.read_text()
    print(log)
    for job in (a, b):
        assert f"prolog job {job}" in log and f"epilog job {job}" in log
    assert "FAILED" not in log


def test_prolog_without_a_silofs_comment_does_nothing_and_a_bad_dataset_fails(
    slurm: Slurm, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    plain = slurm.sbatch(f"--output={out}/%j.out", "--wrap=true")
    wait_for(lambda: slurm.state(plain) in ("COMPLETED", "GONE"), timeout=120, what="plain job")
    assert not list(slurm.mount_root.iterdir())
    # A dataset the node cannot open: the prolog fails, Slurm holds the job (and, as
    # for any prolog failure, drains the node), nothing stays mounted.
    bad = slurm.sbatch(
        f"--comment=silofs={tmp_path}/no-such-dir", f"--output={out}/%j.out", "--wrap=true"
    )
    wait_for(lambda: "FAILED" in (slurm.log.read_text() if slurm.log.exists() else ""),
             timeout=120, what="the prolog to fail")  # fmt: skip
    assert bad in slurm.log.read_text()
    assert not any(mounted(p) for p in slurm.mount_root.glob("*/*"))
    slurm.node.expect_errors(".*no-such-dir.*", ".*does not exist.*")


def test_a_job_of_another_user_is_mounted_by_that_user(slurm: Slurm) -> None:
    """The comment is the job owner's text and the prolog runs as root, so it mounts as
    the job's user (runuser): the daemon then checks the dataset as that user, as for a
    mount made by hand (those checks: tests/integration/test_security.py).

    `silofs mount` itself cannot run as another user on this machine (the interpreter
    lives under /root, 0700), so here `silofs` is a stand-in that records who ran it
    with what and fails like a refused mount; the prolog's part is what is tested."""
    record = slurm.public / "record"
    record.touch(mode=0o666)
    record.chmod(0o666)
    stand_in = slurm.public / "silofs-stand-in"
    stand_in.write_text(
        f'#!/bin/sh\necho "$(id -u) $*" >> {record}\n'
        'echo "uid $(id -u) may not search the dataset" >&2\nexit 1\n'
    )
    stand_in.chmod(0o755)
    env_file = slurm.root / "silofs-slurm.env"
    lines = env_file.read_text().splitlines()
    env_file.write_text("\n".join(f"SILOFS={stand_in}" if ln.startswith("SILOFS=") else ln
                                  for ln in lines) + "\n")  # fmt: skip
    secret = slurm.public / "secret"
    job = slurm.sbatch(
        "--uid=nobody", f"--comment=silofs={secret}", "--output=/dev/null", "--wrap=true"
    )
    wait_for(lambda: f"prolog job {job}" in (slurm.log.read_text() if slurm.log.exists() else ""),
             timeout=120, what="the prolog to run")  # fmt: skip
    log = slurm.log.read_text()
    print(log)
    assert "FAILED" in log and "may not search" in log, log
    uid, *args = record.read_text().split("\n")[0].split()
    assert int(uid) == pwd.getpwnam("nobody").pw_uid
    assert args[0] == "mount" and args[args.index("--") + 1] == str(secret)
    assert "--allow-other" not in args
    assert args[args.index("--job") + 1] == f"slurm-{job}"
    assert not list(slurm.mount_root.glob("*/*"))  # the mountpoint it made is gone


QUEUED_SCRIPT = """\
#!/bin/sh
# Reads its dataset through its mount, then runs until the test releases this job.
d={mount_root}/$SLURM_JOB_ID/{name}
cat "$d"/*.bin | sha256sum > {out}/$SLURM_JOB_ID.tmp
mv {out}/$SLURM_JOB_ID.tmp {out}/$SLURM_JOB_ID.sum
i=0
while [ ! -e {out}/release-$SLURM_JOB_ID ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done
"""


def _priority(slurm: Slurm, job: str) -> int:
    res = slurm.run("scontrol", "show", "job", "-o", job)
    for field in res.stdout.split():
        if field.startswith("Priority="):
            return int(field.split("=", 1)[1])
    raise AssertionError(f"no priority for job {job}: {res.stdout or res.stderr}")


def _controller(slurm: Slurm, config: Path, *flags: str) -> subprocess.CompletedProcess:
    res = subprocess.run(
        [sys.executable, "-m", "silofs_ctl", "-v", "controller", "run", "--config", str(config),
         *flags],
        capture_output=True, text=True, timeout=120, env=slurm.env,
    )  # fmt: skip
    print(res.stdout, res.stderr)
    return res


def test_controller_learns_the_queue_from_slurmctld_and_sets_priorities_in_sjf_order(
    slurm: Slurm, tmp_path: Path
) -> None:
    """[slurm]: the controller asks slurmctld for pending and running jobs, orders the
    pending silofs jobs by SJF-SiloD (here: same dataset, GPUs and f*, so by epochs) and
    permutes their Slurm priorities into that order; Slurm then starts the shortest
    first, and the allocations follow the jobs that run."""
    data = _dataset(tmp_path / "data", "imagenet", 4)
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "job.sh"
    script.write_text(QUEUED_SCRIPT.format(mount_root=slurm.mount_root, name="imagenet", out=out))
    hint = "silofs.ideal_io=40MB/s"

    def submit(*args: str, comment: str | None = None) -> str:
        extra = [f"--comment={comment}"] if comment else []
        return slurm.sbatch("--gres=gpu:2", *extra, f"--output={out}/%j.out", *args)

    # One job holds both GPUs; the others want both too, so they wait in the queue.
    first = submit(str(script), comment=f"silofs={data} {hint} silofs.epochs=1")
    wait_for(lambda: (out / f"{first}.sum").exists(), timeout=120, what="the first job to read")
    long = submit(str(script), comment=f"silofs={data} {hint} silofs.epochs=9")
    plain = submit("--wrap=true")  # not a silofs job: its priority is not ours to move
    short = submit(str(script), comment=f"silofs={data} {hint} silofs.epochs=1")
    mid = submit(str(script), comment=f"silofs={data} {hint} silofs.epochs=3")
    held = submit("--hold", "--wrap=true", comment=f"silofs={data} {hint} silofs.epochs=1")
    queued = (long, short, mid)
    before = {j: _priority(slurm, j) for j in (*queued, plain, held)}
    # Slurm's own order (multifactor with no weights: all 1, then submission order)
    # puts the long job first; the held job's priority is 0.
    assert before[long] >= before[short] >= before[mid] and before[held] == 0
    for job in (*queued, plain):
        assert slurm.state(job) == "PENDING"

    host = socket.gethostname().split(".")[0]
    node = f'[[nodes]]\nname = "{host}"\nsocket = "{slurm.node.socket}"\n'
    base = f'policy = "sjf"\nremote_io = "100MB/s"\n{node}'
    dry = tmp_path / "dry.toml"  # the text form of squeue, and priorities only said
    dry.write_text(base + '[slurm]\nformat = "text"\npriority = "set"\n')
    res = _controller(slurm, dry, "--dry-run")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    rows = [ln for ln in lines if ln.startswith("slurm-")]
    # the queue, in SJF order, with its dataset and GPUs as slurmctld gives them
    queue_rows = rows[rows.index(next(r for r in rows if r.startswith(f"slurm-{short} "))) :]
    assert any(r.startswith(f"slurm-{held} ") and "held" in r for r in queue_rows)
    queue_rows = [r for r in queue_rows if not r.startswith(f"slurm-{held} ")]
    assert [r.split()[0] for r in queue_rows] == [f"slurm-{j}" for j in (short, mid, long)]
    for r in queue_rows:
        assert r.split()[1] == "2" and r.endswith(f"file://{data}/") and "40.0MB/s" in r
    assert not any(r.startswith(f"slurm-{plain} ") for r in rows)
    assert f"would run: scontrol update JobId={short} Priority=" in res.stdout
    assert {j: _priority(slurm, j) for j in before} == before  # a dry run changes nothing

    config = tmp_path / "controller.toml"
    config.write_text(base + '[slurm]\npriority = "set"\n')
    res = _controller(slurm, config, "--once")
    assert res.returncode == 0, res.stderr
    after = {j: _priority(slurm, j) for j in before}
    assert after[short] > after[mid] > after[long] >= 1
    assert after[plain] == before[plain] and after[held] == 0  # not ours; held stays held
    assert "priorities in SJF-SiloD order" in res.stderr
    # the running job is planned as its registration says, and throttled
    assert any(r.startswith(f"slurm-{first} ") and "40.0MB/s" in r for r in res.stdout.splitlines())
    assert slurm.node.request("GET", f"/v1/jobs/slurm-{first}/io")["bytes_per_s"]
    # Once in order, nothing more to set.
    res = _controller(slurm, config, "--once")
    assert res.returncode == 0 and "scontrol update" not in res.stdout, res.stdout

    # slurmctld unreachable (a config naming a port nobody listens on): one line, and
    # the round goes on with what the daemon knows.
    dead_conf = tmp_path / "dead-slurm.conf"
    dead_conf.write_text(
        "\n".join(
            f"SlurmctldPort={free_port()}" if ln.startswith("SlurmctldPort=") else ln
            for ln in slurm.conf.read_text().splitlines()
        )
        + "\n"
    )
    dead = tmp_path / "dead.toml"
    dead.write_text(base + '[slurm]\npriority = "set"\ntimeout = "3s"\n')
    res = subprocess.run(
        [sys.executable, "-m", "silofs_ctl", "controller", "run", "--config", str(dead), "--once"],
        capture_output=True, text=True, timeout=120,
        env={**slurm.env, "SLURM_CONF": str(dead_conf)},
    )  # fmt: skip
    print(res.stdout, res.stderr)
    assert res.returncode == 0, res.stderr
    warnings = [ln for ln in res.stderr.splitlines() if "slurm:" in ln]
    assert len(warnings) == 1 and "planning with what the daemons know" in warnings[0]
    assert any(r.startswith(f"slurm-{first} ") for r in res.stdout.splitlines())

    # The first job ends: Slurm starts the SJF-first job, and its allocation follows.
    (out / f"release-{first}").touch()
    wait_for(lambda: slurm.state(short) == "RUNNING", timeout=120, what="the short job to start")
    assert slurm.state(mid) == "PENDING" and slurm.state(long) == "PENDING"
    wait_for(lambda: (out / f"{short}.sum").exists(), timeout=120, what="the short job to read")
    res = _controller(slurm, config, "--once")
    assert res.returncode == 0, res.stderr
    rows = res.stdout.splitlines()
    assert any(r.startswith(f"slurm-{short} ") and "40.0MB/s" in r for r in rows)
    assert not any(r.startswith(f"slurm-{first} ") for r in rows)  # gone with its epilog
    assert slurm.node.request("GET", f"/v1/jobs/slurm-{short}/io")["bytes_per_s"]
    for job in (short, mid, long):
        (out / f"release-{job}").touch()
    log = slurm.log.read_text()
    print(log)
    assert "FAILED" not in log
