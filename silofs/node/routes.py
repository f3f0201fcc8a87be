"""The daemon's HTTP API: routes, request validation, and JSON views of daemon state.

Owns the versioned paths under /v1, what each accepts and answers, and who may call it
(docs/SECURITY.md: allocations and store options only from root or the admin group; a
peer opens, mounts and reads only what it could read itself, holds its own jobs, and
stays within its per-uid limits; anyone may read status). Every malformed request gets
a 4xx JSON error and changes nothing. Never holds state of its own: it reads and calls
the Daemon.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from silofs.cache.format import MAX_SPAN_CHUNKS
from silofs.config import STORE_OPTIONS
from silofs.control.peer import Peer, peer_groups
from silofs.control.router import HTTPError, Request, Response, Router, json_response
from silofs.errors import (
    BackendError,
    NotFoundError,
    ObjectChangedError,
    UsageError,
    VersionMismatchError,
)
from silofs.node.authz import (
    check_dataset_access,
    check_job,
    check_limit,
    check_object_access,
    check_store_options,
    own_mount,
    refuse,
    require_admin,
    trusted,
)
from silofs.node.daemon import Daemon
from silofs.node.prefetch import MAX_HINT_PATH_LEN, MAX_HINT_PATHS
from silofs.node.state import DatasetState, MountState
from silofs.node.views import dataset_view, job_view, status_view
from silofs.records import MountCounters, job_name_error
from silofs.units import parse_rate, parse_size
from silofs.uri import parse_uri

log = logging.getLogger(__name__)

_MAX_NAME = 1024
_MOUNT_ID = re.compile(r"[0-9a-f]{8,32}")  # a mount process chooses its own id
# Jobs with neither a mount nor an IO allocation kept for status; older ones are
# forgotten, so cycling job names cannot grow the daemon without bound.
_IDLE_JOBS_KEPT = 1024


_NEWER_COUNTERS = {"buffer_bytes", "store_bytes"}


# A chunk offered by a mount (PUT /v1/mounts/{id}/offer) is its only large request body.
MAX_OFFER_BODY = (64 << 20) + 4096


def body_limit(method: str, path: str, peer: Peer) -> int:
    """The control server's body limit, decided before the body is read: 1 MiB, or a
    chunk for an offer from a peer that may offer (others get 403 after 1 MiB at most)."""
    offer = method == "PUT" and path.startswith("/v1/mounts/") and path.endswith("/offer")
    if offer and peer.uid in (0, os.getuid()):
        return MAX_OFFER_BODY
    return 1 << 20


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


async def _initial_settings(
    d: Daemon, req: Request, ds: DatasetState, job: str, io_limit: int | None, mode: str | None
) -> None:
    """A mount's --io-limit / --admission apply only where no allocation exists yet: the
    controller's decisions win over a mount's defaults. They are allocations, so they
    are taken only from root or the admin group."""
    if (io_limit is not None or mode is not None) and not trusted(d, req):
        log.warning(
            "ignoring --io-limit/--admission of a mount by uid %d: allocations "
            "are changed by root or the admin group",
            req.peer.uid,
        )
        return
    if io_limit is not None and job not in d.io_allocations:
        await d.set_io_allocation(job, io_limit)
    if mode is not None and mode != d.modes.get(ds.uri.canonical, "uniform"):
        if ds.uri.canonical in d.modes:
            log.info(
                "mount asked for %s admission of %s; keeping %s",
                mode,
                ds.uri.canonical,
                d.modes[ds.uri.canonical],
            )
            return
        try:
            await d.set_mode(ds.uri.canonical, mode)
        except UsageError as exc:
            raise HTTPError(400, str(exc)) from None


def _backend_status(exc: BackendError) -> int:
    if isinstance(exc, ObjectChangedError):
        return 409
    if isinstance(exc, NotFoundError):
        return 404
    return 502


def _dataset_uri(d: Daemon, name: str) -> str:
    """Canonical URI for an allocation: a known dataset's name, or any dataset URI (an
    allocation for a dataset not mounted yet is kept until it appears)."""
    ds = d.find_dataset(name)
    if ds is not None:
        return ds.uri.canonical
    if "://" in name or name.startswith("/"):
        try:
            return parse_uri(name).canonical
        except UsageError as exc:
            raise HTTPError(400, str(exc)) from None
    raise HTTPError(
        404, f"no dataset named {name!r} on this node: use its URI to allocate before it is mounted"
    )


def _job_name(job: str) -> str:
    why = job_name_error(job)
    if why is not None:
        raise HTTPError(400, why)
    return job


def _parse_amount(body: dict, name: str, parse: Any, *, allow_null: bool) -> int | None:
    if name not in body:
        raise HTTPError(400, f"missing field {name!r}")
    value = body[name]
    if value is None and allow_null:
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise HTTPError(400, f"field {name!r} must be an integer or a string with units")
    try:
        parsed = parse(value)
    except UsageError as exc:
        raise HTTPError(400, str(exc)) from None
    except ValueError:  # more digits than int() converts (4300)
        raise HTTPError(400, f"field {name!r} is not a number silofs can use") from None
    if parsed is None and not allow_null:
        raise HTTPError(400, f"field {name!r} must be a size")
    return parsed


def _allocation_routes(r: Router, d: Daemon) -> None:
    async def get_cache(req: Request, name: str) -> Response:
        uri = _dataset_uri(d, name)
        return json_response({"dataset": uri, "bytes": d.allocations.get(uri)})

    async def put_cache(req: Request, name: str) -> Response:
        require_admin(d, req)
        body = req.json()
        uri = _dataset_uri(d, name)
        size = _parse_amount(body, "bytes", parse_size, allow_null=True)
        try:
            await d.set_cache_allocation(uri, size)
        except UsageError as exc:
            raise HTTPError(409, str(exc)) from None
        return json_response({"dataset": uri, "bytes": size})

    async def get_io(req: Request, job: str) -> Response:
        job = _job_name(job)
        return json_response({"job": job, "bytes_per_s": d.io_allocations.get(job)})

    async def put_io(req: Request, job: str) -> Response:
        require_admin(d, req)
        body = req.json()
        job = _job_name(job)
        rate = _parse_amount(body, "bytes_per_s", parse_rate, allow_null=True)
        await d.set_io_allocation(job, rate)
        return json_response({"job": job, "bytes_per_s": rate})

    async def del_io(req: Request, job: str) -> Response:
        require_admin(d, req)
        job = _job_name(job)
        if not await d.clear_io_allocation(job):
            raise HTTPError(404, f"job {job!r} has no remote IO allocation on this node")
        return json_response({"job": job, "bytes_per_s": None, "cleared": True})

    async def get_mode(req: Request, name: str) -> Response:
        uri = _dataset_uri(d, name)
        return json_response({"dataset": uri, "mode": d.modes.get(uri, "uniform")})

    async def put_mode(req: Request, name: str) -> Response:
        require_admin(d, req)
        mode = _field(req.json(), "mode", str)
        uri = _dataset_uri(d, name)
        try:
            await d.set_mode(uri, mode)
        except UsageError as exc:
            raise HTTPError(400, str(exc)) from None
        return json_response({"dataset": uri, "mode": mode})

    async def allocations(req: Request) -> Response:
        return json_response(
            {
                "cache": d.allocations,
                "io": d.io_allocations,
                "admission": d.modes,
                "cache_size": d.cache_size,
            }
        )

    r.add("GET", "/v1/datasets/{name}/cache", get_cache)
    r.add("PUT", "/v1/datasets/{name}/cache", put_cache)
    r.add("GET", "/v1/datasets/{name}/admission", get_mode)
    r.add("PUT", "/v1/datasets/{name}/admission", put_mode)
    r.add("GET", "/v1/jobs/{job}/io", get_io)
    r.add("PUT", "/v1/jobs/{job}/io", put_io)
    r.add("DELETE", "/v1/jobs/{job}/io", del_io)
    r.add("GET", "/v1/allocations", allocations)


def build_router(d: Daemon) -> Router:
    r = Router()
    _allocation_routes(r, d)

    async def status(req: Request) -> Response:
        return json_response(status_view(d))

    async def open_dataset(req: Request) -> Response:
        body = req.json()
        uri = _field(body, "uri", str)
        refresh = _field(body, "refresh", bool, required=False) or False
        endpoint_url = _field(body, "endpoint_url", str, required=False)
        check_store_options(d, req, body)
        options = _store_options(body)
        if "://" not in uri and not uri.startswith("/"):
            # parse_uri would resolve it against the daemon's cwd (or its ~), which is
            # not the caller's: the client resolves relative paths (silofs mount does).
            raise HTTPError(
                400,
                f"dataset path {uri!r} is relative: send an absolute path or file:///... "
                "(the daemon does not know the caller's working directory)",
            )
        try:
            parsed = parse_uri(uri)
        except UsageError as exc:
            raise HTTPError(400, str(exc)) from None
        await check_dataset_access(d, req, parsed)
        if d.find_dataset(parsed.canonical) is None and not trusted(d, req):
            held, _, _ = d.held_by(req.peer.uid)
            if held >= d.settings.max_datasets_per_uid and d.forget_idle_dataset(req.peer.uid):
                held -= 1
            check_limit(req, "datasets", held, d.settings.max_datasets_per_uid)
        try:
            ds = await d.open_dataset(uri, refresh, endpoint_url, options)
        except UsageError as exc:
            raise HTTPError(400, str(exc)) from None
        d.opened_by.setdefault(ds.id, req.peer.uid)
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
        if io_limit is not None:
            io_limit = _parse_amount(body, "io_limit", parse_rate, allow_null=True)
        mode = _field(body, "admission", str, required=False)
        job = _job_name(_field(body, "job", str))
        mount_id = _field(body, "id", str, required=False)
        if mount_id is not None and not _MOUNT_ID.fullmatch(mount_id):
            raise HTTPError(400, "field 'id' must be 8-32 lowercase hex digits")
        mountpoint = _field(body, "mountpoint", str)
        await check_dataset_access(d, req, ds.uri, mount=ds)
        known = d.mounts.get(mount_id) if mount_id else None
        check_job(d, req, job, again=known is not None and known.uid == req.peer.uid)
        await _initial_settings(d, req, ds, job, io_limit, mode)
        try:
            m = d.register_mount(
                ds,
                job,
                mountpoint,
                req.peer.pid,
                req.peer.uid,
                chunk_size,
                mount_id=mount_id,
                background=body.get("background") is True,
            )
        except UsageError as exc:
            raise HTTPError(409, str(exc)) from None
        d.forget_idle_jobs(keep=_IDLE_JOBS_KEPT)
        return json_response(
            {
                "id": m.id,
                "chunk_size": m.chunk_size,
                "dataset": ds.id,
                "cache_dir": d.settings.cache_dir,
                "map_size": d.map_size,
                # A mount serves the listing being written only if there is no complete
                # one (a first listing, --list-in-background).
                "building_gen": None
                if d.store.current_generation(ds.id) is not None
                else ds.building_gen,
                "admission": d.modes.get(ds.uri.canonical, "uniform"),
            },
            status=201,
        )

    async def del_mount(req: Request, mount_id: str) -> Response:
        own_mount(d, req, mount_id)
        d.unregister_mount(mount_id)
        return json_response({"deleted": mount_id})

    async def mount_stats(req: Request, mount_id: str) -> Response:
        m = own_mount(d, req, mount_id)
        body = req.json()
        # buffer_bytes and store_bytes are newer than the rest: a mount started before
        # the daemon was upgraded does not send them.
        counters = MountCounters(
            **{
                k: _field(body, k, int, required=k not in _NEWER_COUNTERS) or 0
                for k in vars(MountCounters())
            }
        )
        _field(body, "epoch", int, required=False)  # sent by older mounts; the daemon counts
        touched = body.get("touched") or []
        if not isinstance(touched, list) or len(touched) > 65536:
            raise HTTPError(400, "field 'touched' must be a list of chunk keys")
        try:
            keys = [bytes.fromhex(k) for k in touched if isinstance(k, str) and len(k) == 32]
        except ValueError:
            raise HTTPError(400, "field 'touched' must hold hex chunk keys") from None
        await d.report(m, counters, keys)
        return json_response(
            {"ok": True, "admission": d.modes.get(d.datasets[m.dsid].uri.canonical, "uniform")}
        )

    async def get_chunk(req: Request) -> Response:
        m = own_mount(d, req, req.query.get("mount", ""))
        key = req.query.get("key", "")
        try:
            index = int(req.query.get("index", ""))
        except ValueError:
            raise HTTPError(400, "index must be an integer") from None
        span = _span(req.query.get("span"), index)
        await check_object_access(d, req, m, key)
        try:
            data, source = await d.get_chunk(
                m, key, index, req.query.get("refetch") == "1", req.query.get("version"), span
            )
        except VersionMismatchError as exc:
            raise HTTPError(409, str(exc)) from None
        except UsageError as exc:
            raise HTTPError(404, str(exc)) from None
        except BackendError as exc:
            raise HTTPError(_backend_status(exc), str(exc)) from None
        return Response(200, data, "application/octet-stream", {"x-silofs-source": source})

    async def offer(req: Request, mount_id: str) -> Response:
        m = own_mount(d, req, mount_id)
        # The bytes come from the mount, and other users' mounts may read them once
        # admitted: only a peer that could write the cache anyway may offer (promise 3).
        if req.peer.uid not in (0, os.getuid()):
            raise HTTPError(403, "only root (or the daemon's user) may offer chunks")
        key = req.query.get("key", "")
        try:
            index = int(req.query.get("index", ""))
        except ValueError:
            raise HTTPError(400, "index must be an integer") from None
        content_id = req.query.get("content_id", "")
        try:
            outcome = d.offer_chunk(m, key, index, content_id, req.body)
        except UsageError as exc:
            raise HTTPError(409, str(exc)) from None
        return json_response({"chunk": outcome})

    async def metrics(req: Request) -> Response:
        from silofs.node.metrics import CONTENT_TYPE

        return Response(200, d.metrics.render(), CONTENT_TYPE)

    r.add("GET", "/v1/status", status)
    r.add("POST", "/v1/datasets", open_dataset)
    r.add("GET", "/v1/datasets/{name}", get_dataset)
    r.add("POST", "/v1/mounts", add_mount)
    r.add("DELETE", "/v1/mounts/{mount_id}", del_mount)
    r.add("PUT", "/v1/mounts/{mount_id}/stats", mount_stats)
    r.add("GET", "/v1/chunks", get_chunk)
    r.add("PUT", "/v1/mounts/{mount_id}/offer", offer)
    r.add("GET", "/metrics", metrics)
    _warm_routes(r, d)
    _forget_routes(r, d)
    _registration_routes(r, d)
    _hint_routes(r, d)
    return r


# -- per-dataset store options (silofs mount --region/--profile/...) --------------------
def _span(text: str | None, index: int) -> tuple[int, int] | None:
    """`span=FIRST-LAST`: the read-ahead span a chunk request belongs to (inclusive
    chunk indices around `index`, at most MAX_SPAN_CHUNKS). The daemon clamps it to the
    object and to MAX_SPAN_BYTES, and charges every chunk it fetches to the peer's job."""
    if text is None:
        return None
    first_text, sep, last_text = text.partition("-")
    try:
        first, last = int(first_text), int(last_text)
    except ValueError:
        raise HTTPError(400, "span must be FIRST-LAST chunk indices") from None
    if not sep or not 0 <= first <= index <= last or last - first >= MAX_SPAN_CHUNKS:
        raise HTTPError(
            400, f"span must be FIRST-LAST around index {index}, at most {MAX_SPAN_CHUNKS} chunks"
        )
    return first, last


def _store_options(body: dict) -> dict[str, str]:
    """The "options" of POST /v1/datasets: only config.STORE_OPTIONS, short scalars."""
    options = _field(body, "options", dict, required=False) or {}
    out: dict[str, str] = {}
    for key, value in options.items():
        if key not in STORE_OPTIONS:
            raise HTTPError(
                400, f"unknown store option {key!r} (known: {', '.join(STORE_OPTIONS)})"
            )
        if isinstance(value, bool):
            value = "true" if value else "false"
        if not isinstance(value, str) or not 0 < len(value) <= 256:
            raise HTTPError(400, f"store option {key!r} must be a short string or a boolean")
        out[key] = value
    return out


# -- warm (silofs warm) -----------------------------------------------------------------
# Its own section: other route work rebases around it.
_MAX_GLOBS = 64


def _warm_routes(r: Router, d: Daemon) -> None:
    def warm_of(req: Request, name: str) -> tuple[DatasetState, Any]:
        ds = _dataset(d, name)
        w = d.warms.get(ds.id)
        if w is None:
            raise HTTPError(404, f"no warm of {ds.uri.canonical} since the daemon started")
        return ds, w

    async def start(req: Request, name: str) -> Response:
        ds = _dataset(d, name)
        body = req.json()
        job = _job_name(_field(body, "job", str))
        paths = body.get("paths") or []
        if (
            not isinstance(paths, list)
            or len(paths) > _MAX_GLOBS
            or not all(isinstance(p, str) and 0 < len(p) <= _MAX_NAME for p in paths)
        ):
            raise HTTPError(400, f"field 'paths' must be a list of up to {_MAX_GLOBS} globs")
        chunk_size = _field(body, "chunk_size", int, required=False)
        if chunk_size is not None and not (64 << 10) <= chunk_size <= (64 << 20):
            raise HTTPError(400, "chunk_size must be between 64KiB and 64MiB")
        # A warm spends the job's remote IO and fills the cache with the dataset's
        # bytes: an untrusted peer may charge only a job it may hold (as for a mount)
        # and warm only a dataset it may mount; of a local one, only the files it could
        # read itself are fetched (node/warm.py), so it cannot pull a 0600 file of
        # another user into the cache.
        await check_dataset_access(d, req, ds.uri, mount=ds)
        check_job(d, req, job, mount=False)
        reader = None if trusted(d, req) else (req.peer.uid, peer_groups(req.peer))
        try:
            w = d.start_warm(ds, job, paths, chunk_size, req.peer.uid, reader=reader)
        except UsageError as exc:
            raise HTTPError(409, str(exc)) from None
        return json_response({"dataset": ds.uri.canonical, "id": ds.id, **w.view()}, status=202)

    async def get(req: Request, name: str) -> Response:
        ds, w = warm_of(req, name)
        return json_response({"dataset": ds.uri.canonical, "id": ds.id, **w.view()})

    async def cancel(req: Request, name: str) -> Response:
        ds, w = warm_of(req, name)
        if req.peer.uid != w.uid and not trusted(d, req):
            raise refuse(req, 403, f"this warm was started by uid {w.uid}")
        w.scope.cancel()
        return json_response({"dataset": ds.uri.canonical, "id": ds.id, **w.view()})

    r.add("POST", "/v1/datasets/{name}/warm", start)
    r.add("GET", "/v1/datasets/{name}/warm", get)
    r.add("DELETE", "/v1/datasets/{name}/warm", cancel)


# -- forget (silofs-ctl forget) ---------------------------------------------------------
def _forget_routes(r: Router, d: Daemon) -> None:
    async def forget_dataset(req: Request, name: str) -> Response:
        require_admin(d, req)
        ds = _dataset(d, name)
        try:
            await d.forget_dataset(ds)
        except UsageError as exc:
            raise HTTPError(409, str(exc)) from None
        return json_response({"forgot": "dataset", "dataset": ds.uri.canonical})

    async def forget_job(req: Request, job: str) -> Response:
        require_admin(d, req)
        job = _job_name(job)
        if job not in d.jobs and job not in d.io_allocations:
            raise HTTPError(404, f"no job {job!r} on this node")
        try:
            await d.forget_job(job)
        except UsageError as exc:
            raise HTTPError(409, str(exc)) from None
        return json_response({"forgot": "job", "job": job})

    r.add("DELETE", "/v1/datasets/{name}", forget_dataset)
    r.add("DELETE", "/v1/jobs/{job}", forget_job)


# -- job registrations (a cluster scheduler's prolog; configs/slurm/) -------------------
_REGISTRATION_KEYS = {
    "gpus",
    "ideal_io",
    "epochs",
    "datasets",
    "scheduler",
    "scheduler_id",
    "nodes",
}
_MAX_GPUS = 1 << 16
_MAX_DATASETS = 64
_MAX_NODES = 4096
_MAX_EPOCHS = 1e9


def _registration(body: dict) -> dict[str, Any]:
    """A job registration, checked: what the controller may plan with (GPUs, f*,
    epochs, datasets as canonical URIs) and where it comes from (scheduler, its job id,
    the job's nodes). HTTPError(400) naming the first bad field."""
    unknown = sorted(set(body) - _REGISTRATION_KEYS)
    if unknown:
        raise HTTPError(400, f"unknown field {unknown[0]!r} in a job registration")
    gpus = _field(body, "gpus", int)
    if not 0 <= gpus <= _MAX_GPUS:
        raise HTTPError(400, f"field 'gpus' must be between 0 and {_MAX_GPUS}")
    info: dict[str, Any] = {"gpus": gpus}
    if body.get("ideal_io") is not None:
        info["ideal_io"] = _parse_amount(body, "ideal_io", parse_rate, allow_null=False)
    epochs = body.get("epochs")
    if epochs is not None:
        if isinstance(epochs, bool) or not isinstance(epochs, int | float):
            raise HTTPError(400, "field 'epochs' must be a number")
        if not 0 < epochs <= _MAX_EPOCHS:
            raise HTTPError(400, f"field 'epochs' must be more than 0 and at most {_MAX_EPOCHS:g}")
        info["epochs"] = epochs
    datasets = _string_list(body, "datasets", _MAX_DATASETS)
    canonical = []
    for uri in datasets:
        try:
            canonical.append(parse_uri(uri).canonical)
        except UsageError as exc:
            raise HTTPError(400, f"field 'datasets': {exc}") from None
    info["datasets"] = canonical
    info["nodes"] = _string_list(body, "nodes", _MAX_NODES)
    for name in ("scheduler", "scheduler_id"):
        value = _field(body, name, str, required=False)
        if value is not None:
            if len(value) > 255 or not value.isprintable():
                raise HTTPError(400, f"field {name!r} must be printable, at most 255 characters")
            info[name] = value
    return info


def _string_list(body: dict, name: str, limit: int) -> list[str]:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > limit:
        raise HTTPError(400, f"field {name!r} must be a list of at most {limit} strings")
    for item in value:
        if not isinstance(item, str) or not item or len(item) > _MAX_NAME:
            raise HTTPError(400, f"field {name!r} must hold non-empty strings")
        if not item.isprintable():
            raise HTTPError(400, f"field {name!r} holds a string that is not printable")
    return list(value)


def _registration_routes(r: Router, d: Daemon) -> None:
    async def register_job(req: Request, job: str) -> Response:
        require_admin(d, req)
        job = _job_name(job)
        info = _registration(req.json())
        await d.register_job(job, info)
        return json_response({"job": job, "registration": info})

    async def get_job(req: Request, job: str) -> Response:
        job = _job_name(job)
        j = d.jobs.get(job)
        if j is None:
            raise HTTPError(404, f"no job {job!r} on this node")
        return json_response(job_view(d, j))

    r.add("PUT", "/v1/jobs/{job}", register_job)
    r.add("GET", "/v1/jobs/{job}", get_job)


# What a remote controller (the mutual-TLS listener, docs/SECURITY.md) may call: reads
# and the admin changes the controller makes. Never mounts, chunks, offers, warms or
# dataset opens: those name local processes, read bytes, or send the node's store
# credentials where the body says (endpoint_url), which a network peer has no need of.
REMOTE_ROUTES = {
    ("GET", "/v1/status"),
    ("GET", "/v1/allocations"),
    ("GET", "/v1/datasets/{name}"),
    ("GET", "/v1/datasets/{name}/cache"),
    ("PUT", "/v1/datasets/{name}/cache"),
    ("GET", "/v1/datasets/{name}/admission"),
    ("PUT", "/v1/datasets/{name}/admission"),
    ("GET", "/v1/jobs/{job}/io"),
    ("PUT", "/v1/jobs/{job}/io"),
    ("DELETE", "/v1/jobs/{job}/io"),
    ("GET", "/v1/jobs/{job}"),
    ("DELETE", "/v1/datasets/{name}"),
    ("DELETE", "/v1/jobs/{job}"),
    ("GET", "/metrics"),
}


# -- hints (prefetch by hint, node/prefetch.py) -----------------------------------------
def _hint_paths(body: dict) -> list[str]:
    paths = body.get("paths")
    if not isinstance(paths, list) or len(paths) > MAX_HINT_PATHS:
        raise HTTPError(
            400, f"field 'paths' must be a list of up to {MAX_HINT_PATHS} paths (then append)"
        )
    out = []
    for p in paths:
        if not isinstance(p, str) or not 0 < len(p) <= MAX_HINT_PATH_LEN or "\0" in p:
            raise HTTPError(
                400, f"field 'paths' must hold paths of 1-{MAX_HINT_PATH_LEN} characters"
            )
        out.append(p.lstrip("/"))  # an object key is its path relative to the mount
    return out


def _hint_routes(r: Router, d: Daemon) -> None:
    def owned_mount(req: Request, mount_id: str) -> MountState:
        """The peer's own mount, of a job it owns (root and admins: any)."""
        m = own_mount(d, req, mount_id)
        check_job(d, req, m.job, again=True)
        return m

    async def post(req: Request, mount_id: str) -> Response:
        m = owned_mount(req, mount_id)
        body = req.json()
        if not isinstance(body, dict):
            raise HTTPError(400, "the body must be a JSON object with 'paths'")
        paths = _hint_paths(body)
        append = _field(body, "append", bool, required=False) or False
        limit = d.settings.prefetch_window
        window = limit
        if body.get("window") is not None:
            window = _parse_amount(body, "window", parse_size, allow_null=False) or 0
            if window < 1:
                raise HTTPError(400, "field 'window' must be a size of at least 1 byte")
            window = min(window, limit)  # the node's setting is the most a hint gets
        if limit <= 0:
            raise HTTPError(409, "prefetch by hint is off on this node (prefetch_window = 0)")
        peer = None if trusted(d, req) else (req.peer.uid, peer_groups(req.peer))
        try:
            h = d.prefetch.hint(m, paths, append=append, window=window, peer=peer)
        except ValueError as exc:
            raise refuse(req, 429, str(exc)) from None
        return json_response({"mount": m.id, "job": m.job, **h.view()}, status=202)

    async def get(req: Request, mount_id: str) -> Response:
        m = own_mount(d, req, mount_id)
        h = d.prefetch.hints.get(m.id)
        if h is None:
            raise HTTPError(404, f"mount {m.id} has sent no hint")
        return json_response({"mount": m.id, "job": m.job, **h.view()})

    async def cancel(req: Request, mount_id: str) -> Response:
        m = owned_mount(req, mount_id)
        h = d.prefetch.cancel(m.id)
        if h is None:
            raise HTTPError(404, f"mount {m.id} has sent no hint")
        return json_response({"mount": m.id, "job": m.job, **h.view()})

    r.add("POST", "/v1/mounts/{mount_id}/hints", post)
    r.add("GET", "/v1/mounts/{mount_id}/hints", get)
    r.add("DELETE", "/v1/mounts/{mount_id}/hints", cancel)
