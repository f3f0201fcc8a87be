"""Fixtures for the reliability suite: the short/long switch and the figures.

Owns: the SILOFS_LONG=1 switch between the short form CI runs and the long form run by
hand; and collecting each check's figures, printed at the end of the run and written as
JSON to $SILOFS_RELIABILITY_JSON when set (docs/RESULTS.md "Reliability" quotes them).
Nodes and servers come from the shared plugin (tests/support/fixtures.py).

Never: decides what a check asserts (each test asserts its promise itself), or starts
servers of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

LONG = os.environ.get("SILOFS_LONG") == "1"

# nodeid -> figures, in the order the checks ran
FIGURES: dict[str, dict[str, Any]] = {}


def scale(short: Any, long: Any) -> Any:
    """The short-form value in CI, the long-form value under SILOFS_LONG=1."""
    return long if LONG else short


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=10,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """A dict the check fills with its counts; reported even when the check fails."""
    out: dict[str, Any] = {"form": "long" if LONG else "short"}
    FIGURES[request.node.nodeid] = out
    yield out


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not FIGURES:
        return
    terminalreporter.section("reliability figures")
    for nodeid, figs in FIGURES.items():
        terminalreporter.write_line(nodeid)
        terminalreporter.write_line("    " + json.dumps(figs, sort_keys=True, default=str))
    if path := os.environ.get("SILOFS_RELIABILITY_JSON"):
        with open(path, "w") as f:
            json.dump({"commit": git_commit(), "figures": FIGURES}, f, indent=1, default=str)
