"""Read throughput of a warm silofs mount side by side with the same files on local disk.

Owns: one 512 MiB file and 2000 files of 110 KiB (random bytes, generated once under
--data-dir and reused), a private silofs daemon and mount of that directory (file://),
a cold first pass that fills the cache, then warm passes with the page cache dropped
before each one, interleaved with the same reads on local disk, the ratios against the
targets (big file >= 0.8x local, small files >= 0.5x local), hit ratio from status, and
a byte-for-byte check of what the mount served. Never runs in CI (it drops the page
cache of the whole machine) and never changes silofs.

    sudo python bench/throughput.py                      # 512 MiB + 2000 x 110 KiB
    sudo python bench/throughput.py --size-mb 256 --files 1000 --readers 1,4 --keep
    sudo python bench/throughput.py --profile /tmp/prof  # py-spy the mount, extra passes
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from common import (
    Node,
    ProcTimes,
    Samples,
    busy_processes,
    check_root,
    drop_caches,
    load_average,
    ratio,
    read_files,
)

SMALL_BYTES = 110 << 10
BIG_TARGET = 0.8
SMALL_TARGET = 0.5


# -- data --------------------------------------------------------------------------------
def dataset_dir(base: Path, size_mb: int, files: int) -> Path:
    return base / f"d-{size_mb}M-{files}x110K"


def ensure_data(base: Path, size_mb: int, files: int) -> Path:
    """The dataset directory, written once with random bytes; reused when complete."""
    d = dataset_dir(base, size_mb, files)
    done = d.with_name(d.name + ".complete")  # outside d: not part of the dataset
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


def small_paths(root: Path | str, files: int) -> list[str]:
    return [os.path.join(root, "small", f"{i:06d}.bin") for i in range(files)]


# -- measurements ------------------------------------------------------------------------
def big_pass(root: Path | str) -> float:
    """GB/s (10**9) reading the big file once, after dropping the page cache."""
    drop_caches()
    secs, n = read_files([os.path.join(root, "big.bin")], 1)
    return n / secs / 1e9


def small_pass(paths: list[str], readers: int) -> float:
    """Files/s reading `paths` once with `readers` threads, after dropping the page cache."""
    drop_caches()
    secs, _ = read_files(paths, readers)
    return len(paths) / secs


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


class Profiler:
    """py-spy record of one process while a block runs (raw collapsed stacks)."""

    def __init__(self, pid: int, out: str) -> None:
        self.pid, self.out = pid, out
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Profiler:
        exe = shutil.which("py-spy")
        if exe is None:
            sys.exit("--profile needs py-spy: pip install py-spy")
        self.proc = subprocess.Popen(
            [
                exe,
                "record",
                "-p",
                str(self.pid),
                "-r",
                "250",
                "--format",
                "raw",
                "-o",
                self.out,
                "--nonblocking",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1.0)  # py-spy attaches
        return self

    def __exit__(self, *_exc: object) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        print(f"  profile: {self.out}")


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
        help="keep one mount process for all warm passes (its mapped LMDB pages then "
        "survive drop_caches: a RAM-warm figure, not an SSD-warm one)",
    )
    ap.add_argument("--no-verify", action="store_true", help="skip the byte-for-byte check")
    ap.add_argument(
        "--profile",
        metavar="PREFIX",
        default=None,
        help="after the measured passes, py-spy record the mount process "
        "during one more warm pass of each kind into PREFIX-*.txt",
    )
    args = ap.parse_args()
    readers = [int(r) for r in args.readers.split(",")]
    check_root()

    base = Path(args.data_dir)
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="silofs-bench-", dir="/var/tmp"))
    try:
        data = ensure_data(base, args.size_mb, args.files)
        return run(args, data, readers, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(dataset_dir(base, args.size_mb, args.files), ignore_errors=True)
            dataset_dir(base, args.size_mb, args.files).with_name(
                f"d-{args.size_mb}M-{args.files}x110K.complete"
            ).unlink(missing_ok=True)


COUNTERS = ("bytes_read", "hits", "misses", "hit_bytes", "remote_bytes", "remote_gets")


class Mount:
    """The silofs mount under test, remounted on demand, with counters summed over mounts.

    A fresh mount process per measured pass is what makes drop_caches honest: pages of
    the LMDB file that a process has mapped survive drop_caches (the kernel drops only
    unmapped clean pages), so a long-lived mount process would serve later passes from
    RAM however often the page cache is "dropped".
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
        if self.expected:
            st = self.node.settled(self.mp, self.expected)
            for k in COUNTERS:
                self.totals[k] += st[k]
        self.node.unmount(self.mp)
        self.pid = 0

    def fresh(self) -> None:
        self.close()
        self.open()

    def snapshot(self) -> dict[str, int]:
        """Counters of all mounts so far, the current one settled."""
        out = dict(self.totals)
        if self.expected:
            st = self.node.settled(self.mp, self.expected)
            for k in COUNTERS:
                out[k] += st[k]
        return out


def run(args: argparse.Namespace, data: Path, readers: list[int], tmp: Path) -> int:
    total = (args.size_mb << 20) + args.files * SMALL_BYTES
    big_bytes = args.size_mb << 20
    mp = str(tmp / "mnt")
    local_small = small_paths(data, args.files)
    fuse_small = small_paths(mp, args.files)
    print(f"load average before: {load_average()}")
    for line in busy_processes():
        print(f"  busy: {line}")

    node = Node(tmp / "node", cache_size=total * 2 + (512 << 20), chunk_size=args.chunk_size)
    with node:
        node.start()
        mount_args = ["--job", "bench"]
        if args.chunk_size:
            mount_args += ["--chunk-size", args.chunk_size]
        m = Mount(node, f"file://{data}", mp, mount_args)
        t0 = time.perf_counter()
        m.open()
        print(f"mount: {time.perf_counter() - t0:.2f}s (listing {args.files + 1} objects)")

        # Cold pass: everything is a miss served by the daemon from the local dir
        # (itself cold). Small files are split into one group per reader count.
        print("\n== pass 1: cold cache (remote = the local dir, page cache dropped) ==")
        cold_big = big_pass(mp)
        local_cold_big = big_pass(data)
        print(
            f"big file   silofs {cold_big:6.2f} GB/s   local {local_cold_big:6.2f} GB/s   "
            f"ratio {ratio(cold_big, local_cold_big):.2f}x"
        )
        group = args.files // len(readers)
        for i, r in enumerate(readers):
            part = slice(i * group, (i + 1) * group)
            cold = small_pass(fuse_small[part], r)
            # Local reads of the same files after drop_caches: what silofs read cold.
            local = small_pass(local_small[part], r)
            print(
                f"small x{r:<2}  silofs {cold:6.0f} files/s local {local:6.0f} files/s "
                f"ratio {ratio(cold, local):.2f}x   ({group} files)"
            )
        m.expected = big_bytes + group * len(readers) * SMALL_BYTES
        st = m.snapshot()
        print(
            f"status: bytes_read {st['bytes_read']} hits {st['hits']} misses {st['misses']} "
            f"hit ratio {ratio(st['hit_bytes'], st['bytes_read']):.3f} "
            f"remote_gets {st['remote_gets']} remote_bytes {st['remote_bytes']}"
        )
        before = st

        # Warm passes, interleaved with local disk so machine noise hits both alike.
        how = "a fresh mount process per pass" if not args.no_remount else "one mount process"
        print(
            f"\n== warm passes ({args.repeat} each, {how}; page cache dropped before each "
            "read; median (min-max)) =="
        )
        big_s, big_l = Samples([]), Samples([])
        small_s = {r: Samples([]) for r in readers}
        small_l = {r: Samples([]) for r in readers}
        costs: dict[str, list[ProcTimes]] = {}

        def timed(kind: str, nbytes: int, fn: Callable[[], float]) -> float:
            if not args.no_remount:
                m.fresh()
            t0 = ProcTimes.of(m.pid)
            value = fn()
            costs.setdefault(kind, []).append(ProcTimes.of(m.pid).minus(t0))
            m.expected += nbytes
            return value

        for _ in range(args.repeat):
            big_s.values.append(timed("big", big_bytes, lambda: big_pass(mp)))
            big_l.values.append(big_pass(data))
            for r in readers:
                small_s[r].values.append(
                    timed(f"x{r}", args.files * SMALL_BYTES, lambda r=r: small_pass(fuse_small, r))
                )
                small_l[r].values.append(small_pass(local_small, r))
        after = m.snapshot()
        ok = True
        rb = ratio(big_s.median, big_l.median)
        ok &= rb >= BIG_TARGET
        print(
            f"big file   silofs {big_s.text()} GB/s   local {big_l.text()} GB/s   "
            f"ratio {rb:.2f}x (target >= {BIG_TARGET}x) {'ok' if rb >= BIG_TARGET else 'MISS'}"
        )
        for r in readers:
            rs = ratio(small_s[r].median, small_l[r].median)
            ok &= rs >= SMALL_TARGET
            print(
                f"small x{r:<2}  silofs {small_s[r].text('{:.0f}')} files/s   "
                f"local {small_l[r].text('{:.0f}')} files/s   ratio {rs:.2f}x "
                f"(target >= {SMALL_TARGET}x) {'ok' if rs >= SMALL_TARGET else 'MISS'}"
            )
        for kind, cs in costs.items():
            print(
                f"  mount process, {kind:>3} pass: {sum(c.cpu_s for c in cs) / len(cs):.2f} "
                f"CPU-s, {sum(c.major_faults for c in cs) // len(cs)} major page faults "
                f"(per pass: {', '.join(str(c.major_faults) for c in cs)})"
            )
        d = {k: after[k] - before[k] for k in COUNTERS}
        print(
            f"status (warm passes): bytes_read {d['bytes_read']} hits {d['hits']} "
            f"misses {d['misses']} hit ratio {ratio(d['hit_bytes'], d['bytes_read']):.4f} "
            f"remote_gets {d['remote_gets']} remote_bytes {d['remote_bytes']}"
        )

        if args.profile:
            print("\n== profile of the mount process, extra warm passes ==")
            m.fresh()
            with Profiler(m.pid, f"{args.profile}-big.txt"):
                print(f"  big     {big_pass(mp):.2f} GB/s (under py-spy)")
            for r in readers:
                m.fresh()
                with Profiler(m.pid, f"{args.profile}-small-x{r}.txt"):
                    print(f"  small x{r} {small_pass(fuse_small, r):.0f} files/s (under py-spy)")
            m.expected = 0

        if not args.no_verify:
            bad = verify(data, mp, args.files)
            print(
                f"\nverify: {'all bytes match' if not bad else f'{len(bad)} files DIFFER'}"
                + (f": {bad[:5]}" if bad else "")
            )
            ok &= not bad
        m.expected = 0
        m.close()
    print(f"load average after: {load_average()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
