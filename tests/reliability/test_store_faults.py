"""A fault-injecting proxy in front of moto, Azurite and fake-gcs-server, readers on a real
mount: no wrong byte, no EIO, no read over 60 s, whatever the store does.

tests/support/faultproxy.py sits between the daemon and the emulator and, on GET requests, answers
500 or 503 SlowDown, resets the connection before the answer or in the middle of the body,
truncates the body, announces a wrong Content-Length, delays the answer (short form 2 s,
long form 5-30 s) or flips one byte of the body. The bucket and its listing are made
without faults; faults start once the mount is up, so every fault lands on a chunk GET.

Rounds: the dataset's cache allocation is 0 (nothing admitted) and each round mounts
afresh (a mount buffers what it fetched), so every round fetches every chunk from the store
through the proxy. A last round gives the dataset the shared pool and reads everything
twice: the second pass is served from what was admitted while faults were injected, so a
damaged body that got cached shows up as wrong bytes there.

Counted per store: faults injected (by kind), chunk GETs, reads, wrong bytes (asserted 0),
EIO and other errors (asserted 0: the daemon here makes MAX_ATTEMPTS attempts per GET, so
an EIO means a fault was not retried), reads slower than 60 s (asserted 0), the slowest
read. Short form 2 rounds, SILOFS_LONG=1: 12 rounds.
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from silofs.control.client import quote_segment
from tests.support.faultproxy import FAULT_KINDS, Fault, FaultPlan, FaultProxy
from tests.support.fixtures import needs_fuse
from tests.support.node import Node, drop_file_cache
from tests.support.servers import AZURITE_KEY, connection_string
from tests.support.trees import random_files

from .conftest import LONG, scale
from .verify import pread_all

pytestmark = [needs_fuse, pytest.mark.fuse, pytest.mark.servers]

ROUNDS = int(os.environ.get("SILOFS_FAULT_ROUNDS") or scale(2, 12))
SEED = int(os.environ.get("SILOFS_FAULT_SEED", "1"))
CHUNK = 256 << 10
READ = 1 << 20  # one pread; the unit "a read over 60 s" is measured on
SLOW = 60.0
READERS = 4
DELAY = (5.0, 30.0) if LONG else 2.0
# Attempts per GET (the daemon's default is 5). What is asserted is that every fault is
# retried, not that five attempts outlast these fault rates: 8-14% of attempts are
# retried here (store_retries / proxied requests of the long run in docs/RESULTS.md:
# S3 174/1,211, Azure 75/894, GCS 105/867), so a GET drew five faults in a row in up to
# 0.144**5 = 6e-5 of GETs, and the short form's ~600 GETs over the three stores gave
# one its reader may see as EIO in ~2% of runs. With 12 attempts: 0.144**12 = 8e-11
# a GET, ~5e-8 a run; a fault kind never retried still fails 2-3% of GETs (a dozen a run).
MAX_ATTEMPTS = 12

_SERVER = {"s3": "s3_server", "azure": "azurite_server", "gcs": "gcs_server"}


# S3 and GCS send no checksum for a range (docs/SEMANTICS.md, "What is detected"): a
# corrupted ranged body is the one damage they cannot catch over plain HTTP, so the main
# check corrupts only bodies of single-chunk objects there (one whole-object GET can be
# checked against the object's checksum), and
# test_a_corrupted_range_over_plain_http_is_served keeps asserting the promise for ranges.
RANGES_UNCHECKED = {"s3", "gcs"}


def fault_plan(kind: str) -> FaultPlan:
    """About 17% of GETs get a fault; the first rule whose draw succeeds wins."""
    get = "GET"
    # The objects of one chunk (s/NNN.bin) are what S3 and GCS can checksum, when read in one
    # GET; the path may be URL-encoded (GCS: o/s%2F000.bin).
    corruptible = r"s(/|%2F)\d{3}\.bin" if kind in RANGES_UNCHECKED else None
    return FaultPlan(
        faults=(
            Fault("http_500", 0.03, methods=get),
            Fault("http_503", 0.03, methods=get),
            Fault("reset_before_response", 0.02, methods=get),
            Fault("reset_mid_body", 0.02, methods=get, at=0.5),
            Fault("truncate", 0.02, methods=get, at=0.3),
            Fault("wrong_content_length", 0.02, methods=get, at=0.7),
            Fault("corrupt", 0.02, methods=get, path=corruptible),
            Fault("delay", 0.02, methods=get, seconds=DELAY),
        )
    )


def make_tree(rnd: random.Random) -> dict[str, bytes]:
    small = random_files(rnd, 40, range(1, 200_001), "s/{i:03d}.bin")
    return small | random_files(rnd, 4, [4 * CHUNK, 4 * CHUNK + 999], "m/{i}.bin")


def put_multipart(server: Any, bucket: str, key: str, data: bytes) -> None:
    """An S3 object uploaded in parts: its ETag is no MD5 of the bytes, so the SDK cannot
    check the body against it (a body once served wrong over plain HTTP)."""
    client = server.client()
    part = 5 << 20
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)
    parts = []
    for n, start in enumerate(range(0, len(data), part), 1):
        res = client.upload_part(
            Bucket=bucket,
            Key=key,
            UploadId=upload["UploadId"],
            PartNumber=n,
            Body=data[start : start + part],
        )
        parts.append({"ETag": res["ETag"], "PartNumber": n})
    client.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=upload["UploadId"], MultipartUpload={"Parts": parts}
    )


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reads = 0
        self.bytes = 0
        self.wrong_bytes = 0
        self.wrong: list[str] = []
        self.wrong_by_object: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.slow = 0
        self.slowest = 0.0

    def read(self, name: str, off: int, got: bytes, want: bytes, seconds: float) -> None:
        wrong = 0
        if got != want:
            wrong = sum(1 for a, b in zip(got, want, strict=False) if a != b)
            wrong += abs(len(want) - len(got))  # a short read is wrong bytes too
        with self.lock:
            self.reads += 1
            self.bytes += len(got)
            self.slowest = max(self.slowest, seconds)
            self.slow += seconds > SLOW
            if wrong:
                self.wrong_bytes += wrong
                # Chunks of multi-chunk objects come from ranged GETs, which S3 and GCS
                # give no checksum for; a single-chunk object is one whole-object GET.
                self.wrong_by_object[name.split("/")[0]] += wrong
                self.wrong.append(f"{name}@{off}: {wrong} wrong of {len(want)}")

    def error(self, name: str, exc: OSError, seconds: float) -> None:
        with self.lock:
            self.errors[errno.errorcode.get(exc.errno or 0, str(exc.errno))] += 1
            self.slowest = max(self.slowest, seconds)
            self.slow += seconds > SLOW


def read_file(mp: Path, name: str, want: bytes, rnd: random.Random, t: Tally) -> None:
    """The whole file in 1 MiB preads, or a few random ranges, each timed and compared."""
    drop_file_cache(mp / name)
    fd = os.open(mp / name, os.O_RDONLY)
    try:
        if rnd.random() < 0.7:
            spans = [(off, READ) for off in range(0, max(len(want), 1), READ)]
        else:
            spans = [(rnd.randrange(max(len(want), 1)), rnd.randint(1, READ)) for _ in range(3)]
        for off, n in spans:
            t0 = time.monotonic()
            got, exc, _ = pread_all(fd, n, off)
            seconds = time.monotonic() - t0
            expect = want[off : off + n]
            if exc is not None:
                t.read(name, off, got, expect[: len(got)], seconds)  # what came is checked
                t.error(name, exc, seconds)
                continue
            t.read(name, off, got, expect, seconds)
    finally:
        os.close(fd)


def read_round(mp: Path, tree: dict[str, bytes], seed: int, t: Tally, passes: int = 1) -> None:
    """READERS threads share each shuffled pass over the tree; passes run one after another
    (the second pass of the last round must find what the first admitted)."""
    rnd = random.Random(seed)
    for p in range(passes):
        names = sorted(tree)
        rnd.shuffle(names)
        lock = threading.Lock()

        def run(i: int, names: list[str] = names, lock: threading.Lock = lock, p: int = p) -> None:
            r = random.Random(seed * 31 + p * 7 + i)
            while True:
                with lock:
                    if not names:
                        return
                    name = names.pop()
                try:
                    read_file(mp, name, tree[name], r, t)
                except OSError as exc:  # open itself failed
                    t.error(name, exc, 0.0)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(READERS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()


def unmount(node: Node, mp: Path) -> None:
    res = node.run("unmount", str(mp))
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("kind", ["s3", "azure", "gcs"])
def test_store_faults_never_give_wrong_bytes(
    kind: str,
    request: pytest.FixtureRequest,
    make_node,
    monkeypatch,
    bucket_name: str,
    tmp_path: Path,
    figures: dict[str, Any],
) -> None:
    server = request.getfixturevalue(_SERVER[kind])
    server.apply_env(monkeypatch)
    rnd = random.Random(SEED)
    tree = make_tree(rnd)
    server.create(bucket_name, tree)
    if kind == "s3":
        tree["big/multipart.bin"] = data = rnd.randbytes((5 << 20) + 300_000)
        put_multipart(server, bucket_name, "big/multipart.bin", data)
    up = urlsplit(server.endpoint_url)
    seed = SEED * 7 + ["s3", "azure", "gcs"].index(kind)

    with FaultProxy(upstream=(up.hostname, up.port), faults=FaultPlan(), seed=seed) as proxy:
        # The daemon reaches the store only through the proxy.
        if kind == "s3":
            env = {"AWS_ENDPOINT_URL": proxy.url}
        elif kind == "azure":
            env = {
                "AZURE_STORAGE_CONNECTION_STRING": connection_string(
                    f"{proxy.url}/{server.account}", AZURITE_KEY
                )
            }
        else:
            env = {"STORAGE_EMULATOR_HOST": proxy.url}
        node = make_node(cache_size="128M", env=env, start=False)
        node.config = tmp_path / "silofs.toml"
        node.config.write_text(f"[backend]\nmax_attempts = {MAX_ATTEMPTS}\n")
        node.start("--chunk-size", "256K")
        # When the faults outlast the daemon's retries, a READ fails and the mount logs
        # it: one the kernel made for its own read-ahead is dropped, and the reader's
        # read asks again. What the programs saw is asserted below (no read error).
        node.expect_errors(r"silofs\.mount\.reader: reading \S+ chunk \d+: ")
        uri = server.uri(bucket_name)
        t = Tally()
        started = time.monotonic()
        try:
            for r in range(ROUNDS + 1):
                last = r == ROUNDS
                proxy.set_plan(FaultPlan())  # listing and registration without faults
                mp = node.mount(uri, tmp_path / f"mnt{r}", "--job", "f")
                canonical = node.status()["datasets"][0]["uri"]
                cache_path = f"/v1/datasets/{quote_segment(canonical)}/cache"
                node.request("PUT", cache_path, {"bytes": None if last else 0})
                proxy.set_plan(fault_plan(kind))
                read_round(mp, tree, seed * 100 + r, t, passes=2 if last else 1)
                proxy.set_plan(FaultPlan())
                unmount(node, mp)
                assert node.proc is not None and node.proc.poll() is None, "daemon died"
        finally:
            stats = dict(proxy.stats)
            injected = {k: stats.get(k, 0) for k in FAULT_KINDS if stats.get(k, 0)}
            status = node.status() if node.proc and node.proc.poll() is None else {}
            figures.update(
                store=kind,
                seed=seed,
                rounds=ROUNDS,
                delay_seconds=DELAY,
                proxied_requests=stats.get("requests", 0),
                faults_injected=sum(injected.values()),
                faults_by_kind=injected,
                not_applicable=stats.get("not_applicable", 0),
                reads=t.reads,
                read_mb=round(t.bytes / 1e6, 1),
                wrong_bytes=t.wrong_bytes,
                wrong_bytes_single_chunk_objects=t.wrong_by_object["s"],
                wrong_bytes_multi_chunk_objects=t.wrong_by_object["m"] + t.wrong_by_object["big"],
                eio=t.errors.get("EIO", 0),
                other_errors={k: n for k, n in t.errors.items() if k != "EIO"},
                reads_over_60s=t.slow,
                slowest_read_s=round(t.slowest, 1),
                dataset_errors={
                    k: v
                    for ds in status.get("datasets", [])
                    for k, v in ds.items()
                    if "error" in k or "corrupt" in k or "retr" in k
                },
                seconds=round(time.monotonic() - started, 1),
            )

    assert figures["faults_injected"] > 0, "the proxy injected nothing: is it on the path?"
    assert t.wrong_bytes == 0, t.wrong[:20]
    assert not t.errors, f"read errors {dict(t.errors)} (log: {node.logs})"
    assert t.slow == 0, f"{t.slow} reads took over {SLOW:.0f}s (slowest {t.slowest:.1f}s)"


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="docs/SEMANTICS.md: S3 and GCS send no checksum for a range, so over plain HTTP "
    "a corrupted ranged body is cached and served (TLS catches it in transit)",
)
@pytest.mark.parametrize("kind", sorted(RANGES_UNCHECKED))
def test_a_corrupted_range_over_plain_http_is_served(
    kind: str,
    request: pytest.FixtureRequest,
    make_node,
    monkeypatch,
    bucket_name: str,
    tmp_path: Path,
) -> None:
    """No wrong byte, ever (docs/SEMANTICS.md): one flipped byte in one ranged GET of a
    multi-chunk object must not reach a reader. Strict xfail: when this starts passing,
    the gap is closed and the marker (and RANGES_UNCHECKED) must go."""
    server = request.getfixturevalue(_SERVER[kind])
    server.apply_env(monkeypatch)
    # Larger than the kernel's 1 MiB read-ahead request: a first read of a smaller
    # object fetches it whole, with no Range, and so checked against its checksum.
    data = random.Random(SEED).randbytes(16 * CHUNK)
    server.create(bucket_name, {"m/big.bin": data})
    up = urlsplit(server.endpoint_url)
    once = FaultPlan(faults=(Fault("corrupt", 1.0, methods="GET", has_range=True, times=1),))
    with FaultProxy(upstream=(up.hostname, up.port), faults=FaultPlan(), seed=SEED) as proxy:
        if kind == "s3":
            env = {"AWS_ENDPOINT_URL": proxy.url}
        else:
            env = {"STORAGE_EMULATOR_HOST": proxy.url}
        node = make_node(cache_size="64M", env=env, args=("--chunk-size", "256K"))
        mp = node.mount(server.uri(bucket_name), tmp_path / "mnt", "--job", "r")
        proxy.set_plan(once)
        got = (mp / "m/big.bin").read_bytes()
        if proxy.stats.get("corrupt", 0) != 1:  # not an AssertionError: a real failure
            pytest.fail(f"the proxy corrupted {proxy.stats.get('corrupt', 0)} bodies, not 1")
        wrong = sum(a != b for a, b in zip(got, data, strict=False))
        assert got == data, f"{wrong} wrong bytes served"
