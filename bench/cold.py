"""Cold reads from an S3 store: a big file sequentially, and small files behind latency.

Owns, for each local S3 server (moto, and s3rver, which npm installs into .ci/node on
first use; skipped if it cannot): one bucket with a big random object and many 110 KiB objects,
uploaded once per run; the "store allows" ceiling (one plain boto3 GET of the whole big
object, streamed in 1 MiB reads) and rclone's `rclone cat` of it when rclone is on PATH;
then, each on a fresh silofs daemon and cache, a cold sequential read of the big object
through a mount (MB/s, the range GETs the store saw, the daemon's and the mount's CPU
split into user and kernel, and how long after the last byte the cache held all of it),
with the CPU per MiB of daemon and mount, of boto3's process, and of the store
meanwhile; the boto3 GET and the silofs read (and with `--git-rev REV|DIR`, another
revision's or checkout's silofs) alternate round by round, so each ratio compares
passes that met the same load;
and cold small files through tests/support/faultproxy.py adding
`--first-byte-ms` (20 ms) before every response, with 1 and with 8 reader threads
(files/s and their ratio, the daemon's and the mount's CPU per file, and the requests the
daemon's S3 lean path handed to botocore), then the CPU of one whole 110 KiB GET in this
process with botocore's request path and with the lean one, alternated (the request
path's share of the daemon's CPU per file). Every figure is the median of `--runs`
runs, printed with its range; ratios are of medians from the same run of this script.
Every byte read is checked against what was uploaded. Never runs in CI and never
changes silofs.

    python bench/cold.py                            # moto and s3rver, 3 runs
    python bench/cold.py --stores moto --runs 5 --big-mb 256 --small-files 240
    python bench/cold.py --stores moto --runs 5 --skip-small --git-rev main

MB is 10**6 bytes. The machine is shared: the load average and busy processes are
printed first, and figures from a busy machine are only comparable within one run.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

from common import (
    ProcTimes,
    Profiler,
    Samples,
    busy_processes,
    check_fuse,
    drain,
    load_average,
    need_tools,
    profile_summary,
    ratio,
)

from tests.support import baseline
from tests.support.faultproxy import FaultPlan, FaultProxy
from tests.support.node import Node
from tests.support.poll import wait_for
from tests.support.servers import S3Server as Server
from tests.support.servers import ServerError, start_moto, start_s3rver

BUCKET = "cold-bench"
SMALL = 110 * 1024
READ = 1 << 20


def start_store(name: str, tmp: Path) -> Server | None:
    if name == "moto":
        return start_moto(log_path=tmp / "moto.log")
    try:
        return start_s3rver(tmp / "s3rver", tmp / "s3rver.log")
    except ServerError as exc:
        print(f"s3rver skipped: {exc}")
        return None


def upload(store: Server, big: bytes, small: dict[str, bytes]) -> None:
    client = store.client()
    client.create_bucket(Bucket=BUCKET)
    client.put_object(Bucket=BUCKET, Key="big/big.bin", Body=big)
    with ThreadPoolExecutor(8) as pool:
        list(
            pool.map(
                lambda kv: client.put_object(Bucket=BUCKET, Key=kv[0], Body=kv[1]), small.items()
            )
        )


def store_times(store: Server) -> ProcTimes | None:
    """The store process's CPU so far (None if it is not our subprocess)."""
    return ProcTimes.of(store.process.pid) if store.process is not None else None


def store_cpu(store: Server, before: ProcTimes | None) -> float:
    now = store_times(store)
    return float("nan") if now is None or before is None else now.minus(before).cpu_s


def boto3_ceiling(store: Server, size: int, digest: str) -> dict[str, float]:
    """One whole-object GET streamed in 1 MiB reads (what the store allows): MB/s, and
    the CPU seconds of this process (boto3 and the hash) and of the store meanwhile."""
    client = store.client()
    s0, c0 = store_times(store), resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    body = client.get_object(Bucket=BUCKET, Key="big/big.bin")["Body"]
    h = hashlib.blake2b(digest_size=16)
    n = 0
    while piece := body.read(READ):
        h.update(piece)
        n += len(piece)
    secs = time.perf_counter() - t0
    c1 = resource.getrusage(resource.RUSAGE_SELF)
    assert n == size and h.hexdigest() == digest, "boto3 read other bytes than uploaded"
    client_cpu = c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime
    return {"rate": size / secs / 1e6, "client": client_cpu, "store": store_cpu(store, s0)}


def _rclone_env(store: Server) -> dict[str, str]:
    return {
        **os.environ,
        "RCLONE_CONFIG_COLD_TYPE": "s3",
        "RCLONE_CONFIG_COLD_PROVIDER": "Other",
        "RCLONE_CONFIG_COLD_ENDPOINT": store.endpoint_url,
        "RCLONE_CONFIG_COLD_ACCESS_KEY_ID": store.env["AWS_ACCESS_KEY_ID"],
        "RCLONE_CONFIG_COLD_SECRET_ACCESS_KEY": store.env["AWS_SECRET_ACCESS_KEY"],
        "RCLONE_CONFIG_COLD_FORCE_PATH_STYLE": "true",
    }


def rclone_rate(store: Server, size: int) -> float | None:
    """MB/s of `rclone cat` of the big object (one streamed GET), None without rclone."""
    exe = shutil.which("rclone")
    if exe is None:
        return None
    env = _rclone_env(store)
    t0 = time.perf_counter()
    res = subprocess.run(
        [exe, "cat", f"cold:{BUCKET}/big/big.bin"], stdout=subprocess.PIPE, env=env, check=False
    )
    secs = time.perf_counter() - t0
    if res.returncode != 0 or len(res.stdout) != size:
        print(f"rclone cat failed ({res.returncode}, {len(res.stdout)} bytes)")
        return None
    return size / secs / 1e6


def rclone_mount_rate(store: Server, tmp: Path, tag: str, size: int, digest: str) -> float | None:
    """MB/s of a cold sequential read of the big object through `rclone mount
    --vfs-cache-mode full` (the peer harness's setting), None without rclone."""
    exe = shutil.which("rclone")
    if exe is None:
        return None
    mp, cache = tmp / f"rclone-{tag}", tmp / f"rclone-cache-{tag}"
    mp.mkdir()
    proc = subprocess.Popen(
        [
            exe,
            "mount",
            f"cold:{BUCKET}",
            str(mp),
            "--vfs-cache-mode",
            "full",
            "--cache-dir",
            str(cache),
            "--read-only",
        ],
        env=_rclone_env(store),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for(lambda: os.path.ismount(mp), 30, "rclone mount")
        h = hashlib.blake2b(digest_size=16)
        t0 = time.perf_counter()
        with open(mp / "big" / "big.bin", "rb", buffering=0) as f:
            while piece := f.read(READ):
                h.update(piece)
        secs = time.perf_counter() - t0
        if h.hexdigest() != digest:
            print("rclone mount read other bytes")
            return None
        return size / secs / 1e6
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def profiled(args: argparse.Namespace, tag: str, pids: dict[str, int]) -> Iterator[None]:
    """py-spy record of the daemon and the mount while the block runs, with --profile;
    the busiest functions of each are printed after it."""
    if not args.profile:
        yield
        return
    os.makedirs(args.profile, exist_ok=True)
    outs = {k: os.path.join(args.profile, f"{tag}-{k}.txt") for k in pids}
    with ExitStack() as stack:
        for k, pid in pids.items():
            stack.enter_context(Profiler(pid, outs[k]))
        yield
    for k, out in outs.items():
        print(f"  {k} ({tag}):\n{profile_summary(out)}")


@contextmanager
def fresh_mount(
    tmp: Path, tag: str, url: str, cache: int, *args: str, tree: str | None = None
) -> Iterator[tuple[Node, str]]:
    path = [tree, os.path.join(tree, "silofs-ctl")] if tree else []
    node = Node(tmp / f"node-{tag}", cache_size=cache, pythonpath=path)
    with node:
        node.start()
        mp = str(tmp / f"mnt-{tag}")
        node.mount(f"s3://{BUCKET}/", mp, "--endpoint-url", url, *args)
        try:
            yield node, mp
        finally:
            node.unmount(mp)


def cold_big(
    store: Server,
    tmp: Path,
    tag: str,
    size: int,
    digest: str,
    args: argparse.Namespace,
    tree: str | None = None,
) -> dict[str, float]:
    """One cold sequential read of the big object through a fresh mount (of the silofs
    in `tree`, default this checkout); the range GETs are the daemon's count
    (remote_requests), so no proxy slows the bytes down. Then waits until every byte is
    admitted to the cache (the next epoch hits): the seconds that took after the read."""
    cache = 2 * size + (256 << 20)
    with fresh_mount(tmp, tag, store.endpoint_url, cache, *args.mount_args, tree=tree) as (
        node,
        mp,
    ):
        pids = {"daemon": node.daemon_pid, "mount": node.mount_pid(mp)}
        before = {k: ProcTimes.of(p) for k, p in pids.items()}
        s0 = store_times(store)
        h = hashlib.blake2b(digest_size=16)
        buf = bytearray(READ)
        view = memoryview(buf)
        n = 0
        t0 = time.perf_counter()
        fd = os.open(os.path.join(mp, "big", "big.bin"), os.O_RDONLY)
        try:
            with profiled(args if tag.endswith("0") else _NO_PROFILE, "big", pids):
                while got := os.readv(fd, [view]):
                    h.update(view[:got])
                    n += got
        finally:
            os.close(fd)
        secs = time.perf_counter() - t0
        cost = {k: ProcTimes.of(p).minus(before[k]) for k, p in pids.items()}
        on_store = store_cpu(store, s0)
        assert n == size and h.hexdigest() == digest, "the mount read other bytes"
        gets = node.settle(mp, size).get("remote_requests", float("nan"))
        wait_for(
            lambda: node.status()["datasets"][0]["cached_bytes"] >= size,
            120,
            "every chunk of the big object to be admitted",
        )
        admitted_after = time.perf_counter() - t0 - secs
    return {
        "rate": size / secs / 1e6,
        "gets": gets,
        "admitted_after": admitted_after,
        "daemon_user": cost["daemon"].user_s,
        "daemon_sys": cost["daemon"].sys_s,
        "mount_user": cost["mount"].user_s,
        "mount_sys": cost["mount"].sys_s,
        "store": on_store,
    }


def cold_small(
    store: Server,
    tmp: Path,
    tag: str,
    small: dict[str, bytes],
    readers: int,
    args: argparse.Namespace,
    tree: str | None = None,
) -> float:
    """files/s reading every small object once, cold, with `readers` threads, through a
    proxy that holds every response's first byte for --first-byte-ms."""
    up = ("127.0.0.1", store.port)
    plan = FaultPlan(first_byte_delay=args.first_byte_ms / 1000)
    digests = {k: hashlib.blake2b(v, digest_size=16).digest() for k, v in small.items()}
    cache = 2 * sum(map(len, small.values())) + (256 << 20)
    with FaultProxy(upstream=up, faults=plan, max_connections=256) as proxy:
        with fresh_mount(tmp, tag, proxy.url, cache, *args.mount_args, tree=tree) as (node, mp):
            pids = {"daemon": node.daemon_pid, "mount": node.mount_pid(mp)}
            keys = list(small)
            random.Random(readers).shuffle(keys)
            bad: list[str] = []

            def read(key: str) -> int:
                try:
                    with open(os.path.join(mp, key), "rb") as f:
                        data = f.read()
                except OSError as exc:
                    bad.append(f"{key}: {exc}")
                    return 0
                if hashlib.blake2b(data, digest_size=16).digest() != digests[key]:
                    bad.append(key)
                return len(data)

            before = {k: ProcTimes.of(p) for k, p in pids.items()}
            t0 = time.perf_counter()
            with profiled(args if tag.endswith("-0") else _NO_PROFILE, f"small{readers}", pids):
                drain(keys, read, readers)
            secs = time.perf_counter() - t0
            cost = {k: ProcTimes.of(p).minus(before[k]) for k, p in pids.items()}
            [ds] = node.status()["datasets"]
            fallbacks = ds.get("store_lean_fallbacks", "-")  # "-": a tree without the lean path
            if bad:
                sys.exit(f"cold small files through {store.name}: {bad[:3]}")
    per_file = {k: c.cpu_s / len(small) * 1e3 for k, c in cost.items()}
    print(
        f"    {readers} reader(s): {len(small) / secs:.0f} files/s; CPU ms per file: daemon "
        f"{per_file['daemon']:.1f}, mount {per_file['mount']:.1f}; lean fallbacks {fallbacks}"
    )
    return len(small) / secs


def get_cost(store: Server, small: dict[str, bytes], runs: int) -> None:
    """CPU per whole-object GET in this process, S3Backend.get_range straight to the
    store (no proxy, no daemon), botocore's request path (extra lean=false) against the
    lean one, alternated `runs` times: the share of the daemon's CPU per small file the
    request path is. A tree without the lean path ignores the option (both botocore)."""
    from silofs.node.backends.base import BackendOptions
    from silofs.node.backends.s3 import S3Backend
    from silofs.uri import parse_uri

    os.environ.update(store.env)
    cost: dict[str, list[float]] = {"false": [], "true": []}
    for _ in range(runs):
        for lean in cost:
            opts = BackendOptions(endpoint_url=store.endpoint_url, extra={"lean": lean})
            backend = S3Backend(parse_uri(f"s3://{BUCKET}/small/"), opts)
            infos = list(backend.list())
            c0 = time.process_time()
            for info in infos:
                if len(backend.get_range(info, 0, info.size)) != info.size:
                    sys.exit(f"short GET of {info.key} from {store.name}")
            cost[lean].append((time.process_time() - c0) / len(infos) * 1e3)
            backend.close()
    boto, lean_ms = Samples(cost["false"]), Samples(cost["true"])
    print(
        f"  CPU ms per 110 KiB GET in-process: botocore {boto.text('{:.2f}')}, lean "
        f"{lean_ms.text('{:.2f}')} ({ratio(lean_ms.median, boto.median):.2f}x)"
    )


def big_pass(
    store: Server, tmp: Path, name: str, size: int, digest: str, args: argparse.Namespace
) -> str:
    """The big file, `--runs` rounds; each round reads it with one boto3 GET, then
    through silofs (and through --other-tree's silofs), so the ratios compare passes
    that met the same load. rclone's figures come after the rounds. Its table row."""
    trees = {"silofs": None, **({"other": args.other_tree} if args.other_tree else {})}
    boto: list[dict[str, float]] = []
    runs: dict[str, list[dict[str, float]]] = {t: [] for t in trees}
    for i in range(args.runs):
        boto.append(boto3_ceiling(store, size, digest))
        for t, tree in trees.items():
            runs[t].append(cold_big(store, tmp, f"{name}-{t}-big{i}", size, digest, args, tree))
        print(
            f"  round {i}: boto3 {boto[-1]['rate']:.0f} MB/s, "
            + ", ".join(f"{t} {r[-1]['rate']:.0f}" for t, r in runs.items())
        )
    ceiling = Samples([b["rate"] for b in boto])
    mib = size / (1 << 20)
    boto_ms = {k: Samples([b[k] for b in boto]).median * 1000 / mib for k in ("client", "store")}
    rc = [r for _ in range(args.runs) if (r := rclone_rate(store, size))]
    rcl = Samples(rc) if rc else None
    rm = [
        r
        for i in range(args.runs)
        if (r := rclone_mount_rate(store, tmp, f"{name}{i}", size, digest))
    ]
    rcm = Samples(rm) if rm else None
    print(f"cold {args.big_mb} MiB sequential, MB/s (median, range of {args.runs}):")
    print(f"  boto3 one GET (ceiling)  {ceiling.text('{:.0f}')}")
    print(
        f"    CPU ms per MiB (median): client (boto3 and the hash) {boto_ms['client']:.2f}, "
        f"store {boto_ms['store']:.2f}"
    )
    if rcl is not None:
        print(f"  rclone cat               {rcl.text('{:.0f}')}")
    else:
        print("  rclone                   not installed")
    if rcm is not None:
        print(f"  rclone mount vfs full    {rcm.text('{:.0f}')}")
    rows = []
    for t, tree in trees.items():
        rate = Samples([r["rate"] for r in runs[t]])
        med = {k: Samples([r[k] for r in runs[t]]).median for k in runs[t][0]}
        label = "silofs mount" if tree is None else f"silofs of {args.other_label}"
        print(f"  {label:<24} {rate.text('{:.0f}')}   {med['gets']:.0f} range GETs")
        ratios = [f"silofs / boto3 {ratio(rate.median, ceiling.median):.2f}x"]
        if rcl is not None:
            ratios.append(f"silofs / rclone cat {ratio(rate.median, rcl.median):.2f}x")
        if rcm is not None:
            ratios.append(f"silofs / rclone mount {ratio(rate.median, rcm.median):.2f}x")
        print("    " + "   ".join(ratios))
        print(
            f"    CPU s (median): daemon user {med['daemon_user']:.2f} sys "
            f"{med['daemon_sys']:.2f}; mount user {med['mount_user']:.2f} "
            f"sys {med['mount_sys']:.2f}; all admitted {med['admitted_after']:.2f} s "
            "after the last byte was read"
        )
        per_mib = med["daemon_user"] + med["daemon_sys"] + med["mount_user"] + med["mount_sys"]
        print(
            f"    CPU ms per MiB (median): daemon and mount {per_mib * 1000 / mib:.2f}, "
            f"store {med['store'] * 1000 / mib:.2f}"
        )
        if tree is None:
            rows.append(
                f"| {name} | cold {args.big_mb} MiB sequential | {rate.text('{:.0f}')} MB/s "
                f"| boto3 {ceiling.median:.0f} MB/s | " + ", ".join(ratios) + " |"
            )
    return "\n".join(rows)


_NO_PROFILE = argparse.Namespace(profile=None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stores", default="moto,s3rver", help="comma-separated: moto, s3rver")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--big-mb", type=int, default=256, help="MiB of the big object")
    ap.add_argument("--small-files", type=int, default=240)
    ap.add_argument("--first-byte-ms", type=float, default=20.0)
    ap.add_argument("--skip-small", action="store_true")
    ap.add_argument(
        "--profile",
        metavar="DIR",
        help="py-spy the daemon and the mount in the first run of each pass (its figures "
        "are then not comparable: py-spy takes CPU)",
    )
    ap.add_argument("--skip-big", action="store_true")
    ap.add_argument(
        "--other-tree",
        "--git-rev",
        metavar="REV|DIR",
        help="another silofs (a git revision of this repository, or a checkout in DIR) whose "
        "daemon and mount read the big file and the small files too, in every round right "
        "after this checkout's",
    )
    ap.add_argument(
        "--mount-args", default="", help="extra `silofs mount` flags, e.g. '--chunk-size 1M'"
    )
    args = ap.parse_args()
    args.mount_args = args.mount_args.split()
    need_tools({"--profile": args.profile and "py-spy"})
    check_fuse()
    unpacked = ExitStack()  # a --git-rev revision's unpacked tree, removed on exit
    if args.other_tree:
        args.other_label = baseline.describe(args.other_tree)
        print(f"other tree: {args.other_label}")
        args.other_tree = str(unpacked.enter_context(baseline.baseline_tree(args.other_tree)))
    for k in ("AWS_CA_BUNDLE", "AWS_PROFILE", "AWS_ENDPOINT_URL", "HTTP_PROXY", "http_proxy"):
        os.environ.pop(k, None)  # our own environment only: it reaches our daemons
    os.environ["AWS_CONFIG_FILE"] = os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull
    print(f"load average before: {load_average()}")
    for line in busy_processes():
        print(f"  busy: {line}")

    rnd = random.Random(11)
    size = args.big_mb << 20
    big = os.urandom(size)
    digest = hashlib.blake2b(big, digest_size=16).hexdigest()
    # One flat prefix: s3rver 3.7.1's delimiter listing does not go deeper than one level
    # below the prefix, so it never returns "small/" as a CommonPrefix when every key is in
    # small/000/... (and its pages without a delimiter are not in key order). The keys
    # were missing from s3rver mounts; moto lists them all (bench/README.md, cold.py).
    small = {f"small/img{i:05d}.jpg": rnd.randbytes(SMALL) for i in range(args.small_files)}
    tmp = Path(tempfile.mkdtemp(prefix="silofs-cold-", dir="/var/tmp"))
    table: list[str] = []
    try:
        for name in args.stores.split(","):
            store = start_store(name, tmp)
            if store is None:
                continue
            os.environ.update(store.env)  # its credentials, for our daemons and clients
            try:
                t0 = time.perf_counter()
                upload(store, big, small)
                print(
                    f"\n== {name}: uploaded {args.big_mb} MiB + {len(small)} x 110 KiB "
                    f"in {time.perf_counter() - t0:.1f}s =="
                )
                if not args.skip_big:
                    table.append(big_pass(store, tmp, name, size, digest, args))
                if not args.skip_small:
                    trees = {"": None, **({" (other)": args.other_tree} if args.other_tree else {})}
                    figures: dict[tuple[int, str], Samples] = {}
                    for readers in (1, 8):
                        got: dict[str, list[float]] = {t: [] for t in trees}
                        for i in range(args.runs):  # the trees alternate run by run
                            for t, tree in trees.items():
                                tag = f"{name}-small{readers}{t.strip(' ()')}-{i}"
                                rate = cold_small(store, tmp, tag, small, readers, args, tree)
                                got[t].append(rate)
                        for t in trees:
                            figures[(readers, t)] = Samples(got[t])
                    x = ratio(figures[(8, "")].median, figures[(1, "")].median)
                    print(f"cold 110 KiB files, {args.first_byte_ms:g} ms first byte, files/s:")
                    for (readers, t), s in figures.items():
                        print(f"  {readers} reader(s){t}  {s.text('{:.0f}')}")
                    print(f"  8 readers / 1 reader {x:.2f}x")
                    get_cost(store, small, args.runs)
                    table.append(
                        f"| {name} | cold 110 KiB, {args.first_byte_ms:g} ms | "
                        f"1: {figures[(1, '')].text('{:.0f}')} files/s, "
                        f"8: {figures[(8, '')].text('{:.0f}')} "
                        f"| | {x:.2f}x |"
                    )
            finally:
                store.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        unpacked.close()
    if not table:  # every store skipped (s3rver without npm): nothing was measured
        sys.exit(f"no store could be started of {args.stores}: nothing measured")
    print("\n| store | figure | silofs | reference | ratio |\n|---|---|---|---|---|")
    print("\n".join(table))
    print(f"load average after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
