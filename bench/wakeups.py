"""Where a warm small file's serving thread waits, and how often trio's loop turns, per file:
a kept silofs mount against the pyfuse3 ceiling in the readers' session (the contract's)
and in a session of its own (placed as a mount process is).

Owns: a private daemon and one kept mount of 110 KiB files (bench/throughput.py's dataset,
cache fill and ceilings), then rounds of one warm pass per server and reader count, the
servers' order reversed every other round, the page cache dropped before each pass and
data.mdb read back for the mount (as throughput.py --no-remount). Per pass it prints
files/s and CPU per file, and per file, of the serving thread: its sleeps and preemptions
(voluntary and involuntary context switches), trio's scheduler passes (epoll_wait calls:
trio's run loop makes one per turn, so a request whose handler yielded would add one
beside the sleeps), futex calls (a GIL hand-off or another thread's wakeup would show
there), the other system calls it made, where each sleep and preemption happened (the
system call it was in, from `perf record -e sched:sched_switch -g`), and the system calls
of every other thread of the serving process. The counts are what a busy host moves
least; files/s and CPU are figures of one run, to compare within it. Never changes silofs.

    sudo python bench/wakeups.py [--files 2000] [--readers 1,4] [--rounds 3]
        [--data-dir /var/tmp/silofs-wakeups] [--keep]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common import check_root, drop_caches, load_average, read_files, rewarm
from throughput import (
    SMALL_BYTES,
    Ceiling,
    Mount,
    _serving,
    dataset,
    fill_cache,
    small_paths,
    thread_switches,
    tree_times,
)

from tests.support.node import Node

# The system calls counted per file on the serving thread (tracepoints syscalls:sys_enter_*).
SYSCALLS = ("epoll_wait", "epoll_ctl", "futex", "poll", "read", "writev", "mincore")


@dataclass
class Server:
    """One server of the rounds: its name, mountpoint, process id, and what runs after
    each drop_caches before its pass (untimed)."""

    name: str
    root: str
    pid: Callable[[], int]
    warm: Callable[[], object] | None = None


@dataclass
class Counts:
    """One pass's figures, per file unless named otherwise."""

    files_s: float
    cpu_us: float
    slept: float
    preempted: float
    calls: dict[str, float]
    others: dict[str, int]  # other threads of the serving process: system calls, in all
    sites: dict[str, float]  # "slept in X" / "preempted in X" per file

    def text(self) -> str:
        calls = ", ".join(f"{k} {v:.2f}" for k, v in self.calls.items())
        sites = ", ".join(f"{k} {v:.3f}" for k, v in self.sites.items())
        others = ", ".join(f"{k} {v}" for k, v in self.others.items()) or "none"
        return (
            f"{self.files_s:6.0f} files/s, {self.cpu_us:4.0f} us CPU/file; serving thread per "
            f"file: slept {self.slept:.2f}, preempted {self.preempted:.2f}; scheduler passes "
            f"(epoll_wait) {self.calls.get('epoll_wait', 0):.2f}\n"
            f"      system calls per file: {calls}\n"
            f"      where it switched, per file: {sites}\n"
            f"      other threads' system calls in the pass: {others}"
        )


def _perf(args: list[str], ctl: Path) -> subprocess.Popen:
    """`perf ARGS` with its events enabled before this returns: started disabled, then
    enabled through its control FIFOs once it acknowledges (on a busy host perf may take
    longer to attach than a whole pass)."""
    fifo, ack = ctl.with_suffix(".ctl"), ctl.with_suffix(".ack")
    os.mkfifo(fifo)
    os.mkfifo(ack)
    proc = subprocess.Popen(
        ["perf", *args, "-D", "-1", "--control", f"fifo:{fifo},{ack}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    # Each open blocks until perf has opened its end of the FIFO.
    with open(fifo, "w") as c, open(ack) as a:
        c.write("enable\n")
        c.flush()
        if a.readline().strip() != "ack":
            raise RuntimeError(f"perf {args[0]} did not enable its events")
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def stat_rows(text: str) -> dict[str, dict[str, int]]:
    """`perf stat --per-thread -x,` output: {"comm-tid": {event: count}}, the events'
    syscalls:sys_enter_ prefix taken off (a row perf could not count is left out)."""
    rows: dict[str, dict[str, int]] = collections.defaultdict(dict)
    for line in text.splitlines():
        parts = line.strip().split(",")
        if line.startswith("#") or len(parts) < 4:
            continue
        with contextlib.suppress(ValueError):
            rows[parts[0]][parts[3].removeprefix("syscalls:sys_enter_")] = int(parts[1])
    return dict(rows)


_SYS = re.compile(r"^(?:__x64_sys_|__arm64_sys_|__do_sys_)(\w+)")


def switch_sites(text: str, tid: int) -> collections.Counter[str]:
    """Per switch of thread `tid` in `perf script -F tid,trace,ip,sym` output of a
    sched_switch recording with call graphs: "slept in CALL" (it left the CPU waiting)
    or "preempted in CALL" (prev_state=R: still runnable), CALL the system call on its
    kernel stack, "user" when there is none (preempted on the way back to user space)."""
    sites: collections.Counter[str] = collections.Counter()
    for block in text.split("\n\n"):
        lines = block.strip().splitlines()
        head = lines[0].split() if lines else []
        if not head or not head[0].isdigit() or int(head[0]) != tid:
            continue
        how = "preempted" if "prev_state=R" in lines[0] else "slept"
        call = "user"
        for line in lines[1:]:
            m = _SYS.match(line.split()[-1])
            if m:
                call = m.group(1)
                break
        sites[f"{how} in {call}"] += 1
    return sites


def measure(server: Server, readers: int, files: int, tmp: Path, tag: str) -> Counts:
    pid = server.pid()
    tid = _serving(pid)  # its main thread serves: tid == its pid
    paths = small_paths(server.root, files)
    drop_caches()
    if server.warm is not None:
        server.warm()
    stat_out, rec_out = str(tmp / f"{tag}.stat"), str(tmp / f"{tag}.data")
    events = ",".join(f"syscalls:sys_enter_{c}" for c in SYSCALLS)
    with contextlib.ExitStack() as perf:  # both stopped (flushed) before they are read
        for args in (
            ["stat", "--per-thread", "-x,", "-e", events, "-p", str(tid), "-o", stat_out],
            ["record", "-q", "-e", "sched:sched_switch", "-g", "-t", str(tid), "-o", rec_out],
        ):
            perf.callback(_stop, _perf(args, tmp / f"{tag}-{args[0]}"))
        t0, s0 = tree_times(pid), thread_switches(pid)
        secs, _ = read_files(paths, readers)
        cpu, s1 = tree_times(pid).minus(t0), thread_switches(pid)
    with open(stat_out) as f:
        rows = stat_rows(f.read())
    own = next((v for k, v in rows.items() if k.endswith(f"-{tid}")), {})
    others = {k: sum(v.values()) for k, v in rows.items() if not k.endswith(f"-{tid}")}
    script = subprocess.run(
        ["perf", "script", "-i", rec_out, "-F", "tid,trace,ip,sym"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    sites = switch_sites(script, tid)
    return Counts(
        files_s=files / secs,
        cpu_us=1e6 * cpu.cpu_s / files,
        slept=(s1[0] - s0[0]) / files,
        preempted=(s1[1] - s0[1]) / files,
        calls={c: own.get(c, 0) / files for c in SYSCALLS},
        others={k: v for k, v in others.items() if v},
        sites={k: v / files for k, v in sites.most_common(6)},
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=2000, help="number of 110 KiB files")
    ap.add_argument("--readers", default="1,4", help="reader threads per pass")
    ap.add_argument("--rounds", type=int, default=3, help="passes of each server per count")
    ap.add_argument("--data-dir", default="/var/tmp/silofs-wakeups", help="the dataset's home")
    ap.add_argument("--keep", action="store_true", help="keep the dataset afterwards")
    args = ap.parse_args()
    check_root()
    for tool in ("perf", "fincore"):
        if shutil.which(tool) is None:
            raise SystemExit(f"wakeups.py needs {tool}")
    readers = [int(r) for r in args.readers.split(",")]
    print(f"load average before: {load_average()}")
    size_mb = 1  # throughput.py's dataset has a big file too; one MiB of it here
    with (
        dataset(Path(args.data_dir), size_mb, args.files, args.keep) as data,
        tempfile.TemporaryDirectory(prefix="silofs-wakeups-") as tmp_s,
    ):
        tmp = Path(tmp_s)
        node = Node(tmp / "node", cache_size=2 * args.files * SMALL_BYTES + (512 << 20))
        with node, contextlib.ExitStack() as stack:
            node.start()
            m = Mount(node, f"file://{data}", str(tmp / "mnt"), ["--job", "bench"])
            m.open()
            stack.callback(m.close)
            read_files([os.path.join(m.mp, "big.bin"), *small_paths(m.mp, args.files)], 4)
            fill_cache(node, m, data, args.files)
            read_files(small_paths(m.mp, args.files), 4)  # no measured pass is its first
            m.expected = 0  # its counters are not this script's question: no settle at close
            mdb = Path(node.cache_dir) / "data.mdb"
            raw = stack.enter_context(Ceiling(data, str(tmp / "raw"), loop="turns"))
            apart = stack.enter_context(
                Ceiling(data, str(tmp / "raws"), loop="turns", own_session=True)
            )
            servers = [
                Server("silofs (kept mount)", m.mp, lambda: m.pid, lambda: rewarm(mdb)),
                Server("ceiling, readers' session", raw.mp, lambda: raw.pid),
                Server("ceiling, own session", apart.mp, lambda: apart.pid),
            ]
            for r in readers:
                print(f"\n== {r} reader(s), {args.files} files a pass ==")
                for i in range(args.rounds):
                    order = servers if i % 2 == 0 else servers[::-1]
                    for s in order:
                        c = measure(s, r, args.files, tmp, f"x{r}-{i}-{servers.index(s)}")
                        print(f"  [{i}] {s.name}: {c.text()}", flush=True)
    print(f"\nload average after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
