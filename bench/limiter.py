"""Accuracy of the per-job remote-IO limiter: achieved vs allocated bytes/s, cold reads.

Owns: a local S3 server with cheap range GETs (s3rver, installed into .ci/node with npm
on first use; moto makes a range GET as expensive as a whole GET, so it never serves
miss benchmarks), a bucket of random objects uploaded once per run, and for each
allocation (5, 20, 80 MB/s and unlimited by default) a fresh silofs daemon and cache, a
mount with `--io-limit RATE --chunk-size 1M`, reader threads that read every object
cold so demand exceeds the allocation, the job's remote_bytes sampled from status every
100 ms, and per-second and overall achieved rates with their ratio to the allocation.
Every object read is checked against its uploaded digest. Never runs in CI and never
changes silofs.

    python bench/limiter.py                              # 5, 20, 80 MB/s, unlimited
    python bench/limiter.py --rates 10MB/s,40MB/s --seconds 20 --readers 16
    python bench/limiter.py --step 40MB/s                # also change it mid-run (API)

MB is 10**6 bytes, as in silofs's rate grammar.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from common import ProcTimes, busy_processes, check_fuse, load_average, ratio, start_server

from silofs.control.client import ControlClient, ControlError
from silofs.units import parse_rate, parse_size
from tests.support.node import Node
from tests.support.servers import S3Server, start_s3rver

BUCKET = "bench"
PREFIX = "limiter/"


def upload(s3: S3Server, files: int, size: int) -> dict[str, bytes]:
    """`files` objects of `size` random bytes; key -> blake2b digest."""
    client = s3.client()
    client.create_bucket(Bucket=BUCKET)
    digests: dict[str, bytes] = {}

    def put(i: int) -> None:
        key = f"{PREFIX}{i:06d}.bin"
        data = os.urandom(size)
        client.put_object(Bucket=BUCKET, Key=key, Body=data)
        digests[key] = hashlib.blake2b(data, digest_size=16).digest()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put, range(files)))
    secs = time.perf_counter() - t0
    print(f"uploaded {files} x {size / 1e6:.2f} MB to s3rver in {secs:.1f}s")
    return digests


def probe_range_get(s3: S3Server, key: str, size: int) -> float:
    """Median seconds of a 1 MiB range GET from the middle of the object (sanity check:
    the server must make range GETs cheap for this benchmark to mean anything)."""
    client = s3.client()
    times = []
    n = min(1 << 20, size)
    start = (size - n) // 2
    for _ in range(9):
        t0 = time.perf_counter()
        client.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={start}-{start + n - 1}")[
            "Body"
        ].read()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


# -- one allocation ----------------------------------------------------------------------
@dataclass
class Run:
    label: str
    rate: int | None  # bytes/s; None = unlimited
    seconds: float
    samples: list[tuple[float, int]] = field(default_factory=list)  # (t since start, bytes)
    files_read: int = 0
    bad: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    status: dict = field(default_factory=dict)
    step: tuple[float, int, str] | None = None  # (at, new rate, outcome)
    read_end: float = 0.0  # when the last reader finished, since the start
    watch: dict[str, int] = field(default_factory=dict)  # who -> pid, CPU measured
    cost: dict[str, ProcTimes] = field(default_factory=dict)

    def bytes_at(self, t: float) -> tuple[float, int]:
        """The last sample at or before t."""
        best = self.samples[0]
        for s in self.samples:
            if s[0] > t:
                break
            best = s
        return best

    def window(self, a: float, b: float) -> float:
        """Achieved bytes/s between the samples at a and b."""
        (ta, ba), (tb, bb) = self.bytes_at(a), self.bytes_at(b)
        return (bb - ba) / (tb - ta) if tb > ta else float("nan")

    def rate_at(self, t: float) -> int | None:
        if self.step is not None and self.step[2] == "ok" and t >= self.step[0]:
            return self.step[1]
        return self.rate


def sampler(sock: str, job: str, run: Run, t0: float, stop: threading.Event) -> None:
    with ControlClient(sock, timeout=5) as c:
        while not stop.is_set():
            try:
                st = c.request("GET", "/v1/status")
            except ControlError as exc:
                run.errors.append(f"status: {exc}")
                time.sleep(0.1)
                continue
            now = time.monotonic() - t0
            for j in st["jobs"]:
                if j["name"] == job:
                    run.samples.append((now, int(j["remote_bytes"])))
            stop.wait(max(0.0, 0.1 - (time.monotonic() - t0 - now)))


def read_cold(
    node: Node,
    mp: str,
    job: str,
    run: Run,
    keys: list[str],
    digests: dict[str, bytes],
    readers: int,
) -> None:
    """Readers take the next object until `run.seconds` have passed; every object is
    read whole and checked against its digest."""
    it = iter(keys)
    lock = threading.Lock()
    stop = threading.Event()
    t0 = time.monotonic()
    deadline = t0 + run.seconds

    def reader() -> None:
        while time.monotonic() < deadline:
            with lock:
                key = next(it, None)
            if key is None:
                return
            try:
                with open(os.path.join(mp, key.removeprefix(PREFIX)), "rb") as f:
                    data = f.read()
            except OSError as exc:
                run.errors.append(f"{key}: {exc}")
                return
            if hashlib.blake2b(data, digest_size=16).digest() != digests[key]:
                run.bad.append(key)
            with lock:
                run.files_read += 1

    before = {who: ProcTimes.of(pid) for who, pid in run.watch.items()}
    samp = threading.Thread(target=sampler, args=(node.socket, job, run, t0, stop))
    samp.start()
    try:
        threads = [threading.Thread(target=reader) for _ in range(readers)]
        for t in threads:
            t.start()
        if run.step is not None:
            at, new_rate, _ = run.step
            time.sleep(max(0.0, t0 + at - time.monotonic()))
            run.step = (time.monotonic() - t0, new_rate, change_rate(node, job, new_rate))
        for t in threads:
            t.join()
        run.read_end = time.monotonic() - t0
        run.cost = {who: ProcTimes.of(pid).minus(before[who]) for who, pid in run.watch.items()}
    finally:
        time.sleep(0.15)
        stop.set()
        samp.join()
    run.status = node.job_status(job)


def change_rate(node: Node, job: str, rate: int | None) -> str:
    """PUT /v1/jobs/{job}/io; 'ok', or why not (the endpoint may not exist yet)."""
    try:
        with ControlClient(node.socket, timeout=5) as c:
            c.request("PUT", f"/v1/jobs/{job}/io", {"bytes_per_s": rate})
        return "ok"
    except ControlError as exc:
        return f"not changed: {exc}"


def fmt_rate(rate: int | None) -> str:
    return "unlimited" if rate is None else f"{rate / 1e6:g} MB/s"


def report(run: Run, chunk: int) -> dict[str, float]:
    """Print per-second and overall figures; the summary row."""
    print(f"  {'second':>8} {'achieved MB/s':>14} {'allocated':>10} {'ratio':>6}")
    ratios = []
    t_end = min(run.seconds, run.read_end, run.samples[-1][0])
    for k in range(int(t_end)):
        got = run.window(k, k + 1)
        alloc = run.rate_at(k + 0.5)
        r = ratio(got, alloc) if alloc else float("nan")
        if alloc:
            ratios.append(r)
        shown = f"{alloc / 1e6:g}" if alloc else "-"
        rs = f"{r:6.2f}" if alloc else "     -"
        print(f"  {k:>3}-{k + 1:<4} {got / 1e6:14.2f} {shown:>10} {rs}")
    (ta, ba), (tb, bb) = run.bytes_at(0), run.bytes_at(t_end)
    overall = (bb - ba) / (tb - ta) if tb > ta else float("nan")
    if run.step is not None and run.step[2] == "ok":
        alloc_bytes = run.rate * run.step[0] + run.step[1] * (tb - run.step[0]) if run.rate else 0
        alloc_avg = alloc_bytes / (tb - ta) if run.rate else None
    else:
        alloc_avg = run.rate
    r_all = ratio(overall, alloc_avg) if alloc_avg else float("nan")
    st = run.status
    print(
        f"  overall  {overall / 1e6:.2f} MB/s over {tb - ta:.1f}s, "
        + (f"ratio {r_all:.3f}; " if alloc_avg else "")
        + f"{run.files_read} objects read, job remote_gets {st.get('remote_gets')}, "
        f"remote_bytes {st.get('remote_bytes')}, limiter_wait_s {st.get('limiter_wait_s')}"
    )
    if run.cost:
        print(
            "  CPU while reading: "
            + ", ".join(f"{who} {c.cpu_s / run.read_end * 100:.0f}%" for who, c in run.cost.items())
            + " of a core"
        )
    if run.rate and chunk / run.rate > 0.1:
        print(
            f"  (one {chunk >> 20} MiB chunk is {chunk / run.rate:.2f}s of this allocation: "
            "per-second figures are quantized by it)"
        )
    if run.step is not None:
        print(f"  step to {fmt_rate(run.step[1])} at {run.step[0]:.1f}s: {run.step[2]}")
    if run.bad:
        print(f"  WRONG BYTES in {len(run.bad)} objects: {run.bad[:5]}")
    if run.errors:
        print(f"  ERRORS: {run.errors[:5]}")
    return {
        "overall": overall,
        "ratio": r_all,
        "min": min(ratios, default=float("nan")),
        "max": max(ratios, default=float("nan")),
    }


def show_logs(tmp: Path, lines: int = 25) -> None:
    """The tails of the s3rver, daemon and mount logs of this run (before they go)."""
    for log in sorted(tmp.glob("**/*.log")):
        text = log.read_text(errors="replace").splitlines()[-lines:]
        print(f"--- {log}", *text, sep="\n", file=sys.stderr)


# -- the run -----------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="5MB/s,20MB/s,80MB/s,unlimited")
    ap.add_argument("--files", type=int, default=800, help="objects in the bucket")
    ap.add_argument("--file-mb", type=float, default=1.0, help="object size (MiB)")
    ap.add_argument("--readers", type=int, default=16, help="reader threads")
    ap.add_argument("--seconds", type=float, default=10.0, help="reading time per allocation")
    ap.add_argument("--chunk-size", default="1M")
    ap.add_argument(
        "--step",
        default=None,
        metavar="RATE",
        help="halfway through each limited run, set the job's allocation to RATE with "
        "PUT /v1/jobs/{job}/io (skipped, and said so, if the daemon lacks the endpoint)",
    )
    args = ap.parse_args()
    check_fuse()
    rates = [parse_rate(r) for r in args.rates.split(",")]
    step = parse_rate(args.step) if args.step else None
    size = int(args.file_mb * (1 << 20))
    chunk = parse_size(args.chunk_size)

    for k in ("AWS_CA_BUNDLE", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        os.environ.pop(k, None)  # our own environment only: it reaches our daemons
    print(f"load average before: {load_average()}")
    for line in busy_processes():
        print(f"  busy: {line}")

    tmp = Path(tempfile.mkdtemp(prefix="silofs-limiter-", dir="/var/tmp"))
    s3 = start_server(lambda: start_s3rver(tmp / "s3rver", tmp / "s3rver.log"), "s3rver", tmp)
    os.environ.update(s3.env)  # its credentials, for our daemons
    summary = []
    ok = True
    try:
        digests = upload(s3, args.files, size)
        keys = sorted(digests)
        print(f"s3rver 1 MiB range GET: {probe_range_get(s3, keys[0], size) * 1e3:.1f} ms (median)")
        for i, rate in enumerate(rates):
            label = fmt_rate(rate)
            job = f"lim{i}"
            node = Node(tmp / f"node{i}", cache_size=2 * args.files * size + (256 << 20))
            with node:
                node.start()
                mp = str(tmp / f"mnt{i}")
                io = ["--io-limit", f"{rate}B/s"] if rate is not None else []
                node.mount(
                    f"s3://{BUCKET}/{PREFIX}",
                    mp,
                    "--job",
                    job,
                    "--chunk-size",
                    args.chunk_size,
                    "--endpoint-url",
                    s3.endpoint_url,
                    *io,
                )
                alloc = node.job_status(job)["io_allocation"]
                run = Run(label, rate, args.seconds)
                run.watch = {
                    "daemon": node.daemon_pid,
                    "mount": node.mount_pid(mp),
                    "s3rver": s3.process.pid,
                }
                if step is not None and rate is not None:
                    run.step = (args.seconds / 2, step, "")
                print(
                    f"\n== allocation {label} (status io_allocation {alloc}), {args.readers} "
                    f"readers, cold cache, {args.seconds:g}s =="
                )
                read_cold(node, mp, job, run, keys, digests, args.readers)
                node.unmount(mp)
            fig = report(run, chunk)
            ok &= not run.bad and not run.errors
            if run.step is not None and run.step[2] == "ok":
                label += f" -> {fmt_rate(run.step[1])}"
            summary.append((label, rate, fig))
    except BaseException:
        show_logs(tmp)
        raise
    finally:
        s3.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    print(
        f"\n== summary ({args.readers} readers, {args.file_mb:g} MiB objects, chunk "
        f"{args.chunk_size}) =="
    )
    print(
        f"  {'allocation':>24} {'achieved MB/s':>14} {'ratio':>6} {'per-second ratio min-max':>26}"
    )
    for label, rate, fig in summary:
        rr = f"{fig['ratio']:.3f}" if rate else "-"
        mm = f"{fig['min']:.2f}-{fig['max']:.2f}" if rate else "-"
        print(f"  {label:>24} {fig['overall'] / 1e6:14.2f} {rr:>6} {mm:>26}")
    unlimited = [fig["overall"] for _, rate, fig in summary if rate is None]
    if unlimited:
        for label, rate, _fig in summary:
            if rate and rate > 0.8 * unlimited[0]:
                print(
                    f"  note: {label} is close to what this server delivers unlimited "
                    f"({unlimited[0] / 1e6:.0f} MB/s): its ratio measures the server too"
                )
    print(f"load average after: {load_average()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
