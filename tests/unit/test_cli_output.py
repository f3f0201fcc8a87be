"""The CLIs' own output that cannot be written: stdout to a full disk (/dev/full) or a
pipe whose reader has gone. One line on stderr and exit 1 (nothing for a closed pipe,
as `cat` says nothing), never a traceback; the commands run as real subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from silofs.output import output_error

COMMANDS = [
    ["silofs_ctl", "--help"],
    ["silofs_ctl", "allocate-cache", "--help"],
    ["silofs", "--help"],
    ["silofs", "mount", "--help"],
]


def _run(args: list[str], stdout: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args], stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=60
    )


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("args", COMMANDS)
def test_output_to_a_full_disk_is_one_line(args: list[str]) -> None:
    """`silofs-ctl status --json > /full/disk/status.json` was a traceback (ENOSPC out
    of click.echo)."""
    fd = os.open("/dev/full", os.O_WRONLY)
    try:
        res = _run(args, fd)
    finally:
        os.close(fd)
    prog = "silofs-ctl" if args[0] == "silofs_ctl" else "silofs"
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr == f"{prog}: error: cannot write the output: No space left on device\n"


@pytest.mark.parametrize("args", COMMANDS)
def test_output_to_a_closed_pipe_ends_quietly(args: list[str]) -> None:
    """click's main already ends so on EPIPE; kept true with the handler above it."""
    r, w = os.pipe()
    os.close(r)
    try:
        res = _run(args, w)
    finally:
        os.close(w)
    assert (res.returncode, res.stderr) == (1, "")


def test_any_other_os_error_is_not_taken_for_one_of_output() -> None:
    try:
        open("/nonexistent/silofs/x")  # noqa: SIM115 - the error is the point
    except OSError as exc:
        assert output_error(exc) is None
