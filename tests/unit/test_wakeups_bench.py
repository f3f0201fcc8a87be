"""bench/wakeups.py: perf stat's per-thread counts and sched_switch call graphs read into
the serving thread's system calls and where it slept or was preempted."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

_BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def wakeups() -> Any:
    sys.path.insert(0, str(_BENCH))
    try:
        import wakeups as module
    finally:
        sys.path.remove(str(_BENCH))
    return module


# As `perf stat --per-thread -x, -o FILE` writes it: comment lines, then per thread and
# event the thread, the count, the unit (empty), the event.
STAT = """\
# started on Sun Nov 29 16:10:51 2026

python-4242,2000,,syscalls:sys_enter_epoll_wait,1000000,100.00,,
python-4242,8000,,syscalls:sys_enter_writev,1000000,100.00,,
trio-thread-4250,3,,syscalls:sys_enter_futex,1000000,100.00,,
python-4242,<not counted>,,syscalls:sys_enter_futex,0,0.00,,
"""

# As `perf script -F tid,trace,ip,sym` prints a sched_switch recording made with -g: a
# head line per switch (the thread id right-aligned), its kernel then user frames.
SCRIPT = """\
   4242 prev_comm=python prev_pid=4242 prev_prio=120 prev_state=S ==> next_comm=x next_pid=1
\tffffffff82266208 __schedule
\tffffffff82266b73 schedule
\tffffffff8226dbde do_epoll_wait
\tffffffff8143a8be __x64_sys_epoll_wait
\tffffffff8225aa01 do_syscall_64
\t          cf503 epoll_wait@GLIBC_2.2.5

   4242 prev_comm=python prev_pid=4242 prev_prio=120 prev_state=R ==> next_comm=x next_pid=1
\tffffffff82266208 __schedule
\tffffffff82266c00 preempt_schedule_irq
\tffffffff82200e6a asm_sysvec_apic_timer_interrupt
\t          4a1b2c _PyEval_EvalFrameDefault

   4242 prev_comm=python prev_pid=4242 prev_prio=120 prev_state=R+ ==> next_comm=x next_pid=1
\tffffffff82266208 __schedule
\tffffffff8183bb54 fuse_dev_write
\tffffffff8143a000 __x64_sys_writev

   4250 prev_comm=trio prev_pid=4250 prev_prio=120 prev_state=S ==> next_comm=x next_pid=1
\tffffffff82266208 __schedule
\tffffffff8143a100 __x64_sys_futex
"""


def test_stat_rows_per_thread_without_the_prefix_or_uncounted_rows(wakeups: Any) -> None:
    rows = wakeups.stat_rows(STAT)
    assert rows == {
        "python-4242": {"epoll_wait": 2000, "writev": 8000},
        "trio-thread-4250": {"futex": 3},
    }


def test_switch_sites_of_one_thread_by_state_and_system_call(wakeups: Any) -> None:
    sites = wakeups.switch_sites(SCRIPT, 4242)
    assert sites == {
        "slept in epoll_wait": 1,
        "preempted in user": 1,  # no system call on the stack: preempted in user space
        "preempted in writev": 1,
    }
    assert wakeups.switch_sites(SCRIPT, 4250) == {"slept in futex": 1}
    assert not wakeups.switch_sites(SCRIPT, 1)
