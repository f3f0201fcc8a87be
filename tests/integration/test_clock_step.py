"""The wall clock stepped while a real daemon and a real FUSE mount run (an NTP step, an
operator's `date -s`; tests/support/clockstep.py steps it in those processes only).

Owns: the metadata TTL still relists when the clock is stepped back a day after a
listing (the listing's persisted listed_at is then a day in the future), and a step
forward relists once and then keeps the TTL's pace. Durations in status: unit tests
(test_wall_clock.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.clockstep import clock_step_dir
from tests.support.fixtures import needs_fuse
from tests.support.poll import wait_for

pytestmark = [needs_fuse, pytest.mark.fuse]

DAY = 86400


def test_metadata_ttl_relists_after_the_clock_is_stepped_back_or_forward(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    step = tmp_path / "clock-step"
    step.write_text("0")
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"a.txt": b"a"})
    node = make_node(
        env={"SILOFS_TEST_CLOCK_STEP": str(step)},
        pythonpath=(str(clock_step_dir(tmp_path / "clock")),),
    )
    uri = local_store.uri(bucket_name)
    mp = node.mount(uri, tmp_path / "mnt", "--metadata-ttl", "2")
    assert os.listdir(mp) == ["a.txt"]
    objects = local_store.root / bucket_name
    # Back a day: the listing just made now looks made tomorrow. Its TTL still runs out.
    step.write_text(str(-DAY))
    (objects / "b.txt").write_bytes(b"b")
    wait_for(lambda: "b.txt" in os.listdir(mp), 40, "a relist after the clock went back")
    # Forward two days: one early relist at most, and then the TTL's pace again.
    step.write_text(str(DAY))
    (objects / "c.txt").write_bytes(b"c")
    wait_for(lambda: "c.txt" in os.listdir(mp), 40, "a relist after the clock went forward")
    (objects / "d.txt").write_bytes(b"d")
    wait_for(lambda: "d.txt" in os.listdir(mp), 40, "the next relist")
