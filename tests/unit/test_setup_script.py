"""scripts/setup.sh (the README's two commands) as a user other than root runs it: on a
host where everything is installed it installs nothing (programs in /usr/sbin, which a
user's PATH lacks, are found there), and with something missing and no sudo it says in
one line what root must install.

The script runs for real, in a copy of the checkout's layout, with a PATH of stand-ins
for the programs it probes (apt-get records that it was asked; .venv/bin/python
records pip and pytest), so no package is installed and no test suite runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "setup.sh"
SBIN_PROGRAMS = ("slurmctld", "munged")  # found only in the sbin directories below


def _stub(path: Path, body: str) -> None:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


@pytest.fixture
def host(tmp_path: Path) -> dict[str, Path]:
    """A checkout (scripts/setup.sh, a made .venv) and a bin directory of stand-ins: a
    host prepared for the suite, as seen by a user whose `id -u` is 1000."""
    if shutil.which("bash") is None:
        pytest.skip("setup.sh is a bash script")
    for program in SBIN_PROGRAMS:
        if not any(Path(d, program).exists() for d in ("/usr/local/sbin", "/usr/sbin", "/sbin")):
            pytest.skip(f"{program} is not installed in an sbin directory here")
    repo = tmp_path / "checkout"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "scripts" / "setup.sh")
    log = tmp_path / "calls.log"
    venv_bin = repo / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    _stub(venv_bin / "python", f'echo "venv-python $*" >>{log}')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for real in ("bash", "dirname", "env"):
        os.symlink(shutil.which(real) or real, bin_dir / real)
    # Python >= 3.11 with its headers: every `python3 -c` probe succeeds.
    _stub(bin_dir / "python3", "exit 0")
    _stub(bin_dir / "id", 'if [ "$1" = -u ]; then echo 1000; else echo uid=1000; fi')
    for program in ("fusermount3", "pkg-config", "gcc", "npm", "node", "ip", "pgrep", "dpkg"):
        _stub(bin_dir / program, "exit 0")
    _stub(bin_dir / "apt-get", f'echo "apt-get $*" >>{log}')
    return {"repo": repo, "bin": bin_dir, "log": log}


def _run(host: dict[str, Path]) -> subprocess.CompletedProcess[str]:
    env = {"PATH": str(host["bin"]), "HOME": str(host["repo"].parent), "LANG": "C"}
    return subprocess.run(
        [str(host["bin"] / "bash"), str(host["repo"] / "scripts" / "setup.sh"), "test", "-x"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip


def test_a_user_on_a_prepared_host_is_asked_to_install_nothing(host: dict[str, Path]) -> None:
    # slurmctld and munged are in /usr/sbin, not on this user's PATH (as on Debian).
    res = _run(host)
    calls = host["log"].read_text() if host["log"].exists() else ""
    assert res.returncode == 0, res.stderr
    assert "apt-get" not in calls and "sudo" not in res.stderr
    assert "venv-python -m pytest -q -x" in calls  # the suite ran, with the arguments


def test_a_user_without_sudo_is_told_in_one_line_what_root_must_install(
    host: dict[str, Path],
) -> None:
    (host["bin"] / "fusermount3").unlink()  # FUSE 3 is missing
    res = _run(host)
    calls = host["log"].read_text() if host["log"].exists() else ""
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("setup: "), res.stderr
    assert "fuse3" in lines[0] and "root" in lines[0]
    assert "apt-get" not in calls and "venv-python" not in calls
