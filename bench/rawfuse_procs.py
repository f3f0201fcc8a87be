"""Does the pyfuse3 ceiling scale with serving processes? bench/rawfuse.py with 1, 2, 4...
forked processes (silofs/mount/forked.py), warm 110 KiB files with 1 and 4 readers.

Each pass drops the page cache (rawfuse serves from its own memory, so only the kernel's
pages of the mount and of nothing else are dropped), reads every file once and records
files/s and the CPU seconds of every serving process (the parent supervisor included).
Passes of the configurations are interleaved round by round so the shared host's load
lands on all of them alike; the table shows the median of the rounds and the ratio to
1 process in the same run.

    python bench/rawfuse_procs.py [--files 4000] [--processes 1,2,4] [--readers 1,4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ProcTimes, check_fuse, check_root, drop_caches, force_unmount, read_files  # noqa: E402
from throughput import SMALL_BYTES, small_paths  # noqa: E402


class Raw:
    def __init__(self, data: Path, mp: Path, processes: int) -> None:
        mp.mkdir(parents=True, exist_ok=True)
        script = Path(__file__).resolve().parent / "rawfuse.py"
        args = [sys.executable, str(script), str(data), str(mp)]
        if processes > 1:
            args += ["--processes", str(processes)]
        self.mp = str(mp)
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "ready":
            self.close()
            raise RuntimeError(f"rawfuse.py did not mount ({line!r})")
        self.pids = [self.proc.pid] + [int(p) for p in line[1:]]

    def cpu(self) -> float:
        return sum(ProcTimes.of(p).cpu_s for p in self.pids)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        force_unmount(self.mp)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=4000)
    ap.add_argument("--processes", default="1,2,4")
    ap.add_argument("--readers", default="1,4")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--data-dir", default="/var/tmp/silofs-bench-rawprocs")
    args = ap.parse_args()
    check_root()
    check_fuse()
    procs = [int(x) for x in args.processes.split(",")]
    readers = [int(x) for x in args.readers.split(",")]
    data = Path(args.data_dir)
    (data / "small").mkdir(parents=True, exist_ok=True)
    for p in small_paths(data, args.files):
        if not os.path.exists(p) or os.path.getsize(p) != SMALL_BYTES:
            with open(p, "wb") as f:
                f.write(os.urandom(SMALL_BYTES))
    results: dict[tuple[int, int], list[tuple[float, float]]] = {}
    local: dict[int, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="rawprocs-") as tmp:
        mounts = {n: Raw(data, Path(tmp) / f"p{n}", n) for n in procs}
        try:
            for _ in range(args.repeat):
                for r in readers:
                    drop_caches()
                    secs, _ = read_files(small_paths(data, args.files), r)
                    local.setdefault(r, []).append(args.files / secs)
                    for n, m in mounts.items():
                        paths = small_paths(m.mp, args.files)
                        drop_caches()
                        c0 = m.cpu()
                        secs, _ = read_files(paths, r)
                        cpu = m.cpu() - c0
                        results.setdefault((n, r), []).append((args.files / secs, cpu))
        finally:
            for m in mounts.values():
                m.close()
    print(
        f"load average: {os.getloadavg()[0]:.1f}; {args.files} files x 110 KiB, "
        f"median of {args.repeat} interleaved rounds"
    )
    for r in readers:
        base = statistics.median(x[0] for x in results[(procs[0], r)])
        disk = statistics.median(local[r])
        print(
            f"{r} reader(s), local disk (dropped):   {disk:8.0f} files/s  "
            f"rounds {', '.join(f'{x:.0f}' for x in local[r])}"
        )
        for n in procs:
            rates = [x[0] for x in results[(n, r)]]
            cpus = [x[1] for x in results[(n, r)]]
            rate = statistics.median(rates)
            us = 1e6 * statistics.median(cpus) / args.files
            core = statistics.median(c / (args.files / x) for x, c in zip(rates, cpus, strict=True))
            print(
                f"{r} reader(s), {n} serving process(es): {rate:8.0f} files/s "
                f"({rate / base:.2f}x {procs[0]} process, {rate / disk:.2f}x disk)  "
                f"{us:.0f} us CPU/file, {100 * core:.0f}% of a core  "
                f"rounds {', '.join(f'{x:.0f}' for x in rates)}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
