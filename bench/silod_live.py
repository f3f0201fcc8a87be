"""SiloD on real mounts: a scenario's jobs run live under each cache system, against the simulator.

Owns: the live experiment. An s3rver bucket (s3rver is installed into .ci/node with npm
on first use) holds each dataset of the scenario (img-* datasets as ~256 KiB image-like
files, everything else as 8 MiB shards) behind tests/support/faultproxy.py with one token
bucket of the scenario's `remote_io`: the cloud link every remote GET of every job
shares. For each system a fresh silofs daemon (cache size =
the node's cache) serves one `silofs mount --job NAME` per job; each job is a real
process (this script with --worker) that reads its dataset in a new random order every
epoch with reader threads feeding a compute loop that sleeps size/f* per sample, so it
runs at min(f*, what its IO feeds), as the simulator assumes. Jobs start in FIFO order
when the node has GPUs for them (all GPUs or none, no backfill); JCT is submission to the
end of the last epoch. The systems, each through silofs's own knobs:

  silod    `silofs-ctl controller run` (policy fifo: Algorithm 2 for cache, the link's
           rest max-min to the jobs) with the jobs file giving f*, GPUs and sizes; a job
           is written to it when it starts and removed when it ends
  coordl   PUT /v1/datasets/URI/cache = node cache x job GPUs / node GPUs when the job
           starts, 0 when it ends (never shared); no IO allocation (the link decides)
  alluxio  every mount with --admission lru and no allocation: one LRU over the cache
  quiver   at each start and end, silofs_ctl's QuiverCache picks whole datasets; PUT
           their size, 0 for the rest; no IO allocation

Then the same scenario through the simulator (silofs_ctl.simulator.simulate, what
`silofs-ctl simulate --scheduler fifo --cache X --interval I` runs) and the table: avg
JCT, makespan, live vs simulated error. Hidden caches are kept out: each worker drops
the pages of every file it read (posix_fadvise DONTNEED; the mounts use keep_cache), and
SILOFS_BUFFER_BYTES bounds each mount's buffer of fetched chunks to what its readers
have in flight.
Never: changes silofs, or leaves a mount or process behind.

    python bench/silod_live.py                    # configs/scenarios/live-full.toml
    python bench/silod_live.py --quick --json     # live-quick.toml, under 10 minutes
    python bench/silod_live.py SCENARIO.toml --systems silod,coordl
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, urlsplit

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from common import ROOT, load_average, start_server  # noqa: E402

sys.path.insert(0, str(ROOT / "silofs-ctl"))
from silofs.control.client import ControlClient  # noqa: E402
from tests.support.node import Node, pids_with  # noqa: E402

SYSTEMS = ("silod", "coordl", "alluxio", "quiver")
IMAGE_BYTES = 256 << 10
SHARD_BYTES = 8 << 20
CHUNK = "4M"
# Reader threads per job (a DataLoader's workers): image-like files one per sample,
# shards streamed by fewer workers, as WebDataset does.
READERS = {"img": 8, "shards": 4}
# A mount's buffer of fetched chunks (SILOFS_BUFFER_BYTES) must hold what its readers
# have in flight (the kernel reads a 256 KiB file in two 128 KiB requests; a shard
# reader has its chunk and the read-ahead one), or chunks are fetched twice; any more
# is a private LRU the simulator does not know (the default 128 MiB is most of a small
# dataset). Images: 8 readers x 256 KiB, doubled; shards: 4 readers x 8 MiB + 4 MiB.
BUFFER_BYTES = {"img": 4 << 20, "shards": 36 << 20}
PREFETCH = 32  # samples read ahead of the compute loop (at most 32 MiB)
SAMPLE_BYTES = 1 << 20  # a shard is streamed to the compute loop in records this big


# -- the job: a training loop ------------------------------------------------------------
def worker(args: argparse.Namespace) -> int:
    """One job: epochs over the mount in a fresh random order, compute = sleep(size/f*).

    Reader threads (a DataLoader's workers, persistent across epochs) take files in
    epoch order and hand the compute loop samples of at most SAMPLE_BYTES: an image-like
    file is one sample, a shard is streamed as consecutive records (as WebDataset reads
    a shard), so a sample is there as soon as its bytes are, not when the whole 8 MiB
    shard is. The queue between them is bounded (prefetch). The compute loop keeps a
    virtual clock (each sample's compute starts when the sample is there and the last
    one is done), so the job runs at min(f*, what its reads deliver) without sleep
    overheads adding up, and the next epoch's reads overlap the end of this one: no
    bubble at epoch boundaries, as the simulator's fluid model assumes. Prints one JSON
    line per epoch and a last one with the totals."""
    root = args.worker
    files: list[tuple[str, int]] = []
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            files.append((path, os.stat(path).st_size))
    files.sort()
    size = sum(n for _, n in files)
    work = int(args.epochs * size)
    rng = random.Random(args.seed)

    def plan() -> Iterator[tuple[str, int]]:
        """Files in epoch order, epoch after epoch, until `work` bytes are planned (a
        fractional last epoch reads a prefix of its order)."""
        planned = 0
        while planned < work:
            order = files[:]
            rng.shuffle(order)
            for item in order:
                if planned >= work:
                    return
                yield item
                planned += item[1]

    samples: queue.Queue[int | None] = queue.Queue(PREFETCH)
    todo = plan()
    # A file is read by one reader at a time: around an epoch boundary the next epoch
    # may start with a file the last one is still reading, and the second open would be
    # served by the kernel's page cache before the first reader drops its pages.
    inflight: set[str] = set()
    turn = threading.Condition()

    def reader() -> None:
        buf = bytearray(SAMPLE_BYTES)
        try:
            while True:
                with turn:
                    item = next(todo, None)
                    if item is None:
                        return
                    path = item[0]
                    turn.wait_for(lambda p=path: p not in inflight)  # type: ignore[misc]
                    inflight.add(path)
                try:
                    for n in _read_drop(item[0], buf):
                        samples.put(n)
                finally:
                    with turn:
                        inflight.discard(item[0])
                        turn.notify_all()
        finally:
            samples.put(None)

    threads = [threading.Thread(target=reader, daemon=True) for _ in range(args.readers)]
    for t in threads:
        t.start()
    done = 0
    epoch = 0
    clock = time.monotonic()
    finished = 0
    while finished < len(threads):
        n = samples.get()
        if n is None:
            finished += 1
            continue
        done += n
        clock = max(clock, time.monotonic()) + n / args.rate
        delay = clock - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        while done >= (epoch + 1) * size and epoch + 1 < math.ceil(args.epochs):
            epoch += 1
            print(json.dumps({"epoch": epoch, "bytes": done, "t": time.monotonic()}), flush=True)
    for t in threads:
        t.join()
    print(json.dumps({"done": True, "bytes": done, "t": time.monotonic()}), flush=True)
    return 0


def _read_drop(path: str, buf: bytearray) -> Iterator[int]:
    """Read a file in len(buf) pieces, yielding each piece's size; then drop its pages:
    the kernel's page cache must not be a second, unallocated cache (the mounts say
    keep_cache)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        view = memoryview(buf)
        while got := os.readv(fd, [view]):
            yield got
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# -- the store and the link ----------------------------------------------------------------
def kind(dataset: str) -> str:
    """img-* datasets are image-like files; anything else is shards."""
    return "img" if dataset.startswith("img") else "shards"


def dataset_files(name: str, size: int) -> list[tuple[str, int]]:
    """Object keys and sizes of a dataset of exactly `size` bytes."""
    each = SHARD_BYTES if kind(name) == "shards" else IMAGE_BYTES
    ext = "tar" if each == SHARD_BYTES else "jpg"
    out = []
    i = 0
    left = size
    while left > 0:
        n = min(each, left)
        out.append((f"{name}/{i:05d}.{ext}", n))
        left -= n
        i += 1
    return out


def _client(endpoint: str):  # type: ignore[no-untyped-def]
    import boto3

    return boto3.client("s3", endpoint_url=endpoint)


def upload(client, bucket: str, datasets: dict[str, int]) -> None:  # type: ignore[no-untyped-def]
    client.create_bucket(Bucket=bucket)
    items = [kv for name, size in datasets.items() for kv in dataset_files(name, size)]
    blob = os.urandom(SHARD_BYTES + 4096)
    rng = random.Random(1)

    def put(item: tuple[str, int]) -> None:
        key, n = item
        start = rng.randrange(4096)
        client.put_object(Bucket=bucket, Key=key, Body=blob[start : start + n])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put, items))
    total = sum(datasets.values())
    print(
        f"uploaded {len(items)} objects, {total / 1e6:.0f} MB, in {time.perf_counter() - t0:.0f}s",
        file=sys.stderr,
    )


# -- CPU accounting --------------------------------------------------------------------------
class CpuMeter:
    """The machine's busy fraction and our processes' CPU over a run.

    Ours: this process (the proxy's threads), s3rver, and every process whose command line
    names the run's directory (daemon, mounts, workers, controller), sampled every second
    so processes that exit are counted up to their last sample."""

    def __init__(self, marker: str, extra: list[int]) -> None:
        self.marker, self.extra = marker, extra
        self.ticks: dict[int, int] = {}
        self.first: dict[int, int] = {}
        self.stop = threading.Event()
        self.hz = os.sysconf("SC_CLK_TCK")
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.t0 = time.monotonic()
        self.m0 = _machine()

    def __enter__(self) -> CpuMeter:
        self._sample()
        self.thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self._sample()
        self.wall = time.monotonic() - self.t0
        busy0, total0 = self.m0
        busy1, total1 = _machine()
        self.machine = (busy1 - busy0) / max(1, total1 - total0)
        self.ours = sum(self.ticks[p] - self.first[p] for p in self.ticks) / self.hz / self.wall

    def _loop(self) -> None:
        while not self.stop.wait(1.0):
            self._sample()

    def _sample(self) -> None:
        for pid in {os.getpid(), *self.extra, *pids_with(self.marker)}:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            t = int(fields[11]) + int(fields[12])
            self.first.setdefault(pid, t if pid in (os.getpid(), *self.extra) else 0)
            self.ticks[pid] = t


def _machine() -> tuple[int, int]:
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    idle = vals[3] + vals[4]
    return sum(vals) - idle, sum(vals)


# -- one system, live ------------------------------------------------------------------------
@dataclass
class LiveJob:
    spec: object  # silofs_ctl.scenario.JobSpec
    mountpoint: str = ""
    start: float | None = None
    finish: float | None = None
    bytes_read: int = 0
    mount_s: float = 0.0  # `silofs mount` (open, list, register) inside the JCT
    proc: subprocess.Popen | None = None
    error: str = ""


@dataclass
class LiveResult:
    system: str
    jobs: list[LiveJob]
    cpu_machine: float = 0.0
    cpu_ours: float = 0.0
    load: str = ""
    served: dict[str, dict] = field(default_factory=dict)
    waited: dict[str, float] = field(default_factory=dict)
    link_bytes: int = 0  # through the proxy: the link's bytes (HTTP bodies and heads)

    @property
    def avg_jct(self) -> float:
        done = [j.finish - j.spec.submit for j in self.jobs if j.finish is not None]  # type: ignore[attr-defined]
        return sum(done) / len(done) if len(done) == len(self.jobs) else math.nan

    @property
    def makespan(self) -> float:
        if any(j.finish is None for j in self.jobs):
            return math.nan
        return max(j.finish for j in self.jobs) - min(j.spec.submit for j in self.jobs)  # type: ignore[attr-defined,type-var]


class Live:
    """One system's run of the scenario on a fresh daemon and cache."""

    def __init__(self, system: str, scenario, base: Path, endpoint: str, args) -> None:  # type: ignore[no-untyped-def]
        self.system, self.sc, self.args = system, scenario, args
        self.root = base / system
        self.endpoint = endpoint
        node = scenario.nodes[0]
        self.node_gpus, self.node_cache = node.gpus, node.cache
        self.node = Node(
            self.root,
            cache_size=node.cache,
            chunk_size=CHUNK,
        )
        self.jobs = [LiveJob(spec) for spec in scenario.jobs]
        self.jobs_file = self.root / "jobs.toml"
        self.controller: subprocess.Popen | None = None
        self.running: list[LiveJob] = []  # started and not ended (guarded by lock)
        self.lock = threading.Lock()
        self.failed: list[str] = []  # errors of start and end threads
        self.served: dict[str, dict] = {}  # job -> its mount's status when it ended
        self.waited: dict[str, float] = {}  # job -> seconds its fetches waited on its limiter

    def uri(self, dataset: str) -> str:
        return f"s3://{self.args.bucket}/{dataset}/"

    def run(self) -> LiveResult:
        self.node.start()
        try:
            if self.system == "silod":
                self._start_controller()
            self._open_datasets()
            with CpuMeter(str(self.root), [self.args.s3rver_pid]) as meter:
                self._schedule()
        finally:
            if self.controller is not None:
                self.controller.terminate()
                try:
                    self.controller.wait(10)
                except subprocess.TimeoutExpired:
                    self.controller.kill()
                    self.controller.wait()
            for job in self.jobs:
                if job.proc is not None and job.proc.poll() is None:
                    job.proc.kill()
                    job.proc.wait()
            self.node.cleanup()
        res = LiveResult(self.system, self.jobs, meter.machine, meter.ours, load_average())
        res.served = {k: v.get("served_bytes", {}) for k, v in self.served.items()}
        res.waited = self.waited
        return res

    # FIFO, all GPUs or none, no backfill (the simulator's fifo scheduler on one node).
    def _schedule(self) -> None:
        """Starts (mount, then the worker) and ends (final counters, unmount) run in
        threads, so that one job's mount never delays noticing another's end or starting
        the next; a job's end is the time its worker wrote (CLOCK_MONOTONIC is one clock
        for every process)."""
        t0 = time.monotonic()
        self.t0 = t0
        waiting = sorted(self.jobs, key=lambda j: (j.spec.submit, j.spec.name))
        free = self.node_gpus
        limit = self.args.timeout
        threads: list[threading.Thread] = []
        try:
            while waiting or self.running:
                now = time.monotonic() - t0
                if now > limit:
                    raise RuntimeError(f"{self.system}: jobs still running after {limit:.0f}s")
                if self.failed:
                    raise RuntimeError(self.failed[0])
                for job in list(self.running):
                    if job.proc is not None and job.proc.poll() is not None:
                        self._ended(job)
                        with self.lock:
                            self.running.remove(job)
                        free += job.spec.gpus
                        self._replan()
                        threads.append(self._thread(self._teardown, job))
                while waiting and waiting[0].spec.submit <= now and waiting[0].spec.gpus <= free:
                    job = waiting.pop(0)
                    free -= job.spec.gpus
                    with self.lock:
                        self.running.append(job)
                    threads.append(self._thread(self._start, job))
                time.sleep(0.05)
        finally:
            for t in threads:
                t.join()

    def _thread(self, fn, job: LiveJob) -> threading.Thread:  # type: ignore[no-untyped-def]
        def run() -> None:
            try:
                fn(job)
            except Exception as exc:  # reported by the scheduling loop
                self.failed.append(f"{self.system} {job.spec.name}: {exc}")

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    def _open_datasets(self) -> None:
        """Open (list) every dataset before the clock starts, as on a cluster where the
        datasets are registered before jobs come: a job's mount then only registers."""
        with ControlClient(self.node.socket, timeout=120) as c:
            for name in self.sc.datasets:
                body = {"uri": self.uri(name), "endpoint_url": self.endpoint}
                ds = c.request("POST", "/v1/datasets", body)
                deadline = time.monotonic() + 120
                while ds["state"] != "ready":
                    if ds["state"] == "error" or time.monotonic() > deadline:
                        raise RuntimeError(f"cannot list {name}: {ds.get('error')}")
                    time.sleep(0.1)
                    ds = c.request("GET", f"/v1/datasets/{ds['id']}")

    def _start(self, job: LiveJob) -> None:
        spec = job.spec
        job.mountpoint = str(self.root / "mnt" / spec.name)
        extra = ["--admission", "lru"] if self.system == "alluxio" else []
        # The baselines' allocations go first: the job's first fetches fill its share.
        self._replan(starting=job)
        mount_t0 = time.monotonic() - self.t0
        os.makedirs(job.mountpoint, exist_ok=True)
        with self.lock:
            self.node.mountpoints.append(job.mountpoint)
        env = {"SILOFS_BUFFER_BYTES": str(BUFFER_BYTES[kind(spec.dataset)])}
        args = ["--job", spec.name, "--endpoint-url", self.endpoint, "--chunk-size", CHUNK]
        res = self.node.run(
            "mount", self.uri(spec.dataset), job.mountpoint, "--socket", self.node.socket,
            *args, *extra, env=env, timeout=120,
        )  # fmt: skip
        if res.returncode != 0:
            raise RuntimeError(f"silofs mount failed: {res.stderr.strip()}")
        job.start = time.monotonic() - self.t0
        job.mount_s = job.start - mount_t0
        if self.system == "silod":
            self._replan()  # the controller learns of it once it is mounted
        log = open(self.root / f"{spec.name}.out", "w")
        job.proc = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--worker",
                job.mountpoint,
                "--rate",
                str(spec.ideal_io),
                "--epochs",
                str(spec.epochs),
                "--readers",
                str(READERS[kind(spec.dataset)]),
                "--seed",
                str(self.args.seed * 1000 + len(spec.name) * 7 + int(spec.submit)),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def _ended(self, job: LiveJob) -> None:
        assert job.proc is not None
        out = (self.root / f"{job.spec.name}.out").read_text().splitlines()
        last = json.loads(out[-1]) if out and out[-1].startswith("{") else {}
        if job.proc.returncode != 0 or not last.get("done"):
            job.error = f"worker exited {job.proc.returncode}: {out[-3:]}"
            raise RuntimeError(f"{self.system} {job.spec.name}: {job.error}")
        job.finish = float(last["t"]) - self.t0
        job.bytes_read = int(last["bytes"])

    def _teardown(self, job: LiveJob) -> None:
        # The mount's counters (reported every 0.25 s) before it goes away with its job.
        try:
            self.served[job.spec.name] = self.node.settle(job.mountpoint, job.bytes_read, 5)
            self.waited[job.spec.name] = self.node.job_status(job.spec.name)["limiter_wait_s"]
        except RuntimeError as exc:
            print(f"warning: {job.spec.name}: no final counters: {exc}", file=sys.stderr)
        self.node.unmount(job.mountpoint)

    # -- the systems' knobs ---------------------------------------------------------------
    def _replan(self, starting: LiveJob | None = None) -> None:
        """What the system knows changed: a job starts (in `running` already) or ended.
        The controller learns of a starting job once it is mounted (_start)."""
        with self.lock:
            jobs = [j for j in self.running if self.system != "silod" or j.start is not None]
            if self.system == "silod":
                self._write_jobs([j for j in jobs if j is not starting])
            elif self.system == "coordl":
                self._push(self._coordl(jobs))
            elif self.system == "quiver":
                self._push(self._quiver(jobs))

    def _coordl(self, jobs: list[LiveJob]) -> dict[str, int]:
        want = {j.spec.dataset: 0 for j in self.jobs}
        for j in jobs:
            share = self.node_cache * j.spec.gpus // self.node_gpus
            want[j.spec.dataset] = min(j.spec.dataset_size, want[j.spec.dataset] + share)
        return want

    def _quiver(self, jobs: list[LiveJob]) -> dict[str, int]:
        from silofs_ctl.model import Allocation, Cluster, Job
        from silofs_ctl.policies.quiver import QuiverCache

        sizes = {j.spec.dataset: float(j.spec.dataset_size) for j in self.jobs}
        cluster = Cluster.pooled(
            {"node": self.node_gpus}, {"node": float(self.node_cache)}, self.sc.remote_io, sizes
        )
        views = [
            Job(j.spec.name, j.spec.dataset, j.spec.gpus, j.spec.ideal_io, {j.spec.dataset: 1.0})
            for j in jobs
        ]
        alloc = Allocation(gpu_share={j.spec.name: 1.0 for j in jobs})
        QuiverCache().fill_cache(views, cluster, alloc)
        return {ds: int(alloc.cache.get(ds, 0.0)) for ds in sizes}

    def _push(self, want: dict[str, int]) -> None:
        """Shrinks before grows: the daemon refuses allocations over its cache size."""
        with ControlClient(self.node.socket, timeout=30) as c:
            current = c.request("GET", "/v1/allocations")
            have = current.get("cache", {}) if isinstance(current, dict) else {}
            order = sorted(want, key=lambda ds: want[ds] - int(have.get(self.uri(ds)) or 0))
            for ds in order:
                c.request(
                    "PUT", f"/v1/datasets/{quote(self.uri(ds), safe='')}/cache", {"bytes": want[ds]}
                )

    def _start_controller(self) -> None:
        self._write_jobs([])
        cfg = self.root / "controller.toml"
        cfg.write_text(
            f'policy = "fifo"\nremote_io = {self.sc.remote_io:.0f}\n'
            f'interval = "{self.args.interval}s"\npoll = "{self.args.poll}s"\n'
            f'jobs_file = "jobs.toml"\n\n[[nodes]]\nname = "node"\n'
            f'socket = "{self.node.socket}"\ngpus = {self.node_gpus}\n'
        )
        log = open(self.root / "controller.log", "ab")
        self.controller = subprocess.Popen(
            [sys.executable, "-m", "silofs_ctl", "controller", "run", "--config", str(cfg)],
            stdout=log,
            stderr=log,
            env=self.node.env,
            start_new_session=True,
        )

    def _write_jobs(self, jobs: list[LiveJob]) -> None:
        text = "".join(
            f'[[jobs]]\nname = "{j.spec.name}"\ndataset = "{self.uri(j.spec.dataset)}"\n'
            f"gpus = {j.spec.gpus}\nideal_io = {j.spec.ideal_io:.0f}\n"
            f"dataset_size = {j.spec.dataset_size}\nepochs = {j.spec.epochs}\n"
            f'nodes = ["node"]\n\n'
            for j in jobs
        )
        tmp = self.jobs_file.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.jobs_file)


# -- the comparison ----------------------------------------------------------------------------
def simulated(scenario, system: str, interval: float):  # type: ignore[no-untyped-def]
    from silofs_ctl.simulator import simulate

    return simulate(scenario, "fifo", system, interval=interval)


def err(live: float, sim: float) -> float:
    return (live - sim) / sim if sim else math.nan


def compare(args: argparse.Namespace) -> int:
    from silofs_ctl.scenario import load_scenario

    from tests.support.faultproxy import FaultPlan, FaultProxy
    from tests.support.servers import S3Server, start_s3rver

    scenario = load_scenario(args.scenario)
    if len(scenario.nodes) != 1:
        sys.exit("bench/silod_live.py runs one node: the scenario must have one [[cluster.nodes]]")
    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        if s not in SYSTEMS:
            sys.exit(f"unknown system {s!r} (try {', '.join(SYSTEMS)})")
    base = Path(tempfile.mkdtemp(prefix="silod-live-"))
    for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL"):
        os.environ.pop(k, None)
    s3: S3Server | None = None
    if args.s3_endpoint:  # a server of the caller's (tests: moto), credentials in the env
        url = urlsplit(args.s3_endpoint)
        upstream = (url.hostname or "127.0.0.1", url.port or 80)
        client = _client(args.s3_endpoint)
        args.s3rver_pid = 0
    else:
        s3 = start_server(
            lambda: start_s3rver(base / "s3rver", base / "s3rver.log"), "s3rver", base
        )
        os.environ.update(s3.env)  # its credentials, for our daemons
        upstream = ("127.0.0.1", s3.port)
        client = s3.client()
        args.s3rver_pid = s3.process.pid if s3.process else 0
    results: dict[str, LiveResult] = {}
    try:
        upload(client, args.bucket, scenario.datasets)
        plan = FaultPlan(bandwidth=scenario.remote_io)
        with FaultProxy(upstream, plan) as proxy:
            for system in systems:
                print(f"== {system} live ...", file=sys.stderr, flush=True)
                before = proxy.stats["bytes_to_client"]
                results[system] = Live(system, scenario, base, proxy.url, args).run()
                results[system].link_bytes = proxy.stats["bytes_to_client"] - before
                r = results[system]
                print(
                    f"   avg JCT {r.avg_jct:.1f}s makespan {r.makespan:.1f}s, CPU: machine "
                    f"{100 * r.cpu_machine:.0f}%, ours {100 * r.cpu_ours / os.cpu_count():.0f}% "
                    f"of {os.cpu_count()} cores, load {r.load}",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        if s3 is not None:
            s3.stop()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
        else:
            print(f"kept {base}", file=sys.stderr)
    report(scenario, results, args)
    return 0


def report(scenario, results: dict[str, LiveResult], args: argparse.Namespace) -> None:  # type: ignore[no-untyped-def]
    out: dict[str, dict] = {}
    for system, r in results.items():
        sim = simulated(scenario, system, args.interval)
        out[system] = {
            "avg_jct_s": r.avg_jct,
            "makespan_s": r.makespan,
            "sim_avg_jct_s": sim.avg_jct,
            "sim_makespan_s": sim.makespan,
            "jct_error": err(r.avg_jct, sim.avg_jct),
            # The simulator has no job start-up: the live JCT less each job's mount.
            "avg_mount_s": sum(j.mount_s for j in r.jobs) / len(r.jobs),
            "jct_less_mount_error": err(
                r.avg_jct - sum(j.mount_s for j in r.jobs) / len(r.jobs), sim.avg_jct
            ),
            "makespan_error": err(r.makespan, sim.makespan),
            "link_mb": r.link_bytes / 1e6,
            "sim_link_mb": sum(j.remote_bytes for j in sim.jobs) / 1e6,
            "cpu_machine": r.cpu_machine,
            "cpu_ours_per_core": r.cpu_ours / (os.cpu_count() or 1),
            "load": r.load,
            "jobs": {
                j.spec.name: {  # type: ignore[attr-defined]
                    "jct_s": None if j.finish is None else j.finish - j.spec.submit,  # type: ignore[attr-defined]
                    "start_s": j.start,
                    "mount_s": j.mount_s,
                    "limiter_wait_s": r.waited.get(j.spec.name),  # type: ignore[attr-defined]
                    "sim_jct_s": next(x.jct for x in sim.jobs if x.name == j.spec.name),  # type: ignore[attr-defined]
                    "bytes_read": j.bytes_read,
                    "served_bytes": r.served.get(j.spec.name, {}),  # type: ignore[attr-defined]
                    "sim_hit_ratio": next(
                        x.hit_ratio
                        for x in sim.jobs
                        if x.name == j.spec.name  # type: ignore[attr-defined]
                    ),
                }
                for j in r.jobs
            },
        }
    doc = {
        "scenario": scenario.name,
        "jobs": len(scenario.jobs),
        "link_mb_s": scenario.remote_io / 1e6,
        "systems": out,
    }
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        render(doc)


def render(doc: dict) -> None:
    """The table, from the --json document (also `--report FILE` of a saved one)."""
    out = doc["systems"]
    print(f"\n== {doc['scenario']}: {doc['jobs']} jobs, link {doc['link_mb_s']:.0f} MB/s")
    print(
        f"{'system':8} {'avg JCT':>8} {'sim':>8} {'err':>6} {'makespan':>9} {'sim':>8} "
        f"{'err':>6} {'mount':>6} {'err-m':>6} {'CPU':>5}"
    )
    for system, o in out.items():
        print(
            f"{system:8} {o['avg_jct_s']:7.1f}s {o['sim_avg_jct_s']:7.1f}s "
            f"{100 * o['jct_error']:+5.1f}% {o['makespan_s']:8.1f}s {o['sim_makespan_s']:7.1f}s "
            f"{100 * o['makespan_error']:+5.1f}% {o['avg_mount_s']:5.1f}s "
            f"{100 * o['jct_less_mount_error']:+5.1f}% {100 * o['cpu_machine']:4.0f}%"
        )
    print(
        "(err: live vs simulated; mount: the average `silofs mount` inside a live JCT, "
        "which the simulator has no notion of; err-m: avg JCT error without it; CPU: the "
        "machine's, all processes)"
    )
    print("\nremote bytes over the link, live (proxy) / simulated:")
    for system, o in out.items():
        print(f"  {system:8} {o['link_mb']:.0f} / {o['sim_link_mb']:.0f} MB")
    print("\nper job (live JCT / simulated JCT, mount time, live hit ratio / simulated):")
    for system, o in out.items():
        cells = []
        for name, j in o["jobs"].items():
            served = j["served_bytes"]
            total = sum(served.values()) if served else 0
            hit = served.get("cache", 0) / total if total else math.nan
            cells.append(
                f"{name} {j['jct_s']:.0f}/{j['sim_jct_s']:.0f}s {j['mount_s']:.1f}s "
                f"{hit:.2f}/{j['sim_hit_ratio']:.2f}"
            )
        print(f"  {system:8} " + "  ".join(cells))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", nargs="?", type=Path)
    parser.add_argument("--quick", action="store_true", help="live-quick.toml (under 10 min)")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--interval", type=float, default=5.0, help="controller re-plan (s)")
    parser.add_argument("--poll", type=float, default=1.0, help="controller poll (s)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="per system (s)")
    parser.add_argument("--keep", action="store_true", help="keep the run's directory")
    parser.add_argument("--s3-endpoint", help="use this S3 server (credentials from the env)")
    parser.add_argument("--bucket", default="live")
    # the job process
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--rate", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--readers", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--report", type=Path, help="print the table of a saved --json run")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.report:
        render(json.loads(args.report.read_text()))
        return 0
    if args.scenario is None:
        name = "live-quick.toml" if args.quick else "live-full.toml"
        args.scenario = ROOT / "configs" / "scenarios" / name
    if shutil.which("fusermount3") is None or not os.path.exists("/dev/fuse"):
        sys.exit("FUSE is missing: /dev/fuse and fusermount3")
    return compare(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
