"""Datasets: open one (check and list it), read its view, forget it, and warm it.

Owns reading and checking those requests: the dataset URI a peer may send (absolute,
never resolved against the daemon's working directory), per-dataset store options,
a warm's globs; and the checks an untrusted peer needs beyond its route's entry
(node/authz.py: store options, access to the dataset, its dataset limit, the job a warm
charges). The listing lifecycle itself is the Daemon's.
"""

from __future__ import annotations

import logging
import os

from silofs.config import STORE_OPTIONS
from silofs.control.peer import peer_groups
from silofs.control.router import HTTPError, Request, Response, json_response
from silofs.errors import RefreshTooSoonError
from silofs.node.api.fields import (
    MAX_NAME,
    chunk_size,
    dataset,
    dataset_uri,
    field,
    job_name,
    usage_error_as,
)
from silofs.node.authz import (
    check_dataset_access,
    check_job,
    check_limit,
    check_store_options,
    refuse,
    trusted,
)
from silofs.node.daemon import Daemon
from silofs.node.state import DatasetState
from silofs.node.views import dataset_view
from silofs.node.warm import WarmState, glob_error
from silofs.uri import DatasetURI, check_endpoint, parse_uri

log = logging.getLogger(__name__)

MAX_GLOBS = 64  # globs one warm may name


async def open_dataset(d: Daemon, req: Request) -> Response:
    body = req.json()
    uri = field(body, "uri", str)
    refresh = field(body, "refresh", bool, required=False) or False
    endpoint_url = field(body, "endpoint_url", str, required=False)
    if endpoint_url:
        with usage_error_as(400):  # credentials in it: they would be in status and logs
            check_endpoint(endpoint_url, "endpoint_url")
    check_store_options(d, req, body)
    options = store_options(body)
    parsed = _absolute_uri(uri)
    await check_dataset_access(d, req, parsed)
    if d.catalog.find_dataset(parsed.canonical) is None and not trusted(d, req):
        held, _, _ = d.held_by(req.peer.uid)
        if held >= d.settings.max_datasets_per_uid and d.catalog.forget_idle_dataset(req.peer.uid):
            held -= 1
        check_limit(req, "datasets", held, d.settings.max_datasets_per_uid)
    # Root and the daemon's own uid may refresh at any time; anyone else a dataset its
    # last listing has not refreshed for min_refresh_seconds (a listing costs LIST
    # requests, and each drops the generation before it under other users' handles).
    limited = req.peer.uid not in (0, os.getuid())
    try:
        with usage_error_as(400):
            ds = await d.catalog.open_dataset(
                uri, refresh, endpoint_url, options, refresh_limited=limited
            )
    except RefreshTooSoonError as exc:
        log.info("refresh of %s by uid %d refused: %s", uri, req.peer.uid, exc)
        raise HTTPError(429, str(exc)) from None
    d.catalog.opened_by.setdefault(ds.id, req.peer.uid)
    return json_response(dataset_view(d, ds))


def _absolute_uri(uri: str) -> DatasetURI:
    if "://" not in uri and not uri.startswith("/"):
        # parse_uri would resolve it against the daemon's cwd (or its ~), which is
        # not the caller's: the client resolves relative paths (silofs mount does).
        raise HTTPError(
            400,
            f"dataset path {uri!r} is relative: send an absolute path or file:///... "
            "(the daemon does not know the caller's working directory)",
        )
    with usage_error_as(400):
        return parse_uri(uri)


def store_options(body: dict) -> dict[str, str]:
    """The "options" of POST /v1/datasets: only config.STORE_OPTIONS, short scalars."""
    options = field(body, "options", dict, required=False) or {}
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


async def get_dataset(d: Daemon, req: Request, name: str) -> Response:
    return json_response(dataset_view(d, dataset(d, name)))


async def forget_dataset(d: Daemon, req: Request, name: str) -> Response:
    if d.catalog.find_dataset(name) is None:
        # No row, but maybe an allocation kept for the dataset (`allocate-cache --create`
        # of a mistyped URI): forgetting it is the undo README promises.
        uri = _allocated_uri(d, name)
        if uri is not None:
            await d.allocs.forget_dataset(uri)
            log.info("forgot the allocation of dataset %s (not opened on this node)", uri)
            return json_response({"forgot": "dataset", "dataset": uri})
    ds = dataset(d, name)
    with usage_error_as(409):  # still in use
        await d.forget_dataset(ds)
    return json_response({"forgot": "dataset", "dataset": ds.uri.canonical})


def _allocated_uri(d: Daemon, name: str) -> str | None:
    """The canonical URI `name` gives if it holds a cache allocation or an admission
    mode but no row on this node; None otherwise (not a URI, or nothing set for it)."""
    try:
        uri = dataset_uri(d, name)
    except HTTPError:
        return None
    return uri if uri in d.allocs.cache or uri in d.allocs.modes else None


# -- warm (silofs warm) -----------------------------------------------------------------
async def start_warm(d: Daemon, req: Request, name: str) -> Response:
    ds = dataset(d, name)
    body = req.json()
    job = job_name(field(body, "job", str))
    paths = _warm_globs(body.get("paths") or [])
    size = chunk_size(body)
    # A warm spends the job's remote IO and fills the cache with the dataset's bytes: an
    # untrusted peer may charge only a job it may hold (as for a mount) and warm only a
    # dataset it may mount; of a local one, only the files it could read itself are
    # fetched (node/warm.py), so it cannot pull a 0600 file of another user into the
    # cache.
    await check_dataset_access(d, req, ds.uri, mount=ds)
    check_job(d, req, job, mount=False)
    reader = None if trusted(d, req) else (req.peer.uid, peer_groups(req.peer))
    with usage_error_as(409):
        w = d.start_warm(ds, job, paths, size, req.peer.uid, reader=reader)
    return _warm_response(d, ds, w, status=202)


def _warm_globs(paths: object) -> list[str]:
    """A warm's --paths, checked; HTTPError(400) saying which rule one breaks (an empty
    or a too-long glob was told "a list of up to 64 globs", which it was)."""
    if not isinstance(paths, list) or len(paths) > MAX_GLOBS:
        raise HTTPError(400, f"field 'paths' must be a list of up to {MAX_GLOBS} globs")
    for p in paths:
        if not isinstance(p, str):
            raise HTTPError(400, "field 'paths' must hold strings (globs)")
        if not 0 < len(p) <= MAX_NAME:
            raise HTTPError(
                400, f"field 'paths': a glob is 1 to {MAX_NAME} characters, not {len(p)}"
            )
        if (why := glob_error(p)) is not None:
            raise HTTPError(400, f"field 'paths': {why}")
    return paths


async def get_warm(d: Daemon, req: Request, name: str) -> Response:
    ds, w = _warm_of(d, name)
    return _warm_response(d, ds, w)


async def cancel_warm(d: Daemon, req: Request, name: str) -> Response:
    ds, w = _warm_of(d, name)
    if req.peer.uid != w.uid and not trusted(d, req):
        raise refuse(req, 403, f"this warm was started by uid {w.uid}")
    w.scope.cancel()
    return _warm_response(d, ds, w)


def _warm_of(d: Daemon, name: str) -> tuple[DatasetState, WarmState]:
    ds = dataset(d, name)
    w = d.warms.get(ds.id)
    if w is None:
        raise HTTPError(404, f"no warm of {ds.uri.canonical} since the daemon started")
    return ds, w


def _warm_response(d: Daemon, ds: DatasetState, w: WarmState, status: int = 200) -> Response:
    job = d.jobs.get(w.job)
    # The paying job's allocation as it is now: 0 pauses the warm (promise 2), and the
    # CLI says so rather than showing a bar that does not move.
    rate = job.limiter.rate if job is not None else None
    body = {"dataset": ds.uri.canonical, "id": ds.id, **w.view(), "io_allocation": rate}
    return json_response(body, status=status)
