"""heap.py: freed chunk buffers are reused, not faulted in afresh, until given back."""

from __future__ import annotations

import subprocess
import sys

import pytest

from silofs import heap

# A child process (the settings are the whole process's): 32 buffers of 4 MiB, freed,
# then 32 more; the minor faults of the second round.
_CHILD = """
import resource, sys
from silofs import heap
if sys.argv[1] == "keep":
    assert heap.keep_freed(512 << 20)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def round_():
    bufs = [bytearray(4 << 20) for _ in range(32)]
    del bufs
round_()
before = faults()
round_()
print(faults() - before)
"""


def _second_round_faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout)


@pytest.mark.skipif(heap._glibc() is None, reason="not glibc")
def test_kept_buffers_are_not_faulted_in_again() -> None:
    pages = (32 * (4 << 20)) // 4096
    assert _second_round_faults("default") > pages // 2  # given back, faulted in again
    assert _second_round_faults("keep") < pages // 20


def test_give_back_is_safe_any_time() -> None:
    heap.give_back()
