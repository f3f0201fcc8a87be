"""Fixtures the unit tests share: a cache env, a fetcher, an in-process Daemon, directories.

Owns `store` (a fresh WritableStore, the daemon's side of a cache env, of STORE_MAP
bytes under tmp_path, closed after), `make_fetcher` (a node Fetcher and its Writer over
a small env), `daemon` (a Daemon in-process over its own cache dir:
tests/unit/inprocess.py), `bucket` (a local store of four patterned 300 KiB files for
that daemon), `world` (a directory every user may enter, for tests of other users'
access) and `pki` (a cluster CA with two node certificates for 127.0.0.1, read-only, one
per session). Never starts a subprocess, a server or a FUSE mount: unit tests are in-process.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from silofs.node.daemon import Daemon
from silofs.node.fetch import Fetcher
from silofs.node.quota import QuotaPolicy
from silofs.node.store_write import WritableStore, env_map_size
from silofs.node.writer import Writer
from tests.support.cluster import make_pki
from tests.support.trees import patterned_files, write_tree
from tests.unit.inprocess import settings

STORE_MAP = 64 << 20


@pytest.fixture
def store(tmp_path: Path) -> Iterator[WritableStore]:
    s = WritableStore(str(tmp_path / "cache"), STORE_MAP)
    yield s
    s.close()


@pytest.fixture
def make_fetcher(tmp_path: Path) -> Iterator[Callable[[], Fetcher]]:
    """make_fetcher() -> a Fetcher over a 1 MiB cache env and its Writer (made in the
    test's trio run, where the fetcher works); the env is closed after the test."""
    stores: list[WritableStore] = []

    def make() -> Fetcher:
        store = WritableStore(str(tmp_path / "fetch"), env_map_size(1 << 20))
        stores.append(store)
        writer = Writer(
            store,
            {},
            lambda: QuotaPolicy(1 << 20),
            batch_bytes=1 << 20,
            batch_seconds=0.01,
            queue_bytes=1 << 20,
            sync_seconds=60,
        )
        return Fetcher(store, writer, threads=4)

    yield make
    for s in stores:
        s.close()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(settings(tmp_path))
    yield d
    d.store.close()
    os.close(d.lock_fd)


@pytest.fixture
def bucket(tmp_path: Path) -> Path:
    return write_tree(tmp_path / "bucket", patterned_files(4, 300 << 10))


@pytest.fixture
def world() -> Iterator[Path]:
    """A 0755 directory under /tmp: pytest's tmp_path sits in a 0700 dir of root's."""
    base = Path(tempfile.mkdtemp(prefix="silofs-acc-", dir="/tmp"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/support/cluster.py make_pki: ca.pem, n0/n1 node certificates and keys."""
    return make_pki(tmp_path_factory.mktemp("pki"), ["127.0.0.1", "127.0.0.1"])
