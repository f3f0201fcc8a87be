"""The cluster cache tried the way an attacker, an operator or a careless user would: two
node daemons of one cluster on 127.0.0.1 (each its own port, cache dir, socket and FUSE
mount) reading one moto bucket through a proxy that counts the store's GETs.

- A member naming one object's version with another object's content id gets 409: the
  home never caches the first object's bytes under the second's chunk key (its mounts
  and every member asking it would be served them).
- Outsiders on the peer port (plain HTTP, an expired node certificate) get no answer; a
  member's certificate reaches nothing beyond the peer routes and changes nothing there;
  malformed peer requests are one-line 4xx; hundreds of idle and half-open connections
  leave status, uncached reads and the members' asks working.
- `silofs-ctl cluster set` with a bad list is one line and exit 2, and no node changes;
  a list naming a dead address never holds a read.
- A lying member (a compromised one, its certificate the cluster CA's) answering 409s
  that claim 64 MiB, or right values after seconds of 102s, holds no read past the
  bound of one exchange.

Each test ends by checking that every node still serves right bytes.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import re
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from urllib.parse import quote

import pytest

from silofs.control.client import ControlClient, ControlError, client_tls_context
from tests.support.asuser import Identity, as_user
from tests.support.cluster import odd_node_cert, write_cluster
from tests.support.cluster_run import ClusterDaemon, running_cluster
from tests.support.faultproxy import Fault, FaultPlan
from tests.support.fixtures import needs_fuse
from tests.support.net import free_port, free_ports
from tests.support.node import drop_file_cache
from tests.support.poll import wait_for

pytestmark = [needs_fuse, pytest.mark.fuse]

CHUNK = 256 << 10
NODES = 2
CLUSTER = "test-cluster"


def _tree(files: int) -> dict[str, bytes]:
    rnd = random.Random(2222)
    return {f"d/f{i}.bin": rnd.randbytes(2 * CHUNK + 17 * i + 1) for i in range(files)}


@pytest.fixture
def pair(
    request: pytest.FixtureRequest, s3_server, monkeypatch, bucket_name: str, tmp_path: Path
) -> Iterator[dict]:
    """Two running daemons of one cluster, each with the bucket mounted (6 files, or as
    many as the test's indirect parameter says)."""
    s3_server.apply_env(monkeypatch)
    tree = _tree(getattr(request, "param", 6))
    with running_cluster(s3_server, bucket_name, tree, tmp_path, NODES, "256K") as c:
        yield {
            "nodes": c.nodes, "mps": c.mps, "tree": tree, "proxy": c.proxy, "pki": c.pki,
            "uri": c.uri, "s3": s3_server, "bucket": bucket_name,
        }  # fmt: skip


def _ctx(pki: Path, name: str) -> ssl.SSLContext:
    return client_tls_context(
        str(pki / f"{name}.pem"), str(pki / f"{name}.key"), str(pki / "ca.pem")
    )


def _ask(
    node: ClusterDaemon, ctx: ssl.SSLContext, method: str, path: str, body: dict | None = None
) -> tuple[int, dict[str, str], bytes] | None:
    """One request over a new mutual-TLS connection, naming the cluster as a member
    does: (status, lower-cased headers, body), or None if no answer came."""
    conn = http.client.HTTPSConnection("127.0.0.1", node.spec.port, context=ctx, timeout=10)
    headers = {"x-silofs-cluster": CLUSTER}
    payload = None
    if body is not None:
        payload = json.dumps(body).encode()
        headers["content-type"] = "application/json"
    try:
        conn.request(method, path, body=payload, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def _status(node: ClusterDaemon, ctx: ssl.SSLContext, method: str, path: str,
            body: dict | None = None) -> int | None:  # fmt: skip
    got = _ask(node, ctx, method, path, body)
    return got[0] if got is not None else None


def _wrong_bytes(mp: Path, tree: dict[str, bytes], keys: list[str] | None = None) -> int:
    wrong = 0
    for key in keys or sorted(tree):
        drop_file_cache(mp / key)
        got, want = (mp / key).read_bytes(), tree[key]
        wrong += sum(a != b for a, b in zip(got, want, strict=False)) + abs(len(got) - len(want))
    return wrong


def _chunk_target(uri: str, key: str, cid: str, size: int, version: str, **more: str) -> str:
    q = {"ds": uri, "key": key, "cid": cid, "size": str(size), "version": version,
         "cs": str(CHUNK), "i": "0", "job": "attacker", **more}  # fmt: skip
    return "/v1/peer/chunk?" + "&".join(f"{k}={quote(v, safe='')}" for k, v in q.items())


def _serves_right(pair: dict) -> None:
    """Every node answers status and reads every file right (uncached on the first
    pass of a mount: its misses reach the daemon and, for half the chunks, the peer)."""
    for n, mp in zip(pair["nodes"], pair["mps"], strict=True):
        assert n.status()["cluster"]["name"] == CLUSTER
        assert _wrong_bytes(mp, pair["tree"]) == 0


def test_a_member_cannot_cache_one_objects_bytes_under_anothers_content_id(pair: dict) -> None:
    nodes, mps, tree = pair["nodes"], pair["mps"], pair["tree"]
    client = pair["s3"].client()
    a, b = sorted(tree)[1:3]
    head_a = client.head_object(Bucket=pair["bucket"], Key=a)
    head_b = client.head_object(Bucket=pair["bucket"], Key=b)
    etag_a, etag_b = head_a["ETag"].strip('"'), head_b["ETag"].strip('"')
    size_b = head_b["ContentLength"]
    member = _ctx(pair["pki"], "n1")
    # a's version (the home's GET passes If-Match) under b's content id (the chunk key).
    forged = _chunk_target(pair["uri"], a, f"s3:{etag_b}:{size_b}", size_b, etag_a, charged="1")
    got = _ask(nodes[0], member, "GET", forged)
    assert got is not None and got[0] == 409, got
    assert json.loads(got[2])["error"].count("\n") == 0
    # The same without the charge: refused before the charge round trip too.
    assert _status(nodes[0], member, "GET", forged.replace("charged=1", "charged=0")) == 409
    # The honest ask of the same chunk is served.
    honest = _chunk_target(pair["uri"], b, f"s3:{etag_b}:{size_b}", size_b, etag_b, charged="1")
    got = _ask(nodes[0], member, "GET", honest)
    assert got is not None and got[0] == 200 and got[2].endswith(tree[b][:CHUNK]), got and got[0]
    for mp in mps:
        assert _wrong_bytes(mp, tree, [b]) == 0


def test_outsiders_get_no_answer_and_a_member_reaches_only_the_peer_routes(
    pair: dict, tmp_path: Path
) -> None:
    nodes, pki = pair["nodes"], pair["pki"]
    home = nodes[0]
    # A node certificate of another CA naming a member (its name and host), and one of
    # the cluster's CA not valid before tomorrow: no handshake, no answer.
    foreign = tmp_path / "foreign"
    for args in (["init", str(foreign)], ["node", str(foreign), "n1", "--address", "127.0.0.1"]):
        res = _ctl("certs", *args)
        assert res.returncode == 0, res.stderr
    other_ca = client_tls_context(
        str(foreign / "n1.pem"), str(foreign / "n1.key"), str(pki / "ca.pem")
    )
    assert _status(home, other_ca, "GET", "/v1/peer/ping") is None
    odd_node_cert(pki, "future", "127.0.0.1", future=True)
    assert _status(home, _ctx(pki, "future"), "GET", "/v1/peer/ping") is None
    # Plain HTTP on the TLS port: closed, not a byte of HTTP back.
    with socket.create_connection(("127.0.0.1", home.spec.port), timeout=10) as s:
        s.sendall(f"GET /v1/peer/ping HTTP/1.1\r\nx-silofs-cluster: {CLUSTER}\r\n\r\n".encode())
        try:
            answer = s.recv(4096)
        except ConnectionResetError:
            answer = b""
    assert not answer.startswith(b"HTTP"), answer
    odd_node_cert(pki, "expired", "127.0.0.1", expired=True)
    assert _status(home, _ctx(pki, "expired"), "GET", "/v1/peer/ping") is None
    assert _status(home, _ctx(pki, "legacy"), "GET", "/v1/peer/ping") is None
    member = _ctx(pki, "n1")
    assert _status(home, member, "GET", "/v1/peer/ping") == 200
    before = home.cluster()
    ds = quote(pair["uri"], safe="")
    for method, path, body in [
        ("PUT", f"/v1/datasets/{ds}/cache", {"bytes": 1}),
        ("PUT", f"/v1/datasets/{ds}/admission", {"mode": "off"}),
        ("DELETE", f"/v1/datasets/{ds}", None),
        ("PUT", "/v1/cluster", {"name": "x", "members": ["tls://10.9.9.9:1"]}),
        ("PUT", "/v1/jobs/j/io", {"rate": "1MiB/s"}),
        ("DELETE", "/v1/jobs/j", None),
        ("GET", "/v1/status", None),
        ("GET", "/v1/cluster", None),
        ("GET", "/metrics", None),
    ]:
        assert _status(home, member, method, path, body) == 403, (method, path)
    for method, path, body in [  # local routes: not there at all for a remote peer
        ("POST", "/v1/datasets", {"uri": "file:///etc/"}),
        ("POST", "/v1/mounts", {"uri": pair["uri"]}),
        ("GET", "/v1/chunks?mount=m&key=d/f0.bin&index=0", None),
    ]:
        assert _status(home, member, method, path, body) in (404, 405), (method, path)
    after = home.cluster()
    for key in ("version", "allocations_version", "shares"):
        assert after[key] == before[key], key
    assert [m["address"] for m in after["members"]] == [m["address"] for m in before["members"]]
    assert home.status()["datasets"][0]["uri"] == pair["uri"]
    _serves_right(pair)


def test_malformed_peer_requests_are_one_line_4xx_and_leave_nothing_behind(pair: dict) -> None:
    nodes, uri = pair["nodes"], pair["uri"]
    home, member = nodes[0], _ctx(pair["pki"], "n1")
    cid, good = "s3:e:10", {"size": 10, "version": "e"}
    cases = [
        (_chunk_target(uri, "../../etc/passwd", cid, **good), 400),  # path-like key
        (_chunk_target(uri, "d//f0.bin", cid, **good), 400),
        (_chunk_target(uri, "a" * 5000, cid, **good), 400),  # over-long key
        (_chunk_target(uri, "d/f0.bin", cid, size=10, version="e", i="7"), 400),  # no such chunk
        (_chunk_target(uri, "d/f0.bin", cid, size=10, version="e", cs="1"), 400),
        (_chunk_target(uri, "d/f0.bin", cid, **good).replace("&job=attacker", ""), 400),
        (_chunk_target("s3://another-bucket/", "a", cid, **good), 404),  # not open here
        ("/v1/peer/chunk?ds=" + "x" * 20000, 431),  # a head over the listener's limit
    ]
    for target, want in cases:
        got = _ask(home, member, "GET", target)
        assert got is not None and got[0] == want, (target[:120], got and got[:2])
        assert got[2].count(b"\n") <= 1 and b"error" in got[2] or got[0] == 404
    unknown = _ask(home, member, "GET", _chunk_target("s3://another-bucket/", "a", cid, **good))
    assert unknown is not None and unknown[1].get("x-silofs-unknown-dataset") == "1"
    for body in (
        {"uri": "file:///etc/", "options": {}},  # a local directory this node has not open
        {"uri": "s3://another-bucket/", "options": {"endpoint_url": "http://10.9.9.9/"}},
        {"uri": "s3://another-bucket/", "options": {"profile": "admin"}},
    ):
        assert _status(home, member, "PUT", "/v1/peer/datasets", body) == 403, body
    assert _status(home, member, "PUT", "/v1/peer/datasets", {"uri": "s3://"}) == 400
    big = {"version": 1, "shares": {f"s3://b{i}/": 1 for i in range(80000)}}
    assert _status(home, member, "PUT", "/v1/peer/allocations", big) == 413
    # Nothing of the above is in the home's status: only the dataset it has open.
    view = home.cluster()
    assert [d["uri"] for d in home.status()["datasets"]] == [uri]
    assert list(view["shares"]) == []
    _serves_right(pair)


def _exchange(sock: socket.socket, requests: list[bytes]) -> list[bytes]:
    """Send `requests` one after another on one connection (each waits for the one
    before to be answered); the status line of every answer until the close."""
    sock.settimeout(10)
    got = b""
    for req in requests:
        sock.sendall(req)
        while got.count(b"HTTP/1.1 ") < requests.index(req) + 1:
            more = sock.recv(1 << 20)
            if not more:
                break
            got += more
    with contextlib.suppress(OSError):
        while more := sock.recv(1 << 20):
            got += more
    # An answer's head may follow the body before it with no line break between.
    return re.findall(rb"HTTP/1\.1 \d{3}", got)


def test_digits_int_refuses_are_a_one_line_400_on_every_path(pair: dict) -> None:
    """ "²" ("\xb2" in latin-1, %C2%B2 in a query) passes str.isdigit() and fails int():
    a member's or a local client's request holding it was a traceback in the daemon's
    log and a connection dropped without an answer. Now a 400 (the teardown checks the
    log), on the loop and on connections served by threads, and everyone serves on."""
    home = pair["nodes"][0]
    mount = home.status()["mounts"][0]["id"]
    chunk = f"GET /v1/chunks?mount={mount}&key=d%2Ff0.bin&index="
    good = f"{chunk}0 HTTP/1.1\r\nhost: x\r\n\r\n".encode()  # makes the connection threaded
    bad_index = f"{chunk}%C2%B2 HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode()
    bad_length = b"GET /v1/status HTTP/1.1\r\nhost: x\r\ncontent-length: \xb2\r\n\r\n"
    for requests in ([bad_index], [good, bad_index], [good, bad_length]):
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(home.socket)
            got = _exchange(s, requests)
        assert got[-1].startswith(b"HTTP/1.1 400"), (requests[-1][:60], got)
    ping = f"GET /v1/peer/ping HTTP/1.1\r\nhost: x\r\nx-silofs-cluster: {CLUSTER}\r\n"
    bad_ping = (ping + "content-length: \xb2\r\n\r\n").encode("latin-1")
    raw = socket.create_connection(("127.0.0.1", home.spec.port), 10)
    with _ctx(pair["pki"], "n1").wrap_socket(raw, server_hostname="127.0.0.1") as s:
        got = _exchange(s, [ping.encode() + b"\r\n", bad_ping])  # a member's thread
    assert got == [b"HTTP/1.1 200", b"HTTP/1.1 400"], got
    _serves_right(pair)


def _ctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "silofs_ctl", *args], capture_output=True, text=True, timeout=60
    )


def test_cluster_set_mistakes_are_one_line_and_no_node_changes(pair: dict) -> None:
    nodes = pair["nodes"]
    sockets = ",".join(n.socket for n in nodes)
    addresses = [n.spec.address for n in nodes]
    before = [n.cluster()["version"] for n in nodes]
    for members, extra in [
        ([*addresses, "tls://127.0.0.1:99999"], []),  # a typo'd port
        ([*addresses, addresses[0].replace("tls://", "")], []),  # no scheme
        ([*addresses, addresses[1].upper()], []),  # the same member twice
        ([*addresses, "tls://0.0.0.0:7470"], []),  # tcp_listen's wildcard: each node itself
        ([*addresses, "tls://010.0.0.1:7470"], []),  # 8.0.0.1 to the resolver (octal)
        ([*addresses, "tls://[::1]:7470", "tls://[0:0::1]:7470"], []),  # one address twice
        (addresses, ["--weight", f"{addresses[0]}x=2"]),  # a weight of no member
        (addresses, ["--weight", f"{addresses[0]}=0"]),
        (addresses, ["--name", "two words"]),
        (addresses, ["--name", "\u96c6\u7fa4"]),  # not ASCII: no peer request could carry it
    ]:
        res = _ctl("cluster", "set", "--nodes", sockets, "--members", ",".join(members), *extra)
        assert res.returncode == 2, (members, extra, res.stdout, res.stderr)
        assert res.stderr.count("\n") == 1 and "error" in res.stderr, res.stderr
        assert res.stdout == ""
    res = _ctl("cluster", "set", "--nodes", sockets, "--members", "")
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert [n.cluster()["version"] for n in nodes] == before
    # A weight written with another case is the member's (the nodes compare canonically).
    res = _ctl("cluster", "set", "--nodes", sockets, "--members", ",".join(addresses),
               "--weight", f"{addresses[1].upper().replace('TLS://', 'tls://')}=3")  # fmt: skip
    assert res.returncode == 0, res.stderr
    for n in nodes:
        view = n.cluster()
        weights = {m["address"]: m["weight"] for m in view["members"]}
        assert weights == {addresses[0]: 1.0, addresses[1]: 3.0}
        # silofs.toml's peer settings stay: the list named members only.
        assert view["peer_timeout_seconds"] == 1.0, view["peer_timeout_seconds"]
    _serves_right(pair)


def _push_dead_and_read(pair: dict, dead: list[str], within: float) -> None:
    """Push the running nodes and `dead` as the member list; every mount then reads
    every file right within `within` seconds."""
    nodes = pair["nodes"]
    members = ",".join([*(n.spec.address for n in nodes), *dead])
    res = _ctl("cluster", "set", "--nodes", ",".join(n.socket for n in nodes), "--members", members)
    assert res.returncode == 0, res.stderr
    t0 = time.monotonic()
    for mp in pair["mps"]:
        assert _wrong_bytes(mp, pair["tree"]) == 0
    assert time.monotonic() - t0 < within


def test_a_member_list_naming_a_dead_address_never_holds_a_read(pair: dict) -> None:
    nodes = pair["nodes"]
    dead = f"tls://127.0.0.1:{free_port()}"  # nothing listens: a typo'd or gone member
    _push_dead_and_read(pair, [dead], 30)
    for n in nodes:
        state = {m["address"]: m["state"] for m in n.cluster()["members"]}
        assert state[dead] == "down"
        wait_for(lambda n=n: all(m["state"] == "up" for m in n.cluster()["members"]
                                 if m["address"] != dead), what="the live members up")  # fmt: skip


def test_idle_and_half_open_connections_leave_the_node_and_its_members_serving(
    pair: dict,
) -> None:
    nodes, pki = pair["nodes"], pair["pki"]
    home = nodes[0]
    with ExitStack() as held:
        # Idle members' connections (handshaken, never a request), then connections
        # that never begin their handshake, well past the listener's limit.
        for _ in range(8):
            raw = held.enter_context(socket.create_connection(("127.0.0.1", home.spec.port)))
            held.enter_context(_ctx(pki, "n1").wrap_socket(raw, server_hostname="127.0.0.1"))
        opened = 0
        for _ in range(300):
            try:
                held.enter_context(socket.create_connection(("127.0.0.1", home.spec.port), 2))
                opened += 1
            except OSError:
                break
        assert opened > 64
        assert home.status()["cluster"]["name"] == CLUSTER
        t0 = time.monotonic()
        for mp in pair["mps"]:  # uncached: half the chunks homed at the other node
            assert _wrong_bytes(mp, pair["tree"]) == 0
        assert time.monotonic() - t0 < 30
    # Gone: the member's asks reach the home again.
    wait_for(lambda: _status(home, _ctx(pki, "n1"), "GET", "/v1/peer/ping") == 200,
             what="the peer port to answer again")  # fmt: skip


def _as_local_user(sock: str, calls: list[tuple[str, str, dict | None]]) -> list[int]:
    with ControlClient(sock, timeout=30) as c:
        return [c.request_raw(method, path, body)[0] for method, path, body in calls]


def test_a_local_user_reaches_no_peer_route_and_cannot_change_the_members(
    tmp_path: Path,
) -> None:
    # The socket where any user may reach it (pytest's tmp_path is root's alone).
    public = Path(tempfile.mkdtemp(prefix="silofs-a22-", dir="/tmp"))
    public.chmod(0o755)
    specs = write_cluster(tmp_path, ["127.0.0.1"] * 2, free_ports(2))
    node = ClusterDaemon(specs[0], socket=str(public / "ctl.sock"))
    try:
        node.start()
        before = node.cluster()
        ask = _chunk_target("s3://b/", "a", "s3:e:10", 10, "e")
        calls: list[tuple[str, str, dict | None]] = [
            ("GET", "/v1/peer/ping", None),
            ("GET", ask, None),
            ("PUT", "/v1/peer/datasets", {"uri": "s3://b/", "options": {}}),
            ("GET", "/v1/peer/allocations", None),
            ("PUT", "/v1/peer/allocations", {"version": 1, "shares": {"s3://b/": 1}}),
            ("PUT", "/v1/cluster", {"name": CLUSTER, "members": [specs[0].address]}),
            ("PUT", f"/v1/datasets/{quote('s3://b/', safe='')}/cache", {"bytes": 1}),
            ("GET", "/v1/cluster", None),
        ]
        got = as_user(Identity.nobody(), _as_local_user, node.socket, calls)
        assert got[:5] == [404] * 5, got  # the Unix socket has no peer route, for anyone
        assert got[5:] == [403, 403, 200], got  # admins' changes; reading is public
        after = node.cluster()
        assert (after["version"], after["shares"]) == (before["version"], before["shares"])
        assert [m["address"] for m in after["members"]] == [s.address for s in specs]
    finally:
        node.cleanup()
        shutil.rmtree(public, ignore_errors=True)


@pytest.mark.parametrize("pair", [48], indirect=True)
def test_member_lists_pushed_while_reads_are_in_flight_serve_no_wrong_byte(pair: dict) -> None:
    """Lists that add a dead member, reorder and restore the members, pushed to both
    nodes over and over while both read every file for the first time (each chunk a
    miss: from its home, or the store): no wrong byte, no failed read, no error logged."""
    nodes, mps, tree = pair["nodes"], pair["mps"], pair["tree"]
    both = [n.spec.address for n in nodes]
    dead = f"tls://127.0.0.1:{free_port()}"
    lists = [[*both, dead], [both[1], both[0]], both]
    wrong: list[int] = []
    errors: list[BaseException] = []

    def reader(mp: Path) -> None:
        try:
            wrong.append(_wrong_bytes(mp, tree))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(mp,)) for mp in mps]
    for t in threads:
        t.start()
    pushed = 0
    try:
        while any(t.is_alive() for t in threads):
            body = {"name": CLUSTER, "members": lists[pushed % len(lists)]}
            for n in nodes:
                n.request("PUT", "/v1/cluster", body)
            pushed += 1
    finally:
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors
    assert wrong == [0, 0]
    peer = [n.status()["datasets"][0]["peer"] for n in nodes]
    assert pushed >= 3 and sum(p["requests_out"] for p in peer) > 0, (pushed, peer)
    _serves_right(pair)


# 12 files: the busy answers need a chunk homed at the other node, and placement hashes
# the members' ports (new each run): none of 6 files' 18 chunks was in 2**-18 = 3.8e-6
# of runs; of 36, 1.5e-11.
@pytest.mark.parametrize("pair", [12], indirect=True)
def test_a_home_whose_serve_cap_is_full_says_so_at_once_and_stays_up(pair: dict) -> None:
    """A peer_serve_rate far below what members ask (1 KiB/s, 256 KiB chunks): a home
    whose cap would hold an answer past peer_timeout_seconds answers busy (429) at once,
    and the asker reads the chunk from the store; the home stays up. Before, each ask
    waited 60 s of 102s on the cap, then the member was taken for dead (a file's read
    took 94 s)."""
    nodes, mps, tree = pair["nodes"], pair["mps"], pair["tree"]
    both = [n.spec.address for n in nodes]
    body = {"name": CLUSTER, "members": both, "peer_serve_rate": "1KiB/s",
            "peer_timeout_seconds": 1.0, "peer_backoff_seconds": 0.5}  # fmt: skip
    for n in nodes:
        n.request("PUT", "/v1/cluster", body)
    t0 = time.monotonic()
    assert _wrong_bytes(mps[0], tree) == 0
    assert time.monotonic() - t0 < 20
    other = nodes[0].member(both[1])
    assert other["state"] == "up" and other["failures"] == 0, other
    assert other["errors"].get("busy", 0) >= 1 and "timeout" not in other["errors"], other
    assert other["store_fallbacks"] >= 1, other
    _serves_right(pair)


def test_a_store_down_while_the_homes_are_up_serves_every_cached_chunk(pair: dict) -> None:
    nodes, mps, tree, proxy = pair["nodes"], pair["mps"], pair["tree"], pair["proxy"]
    # Every chunk cached at its home (node 0 reads all: its own chunks admitted here,
    # the others by node 1 as their home).
    assert _wrong_bytes(mps[0], tree) == 0
    for n in nodes:
        wait_for(lambda n=n: n.status()["node"]["writer"]["pending_chunks"] == 0, what="commits")
    proxy.set_plan(FaultPlan(faults=[Fault("http_503", probability=1.0)]))
    before = proxy.stats["requests"]
    assert _wrong_bytes(mps[1], tree) == 0  # a mount that never read them: misses all
    assert proxy.stats["requests"] == before  # no store request at all
    assert nodes[1].status()["datasets"][0]["peer"]["store_fallbacks"] == 0
    for n in nodes:  # (a ping before the other was started may have failed: not since)
        assert all(m["state"] == "up" for m in n.cluster()["members"])


def test_a_share_of_zero_caches_nothing_and_one_beyond_the_disks_changes_nothing(
    pair: dict,
) -> None:
    nodes, mps, tree = pair["nodes"], pair["mps"], pair["tree"]
    path = f"/v1/datasets/{quote(pair['uri'], safe='')}/cache"
    nodes[0].request("PUT", path, {"bytes": 0})
    for n in nodes:
        wait_for(lambda n=n: n.status()["datasets"][0]["cluster_share"] == 0, what="the share")
    with pytest.raises(ControlError) as err:  # each node's part would exceed its cache
        nodes[1].request("PUT", path, {"bytes": 1 << 40})
    assert err.value.status in (400, 409) and "exceed" in str(err.value), err.value
    for mp in mps:  # every read right: from the store, through the homes, nothing kept
        assert _wrong_bytes(mp, tree) == 0
    for n in nodes:
        wait_for(lambda n=n: n.status()["node"]["writer"]["pending_chunks"] == 0, what="commits")
        d = n.status()["datasets"][0]
        assert (d["cluster_share"], d["cluster_part"], d["cached_bytes"]) == (0, 0, 0), d


def _threads_and_fds(pid: int) -> tuple[int, int]:
    return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))


def test_a_list_of_a_thousand_members_mostly_dead_leaves_reads_and_status_working(
    pair: dict,
) -> None:
    """An operator pushes 1,000 members of which only the two running nodes listen (a
    typo'd range, nodes not up yet): most chunks are homed at dead members. Every read
    is right and ends in bounded time, status answers, and the daemon's threads and
    file descriptors do not grow with the list."""
    nodes = pair["nodes"]
    before = [_threads_and_fds(n.daemon_pid) for n in nodes]
    _push_dead_and_read(pair, [f"tls://127.0.0.1:{p}" for p in free_ports(998)], 60)
    peak = [(0, 0)] * len(nodes)
    for _ in range(20):  # the prober pings the dead ones as their backoffs end
        for i, n in enumerate(nodes):
            t1 = time.monotonic()
            assert len(n.cluster()["members"]) == 1000
            assert time.monotonic() - t1 < 5
            now = _threads_and_fds(n.daemon_pid)
            peak[i] = (max(peak[i][0], now[0]), max(peak[i][1], now[1]))
        time.sleep(0.1)  # sampling, not synchronisation
    for b, p in zip(before, peak, strict=True):  # 400 threads before pings were capped
        assert p[0] < b[0] + 100 and p[1] < b[1] + 200, (before, peak)
    _serves_right(pair)


class LyingMember:
    """A compromised member on 127.0.0.1: a TLS listener with a node certificate of the
    cluster's CA for 127.0.0.1 (so the nodes take it for the member they pushed), which
    answers pings as a member does and every chunk ask as `mode` says:
    "error_stall", a 409 whose head claims a 64 MiB body, then nothing; "slow_right",
    102s for SLOW_SECONDS, then the chunk's right value."""

    SLOW_SECONDS = 4.0

    def __init__(self, pki: Path, tree: dict[str, bytes], mode: str) -> None:
        odd_node_cert(pki, "liar", "127.0.0.1")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(pki / "liar.pem", pki / "liar.key")
        ctx.load_verify_locations(pki / "ca.pem")
        ctx.verify_mode = ssl.CERT_REQUIRED
        self.ctx, self.tree, self.mode = ctx, tree, mode
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"tls://127.0.0.1:{self.sock.getsockname()[1]}"
        self.asks = 0
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                raw, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        with (
            contextlib.suppress(OSError, ssl.SSLError),
            self.ctx.wrap_socket(raw, server_side=True) as tls,
        ):
            buf = b""
            while True:
                while b"\r\n\r\n" not in buf:
                    more = tls.recv(65536)
                    if not more:
                        return
                    buf += more
                head, _, buf = buf.partition(b"\r\n\r\n")
                target = head.split(b"\r\n")[0].split()[1].decode()
                if target.startswith("/v1/peer/ping"):
                    self._send(tls, 200, json.dumps({"name": CLUSTER}).encode())
                elif not target.startswith("/v1/peer/chunk?") or not self._chunk(tls, target):
                    return

    @staticmethod
    def _send(tls: ssl.SSLSocket, status: int, body: bytes, length: int | None = None) -> None:
        n = len(body) if length is None else length
        tls.sendall(f"HTTP/1.1 {status} X\r\ncontent-length: {n}\r\n\r\n".encode() + body)

    def _chunk(self, tls: ssl.SSLSocket, target: str) -> bool:
        """Answer one chunk ask; False to close the connection."""
        from urllib.parse import parse_qsl, urlsplit

        from silofs.cache.format import encode_chunk

        self.asks += 1
        q = dict(parse_qsl(urlsplit(target).query))
        if self.mode == "error_stall":
            self._send(tls, 409, b"", length=64 << 20)
            self.stop.wait(120)
            return False
        for _ in range(int(self.SLOW_SECONDS / 0.25)):
            tls.sendall(b"HTTP/1.1 102 Processing\r\n\r\n")
            if self.stop.wait(0.25):
                return False
        cs, i = int(q["cs"]), int(q["i"])
        data = self.tree[q["key"]][i * cs : (i + 1) * cs]
        self._send(tls, 200, encode_chunk(1, i, cs, q["key"], q["cid"], data))
        return True


def _read_chunk(mp: Path, key: str, index: int, want: bytes) -> tuple[float, int]:
    """One chunk of a file read on its own (one miss): (seconds it took, wrong bytes)."""
    t0 = time.monotonic()
    fd = os.open(mp / key, os.O_RDONLY)
    try:
        got = os.pread(fd, CHUNK, index * CHUNK)
    finally:
        os.close(fd)
    part = want[index * CHUNK : (index + 1) * CHUNK]
    wrong = sum(a != b for a, b in zip(got, part, strict=False)) + abs(len(got) - len(part))
    return time.monotonic() - t0, wrong


@pytest.mark.parametrize("pair", [24], indirect=True)
@pytest.mark.parametrize("mode", ["error_stall", "slow_right"])
def test_a_lying_member_holds_no_read_past_the_bound(pair: dict, mode: str) -> None:
    """A compromised member pushed into the list (its certificate the cluster CA's) and
    home of a third of the chunks, answering each ask with a 409 claiming a 64 MiB body
    and then nothing, or right but only after 4 s of 102s. Every chunk of 24 files read
    at once on a node, each on its own: each read ends within the bound of one
    exchange (plus the store), right. Before, a 409 held each of its chunks' reads a
    minute (its body waited for at the floor rate), and the slow member's reads queued
    4 at a time behind each other (the last of ~24 waiting 6 answers)."""
    nodes, mps, tree = pair["nodes"], pair["mps"], pair["tree"]
    liar = LyingMember(pair["pki"], tree, mode)
    try:
        members = [*(n.spec.address for n in nodes), liar.address]
        for n in nodes:
            n.request("PUT", "/v1/cluster", {"name": CLUSTER, "members": members})
        for n in nodes:
            wait_for(lambda n=n: n.member(liar.address)["state"] == "up", what="the liar up")
        chunks = [(k, i) for k in sorted(tree) for i in range(-(-len(tree[k]) // CHUNK))]
        for key in tree:
            drop_file_cache(mps[0] / key)
        with ThreadPoolExecutor(len(chunks)) as pool:
            reads = list(pool.map(lambda c: _read_chunk(mps[0], *c, tree[c[0]]), chunks))
        assert [wrong for _, wrong in reads] == [0] * len(chunks)
        seen = nodes[0].member(liar.address)
        assert liar.asks >= 4 and seen["store_fallbacks"] >= 1, (liar.asks, seen)
        slowest = max(took for took, _ in reads)
        assert slowest < 3 * LyingMember.SLOW_SECONDS, (slowest, seen)  # before: ~6 answers
    finally:
        liar.close()
    _serves_right(pair)
