"""First-listing rate of a store prefix, serial vs fanned out, with per-request latency.

Owns the first-listing rate: objects listed per second by a backend's list() (the code
the daemon's listing runs) behind tests/support/faultproxy.py with a first-byte delay of
0, 10 and 50 ms per request, with list_workers=1 (one page after another) and
list_workers=32, the default (delimiter-split prefixes in parallel; --workers to
change).
--backends picks the stores:
  s3     S3Backend against a minimal ListObjectsV2 server (ListServer, below): moto
         spends ~1.7 s of CPU per 1000-key page, which would measure moto;
  azure  AzureBackend (walk_blobs per prefix) against Azurite, started as the tests
         start it (tests/support/servers.py), the objects uploaded first;
  gcs    GCSBackend (list_blobs with a delimiter per prefix) against fake-gcs-server.
The bucket has --dirs directories of --per-dir objects (--cloud-dirs/--cloud-per-dir for
Azure and GCS, whose emulators take one request per object uploaded). Each timed
listing starts as the daemon's does, after the dataset's check() (client, credentials,
HEAD bucket, a 1-key list), and counts the ObjectInfo records of list_events(), what the
daemon consumes. With --into-env each listing is also written into a fresh cache env as
the daemon writes a first listing (node/datasets.py _fill: a listing thread batching LISTING_BATCH
records into a 2-batch queue, one writer adding each batch in its own txn, then
finish_listing), so the rate is a first listing's end to end. Never changes silofs.
The S3 server and the proxies run in a child process (the store's CPU is not the
client's: in one process they would take the GIL from the listing being measured; the
emulators are processes of their own, and their CPU seconds are counted in the store
side's). --git-rev REV first runs the same listings with REV's silofs, in a process of
its own (tests/support/baseline.py).
    python bench/listing.py [--backends s3,azure,gcs] [--dirs 100] [--per-dir 1000]
        [--workers 1,32] [--into-env] [--git-rev REV]
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import multiprocessing
import os
import queue
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit
from xml.sax.saxutils import escape, unescape

import common  # this checkout (or a baseline) first on sys.path

from silofs.node.backends.base import BackendOptions
from silofs.node.backends.s3 import S3Backend
from silofs.node.store_write import LISTING_BATCH, WritableStore, env_map_size
from silofs.records import ObjectInfo, PrefixListed
from silofs.uri import parse_uri
from tests.support import baseline
from tests.support.faultproxy import FaultPlan, FaultProxy

try:
    from silofs.node.service import tune_gc
except ImportError:  # a baseline from before the daemon tuned its GC

    def tune_gc() -> None:
        pass


class ListServer:
    """ListObjectsV2 (prefix, delimiter, max-keys, continuation) over a sorted in-memory
    key list: moto spends ~1.7 s of CPU per 1000-key page of a 40 k-key bucket, which
    would measure moto, not the number of round trips a listing makes."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = sorted(keys)
        self.pages: dict[tuple[str, str, int, str | None, bool], bytes] = {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_args: object) -> None:
                pass

            def do_HEAD(self) -> None:  # noqa: N802 - HeadBucket, the daemon's check()
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                q = {k: v[0] for k, v in parse_qs(urlsplit(self.path).query).items()}
                body = outer.cached(
                    q.get("prefix", ""),
                    q.get("delimiter", ""),
                    int(q.get("max-keys", "1000")),
                    q.get("continuation-token"),
                    q.get("encoding-type") == "url",
                )
                self.send_response(200)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        # A listen backlog for every proxy connection at once (http.server's is 5): an
        # overflow drops a SYN, and its retransmit adds a second to a fanned listing.
        server = type("Server", (ThreadingHTTPServer,), {"request_queue_size": 256})
        self.httpd = server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def cached(self, *args: Any) -> bytes:
        body = self.pages.get(args)
        if body is None:
            body = self.pages[args] = self.page(*args)
        return body

    def precompute(self, prefix: str, max_keys: int = 1000) -> None:
        """Every page a serial and a fanned-out listing of `prefix` asks for (url
        encoded, as botocore and the lean path ask), so timed listings measure the
        client, not this server's page building."""
        for delim, todo in (("", [prefix]), ("/", [prefix])):
            while todo:
                token: str | None = None
                here = todo.pop()
                while True:
                    body = self.cached(here, delim, max_keys, token, True)
                    if delim:
                        found = re.findall(r"<CommonPrefixes><Prefix>([^<]*)<", body.decode())
                        todo += map(unquote, found)
                    more = re.search(r"<NextContinuationToken>([^<]*)<", body.decode())
                    if not more:
                        break
                    token = unescape(more.group(1))

    def page(self, prefix: str, delim: str, max_keys: int, token: str | None, enc: bool) -> bytes:
        keys = self.keys
        i = bisect.bisect_left(keys, prefix)
        if token:
            kind, after = token[0], token[2:]
            i = (
                bisect.bisect_right(keys, after)
                if kind == "k"
                else bisect.bisect_left(keys, after[:-1] + chr(ord(delim) + 1))
            )
        contents: list[str] = []
        prefixes: list[str] = []
        last = ""
        while (
            i < len(keys)
            and keys[i].startswith(prefix)
            and len(contents) + len(prefixes) < max_keys
        ):
            key = keys[i]
            cut = key.find(delim, len(prefix)) if delim else -1
            if cut >= 0:
                cp = key[: cut + 1]
                prefixes.append(cp)
                last = "p:" + cp
                i = bisect.bisect_left(keys, cp[:-1] + chr(ord(delim) + 1))
                continue
            contents.append(key)
            last = "k:" + key
            i += 1
        truncated = i < len(keys) and keys[i].startswith(prefix)
        q = (lambda k: quote(k, safe="/")) if enc else escape
        parts = [
            '<?xml version="1.0" encoding="UTF-8"?>',
            '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">',
            f"<Name>bench</Name><Prefix>{q(prefix)}</Prefix><MaxKeys>{max_keys}</MaxKeys>",
            f"<KeyCount>{len(contents) + len(prefixes)}</KeyCount>",
            f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>",
        ]
        if delim:
            parts.append(f"<Delimiter>{q(delim)}</Delimiter>")
        if enc:
            parts.append("<EncodingType>url</EncodingType>")
        for k in contents:
            parts.append(
                f"<Contents><Key>{q(k)}</Key><LastModified>2024-01-01T00:00:00.000Z"
                '</LastModified><ETag>"d41d8cd98f00b204e9800998ecf8427e"</ETag>'
                "<Size>0</Size><StorageClass>STANDARD</StorageClass></Contents>"
            )
        for cp in prefixes:
            parts.append(f"<CommonPrefixes><Prefix>{q(cp)}</Prefix></CommonPrefixes>")
        if truncated:
            parts.append(f"<NextContinuationToken>{escape(last)}</NextContinuationToken>")
        parts.append("</ListBucketResult>")
        return "".join(parts).encode()

    def close(self) -> None:
        self.httpd.shutdown()


def serve(keys: list[str] | int, delays: list[float], conn: Any) -> None:
    """The store side: one ListServer over `keys` (its pages built before the URLs are
    sent), or an emulator already listening on port `keys`; one delaying proxy per
    delay. Their URLs go back through `conn`, and they stop when `conn` says so (or the
    parent goes away)."""
    server = ListServer(keys) if isinstance(keys, list) else None
    if server is not None:
        server.precompute("data/")
    port = server.port if server is not None else keys
    assert isinstance(port, int)
    with contextlib.ExitStack() as stack:
        urls = {}
        for delay in delays:
            plan = FaultPlan(first_byte_delay=delay / 1000)
            urls[delay] = stack.enter_context(FaultProxy(("127.0.0.1", port), plan)).url
        conn.send(urls)
        try:
            while conn.recv() == "cpu":  # the store side's CPU seconds so far
                conn.send(time.process_time())
        except EOFError:
            pass
    if server is not None:
        server.close()


def _upload(put: Callable[[str], None], keys: list[str]) -> float:
    """Upload `keys` (empty objects) with 16 threads; seconds taken."""
    t0 = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        for _ in pool.map(put, keys):
            pass
    return time.monotonic() - t0


@contextlib.contextmanager
def emulator(
    kind: str, keys: list[str]
) -> Iterator[tuple[int, Callable[[str, int], Any], Callable[[], float]]]:
    """Azurite or fake-gcs-server started as the tests start them, holding `keys` in
    bucket "bench": (its port, a backend factory taking the proxy URL and workers, the
    emulator's CPU seconds so far)."""
    from tests.support import servers

    if kind == "azure":
        from silofs.node.backends.azure import AzureBackend

        server: Any = common.start_server(servers.start_azurite, "Azurite")
        port = int(server.endpoint_url.rsplit(":", 1)[1].split("/")[0])
        account = server.account
        container = server.service().create_container("bench")
        took = _upload(lambda k: container.upload_blob(k, b"", overwrite=True), keys)

        def backend(url: str, workers: int) -> Any:
            c = servers.connection_string(f"{url}/{account}", servers.AZURITE_KEY)
            opts = BackendOptions(list_workers=workers, extra={"connection_string": c})
            return AzureBackend(parse_uri(f"az://{account}/bench/data/"), opts)

    else:
        from silofs.node.backends.gcs import GCSBackend

        server = common.start_server(servers.start_fake_gcs, "fake-gcs-server")
        port = int(server.endpoint_url.rsplit(":", 1)[1])
        bucket = server.client().create_bucket("bench")
        took = _upload(lambda k: bucket.blob(k).upload_from_string(b""), keys)

        def backend(url: str, workers: int) -> Any:
            opts = BackendOptions(
                endpoint_url=url, list_workers=workers, extra={"anonymous": "true"}
            )
            return GCSBackend(parse_uri("gs://bench/data/"), opts)

    print(f"{kind}: {len(keys):,} objects uploaded in {took:.0f}s", flush=True)
    try:
        yield port, backend, lambda: _cpu_of(server.process.pid)
    finally:
        server.stop()


def _cpu_of(pid: int) -> float:
    """CPU seconds (user + system) of process `pid` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", default="s3", help="comma-separated: s3, azure, gcs")
    ap.add_argument("--dirs", type=int, default=100)
    ap.add_argument("--per-dir", type=int, default=1000)
    ap.add_argument("--cloud-dirs", type=int, default=20, help="directories for azure/gcs")
    ap.add_argument("--cloud-per-dir", type=int, default=1000, help="objects each, azure/gcs")
    ap.add_argument("--delays-ms", default="0,10,50")
    ap.add_argument("--workers", default="1,32", help="list_workers values; the first is the base")
    ap.add_argument(
        "--into-env", action="store_true", help="write each listing into a cache env, as the daemon"
    )
    baseline.add_argument(ap, "backends (run first, in a process of their own)")
    args = ap.parse_args()
    if args.git_rev:
        baseline.run_self_first(args.git_rev, __file__)
    delays = [float(x) for x in args.delays_ms.split(",")]
    workers = [int(w) for w in args.workers.split(",")]
    os.environ.update(
        {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1"}
    )
    print(
        "page size 1000; S3 list server and proxies in a child process; cpu s: this process's CPU "
        "seconds (user + system), store s: the store side's (server or emulator, proxies)"
    )
    print(
        f"{'store':>6} {'delay':>6} {'workers':>8} {'seconds':>8} {'objects/s':>10} "
        f"{'cpu s':>6} {'store s':>8}  speed-up  lean fallbacks"
    )
    for kind in args.backends.split(","):
        if kind == "s3":
            keys = _keys(args.dirs, args.per_dir)
            s3 = parse_uri("s3://bench/data/")

            def backend(url: str, w: int, s3: Any = s3) -> Any:
                return S3Backend(s3, BackendOptions(endpoint_url=url, list_workers=w))

            with _proxies(keys, delays) as (urls, store_cpu):
                _measure(kind, backend, urls, store_cpu, delays, workers, len(keys), args.into_env)
        elif kind in ("azure", "gcs"):
            keys = _keys(args.cloud_dirs, args.cloud_per_dir)
            with emulator(kind, keys) as (port, backend, emulator_cpu):
                with _proxies(port, delays) as (urls, proxies_cpu):

                    def both() -> float:
                        return emulator_cpu() + proxies_cpu()

                    _measure(kind, backend, urls, both, delays, workers, len(keys), args.into_env)
        else:
            ap.error(f"unknown backend {kind!r}: s3, azure or gcs")


def _keys(dirs: int, per_dir: int) -> list[str]:
    return [f"data/d{d:04d}/img_{i:06d}.jpg" for d in range(dirs) for i in range(per_dir)]


@contextlib.contextmanager
def _proxies(
    keys: list[str] | int, delays: list[float]
) -> Iterator[tuple[dict[float, str], Callable[[], float]]]:
    """The delaying proxies (and the S3 ListServer) in a child process: their URLs, and
    the child's CPU seconds so far."""
    mine, theirs = multiprocessing.Pipe()
    child = multiprocessing.get_context("fork").Process(
        target=serve, args=(keys, delays, theirs), daemon=True
    )
    child.start()

    def store_cpu() -> float:
        mine.send("cpu")
        return float(mine.recv())

    try:
        yield mine.recv(), store_cpu
    finally:
        mine.send("stop")
        child.join(10)


def _measure(
    kind: str,
    backend: Callable[[str, int], Any],
    urls: dict[float, str],
    store_cpu: Callable[[], float],
    delays: list[float],
    workers: list[int],
    n: int,
    into_env: bool = False,
) -> None:
    tune_gc()  # as the daemon runs (after the store side forked: not its)
    for delay in delays:
        serial = 0.0
        for w in workers:
            b = backend(urls[delay], w)
            # As the daemon does before it lists (datasets.py _prepare_dataset): the client
            # and credentials made, the bucket checked, one 1-key list; ~0.1 s of CPU
            # that is no part of the listing's rate.
            b.check()
            s0 = store_cpu()
            t0, c0 = time.monotonic(), time.process_time()
            if into_env:
                got = _write_listing(b)
            else:  # what the daemon consumes: objects and PrefixListed records
                got = sum(1 for e in b.list_events() if type(e) is ObjectInfo)
            el, cpu = time.monotonic() - t0, time.process_time() - c0
            scpu = store_cpu() - s0
            # "-": no lean path (before it, or not S3)
            fallbacks = getattr(b.counters, "lean_fallbacks", "-") if kind == "s3" else "-"
            b.close()
            assert got == n, (got, n)
            serial = serial or el
            print(
                f"{kind:>6} {delay:>4.0f}ms {w:>8} {el:>8.2f} {n / el:>10,.0f} {cpu:>6.2f} "
                f"{scpu:>8.2f}  {serial / el:>7.1f}x  {fallbacks}",
                flush=True,
            )


def _write_listing(backend: Any) -> int:
    """List into a fresh env as the daemon's Catalog._fill does; the objects written."""
    d = tempfile.mkdtemp(prefix="silofs-listing-", dir="/var/tmp")
    store = WritableStore(d, env_map_size(4 << 30))
    try:
        dsid = store.dataset_id("s3://bench/data/", create=True)
        assert dsid is not None
        builder = store.begin_listing(dsid)
        batches: queue.Queue[list[ObjectInfo | PrefixListed] | BaseException | None]
        batches = queue.Queue(2)

        def produce() -> None:
            try:
                batch: list[ObjectInfo | PrefixListed] = []
                for e in backend.list_events():
                    batch.append(e)
                    if len(batch) >= LISTING_BATCH:
                        batches.put(batch)
                        batch = []
                batches.put(batch)
                batches.put(None)
            except BaseException as exc:  # noqa: BLE001 - raised by the writer
                batches.put(exc)

        threading.Thread(target=produce, daemon=True).start()
        while (batch := batches.get()) is not None:
            if isinstance(batch, BaseException):
                raise batch
            store.add_to_listing(builder, batch)
        return int(store.finish_listing(builder, {"uri": "s3://bench/data/"})["objects"])
    finally:
        store.close()
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
