"""The daemon's GC thresholds (silofs/node/service.py tune_gc): the young generation is
collected every GC_YOUNG allocations, the older generations' thresholds are kept."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from silofs.node.service import GC_YOUNG, tune_gc


@pytest.fixture
def thresholds() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


@pytest.mark.usefixtures("thresholds")
def test_tune_gc_raises_only_the_young_threshold() -> None:
    gc.set_threshold(700, 7, 9)
    tune_gc()
    assert gc.get_threshold() == (GC_YOUNG, 7, 9)
    assert GC_YOUNG >= 10 * 700
