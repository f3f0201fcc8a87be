"""Durations the daemon reports are measured on the monotonic clock, so the wall clock
stepped back or forward while it runs (an NTP step, an operator's `date -s`) changes
none of them: status's uptime_s, a warm's elapsed_s and bytes_per_s, a hint's
elapsed_s. The wall clock is left to what is a date (a listing's listed_at, persisted
across restarts; certificate expiry). The mount's metadata-TTL relist under a stepped
clock: listing_age below, and on a real mount tests/integration/test_clock_step.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from silofs.node.daemon import Daemon
from silofs.node.prefetch import Hint
from silofs.node.views import status_view
from silofs.node.warm import WarmState
from tests.unit.test_routes_access import Call, run_routes

DAY = 86400.0


def _step_clock(monkeypatch: pytest.MonkeyPatch, by: float) -> None:
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + by)


@pytest.mark.parametrize("step", [-DAY, DAY])
def test_uptime_is_not_moved_by_a_wall_clock_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: float
) -> None:
    async def test(d: Daemon, call: Call) -> None:
        _step_clock(monkeypatch, step)
        uptime = status_view(d)["node"]["uptime_s"]
        assert 0 <= uptime < 60, uptime

    run_routes(tmp_path, test)


@pytest.mark.parametrize("step", [-DAY, DAY])
def test_warm_and_hint_elapsed_are_not_moved_by_a_wall_clock_step(
    monkeypatch: pytest.MonkeyPatch, step: float
) -> None:
    warm = WarmState(job="j", paths=[], chunk_size=1 << 20, uid=0)
    warm.fetched_bytes = 1 << 30
    hint = Hint("m", "j", 1, 1 << 20, 1 << 30, None, 0)
    _step_clock(monkeypatch, step)
    view = warm.view()
    assert 0 <= view["elapsed_s"] < 60, view
    assert view["bytes_per_s"] == 0 or view["bytes_per_s"] > (1 << 30) / 60, view
    assert 0 <= hint.view()["elapsed_s"] < 60


def test_listing_age_for_the_metadata_ttl_is_never_less_than_the_time_known() -> None:
    from silofs.mount.process import listing_age

    assert listing_age(1000.0, 1010.0, 3.0) == 10.0  # the wall clock's, normally
    # Stepped back a day after the listing: the monotonic time this mount has known it.
    assert listing_age(1000.0, 1010.0 - DAY, 12.0) == 12.0
    # Stepped forward: older at once (one relist early), never younger.
    assert listing_age(1000.0, 1010.0 + DAY, 12.0) == 10.0 + DAY
