"""Clients check who serves the control socket (docs/SECURITY.md "The daemon, as seen
by a client"): a socket served by an unprivileged user is refused before a byte is sent.

The fake daemon is a real Unix socket bound and listened on by a forked child running as
nobody (tests/support/asuser.py), so SO_PEERCRED names uid 65534 exactly as it would name a
local user who made a socket appear at the configured path. The clients are the real
`silofs` CLI (a subprocess), the blocking ControlClient and the mount processes'
AsyncControlClient; the real daemon (root) is accepted by a client of any uid.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from silofs.control.client import AsyncControlClient, ControlClient, DaemonNotTrusted
from silofs.control.peer import DAEMON_USER_ENV, UntrustedDaemonError, trusted_daemon_uids
from tests.support.asuser import NOBODY, Child, Identity, as_user, start_as
from tests.support.node import Node, mounted, pids_with, silofs_cmd
from tests.support.poll import wait_for

_ROOT_ONLY = "" if os.geteuid() == 0 else "needs root (a child that drops to nobody)"
_ANSWER = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 35\r\n"
    b'connection: close\r\n\r\n{"node": {"pid": 1}, "mounts": []} '
)
_STOP = b"STOP"


def _serve_fake(path: str) -> list[int]:
    """As nobody: listen on `path`, answer every connection with a canned status, and
    return how many bytes each connection sent (until one sends STOP)."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(16)
    srv.settimeout(60)  # a parent that died never sends STOP
    received: list[int] = []
    while True:
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(5)
            data = b""
            try:
                while not data.endswith(b"\r\n\r\n") and data != _STOP:
                    part = conn.recv(65536)
                    if not part:
                        break
                    data += part
                if data == _STOP:
                    return received
                if data:
                    conn.sendall(_ANSWER)
            except OSError:
                pass
            received.append(len(data))


@dataclass
class Fake:
    path: str
    child: Child
    received: list[int] | None = None

    def stop(self) -> list[int]:
        """Bytes each client connection sent, in order (the child ends here)."""
        if self.received is None:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(self.path)
                s.sendall(_STOP)
            self.received = self.child.result()
        return self.received


@pytest.fixture
def fake() -> Iterator[Fake]:
    if _ROOT_ONLY:
        pytest.skip(_ROOT_ONLY)
    # A sticky world-writable directory (like /tmp) so nobody may create its socket.
    base = tempfile.mkdtemp(prefix="silofs-trust-", dir="/tmp")
    os.chmod(base, 0o1777)
    path = os.path.join(base, "control.sock")
    f = Fake(path, start_as(Identity.nobody(), _serve_fake, path))
    try:
        wait_for(lambda: os.path.exists(path), what="the fake daemon's socket")
        yield f
    finally:
        f.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_cli_refuses_a_socket_served_by_another_user(fake: Fake, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_bytes(b"a")
    mp = tmp_path / "mnt"
    mp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != DAEMON_USER_ENV}
    res = _run(env, "mount", str(data), str(mp), "--socket", fake.path)
    assert res.returncode == 1, res
    line = res.stderr.strip()
    assert "\n" not in line, line
    assert line.startswith(f"silofs: error: refusing the control socket {fake.path}: "), line
    assert f"served by uid {NOBODY}" in line and DAEMON_USER_ENV in line, line
    assert not mounted(mp)
    res = _run(env, "daemon", "stop", "--socket", fake.path)
    assert res.returncode == 1 and "refusing the control socket" in res.stderr, res
    # Refused before a byte was sent: the fake saw connections, never a request; and the
    # CLI started no daemon of its own on that path.
    received = fake.stop()
    assert received and set(received) == {0}, received
    assert not pids_with(fake.path)


def test_clients_refuse_and_trust_only_when_told(
    fake: Fake, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(DAEMON_USER_ENV, raising=False)
    with ControlClient(fake.path, timeout=5) as c, pytest.raises(DaemonNotTrusted):
        c.request("GET", "/v1/status")

    async def miss() -> None:
        async with AsyncControlClient(fake.path, timeout=5) as c:
            await c.json("GET", "/v1/chunks?mount=m&key=k&index=0")

    with pytest.raises(DaemonNotTrusted, match=f"served by uid {NOBODY}"):
        trio.run(miss)
    # Told that the daemon runs as this user (by name and by number), the same socket
    # is served: the refusal above was the uid check, nothing else.
    for who in ("nobody", str(NOBODY)):
        monkeypatch.setenv(DAEMON_USER_ENV, who)
        with ControlClient(fake.path, timeout=5) as c:
            assert c.request("GET", "/v1/status")["node"] == {"pid": 1}
    received = fake.stop()
    assert received[:2] == [0, 0] and all(n > 0 for n in received[2:]), received


def test_daemon_user_naming_no_user_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DAEMON_USER_ENV, "no-such-user-x9")
    with pytest.raises(UntrustedDaemonError, match="names no user") as err:
        trusted_daemon_uids()
    assert "\n" not in str(err.value)
    monkeypatch.delenv(DAEMON_USER_ENV)
    assert trusted_daemon_uids() == {0, os.geteuid()}


def _status_as_client(sock: str) -> int:
    with ControlClient(sock, timeout=30) as c:
        return int(c.request("GET", "/v1/status")["node"]["pid"])


def test_real_root_daemon_is_trusted_by_any_user(make_node) -> None:  # noqa: ANN001
    if _ROOT_ONLY:
        pytest.skip(_ROOT_ONLY)
    # pytest's tmp dirs are 0700: the socket goes where nobody can reach it.
    base = tempfile.mkdtemp(prefix="silofs-trust-", dir="/tmp")
    try:
        os.chmod(base, 0o755)
        node: Node = make_node(socket=os.path.join(base, "control.sock"))
        assert node.proc is not None
        assert as_user(Identity.nobody(), _status_as_client, node.socket) == node.proc.pid
        assert _status_as_client(node.socket) == node.proc.pid
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _run(env: dict[str, str], *args: str):  # noqa: ANN202
    import subprocess

    return subprocess.run(silofs_cmd(*args), capture_output=True, text=True, env=env, timeout=60)
