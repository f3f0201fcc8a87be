"""Prometheus text exposition of the daemon's status.

Owns metric names, types and labels. Renders from the status view (a plain dict), so
metrics and `silofs-ctl status` can never disagree. Never keeps counters of its own.
"""

from __future__ import annotations

from typing import Any

_DATASET = {
    "size": ("silofs_dataset_size_bytes", "gauge", "Bytes in the dataset listing"),
    "cache_allocation": (
        "silofs_dataset_cache_allocation_bytes",
        "gauge",
        "Cache allocated to the dataset (absent: shared pool)",
    ),
    "objects": ("silofs_dataset_objects", "gauge", "Objects in the dataset listing"),
    "cached_bytes": ("silofs_dataset_cached_bytes", "gauge", "Bytes cached for the dataset"),
    "bytes_read": ("silofs_dataset_read_bytes_total", "counter", "Bytes read through mounts"),
    "hit_bytes": ("silofs_dataset_hit_bytes_total", "counter", "Bytes served from cache"),
    "remote_bytes": ("silofs_dataset_remote_bytes_total", "counter", "Bytes fetched remotely"),
    "corrupt_chunks": (
        "silofs_dataset_corrupt_chunks_total",
        "counter",
        "Cached chunks that failed verification",
    ),
    "store_errors": (
        "silofs_dataset_store_errors_total",
        "counter",
        "Store operations that failed after their retries (checks, listings, GETs)",
    ),
    "store_retries": (
        "silofs_dataset_store_retries_total",
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
    "version_mismatches": (
        "silofs_dataset_version_mismatches_total",
        "counter",
        "Chunk requests refused: the mount listed another version of the object",
    ),
}
_JOB = {
    "bytes_read": ("silofs_job_read_bytes_total", "counter", "Bytes read by the job"),
    "remote_bytes": ("silofs_job_remote_bytes_total", "counter", "Remote bytes of the job"),
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
        "silofs_job_limiter_wait_seconds_total",
        "counter",
        "Time the job's fetches waited on its IO allocation",
    ),
}


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _family(lines: list[str], rows: list[dict[str, Any]], spec: dict, label: str, key: str) -> None:
    for field, (name, kind, help_text) in spec.items():
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for row in rows:
            value = row.get(field)
            if value is not None:
                lines.append(f'{name}{{{label}="{_esc(str(row[key]))}"}} {value}')


def render(status: dict[str, Any]) -> str:
    node = status["node"]
    lines = [
        "# HELP silofs_cache_size_bytes Cache budget of the node",
        "# TYPE silofs_cache_size_bytes gauge",
        f"silofs_cache_size_bytes {node['cache_size']}",
        "# HELP silofs_cached_bytes Bytes cached on the node",
        "# TYPE silofs_cached_bytes gauge",
        f"silofs_cached_bytes {node['cached_bytes']}",
    ]
    _family(lines, status["datasets"], _DATASET, "dataset", "uri")
    _family(lines, status["jobs"], _JOB, "job", "name")
    return "\n".join(lines) + "\n"
