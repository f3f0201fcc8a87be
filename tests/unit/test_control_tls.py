"""The control API's mutual-TLS TCP listener on 127.0.0.1: who gets in, who does not,
and that refusals cost the server nothing but the refused connection.

The server runs in a thread with its own trio loop (serve_tls over a real TCP socket);
clients are the blocking ControlClient (what the controller uses), raw sockets and
stdlib ssl. Certificates come from silofs-ctl's own CA helper (certs_cmd), so the
helper is tested with them. No sleeps: waits poll with a deadline.
"""

from __future__ import annotations

import functools
import json
import logging
import socket
import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from silofs_ctl.certs_cmd import client_cert, init_ca, node_cert

from silofs.config import load_node_settings
from silofs.control.client import ControlClient, ControlError, client_tls_context
from silofs.control.peer import REMOTE_UID, Peer, peer_may_change, remote_peer
from silofs.control.router import Caller, Request, Response, Router, json_response
from silofs.control.server import TLSLimits, bind_tcp, serve_tls
from silofs.control.tls import parse_tcp_address, server_context
from silofs.errors import UsageError
from tests.support.cluster import legacy_node_cert, odd_node_cert
from tests.support.poll import wait_for
from tests.unit.serving import serving

DEADLINE = 10.0


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA with a controller and a node (127.0.0.1), and a second, foreign CA."""
    good = tmp_path_factory.mktemp("ca")
    init_ca(str(good))
    node_cert(str(good), "node-a", ["127.0.0.1"])
    client_cert(str(good), "other-client")
    legacy_node_cert(good, "legacy-node", "127.0.0.1")
    foreign = tmp_path_factory.mktemp("foreign")
    init_ca(str(foreign))  # its controller.pem is signed by a CA the node does not trust
    return {"good": good, "foreign": foreign}


def make_router() -> Router:
    router = Router()

    async def peer(req: Request) -> Response:
        return json_response(vars(req.peer))

    async def echo(req: Request) -> Response:
        return json_response(req.json())

    router.add("GET", "/v1/peer", peer)
    router.add("PUT", "/v1/echo", echo)
    return router


@contextmanager
def tls_server(pki: dict[str, Path], **limits: Any) -> Iterator[tuple[int, Any]]:
    """serve_tls on 127.0.0.1 (a free port) in a thread; yields (port, acceptor)."""
    good = pki["good"]
    ctx = server_context(str(good / "node-a.pem"), str(good / "node-a.key"), str(good / "ca.pem"))
    sock = bind_tcp("127.0.0.1", 0)
    port = sock.getsockname()[1]
    acceptor: list[Any] = []
    serve = functools.partial(
        serve_tls, sock, make_router(), ctx, tls_limits=TLSLimits(**limits), acceptor=acceptor
    )
    with serving(serve):
        yield port, acceptor[0]


def controller(pki: dict[str, Path], name: str = "controller", ca: str = "good") -> ssl.SSLContext:
    d = pki[ca]
    return client_tls_context(
        str(d / f"{name}.pem"), str(d / f"{name}.key"), str(pki["good"] / "ca.pem")
    )


def assert_served(port: int, pki: dict[str, Path]) -> None:
    with ControlClient(f"tls://127.0.0.1:{port}", timeout=DEADLINE, tls=controller(pki)) as c:
        assert c.request("GET", "/v1/peer")["remote"] == "controller"


def test_controller_certificate_is_a_remote_admin_never_a_local_uid(pki: dict[str, Path]) -> None:
    with tls_server(pki) as (port, acc):
        with ControlClient(f"tls://127.0.0.1:{port}", timeout=DEADLINE, tls=controller(pki)) as c:
            peer = c.request("GET", "/v1/peer")
            # keep-alive over TLS: the second request reuses the connection
            assert c.request("PUT", "/v1/echo", {"x": [1, 2]}) == {"x": [1, 2]}
            assert c.connections_opened == 1
    assert peer == {
        "pid": 0,
        "uid": REMOTE_UID,
        "gid": REMOTE_UID,
        "remote": "controller",
        "names": [],
        "node": False,
    }
    assert acc.served == 1 and acc.refused == 0
    from silofs.control.peer import Peer

    assert peer_may_change(Peer(**{**peer, "names": ()}), admin_gid=None)
    assert not peer_may_change(Peer(pid=1, uid=REMOTE_UID, gid=REMOTE_UID), admin_gid=None)


@pytest.mark.parametrize(
    "client",
    ["plaintext", "no-certificate", "foreign-ca", "node-certificate-as-client"],
)
def test_refused_clients_get_nothing_and_the_server_goes_on(
    pki: dict[str, Path], client: str
) -> None:
    with tls_server(pki) as (port, acc):
        if client == "plaintext":
            with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as s:
                s.sendall(b"GET /v1/peer HTTP/1.1\r\nhost: x\r\n\r\n")
                got = b""
                try:
                    while data := s.recv(65536):
                        got += data
                except ConnectionResetError:
                    pass
            assert b"HTTP/1.1 200" not in got and b"remote" not in got
        else:
            if client == "no-certificate":
                ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
                ctx.load_verify_locations(str(pki["good"] / "ca.pem"))
            elif client == "foreign-ca":
                ctx = controller(pki, ca="foreign")
            else:  # a node's serverAuth-only certificate (before clusters), the right CA
                ctx = controller(pki, name="legacy-node")
            with ControlClient(f"tls://127.0.0.1:{port}", timeout=DEADLINE, tls=ctx) as c:
                with pytest.raises(ControlError) as err:
                    c.request("GET", "/v1/peer")
            assert err.value.status is None  # no HTTP answer at all
        wait_for(
            lambda: acc.refused >= 1, DEADLINE, "the refusal to be counted"
        )  # GET is retried once
        assert acc.served == 0
        assert_served(port, pki)
        assert acc.open <= 1


def test_a_node_certificate_is_a_member_candidate_and_no_admin(pki: dict[str, Path]) -> None:
    """A certificate of `silofs-ctl certs node` (serverAuth and clientAuth, the node
    role) gets through the handshake even with tls_client_names set, as a peer with its
    names and the node role: the routes judge it (this router's routes are for local
    peers and controllers: 403), and it is never an admin."""
    with tls_server(pki, allowed_names=frozenset({"controller"})) as (port, acc):
        ctx = controller(pki, name="node-a")
        with ControlClient(f"tls://127.0.0.1:{port}", timeout=DEADLINE, tls=ctx) as c:
            with pytest.raises(ControlError) as err:
                c.request("GET", "/v1/peer")
        assert err.value.status == 403
        assert acc.served == 1
    node = remote_peer("node-a", frozenset({"127.0.0.1", "node-a"}), node=True)
    assert not peer_may_change(node, admin_gid=None)


def test_client_checks_the_node_name(pki: dict[str, Path]) -> None:
    """The node's certificate names 127.0.0.1 and node-a, not localhost: a controller
    asked for localhost refuses the node (no man in the middle with any CA cert)."""
    with tls_server(pki) as (port, acc):
        with ControlClient(f"tls://localhost:{port}", timeout=DEADLINE, tls=controller(pki)) as c:
            with pytest.raises(ControlError, match="TLS handshake|cannot reach"):
                c.request("GET", "/v1/peer")
        assert_served(port, pki)


def test_allowed_names_limit_which_certificates_are_admins(pki: dict[str, Path]) -> None:
    with tls_server(pki, allowed_names=frozenset({"controller"})) as (port, acc):
        ctx = controller(pki, name="other-client")
        with ControlClient(f"tls://127.0.0.1:{port}", timeout=DEADLINE, tls=ctx) as c:
            with pytest.raises(ControlError):
                c.request("GET", "/v1/peer")
        wait_for(lambda: acc.refused >= 1, DEADLINE, "the refusal")
        assert_served(port, pki)


def test_silent_clients_are_cut_at_the_handshake_limit_and_count_against_connections(
    pki: dict[str, Path],
) -> None:
    with tls_server(pki, max_connections=2, handshake_seconds=0.5) as (port, acc):
        silent = [socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) for _ in range(2)]
        wait_for(lambda: acc.open == 2, DEADLINE, "two connections held")
        # At the limit, a third connection is closed at once, even a good one.
        with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as s:
            assert s.recv(1) == b""
        # The silent ones are closed once their handshake time is up...
        for s in silent:
            assert s.recv(1) == b""
            s.close()
        wait_for(lambda: acc.open == 0, DEADLINE, "slots freed")
        # ...and the listener serves again.
        assert_served(port, pki)
        assert acc.refused == 3


def test_body_limit_holds_on_tls(pki: dict[str, Path]) -> None:
    with tls_server(pki) as (port, acc):
        with ControlClient(f"tls://127.0.0.1:{port}", timeout=DEADLINE, tls=controller(pki)) as c:
            with pytest.raises(ControlError) as err:
                c.request("PUT", "/v1/echo", {"x": "y" * (2 << 20)})
        assert err.value.status == 413
        assert_served(port, pki)


def test_config_requires_tls_files_with_tcp_listen(tmp_path: Path, pki: dict[str, Path]) -> None:
    conf = tmp_path / "silofs.toml"
    conf.write_text('[control]\ntcp_listen = "0.0.0.0:7470"\n')
    with pytest.raises(UsageError, match="tls_cert, tls_key, tls_client_ca"):
        load_node_settings(str(conf))
    good = pki["good"]
    conf.write_text(
        "[control]\n"
        'tcp_listen = "[::]:7470"\n'
        f'tls_cert = "{good}/node-a.pem"\ntls_key = "{good}/node-a.key"\n'
        f'tls_client_ca = "{good}/ca.pem"\ntls_client_names = ["controller"]\n'
    )
    s = load_node_settings(str(conf))
    assert (s.tcp_listen, s.tls_client_names, s.tcp_max_connections) == (
        "[::]:7470",
        ["controller"],
        64,
    )
    assert parse_tcp_address(s.tcp_listen) == ("::", 7470)
    assert parse_tcp_address(":7470") == ("0.0.0.0", 7470)
    for bad in ("7470", "host:", "::1:7470", "h:99999"):
        with pytest.raises(UsageError):
            parse_tcp_address(bad)
    with pytest.raises(UsageError, match="tls_client_ca"):
        server_context(f"{good}/node-a.pem", f"{good}/node-a.key", f"{good}/missing.pem")


def test_remote_routes_are_admin_routes_only() -> None:
    """The TLS listener's router has no mount, chunk, offer, warm or dataset-open route."""
    from silofs.node.routes import REMOTE_ROUTES

    paths = {p for _, p in REMOTE_ROUTES}
    assert not any(p.startswith(("/v1/mounts", "/v1/chunks")) for p in paths)
    assert ("POST", "/v1/datasets") not in REMOTE_ROUTES
    assert not any(p.endswith("/warm") for p in paths)
    router = Router()

    async def h(req: Request) -> Response:
        return json_response({})

    router.add("GET", "/v1/status", h, who=Caller.LOCAL | Caller.CONTROLLER)
    router.add("POST", "/v1/mounts", h, who=Caller.LOCAL)
    remote = remote_peer("controller")
    assert router.match("GET", ["v1", "status"], remote).error is None
    assert router.match("POST", ["v1", "mounts"], remote).error.status == 404
    assert router.match("POST", ["v1", "mounts"], Peer(pid=1, uid=1000, gid=1000)).error is None


def test_registration_body_is_checked() -> None:
    from silofs.control.router import HTTPError
    from silofs.node.api.jobs import parse_registration as _registration

    info = _registration(
        {"gpus": 4, "ideal_io": "500MB/s", "epochs": 3, "datasets": ["s3://b/p"], "nodes": ["n1"]}
    )
    assert info == {
        "gpus": 4,
        "ideal_io": 500_000_000,
        "epochs": 3,
        "datasets": ["s3://b/p/"],
        "nodes": ["n1"],
    }
    for bad in (
        {},
        {"gpus": -1},
        {"gpus": True},
        {"gpus": 1, "epochs": 0},
        {"gpus": 1, "datasets": "s3://b/"},
        {"gpus": 1, "datasets": ["\x07"]},
        {"gpus": 1, "nodes": ["n"] * 5000},
        {"gpus": 1, "owner": 0},
        {"gpus": 1, "uid": -1},
        {"gpus": 1, "uid": True},
        {"gpus": 1, "uid": "1000"},
        {"gpus": 1, "uid": 1 << 32},
        {"gpus": 1, "ideal_io": -5},
    ):
        with pytest.raises(HTTPError) as err:
            _registration(bad)
        assert err.value.status == 400, bad
    assert json.dumps(info)  # persisted as JSON
    # The job's user (a Slurm prolog's --uid): its owner; uid 0 is a uid like another.
    for uid in (0, 1000):
        assert _registration({"gpus": 1, "uid": uid})["uid"] == uid
    assert "uid" not in _registration({"gpus": 1, "uid": None})


def test_new_connections_beyond_the_handshake_rate_are_closed_before_tls(
    pki: dict[str, Path],
) -> None:
    """A flood costs the loop at most handshakes_per_second handshakes a second; the
    rest are closed at accept, and the listener serves again once the bucket refills."""
    with tls_server(pki, handshakes_per_second=2) as (port, acc):
        conns = [socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) for _ in range(6)]
        try:
            wait_for(lambda: acc.refused >= 4, DEADLINE, "connections over the rate to be closed")
            assert acc.open <= 2
        finally:
            for s in conns:
                s.close()

        def served() -> bool:
            try:
                assert_served(port, pki)
                return True
            except ControlError:
                return False  # still over the rate: the bucket refills at 2 a second

        wait_for(served, DEADLINE, "the listener to serve again")


@pytest.mark.parametrize(
    ("when", "said"), [("expired", "expired on"), ("future", "not valid before")]
)
def test_the_daemons_own_certificate_out_of_its_dates_is_said_at_start(
    pki: dict[str, Path], when: str, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A node started with an expired (or not yet valid) certificate: every client
    refuses it and the daemon saw only closed connections. Now its start says so in
    one ERROR line naming the file, and it starts (the mounts do not need the
    listener)."""
    good = pki["good"]
    odd_node_cert(good, f"node-{when}", "127.0.0.1", **{when: True})
    cert = str(good / f"node-{when}.pem")
    with caplog.at_level(logging.ERROR, logger="silofs.control.tls"):
        ctx = server_context(cert, str(good / f"node-{when}.key"), str(good / "ca.pem"))
    assert isinstance(ctx, ssl.SSLContext)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) == 1 and cert in lines[0] and said in lines[0], lines
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="silofs.control.tls"):
        server_context(str(good / "node-a.pem"), str(good / "node-a.key"), str(good / "ca.pem"))
    assert not caplog.records


def test_a_key_other_users_may_read_stops_the_start_in_one_line(
    pki: dict[str, Path], tmp_path: Path
) -> None:
    good = pki["good"]
    key = tmp_path / "node-a.key"
    key.write_bytes((good / "node-a.key").read_bytes())
    for mode in (0o644, 0o604, 0o660):
        key.chmod(mode)
        with pytest.raises(UsageError) as err:
            server_context(str(good / "node-a.pem"), str(key), str(good / "ca.pem"))
        assert f"chmod 600 {key}" in str(err.value) and "\n" not in str(err.value)
    key.chmod(0o640)  # a group that may read it (ssl-cert): as the operator chose
    server_context(str(good / "node-a.pem"), str(key), str(good / "ca.pem"))


@pytest.mark.parametrize("problem", ["expired", "future", "open-key"])
def test_the_controllers_own_certificate_problems_are_one_line_before_any_node(
    pki: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, problem: str
) -> None:
    """A controller whose certificate expired saw every node close its connections
    "without response"; one whose key others may read gave an admin of every node
    away. Both are said before it asks any node, naming the file."""
    from silofs_ctl.nodes import TLS_DIR_ENV, one_node_client

    good = pki["good"]
    source = "controller"
    if problem != "open-key":
        source = f"ctl-{problem}"
        odd_node_cert(good, source, "127.0.0.1", **{problem: True})
    for ext in ("pem", "key"):
        (tmp_path / f"controller.{ext}").write_bytes((good / f"{source}.{ext}").read_bytes())
    (tmp_path / "controller.key").chmod(0o644 if problem == "open-key" else 0o600)
    (tmp_path / "ca.pem").write_bytes((good / "ca.pem").read_bytes())
    monkeypatch.setenv(TLS_DIR_ENV, str(tmp_path))
    with pytest.raises(ControlError) as err:
        one_node_client("tls://127.0.0.1:7470")
    said = {"expired": "expired on", "future": "not valid before", "open-key": "chmod 600"}
    assert said[problem] in str(err.value) and str(tmp_path) in str(err.value)


def test_a_certificate_the_daemon_refuses_is_named_as_the_likely_cause(
    pki: dict[str, Path],
) -> None:
    """The daemon closes a refused client's connection without an alert the client
    reads: the client's line says where to look."""
    with tls_server(pki) as (port, _acc):
        ctx = controller(pki, ca="foreign")
        with ControlClient(f"tls://127.0.0.1:{port}", timeout=DEADLINE, tls=ctx) as c:
            with pytest.raises(ControlError) as err:
                c.request("GET", "/v1/peer")
    assert "does the daemon refuse this certificate" in str(err.value), err.value


def _bad_tls_files(good: Path, tmp_path: Path) -> dict[str, tuple[str, str, str, str]]:
    """(cert, key, ca, what the line must say) for each file an operator gets wrong."""
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding

    garbage = tmp_path / "garbage.pem"
    garbage.write_text("hello\n")
    garbage.chmod(0o600)
    empty = tmp_path / "empty.pem"
    empty.write_text("")
    der = tmp_path / "ca.der"
    ca = x509.load_pem_x509_certificate((good / "ca.pem").read_bytes())
    der.write_bytes(ca.public_bytes(Encoding.DER))
    cert, key, ca_pem = str(good / "node-a.pem"), str(good / "node-a.key"), str(good / "ca.pem")
    other_key = str(good / "other-client.key")
    return {
        "cert-not-pem": (str(garbage), key, ca_pem, f"{garbage} is not a PEM certificate"),
        "key-not-pem": (cert, str(garbage), ca_pem, f"{garbage} is not a PEM private key"),
        "pair-mismatch": (cert, other_key, ca_pem, f"{other_key} is not the key of {cert}"),
        "ca-der": (cert, key, str(der), f"no PEM certificate in {der}"),
        "ca-empty": (cert, key, str(empty), f"no PEM certificate in {empty}"),
        "ca-is-a-key": (cert, key, key, f"no PEM certificate in {key}"),
    }


@pytest.mark.parametrize(
    "case", ["cert-not-pem", "key-not-pem", "pair-mismatch", "ca-der", "ca-empty", "ca-is-a-key"]
)
def test_tls_files_an_operator_gets_wrong_are_named_in_plain_words(
    pki: dict[str, Path], tmp_path: Path, case: str
) -> None:
    """OpenSSL says "[SSL] PEM lib" for a certificate or key that is not PEM and "no
    certificate or crl found" for a CA that is DER: the node's start and the
    controller's name the file and what is wrong with it, in one line."""
    from silofs.control.client import client_tls_context, tls_files_problem

    cert, key, ca, said = _bad_tls_files(pki["good"], tmp_path)[case]
    with pytest.raises(UsageError) as err:
        server_context(cert, key, ca)
    assert said in str(err.value) and "\n" not in str(err.value), err.value
    with pytest.raises((OSError, ssl.SSLError)) as exc:
        client_tls_context(cert, key, ca)
    assert said in tls_files_problem(cert, key, ca, exc.value)


def test_an_encrypted_key_is_refused_without_a_prompt(pki: dict[str, Path], tmp_path: Path) -> None:
    """OpenSSL asked for an encrypted key's passphrase on the terminal: a daemon started
    by hand waited at "Enter PEM pass phrase:". Now it is one line saying the key is
    encrypted, at once, on a terminal too (the child's controlling terminal is a pty)."""
    import os
    import pty
    import select
    import time

    from cryptography.hazmat.primitives import serialization

    good = pki["good"]
    key = serialization.load_pem_private_key((good / "node-a.key").read_bytes(), None)
    enc = tmp_path / "enc.key"
    enc.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    enc.chmod(0o600)
    pid, fd = pty.fork()
    if pid == 0:  # the child: its controlling terminal is the pty
        try:
            server_context(str(good / "node-a.pem"), str(enc), str(good / "ca.pem"))
            os.write(1, b"LOADED\n")
        except UsageError as exc:
            os.write(1, f"REFUSED {exc}\n".encode())
        finally:
            os._exit(0)
    out = b""
    deadline = time.monotonic() + DEADLINE
    try:
        while b"\n" not in out or b"REFUSED" not in out and b"LOADED" not in out:
            left = deadline - time.monotonic()
            if left <= 0 or b"pass phrase" in out:
                break
            if select.select([fd], [], [], left)[0]:
                try:
                    data = os.read(fd, 4096)
                except OSError:  # the child is gone (EIO)
                    break
                if not data:
                    break
                out += data
    finally:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
        os.close(fd)
    assert b"pass phrase" not in out, out
    assert b"REFUSED" in out and b"is encrypted" in out, out


def test_a_listener_that_never_handshakes_is_named_so(pki: dict[str, Path]) -> None:
    """A port that accepts and says nothing (another program, a frozen daemon): the line
    said "_ssl.c:989: The handshake operation timed out"; now what happened and how
    long it was waited for."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)  # the kernel accepts; nobody ever speaks TLS
        port = silent.getsockname()[1]
        with ControlClient(f"tls://127.0.0.1:{port}", timeout=0.5, tls=controller(pki)) as c:
            with pytest.raises(ControlError) as err:
                c.request("GET", "/v1/peer")
    line = str(err.value)
    assert "finished no TLS handshake within 0.5s" in line and "_ssl.c" not in line, line
