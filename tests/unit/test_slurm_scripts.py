"""configs/slurm/prolog.sh and epilog.sh run with the SLURM_* environment slurmd gives
them, with stand-ins for `silofs` and `silofs-ctl` that record their arguments: what
the scripts do with a job's comment, whatever the comment says. (The real thing, under
a real Slurm with a real daemon: tests/integration/test_slurm.py.)"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def site(tmp_path: Path) -> dict[str, Path]:
    if shutil.which("bash") is None:
        pytest.skip("bash is not installed")
    record = tmp_path / "record"
    for name in ("silofs", "silofs-ctl"):
        stand_in = tmp_path / name
        stand_in.write_text(f'#!/bin/sh\necho "{name} $*" >> {record}\nexit 0\n')
        stand_in.chmod(0o755)
    root = tmp_path / "mnt"
    root.mkdir(mode=0o755)
    env = tmp_path / "slurm.env"
    env.write_text(
        f"SILOFS={tmp_path}/silofs\nSILOFS_CTL={tmp_path}/silofs-ctl\n"
        f"SILOFS_MOUNT_ROOT={root}\nSILOFS_SLURM_LOG={tmp_path}/log\n"
        f"SILOFS_SOCKET={tmp_path}/ctl.sock\n"
    )
    return {"tmp": tmp_path, "record": record, "root": root, "env": env}


def run(site: dict[str, Path], script: str, **slurm: str) -> subprocess.CompletedProcess:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "SILOFS_SLURM_ENV": str(site["env"]),
        **slurm,
    }
    return subprocess.run(
        [str(REPO / "configs" / "slurm" / script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_comment_cannot_steer_paths_or_options(site: dict[str, Path]) -> None:
    comment = "other=1 silofs=s3://b/imagenet/ silofs=/x/.. silofs=-rf silofs=/y/imagenet "
    comment += "silofs.ideal_io=500MB/s silofs.epochs=2"
    res = run(
        site,
        "prolog.sh",
        SLURM_JOB_ID="42",
        SLURM_JOB_UID="0",
        SLURM_JOB_GPUS="0,1",
        SLURM_JOB_COMMENT=comment,
    )
    assert res.returncode == 0, res.stderr + site["tmp"].joinpath("log").read_text()
    lines = site["record"].read_text().splitlines()
    mounts = [ln.split() for ln in lines if ln.startswith("silofs mount")]
    # Every URI after "--" (so "-rf" is a URI, not an option); names are plain and unique.
    got = {m[m.index("--") + 1]: Path(m[m.index("--") + 2]).name for m in mounts}
    assert got == {
        "s3://b/imagenet/": "imagenet",
        "/x/..": "data",
        "-rf": "-rf",
        "/y/imagenet": "imagenet-2",
    }
    assert all(Path(m[m.index("--") + 2]).parent == site["root"] / "42" for m in mounts)
    assert oct(site["root"].stat().st_mode & 0o777) == "0o755"  # not chowned, not moved
    (register,) = [ln.split() for ln in lines if ln.startswith("silofs-ctl job register")]
    assert register[3] == "slurm-42"
    opts = dict(zip(register[4::2], register[5::2], strict=False))
    assert opts["--gpus"] == "2" and opts["--ideal-io"] == "500MB/s" and opts["--epochs"] == "2"
    assert opts["--uid"] == "0"
    # Registered before the first mount (docs/SECURITY.md "Jobs"), and never forgotten
    # by a prolog that succeeds.
    assert lines[0].startswith("silofs-ctl job register") and len(mounts) == 4
    assert not any(ln.startswith("silofs-ctl forget") for ln in lines)

    res = run(site, "epilog.sh", SLURM_JOB_ID="42")
    assert res.returncode == 0, res.stderr
    # The job's directory and name, the name after "--": the epilog leaves the rest
    # (finding, unmounting, forgetting) to `silofs end-job`.
    assert f"silofs end-job --dir {site['root']}/42 -- slurm-42" in site["record"].read_text()


def test_the_epilog_logs_each_line_of_end_job_and_fails_when_something_is_left(
    site: dict[str, Path],
) -> None:
    (site["root"] / "9").mkdir()
    stand_in = site["tmp"] / "silofs"
    stand_in.write_text(
        '#!/bin/sh\necho "unmounted /mnt/silofs/9/ds"\n'
        'echo "silofs: error: left of job slurm-9: mount process 123" >&2\nexit 1\n'
    )
    res = run(site, "epilog.sh", SLURM_JOB_ID="9")
    assert res.returncode == 1
    log = site["tmp"].joinpath("log").read_text().splitlines()
    assert [ln.split(": ", 1)[1] for ln in log] == [
        "unmounted /mnt/silofs/9/ds",
        "silofs: error: left of job slurm-9: mount process 123",
        "FAILED: silofs end-job exited 1",
    ]
    assert all(" epilog job 9 on " in ln for ln in log)
    # Not a silofs job (no directory): nothing runs, nothing is logged.
    stand_in.write_text("#!/bin/sh\nexit 1\n")
    res = run(site, "epilog.sh", SLURM_JOB_ID="10")
    assert res.returncode == 0 and len(site["tmp"].joinpath("log").read_text().splitlines()) == 3


def test_no_silofs_token_means_nothing_and_an_odd_job_id_is_refused(
    site: dict[str, Path],
) -> None:
    res = run(site, "prolog.sh", SLURM_JOB_ID="7", SLURM_JOB_COMMENT="just a comment")
    assert res.returncode == 0 and not site["record"].exists()
    assert not (site["root"] / "7").exists()
    res = run(site, "prolog.sh", SLURM_JOB_ID="../../etc", SLURM_JOB_COMMENT="silofs=/x")
    assert res.returncode == 1 and not site["record"].exists()
    res = run(site, "epilog.sh", SLURM_JOB_ID="../../etc")
    assert res.returncode == 1


def _stand_in(site: dict[str, Path], name: str, body: str) -> None:
    path = site["tmp"] / "bin" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(f'#!/bin/sh\necho "{name} $*" >> {site["record"]}\n{body}\n')
    path.chmod(0o755)


def _with_bin(site: dict[str, Path], **slurm: str) -> subprocess.CompletedProcess:
    path = f"{site['tmp'] / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    return run(site, "prolog.sh", PATH=path, **slurm)


@pytest.mark.parametrize("daemon_answers", [True, False])
def test_a_dataset_that_will_not_mount_cancels_the_job_unless_the_node_is_at_fault(
    site: dict[str, Path], daemon_answers: bool
) -> None:
    """A mount refused while the node daemon answers is the job's own dataset (a typo,
    a path its user may not read): the job is cancelled with the reason and the prolog
    exits 0, so Slurm does not drain the node for one user's comment. With the daemon
    not answering it is the node's failure: exit 1 (Slurm drains it)."""
    for name in ("scancel", "scontrol"):
        _stand_in(site, name, "exit 0")
    ok = "ds1"
    silofs = site["tmp"] / "silofs"
    silofs.write_text(
        f'#!/bin/sh\necho "silofs $*" >> {site["record"]}\n'
        f'case "$*" in *"-- {ok} "*|unmount*) exit 0 ;; esac\n'
        'echo "silofs: error: uid 0 may not read /secret" >&2\nexit 1\n'
    )
    # The registration (before any mount) is accepted; `status` says whether the daemon
    # still answers when the mount fails.
    ctl = site["tmp"] / "silofs-ctl"
    ctl.write_text(
        f'#!/bin/sh\necho "silofs-ctl $*" >> {site["record"]}\n'
        'case "$1" in job) exit 0 ;; esac\n'
        f"exit {0 if daemon_answers else 1}\n"
    )
    res = _with_bin(
        site, SLURM_JOB_ID="7", SLURM_JOB_UID="0", SLURM_JOB_COMMENT=f"silofs={ok} silofs=/secret"
    )
    lines = site["record"].read_text().splitlines()
    log = site["tmp"].joinpath("log").read_text()
    (failed,) = [ln for ln in log.splitlines() if "FAILED" in ln]
    assert "may not read /secret" in failed
    unmount = next(
        i for i, ln in enumerate(lines) if ln.startswith("silofs unmount") and ln.endswith("/7/ds1")
    )
    assert not (site["root"] / "7").exists()
    # Registered first; undone last: a cancelled (or drained) job leaves no registration.
    ours = [ln for ln in lines if ln.startswith("silofs")]  # not scontrol's
    assert ours[0].startswith("silofs-ctl job register slurm-7 ")
    assert lines.index("silofs-ctl forget --kind job slurm-7") > unmount
    if daemon_answers:
        assert res.returncode == 0, res.stderr
        assert "scancel 7" in lines
        (comment,) = [ln for ln in lines if ln.startswith("scontrol update JobId=7")]
        assert "AdminComment=silofs: mount /secret" in comment and "may not read" in comment
    else:
        assert res.returncode == 1
        assert not any(ln.startswith(("scancel", "scontrol update")) for ln in lines)


@pytest.mark.parametrize("daemon_answers", [True, False])
def test_a_registration_refused_for_the_comments_values_cancels_the_job_not_the_node(
    site: dict[str, Path], daemon_answers: bool
) -> None:
    """silofs.epochs=-1 or silofs.ideal_io=fast is the job owner's text: the daemon
    refuses the registration (made before any mount), and the job is cancelled while
    the node stays in service; it drained the node (exit 1). The daemon down: exit 1."""
    for name in ("scancel", "scontrol"):
        _stand_in(site, name, "exit 0")
    ctl = site["tmp"] / "silofs-ctl"
    ctl.write_text(
        f'#!/bin/sh\necho "silofs-ctl $*" >> {site["record"]}\n'
        'case "$1" in job) echo "silofs-ctl: error: field \'epochs\' must be more than 0" >&2;'
        " exit 1 ;; esac\n"
        f"exit {0 if daemon_answers else 1}\n"
    )
    res = _with_bin(
        site,
        SLURM_JOB_ID="8",
        SLURM_JOB_UID="0",
        SLURM_JOB_COMMENT="silofs=ds1 silofs.epochs=-1",
    )
    lines = site["record"].read_text().splitlines()
    (failed,) = [
        ln for ln in site["tmp"].joinpath("log").read_text().splitlines() if "FAILED" in ln
    ]
    assert "register: silofs-ctl: error: field 'epochs' must be more than 0" in failed
    # Refused before anything was mounted; nothing registered, so nothing to forget.
    assert not any(ln.startswith(("silofs mount", "silofs unmount")) for ln in lines)
    assert not any(ln.startswith("silofs-ctl forget") for ln in lines)
    assert not (site["root"] / "8").exists()
    if daemon_answers:
        assert res.returncode == 0, res.stderr
        assert "scancel 8" in lines
        (comment,) = [ln for ln in lines if ln.startswith("scontrol update JobId=8")]
        assert "AdminComment=silofs: register: " in comment and "epochs" in comment
    else:
        assert res.returncode == 1
        assert not any(ln.startswith(("scancel", "scontrol update")) for ln in lines)


@pytest.mark.parametrize("user_runs_silofs", [True, False])
def test_a_silofs_the_jobs_user_cannot_run_is_the_nodes_failure(
    site: dict[str, Path], user_runs_silofs: bool
) -> None:
    """A venv made with a python3 under /root (pyenv: root's PATH on some hosts; the
    README once said `python3 -m venv`) runs for root but for no job user: every mount
    as the user failed with "env: '/opt/silofs/bin/silofs': Permission denied", and the
    prolog took it for the job's dataset and cancelled every job, keeping the broken
    node in service. A silofs the job's user cannot run is the node's: exit 1 (Slurm
    drains it) with a line naming the fix, no scancel. A user who can run it and whose
    mount is refused is still the job's (cancelled, exit 0)."""
    for name in ("scancel", "scontrol"):
        _stand_in(site, name, "exit 0")
    # runuser -u USER -- [env VAR=..] CMD ...: the user's own run of silofs.
    denied = "echo \"env: '/opt/silofs/bin/silofs': Permission denied\" >&2; exit 126"
    refused = 'case "$*" in *--version*) exit 0 ;; esac\n'
    refused += 'echo "silofs: error: a15 may not read /secret" >&2; exit 1'
    _stand_in(site, "runuser", refused if user_runs_silofs else denied)
    res = _with_bin(
        site,
        SLURM_JOB_ID="9",
        SLURM_JOB_UID=str(os.getuid() or 4242),
        SLURM_JOB_USER="a15",
        SLURM_JOB_COMMENT="silofs=/secret",
    )
    lines = site["record"].read_text().splitlines()
    log = site["tmp"].joinpath("log").read_text()
    (failed,) = [ln for ln in log.splitlines() if "FAILED" in ln]
    assert not (site["root"] / "9").exists()
    # The job's user is registered as its owner before the mount, and forgotten after.
    ours = [ln for ln in lines if ln.startswith(("silofs", "runuser"))]  # not scontrol's
    assert ours[0].startswith("silofs-ctl job register slurm-9 ")
    assert ours[0].endswith(f" --uid {os.getuid() or 4242}")
    assert "runuser" in ours[1] and " mount " in ours[1]
    assert "silofs-ctl forget --kind job slurm-9" in ours
    if user_runs_silofs:
        assert res.returncode == 0, res.stderr
        assert "scancel 9" in lines and "may not read /secret" in failed
    else:
        assert res.returncode == 1, res.stderr
        assert not any(ln.startswith(("scancel", "scontrol update")) for ln in lines)
        assert "user a15 cannot run" in failed and "readable by every user" in failed
        assert res.stderr.count("\n") == 1 and "cannot run" in res.stderr


def test_the_epilog_ends_the_dead_mounts_of_the_jobs_user_and_never_fails_for_them(
    site: dict[str, Path],
) -> None:
    """After end-job (for every job, a silofs one or not: its script may have mounted
    silofs itself) the epilog runs `silofs end-dead-mounts --uid UID` when the mount
    table has a silofs mount of the job's user; its lines are logged, and its failure
    too, but the epilog's status is end-job's alone: a dead mount of the user never
    drains the node. Never for root's jobs (root's mounts are the node's own)."""
    silofs = site["tmp"] / "silofs"
    silofs.write_text(
        f'#!/bin/sh\necho "silofs $*" >> {site["record"]}\n'
        'case "$1" in end-job) echo "unmounted x"; exit "${END_JOB_STATUS:-0}" ;; esac\n'
        'echo "cannot detach /o/1, a dead silofs mount of uid 1007: Device or resource busy"\n'
        'echo "silofs: error: dead mounts of uid 1007 left: /o/1" >&2\nexit 1\n'
    )
    path = f"{site['tmp'] / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    (site["tmp"] / "bin").mkdir()
    (site["tmp"] / "bin" / "awk").write_text("#!/bin/sh\nexit 0\n")  # a mount of the user
    (site["tmp"] / "bin" / "awk").chmod(0o755)

    def epilog(job: str, uid: str, **env: str) -> tuple[int, list[str], list[str]]:
        log, record = site["tmp"] / "log", site["record"]
        log.unlink(missing_ok=True)
        record.unlink(missing_ok=True)
        res = run(site, "epilog.sh", PATH=path, SLURM_JOB_ID=job, SLURM_JOB_UID=uid, **env)
        said = [ln.split(": ", 1)[1] for ln in log.read_text().splitlines()] if log.exists() else []
        calls = record.read_text().splitlines() if record.exists() else []
        return res.returncode, calls, said

    # Not a silofs job (no directory): the dead mounts still end, the node stays up.
    status, calls, said = epilog("10", "1007")
    assert status == 0 and calls == ["silofs end-dead-mounts --uid 1007"]
    assert said == [
        "cannot detach /o/1, a dead silofs mount of uid 1007: Device or resource busy",
        "silofs: error: dead mounts of uid 1007 left: /o/1",
        "silofs end-dead-mounts exited 1 (the node stays in service)",
    ]
    # A silofs job: end-job first; its failure alone is the epilog's.
    (site["root"] / "11").mkdir()
    status, calls, said = epilog("11", "1007", END_JOB_STATUS="1")
    assert status == 1
    assert calls == [f"silofs end-job --dir {site['root']}/11 -- slurm-11",
                     "silofs end-dead-mounts --uid 1007"]  # fmt: skip
    assert said[:2] == ["unmounted x", "FAILED: silofs end-job exited 1"]
    status, _, _ = epilog("11", "1007", END_JOB_STATUS="0")
    assert status == 0
    # Root's job, or a uid that is no number: nothing is probed.
    for uid in ("0", "", "12; rm -rf /"):
        status, calls, said = epilog("12", uid)
        assert status == 0 and calls == [], (uid, calls)
    assert said == ["odd SLURM_JOB_UID 12; rm -rf /: its dead mounts are left"]
    # The real awk, and a user with no mount on this host: no python starts.
    (site["tmp"] / "bin" / "awk").unlink()
    status, calls, said = epilog("13", "4242421")
    assert status == 0 and calls == [] and said == []
