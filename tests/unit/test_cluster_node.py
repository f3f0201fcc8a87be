"""A node joining a cluster (node/cluster.py): which member it is, the certificate it
needs, the list that wins at start, and its peer figures in status and /metrics."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from silofs.config import ClusterSettings, MemberSpec, NodeSettings
from silofs.errors import UsageError
from silofs.node.daemon import Daemon
from silofs.node.metrics import render
from silofs.node.views import status_view


def settings(
    tmp_path: Path, pki: Path, cluster: ClusterSettings | None, cert: str = "n0"
) -> NodeSettings:
    return NodeSettings(
        socket=str(tmp_path / "ctl.sock"),
        cache_dir=str(tmp_path / "cache"),
        cache_size=64 << 20,
        tcp_listen="127.0.0.1:7001",
        tls_cert=str(pki / f"{cert}.pem"),
        tls_key=str(pki / f"{cert}.key"),
        tls_client_ca=str(pki / "ca.pem"),
        cluster=cluster,
    )


def members(*ports: int, version: int = 1) -> ClusterSettings:
    return ClusterSettings(
        "c", tuple(MemberSpec(f"tls://127.0.0.1:{p}") for p in ports), version=version
    )


@pytest.fixture
def made(tmp_path: Path) -> Iterator[list[Daemon]]:
    daemons: list[Daemon] = []
    yield daemons
    for d in daemons:
        d.cluster.close()
        d.store.close()
        os.close(d.lock_fd)


def test_without_an_address_a_node_is_the_member_of_its_port_and_certificate_names(
    tmp_path: Path, pki: Path, made: list[Daemon]
) -> None:
    d = Daemon(settings(tmp_path, pki, members(7000, 7001, 7002)))
    made.append(d)
    assert d.cluster.membership is not None
    assert d.cluster.membership.self_address == "tls://127.0.0.1:7001"


def test_a_node_in_none_of_the_members_does_not_start(tmp_path: Path, pki: Path) -> None:
    with pytest.raises(UsageError, match="cannot tell which member"):
        Daemon(settings(tmp_path, pki, members(7000, 7002)))


def test_a_certificate_made_before_clusters_is_one_line_asking_for_a_new_one(
    tmp_path: Path, pki: Path
) -> None:
    with pytest.raises(UsageError) as err:
        Daemon(settings(tmp_path, pki, members(7000, 7001), cert="legacy"))
    assert "needs a new certificate to join a cluster" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_pushed_list_newer_than_the_files_wins_at_start(
    tmp_path: Path, pki: Path, made: list[Daemon]
) -> None:
    d = Daemon(settings(tmp_path, pki, members(7000, 7001, version=10)))

    async def push() -> None:
        async with trio.open_nursery():
            await d.cluster.push({"name": "c", "members": ["tls://127.0.0.1:7001"], "version": 20})

    trio.run(push)
    d.cluster.close()
    d.store.close()
    os.close(d.lock_fd)
    again = Daemon(settings(tmp_path, pki, members(7000, 7001, version=10)))
    made.append(again)
    assert again.cluster.config is not None and again.cluster.config.version == 20
    assert [m.address for m in again.cluster.config.members] == ["tls://127.0.0.1:7001"]
    # An edit of silofs.toml after the push (a newer file) wins at the next start.
    again.cluster.close()
    again.store.close()
    os.close(again.lock_fd)
    made.clear()
    edited = Daemon(settings(tmp_path, pki, members(7000, 7001, 7002, version=30)))
    made.append(edited)
    assert edited.cluster.config is not None and len(edited.cluster.config.members) == 3


def test_a_push_that_names_no_peer_setting_keeps_the_ones_in_force(
    tmp_path: Path, pki: Path, made: list[Daemon]
) -> None:
    """`silofs-ctl cluster set` names members only: silofs.toml's serve cap, timeout and
    keep_peer_copies stay (before, each push put the defaults in force, and persisted
    them); one a push names changes, and stays through the next push that names none."""
    own = dataclasses.replace(
        members(7000, 7001),
        peer_timeout_seconds=5.0,
        peer_serve_rate=100 << 20,
        keep_peer_copies=True,
    )
    d = Daemon(settings(tmp_path, pki, own))
    made.append(d)

    async def push(version: int, **more: object) -> None:
        body = {"name": "c", "members": ["tls://127.0.0.1:7001"], "version": version, **more}
        await d.cluster.push(body)

    trio.run(push, 20)
    c = d.cluster.config
    assert c is not None and [m.address for m in c.members] == ["tls://127.0.0.1:7001"]
    assert (c.peer_timeout_seconds, c.peer_serve_rate, c.keep_peer_copies) == (5.0, 100 << 20, True)
    trio.run(functools.partial(push, 30, peer_serve_rate="unlimited", peer_timeout_seconds=3))
    trio.run(push, 40)
    c = d.cluster.config
    assert c is not None and c.version == 40
    assert (c.peer_timeout_seconds, c.peer_serve_rate, c.keep_peer_copies) == (3.0, None, True)


def test_a_push_without_a_version_is_newer_than_the_list_in_force_after_a_clock_step_back(
    tmp_path: Path, pki: Path, made: list[Daemon]
) -> None:
    """A body without "version" takes the clock's; a clock stepped back a day since the
    list in force was pushed (NTP, `date -s`) made every such push "not newer" (409)
    for a day. It is now one past the list in force."""
    d = Daemon(settings(tmp_path, pki, members(7000, 7001)))
    made.append(d)
    ahead = time.time_ns() // 1000 + 86400 * 10**6  # pushed under tomorrow's clock

    async def push(body: dict) -> None:
        await d.cluster.push({"name": "c", **body})

    trio.run(push, {"members": ["tls://127.0.0.1:7001"], "version": ahead})
    trio.run(push, {"members": ["tls://127.0.0.1:7000", "tls://127.0.0.1:7001"]})
    c = d.cluster.config
    assert c is not None and c.version == ahead + 1 and len(c.members) == 2


def test_peer_figures_in_status_and_metrics(tmp_path: Path, pki: Path, made: list[Daemon]) -> None:
    d = Daemon(settings(tmp_path, pki, members(7000, 7001)))
    made.append(d)
    assert d.cluster.membership is not None
    peer = d.cluster.membership.members["tls://127.0.0.1:7000"]
    peer.counters.requests_out = 3
    peer.counters.error("corrupt")
    d.cluster.dataset_counters("s3://b/").bytes_in = 1234
    d.cluster.incoming_counters("n1").requests_in = 2
    d.cluster.membership.mark_down(peer.address, "refused")
    view = status_view(d)["cluster"]
    assert view["name"] == "c" and view["address"] == "tls://127.0.0.1:7001"
    by = {m["address"]: m for m in view["members"]}
    assert by[peer.address]["state"] == "down" and by[peer.address]["errors"] == {"corrupt": 1}
    assert view["peers_in"]["n1"]["requests_in"] == 2
    text = render(status_view(d))
    for line in (
        'silofs_peer_member_up{member="tls://127.0.0.1:7000"} 0.0',
        'silofs_peer_requests_out_total{member="tls://127.0.0.1:7000"} 3.0',
        'silofs_peer_errors_total{member="tls://127.0.0.1:7000",reason="corrupt"} 1.0',
        'silofs_peer_dataset_bytes_in_total{dataset="s3://b/"} 1234.0',
        'silofs_peer_in_requests_in_total{peer="n1"} 2.0',
    ):
        assert line in text, line
    alone = Daemon(settings(tmp_path / "alone", pki, None))
    made.append(alone)
    assert status_view(alone)["cluster"] is None
    assert "silofs_peer_" not in render(status_view(alone))


def test_a_list_naming_this_node_twice_under_two_of_its_names_is_refused(
    tmp_path: Path, pki: Path, made: list[Daemon]
) -> None:
    from silofs_ctl.certs_cmd import node_cert

    node_cert(str(pki), "aliased", ["127.0.0.1", "localhost"])
    me = "tls://127.0.0.1:7001"
    twice = ClusterSettings(
        "c", (MemberSpec(me), MemberSpec("tls://localhost:7001"), MemberSpec("tls://127.0.0.1:7000")),
        address=me, version=1,
    )  # fmt: skip
    with pytest.raises(UsageError, match="localhost:7001 is this node"):
        made.append(Daemon(settings(tmp_path, pki, twice, cert="aliased")))


def test_a_certificate_naming_several_nodes_is_no_alias(
    tmp_path: Path, pki: Path, made: list[Daemon]
) -> None:
    """One certificate may name several nodes (a shared or wildcard one): a member on
    this node's port under another of its names is this node only if that name reaches
    this node's listener. A name that resolves nowhere here (a member not in DNS yet, or
    down) is a member like any other."""
    from silofs_ctl.certs_cmd import node_cert

    node_cert(str(pki), "shared", ["127.0.0.1", "other-node.invalid"])
    me = "tls://127.0.0.1:7001"
    config = ClusterSettings(
        "c", (MemberSpec(me), MemberSpec("tls://other-node.invalid:7001")), address=me, version=1
    )
    d = Daemon(settings(tmp_path, pki, config, cert="shared"))
    made.append(d)
    assert status_view(d)["cluster"]["members"]


def test_a_thousand_members_with_dns_down_start_within_the_lookup_bound(
    tmp_path: Path, pki: Path, made: list[Daemon], monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,000 members on this node's port named by host names, DNS not answering (each
    lookup 0.5 s here; glibc's own is 5 s a try): looked up one after another the start
    took 500 s. Lookups run RESOLVE_THREADS at once for RESOLVE_SECONDS in all, the
    unanswered ones are not this node, and an alias answered in time is still found."""
    from silofs.node import cluster as cluster_mod

    real = cluster_mod._resolve
    stop = threading.Event()

    def slow(host: str) -> set[str]:
        if host.startswith("node-"):
            stop.wait(0.5)  # a DNS server that does not answer
            return set()
        return real(host)

    monkeypatch.setattr(cluster_mod, "_resolve", slow)
    monkeypatch.setattr(cluster_mod, "RESOLVE_SECONDS", 2.0)
    me = "tls://127.0.0.1:7001"
    many = [MemberSpec(me), *(MemberSpec(f"tls://node-{i}.example:7001") for i in range(999))]
    t0 = time.monotonic()
    d = Daemon(settings(tmp_path, pki, ClusterSettings("c", tuple(many), address=me, version=1)))
    made.append(d)
    assert time.monotonic() - t0 < 10
    assert len(status_view(d)["cluster"]["members"]) == 1000

    async def push(members: list[str]) -> None:
        await d.cluster.push({"name": "c", "members": members, "version": 20})

    # localhost is resolved at once (not node-*): this node twice, refused, in time.
    aliased = [me, "tls://localhost:7001", *(m.address for m in many[1:])]
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="localhost:7001 is this node"):
        trio.run(push, aliased)
    assert time.monotonic() - t0 < 10
    stop.set()


def test_a_pushed_list_naming_this_node_twice_is_refused_and_changes_nothing(
    tmp_path: Path, pki: Path, made: list[Daemon]
) -> None:
    d = Daemon(settings(tmp_path, pki, members(7000, 7001, version=10)))
    made.append(d)
    aliased = ["tls://127.0.0.1:7001", "tls://localhost:7001", "tls://127.0.0.1:7000"]

    async def push() -> None:
        await d.cluster.push({"name": "c", "members": aliased, "version": 20})

    with pytest.raises(ValueError, match="localhost:7001 is this node"):
        trio.run(push)
    assert d.cluster.config is not None and d.cluster.config.version == 10


def test_concurrent_pushes_never_leave_an_older_list_in_force(
    tmp_path: Path, pki: Path, made: list[Daemon]
) -> None:
    """Each push awaits between its version check and putting its list in force (a name
    lookup in a thread, the meta write): an older list pushed at the same moment as a
    newer one must not be applied after it, whatever order their awaits end in."""
    d = Daemon(settings(tmp_path, pki, members(7000, 7001, version=10)))
    made.append(d)

    async def push(version: int, ports: tuple[int, ...]) -> None:
        body = {"name": "c", "members": [f"tls://127.0.0.1:{p}" for p in ports]}
        try:
            await d.cluster.push({**body, "version": version})
        except ValueError:
            pass  # the older one, judged after the newer: refused

    async def both(older: int, newer: int) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(push, older, (7001,))
            nursery.start_soon(push, newer, (7000, 7001))

    for older, newer in ((20, 30), (40, 50), (60, 70)):
        trio.run(both, older, newer)
        assert d.cluster.config is not None and d.cluster.config.version == newer
        assert len(d.cluster.config.members) == 2


def test_an_exchange_with_a_member_a_new_list_left_out_is_refused_not_a_crash(
    tmp_path: Path, pki: Path, made: list[Daemon]
) -> None:
    """A probe, a share push or an ask begun for a member that a list put in force
    meanwhile left out finds no connection pool for it: a refused exchange (counted,
    read from the store), not a KeyError that restarts the prober."""
    from silofs.node.peer_client import PeerError
    from silofs.node.peer_wire import PING_PATH

    d = Daemon(settings(tmp_path, pki, members(7000, 7001, version=10)))
    made.append(d)
    assert d.cluster.membership is not None
    gone = d.cluster.membership.members["tls://127.0.0.1:7000"]

    async def main() -> None:
        await d.cluster.push({"name": "c", "members": ["tls://127.0.0.1:7001"], "version": 20})
        with pytest.raises(PeerError, match="no longer a member") as err:
            await d.cluster._exchange(gone, "GET", PING_PATH)
        assert err.value.reason == "refused"

    trio.run(main)


def test_the_connection_limits_are_fitted_again_to_each_member_list_put_in_force(
    tmp_path: Path, pki: Path, made: list[Daemon], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under NOFILE 1024 the control socket's connections get what the other holders
    leave (node/service.py fd_budget): a pushed list of 60 members takes PEER_POOL fds
    each from them, a shorter one gives them back, and a pushed list in force at the
    next start is the one counted there, not silofs.toml's."""
    from silofs import sealed
    from silofs.node import service

    monkeypatch.setattr(service.resource, "getrlimit", lambda what: (1024, 1024))
    monkeypatch.setattr(sealed, "MAX_LIVE", 1024 // 32)  # the daemon's limit_live(1024)
    d = Daemon(settings(tmp_path, pki, members(7000, 7001, version=10)))
    made.append(d)
    limits = service.connection_limits(d)
    d.cluster.applied = lambda: service.refit_connections(limits, d)
    two = (limits.total, limits.reserve)
    room = 1024 - service.fd_budget(d.settings, 2)
    assert two[0] + two[1] <= room and two[0] + two[1] >= room - 2

    many = [f"tls://127.0.0.1:{p}" for p in (7001, *range(8000, 8059))]
    trio.run(d.cluster.push, {"name": "c", "members": many, "version": 20})
    room = 1024 - service.fd_budget(d.settings, 60)
    assert room < two[0] + two[1] - 200  # 4 fds for each of 58 more members
    assert room - 2 <= limits.total + limits.reserve <= room

    trio.run(d.cluster.push, {"name": "c", "members": many[:2], "version": 30})
    assert (limits.total, limits.reserve) == two

    trio.run(d.cluster.push, {"name": "c", "members": many, "version": 40})
    d.cluster.close()
    d.store.close()
    os.close(d.lock_fd)
    made.clear()
    again = Daemon(settings(tmp_path, pki, members(7000, 7001, version=10)))
    made.append(again)
    fresh = service.connection_limits(again)
    assert (fresh.total, fresh.reserve) == (limits.total, limits.reserve)


def test_an_fd_limit_below_the_connections_floor_says_to_raise_it(
    tmp_path: Path,
    pki: Path,
    made: list[Daemon],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Under `prlimit --nofile=20` the daemon said "using 48 (+16 for admins)": more
    than the limit, as if they fit. Below the floor it now says the limit is too low and
    how to raise it; at a limit that fits them after lowering, nothing of the kind."""
    from silofs import sealed
    from silofs.node import service

    monkeypatch.setattr(sealed, "MAX_LIVE", 1024 // 32)
    d = Daemon(settings(tmp_path, pki, members(7000, 7001)))
    made.append(d)
    budget = service.fd_budget(d.settings, 2)
    for soft, short in ((budget + 20, True), (budget + 600, False)):
        monkeypatch.setattr(service.resource, "getrlimit", lambda what, n=soft: (n, n))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=service.__name__):
            service.connection_limits(d)
        lines = [r.getMessage() for r in caplog.records if "fd limit" in r.getMessage()]
        assert len(lines) == 1, lines
        assert ("raise it (LimitNOFILE=, ulimit -n)" in lines[0]) is short, lines
        assert ("leaves (20)" in lines[0]) is short, lines


@pytest.mark.parametrize("status", [200, 403, 500])
def test_a_members_json_nested_too_deeply_is_a_value_error_never_a_recursion_error(
    status: int,
) -> None:
    """json.loads raises RecursionError on "[[[[...": a member answering its ping or a
    failed chunk ask so ended the ping's task or failed the read (EIO), where any other
    garbage is counted and read from the store."""
    from silofs.node.cluster import _error, _peer_json
    from silofs.node.peer_client import PeerReply

    reply = PeerReply(status, {}, bytearray(b"[" * 200_000))
    with pytest.raises(ValueError):
        _peer_json(reply)
    assert _error(reply) == "[" * 100


def test_a_sweep_keeps_the_copies_of_a_member_that_died_unnoticed(
    tmp_path: Path, pki: Path, made: list[Daemon]
) -> None:
    """Member A answered its last ping, then was killed; the others, finding it down,
    had this node fetch and admit A's chunks (first eviction victims). Before this node
    asks A again, member B comes back up and starts a stand-in sweep: A, still up here,
    must not count as answering (its copies here are the cluster's only ones). The
    sweep pings the members up first: A refuses, is down, and its copies stay; B's
    go (B answers, and holds them)."""
    import hashlib

    from silofs.cache.format import KEY_SIZE
    from silofs.node.peer_client import PeerError, PeerReply
    from silofs.node.store_write import PendingChunk

    d = Daemon(settings(tmp_path, pki, members(7000, 7001, 7002)))
    made.append(d)
    ms = d.cluster.membership
    assert ms is not None
    dead, live = "tls://127.0.0.1:7000", "tls://127.0.0.1:7002"
    placed = ms.placed_by()
    keys: dict[str, bytes] = {}
    for i in range(1000):
        key = hashlib.sha256(str(i).encode()).digest()[:KEY_SIZE]
        keys.setdefault(placed(key), key)
        if dead in keys and live in keys:
            break
    pings: list[str] = []

    async def exchange(member, method, target, body=b"", check=None, most=None):  # noqa: ANN001, ANN202
        pings.append(member.address)
        if member.address == dead:
            raise PeerError("refused", f"{member.address}: connection refused")
        return PeerReply(200, {}, bytearray(b'{"name": "c"}')), None

    d.cluster._exchange = exchange  # type: ignore[method-assign]
    dsid = d.store.dataset_id("s3://b/", create=True)
    assert dsid is not None

    def owns(key: bytes) -> bool:
        with d.store.read_txn() as txn:
            return bool(d.store.owns(txn, dsid, key))

    async def main() -> None:
        ms.mark_up(dead)  # both answered at start
        ms.mark_up(live)
        ms.mark_down(live, "timeout")  # B timed out once
        for addr in (dead, live):  # stand-in copies, admitted as first eviction victims
            key = keys[addr]
            assert d.writer.offer(PendingChunk(dsid, key, b"x" * 100, 100))
        await d.writer.flush()
        assert owns(keys[dead]) and owns(keys[live])
        # A is killed; B answers its probe again: came_up, and the prober's sweep.
        ms.mark_up(live)
        await d.cluster._sweep_standins(ms.came_up)

    trio.run(main)
    assert dead in pings and not ms.members[dead].up
    assert owns(keys[dead])  # the only copy of A's chunk: kept
    assert not owns(keys[live])  # B holds its own: the copy here is dropped


def test_a_member_down_that_calls_is_probed_at_once_and_at_most_once_a_ping_period(
    tmp_path: Path, pki: Path, made: list[Daemon]
) -> None:
    """A member down for a long backoff calls this node (from a connection's thread, as
    the routes' roles tell it): it is pinged at once and up; down again and calling
    again within PING_SECONDS, it is not pinged again before its backoff ends."""
    from silofs.node.membership import PING_SECONDS
    from silofs.node.peer_client import PeerReply

    d = Daemon(settings(tmp_path, pki, members(7000, 7001)))
    made.append(d)
    ms = d.cluster.membership
    assert ms is not None
    other = "tls://127.0.0.1:7000"
    pings: list[str] = []

    async def exchange(member, method, target, body=b"", check=None, most=None):  # noqa: ANN001, ANN202
        pings.append(member.address)
        return PeerReply(200, {}, bytearray(b'{"name": "c"}')), None

    d.cluster._exchange = exchange  # type: ignore[method-assign]

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(d.cluster.probe_loop)
            with trio.fail_after(10):
                while ms.members[other].last_ok == 0.0:  # the prober's first ping
                    await trio.sleep(0.01)
            for _ in range(6):  # refused while it was starting: 32 s down
                ms.mark_down(other, "refused", probe=True)
            seen = len(pings)
            await trio.to_thread.run_sync(d.cluster.contacted, ("127.0.0.1",))
            with trio.fail_after(5):
                while not ms.members[other].up:
                    await trio.sleep(0.01)
            assert pings[seen:] == [other]
            for _ in range(6):
                ms.mark_down(other, "refused", probe=True)
            await trio.to_thread.run_sync(d.cluster.contacted, ("127.0.0.1",))
            # Past two prober ticks: no ping was started (the first call's quiet time
            # runs PING_SECONDS, and the backoff ends later still).
            await trio.sleep(1.2)
            assert pings[seen + 1 :] == [] and not ms.members[other].up
            assert ms.members[other].down_until - ms.clock() > PING_SECONDS
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_certificate_is_for_a_host_as_a_tls_client_checks_it() -> None:
    from silofs.node.cluster import _names_host

    names = {"gpu01", "10.0.0.1", "*.rack2.example", "::1"}
    assert _names_host(names, "gpu01") and _names_host(names, "10.0.0.1")
    assert _names_host(names, "::1")
    assert _names_host(names, "gpu07.rack2.example")  # a wildcard's one leftmost label
    assert not _names_host(names, "a.gpu07.rack2.example")
    assert not _names_host(names, "rack2.example")
    assert not _names_host(names, "gpu02") and not _names_host(names, "10.0.0.2")
