"""The daemon's HTTP API: routes, request validation, and JSON views of daemon state.

Owns the versioned paths under /v1, what each accepts and answers, and who may call it
(promise 6: changes only from root or the admin group; anyone may read status). Every
malformed request gets a 4xx JSON error and changes nothing. Never holds state of its
own: it reads and calls the Daemon.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from ..daemon import Daemon, DatasetState, JobState, MountCounters, MountState
from ..errors import BackendError, NotFoundError, ObjectChangedError, UsageError
from .http import HTTPError, Request, Response, Router, json_response

log = logging.getLogger(__name__)

_MAX_NAME = 1024


def _ratio(hit: int, total: int) -> float:
    return hit / total if total else 0.0


def dataset_view(d: Daemon, ds: DatasetState) -> dict[str, Any]:
    u = d.usage.get(ds.id)
    return {
        "id": ds.id,
        "name": ds.name,
        "uri": ds.uri.canonical,
        "state": ds.state,
        "error": ds.error or None,
        "listed": ds.listed,
        "objects": ds.record.get("objects", 0),
        "size": ds.record.get("size", 0),
        "cached_bytes": u.bytes if u else 0,
        "cached_chunks": u.chunks if u else 0,
        "cache_allocation": d.allocations.get(ds.uri.canonical),
        "bytes_read": ds.reads.bytes_read,
        "hit_bytes": ds.reads.hit_bytes,
        "hit_ratio": _ratio(ds.reads.hit_bytes, ds.reads.bytes_read),
        "remote_bytes": ds.fetch.remote_bytes,
        "remote_gets": ds.fetch.remote_gets,
        "corrupt_chunks": ds.fetch.corrupt_chunks + ds.reads.corrupt_chunks,
        "mounts": sum(1 for m in d.mounts.values() if m.dsid == ds.id),
    }


def job_view(d: Daemon, j: JobState) -> dict[str, Any]:
    return {
        "name": j.name,
        "io_allocation": j.limiter.rate,
        "datasets": sorted(
            {d.datasets[m.dsid].uri.canonical for m in d.mounts.values() if m.job == j.name}
        ),
        "bytes_read": j.reads.bytes_read,
        "hit_ratio": _ratio(j.reads.hit_bytes, j.reads.bytes_read),
        "remote_bytes": j.fetch.remote_bytes,
        "remote_gets": j.fetch.remote_gets,
        "limiter_wait_s": round(j.limiter.waited_seconds, 3),
    }


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
        "remote_bytes": m.fetch.remote_bytes,
        "remote_gets": m.fetch.remote_gets,
        "corrupt_chunks": r.corrupt_chunks,
    }


def status_view(d: Daemon) -> dict[str, Any]:
    w = d.writer.stats
    return {
        "node": {
            "pid": os.getpid(),
            "socket": d.settings.socket,
            "cache_dir": d.settings.cache_dir,
            "cache_size": d.cache_size,
            "cached_bytes": sum(u.bytes for u in d.usage.values()),
            "chunk_size": d.settings.chunk_size,
            "uptime_s": round(time.time() - d.started, 1),
            "writer": vars(w).copy(),
        },
        "datasets": [dataset_view(d, ds) for ds in d.datasets.values()],
        "jobs": [job_view(d, j) for j in d.jobs.values()],
        "mounts": [mount_view(d, m) for m in d.mounts.values()],
    }


# -- request validation --------------------------------------------------------------
def _field(body: dict, name: str, kind: type, *, required: bool = True) -> Any:
    value = body.get(name)
    if value is None:
        if required:
            raise HTTPError(400, f"missing field {name!r}")
        return None
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise HTTPError(400, f"field {name!r} must be an integer")
    if kind is str and (not isinstance(value, str) or len(value) > _MAX_NAME or not value):
        raise HTTPError(400, f"field {name!r} must be a non-empty string")
    if kind is bool and not isinstance(value, bool):
        raise HTTPError(400, f"field {name!r} must be true or false")
    if kind is dict and not isinstance(value, dict):
        raise HTTPError(400, f"field {name!r} must be an object")
    return value


def _dataset(d: Daemon, name: str) -> DatasetState:
    ds = d.find_dataset(name)
    if ds is None:
        raise HTTPError(404, f"no dataset {name!r} on this node")
    return ds


def _mount(d: Daemon, req: Request, mount_id: str) -> MountState:
    m = d.mounts.get(mount_id)
    if m is None:
        raise HTTPError(404, f"no mount {mount_id!r} (the daemon restarted?)")
    if req.peer.uid not in (0, m.uid):
        raise HTTPError(403, "this mount belongs to another user")
    return m


def _backend_status(exc: BackendError) -> int:
    if isinstance(exc, ObjectChangedError):
        return 409
    if isinstance(exc, NotFoundError):
        return 404
    return 502


def build_router(d: Daemon) -> Router:
    r = Router()

    async def status(req: Request) -> Response:
        return json_response(status_view(d))

    async def open_dataset(req: Request) -> Response:
        body = req.json()
        uri = _field(body, "uri", str)
        refresh = _field(body, "refresh", bool, required=False) or False
        endpoint_url = _field(body, "endpoint_url", str, required=False)
        try:
            ds = await d.open_dataset(uri, refresh, endpoint_url)
        except UsageError as exc:
            raise HTTPError(400, str(exc)) from None
        return json_response(dataset_view(d, ds))

    async def get_dataset(req: Request, name: str) -> Response:
        return json_response(dataset_view(d, _dataset(d, name)))

    async def add_mount(req: Request) -> Response:
        body = req.json()
        ds = _dataset(d, str(_field(body, "dataset", int)))
        chunk_size = _field(body, "chunk_size", int, required=False)
        if chunk_size is not None and not (64 << 10) <= chunk_size <= (64 << 20):
            raise HTTPError(400, "chunk_size must be between 64KiB and 64MiB")
        io_limit = _field(body, "io_limit", int, required=False)
        try:
            m = d.register_mount(
                ds,
                _field(body, "job", str),
                _field(body, "mountpoint", str),
                req.peer.pid,
                req.peer.uid,
                chunk_size,
                io_limit,
            )
        except UsageError as exc:
            raise HTTPError(409, str(exc)) from None
        return json_response(
            {
                "id": m.id,
                "chunk_size": m.chunk_size,
                "dataset": ds.id,
                "cache_dir": d.settings.cache_dir,
                "map_size": d.map_size,
            },
            status=201,
        )

    async def del_mount(req: Request, mount_id: str) -> Response:
        _mount(d, req, mount_id)
        d.unregister_mount(mount_id)
        return json_response({"deleted": mount_id})

    async def mount_stats(req: Request, mount_id: str) -> Response:
        m = _mount(d, req, mount_id)
        body = req.json()
        counters = MountCounters(**{k: _field(body, k, int) for k in vars(MountCounters())})
        d.report(m, counters)
        return json_response({"ok": True})

    async def get_chunk(req: Request) -> Response:
        m = _mount(d, req, req.query.get("mount", ""))
        key = req.query.get("key", "")
        try:
            index = int(req.query.get("index", ""))
        except ValueError:
            raise HTTPError(400, "index must be an integer") from None
        try:
            data, source = await d.get_chunk(m, key, index, req.query.get("refetch") == "1")
        except UsageError as exc:
            raise HTTPError(404, str(exc)) from None
        except BackendError as exc:
            raise HTTPError(_backend_status(exc), str(exc)) from None
        return Response(200, data, "application/octet-stream", {"x-silofs-source": source})

    async def metrics(req: Request) -> Response:
        from ..metrics import render

        return Response(
            200, render(status_view(d)).encode(), "text/plain; version=0.0.4; charset=utf-8"
        )

    r.add("GET", "/v1/status", status)
    r.add("POST", "/v1/datasets", open_dataset)
    r.add("GET", "/v1/datasets/{name}", get_dataset)
    r.add("POST", "/v1/mounts", add_mount)
    r.add("DELETE", "/v1/mounts/{mount_id}", del_mount)
    r.add("PUT", "/v1/mounts/{mount_id}/stats", mount_stats)
    r.add("GET", "/v1/chunks", get_chunk)
    r.add("GET", "/metrics", metrics)
    return r
