"""The daemon's file descriptors: connections of every kind stay below RLIMIT_NOFILE with
room for mounts and store fetches, so a flood of idle connections never starves status
or a mount's uncached read.

A real daemon runs under `prlimit --nofile=1024:1024` (a hard limit it cannot raise);
the test, as root (a trusted client, exempt from per-uid limits), opens 1,124 idle
connections to its socket and keeps them open while it asks for status and reads an
uncached file through a real mount. A cluster node gets the same on its TLS port from
a member's certificate (handshaken) and from bare TCP connections.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from silofs.control.client import client_tls_context
from tests.support.cluster import write_cluster
from tests.support.cluster_run import ClusterDaemon
from tests.support.fixtures import needs_fuse
from tests.support.net import free_port
from tests.support.node import Node

pytestmark = [needs_fuse, pytest.mark.fuse]

IDLE = 1124
NOFILE = 1024


@pytest.fixture
def limited_node(tmp_path: Path) -> Iterator[Node]:
    """A daemon started with RLIMIT_NOFILE soft = hard = NOFILE: it cannot raise it."""
    if os.geteuid() != 0:
        pytest.skip("the flood must come from a trusted (root) client")
    node = Node(tmp_path / "node", "64M", prefix=["prlimit", f"--nofile={NOFILE}:{NOFILE}"])
    try:
        node.start()
        yield node
    finally:
        node.cleanup()
    assert not node.log_problems(), "\n".join(node.log_problems())


def test_idle_connections_of_a_root_client_leave_status_and_misses_working(
    limited_node: Node, tmp_path: Path
) -> None:
    node = limited_node
    data = tmp_path / "data"
    data.mkdir()
    for i in range(4):
        (data / f"f{i}.bin").write_bytes(os.urandom(300_000 + i))
    mp = node.mount(str(data), tmp_path / "mnt")
    assert (mp / "f0.bin").read_bytes() == (data / "f0.bin").read_bytes()

    idle: list[socket.socket] = []
    try:
        for _ in range(IDLE):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(10)
            s.connect(node.socket)
            idle.append(s)
        # Some were accepted, the rest wait in the backlog or were answered 429 and
        # closed: whatever the daemon did with them, it must still serve these two.
        status = node.status()
        assert status["node"]["cache_size"] > 0
        assert (mp / "f3.bin").read_bytes() == (data / "f3.bin").read_bytes()
        assert (mp / "f2.bin").read_bytes() == (data / "f2.bin").read_bytes()
        fds = len(os.listdir(f"/proc/{node.proc.pid}/fd"))  # type: ignore[union-attr]
        assert fds < NOFILE - 64, f"the daemon holds {fds} fds"
    finally:
        for s in idle:
            s.close()


def test_idle_connections_of_a_member_leave_status_and_misses_working(tmp_path: Path) -> None:
    """The same flood on a cluster node's TLS port: handshakes of a member's certificate
    and bare TCP connections that never begin one, more than NOFILE of each."""
    if os.geteuid() != 0:
        pytest.skip("prlimit on a daemon the test cleans up as root")
    specs = write_cluster(tmp_path, ["127.0.0.1"] * 2, [free_port(), free_port()])
    node = ClusterDaemon(specs[0])  # its member n1 is never started: reads go to the store
    node.prefix = ["prlimit", f"--nofile={NOFILE}:{NOFILE}"]
    data = tmp_path / "data"
    data.mkdir()
    for i in range(4):
        (data / f"f{i}.bin").write_bytes(os.urandom(300_000 + i))
    pki = tmp_path / "pki"
    member = client_tls_context(str(pki / "n1.pem"), str(pki / "n1.key"), str(pki / "ca.pem"))
    held: list[socket.socket] = []
    try:
        node.start()
        mp = node.mount(str(data), tmp_path / "mnt")
        for handshake in (True, False):
            for _ in range(IDLE):
                try:
                    raw = socket.create_connection(("127.0.0.1", node.spec.port), timeout=5)
                    held.append(raw)
                    if handshake:
                        held.append(member.wrap_socket(raw, server_hostname="127.0.0.1"))
                except OSError:  # refused, reset or not answered: the listener's limits
                    continue
        assert node.status()["cluster"]["name"] == "test-cluster"
        for key in ("f2.bin", "f3.bin"):
            assert (mp / key).read_bytes() == (data / key).read_bytes()
        fds = len(os.listdir(f"/proc/{node.proc.pid}/fd"))  # type: ignore[union-attr]
        assert fds < NOFILE - 64, f"the daemon holds {fds} fds"
    finally:
        for s in held:
            s.close()
        node.cleanup()
    assert not node.log_problems(), "\n".join(node.log_problems())
