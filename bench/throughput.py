"""Read throughput of a warm silofs mount side by side with the same files on local disk.

Owns: one 512 MiB file and 2000 files of 110 KiB (random bytes, generated once under
--data-dir and reused), a private silofs daemon and mount of that directory (file://),
a cold first pass that fills the cache, then warm passes with the page cache dropped
before each one, interleaved with the same reads on local disk and on the two pyfuse3
ceilings (bench/rawfuse.py: from memory, and from the local disk), the ratios against
the goals (BIG_TARGET and the others below), the mount's CPU per file, how often its
serving thread slept, and peak RSS (anonymous vs LMDB-mapped), hit ratio from status,
and a byte-for-byte check of what the mount served. The ceilings start in the readers'
session, their best placement (--own-session-ceiling adds one placed as a mount process
is, in a session of its own). With --git-rev, another revision's mount process is
measured in the same rounds, through the same daemon and cache; with --no-remount too,
one mount of each tree is kept for all its passes (RAM-warm: data.mdb is read back
into the page cache after each drop, untimed, unless --no-rewarm; a long-lived mount's
hit path side by side). Never runs in CI (it drops the page cache of the whole machine)
and never changes silofs.

    sudo python bench/throughput.py                      # 512 MiB + 2000 x 110 KiB
    sudo python bench/throughput.py --size-mb 256 --files 1000 --readers 1,4 --keep
    sudo python bench/throughput.py --git-rev HEAD~3     # before (HEAD~3) and after
    sudo python bench/throughput.py --small-only --no-remount --git-rev HEAD~3  # both kept
    sudo python bench/throughput.py --profile /tmp/prof  # py-spy: cold pass, extra warm passes
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from common import (
    ProcTimes,
    Profiler,
    RssPeak,
    Samples,
    busy_processes,
    check_root,
    drop_caches,
    load_average,
    need_tools,
    profile_summary,
    ratio,
    read_files,
    resident_bytes,
    rewarm,
)
from cpu_split import PerfRecord, split

from tests.support import baseline
from tests.support.node import Node, force_unmount
from tests.support.poll import wait_for

SMALL_BYTES = 110 << 10
MIB = 1 << 20
EXIT_SECONDS = 90.0  # a mount process's exit after `silofs unmount` (Mount.close)

# The goals: warm big file >= 1.0x local disk at mount CPU <= 2x the pyfuse3 ceiling's;
# warm 110 KiB files >= 0.9x the ceiling's files/s with 1 and with 4 readers, at mount
# CPU per file <= 1.15x the ceiling's. Each is printed against both ceilings: the one
# from memory and the one from the local disk (--from-disk), which pays for the SSD
# what silofs pays after the page cache is dropped.
BIG_TARGET = 1.0
BIG_CPU_TARGET = 2.0
CEILING_TARGET = 0.9
SMALL_CPU_TARGET = 1.15


class Ceiling:
    """bench/rawfuse.py mounted at `mp` over the data dir: the pyfuse3 ceiling (the files
    served from memory), or with `from_disk` the SSD ceiling (the files mapped, read
    from the local disk as silofs reads its cache after the page cache is dropped; a
    fresh process per pass, fresh(): mapped pages survive drop_caches)."""

    def __init__(
        self,
        data: Path,
        mp: str,
        from_disk: bool = False,
        loop: str = "pyfuse3",
        own_session: bool = False,
    ) -> None:
        self.data, self.mp, self.from_disk, self.loop = data, mp, from_disk, loop
        self.own_session = own_session
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def __enter__(self) -> Ceiling:
        script = Path(__file__).resolve().parent / "rawfuse.py"
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(self.data), self.mp, "--loop", self.loop]
            + (["--from-disk"] if self.from_disk else []),
            stdout=subprocess.PIPE,
            text=True,
            # With the kernel's autogroups (kernel.sched_autogroup_enabled) a session
            # is a scheduling group of its own: a ceiling in the readers' session is
            # preempted by the reader its reply wakes and finds the next request queued,
            # where a process apart (any mount, started as `silofs mount` starts it: its
            # readers are in another session, cgroup or container) sleeps in epoll_wait
            # for ~half of its requests (bench/README.md, "Why the serving thread sleeps
            # between requests"). The contract's ceiling keeps the cheaper placement.
            start_new_session=self.own_session,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()  # after it has read the data in
        if line != "ready":
            self.__exit__()
            raise RuntimeError(f"rawfuse.py did not mount ({line!r})")
        return self

    def fresh(self) -> None:
        self.__exit__()
        self.__enter__()

    def __exit__(self, *_exc: object) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        force_unmount(self.mp)


# -- data --------------------------------------------------------------------------------
def dataset_dir(base: Path, size_mb: int, files: int) -> Path:
    return base / f"d-{size_mb}M-{files}x110K"


@contextlib.contextmanager
def dataset(base: Path, size_mb: int, files: int, keep: bool) -> Iterator[Path]:
    """The dataset under --data-dir `base` for the run; afterwards, without --keep, what
    the run wrote is removed and nothing else (remove_data)."""
    made_base = not base.exists()
    base.mkdir(parents=True, exist_ok=True)
    d = dataset_dir(base, size_mb, files)
    # Decided before the writing starts, so that an interrupted write is removed too.
    written = None if complete_marker(d).exists() else d
    try:
        yield ensure_data(base, size_mb, files)
    finally:
        if not keep:
            remove_data(base, made_base, written)


def ensure_data(base: Path, size_mb: int, files: int) -> Path:
    """The dataset directory, written once with random bytes; reused when complete."""
    d = dataset_dir(base, size_mb, files)
    done = complete_marker(d)
    if done.exists():
        print(f"data: reusing {d}")
        return d
    print(f"data: writing {size_mb} MiB + {files} x 110 KiB of random bytes to {d}")
    shutil.rmtree(d, ignore_errors=True)
    (d / "small").mkdir(parents=True)
    with open(d / "big.bin", "wb") as f:
        for _ in range(size_mb // 16):
            f.write(os.urandom(16 << 20))
        f.write(os.urandom((size_mb % 16) << 20))
    for i in range(files):
        with open(d / "small" / f"{i:06d}.bin", "wb") as f:
            f.write(os.urandom(SMALL_BYTES))
    os.sync()
    done.touch()
    return d


def complete_marker(d: Path) -> Path:
    """Written last, outside d (not part of the dataset): d is whole."""
    return d.with_name(d.name + ".complete")


def remove_data(base: Path, made_base: bool, data: Path | None) -> None:
    """Without --keep, remove what this run wrote and nothing else: `data` (None when the
    run reused a dataset some earlier run left, or wrote none) with its marker, and
    `base` only if this run made it and it is empty. --data-dir may be a directory the
    user shares with other runs or keeps other things in."""
    if data is not None:
        shutil.rmtree(data, ignore_errors=True)
        complete_marker(data).unlink(missing_ok=True)
    if made_base:
        with contextlib.suppress(OSError):
            base.rmdir()  # only if nothing else is in it


def small_paths(root: Path | str, files: int) -> list[str]:
    return [os.path.join(root, "small", f"{i:06d}.bin") for i in range(files)]


# -- measurements ------------------------------------------------------------------------
@dataclass
class Pass:
    """One timed read pass: its rate, wall time, the CPU and major page faults of the
    watched processes (the silofs mount and daemon, or the pyfuse3 ceiling) during it,
    and their peak RSS split into anonymous and file-backed (LMDB-mapped) memory."""

    rate: float
    secs: float
    cost: dict[str, ProcTimes]
    rss: dict[str, RssPeak]
    files: int = 1
    # Times the serving thread slept (voluntary context switches: in epoll_wait for the
    # next request, mostly) and was preempted, per watched process.
    switches: dict[str, tuple[int, int]] = field(default_factory=dict)

    def cost_text(self) -> str:
        return "; ".join(
            f"{who} {c.cpu_s:.2f} CPU-s ({100 * c.cpu_s / self.secs:.0f}% of a core, "
            f"{100 * c.sys_s / max(c.cpu_s, 1e-9):.0f}% in the kernel"
            + (f", {1e6 * c.cpu_s / self.files:.0f} us/file" if self.files > 1 else "")
            + f"), {c.major_faults} major faults, {self.rss[who].text()}"
            + self.switch_text(who)
            for who, c in self.cost.items()
        )

    def switch_text(self, who: str) -> str:
        if who not in self.switches:
            return ""
        slept, preempted = (n / self.files for n in self.switches[who])
        per = "file" if self.files > 1 else "pass"
        return f", main thread slept {slept:.2f}, preempted {preempted:.2f} times per {per}"


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (an exited one not yet reaped maps nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _serving(pid: int) -> int:
    """The process that serves `pid`'s requests: its first serving child with
    --serve-processes, else `pid` itself. A mount process's other child, the watcher of
    blocked device reads (silofs/mount/unstick.py), serves nothing: its switches and
    RSS are not the mount's."""
    for c in _children(pid):
        try:
            with open(f"/proc/{c}/cmdline", "rb") as f:
                if b"silofs.mount.unstick" in f.read():
                    continue
        except OSError:
            continue
        return c
    return pid


def tree_times(pid: int) -> ProcTimes:
    """CPU of a process and its children (a mount's serving processes with
    --serve-processes: its supervisor serves nothing)."""
    t = ProcTimes.of(pid)
    for c in _children(pid):
        try:
            ct = ProcTimes.of(c)
        except OSError:
            continue
        t = ProcTimes(t.user_s + ct.user_s, t.sys_s + ct.sys_s, t.major_faults + ct.major_faults)
    return t


def thread_switches(pid: int) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of `pid`'s main thread, the one that
    serves FUSE requests (a serving process's, with --serve-processes: the first)."""
    pid = _serving(pid)
    counts: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/task/{pid}/status") as f:
            for line in f:
                if "ctxt_switches" in line:
                    key, value = line.split(":")
                    counts[key] = int(value)
    except OSError:
        return 0, 0
    return counts.get("voluntary_ctxt_switches", 0), counts.get("nonvoluntary_ctxt_switches", 0)


def timed_read(
    paths: list[str],
    readers: int,
    watch: dict[str, int] | None,
    warm: Callable[[], None] | None = None,
) -> Pass:
    """Drop the page cache (then run `warm`, untimed), then read `paths` once; rate =
    bytes/s. CPU counts the watched processes' children too; RSS and switches are of the
    first serving process if any."""
    drop_caches()
    if warm is not None:
        warm()
    watch = watch or {}
    t0 = {who: tree_times(pid) for who, pid in watch.items()}
    s0 = {who: thread_switches(pid) for who, pid in watch.items()}
    with contextlib.ExitStack() as stack:
        rss = {who: stack.enter_context(RssPeak(_serving(pid))) for who, pid in watch.items()}
        secs, n = read_files(paths, readers)
    cost = {who: tree_times(pid).minus(t0[who]) for who, pid in watch.items()}
    switches: dict[str, tuple[int, int]] = {}
    for who, pid in watch.items():
        v, i = thread_switches(pid)
        switches[who] = (v - s0[who][0], i - s0[who][1])
    return Pass(n / secs, secs, cost, rss, len(paths), switches)


def big_pass(
    root: Path | str,
    watch: dict[str, int] | None = None,
    warm: Callable[[], None] | None = None,
) -> Pass:
    """The big file once, after dropping the page cache; rate in GB/s (10**9)."""
    p = timed_read([os.path.join(root, "big.bin")], 1, watch, warm)
    p.rate /= 1e9
    return p


def small_pass(
    paths: list[str],
    readers: int,
    watch: dict[str, int] | None = None,
    warm: Callable[[], None] | None = None,
) -> Pass:
    """`paths` once with `readers` threads, after dropping the page cache; files/s."""
    p = timed_read(paths, readers, watch, warm)
    p.rate = len(paths) / p.secs
    return p


def perf_passes(
    prefix: str,
    m: Mount,
    data: Path | None,
    tmp: Path,
    files: int,
    kinds: list[int],
    kept_warm: Callable[[], None] | None = None,
) -> None:
    """One more warm pass of each kind (0: the big file, else that many small-file
    readers) through a fresh silofs mount process and, given `data`, through the ceiling
    from memory, each under perf; prints where each one's CPU went (cpu_split.py).
    With `kept_warm` (--no-remount) silofs's passes are the kept mount's, as the warm
    rounds' are, `kept_warm` run (untimed) after each drop: a fresh mount's first pass
    decodes every entry and reads its values from the SSD, which is not what a kept
    pass measures."""
    print("\n== where the CPU goes (perf record -e cpu-clock; figures under perf) ==")
    servers: list[tuple[str, str, Callable[[], int]]] = [("silofs", m.mp, lambda: m.pid)]
    with contextlib.ExitStack() as stack:
        if data is not None:
            raw = stack.enter_context(Ceiling(data, str(tmp / "rawperf"), loop="turns"))
            servers.append(("ceiling", raw.mp, lambda: raw.pid))
        for kind in kinds:
            for who, root, pid in servers:
                warm = None
                if who == "silofs":
                    if kept_warm is None or not m.pid:
                        m.fresh()
                    warm = kept_warm
                out = f"{prefix}-{who}-{'big' if not kind else f'x{kind}'}.data"
                watch = {who: pid()}
                with PerfRecord(pid(), out):
                    if kind:
                        p = small_pass(small_paths(root, files), kind, watch, warm)
                        rate = f"{p.rate:.0f} files/s"
                    else:
                        p = big_pass(root, watch, warm)
                        rate = f"{p.rate:.2f} GB/s"
                c = p.cost[who]
                print(
                    f"  {who}, {'big file' if not kind else f'small x{kind}'}: {rate}, "
                    f"{c.cpu_s:.2f} CPU-s, {c.major_faults} major faults ({out})"
                )
                print(split(out).text())


def verify(local: Path, mp: str, files: int) -> list[str]:
    """Files whose bytes through the mount differ from the local copy."""
    bad = []
    names = ["big.bin"] + [os.path.relpath(p, local) for p in small_paths(local, files)]
    for name in names:
        with open(local / name, "rb") as a, open(os.path.join(mp, name), "rb") as b:
            while True:
                x, y = a.read(8 << 20), b.read(8 << 20)
                if x != y:
                    bad.append(name)
                    break
                if not x:
                    break
    return bad


# -- the run -----------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=512, help="size of the big file (MiB)")
    ap.add_argument("--files", type=int, default=2000, help="number of 110 KiB files")
    ap.add_argument("--readers", default="1,4", help="reader threads for small files")
    ap.add_argument("--chunk-size", default=None, help="silofs --chunk-size (default: 4M)")
    ap.add_argument("--repeat", type=int, default=3, help="warm passes of each kind")
    ap.add_argument(
        "--data-dir", default="/var/tmp/silofs-bench", help="where the data is generated and reused"
    )
    ap.add_argument("--keep", action="store_true", help="keep the data dir afterwards")
    ap.add_argument(
        "--no-remount",
        action="store_true",
        help="keep one mount process for all warm passes, with --git-rev one of each tree, "
        "both mounted side by side, data.mdb read back into the page cache (untimed) after "
        "each drop_caches: a RAM-warm figure, not an SSD-warm one; with --git-rev each kept "
        "mount reads the files once, unmeasured, before the warm rounds, so every pass is "
        "a kept mount's",
    )
    ap.add_argument("--no-verify", action="store_true", help="skip the byte-for-byte check")
    ap.add_argument(
        "--no-rewarm",
        action="store_true",
        help="with --no-remount: do not read data.mdb back into the page cache after each "
        "drop_caches (its values, copied out by preadv and mapped by no process, are then "
        "partly read from the SSD in every kept pass, while the ceiling serves from memory)",
    )
    baseline.add_argument(ap, "mount process (through the same daemon and cache, interleaved)")
    ap.add_argument(
        "--small-only",
        action="store_true",
        help="warm passes of the small files only (the cold pass still reads everything)",
    )
    ap.add_argument(
        "--big-only",
        action="store_true",
        help="warm passes of the big file only (the cold pass still reads everything)",
    )
    ap.add_argument(
        "--serve-processes",
        type=int,
        default=1,
        help="this tree's mount with --serve-processes N (the baseline's without)",
    )
    ap.add_argument(
        "--no-ceiling",
        action="store_true",
        help="skip the pyfuse3 ceilings (bench/rawfuse.py: the same files served from memory, "
        "and from the local disk, by a minimal pyfuse3 filesystem, measured the same way "
        "as silofs)",
    )
    ap.add_argument(
        "--pyfuse3-loop-ceiling",
        action="store_true",
        help="also both ceilings served with pyfuse3's own device loop (rawfuse.py --loop "
        "pyfuse3; the contract's ceilings use the cheaper one silofs uses, --loop turns)",
    )
    ap.add_argument(
        "--own-session-ceiling",
        action="store_true",
        help="also the ceiling from memory started in a session of its own, as a mount "
        "process is, not in the readers' (the contract's ceiling): with the kernel's "
        "autogroups the readers' wakeups then seldom preempt it, and it sleeps more",
    )
    ap.add_argument(
        "--perf",
        metavar="PREFIX",
        default=None,
        help="after the warm rounds, one more warm pass of each kind through silofs (with "
        "--no-remount the kept mount, data.mdb read back first; else a fresh mount) and "
        "through the ceiling from memory under `perf record` (PREFIX-*.data), and their "
        "CPU split by part: the reply, the verification, the page-cache fill, ... "
        "(bench/cpu_split.py)",
    )
    ap.add_argument(
        "--profile",
        metavar="PREFIX",
        default=None,
        help="py-spy record the daemon and the mount during the cold pass (its figures are "
        "then not comparable) and the mount during one extra warm pass of each kind, into "
        "PREFIX-*.txt, and print the top functions",
    )
    args = ap.parse_args()
    readers = [int(r) for r in args.readers.split(",")]
    need_tools({"--profile": args.profile and "py-spy", "--perf": args.perf and "perf"})
    check_root()

    tmp = Path(tempfile.mkdtemp(prefix="silofs-bench-", dir="/var/tmp"))
    try:
        with dataset(Path(args.data_dir), args.size_mb, args.files, args.keep) as data:
            if args.git_rev is None:
                return run(args, data, readers, tmp, None)
            with baseline.baseline_tree(args.git_rev) as tree:
                return run(args, data, readers, tmp, tree)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


COUNTERS = ("bytes_read", "hits", "misses", "hit_bytes", "remote_bytes", "remote_gets")


class Mount:
    """The silofs mount under test, remounted on demand, with counters summed over mounts.

    A fresh mount process per measured pass is what makes drop_caches honest: pages of
    the LMDB file that a process has mapped survive drop_caches (the kernel drops only
    unmapped clean pages), so a long-lived mount process would serve later passes from
    RAM however often the page cache is "dropped"; so would the previous one, had close()
    not waited for it to exit.
    """

    def __init__(self, node: Node, uri: str, mp: str, args: list[str]) -> None:
        self.node, self.uri, self.mp, self.args = node, uri, mp, args
        self.totals = dict.fromkeys(COUNTERS, 0)
        self.expected = 0  # bytes the current mount process must report
        self.pid = 0

    def open(self) -> None:
        self.node.mount(self.uri, self.mp, *self.args)
        self.pid = self.node.mount_pid(self.mp)
        self.expected = 0

    def close(self) -> None:
        if not self.pid:
            return
        if self.expected:
            st = self.node.settle(self.mp, self.expected)
            for k in COUNTERS:
                self.totals[k] += st[k]
            self.expected = 0
        pids = [self.pid, *_children(self.pid)]
        self.node.unmount(self.mp)
        # A mount process ends a second or two after `silofs unmount` returns, its LMDB
        # pages still mapped meanwhile: the next pass's drop_caches would keep them. Its
        # last report to the daemon may take up to the daemon timeout (30 s) when the
        # daemon is slow to answer (seen on a loaded host), so wait longer than that.
        wait_for(
            lambda: not any(map(_running, pids)),
            timeout=EXIT_SECONDS,
            what=f"mount process {self.pid} to exit",
        )
        self.pid = 0

    def chunk_size(self) -> int:
        return int(self.node.mount_status(self.mp)["chunk_size"])

    def fresh(self) -> None:
        self.close()
        self.open()

    def snapshot(self) -> dict[str, int]:
        """Counters of all mounts so far, the current one settled."""
        out = dict(self.totals)
        if self.expected:
            st = self.node.settle(self.mp, self.expected)
            for k in COUNTERS:
                out[k] += st[k]
        return out


def ready(this: Mount, other: Mount | None, keep: bool) -> None:
    """Make `this` the mount for the next measured pass. Without `keep` (SSD-warm), only
    a fresh `this` is mounted: `other` is closed and `this` restarted, since a process
    that has mapped LMDB pages keeps them through drop_caches. With `keep` (RAM-warm,
    --no-remount) both stay mounted for all their passes, `this` opened only if it is
    not: data.mdb, which both read, is read back into the page cache before each pass
    (run()'s kept_mdb), for both alike."""
    if other is not None and not keep:
        other.close()
    if not keep or not this.pid:
        this.fresh()


def dataset_status(node: Node, uri: str) -> dict:
    for ds in node.status()["datasets"]:
        if ds["uri"].rstrip("/") == uri.rstrip("/"):
            return ds
    raise RuntimeError(f"no dataset {uri} in the daemon's status")


def stable_cached_chunks(node: Node, uri: str) -> int:
    """The dataset's cached chunk count once the writer has stopped admitting."""
    last = -1
    while True:
        n = dataset_status(node, uri)["cached_chunks"]
        if n == last:
            return n
        last = n
        time.sleep(0.5)


def fill_cache(node: Node, m: Mount, data: Path, files: int, attempts: int = 3) -> None:
    """Re-read until every chunk is admitted. The daemon's writer drops chunks when its
    admission queue is full (counted as dropped_chunks): a fast cold pass can leave a
    few chunks out, and the warm passes would then measure misses."""
    cs = m.chunk_size()
    want = -(-(os.path.getsize(data / "big.bin")) // cs) + files
    everything = [str(Path(m.mp) / "big.bin")] + small_paths(m.mp, files)
    for attempt in range(attempts + 1):
        have = stable_cached_chunks(node, m.uri)
        w = node.status()["node"]["writer"]
        print(
            f"cache: {have}/{want} chunks admitted; writer: admitted {w['admitted_chunks']}, "
            f"dropped (queue full) {w['dropped_chunks']}, rejected {w['rejected_chunks']}"
        )
        if have >= want or attempt == attempts:
            return
        m.fresh()  # an empty mount-side buffer: every missing chunk goes to the daemon
        _, n = read_files(everything, 4)
        m.expected += n


def run(
    args: argparse.Namespace, data: Path, readers: list[int], tmp: Path, tree: Path | None
) -> int:
    total = (args.size_mb << 20) + args.files * SMALL_BYTES
    big_bytes = args.size_mb << 20
    warm_readers = [] if args.big_only else readers
    mp = str(tmp / "mnt")
    local_small = small_paths(data, args.files)
    fuse_small = small_paths(mp, args.files)
    print(f"load average before: {load_average()}")
    for line in busy_processes():
        print(f"  busy: {line}")

    node = Node(
        tmp / "node",
        cache_size=total * 2 + (512 << 20),
        chunk_size=args.chunk_size,
    )
    with node:
        node.start()
        mount_args = ["--job", "bench"]
        if args.chunk_size:
            mount_args += ["--chunk-size", args.chunk_size]
        ours = mount_args
        if args.serve_processes > 1:  # this tree's mount only: the baseline has no flag
            ours = [*mount_args, "--serve-processes", str(args.serve_processes)]
        m = Mount(node, f"file://{data}", mp, ours)
        t0 = time.perf_counter()
        m.open()
        print(f"mount: {time.perf_counter() - t0:.2f}s (listing {args.files + 1} objects)")

        profiles: list[str] = []

        @contextlib.contextmanager
        def profiling(kind: str, daemon: bool = True) -> Iterator[None]:
            """py-spy on the mount process (and the daemon) during one silofs pass."""
            if not args.profile:
                yield
                return
            with contextlib.ExitStack() as stack:
                targets = [("mount", m.pid)] + ([("daemon", node.daemon_pid)] if daemon else [])
                for who, pid in targets:
                    out = f"{args.profile}-{kind}-{who}.txt"
                    stack.enter_context(Profiler(pid, out))
                    profiles.append(out)
                yield

        # Cold pass: everything is a miss served by the daemon from the local dir
        # (itself cold). Small files are split into one group per reader count.
        print("\n== pass 1: cold cache (remote = the local dir, page cache dropped) ==")
        watch = {"mount": m.pid, "daemon": node.daemon_pid}
        with profiling("cold-big"):
            cold_big = big_pass(mp, watch)
        local_cold_big = big_pass(data).rate
        print(
            f"big file   silofs {cold_big.rate:6.2f} GB/s   local {local_cold_big:6.2f} GB/s   "
            f"ratio {ratio(cold_big.rate, local_cold_big):.2f}x\n    {cold_big.cost_text()}"
        )
        group = args.files // len(readers)
        for i, r in enumerate(readers):
            part = slice(i * group, (i + 1) * group)
            with profiling(f"cold-small-x{r}"):
                cold = small_pass(fuse_small[part], r, watch)
            # Local reads of the same files after drop_caches: what silofs read cold.
            local = small_pass(local_small[part], r).rate
            print(
                f"small x{r:<2}  silofs {cold.rate:6.0f} files/s local {local:6.0f} files/s "
                f"ratio {ratio(cold.rate, local):.2f}x   ({group} files)\n    {cold.cost_text()}"
            )
        m.expected = big_bytes + group * len(readers) * SMALL_BYTES
        st = m.snapshot()
        print(
            f"status: bytes_read {st['bytes_read']} hits {st['hits']} misses {st['misses']} "
            f"hit ratio {ratio(st['hit_bytes'], st['bytes_read']):.3f} "
            f"remote_gets {st['remote_gets']} remote_bytes {st['remote_bytes']}"
        )
        fill_cache(node, m, data, args.files)
        before = m.snapshot()

        # Warm passes, interleaved with local disk so machine noise hits both alike.
        if not args.no_remount:
            how = "a fresh mount process per pass"
        elif tree is None:
            how = "one mount process kept: RAM-warm, data.mdb read back after each drop"
        else:
            how = (
                "one mount process of each tree kept, side by side: RAM-warm, data.mdb "
                "read back after each drop"
            )
        if args.no_remount and args.no_rewarm:
            how = how.replace("read back after each drop", "NOT read back (--no-rewarm)")
        print(
            f"\n== warm passes ({args.repeat} each, {how}; page cache dropped before each "
            "read; median (min-max)) =="
        )
        # A kept mount's pass is RAM-warm only if data.mdb is in the page cache: the
        # values a mount copies out by preadv are mapped by no process, so drop_caches
        # takes them (a third of them in a 2000-file run, bench/README.md). Unless
        # --no-rewarm, data.mdb is read back in, untimed, after each drop before a kept
        # pass, as the ceiling has every file in memory; either way what the drop left
        # is measured (fincore) and printed.
        mdb = Path(node.cache_dir) / "data.mdb"
        mdb_left: list[tuple[int, int]] = []  # (resident after the drop, data bytes)

        def kept_mdb() -> None:
            left = resident_bytes(mdb)
            size = rewarm(mdb) if not args.no_rewarm else 0
            if left is not None:
                mdb_left.append((left, size))

        kept_warm: Callable[[], None] | None = kept_mdb if args.no_remount else None
        big_s, big_l = Samples([]), Samples([])
        small_s = {r: Samples([]) for r in readers}
        small_l = {r: Samples([]) for r in readers}
        costs: dict[str, list[Pass]] = {}
        # Per ceiling ("ceiling": from memory, "ssd ceiling": from the local disk).
        ceil_rates: dict[str, dict[str, Samples]] = {}
        ceiling_costs: dict[str, dict[str, list[Pass]]] = {}

        def timed(kind: str, nbytes: int, fn: Callable[[dict[str, int]], Pass]) -> float:
            ready(m, base, args.no_remount)
            p = fn({"mount": m.pid})
            costs.setdefault(kind, []).append(p)
            m.expected += nbytes
            return p.rate

        base: Mount | None = None
        base_costs: dict[str, list[Pass]] = {}
        big_b = Samples([])
        small_b = {r: Samples([]) for r in readers}
        base_mp = str(tmp / "mnt-baseline")
        if tree is not None:
            # The other tree's `silofs mount` and mount process, against our daemon.
            other = copy.copy(node)
            other.env = baseline.env(tree, node.env)
            base = Mount(other, f"file://{data}", base_mp, mount_args)
            base.open()
        if args.no_remount and base is not None:
            # A long-lived mount has served the files before: one unmeasured read of
            # everything the rounds read, through each kept mount, so that no measured
            # pass is a fresh mount's first (handler_ir.py --kept drops its first pass).
            # Ours read everything in the cold pass already; both read it again alike.
            for km, root in ((m, mp), (base, base_mp)):
                if km is None:
                    continue
                if not km.pid:
                    km.open()
                names = [] if args.small_only else [os.path.join(root, "big.bin")]
                if warm_readers:
                    names += small_paths(root, args.files)
                _, n = read_files(names, 4)
                km.expected += n
            before = m.snapshot()
            print("kept mounts: every file read once through each before the warm rounds")

        def timed_base(kind: str, nbytes: int, fn: Callable[[dict[str, int]], Pass]) -> float:
            assert base is not None
            ready(base, m, args.no_remount)
            p = fn({"mount": base.pid})
            base_costs.setdefault(kind, []).append(p)
            base.expected += nbytes
            return p.rate

        with contextlib.ExitStack() as stack:
            ceilings: dict[str, Ceiling] = {}
            if not args.no_ceiling:
                kinds = [
                    ("ceiling", "raw", False, "turns", False),
                    ("ssd ceiling", "rawd", True, "turns", False),
                ]
                if args.pyfuse3_loop_ceiling:
                    kinds.append(("pyfuse3-loop ceiling", "rawp", False, "pyfuse3", False))
                    kinds.append(("pyfuse3-loop ssd ceiling", "rawdp", True, "pyfuse3", False))
                if args.own_session_ceiling:
                    kinds.append(("own-session ceiling", "raws", False, "turns", True))
                for name, mp_name, disk, loop, apart in kinds:
                    ceilings[name] = stack.enter_context(
                        Ceiling(data, str(tmp / mp_name), disk, loop, own_session=apart)
                    )
                    ceil_rates[name] = {}
                    ceiling_costs[name] = {}

            def raw(name: str, kind: str, fn: Callable[[dict[str, int]], Pass]) -> None:
                if ceilings[name].from_disk:
                    # Started for its pass and stopped after it: the files another
                    # process keeps mapped would survive drop_caches.
                    ceilings[name].fresh()
                try:
                    p = fn({"ceiling": ceilings[name].pid})
                finally:
                    if ceilings[name].from_disk:
                        ceilings[name].__exit__()
                ceiling_costs[name].setdefault(kind, []).append(p)
                ceil_rates[name].setdefault(kind, Samples([])).values.append(p.rate)

            for round_ in range(args.repeat):
                # Every kind of pass in a fixed order would favour whoever goes first or
                # last on a busy machine: the rounds alternate the order.
                def ours_big() -> None:
                    big_s.values.append(
                        timed("big", big_bytes, lambda w: big_pass(mp, w, kept_warm))
                    )

                def base_big() -> None:
                    if base:
                        big_b.values.append(
                            timed_base("big", big_bytes, lambda w: big_pass(base_mp, w, kept_warm))
                        )

                def local_big() -> None:
                    big_l.values.append(big_pass(data).rate)

                def raw_big() -> None:
                    for name, c in ceilings.items():
                        raw(name, "big", lambda w, c=c: big_pass(c.mp, w))  # type: ignore[misc]

                def ours_small(r: int) -> None:
                    small_s[r].values.append(
                        timed(
                            f"x{r}",
                            args.files * SMALL_BYTES,
                            lambda w: small_pass(fuse_small, r, w, kept_warm),
                        )
                    )

                def base_small(r: int) -> None:
                    if base:
                        paths = small_paths(base_mp, args.files)
                        small_b[r].values.append(
                            timed_base(
                                f"x{r}",
                                args.files * SMALL_BYTES,
                                lambda w: small_pass(paths, r, w, kept_warm),
                            )
                        )

                def local_small_pass(r: int) -> None:
                    small_l[r].values.append(small_pass(local_small, r).rate)

                def raw_small_pass(r: int) -> None:
                    for name, c in ceilings.items():
                        paths = small_paths(c.mp, args.files)
                        raw(name, f"x{r}", lambda w, p=paths: small_pass(p, r, w))  # type: ignore[misc]

                bigs = [ours_big, base_big, local_big, raw_big]
                smalls = [ours_small, base_small, local_small_pass, raw_small_pass]
                if round_ % 2:
                    bigs.reverse()
                    smalls.reverse()
                if not args.small_only:
                    for step in bigs:
                        step()
                for r in warm_readers:
                    for small_step in smalls:
                        small_step(r)
        after = m.snapshot()
        ok = True

        def verdict(value: float, target: float, most: bool = False) -> str:
            good = value <= target if most else value >= target
            return f"(target {'<=' if most else '>='} {target}x) {'ok' if good else 'MISS'}"

        def median_cpu(table: dict[str, list[Pass]], kind: str, who: str) -> float:
            """Median CPU of `who` per pass (big) or per file (small), in us."""
            ps = table.get(kind, [])
            return Samples([1e6 * p.cost[who].cpu_s / p.files for p in ps]).median if ps else 0.0

        def against_ceilings(kind: str, ours: Samples, unit: str, fmt: str) -> bool:
            """silofs against each ceiling: rate and mount CPU. True if the goals against
            the ceiling from memory hold (the contract; the SSD one is printed beside)."""
            met = True
            mine = median_cpu(costs, kind, "mount")
            for name, rates in ceil_rates.items():
                theirs = rates.get(kind)
                if theirs is None:
                    continue
                rr = ratio(ours.median, theirs.median)
                rc = ratio(mine, median_cpu(ceiling_costs[name], kind, "ceiling"))
                big = kind == "big"
                rate_ok = "" if big else f" {verdict(rr, CEILING_TARGET)}"
                cpu_target = BIG_CPU_TARGET if big else SMALL_CPU_TARGET
                label = {
                    "ceiling": "pyfuse3 ceiling",
                    "ssd ceiling": "pyfuse3 SSD ceiling",
                    "pyfuse3-loop ceiling": "pyfuse3 ceiling, pyfuse3's own loop",
                    "pyfuse3-loop ssd ceiling": "pyfuse3 SSD ceiling, pyfuse3's own loop",
                    "own-session ceiling": "pyfuse3 ceiling in a session of its own",
                }[name]
                print(
                    f"           {label} {theirs.text(fmt)} {unit}   silofs/{name} {rr:.2f}x"
                    f"{rate_ok}; mount CPU / {name}'s {rc:.2f}x {verdict(rc, cpu_target, True)}"
                )
                if name == "ceiling":
                    met &= rc <= cpu_target and (big or rr >= CEILING_TARGET)
            return met

        rb = ratio(big_s.median, big_l.median)
        if big_s.values:
            ok &= rb >= BIG_TARGET
            print(
                f"big file   silofs {big_s.text()} GB/s   local {big_l.text()} GB/s   "
                f"ratio {rb:.2f}x {verdict(rb, BIG_TARGET)}"
            )
            ok &= against_ceilings("big", big_s, "GB/s", "{:.2f}")
        if big_b.values:
            print(
                f"           baseline {big_b.text()} GB/s   ratio "
                f"{ratio(big_b.median, big_l.median):.2f}x (this tree / baseline "
                f"{ratio(big_s.median, big_b.median):.2f}x)"
            )
        for r in warm_readers:
            rs = ratio(small_s[r].median, small_l[r].median)
            print(
                f"small x{r:<2}  silofs {small_s[r].text('{:.0f}')} files/s   "
                f"local {small_l[r].text('{:.0f}')} files/s   ratio {rs:.2f}x"
            )
            ok &= against_ceilings(f"x{r}", small_s[r], "files/s", "{:.0f}")
            if small_b[r].values:
                print(
                    f"           baseline {small_b[r].text('{:.0f}')} files/s   ratio "
                    f"{ratio(small_b[r].median, small_l[r].median):.2f}x (this tree / "
                    f"baseline {ratio(small_s[r].median, small_b[r].median):.2f}x)"
                )
        for who, table in (
            ("mount process", costs),
            ("baseline mount", base_costs),
            *((f"pyfuse3 {name}", t) for name, t in ceiling_costs.items()),
        ):
            for kind, ps in table.items():
                key = "ceiling" if who.startswith("pyfuse3") else "mount"
                cpu = Samples([p.cost[key].cpu_s for p in ps])
                kernel = sum(p.cost[key].sys_s for p in ps) / max(sum(cpu.values), 1e-9)
                busy = Samples([p.cost[key].cpu_s / p.secs for p in ps])
                per_file = Samples([1e6 * p.cost[key].cpu_s / p.files for p in ps])
                faults = ", ".join(str(p.cost[key].major_faults) for p in ps)
                anon = max(p.rss[key].anon for p in ps) / 1024
                mapped = max(p.rss[key].file for p in ps) / 1024
                unit = f", {per_file.text('{:.0f}')} us CPU/file" if kind != "big" else ""
                slept = Samples([p.switches.get(key, (0, 0))[0] / p.files for p in ps])
                print(
                    f"  {who}, {kind:>3} pass: {cpu.text()} CPU-s{unit} "
                    f"({100 * busy.median:.0f}% of a core, {100 * kernel:.0f}% in the kernel), "
                    f"major faults {faults}; peak RSS anon {anon:.0f} MiB, "
                    f"file-backed {mapped:.0f} MiB; serving thread slept {slept.text('{:.2f}')} "
                    f"times per {'pass' if kind == 'big' else 'file'}"
                )
        if mdb_left:
            lefts = Samples([left / MIB for left, _ in mdb_left])
            sizes = [size for _, size in mdb_left if size]
            print(
                f"kept mounts: data.mdb after each drop_caches {lefts.text('{:.0f}')} MiB in the "
                "page cache"
                + (
                    f", read back to {max(sizes) / MIB:.0f} MiB (all its data) before each pass"
                    if sizes
                    else " (--no-rewarm: the rest of each pass's values read from the SSD)"
                )
            )
        d = {k: after[k] - before[k] for k in COUNTERS}
        print(
            f"status (warm passes): bytes_read {d['bytes_read']} hits {d['hits']} "
            f"misses {d['misses']} hit ratio {ratio(d['hit_bytes'], d['bytes_read']):.4f} "
            f"remote_gets {d['remote_gets']} remote_bytes {d['remote_bytes']}"
        )

        if args.profile:
            print("\n== profiles (py-spy, --nonblocking; figures under py-spy) ==")
            m.fresh()
            with profiling("warm-big", daemon=False):
                print(f"  big     {big_pass(mp).rate:.2f} GB/s (under py-spy)")
            for r in warm_readers:
                m.fresh()
                with profiling(f"warm-small-x{r}", daemon=False):
                    print(
                        f"  small x{r} {small_pass(fuse_small, r).rate:.0f} files/s (under py-spy)"
                    )
            m.expected = 0
            for out in profiles:
                print(f"\n{out}:\n{profile_summary(out)}")

        if args.perf:
            kinds = ([] if args.small_only else [0]) + warm_readers  # 0: the big file
            perf_passes(
                args.perf, m, None if args.no_ceiling else data, tmp, args.files, kinds, kept_warm
            )
            m.expected = 0
        if not m.pid:
            m.open()
        if not args.no_verify:
            bad = verify(data, mp, args.files)
            print(
                f"\nverify: {'all bytes match' if not bad else f'{len(bad)} files DIFFER'}"
                + (f": {bad[:5]}" if bad else "")
            )
            ok &= not bad
        m.expected = 0
        m.close()
        if base is not None:
            base.expected = 0
            base.close()
    print(f"load average after: {load_average()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
