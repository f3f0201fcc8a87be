"""The pytest plugin over the support package: servers and nodes as fixtures.

Owns the session-wide storage servers (moto, a second moto that checks credentials,
Azurite, fake-gcs-server), per-test bucket names, closed ports and local stores, the
`needs_fuse` mark, and `make_node`: real silofs nodes whose teardown leaves no mount and
no process behind and fails the test on an unexpected ERROR or traceback in their logs.
A server that cannot be started FAILS the test (never skips: CI installs all of them);
only a missing FUSE skips, with the reason.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support.net import free_port
from tests.support.node import FUSE_MISSING, Node
from tests.support.servers import (
    AzuriteServer,
    GCSServer,
    LocalStore,
    S3Server,
    ServerError,
    start_azurite,
    start_fake_gcs,
    start_moto,
)

needs_fuse = pytest.mark.skipif(FUSE_MISSING is not None, reason=FUSE_MISSING or "")


@contextmanager
def _failing_on_server_errors() -> Iterator[None]:
    try:
        yield
    except ServerError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto's S3 server on a free port; credentials in `.env` (any key works)."""
    with _failing_on_server_errors():
        server = start_moto("moto-s3")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_auth_server() -> Iterator[S3Server]:
    """A second moto that checks IAM credentials from its first request (none exist)."""
    with _failing_on_server_errors():
        server = start_moto("moto-s3-auth", {"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    yield server
    server.stop()


@pytest.fixture(scope="session")
def azurite_server() -> Iterator[AzuriteServer]:
    """Azurite's blob service on a free port, in memory, devstoreaccount1."""
    with _failing_on_server_errors():
        server = start_azurite()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[GCSServer]:
    """fake-gcs-server on a free port with the in-memory backend."""
    with _failing_on_server_errors():
        server = start_fake_gcs()
    yield server
    server.stop()


@pytest.fixture
def bucket_name() -> str:
    """A bucket/container name no other test uses (valid for S3, Azure and GCS)."""
    return f"silofs-{uuid.uuid4().hex[:16]}"


@pytest.fixture
def closed_port() -> int:
    """A port on 127.0.0.1 with no listener: connections to it are refused."""
    return free_port()


@pytest.fixture
def local_store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "stores")


@pytest.fixture
def make_node(tmp_path: Path) -> Iterator[Callable[..., Node]]:
    """make_node(cache_size="64M", env=None, start=True, name="node", args=(),
    socket=None, root=None, pythonpath=()) -> a running Node (its daemon started with
    `args`; root: its directory, for one other users must reach; default under tmp_path;
    pythonpath: directories first on its processes' PYTHONPATH)."""
    if FUSE_MISSING:
        pytest.skip(FUSE_MISSING)
    nodes: list[Node] = []

    def factory(
        cache_size: str = "64M",
        env: dict[str, str] | None = None,
        start: bool = True,
        name: str = "node",
        args: tuple[str, ...] = (),
        socket: str | None = None,
        root: Path | None = None,
        pythonpath: tuple[str, ...] = (),
    ) -> Node:
        root = root or tmp_path / f"{name}{len(nodes)}"
        root.mkdir()
        node = Node(root, cache_size, env, socket, pythonpath=pythonpath)
        nodes.append(node)
        if start:
            node.start(*args)
        return node

    yield factory
    for node in nodes:
        node.cleanup()
    problems = [p for node in nodes for p in node.log_problems()]
    if problems:
        pytest.fail(
            "unexpected errors in the silofs logs (declare expected ones with "
            "node.expect_errors):\n" + "\n".join(problems),
            pytrace=False,
        )
