"""Chunks: a mount's miss (GET /v1/chunks) and a chunk it offers back for admission after
a daemon restart (PUT /v1/mounts/{id}/offer).

Owns reading and checking those requests (the object key, the chunk index, the
read-ahead span, the version the reader's handle opened), the per-request checks beyond
the route's entry (node/authz.py: the peer's own mount; for a local dataset, that it
could read the object itself, on every request), and the status each failure answers.
A mount that asks with `fd=1` on a connection that can carry one (a Unix socket's) is
handed a streamed chunk's sealed memory file instead of its bytes (silofs/sealed.py),
if the daemon trusts it: the file's pages stay charged to the daemon while the mount
holds them, so an untrusted user's mount could pin the daemon's memory with them. One
that asks with `region=1` on a thread-served connection is answered a chunk another
member served by its place in the connection's hand-off region (the same trust rule).
Fetching, verification and admission are the Daemon's.
"""

from __future__ import annotations

from silofs import sealed
from silofs.cache.format import MAX_SPAN_CHUNKS
from silofs.control.router import HTTPError, Request, Response, json_response
from silofs.errors import (
    BackendError,
    NotFoundError,
    ObjectChangedError,
    UsageError,
    VersionMismatchError,
)
from silofs.node.api.fields import query_int, usage_error_as
from silofs.node.authz import check_object_access, own_mount, trusted
from silofs.node.daemon import Daemon
from silofs.units import is_digits


async def get_chunk(d: Daemon, req: Request) -> Response:
    m = own_mount(d, req, req.query.get("mount", ""))
    key = req.query.get("key", "")
    index = query_int(req, "index")
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
        raise HTTPError(backend_status(exc), str(exc)) from None
    headers = {"x-silofs-source": source}
    if req.query.get("fd") == "1" and req.passes_fds and trusted(d, req):
        shared = sealed.passable(data)
        if shared is not None:  # the mount maps the sealed file instead (silofs/sealed.py)
            value, offset = shared
            headers[sealed.FD_HEADER] = f"{offset} {len(data)}"
            return Response(200, b"", "application/octet-stream", headers, fd=value)
    return Response(200, data, "application/octet-stream", headers)


def peer_chunk(d: Daemon, req: Request) -> Response | None:
    """GET /v1/chunks from the mount connection's thread (Route.inline): a miss of a
    chunk homed at another member, asked of it from here (node/peer_ask.py); None for
    everything else, which get_chunk answers on the loop (errors included)."""
    q = req.query
    m = d.mounts.get(q.get("mount", ""))
    if m is None or q.get("refetch") == "1" or (req.peer.uid != m.uid and not trusted(d, req)):
        return None
    ds = d.datasets.get(m.dsid)
    index_text = q.get("index", "")
    if ds is None or ds.uri.scheme == "file" or not is_digits(index_text) or len(index_text) > 19:
        return None  # a local directory's reader is checked on the loop (authz)
    index = int(index_text)
    try:
        _span(q.get("span"), index)
    except HTTPError:
        return None
    # A mount that takes a hand-off region (region=1) and that the daemon trusts (its
    # pages stay the daemon's while the mount maps them: silofs/sealed.py) has the chunk
    # received into its connection's region and named there, not sent as bytes.
    region = req.region if q.get("region") == "1" and trusted(d, req) else None
    got = d.cluster.thread_asks.read(
        ds, m, q.get("key", ""), index, q.get("version"), gone=req.gone, region=region
    )
    if got is None:
        return None
    headers = {"x-silofs-source": got.source}
    where = region.where(got.data) if region is not None else None
    if where is None:
        return Response(200, got.data, "application/octet-stream", headers)
    headers[sealed.REGION_HEADER] = where
    fd = None if region.sent else region.value
    region.sent = True  # a failed send ends the connection, and the region with it
    return Response(200, b"", "application/octet-stream", headers, fd=fd)


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


def backend_status(exc: BackendError) -> int:
    if isinstance(exc, ObjectChangedError):
        return 409
    if isinstance(exc, NotFoundError):
        return 404
    return 502


async def offer(d: Daemon, req: Request, mount_id: str) -> Response:
    # Only root or the daemon's own uid get here (the route's entry): the bytes come from
    # the mount, and other users' mounts read them once admitted.
    m = own_mount(d, req, mount_id)
    key = req.query.get("key", "")
    index = query_int(req, "index")
    content_id = req.query.get("content_id", "")
    with usage_error_as(409):  # not what the listing says
        outcome = d.offer_chunk(m, key, index, content_id, req.body)
    return json_response({"chunk": outcome})
