"""Prometheus metrics of the daemon, through prometheus_client.

Owns metric names, types and labels, and the optional TCP listener for scrapers. Most
metrics are a custom collector over the status view (a plain dict), so metrics and
`silofs-ctl status` can never disagree; process metrics come from prometheus_client's
ProcessCollector; the one thing kept here is the fetch latency histogram (a status view
has no distribution). Never keeps other counters, and never serves anything but
GET /metrics on the TCP listener (the control API stays on the Unix socket).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import trio
from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from silofs.control.server import Throttled, accept_forever
from silofs.errors import UsageError
from silofs.units import is_digits

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_DATASET = {
    "size": ("silofs_dataset_size_bytes", "gauge", "Bytes in the dataset listing"),
    "cache_allocation": (
        "silofs_dataset_cache_allocation_bytes",
        "gauge",
        "Cache allocated to the dataset (absent: shared pool)",
    ),
    "objects": ("silofs_dataset_objects", "gauge", "Objects in the dataset listing"),
    "cached_bytes": ("silofs_dataset_cached_bytes", "gauge", "Bytes cached for the dataset"),
    "bytes_read": ("silofs_dataset_read_bytes", "counter", "Bytes read through mounts"),
    "hit_bytes": ("silofs_dataset_hit_bytes", "counter", "Bytes served from cache"),
    "remote_bytes": ("silofs_dataset_remote_bytes", "counter", "Bytes fetched remotely"),
    "corrupt_chunks": (
        "silofs_dataset_corrupt_chunks",
        "counter",
        "Cached chunks that failed verification",
    ),
    "store_errors": (
        "silofs_dataset_store_errors",
        "counter",
        "Store operations that failed after their retries (checks, listings, GETs)",
    ),
    "store_retries": (
        "silofs_dataset_store_retries",
        "counter",
        "Store operations retried after a retryable error",
    ),
    "store_checksum_errors": (
        "silofs_dataset_store_checksum_errors_total",
        "counter",
        "Store bodies that did not match the store's checksum (refused, retried)",
    ),
    "store_short_reads": (
        "silofs_dataset_store_short_reads_total",
        "counter",
        "Store bodies shorter than the range asked for (refused, retried)",
    ),
    "store_lean_fallbacks": (
        "silofs_dataset_store_lean_fallbacks_total",
        "counter",
        "Requests silofs's own paths handed back to the SDK, which redid them (S3: errors, "
        "broken connections, pages it could not parse; Azure: list pages it could not parse)",
    ),
    "version_mismatches": (
        "silofs_dataset_version_mismatches_total",
        "counter",
        "Chunk requests refused: the mount listed another version of the object",
    ),
    "refreshes_refused": (
        "silofs_dataset_refreshes_refused_total",
        "counter",
        "Refreshes refused: asked less than min_refresh_seconds after the last listing",
    ),
}
_JOB = {
    "bytes_read": ("silofs_job_read_bytes", "counter", "Bytes read by the job"),
    "remote_bytes": ("silofs_job_remote_bytes", "counter", "Remote bytes of the job"),
    "throughput": (
        "silofs_job_throughput_bytes_per_second",
        "gauge",
        "Bytes read by the job per second, last 5 s",
    ),
    "remote_bytes_per_s": (
        "silofs_job_remote_bytes_per_second",
        "gauge",
        "Remote bytes per second of the job, last 5 s",
    ),
    "io_allocation": (
        "silofs_job_io_allocation_bytes_per_second",
        "gauge",
        "Remote IO allocation of the job (absent: unlimited)",
    ),
    "effective_cache": (
        "silofs_job_effective_cache_bytes",
        "gauge",
        "Cached bytes valid for the job's current epoch",
    ),
    "hit_ratio": ("silofs_job_hit_ratio", "gauge", "Share of the job's bytes served from cache"),
    "limiter_wait_s": (
        "silofs_job_limiter_wait_seconds",
        "counter",
        "Time the job's fetches waited on its IO allocation",
    ),
    "limiter_waiting": (
        "silofs_job_limiter_waiting",
        "gauge",
        "Fetches of the job waiting on its IO allocation now (0 pauses them)",
    ),
    "limiter_oldest_wait_s": (
        "silofs_job_limiter_oldest_wait_seconds",
        "gauge",
        "How long the job's oldest fetch waiting on its IO allocation has waited",
    ),
    "prefetched_bytes": (
        "silofs_job_prefetched_bytes",
        "counter",
        "Bytes fetched ahead of the job's readers by its hints",
    ),
    "prefetch_hit_chunks": (
        "silofs_job_prefetch_hit_chunks",
        "counter",
        "Prefetched chunks the job's readers passed without a miss",
    ),
    "prefetch_missed_chunks": (
        "silofs_job_prefetch_missed_chunks",
        "counter",
        "Prefetched chunks the job's readers still missed (late, or not admitted)",
    ),
}
_WRITER = {
    "admitted_chunks": ("silofs_admitted_chunks", "Chunks admitted into the cache"),
    "admitted_bytes": ("silofs_admitted_bytes", "Bytes admitted into the cache"),
    "rejected_chunks": ("silofs_admission_rejected_chunks", "Offers refused: dataset over quota"),
    "dropped_chunks": (
        "silofs_admission_dropped_chunks",
        "Offers dropped because the admission queue was full",
    ),
    "damaged_chunks": (
        "silofs_admission_damaged_chunks",
        "Offers not admitted: the chunk's LMDB node is damaged (it is read from the store)",
    ),
    "map_full_chunks": (
        "silofs_admission_map_full_chunks",
        "Offers not admitted: their batch hit LMDB's map size",
    ),
    "evicted_bytes": ("silofs_evicted_bytes", "Bytes evicted to enforce quotas"),
    "map_full": ("silofs_lmdb_map_full", "Admission batches that hit LMDB's map size"),
    "failed_batches": (
        "silofs_admission_failed_batches",
        "Admission batches whose write failed (a full disk, an I/O error)",
    ),
}


# Peer traffic (status "cluster"), per member this node asks, per certificate name that
# asks this node, and per dataset: field -> (metric name, help).
_PEER = {
    "requests_out": ("requests_out", "Chunk requests this node sent"),
    "bytes_in": ("bytes_in", "Chunk bytes this node received, verified"),
    "requests_in": ("requests_in", "Chunk requests this node served"),
    "bytes_out": ("bytes_out", "Chunk bytes this node served"),
    "store_fallbacks": ("store_fallbacks", "Chunks read from the store after a failed ask"),
    "wait_s": ("wait_seconds", "Seconds spent waiting on peers' answers"),
}


def _peer_families(cluster: dict[str, Any]) -> Iterator[Metric]:
    """silofs_peer_* (by member), silofs_peer_in_* (by asking certificate) and
    silofs_peer_dataset_* (by dataset), and the members' state."""
    up = GaugeMetricFamily(
        "silofs_peer_member_up", "Whether a cluster member is up (1) or down (0)", labels=["member"]
    )
    for m in cluster["members"]:
        up.add_metric([m["address"]], 1.0 if m["state"] == "up" else 0.0)
    yield up
    yield CounterMetricFamily(
        "silofs_peer_serve_wait_seconds",
        "Seconds answers to members waited on peer_serve_rate",
        value=cluster["serve_wait_s"],
    )
    asking = ("requests_out", "bytes_in", "store_fallbacks", "wait_s")
    rows = (
        # what this node asked of each member, what members asked of it (by the name of
        # their certificate), and both per dataset
        ("silofs_peer", "member", asking, [(m["address"], m) for m in cluster["members"]
                                           if not m["self"]]),
        ("silofs_peer_in", "peer", ("requests_in", "bytes_out"), list(cluster["peers_in"].items())),
        ("silofs_peer_dataset", "dataset", tuple(_PEER), [(d["uri"], d)
                                                          for d in cluster["datasets"]]),
    )  # fmt: skip
    for prefix, label, fields, items in rows:
        for field in fields:
            suffix, help_text = _PEER[field]
            family = CounterMetricFamily(f"{prefix}_{suffix}", help_text, labels=[label])
            for name, row in items:
                family.add_metric([name], row[field])
            yield family
        if prefix == "silofs_peer_in":
            continue
        errors = CounterMetricFamily(
            f"{prefix}_errors", "Failed peer requests, by reason", labels=[label, "reason"]
        )
        for name, row in items:
            for reason, n in sorted(row["errors"].items()):
                errors.add_metric([name, reason], n)
        yield errors
    for key, help_text in (("share", "Cluster share"), ("part", "This node's part of its share")):
        family = GaugeMetricFamily(
            f"silofs_dataset_cluster_{key}_bytes", f"{help_text} of the dataset", labels=["dataset"]
        )
        for d in cluster["datasets"]:
            if d[key] is not None:
                family.add_metric([d["uri"]], d[key])
        yield family


def _family(name: str, kind: str, help_text: str, labels: list[str]) -> Metric:
    if kind == "counter":
        return CounterMetricFamily(name, help_text, labels=labels)
    return GaugeMetricFamily(name, help_text, labels=labels)


class StatusCollector(Collector):
    """Metric families computed from one status view per scrape."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self.status = status

    def collect(self) -> Iterator[Metric]:
        status = self.status()
        node = status["node"]
        yield GaugeMetricFamily(
            "silofs_cache_size_bytes", "Cache budget of the node", value=node["cache_size"]
        )
        yield GaugeMetricFamily(
            "silofs_cached_bytes", "Bytes cached on the node", value=node["cached_bytes"]
        )
        for field, (name, help_text) in _WRITER.items():
            value = node.get("writer", {}).get(field)
            if value is not None:
                yield CounterMetricFamily(name, help_text, value=value)
        yield from self._rows(status["datasets"], _DATASET, "dataset", "uri")
        yield from self._rows(status["jobs"], _JOB, "job", "name")
        if status.get("cluster"):
            yield from _peer_families(status["cluster"])

    @staticmethod
    def _rows(rows: list[dict], spec: dict, label: str, key: str) -> Iterator[Metric]:
        for field, (name, kind, help_text) in spec.items():
            family = _family(name, kind, help_text, [label])
            for row in rows:
                value = row.get(field)
                if value is not None:
                    family.add_metric([str(row[key])], value)
            yield family


class DaemonMetrics:
    """The daemon's registry: the status collector, process metrics, fetch latency."""

    def __init__(self, status: Callable[[], dict[str, Any]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.fetch_seconds = Histogram(
            "silofs_fetch_seconds",
            "Time to fetch one chunk from the store (limiter wait included)",
            ["dataset"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        ProcessCollector(registry=self.registry)
        if status is not None:
            self.watch(status)

    def watch(self, status: Callable[[], dict[str, Any]]) -> None:
        self.registry.register(StatusCollector(status))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def render(status: dict[str, Any]) -> str:
    """The Prometheus text of one status view alone (no process metrics, no histogram)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(lambda: status))
    return generate_latest(registry).decode()


def parse_address(text: str) -> tuple[str, int]:
    """HOST:PORT or :PORT or PORT (host: 127.0.0.1; scrapes stay local unless asked)."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "", text
    host = host.strip("[]") or "127.0.0.1"
    number = int(port) if is_digits(port) else -1
    if not 0 < number < 65536:
        raise UsageError(f"metrics_address must be HOST:PORT, like 127.0.0.1:9464, not {text!r}")
    return host, number


_MAX_REQUEST = 8192


async def open_metrics(address: str) -> list[trio.SocketListener]:
    """The listeners of metrics_address, opened at startup before any task runs, so a
    busy port is one UsageError naming it (inside the daemon's nursery it was a
    traceback of an ExceptionGroup)."""
    host, port = parse_address(address)
    try:
        return await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise UsageError(
            f"cannot listen on metrics_address {address}: {exc.strerror or exc}"
        ) from None


# Scrapes served at once: Prometheus scrapes a target one at a time, so a few are plenty.
# A connection beyond is closed as soon as it is accepted: an unauthenticated flood of
# idle or never-reading connections to metrics_address took every fd the daemon had
# (at NOFILE 1024: 1,024 fds held, accept failing with EMFILE every 0.1 s), where the
# mounts' fetches and the control socket need them. node/service.py's fd headroom
# keeps room for these.
METRICS_CONNECTIONS = 16
# A scrape's request must arrive within this, and its answer leave within it again: a
# client that sends nothing, or never reads, holds its connection no longer.
METRICS_SECONDS = 10.0


async def serve_tcp(
    listeners: list[trio.SocketListener],
    render: Callable[[], bytes],
    task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED,
) -> None:
    """GET /metrics over TCP for Prometheus on `listeners` (open_metrics); anything else
    is 404. One request per connection, METRICS_CONNECTIONS at once; rendering runs in
    the trio loop, where the state it reads lives."""
    active = 0
    throttled = Throttled()

    def warn(message: str) -> None:
        throttled(f"metrics listener: {message}")

    async def handle(stream: trio.SocketStream) -> None:
        data = b""
        with trio.move_on_after(METRICS_SECONDS):
            while b"\r\n\r\n" not in data and len(data) < _MAX_REQUEST:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    return
                data += chunk
        line = data.split(b"\r\n", 1)[0].split()
        if len(line) >= 2 and line[0] in (b"GET", b"HEAD") and line[1] in (b"/metrics", b"/"):
            body, status = render(), b"200 OK"
            ctype = CONTENT_TYPE.encode()
        else:
            body, status, ctype = b"not found: try /metrics\n", b"404 Not Found", b"text/plain"
        head = (
            b"HTTP/1.1 " + status + b"\r\nContent-Type: " + ctype
            + b"\r\nContent-Length: " + str(len(body)).encode()
            + b"\r\nConnection: close\r\n\r\n"
        )  # fmt: skip
        with trio.move_on_after(METRICS_SECONDS):
            await stream.send_all(head + (body if line[:1] != [b"HEAD"] else b""))

    async def serve(stream: trio.SocketStream) -> None:
        nonlocal active
        try:
            await handle(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the scraper left
        except Exception:  # one scrape never ends the listener, nor the daemon
            log.exception("bug: unexpected error answering a scrape")
        finally:
            active -= 1
            await trio.aclose_forcefully(stream)

    def accepted(nursery: trio.Nursery, conn: trio.socket.SocketType, _addr: Any) -> None:
        nonlocal active
        if active >= METRICS_CONNECTIONS:
            conn.close()
            warn(f"{METRICS_CONNECTIONS} scrapes open; closing the connections beyond")
            return
        active += 1
        nursery.start_soon(serve, trio.SocketStream(conn))

    for listener in listeners:
        host, port = listener.socket.getsockname()[:2]
        log.info("metrics on http://%s:%d/metrics", host, port)
    async with trio.open_nursery() as nursery:
        for listener in listeners:
            on_accept = functools.partial(accepted, nursery)
            nursery.start_soon(accept_forever, listener.socket, on_accept, warn)
        task_status.started()
