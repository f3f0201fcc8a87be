"""`silofs-ctl` starts without what only one command needs: numpy (the simulator's
arrays, ~0.1 s of CPU to import) is loaded by `simulate` alone, never by `status` or
any command an operator or a script runs often (silofs_ctl/cli.py LAZY_COMMANDS)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import sys
from silofs_ctl.cli import main
try:
    main({args!r})
except SystemExit:
    pass
print(sorted(m for m in ("numpy", "silofs_ctl.simulate_cmd") if m in sys.modules))
"""


def _loaded(args: list[str]) -> list[str]:
    res = subprocess.run(
        [sys.executable, "-c", PROBE.format(args=args)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return ast.literal_eval(res.stdout.strip().splitlines()[-1])


def test_importing_the_cli_loads_no_numpy() -> None:
    res = subprocess.run(
        [sys.executable, "-c", "import sys, silofs_ctl.cli; print('numpy' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert res.stdout.strip() == "False"


@pytest.mark.parametrize("args", [["status"], ["allocate-io", "train", "1MB/s"], ["--version"]])
def test_other_commands_load_no_numpy(args: list[str], tmp_path: Path) -> None:
    # against a socket nobody listens on: the command fails after its imports
    socket = ["--socket", str(tmp_path / "none.sock")] if args[0] != "--version" else []
    assert _loaded([*args, *socket]) == []


def test_simulate_is_still_a_command_and_loads_numpy_itself() -> None:
    assert _loaded(["simulate", "--help"]) == ["numpy", "silofs_ctl.simulate_cmd"]
