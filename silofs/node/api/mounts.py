"""Mount processes: registering one, its counter reports, its goodbye, and its reading
order (prefetch by hint, node/prefetch.py).

Owns reading and checking those requests, the settings a mount may ask for (an IO
limit, an admission mode: taken only from root or the admin group, and only where no
allocation exists yet), and the checks beyond the route's entry (node/authz.py: the
peer's access to the dataset, its own mount, its own job, its limits). Registration
itself is the Daemon's.
"""

from __future__ import annotations

import logging
import re
import time

from silofs.control.peer import peer_groups
from silofs.control.router import HTTPError, Request, Response, json_response
from silofs.node.api.fields import (
    amount,
    chunk_size,
    dataset,
    field,
    job_name,
    usage_error_as,
)
from silofs.node.authz import check_dataset_access, check_job, own_mount, refuse, trusted
from silofs.node.daemon import Daemon
from silofs.node.prefetch import MAX_HINT_PATH_LEN, MAX_HINT_PATHS
from silofs.node.state import DatasetState, MountState
from silofs.records import MAX_HELD, MountCounters
from silofs.units import MAX_VALUE, parse_rate, parse_size

log = logging.getLogger(__name__)

_MOUNT_ID = re.compile(r"[0-9a-f]{8,32}")  # a mount process chooses its own id
# Jobs with neither a mount nor an IO allocation kept for status; older ones are
# forgotten, so cycling job names cannot grow the daemon without bound.
_IDLE_JOBS_KEPT = 1024
# Counters newer than the rest: a mount started before the daemon was upgraded does
# not send them.
_NEWER_COUNTERS = {"buffer_bytes", "store_bytes", "interrupted_reads"}
_MAX_TOUCHED = 65536  # chunk keys one report may name (lru datasets)


async def add_mount(d: Daemon, req: Request) -> Response:
    body = req.json()
    ds = dataset(d, str(field(body, "dataset", int)))
    size = chunk_size(body)
    io_limit = field(body, "io_limit", int, required=False)
    if io_limit is not None:
        io_limit = amount(body, "io_limit", parse_rate, allow_null=True)
    mode = field(body, "admission", str, required=False)
    job = job_name(field(body, "job", str))
    mount_id = field(body, "id", str, required=False)
    if mount_id is not None and not _MOUNT_ID.fullmatch(mount_id):
        raise HTTPError(400, "field 'id' must be 8-32 lowercase hex digits")
    mountpoint = field(body, "mountpoint", str)
    await check_dataset_access(d, req, ds.uri, mount=ds)
    known = d.mounts.get(mount_id) if mount_id else None
    check_job(d, req, job, again=known is not None and known.uid == req.peer.uid)
    await _initial_settings(d, req, ds, job, io_limit, mode)
    with usage_error_as(409):  # not ready, or the id is another mount's
        m = d.register_mount(
            ds,
            job,
            mountpoint,
            req.peer.pid,
            req.peer.uid,
            size,
            mount_id=mount_id,
            background=body.get("background") is True,
            again=body.get("again") is True,
        )
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
            "admission": d.allocs.mode(ds.uri.canonical),
        },
        status=201,
    )


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
    if io_limit is not None and job not in d.allocs.io:
        await d.set_io_allocation(job, io_limit)
    if mode is not None and mode != d.allocs.mode(ds.uri.canonical):
        if ds.uri.canonical in d.allocs.modes:
            log.info(
                "mount asked for %s admission of %s; keeping %s",
                mode,
                ds.uri.canonical,
                d.allocs.modes[ds.uri.canonical],
            )
            return
        with usage_error_as(400):  # neither uniform nor lru
            await d.set_mode(ds.uri.canonical, mode)


async def del_mount(d: Daemon, req: Request, mount_id: str) -> Response:
    own_mount(d, req, mount_id)
    d.unregister_mount(mount_id)
    return json_response({"deleted": mount_id})


async def mount_stats(d: Daemon, req: Request, mount_id: str) -> Response:
    m = own_mount(d, req, mount_id)
    body = req.json()
    counters = MountCounters(
        **{
            k: field(body, k, int, required=k not in _NEWER_COUNTERS) or 0
            for k in vars(MountCounters())
        }
    )
    if any(not 0 <= v <= MAX_VALUE for v in vars(counters).values()):
        raise HTTPError(400, f"counters must be 0 to {MAX_VALUE}")
    field(body, "epoch", int, required=False)  # sent by older mounts; the daemon counts
    gen = field(body, "gen", int, required=False)  # the listing generation it serves
    if gen is not None:
        if not 0 <= gen <= MAX_VALUE:
            raise HTTPError(400, f"field 'gen' must be 0 to {MAX_VALUE}")
        m.said_gen(gen, time.monotonic())
    held = body.get("held")  # the generations its open handles need (serving processes)
    if held is not None:
        if (
            not isinstance(held, list)
            or len(held) > MAX_HELD
            or not all(type(g) is int and 0 <= g <= MAX_VALUE for g in held)
        ):
            raise HTTPError(400, f"field 'held' must be at most {MAX_HELD} generations")
        m.held, m.held_seen = frozenset(held), time.monotonic()
    touched = body.get("touched") or []
    if not isinstance(touched, list) or len(touched) > _MAX_TOUCHED:
        raise HTTPError(400, "field 'touched' must be a list of chunk keys")
    try:
        keys = [bytes.fromhex(k) for k in touched if isinstance(k, str) and len(k) == 32]
    except ValueError:
        raise HTTPError(400, "field 'touched' must hold hex chunk keys") from None
    await d.report(m, counters, keys)
    return json_response({"ok": True, "admission": d.allocs.mode(d.datasets[m.dsid].uri.canonical)})


# -- hints (prefetch by hint, node/prefetch.py) -----------------------------------------
async def post_hint(d: Daemon, req: Request, mount_id: str) -> Response:
    m = _hinting_mount(d, req, mount_id)
    body = req.json()
    paths = _hint_paths(body)
    append = field(body, "append", bool, required=False) or False
    limit = d.settings.prefetch_window
    window = limit
    if body.get("window") is not None:
        window = amount(body, "window", parse_size, allow_null=False) or 0
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


async def get_hint(d: Daemon, req: Request, mount_id: str) -> Response:
    m = own_mount(d, req, mount_id)
    h = d.prefetch.hints.get(m.id)
    if h is None:
        raise HTTPError(404, f"mount {m.id} has sent no hint")
    return json_response({"mount": m.id, "job": m.job, **h.view()})


async def cancel_hint(d: Daemon, req: Request, mount_id: str) -> Response:
    m = _hinting_mount(d, req, mount_id)
    h = d.prefetch.cancel(m.id)
    if h is None:
        raise HTTPError(404, f"mount {m.id} has sent no hint")
    return json_response({"mount": m.id, "job": m.job, **h.view()})


def _hinting_mount(d: Daemon, req: Request, mount_id: str) -> MountState:
    """The peer's own mount, of a job it owns (root and admins: any)."""
    m = own_mount(d, req, mount_id)
    check_job(d, req, m.job, again=True)
    return m


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
