"""A wall clock stepped while a silofs process a test starts runs (an NTP step, an
operator's `date -s`), without setting the host's clock (other tests share it).

Owns writing a `sitecustomize` module into a directory of the test's: put that directory
first on a process's PYTHONPATH (make_node(pythonpath=...)) with SILOFS_TEST_CLOCK_STEP
naming a file, and in that process time.time() (and time.time_ns()) is the real clock
plus the seconds the file holds, read at each call (write it to step the clock while the
process runs; missing or empty: 0). time.monotonic() is left alone, as a real step
leaves CLOCK_MONOTONIC. Never used by silofs itself; never changes a process without
SILOFS_TEST_CLOCK_STEP.
"""

from __future__ import annotations

from pathlib import Path

_SITECUSTOMIZE = """
import os
import time

_FILE = os.environ.get("SILOFS_TEST_CLOCK_STEP", "")

if _FILE:
    _real_time, _real_time_ns = time.time, time.time_ns

    def _step():
        try:
            with open(_FILE) as f:
                return float(f.read().strip() or 0)
        except (OSError, ValueError):
            return 0.0

    time.time = lambda: _real_time() + _step()
    time.time_ns = lambda: _real_time_ns() + int(_step() * 1e9)
"""


def clock_step_dir(directory: Path) -> Path:
    """Write the sitecustomize into `directory` (made if missing) and return it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    return directory
