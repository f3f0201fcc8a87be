"""silofs/trace.py: off unless SILOFS_TRACE_DIR is set at import; on, one whole line
per mark in DIR/PID.trace, chunk names that keep a line's three fields apart."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

from silofs import trace


def test_off_without_the_environment_variable() -> None:
    # The test run does not set it (nor may it: every process would write marks).
    assert "SILOFS_TRACE_DIR" not in os.environ
    assert trace.ON is False


def test_marks_are_lines_of_monotonic_time_stage_and_chunk(tmp_path: Path) -> None:
    code = (
        "import time; from silofs import trace; t = time.monotonic(); "
        "trace.mark('ask:begin', trace.chunk_id('a b\\nc%d', 3)); "
        "trace.mark('ask:checked', trace.chunk_id('x', 0)); print(t, trace.ON)"
    )
    env = {**os.environ, "SILOFS_TRACE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True)  # fmt: skip
    started, on = out.stdout.split()
    assert on == "True"
    (path,) = tmp_path.glob("*.trace")
    lines = path.read_text().splitlines()
    assert [line.split(" ")[1:] for line in lines] == [
        ["ask:begin", "a%20b%0Ac%25d#3"],
        ["ask:checked", "x#0"],
    ]
    times = [float(line.split(" ")[0]) for line in lines]
    assert float(started) <= times[0] <= times[1]


def test_a_forked_child_writes_a_file_of_its_own(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SILOFS_TRACE_DIR", str(tmp_path))
    fresh = importlib.reload(trace)
    try:
        fresh.mark("parent", "k#0")
        pid = os.fork()
        if pid == 0:  # the child: one mark, then out without the parent's cleanup
            try:
                fresh.mark("child", "k#0")
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        files = {p.name: p.read_text().split()[1] for p in tmp_path.glob("*.trace")}
        assert files == {f"{os.getpid()}.trace": "parent", f"{pid}.trace": "child"}
    finally:
        if fresh._fd >= 0:
            os.close(fresh._fd)
        monkeypatch.delenv("SILOFS_TRACE_DIR")
        importlib.reload(trace)
    assert trace.ON is False
