"""Where a FUSE server process's CPU goes, from the kernel's side too: perf samples by part.

Owns PerfRecord (`perf record -e cpu-clock -g` of one process, all its threads, while a
block runs) and split(), which sorts the recorded stacks into the parts of serving a
read: the reply (the kernel copying it into the reader's pages), the verification
(xxh3, and the page faults that map the value it reads), filling the page cache from
the SSD (LMDB lookups' faults, read-ahead hints, residency probes), the private copy a
hit is checked on (preadv, or a memcpy out of the map), receiving requests,
and the interpreter (the handlers, trio, pyfuse3's glue; perf sees no Python frames).
py-spy sees the Python side and only wall time; this sees CPU, and the kernel. The
event is cpu-clock, a software timer: VMs often lack the hardware counters. Never
changes the process it watches; figures under it are a little inflated (perf's own
sampling), so compare parts, not against unprofiled passes.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

# (part, substrings of a frame that put a sample there): the first part any frame of
# a sample's stack matches takes it, so the specific parts come before the general.
PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reply (writev to /dev/fuse: the kernel's copy)", ("fuse_dev_write", "__GI___writev")),
    ("verification's page faults (mapping the value)", ()),  # xxh3 with a kernel leaf
    ("verification (xxh3 of the served blocks)", ("XXH",)),
    (
        "page-cache fill (LMDB lookups' faults, read-ahead, residency probes)",
        ("mdb_page_get", "mdb_cursor", "mdb_node", "madvise", "page_cache_ra"),
    ),
    # The private copy a hit is checked and served from (mount/reader.py): preadv of
    # data.mdb, or a memcpy out of LMDB's map after a mincore (libc's __memmove_*: perf
    # finds no caller above it; the kernel's own copies are __pi_memcpy, under the
    # reply or the receive). A preadv that starts read-ahead is the fill's, above.
    (
        "the private copy (preadv of data.mdb, or memcpy out of the map and its mincore)",
        ("preadv", "__memmove_", "mincore"),
    ),
    (
        "request receive (read of /dev/fuse, poll, epoll)",
        ("fuse_dev_read", "fuse_dev_poll", "epoll_wait", "do_sys_poll", "__GI___read"),
    ),
    ("interpreter (handlers, trio, pyfuse3's glue)", ("libpython", "pyfuse3")),
)
_FAULTS = PARTS[1][0]
SCRIPT_FIELDS = "tid,period,ip,sym,dso"
_OTHER = "other (scheduler, timers, libc)"


class PerfRecord:
    """`perf record` of process `pid` while a block runs, into `out` (perf.data)."""

    def __init__(self, pid: int, out: str) -> None:
        self.pid, self.out = pid, out
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> PerfRecord:
        exe = shutil.which("perf")
        if exe is None:
            raise SystemExit("--perf needs perf (linux-perf)")
        self.proc = subprocess.Popen(
            [exe, "record", "-e", "cpu-clock", "-g", "-p", str(self.pid), "-o", self.out],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(0.5)  # perf attaches
        return self

    def __exit__(self, *_exc: object) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Split:
    """CPU seconds sampled in each part (PARTS, then other), and in all."""

    seconds: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def text(self, indent: str = "    ") -> str:
        total = self.total or 1e-9
        lines = [f"{indent}{self.total:.3f} CPU-s sampled"]
        for part, s in sorted(self.seconds.items(), key=lambda kv: -kv[1]):
            if s:
                lines.append(f"{indent}{100 * s / total:5.1f}%  {s:.3f} s  {part}")
        return "\n".join(lines)


def _part(frames: list[str]) -> str:
    for part, marks in PARTS:
        if part == _FAULTS:
            if "[kernel.kallsyms]" in frames[0] and any("XXH" in f for f in frames):
                return part
            continue
        if any(m in f for f in frames for m in marks):
            return part
    return _OTHER


def split(data: str) -> Split:
    """The samples of perf.data `data` by part, in CPU seconds (each sample's period)."""
    out = subprocess.run(
        ["perf", "script", "-i", data, "-F", SCRIPT_FIELDS],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return split_text(out)


def split_text(out: str) -> Split:
    """split() of `perf script -F SCRIPT_FIELDS` output."""
    seconds = dict.fromkeys([p for p, _ in PARTS] + [_OTHER], 0.0)
    period, frames = 0, []
    for line in [*out.splitlines(), ""]:
        if not line.strip():
            if frames:
                seconds[_part(frames)] += period / 1e9
            period, frames = 0, []
        elif line.startswith("\t"):  # a frame (perf script indents them with a tab)
            frames.append(line.strip())
        else:  # a sample's head: TID PERIOD (ns of cpu-clock), the TID right-aligned
            period = int(line.split()[1])
    return Split(seconds)
