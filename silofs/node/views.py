"""JSON views of the daemon's state: status, a dataset, a job, a mount.

Owns what GET /v1/status and the other views show and how each figure is derived from
the state records (ratios, rates, where bytes were served from), including a process's
memory as /proc tells it. Read only: never changes the daemon's state and never
decides who may see a view (node/authz.py and the route table do).
"""

from __future__ import annotations

import os
import time
from typing import Any

from silofs import sealed
from silofs.node.daemon import Daemon
from silofs.node.membership import PeerCounters
from silofs.node.state import DatasetState, JobState, MountState
from silofs.records import MountCounters

PAGE_CACHE_NOTE = (
    "reads the kernel page cache serves never reach silofs and are not counted; "
    "bytes from a mount's chunk buffer are hits only if the daemon had the chunk cached"
)


def _served(r: MountCounters) -> dict[str, int]:
    """Bytes read by where they came from (disjoint; they add up to bytes_read)."""
    return {
        "cache": max(0, r.bytes_read - r.buffer_bytes - r.store_bytes),
        "buffer": r.buffer_bytes,
        "store": r.store_bytes,
    }


def _ratio(hit: int, total: int) -> float:
    return hit / total if total else 0.0


def _retries(ds: DatasetState) -> int:
    counters = getattr(ds.backend, "counters", None)  # the local backend never retries
    return counters.retries if counters is not None else 0


def _list_rate(ds: DatasetState) -> float:
    """Objects listed per second while a listing runs (0 otherwise)."""
    if ds.state != "listing" or not ds.list_started:
        return 0.0
    return ds.listed / max(time.monotonic() - ds.list_started, 1e-3)


def _store_count(ds: DatasetState, name: str) -> int:
    """One of a RetryingBackend's StoreCounters (a local directory has none)."""
    counters = getattr(ds.backend, "counters", None)
    return getattr(counters, name, 0) if counters is not None else 0


def dataset_view(d: Daemon, ds: DatasetState) -> dict[str, Any]:
    u = d.usage.get(ds.id)
    return {
        "id": ds.id,
        "name": ds.name,
        "uri": ds.uri.canonical,
        "state": ds.state,
        "error": ds.error or None,
        "listed": ds.listed,
        "list_rate": _list_rate(ds),
        "generation": ds.record.get("gen"),
        "building_gen": ds.building_gen,
        "objects": ds.record.get("objects", 0),
        "size": ds.record.get("size", 0),
        "cached_bytes": u.bytes if u else 0,
        "cached_chunks": u.chunks if u else 0,
        "cache_allocation": d.allocs.cache.get(ds.uri.canonical),
        "admission": d.allocs.mode(ds.uri.canonical),
        "bytes_read": ds.reads.bytes_read,
        "hit_bytes": ds.reads.hit_bytes,
        "hit_ratio": _ratio(ds.reads.hit_bytes, ds.reads.bytes_read),
        "served_bytes": _served(ds.reads),
        "remote_bytes": ds.fetch.remote_bytes,
        "remote_gets": ds.fetch.remote_gets,
        "remote_requests": ds.fetch.remote_requests,
        "corrupt_chunks": ds.fetch.corrupt_chunks + ds.reads.corrupt_chunks,
        # Failed store operations (after retries): chunk GETs, checks, listings; and the
        # retries the backend made (node/backends/base.py retry_call).
        "store_errors": ds.fetch.errors + ds.prepare_errors,
        "store_retries": _retries(ds),
        # Store bodies refused and retried: checksum mismatches, short bodies.
        "store_checksum_errors": _store_count(ds, "checksum_errors"),
        "store_short_reads": _store_count(ds, "short_reads"),
        # Requests the S3 lean path handed to botocore (error answers, transport errors).
        "store_lean_fallbacks": _store_count(ds, "lean_fallbacks"),
        "version_mismatches": ds.fetch.version_mismatches,
        # Refreshes refused: asked less than min_refresh_seconds after the last listing.
        "refreshes_refused": d.catalog.refreshes_refused.get(ds.id, 0),
        "stale_chunks": ds.stale_chunks,  # the first eviction victims marked after a refresh
        "mounts": sum(1 for m in d.mounts.values() if m.dsid == ds.id),
        "warm": d.warms[ds.id].view() if ds.id in d.warms else None,
        # In a cluster: the dataset's share of the cluster's caches and this node's part
        # (null: no share, the shared pool), and its peer traffic (null alone).
        "cluster_share": d.cluster.shares.share(ds.uri.canonical) if d.cluster.active else None,
        "cluster_part": d.cluster.parts().get(ds.uri.canonical),
        "peer": _peer_counters(d, ds.uri.canonical),
    }


def _peer_counters(d: Daemon, uri: str) -> dict[str, Any] | None:
    if not d.cluster.active:
        return None
    c = d.cluster.datasets.get(uri)
    return c.view() if c is not None else PeerCounters().view()


def _cached(d: Daemon, uri: str) -> int:
    """Bytes this node holds of a dataset, open here or only for members."""
    ds = d.cluster.home.dataset(uri)
    u = d.usage.get(ds.id) if ds is not None else None
    return u.bytes if u else 0


def cluster_view(d: Daemon) -> dict[str, Any] | None:
    """The cluster this node is in (GET /v1/cluster, status "cluster"): its members,
    each one's state and peer traffic, this node's serve cap, the cache shares; None
    when the node stands alone."""
    c = d.cluster
    if c.membership is None or c.config is None:
        return None
    now = time.monotonic()
    members = []
    for m in c.membership.members.values():
        members.append(
            {
                "address": m.address,
                "weight": m.weight,
                "self": m.is_self,
                "state": "up" if m.up or m.is_self else "down",
                "down_for_s": round(max(0.0, m.down_until - now), 2) if not m.up else 0.0,
                "failures": m.failures,
                "last_error": m.last_error or None,
                # Its member list as its last ping said, when it differs from this
                # node's (a list pushed to some nodes only); None: the same, or unsaid.
                "other_list": (
                    None
                    if m.list_differs_since is None or m.their_list is None
                    else {"version": m.their_list[0], "members": m.their_list[1]}
                ),
                "connections_opened": c.pools[m.address].opened if m.address in c.pools else 0,
                **m.counters.view(),
            }
        )
    shares = c.shares
    return {
        "name": c.config.name,
        "address": c.membership.self_address,
        "version": c.config.version,
        "peer_timeout_seconds": c.config.peer_timeout_seconds,
        "peer_serve_rate": c.config.peer_serve_rate,
        "serve_wait_s": round(c.home.serve_waited(), 3),
        "keep_peer_copies": c.config.keep_peer_copies,
        "members": members,
        # What members asked of this node, by the name of their certificate. The
        # counter tables are copied first (list(): one C call, no thread runs in it):
        # member connections' threads add to them.
        "peers_in": {name: pc.view() for name, pc in list(c.incoming.items())},
        # Every dataset with peer traffic here or a share: a share set on another
        # member (allocate-cache there) is this node's to hold before it reads a byte,
        # and `cluster status` here showed nothing of it.
        "datasets": [
            {
                "uri": uri,
                "share": shares.share(uri),
                "part": c.parts().get(uri),
                "cached_bytes": _cached(d, uri),
                **pc.view(),
            }
            for uri, pc in sorted(
                {**{u: PeerCounters() for u in shares.shares}, **dict(c.datasets)}.items()
            )
        ],
        "allocations_version": shares.version,
        "shares": dict(shares.shares),
    }


def job_view(d: Daemon, j: JobState) -> dict[str, Any]:
    now = time.monotonic()
    throughput, remote_rate = j.rates(now)
    return {
        "name": j.name,
        # The daemon's CLOCK_MONOTONIC (seconds) when these counters were read, in the
        # same loop step: rates over any two views are exact, however late they arrive
        # (tests/integration/test_allocations.py measures the limiter with it).
        "sampled_at": now,
        "io_allocation": j.limiter.rate,
        "throughput": round(throughput),
        "remote_bytes_per_s": round(remote_rate),
        "epoch": j.epoch,
        "effective_cache": d.effective_cache(j),
        "datasets": sorted(
            {d.datasets[m.dsid].uri.canonical for m in d.mounts.values() if m.job == j.name}
        ),
        "bytes_read": j.reads.bytes_read,
        "hit_ratio": _ratio(j.reads.hit_bytes, j.reads.bytes_read),
        "remote_bytes": j.fetch.remote_bytes,
        "remote_gets": j.fetch.remote_gets,
        "remote_requests": j.fetch.remote_requests,
        "limiter_wait_s": round(j.limiter.waited_seconds, 3),
        "limiter_charged_bytes": j.limiter.charged_bytes,
        # Fetches waiting on the allocation now (readers, read-ahead, warm, prefetch) and
        # how long the oldest has: a pause (0) or a tiny rate shows here, not as silence.
        "limiter_waiting": j.limiter.waiting,
        "limiter_oldest_wait_s": round(j.limiter.oldest_wait(), 3),
        # What the job's scheduler said of it (PUT /v1/jobs/{job}), or null.
        "registration": d.allocs.registrations.get(j.name),
        # Prefetch by hint: bytes fetched ahead of the job's readers, and how many of
        # those chunks its readers then read as hits (or still missed).
        "prefetched_bytes": j.prefetch.bytes,
        "prefetched_chunks": j.prefetch.chunks,
        "prefetch_hit_chunks": j.prefetch.hit_chunks,
        "prefetch_missed_chunks": j.prefetch.missed_chunks,
    }


def process_memory(pid: int) -> dict[str, int] | None:
    """A process's resident memory split as `top` does not: anon_bytes (RssAnon, what it
    allocated itself), file_bytes (RssFile: for a mount process mostly the pages of
    the LMDB env it has mapped, shared with every other mount and the page cache, and
    reclaimable) and shmem_bytes (RssShmem: for a mount process the daemon's sealed chunk
    files it maps, silofs/sealed.py, at most about its chunk buffer; not reclaimable
    while mapped, and charged to the daemon, which made them), summed with its
    children's (a mount's serving processes with --serve-processes; a page mapped by
    several of them counts in each, as in `top`).
    None if it has gone or /proc is unreadable."""
    out = _rss(pid)
    if out is None:
        return None
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except (OSError, ValueError):
        children = []
    for child in children[:64]:  # bounded: a mount has at most 16
        more = _rss(child)
        if more is not None:
            out = {k: v + more[k] for k, v in out.items()}
    return out


def _rss(pid: int) -> dict[str, int] | None:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name = _RSS_FIELDS.get(line.split(":", 1)[0])
                if name is not None:
                    out[name] = int(line.split()[1]) << 10
    except (OSError, ValueError):
        return None
    return out if len(out) == len(_RSS_FIELDS) else None


_RSS_FIELDS = {"RssAnon": "anon_bytes", "RssFile": "file_bytes", "RssShmem": "shmem_bytes"}


def mount_view(d: Daemon, m: MountState) -> dict[str, Any]:
    r = m.reported
    return {
        "id": m.id,
        "job": m.job,
        "dataset": d.datasets[m.dsid].uri.canonical,
        "mountpoint": m.mountpoint,
        "pid": m.pid,
        "chunk_size": m.chunk_size,
        "bytes_read": r.bytes_read,
        "hits": r.hits,
        "misses": r.misses,
        "hit_bytes": r.hit_bytes,
        "hit_ratio": _ratio(r.hit_bytes, r.bytes_read),
        "served_bytes": _served(r),
        "remote_bytes": m.fetch.remote_bytes,
        "remote_gets": m.fetch.remote_gets,
        "remote_requests": m.fetch.remote_requests,
        "corrupt_chunks": r.corrupt_chunks,
        # Reads that waited and ended with EINTR: their process was gone or told to stop.
        "interrupted_reads": r.interrupted_reads,
        # The listing generation it said it serves and those its open handles need: a
        # new listing keeps them (node/datasets.py served_generations).
        "generation": m.gen,
        "held_generations": sorted(m.held),
        "memory": process_memory(m.pid),
        "prefetch": d.prefetch.hints[m.id].view() if m.id in d.prefetch.hints else None,
    }


def status_view(d: Daemon) -> dict[str, Any]:
    w = d.writer.stats
    return {
        "node": {
            "pid": os.getpid(),
            "socket": d.settings.socket,
            "cache_dir": d.settings.cache_dir,
            # true once the cache dir was removed under the daemon (watch_cache_dir)
            "cache_removed": d.cache_removed,
            "cache_size": d.cache_size,
            "cached_bytes": sum(u.bytes for u in d.usage.values()),
            "chunk_size": d.settings.chunk_size,
            "uptime_s": round(time.monotonic() - d.started, 1),
            "started_by": d.origin.get("started_by", "manual"),
            "started_by_uid": d.origin.get("uid", os.getuid()),
            "parent_pid": d.origin.get("parent_pid"),
            "idle_exit_seconds": d.origin.get("idle_exit_seconds"),
            "credentials_env": d.credentials,
            "note": PAGE_CACHE_NOTE,
            "writer": {**vars(w), "pending_chunks": d.writer.pending_chunks()},
            # Streamed chunks the daemon holds in sealed memory files (at most "max");
            # the mounts' mappings of them are each mount's memory.shmem_bytes.
            "sealed_chunks": sealed.live(),
        },
        "datasets": [dataset_view(d, ds) for ds in d.datasets.values()],
        "jobs": [job_view(d, j) for j in d.jobs.values()],
        "mounts": [mount_view(d, m) for m in d.mounts.values()],
        "cluster": cluster_view(d),
        "waiting_allocations": waiting_allocations(d),
    }


def waiting_allocations(d: Daemon) -> dict[str, dict[str, Any]]:
    """Cache allocations and admission modes set for datasets this node has no row of
    (`allocate-cache --create`, a controller's push before the mount, a row forgotten or
    never opened since a restart): kept for when the dataset is opened, and counted in
    the sum a later allocate-cache is checked against, so status shows them (without
    them a refusal named a total no row added up to)."""
    rows = {ds.uri.canonical for ds in d.datasets.values()}
    return {
        "cache": {u: n for u, n in sorted(d.allocs.cache.items()) if u not in rows},
        "admission": {u: m for u, m in sorted(d.allocs.modes.items()) if u not in rows},
    }
