"""bench/cluster.py: what several chunks per exchange could carry, counted from the
timeline's marks per process (_batchable): the home an ask went to, the asks in flight
beside it, those begun within 50 and 200 us after it, and one exchange at a time; the
host's busy ticks (_host_ticks) and --pin's affinity (_pin)."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

_BENCH = Path(__file__).resolve().parents[2] / "bench"
MS = 1e-3


@pytest.fixture(scope="module")
def bench() -> Any:
    sys.path.insert(0, str(_BENCH))
    try:
        import cluster as module
    finally:
        sys.path.remove(str(_BENCH))
    return module


def _ask(chunk: str, begin: float, end: float) -> list[tuple[float, str, str]]:
    return [(begin, "ask:begin", chunk), (end, "ask:checked", chunk)]


def test_asks_are_counted_per_home_by_who_read_them(bench: Any) -> None:
    asker = (
        _ask("a#0", 0.0, 1.0 * MS)
        + _ask("b#0", 0.02 * MS, 1.6 * MS)  # begun 20 us after a, in flight beside it
        + _ask("c#0", 0.045 * MS, 1.7 * MS)  # 45 us after a: the same home
        + _ask("d#0", 0.04 * MS, 0.9 * MS)  # another home
    )
    home_1 = [(0.3 * MS, "head:/v1/peer/chunk", "a#0"), (1.2 * MS, "head:/v1/peer/chunk", "b#0"),
              (1.3 * MS, "head:/v1/peer/chunk", "c#0")]  # fmt: skip
    home_2 = [(0.5 * MS, "head:/v1/peer/chunk", "d#0")]
    # The same chunk key read by a home outside the ask's span is not its home.
    stray = [(5.0 * MS, "head:/v1/peer/chunk", "d#0")]
    out = bench._batchable({"10": asker, "20": home_1, "30": home_2, "40": stray})
    peer = out["asker_to_home"]
    assert peer["exchanges"] == 4
    # a: none in flight; b: a; c: a and b; d: none to its home (a, b, c are another's)
    assert peer["others_in_flight"] == {"0": 0.5, "1": 0.25, "2": 0.25}
    # within 50 us after a: b and c; after b: c (25 us); after c and d: none
    assert peer["others_begun_within_50us"] == {"0": 0.5, "1": 0.25, "2": 0.25}
    assert peer["others_begun_within_200us"] == peer["others_begun_within_50us"]
    # One exchange at a time to home 20: a alone, then b and c together; d alone at 30.
    assert peer["chunks_per_exchange_one_at_a_time"] == round(4 / 3, 2)
    assert out["mount_to_daemon"] == {"exchanges": 0}


def test_mount_misses_are_counted_per_mount(bench: Any) -> None:
    mount = [
        (0.0, "mount:ask", "a#0"),
        (0.1 * MS, "mount:ask", "b#0"),  # 100 us later: within 200 us, not 50
        (1.0 * MS, "mount:answered", "a#0"),
        (1.5 * MS, "mount:answered", "b#0"),
        (2.0 * MS, "mount:ask", "a#0"),  # the same chunk again, alone this time
        (2.5 * MS, "mount:answered", "a#0"),
    ]
    other_mount = [(0.0, "mount:ask", "c#0"), (0.2 * MS, "mount:answered", "c#0")]
    out = bench._batchable({"50": mount, "60": other_mount})
    m = out["mount_to_daemon"]
    assert m["exchanges"] == 4
    assert m["others_in_flight"] == {"0": 0.75, "1": 0.25}  # b, beside a
    assert m["others_begun_within_50us"] == {"0": 1.0}
    assert m["others_begun_within_200us"] == {"0": 0.75, "1": 0.25}
    # mount 50: a, then b (came while a was in flight), then a again; mount 60: c
    assert m["chunks_per_exchange_one_at_a_time"] == 1.0
    assert out["asker_to_home"] == {"exchanges": 0}


def test_host_ticks_count_busy_time_apart_from_idle(bench: Any) -> None:
    busy0, all0 = bench._host_ticks()
    deadline = time.monotonic() + 5.0
    # Spin until the host's busy ticks move (this thread's own work is busy time).
    while bench._host_ticks()[0] == busy0:
        assert time.monotonic() < deadline, "no busy tick in 5 s of spinning"
    busy1, all1 = bench._host_ticks()
    assert 0 < busy1 - busy0 <= all1 - all0
    assert busy1 <= all1


def test_pin_sets_every_thread_and_restores(bench: Any) -> None:
    before = os.sched_getaffinity(0)
    other = threading.Event()
    seen: list[set[int]] = []

    def worker() -> None:
        other.wait(5.0)
        seen.append(os.sched_getaffinity(0))

    t = threading.Thread(target=worker)
    t.start()
    one = {min(before)}
    try:
        bench._pin(os.getpid(), one)
        assert os.sched_getaffinity(0) == one
        other.set()
        t.join(5.0)
        assert seen == [one]  # a thread started before the pin is pinned too
    finally:
        other.set()
        t.join(5.0)
        bench._pin(os.getpid(), before)
    assert os.sched_getaffinity(0) == before
