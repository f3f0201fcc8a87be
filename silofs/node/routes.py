"""The daemon's route table: every /v1 route, what handles it, who may call it, and how
large a body it takes.

Owns the table and nothing else: each entry (control/router.py Route) is the whole
truth about its route, read before a request's body: the server takes the body limit
from it, and the router finds the route only for peers of a kind it names (a remote
controller never finds a mount, chunk, offer, warm or dataset-open route: those name
local processes, serve cached bytes, or would send the node's store credentials where
a body says) and refuses it (403) to local peers whose roles it does not name. What a
handler checks beyond its entry (a mount's owner, a file the peer could read, per-uid
limits: docs/SECURITY.md) is in node/authz.py; the handlers are in node/api/. A
member's request is told to the cluster as its roles are judged (a member down here
that calls is probed then: Cluster.contacted). Never holds state and never handles a
request itself.
"""

from __future__ import annotations

import dataclasses
import functools

from silofs.control.peer import Peer
from silofs.control.router import Caller, Route, Router
from silofs.node import authz
from silofs.node.api import allocations, chunks, datasets, jobs, mounts, peer, status
from silofs.node.daemon import Daemon

# Who may call a route: reads are for every local peer and a remote controller; the
# changes a controller makes, for local admins and a remote controller; the rest of the
# local API for local peers (its handlers judge each peer: own mounts, jobs, files).
READ = Caller.LOCAL | Caller.CONTROLLER
CONTROL = Caller.ADMIN | Caller.CONTROLLER
LOCAL = Caller.LOCAL
# Members of this node's cluster, by their node certificate, on the TLS listener only:
# the Unix socket has no peer routes, and a member's certificate reaches nothing else.
PEER = Caller.PEER

# A chunk offered by a mount is the only large request body (others: the listener's
# 1 MiB); only root or the daemon's own uid may send one.
MAX_OFFER_BODY = (64 << 20) + 4096

_DATASET = "/v1/datasets/{name}"
_JOB = "/v1/jobs/{job}"
_MOUNT = "/v1/mounts/{mount_id}"

# Handlers take the Daemon first: build_router binds it.
ROUTES: tuple[Route, ...] = (
    Route("GET", "/v1/status", status.status, READ, doc="read the node's status"),
    Route("GET", "/metrics", status.metrics, READ, doc="read the node's metrics"),
    Route("GET", "/v1/allocations", allocations.all_allocations, READ, doc="list allocations"),
    # datasets
    Route("POST", "/v1/datasets", datasets.open_dataset, LOCAL, doc="open a dataset"),
    Route("GET", _DATASET, datasets.get_dataset, READ, doc="read a dataset's view"),
    Route("DELETE", _DATASET, datasets.forget_dataset, CONTROL, doc="forget a dataset"),
    Route("GET", f"{_DATASET}/cache", allocations.get_cache, READ, doc="read a cache allocation"),
    Route(
        "PUT", f"{_DATASET}/cache", allocations.put_cache, CONTROL, doc="change cache allocations"
    ),
    Route("GET", f"{_DATASET}/admission", allocations.get_mode, READ, doc="read an admission mode"),
    Route(
        "PUT", f"{_DATASET}/admission", allocations.put_mode, CONTROL, doc="change admission modes"
    ),
    Route("POST", f"{_DATASET}/warm", datasets.start_warm, LOCAL, doc="warm a dataset"),
    Route("GET", f"{_DATASET}/warm", datasets.get_warm, LOCAL, doc="read a warm's progress"),
    Route("DELETE", f"{_DATASET}/warm", datasets.cancel_warm, LOCAL, doc="stop a warm"),
    # jobs
    Route("PUT", _JOB, jobs.register_job, Caller.ADMIN, doc="register jobs"),
    Route("GET", _JOB, jobs.get_job, READ, doc="read a job's view"),
    Route("DELETE", _JOB, jobs.forget_job, CONTROL, doc="forget jobs"),
    Route("GET", f"{_JOB}/io", allocations.get_io, READ, doc="read an IO allocation"),
    Route("PUT", f"{_JOB}/io", allocations.put_io, CONTROL, doc="change IO allocations"),
    Route("DELETE", f"{_JOB}/io", allocations.del_io, CONTROL, doc="remove IO allocations"),
    # mounts and their misses
    Route("POST", "/v1/mounts", mounts.add_mount, LOCAL, doc="register a mount"),
    Route("DELETE", _MOUNT, mounts.del_mount, LOCAL, doc="unregister a mount"),
    Route("PUT", f"{_MOUNT}/stats", mounts.mount_stats, LOCAL, doc="report a mount's counters"),
    Route("POST", f"{_MOUNT}/hints", mounts.post_hint, LOCAL, doc="hint a reading order"),
    Route("GET", f"{_MOUNT}/hints", mounts.get_hint, LOCAL, doc="read a hint's progress"),
    Route("DELETE", f"{_MOUNT}/hints", mounts.cancel_hint, LOCAL, doc="stop a hint"),
    # A mount's misses: its connections move to threads of their own after the first.
    # A miss homed at another member is asked of it from that thread.
    Route(
        "GET",
        "/v1/chunks",
        chunks.get_chunk,
        LOCAL,
        doc="read a chunk",
        threaded=True,
        inline=chunks.peer_chunk,
    ),  # fmt: skip
    Route(
        "PUT",
        f"{_MOUNT}/offer",
        chunks.offer,
        Caller.ROOT,
        body_limit=MAX_OFFER_BODY,
        doc="offer chunks for admission",
    ),
    # the cluster: its member list, and what members ask of each other
    Route("GET", "/v1/cluster", peer.get_cluster, READ, doc="read the cluster's members"),
    Route("PUT", "/v1/cluster", peer.put_cluster, CONTROL, doc="change the cluster's members"),
    Route("GET", "/v1/peer/ping", peer.ping, PEER, doc="ping a cluster member"),
    Route("PUT", "/v1/peer/datasets", peer.put_dataset, PEER, doc="introduce a dataset"),
    # A chunk the home holds is answered from the member connection's thread.
    Route(
        "GET",
        "/v1/peer/chunk",
        peer.get_chunk,
        PEER,
        doc="read a chunk from its home",
        inline=peer.held_chunk,
    ),  # fmt: skip
    Route("GET", "/v1/peer/allocations", peer.get_allocations, PEER, doc="read cache shares"),
    Route("PUT", "/v1/peer/allocations", peer.put_allocations, PEER, doc="push cache shares"),
)

# What a remote controller (the mutual-TLS listener, docs/SECURITY.md) may call.
REMOTE_ROUTES = frozenset((r.method, r.path) for r in ROUTES if r.who & Caller.CONTROLLER)
# What a member of this node's cluster may call (the same listener).
PEER_ROUTES = frozenset((r.method, r.path) for r in ROUTES if r.who & Caller.PEER)


def _roles(d: Daemon, who: Peer) -> Caller:
    """authz.roles, and a member's call noted (Cluster.contacted: a member down here
    that calls is probed now). Every request asks it, from its connection's thread or
    the loop."""
    roles = authz.roles(d, who)
    if roles is _PEER and d.cluster.membership.down_hosts:  # else nothing to probe
        d.cluster.contacted(who.names)
    return roles


_PEER = Caller.PEER  # a module global: the enum's attribute look-up costs more


def build_router(d: Daemon) -> Router:
    """The table with each handler bound to `d`, judging peers by `d`'s settings."""
    return Router(
        (
            dataclasses.replace(
                r,
                handler=functools.partial(r.handler, d),
                inline=functools.partial(r.inline, d) if r.inline is not None else None,
            )
            for r in ROUTES
        ),
        roles=functools.partial(_roles, d),
        refusal=functools.partial(authz.refusal, d),
    )
