"""bench/cpu_split.py: perf script output sorted into the parts of serving a read."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "cpu_split.py"
_spec = importlib.util.spec_from_file_location("cpu_split", _PATH)
assert _spec is not None and _spec.loader is not None
cpu_split = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("cpu_split", cpu_split)  # its dataclass looks its module up
_spec.loader.exec_module(cpu_split)

# As `perf script -F tid,period,ip,sym,dso` prints it: a head line per sample (the
# thread id right-aligned, so a short one starts with blanks), its frames tab-indented.
SCRIPT = """\
 1078     250000
\t          1a9e20 XXHL64_seed_avx512 (/x/_xxhash.cpython-311-x86_64-linux-gnu.so)
\t          1b0000 xxh3_64_intdigest (/x/_xxhash.cpython-311-x86_64-linux-gnu.so)

 1078     250000
\tffffffff81000000 next_uptodate_folio ([kernel.kallsyms])
\tffffffff81000100 asm_exc_page_fault ([kernel.kallsyms])
\t          1a9e20 XXHL64_seed_avx512 (/x/_xxhash.cpython-311-x86_64-linux-gnu.so)

13193     500000
\tffffffff82203877 _raw_spin_lock ([kernel.kallsyms])
\tffffffff8183bb54 fuse_dev_write ([kernel.kallsyms])
\t    7f0000000000 __GI___writev (/usr/lib/x86_64-linux-gnu/libc.so.6)

13214     250000
\tffffffff81000200 filemap_fault ([kernel.kallsyms])
\t    7f0000001000 mdb_page_get.constprop.0 (/x/cpython.cpython-311-x86_64-linux-gnu.so)

13214     250000
\tffffffff81000400 _copy_to_iter ([kernel.kallsyms])
\tffffffff81000500 do_preadv ([kernel.kallsyms])
\t           fe111 preadv64v2 (/usr/lib/x86_64-linux-gnu/libc.so.6)

13214     250000
\tffffffff81000600 page_cache_ra_unbounded ([kernel.kallsyms])
\t           fe111 preadv64v2 (/usr/lib/x86_64-linux-gnu/libc.so.6)

13214     250000
\t          1a0000 __memmove_avx512_unaligned_erms (/usr/lib/x86_64-linux-gnu/libc.so.6)

13193     250000
\tffffffff81000700 __pi_memcpy ([kernel.kallsyms])
\tffffffff8183bb54 fuse_dev_write ([kernel.kallsyms])

13193     250000
\t          1af848 _PyEval_EvalFrameDefault (/x/libpython3.11.so.1.0)

13193     250000
\tffffffff81000300 finish_task_switch.isra.0 ([kernel.kallsyms])
"""


def test_each_sample_lands_in_its_part_by_its_period() -> None:
    s = cpu_split.split_text(SCRIPT).seconds
    assert s["verification (xxh3 of the served blocks)"] == pytest.approx(0.00025)
    assert s["verification's page faults (mapping the value)"] == pytest.approx(0.00025)
    # The kernel's memcpy under the reply is the reply's, not the private copy's.
    assert s["reply (writev to /dev/fuse: the kernel's copy)"] == pytest.approx(0.00075)
    fill = "page-cache fill (LMDB lookups' faults, read-ahead, residency probes)"
    assert s[fill] == pytest.approx(0.0005)  # the lookup's fault, the preadv's read-ahead
    copy = "the private copy (preadv of data.mdb, or memcpy out of the map and its mincore)"
    assert s[copy] == pytest.approx(0.0005)  # the preadv's copy, libc's memmove
    assert s["interpreter (handlers, trio, pyfuse3's glue)"] == pytest.approx(0.00025)
    assert s["other (scheduler, timers, libc)"] == pytest.approx(0.00025)
    assert cpu_split.split_text(SCRIPT).total == pytest.approx(0.00275)


def test_no_samples_is_an_empty_split() -> None:
    assert cpu_split.split_text("").total == 0
    assert "0.000 CPU-s" in cpu_split.split_text("").text()
