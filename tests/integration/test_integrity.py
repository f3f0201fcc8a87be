"""What a backend checks about the bytes it returns, against the real emulators.

Owns: a body a store sent that does not match the checksum the store sent with it is
refused and retried (ChecksumMismatchError, counted), never returned; a short body (a
truncated response, a Content-Length shorter than the range) is retried, never an error on
the first try; and the local store's version sees a rewrite that restored the mtime.
Faults are injected by tests/support/faultproxy.py between the backend and the emulator (moto,
Azurite, fake-gcs-server). What is NOT detected (a range of an S3 or GCS object over
plain HTTP) is pinned here too, so docs/SEMANTICS.md has to change with it.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from silofs.errors import ObjectChangedError
from silofs.node.backends import Backend, BackendOptions, open_backend
from silofs.node.backends.local import LocalBackend
from silofs.uri import parse_uri
from tests.support.faultproxy import Fault, FaultPlan, FaultProxy
from tests.support.servers import LocalStore, Store

pytestmark = pytest.mark.servers

CLOUDS = ["s3", "azure", "gcs"]
PREFIX = "ds/"
SMALL = random.Random("small").randbytes(110 << 10)  # read whole: the store's checksum
BIG = random.Random("big").randbytes(5 << 20)  # read in ranges; > 4 MiB (Azure's MD5 limit)


@pytest.fixture(scope="module", params=CLOUDS)
def store(request: pytest.FixtureRequest) -> Store:
    fixture = {"s3": "s3_server", "azure": "azurite_server", "gcs": "gcs_server"}[request.param]
    return request.getfixturevalue(fixture)


@pytest.fixture(autouse=True)
def _store_env(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if "store" in request.fixturenames:
        request.getfixturevalue("store").apply_env(monkeypatch)


@pytest.fixture(scope="module")
def bucket(store: Store) -> str:
    name = f"silofs-int-{random.Random().getrandbits(48):012x}"
    store.create(name, {f"{PREFIX}small.bin": SMALL, f"{PREFIX}big.bin": BIG})
    return name


@pytest.fixture
def proxy(store: Store) -> Iterator[FaultProxy]:
    parts = urlsplit(store.endpoint_url)  # type: ignore[attr-defined]
    with FaultProxy(upstream=(parts.hostname or "127.0.0.1", parts.port or 80), seed=7) as p:
        yield p


def _backend(store: Store, bucket: str, proxy: FaultProxy) -> Backend:
    path = urlsplit(store.endpoint_url).path  # type: ignore[attr-defined]  # Azurite: /account
    opts: BackendOptions = store.options(
        endpoint_url=proxy.url + path, max_attempts=4, backoff_base=0.01, backoff_max=0.05
    )
    return open_backend(parse_uri(store.uri(bucket, PREFIX)), opts)


def _only(kind: str, key: str, times: int = 1, **kw: object) -> FaultPlan:
    """`kind` on the first `times` GETs of object `key`, nothing else."""
    return FaultPlan(faults=(Fault(kind, methods="GET", path=key, times=times, **kw),))


@pytest.mark.parametrize("kind", ["corrupt", "truncate", "wrong_content_length", "reset_mid_body"])
def test_a_bad_whole_object_body_is_retried_never_returned(
    store: Store, bucket: str, proxy: FaultProxy, kind: str
) -> None:
    backend = _backend(store, bucket, proxy)
    info = {o.key: o for o in backend.list()}["small.bin"]
    proxy.set_plan(_only(kind, "small"))
    assert backend.get_range(info, 0, info.size) == SMALL
    assert proxy.stats[kind] == 1
    if kind == "corrupt":
        assert backend.counters.checksum_errors == 1  # type: ignore[attr-defined]
    backend.close()


@pytest.mark.parametrize("kind", ["truncate", "wrong_content_length", "reset_mid_body"])
def test_a_short_ranged_body_is_retried(
    store: Store, bucket: str, proxy: FaultProxy, kind: str
) -> None:
    backend = _backend(store, bucket, proxy)
    info = {o.key: o for o in backend.list()}["big.bin"]
    proxy.set_plan(_only(kind, "big"))
    assert backend.get_range(info, 1 << 20, 1 << 20) == BIG[1 << 20 : 2 << 20]
    assert proxy.stats[kind] == 1
    backend.close()


def test_a_corrupted_range_is_detected_only_where_the_store_checksums_ranges(
    store: Store, bucket: str, proxy: FaultProxy
) -> None:
    """Azure sends a range's MD5 (x-ms-range-get-content-md5, ranges <= 4 MiB); S3 and GCS
    send no checksum for a range, so over plain HTTP a flipped byte in a range of a large
    object is returned (docs/SEMANTICS.md says so; HTTPS's TLS would catch it in transit)."""
    backend = _backend(store, bucket, proxy)
    info = {o.key: o for o in backend.list()}["big.bin"]
    proxy.set_plan(_only("corrupt", "big"))
    got = backend.get_range(info, 1 << 20, 1 << 20)
    assert proxy.stats["corrupt"] == 1
    if store.kind == "azure":
        assert got == BIG[1 << 20 : 2 << 20]
        assert backend.counters.checksum_errors == 1  # type: ignore[attr-defined]
    else:
        assert got != BIG[1 << 20 : 2 << 20]  # the documented gap
    backend.close()


def test_azure_checks_a_range_longer_than_4mib_in_parts(
    store: Store, bucket: str, proxy: FaultProxy
) -> None:
    """Azure sends no MD5 for a range over 4 MiB: such a read is several checked GETs."""
    if store.kind != "azure":
        pytest.skip("Azure's range MD5 only")
    backend = _backend(store, bucket, proxy)
    info = {o.key: o for o in backend.list()}["big.bin"]
    proxy.set_plan(_only("corrupt", "big", times=2))
    assert backend.get_range(info, 0, info.size) == BIG
    assert proxy.stats["corrupt"] == 2
    gets = [r for r in proxy.settled_history() if r.method == "GET" and "big" in r.target]
    assert len(gets) >= 4  # two 4 MiB-or-less parts; the first two GETs refused, retried
    assert backend.counters.checksum_errors == 2  # type: ignore[attr-defined]
    backend.close()


# ---------------------------------------------------------------------------------------
# The local store


def test_local_rewrite_that_restores_mtime_is_a_change(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    old, new = b"a" * 5000, b"b" * 5000  # same size
    store.create("bkt", {"ds/f.bin": old, "ds/other.bin": b"keep"})
    backend = open_backend(parse_uri(store.uri("bkt", "ds/")), store.options())
    assert isinstance(backend, LocalBackend)
    listed = {o.key: o for o in backend.list()}
    path = tmp_path / "bkt" / "ds" / "f.bin"
    st = os.stat(path)
    # A rewrite in place (same inode, same size), then the mtime put back as it was.
    end = time.monotonic() + 5
    while os.stat(path).st_ctime_ns == st.st_ctime_ns:  # coarse ctime clocks: wait a tick
        with open(path, "r+b") as f:
            f.write(new)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert time.monotonic() < end, "ctime never moved"
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        st.st_ino,
        st.st_size,
        st.st_mtime_ns,
    )
    with pytest.raises(ObjectChangedError):
        backend.get_range(listed["f.bin"], 0, 100)
    assert backend.get_range(listed["other.bin"], 0, 4) == b"keep"
    relisted = {o.key: o for o in backend.list()}
    assert relisted["f.bin"].content_id != listed["f.bin"].content_id
    assert backend.get_range(relisted["f.bin"], 0, 100) == new[:100]
