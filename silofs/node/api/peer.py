"""The cluster's routes: the member list (GET, PUT /v1/cluster: admins and a remote
controller) and the peer routes members call (/v1/peer/*: members only, over the
mutual-TLS listener).

Owns reading and checking those requests (a peer route also checks that the caller
names this node's cluster in x-silofs-cluster), the status each outcome answers
(428 and the bytes to charge, 404 and x-silofs-unknown-dataset for a dataset to
introduce first), and counting what members ask of this node. A chunk the home holds
is answered from the member connection's thread (held_chunk), the rest on the loop.
Who may call a route is the route table's and node/authz.py's; what a home does is
node/peer_serve.py's, the member list and shares node/cluster.py's.
"""

from __future__ import annotations

from silofs.control.router import HTTPError, Request, Response, json_response
from silofs.errors import BackendError, UsageError
from silofs.node.api.chunks import backend_status
from silofs.node.api.fields import field
from silofs.node.daemon import Daemon
from silofs.node.peer_serve import ChargeFirst, ServeBusy, UnknownDataset
from silofs.node.peer_wire import (
    CHARGE_HEADER,
    CLUSTER_HEADER,
    SOURCE_HEADER,
    UNKNOWN_DATASET_HEADER,
    ChunkAsk,
)
from silofs.node.views import cluster_view


# -- the member list (admins, a remote controller) -----------------------------------
async def get_cluster(d: Daemon, req: Request) -> Response:
    return json_response(cluster_view(d) or {"cluster": None})


async def put_cluster(d: Daemon, req: Request) -> Response:
    body = req.json()
    try:
        config = await d.cluster.push(body, check_only=req.query.get("check") == "1")
    except UsageError as exc:
        raise HTTPError(400, str(exc)) from None
    except ValueError as exc:
        raise HTTPError(409, str(exc)) from None
    return json_response(
        {"name": config.name, "version": config.version, "members": len(config.members)}
    )


# -- peer routes (members only) --------------------------------------------------------
def _member(d: Daemon, req: Request) -> str:
    """The asking member's certificate name, once it names this node's cluster (403)."""
    config = d.cluster.config
    if config is None:
        raise HTTPError(403, "this node is in no cluster")
    named = req.headers.get(CLUSTER_HEADER)
    if named != config.name:
        raise HTTPError(403, f"this node is of cluster {config.name!r}, not {named!r}")
    return req.peer.remote or "?"


async def ping(d: Daemon, req: Request) -> Response:
    _member(d, req)
    config = d.cluster.config
    assert config is not None and d.cluster.membership is not None
    return json_response(
        {
            "name": config.name,
            "address": d.cluster.membership.self_address,
            "members_version": config.version,
            # What placement follows: a member whose list differs says so (Cluster).
            "members_digest": d.cluster.membership.digest,
            "members_count": len(config.members),
            "allocations_version": d.cluster.shares.version,
            "allocations_digest": d.cluster.shares.digest,
        }
    )


async def put_dataset(d: Daemon, req: Request) -> Response:
    _member(d, req)
    body = req.json()
    uri = field(body, "uri", str)
    options = body.get("options") or {}
    if not isinstance(options, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in options.items()
    ):
        raise HTTPError(400, "options must be an object of strings")
    try:
        ds = await d.cluster.home.introduce(uri, options)
    except PermissionError as exc:
        raise HTTPError(403, str(exc)) from None
    except UsageError as exc:
        raise HTTPError(400, str(exc)) from None
    return json_response({"uri": ds.uri.canonical})


async def get_chunk(d: Daemon, req: Request) -> Response:
    name = _member(d, req)
    try:
        ask = ChunkAsk.from_query(req.query)
    except ValueError as exc:
        raise HTTPError(400, str(exc)) from None
    counters = [d.cluster.incoming_counters(name)]
    if d.cluster.home.dataset(ask.uri) is not None:  # never a row per name a member makes up
        counters.append(d.cluster.dataset_counters(ask.uri))
    for c in counters:
        c.answered(0)
    try:
        served = await d.cluster.home.serve(ask)
    except ChargeFirst as exc:
        resp = json_response({"charge": exc.nbytes}, 428)
        resp.headers[CHARGE_HEADER] = str(exc.nbytes)
        return resp
    except UnknownDataset:
        resp = json_response({"error": f"no dataset {ask.uri} here: introduce it"}, 404)
        resp.headers[UNKNOWN_DATASET_HEADER] = "1"
        return resp
    except ServeBusy as exc:
        raise HTTPError(429, str(exc)) from None
    except UsageError as exc:
        raise HTTPError(409, str(exc)) from None
    except BackendError as exc:
        raise HTTPError(backend_status(exc), str(exc)) from None
    if served.value is None:  # a warm
        resp = json_response({"chunk": served.outcome})
        resp.headers[SOURCE_HEADER] = served.source
        return resp
    for c in counters:
        c.sent(len(served.value))
    return Response(200, served.value, "application/octet-stream", {SOURCE_HEADER: served.source})


def held_chunk(d: Daemon, req: Request) -> Response | None:
    """GET /v1/peer/chunk from the member connection's thread (Route.inline): the
    answer for a chunk this node holds, as get_chunk would give it; None for the rest
    (get_chunk answers on the loop: misses, warms, errors)."""
    config = d.cluster.config
    if config is None or req.headers.get(CLUSTER_HEADER) != config.name:
        return None
    try:
        ask = ChunkAsk.from_query(req.query)
    except ValueError:
        return None
    held = d.cluster.home.held(ask)
    if held is None:
        return None
    try:
        for c in (d.cluster.incoming_counters(req.peer.remote or "?"),
                  d.cluster.dataset_counters(ask.uri)):  # fmt: skip
            c.answered(len(held.value))
    except BaseException:
        held.close()
        raise
    # Sent from the map: the txn it lies in ends once the answer is sent (release).
    headers = {SOURCE_HEADER: "cache"}
    return Response(200, held.value, "application/octet-stream", headers, release=held.close)


async def get_allocations(d: Daemon, req: Request) -> Response:
    _member(d, req)
    return json_response(d.cluster.shares.view())


async def put_allocations(d: Daemon, req: Request) -> Response:
    _member(d, req)
    try:
        accepted = await d.cluster.accept_shares(req.json())
    except UsageError as exc:
        raise HTTPError(400, str(exc)) from None
    return json_response({"accepted": accepted, "version": d.cluster.shares.version})
