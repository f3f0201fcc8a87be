"""`silofs-ctl certs` as an operator mistypes it: names that are paths or the CA's own,
addresses that are not hosts, a directory it cannot write, a controller's certificate
about to be replaced by a node's. Each is one line, exit 1 or 2, and no file changes."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
from pathlib import Path

import pytest


def certs(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "silofs_ctl", "certs", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def one_line(res: subprocess.CompletedProcess, needle: str) -> str:
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert lines[0].startswith("silofs-ctl: error: ") and needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pki")
    res = certs("init", str(path))
    assert res.returncode == 0, res.stderr
    return path


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize(
    ("args", "needle", "code"),
    [
        (("../outside",), "not a host name", 2),
        (("a/b",), "not a host name", 2),
        (("ca",), "names the CA's own files", 2),
        (("CA",), "names the CA's own files", 2),
        (("controller",), "not a node's certificate", 1),
        (("gpu01", "--address", ""), "not a host name", 2),
        (("gpu01", "--address", "a b"), "not a host name", 2),
    ],
)
def test_node_names_and_addresses_that_would_misfile_are_refused(
    pki: Path, args: tuple[str, ...], needle: str, code: int
) -> None:
    before = _files(pki)
    res = certs("node", str(pki), *args)
    one_line(res, needle)
    assert res.returncode == code
    assert _files(pki) == before
    assert not (pki.parent / "outside.pem").exists()


def test_a_node_certificate_may_be_renewed_with_addresses(pki: Path) -> None:
    for _ in range(2):  # the second run renews the first's
        res = certs("node", str(pki), "gpu01", "--address", "10.0.0.1", "--address", "gpu01.lan")
        assert res.returncode == 0, res.stderr
    assert (pki / "gpu01.pem").exists() and (pki / "gpu01.key").stat().st_mode & 0o777 == 0o600


def test_a_directory_it_cannot_write_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    res = certs("init", str(blocker / "pki"))
    one_line(res, "cannot write certificates in")
    assert res.returncode == 1
    if os.geteuid() == 0:
        return  # root writes anywhere; the rest needs a directory it may not write
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    one_line(certs("init", str(ro)), "cannot write certificates in")


def test_a_controller_name_that_is_a_path_is_refused(tmp_path: Path) -> None:
    res = certs("init", str(tmp_path / "pki"), "--controller", "../ctl")
    one_line(res, "not a host name")
    assert res.returncode == 2 and not (tmp_path / "pki").exists()


def _handshake(server: ssl.SSLContext, client: ssl.SSLContext, host: str) -> str | None:
    """A TLS handshake in memory between the two contexts: None if both ends verified the
    other, else the first failure's text."""
    s_in, s_out, c_in, c_out = (ssl.MemoryBIO() for _ in range(4))
    srv = server.wrap_bio(s_in, s_out, server_side=True)
    cli = client.wrap_bio(c_in, c_out, server_hostname=host)
    done = {"srv": False, "cli": False}
    for _ in range(20):
        for side, obj in (("cli", cli), ("srv", srv)):
            if done[side]:
                continue
            try:
                obj.do_handshake()
                done[side] = True
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLError as exc:
                return f"{side}: {exc}"
        if c_out.pending:
            s_in.write(c_out.read())
        if s_out.pending:
            c_in.write(s_out.read())
        if all(done.values()):
            # TLS 1.3: the server checks the client's certificate after its own Finished.
            try:
                srv.read(1)
            except ssl.SSLWantReadError:
                return None
            except ssl.SSLError as exc:
                return f"srv: {exc}"
    return "no end to the handshake"


@pytest.mark.parametrize("old_first", [True, False])
def test_a_rotated_ca_is_trusted_beside_the_old_one_in_one_bundle(
    tmp_path: Path, old_first: bool
) -> None:
    """A CA rotation: nodes and controllers trust old and new ca.pem together while the
    certificates are reissued. Both CAs once had one name, and OpenSSL, which finds an
    issuer by name, tried only the bundle's first: every certificate of the other CA
    failed ("certificate signature failure")."""
    from silofs_ctl.certs_cmd import init_ca, node_cert

    from silofs.control.client import client_tls_context
    from silofs.control.tls import server_context
    from silofs.node.peer_client import client_context

    old, new = tmp_path / "old", tmp_path / "new"
    for d in (old, new):
        init_ca(str(d))
        node_cert(str(d), "node-a", ["127.0.0.1"])
    pems = [(d / "ca.pem").read_bytes() for d in ((old, new) if old_first else (new, old))]
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(b"".join(pems))
    for node_ca, ctl_ca in ((old, new), (new, old), (old, old), (new, new)):
        node = server_context(str(node_ca / "node-a.pem"), str(node_ca / "node-a.key"), str(bundle))
        ctl = client_tls_context(
            str(ctl_ca / "controller.pem"), str(ctl_ca / "controller.key"), str(bundle)
        )
        assert _handshake(node, ctl, "127.0.0.1") is None, (node_ca.name, ctl_ca.name)
        # A member asking another: the node's own certificate as the client.
        member = client_context(str(ctl_ca / "node-a.pem"), str(ctl_ca / "node-a.key"), str(bundle))
        assert _handshake(node, member, "127.0.0.1") is None, (node_ca.name, ctl_ca.name)
    # A CA that is in no bundle is still refused.
    stranger = tmp_path / "stranger"
    init_ca(str(stranger))
    node = server_context(str(old / "node-a.pem"), str(old / "node-a.key"), str(bundle))
    ctl = client_tls_context(
        str(stranger / "controller.pem"), str(stranger / "controller.key"), str(bundle)
    )
    assert _handshake(node, ctl, "127.0.0.1") is not None
