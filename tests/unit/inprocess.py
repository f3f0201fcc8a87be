"""A Daemon in-process for unit tests: no FUSE, no socket, a local store in tmp_path.

Owns the settings such a Daemon starts with, running its writer and enforcer loops as
service.serve runs them, and opening and mounting a local directory as a dataset the way
a mount process registers one. Never asserts anything itself.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import trio

from silofs.config import ClusterSettings, NodeSettings
from silofs.node import daemon as daemon_mod
from silofs.node.daemon import Daemon
from silofs.node.state import MountState
from silofs.node.supervise import run_forever
from silofs.records import ObjectInfo

MiB = 1 << 20


def settings(tmp_path: Path, cache_size: int = 100 * MiB) -> NodeSettings:
    return NodeSettings(
        socket=str(tmp_path / "ctl.sock"),
        cache_dir=str(tmp_path / "cache"),
        cache_size=cache_size,
        chunk_size=256 << 10,
        sync_seconds=0.5,
    )


# A member's address in the in-process cluster tests: the node's tcp_listen, never
# listened on (nothing asks the node over the network there).
MEMBER_ME = "tls://127.0.0.1:1"


@contextlib.contextmanager
def member_daemon(
    tmp_path: Path, pki: Path, cluster: ClusterSettings, chunk_size: int
) -> Iterator[Daemon]:
    """A Daemon that is MEMBER_ME of `cluster` (the certificate n0 of the test PKI),
    closed after."""
    d = Daemon(
        NodeSettings(
            socket=str(tmp_path / "ctl.sock"),
            cache_dir=str(tmp_path / "cache"),
            cache_size=64 * MiB,
            chunk_size=chunk_size,
            tcp_listen="127.0.0.1:1",
            tls_cert=str(pki / "n0.pem"),
            tls_key=str(pki / "n0.key"),
            tls_client_ca=str(pki / "ca.pem"),
            cluster=cluster,
        )
    )
    try:
        yield d
    finally:
        d.cluster.close()
        d.store.close()
        os.close(d.lock_fd)


@contextlib.asynccontextmanager
async def running(d: Daemon) -> AsyncIterator[Daemon]:
    """The daemon's loops as service.serve runs them, minus the socket."""
    async with trio.open_nursery() as nursery:
        d.nursery = nursery
        for what, loop in (("writer", d.writer.run), ("enforcer", d.enforce_loop)):
            nursery.start_soon(run_forever, what, loop)
        yield d
        nursery.cancel_scope.cancel()


async def ready(d: Daemon, uri: str, endpoint_url: str | None = None) -> daemon_mod.DatasetState:
    ds = await d.catalog.open_dataset(uri, False, endpoint_url)
    with trio.fail_after(30):
        while ds.state in ("checking", "listing"):
            await trio.sleep(0.01)
    return ds


async def mounted(d: Daemon, bucket: Path) -> tuple[daemon_mod.DatasetState, MountState]:
    """The local `bucket` listed as a dataset, and a mount of it (job "j") by this
    process, as a mount process registers one."""
    ds = await ready(d, f"file://{bucket}/")
    return ds, d.register_mount(ds, "j", "/mnt/x", os.getpid(), os.getuid(), None)


def listed(d: Daemon, ds: daemon_mod.DatasetState, key: str) -> ObjectInfo:
    """The object `key` as the dataset's listing has it."""
    obj = d.store.get_object(ds.id, key)
    assert obj is not None, key
    return obj
