"""Who may do what through the daemon's API (docs/SECURITY.md), judged per request.

Owns the roles a peer holds, which the route table's entries are matched against (any
local peer; root, the daemon's uid or the admin group; a remote controller), the line
refusing a route a peer's roles do not reach, the trust test, the checks handlers make
before they act (store options, opening or mounting a dataset, reading an object of a
local dataset, holding a job, per-uid limits, a mount's owner), and the WARNING line a
refusal leaves. Never changes the daemon's state: it reads it, and asks the backend as
the peer.
"""

from __future__ import annotations

import logging
import os

import trio

from silofs.control.peer import Peer, peer_groups, peer_may_change
from silofs.control.router import Caller, HTTPError, Request, Route
from silofs.errors import (
    AccessDeniedError,
    BackendError,
    ObjectChangedError,
    VersionMismatchError,
)
from silofs.node.access import cloud_allowed
from silofs.node.backends.local import LocalBackend
from silofs.node.daemon import Daemon
from silofs.node.datasets import Purpose, named_object
from silofs.node.state import DatasetState, MountState
from silofs.records import is_slurm_job_name
from silofs.units import count
from silofs.uri import DatasetURI

log = logging.getLogger(__name__)


def roles(d: Daemon, peer: Peer) -> Caller:
    """The roles (control/router.py Caller) a peer holds, which its route's entry is
    matched against: a remote peer with the node role is a member (PEER) if one of its
    certificate's names is the host of a member of this node's cluster, else nothing
    at all; another remote peer is a controller; a local one is LOCAL, ADMIN if trusted
    (peer_may_change), ROOT if root or the daemon's own uid."""
    if peer.remote is not None:
        if not peer.node:
            return Caller.CONTROLLER
        membership = d.cluster.membership
        if membership is not None and membership.names_a_member(peer.names):
            return Caller.PEER
        return Caller(0)
    return _LOCAL[peer_may_change(peer, d.admin_gid), peer.uid in (0, os.getuid())]


# A local peer's roles by (trusted, root or the daemon's uid), made once: every request
# asks.
_LOCAL = {
    (admin, root): Caller.LOCAL
    | (Caller.ADMIN if admin else Caller(0))
    | (Caller.ROOT if root else Caller(0))
    for admin in (False, True)
    for root in (False, True)
}


def refusal(d: Daemon, route: Route, peer: Peer) -> str:
    """Why a peer may not call a route its roles do not reach (403, one line)."""
    if peer.remote is not None:
        return _remote_refusal(d, route, peer)
    who = ["root"]
    if os.getuid():
        who.append(f"uid {os.getuid()} (the daemon's)")
    if route.who & Caller.ADMIN and d.settings.admin_group:
        who.append(f"group {d.settings.admin_group}")
    return f"only {' or '.join(who)} may {route.doc}; you are uid {peer.uid}"


def _remote_refusal(d: Daemon, route: Route, peer: Peer) -> str:
    """Why a certificate may not call a route: a controller's on a peer route, a
    member's on anything else, a node certificate naming no member on anything."""
    name = repr(peer.remote)
    if not peer.node:
        return (
            f"only members of this node's cluster may {route.doc}; "
            f"certificate {name} is not a node's"
        )
    membership = d.cluster.membership
    if membership is None or not membership.names_a_member(peer.names):
        cluster = f"cluster {membership.name!r}" if membership is not None else "no cluster"
        return (
            f"certificate {name} names no member of this node's cluster ({cluster}): "
            f"its names are {', '.join(sorted(peer.names)) or 'none'}"
        )
    return f"a cluster member's certificate may call only the peer routes, not {route.doc}"


def trusted(d: Daemon, req: Request) -> bool:
    """Root and the admin group: exempt from the checks below."""
    return peer_may_change(req.peer, d.admin_gid)


def refuse(req: Request, status: int, message: str) -> HTTPError:
    log.warning("refused %s %s from uid %d: %s", req.method, req.path, req.peer.uid, message)
    return HTTPError(status, message)


_OPEN_FIELDS = {"uri", "refresh"}


def check_store_options(d: Daemon, req: Request, body: dict) -> None:
    """A store option (endpoint_url, ...) makes the daemon send its credentials where
    the caller says: only trusted peers may name one."""
    named = sorted(k for k, v in body.items() if k not in _OPEN_FIELDS and v is not None)
    if named and not trusted(d, req):
        raise refuse(
            req,
            403,
            f"store options ({', '.join(named)}) are for root or the admin group; "
            f"uid {req.peer.uid} may only name a dataset URI",
        )


async def check_dataset_access(
    d: Daemon, req: Request, uri: DatasetURI, *, mount: DatasetState | None = None
) -> None:
    """403 unless an untrusted peer may open (or, with `mount`, mount) the dataset: a
    local directory it can list itself (for a mount: every directory under it, since the
    mount shows all their names), or a cloud prefix [access] grants one of its groups."""
    if trusted(d, req):
        return
    uid, gids = req.peer.uid, peer_groups(req.peer)
    if uri.scheme != "file":
        if not cloud_allowed(uri.canonical, gids, d.cloud_access):
            raise refuse(
                req,
                403,
                f"uid {uid} may not open {uri.canonical}: cloud datasets are opened by root, "
                "the admin group, or a group the daemon's [access] lists for the prefix",
            )
        return
    if mount is not None and uid in d.catalog.tree_checked.get(mount.id, ()):
        return
    backend = mount.backend if mount is not None else LocalBackend(uri, d.catalog.backend_opts)
    check = getattr(backend, "check_peer_list", None)
    if check is None:  # not a local backend (a test double): nothing to walk
        return
    try:
        await trio.to_thread.run_sync(
            lambda: check(uid, gids, tree=mount is not None), limiter=d.fetcher.threads
        )
    except AccessDeniedError as exc:
        raise refuse(req, 403, str(exc)) from None
    except (BackendError, OSError):
        if mount is not None:  # fail closed; opening reports a missing directory itself
            raise refuse(req, 403, f"cannot check that uid {uid} may list {uri.bucket}") from None
        return
    if mount is not None:
        d.catalog.tree_checked.setdefault(mount.id, set()).add(uid)


async def check_object_access(d: Daemon, req: Request, m: MountState, key: str) -> None:
    """An untrusted peer gets a local object's bytes (cached or not) only if it could
    read the file itself, checked on every request: a chmod takes effect at once."""
    if trusted(d, req):
        return
    ds = d.datasets[m.dsid]
    check = getattr(ds.backend, "check_peer_read", None)
    if ds.uri.scheme != "file" or check is None:
        return
    try:
        named = named_object(d.store, ds, key, Purpose.READ, req.query.get("version"))
    except VersionMismatchError as exc:
        raise HTTPError(409, str(exc)) from None
    if named is None:
        return  # get_chunk answers 404
    if named.previous:
        # The previous listing's version would be served from the cache, and only the
        # file as it is now can be judged: no old bytes for an untrusted peer.
        raise HTTPError(
            409,
            f"{ds.uri.canonical}{key} changed since this mount listed it; "
            "remount to read the new one",
        )
    obj = named.obj
    uid, gids = req.peer.uid, peer_groups(req.peer)
    try:
        await trio.to_thread.run_sync(check, obj, uid, gids, limiter=d.fetcher.threads)
    except AccessDeniedError as exc:
        raise refuse(req, 403, str(exc)) from None
    except ObjectChangedError as exc:
        raise HTTPError(409, str(exc)) from None
    except (BackendError, OSError) as exc:
        raise refuse(req, 403, f"cannot check that uid {uid} may read {key}: {exc}") from None


def check_limit(req: Request, what: str, held: int, limit: int) -> None:
    if held >= limit:
        raise refuse(
            req,
            429,
            f"uid {req.peer.uid} already holds {count(held, what.removesuffix('s'), what)} "
            f"(limit {limit}): "
            f"release some, or ask an admin to raise max_{what}_per_uid",
        )


def check_job(
    d: Daemon, req: Request, job: str, *, again: bool = False, mount: bool = True
) -> None:
    """A job belongs to the uid its registration names, else to the one that registered
    its oldest live mount (or started its running warm): no one else may register under
    it or warm with it (spend its IO, push its stats), except root and admins. A name
    `slurm-N` is the Slurm prolog's, made for job N's user: an untrusted caller may use
    one only once a registration names its uid (else another user could take the name
    first and the prolog's mount for the real owner would be refused, cancelling the
    job). A mount registering `again` under its own id holds nothing new: no limit
    applies. A warm (`mount=False`) holds no mount."""
    if trusted(d, req):
        return
    if is_slurm_job_name(job) and d.registered_owner(job) != req.peer.uid:
        raise refuse(
            req,
            403,
            f"job names slurm-N are made by the Slurm prolog for the job's user: {job!r} "
            f"is not registered for uid {req.peer.uid} (an admin registers it first: "
            "silofs-ctl job register --uid)",
        )
    owner = d.job_owner(job)
    if owner is not None and owner != req.peer.uid:
        raise refuse(req, 403, f"job {job!r} belongs to uid {owner}, not to uid {req.peer.uid}")
    if again:
        return
    _, mounts, jobs = d.held_by(req.peer.uid)
    if mount:
        check_limit(req, "mounts", mounts, d.settings.max_mounts_per_uid)
    if owner is None:
        check_limit(req, "jobs", jobs, d.settings.max_jobs_per_uid)


def own_mount(d: Daemon, req: Request, mount_id: str) -> MountState:
    """The mount `mount_id`, if it is the peer's (root and admins: any); 404, 403."""
    m = d.mounts.get(mount_id)
    if m is None:
        raise HTTPError(404, f"no mount {mount_id!r} (the daemon restarted?)")
    if req.peer.uid != m.uid and not trusted(d, req):
        raise HTTPError(403, "this mount belongs to another user")
    return m
