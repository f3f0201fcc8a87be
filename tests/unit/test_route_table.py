"""The route table and what its entries decide before a body is read: who finds and may
call a route, and how large a body they may send (control/router.py, node/routes.py)."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from silofs.control.client import ControlClient, ControlError
from silofs.control.peer import Peer, remote_peer
from silofs.control.router import Caller, Request, Response, Route, Router, json_response
from silofs.control.server import serve_unix
from silofs.node.routes import MAX_OFFER_BODY, PEER_ROUTES, REMOTE_ROUTES, ROUTES
from tests.unit.serving import serving

DEADLINE = 10.0


def test_every_route_says_who_may_call_it_and_what_it_does() -> None:
    assert len({(r.method, r.path) for r in ROUTES}) == len(ROUTES)
    for r in ROUTES:
        assert r.who, r
        assert r.doc and r.doc == r.doc.strip(), r
    # Only an offer (a chunk's bytes) takes a body larger than the listener's 1 MiB,
    # and only root or the daemon's uid may send one.
    large = [r for r in ROUTES if r.body_limit is not None]
    assert [(r.method, r.path, r.who) for r in large] == [
        ("PUT", "/v1/mounts/{mount_id}/offer", Caller.ROOT)
    ]
    assert large[0].body_limit == MAX_OFFER_BODY


def test_only_a_mounts_chunk_miss_moves_its_connection_to_a_thread() -> None:
    # A route marked threaded is one a local peer calls many times a second with
    # chunk-sized answers; no peer route (members have their own threads) and no route
    # with a large body.
    threaded = [(r.method, r.path, r.who) for r in ROUTES if r.threaded]
    assert threaded == [("GET", "/v1/chunks", Caller.LOCAL)]


def test_a_remote_controller_finds_the_reads_and_allocation_changes_only() -> None:
    assert REMOTE_ROUTES == {
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
        ("GET", "/v1/cluster"),
        ("PUT", "/v1/cluster"),
    }
    # Every change a controller may make is an admin's on the node too.
    for r in ROUTES:
        if r.method != "GET" and r.who & Caller.CONTROLLER:
            assert r.who & Caller.ADMIN and not r.who & Caller.LOCAL, r


def test_members_find_the_peer_routes_only_and_nobody_else_does() -> None:
    assert PEER_ROUTES == {
        ("GET", "/v1/peer/ping"),
        ("PUT", "/v1/peer/datasets"),
        ("GET", "/v1/peer/chunk"),
        ("GET", "/v1/peer/allocations"),
        ("PUT", "/v1/peer/allocations"),
    }
    for r in ROUTES:  # a peer route is a member's alone, and a member reaches no other
        assert (r.who == Caller.PEER) == (r.path.startswith("/v1/peer/")), r
    member = remote_peer("n1", frozenset({"10.0.0.1"}), node=True)
    stranger = remote_peer("n9", frozenset({"10.0.0.9"}), node=True)
    controller, local = remote_peer("controller"), Peer(pid=1, uid=0, gid=0)

    def roles(peer: Peer) -> Caller:  # node/authz.py roles, with 10.0.0.1 a member
        if peer.remote is None:
            return Caller.LOCAL | Caller.ADMIN | Caller.ROOT
        if peer.node:
            return Caller.PEER if "10.0.0.1" in peer.names else Caller(0)
        return Caller.CONTROLLER

    router = Router(ROUTES, roles=roles, refusal=lambda route, peer: "no")

    def status(method: str, path: str, peer: Peer) -> int:
        error = router.match(method, path.split("/")[1:], peer).error
        return 200 if error is None else error.status

    chunk = "/v1/peer/chunk"
    assert status("GET", chunk, local) == 404  # the Unix socket has no peer routes
    assert status("GET", chunk, controller) == 403
    assert status("GET", chunk, member) == 200
    assert status("GET", chunk, stranger) == 403
    assert status("GET", "/v1/status", member) == 403  # a member's certificate: nothing else
    assert status("PUT", "/v1/cluster", member) == 403
    assert status("GET", "/v1/chunks", member) == 404  # local-only routes do not exist for it
    assert status("GET", "/v1/status", stranger) == 403
    assert status("GET", "/v1/status", controller) == 200
    assert status("PUT", "/v1/cluster", controller) == 200


async def _ok(req: Request) -> Response:
    return json_response({"size": len(req.body)})


def _router(held: Caller) -> Router:
    """Three routes, and every peer holding the roles `held` (a remote one: CONTROLLER)."""
    return Router(
        [
            Route("GET", "/v1/open", _ok, Caller.LOCAL | Caller.CONTROLLER, doc="read"),
            Route("PUT", "/v1/admin", _ok, Caller.ADMIN | Caller.CONTROLLER, doc="change it"),
            Route("PUT", "/v1/big", _ok, Caller.ROOT, body_limit=4 << 20, doc="send bytes"),
        ],
        roles=lambda peer: Caller.CONTROLLER if peer.remote else held,
        refusal=lambda route, peer: f"only admins may {route.doc}",
    )


def test_the_router_hides_local_routes_from_a_remote_peer_and_refuses_local_peers() -> None:
    router = _router(Caller.LOCAL)
    local, remote = Peer(pid=1, uid=1000, gid=1000), remote_peer("controller")
    assert router.match("PUT", ["v1", "admin"], remote).error is None
    assert router.match("PUT", ["v1", "big"], remote).error.status == 404  # not there
    refused = router.match("PUT", ["v1", "admin"], local).error
    assert refused.status == 403 and refused.message == "only admins may change it"
    assert router.match("GET", ["v1", "admin"], local).error.status == 405
    # A refused peer gets the listener's limit, not the route's.
    assert router.match("PUT", ["v1", "big"], local).body_limit(1 << 20) == 1 << 20
    admin = _router(Caller.LOCAL | Caller.ROOT)
    assert admin.match("PUT", ["v1", "big"], local).body_limit(1 << 20) == 4 << 20


@contextmanager
def _served(tmp_path: Path, held: Caller) -> Iterator[str]:
    path = str(tmp_path / "s.sock")
    with serving(functools.partial(serve_unix, path, _router(held), max_body=1 << 20)):
        yield path


def test_the_server_reads_a_body_as_large_as_the_route_allows_the_peer(tmp_path: Path) -> None:
    body = {"pad": "x" * (2 << 20)}
    with _served(tmp_path, Caller.LOCAL | Caller.ROOT) as path:
        with ControlClient(path, timeout=DEADLINE) as c:
            assert c.request("PUT", "/v1/big", body)["size"] > 2 << 20
            with pytest.raises(ControlError) as err:  # other routes: the listener's limit
                c.request("PUT", "/v1/admin", body)
            assert err.value.status == 413
    with _served(tmp_path, Caller.LOCAL) as path:
        with ControlClient(path, timeout=DEADLINE) as c:
            with pytest.raises(ControlError) as err:  # may not call it: 1 MiB at most
                c.request("PUT", "/v1/big", body)
            assert err.value.status == 413
        with ControlClient(path, timeout=DEADLINE) as c:
            with pytest.raises(ControlError) as err:
                c.request("PUT", "/v1/big", {"small": 1})
            assert err.value.status == 403 and "only admins may send bytes" in str(err.value)
            assert c.request("GET", "/v1/open") == {"size": 0}  # kept alive after a 403
