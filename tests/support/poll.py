"""Polling with a deadline: the one way tests and benchmarks wait for something.

Owns wait_for. Never sleeps as a barrier: the sleep between two checks is a polling
interval, and the condition itself says when the wait is over.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

DEADLINE = 30.0  # seconds: a daemon or a server on a cold, busy 2-core host


def wait_for(
    pred: Callable[[], Any],
    timeout: float = DEADLINE,
    what: str = "condition",
    interval: float = 0.02,
) -> Any:
    """Poll `pred` until it returns a truthy value and return that value; raise
    AssertionError naming `what` once `timeout` seconds have passed."""
    end = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)  # polling interval, not synchronisation
