"""One conformance suite every backend passes: local, S3 (moto), Azure (Azurite), GCS
(fake-gcs-server), each against a real server on 127.0.0.1 started by tests/support/servers.py.

Owns the behavioural contract of silofs.backends.base.Backend as the daemon relies on it:
exact listings (odd names, deep paths, empty objects, markers skipped, many pages), byte
ranges including short and empty reads, ObjectChangedError instead of mixed bytes, and
typed errors for a missing bucket, an empty prefix, bad credentials and a dead endpoint.
Store-specific credential handling is tested at the end. Never talks to a real cloud.
"""

from __future__ import annotations

import base64
import datetime as dt
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from silofs.errors import (
    AccessDeniedError,
    NotFoundError,
    ObjectChangedError,
    UnreachableError,
    UsageError,
)
from silofs.node.backends import Backend, BackendOptions, open_backend
from silofs.node.backends.base import StoreCounters
from silofs.records import ObjectInfo
from silofs.uri import parse_uri
from tests.support.servers import LocalStore, Store, clean_env

pytestmark = pytest.mark.servers

KINDS = ["local", "s3", "azure", "gcs"]
PREFIX = "ds/"
PAGE = 7  # small on purpose: the dataset below spans several pages


def _bytes(seed: str, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


# Dataset-relative key -> content. Names exercise URL/XML encoding on list and GET.
FILES: dict[str, bytes] = {
    "plain.txt": b"hello silofs\n",
    "with space.txt": _bytes("space", 300),
    "ünïcödé/日本語 ファイル.bin": _bytes("unicode", 777),
    "plus+and%percent=equals&amp.bin": _bytes("plus", 64),
    "a/b/c/d/e/f/g/h/deep.bin": _bytes("deep", 4096),
    "empty.bin": b"",
    "big.bin": _bytes("big", 10_000),
    **{f"many/{i:02d}.bin": _bytes(f"many{i}", 10 + i) for i in range(20)},
}
MARKERS = [PREFIX, f"{PREFIX}many/", f"{PREFIX}marker-only/"]  # zero-byte 'dir/' keys
DECOYS = {"other/x.bin": b"x", "ds-sibling/y.bin": b"y", "dsx": b"z"}  # outside the prefix


def _store_objects() -> dict[str, bytes]:
    objects = {PREFIX + k: v for k, v in FILES.items()}
    objects.update({m: b"" for m in MARKERS})
    objects.update(DECOYS)
    return objects


# ---------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module", params=KINDS)
def store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Store:
    if request.param == "local":
        return LocalStore(tmp_path_factory.mktemp("local-store"))
    fixture = {"s3": "s3_server", "azure": "azurite_server", "gcs": "gcs_server"}[request.param]
    return request.getfixturevalue(fixture)


@pytest.fixture(autouse=True)
def _store_env(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each store's test environment (credentials, no ambient cloud settings).

    Looked up dynamically so tests that need no store are not parametrized over all four.
    """
    if "store" in request.fixturenames:
        request.getfixturevalue("store").apply_env(monkeypatch)


@pytest.fixture(scope="module")
def dataset(store: Store) -> str:
    """A bucket holding the full dataset, shared by the read-only tests of one store."""
    bucket = f"silofs-conf-{random.Random().getrandbits(48):012x}"
    store.create(bucket, _store_objects())
    return bucket


def _open(store: Store, bucket: str, prefix: str = PREFIX, **opts: object) -> Backend:
    return open_backend(parse_uri(store.uri(bucket, prefix)), store.options(**opts))


@pytest.fixture
def backend(store: Store, dataset: str) -> Iterator[Backend]:
    b = _open(store, dataset, page_size=PAGE)
    yield b
    b.close()


def _listing(backend: Backend) -> dict[str, ObjectInfo]:
    infos = list(backend.list())
    by_key = {i.key: i for i in infos}
    assert len(by_key) == len(infos), "a key was listed twice"
    return by_key


# ---------------------------------------------------------------------------------------
# Listing


def test_list_returns_exactly_the_objects_with_sizes(backend: Backend) -> None:
    listed = _listing(backend)
    assert {k: i.size for k, i in listed.items()} == {k: len(v) for k, v in FILES.items()}


def test_list_metadata_is_usable(backend: Backend) -> None:
    listed = _listing(backend)
    now = time.time()
    for info in listed.values():
        assert info.version and info.content_id, info
        assert abs(info.mtime - now) < 3600, info
    # Every object has different bytes, so every identity differs.
    assert len({i.content_id for i in listed.values()}) == len(listed)


def test_check_passes_on_a_good_dataset(backend: Backend) -> None:
    backend.check()
    # First time, every request answered as asked: nothing retried, nothing handed back
    # (a local directory makes no requests and keeps no counters).
    assert getattr(backend, "counters", StoreCounters()) == StoreCounters()


# ---------------------------------------------------------------------------------------
# Reading


def test_every_object_reads_back_whole(backend: Backend) -> None:
    for key, info in _listing(backend).items():
        assert backend.get_range(info, 0, info.size + 1) == FILES[key], key


RANGES = [
    pytest.param(0, 100, id="start"),
    pytest.param(4000, 1234, id="middle"),
    pytest.param(9950, 50, id="end"),
    pytest.param(9990, 100, id="short-at-end"),
    pytest.param(10_000, 10, id="at-eof"),
    pytest.param(12_345, 10, id="past-eof"),
    pytest.param(123, 0, id="length-0"),
    pytest.param(0, 10_000, id="whole"),
]


@pytest.mark.parametrize(("start", "length"), RANGES)
def test_get_range(backend: Backend, start: int, length: int) -> None:
    info = _listing(backend)["big.bin"]
    got = backend.get_range(info, start, length)
    assert got == FILES["big.bin"][start : start + length]


def test_get_range_of_empty_object(backend: Backend) -> None:
    info = _listing(backend)["empty.bin"]
    assert backend.get_range(info, 0, 4096) == b""


def test_overwritten_object_raises_changed_never_mixed_bytes(
    store: Store, bucket_name: str
) -> None:
    old = _bytes("old", 2048)
    new = _bytes("new", 2048)  # same size: identity must not rest on size
    store.create(bucket_name, {f"{PREFIX}victim.bin": old, f"{PREFIX}bystander.bin": b"still"})
    backend = _open(store, bucket_name, max_attempts=2, backoff_base=0.01)
    listed = _listing(backend)
    assert backend.get_range(listed["victim.bin"], 0, 16) == old[:16]

    store.put(bucket_name, f"{PREFIX}victim.bin", new)

    with pytest.raises(ObjectChangedError):
        backend.get_range(listed["victim.bin"], 100, 500)
    assert backend.get_range(listed["bystander.bin"], 0, 10) == b"still"
    relisted = _listing(backend)
    assert relisted["victim.bin"].version != listed["victim.bin"].version
    assert relisted["victim.bin"].content_id != listed["victim.bin"].content_id
    assert backend.get_range(relisted["victim.bin"], 100, 500) == new[100:600]
    backend.close()


def test_a_content_id_is_vouched_for_only_with_the_bytes_it_names(backend: Backend) -> None:
    """What a cluster's home relies on before it caches a member's chunk under the
    content id the member names: a listed object is vouched for (a local directory's
    by its listing only), and an object's version under another's content id is either
    not vouched for or refused by the GET, never read."""
    import dataclasses

    listed = _listing(backend)
    a, b = listed["big.bin"], listed["with space.txt"]
    assert backend.identifies(a) == (not backend.uri.startswith("file://"))
    forged = dataclasses.replace(a, content_id=b.content_id, size=b.size)
    if backend.identifies(forged):  # a digest (Azure): the answer names the real one
        with pytest.raises(ObjectChangedError):
            backend.get_range(forged, 0, 100)
    assert not backend.identifies(dataclasses.replace(a, size=a.size + 1))


# ---------------------------------------------------------------------------------------
# Errors


def test_missing_bucket_is_not_found(store: Store, bucket_name: str) -> None:
    backend = _open(store, bucket_name, max_attempts=2, backoff_base=0.01)
    with pytest.raises(NotFoundError) as err:
        backend.check()
    assert bucket_name in str(err.value)


def test_prefix_without_objects_is_not_found(store: Store, dataset: str) -> None:
    backend = _open(store, dataset, prefix="nothing-here/", max_attempts=2, backoff_base=0.01)
    with pytest.raises(NotFoundError) as err:
        backend.check()
    assert "nothing-here" in str(err.value)


def test_bad_credentials_are_access_denied(
    store: Store,
    dataset: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    uri, opts = store.bad_credentials(request, monkeypatch, dataset)
    backend = open_backend(parse_uri(uri), opts)
    with pytest.raises(AccessDeniedError):
        backend.check()
    with pytest.raises(AccessDeniedError):
        list(backend.list())


def test_unreachable_endpoint_fails_fast(store: Store, dataset: str, closed_port: int) -> None:
    opts = store.unreachable_options(
        closed_port, max_attempts=2, backoff_base=0.01, connect_timeout=2.0
    )
    backend = open_backend(parse_uri(store.uri(dataset, PREFIX)), opts)  # no I/O yet
    started = time.monotonic()
    with pytest.raises(UnreachableError) as err:
        backend.check()
    assert time.monotonic() - started < 10
    assert str(closed_port) in str(err.value)


# ---------------------------------------------------------------------------------------
# Store-specific credential handling (no cloud; most need no server at all)


@pytest.mark.parametrize("store", ["s3"], indirect=True)
def test_s3_endpoint_from_aws_endpoint_url(
    store: Store, dataset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", store.options().endpoint_url or "")
    backend = open_backend(parse_uri(store.uri(dataset, PREFIX)), BackendOptions(page_size=PAGE))
    assert len(_listing(backend)) == len(FILES)


@pytest.mark.parametrize("store", ["s3"], indirect=True)
def test_s3_without_credentials_is_access_denied(
    store: Store, dataset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    backend = _open(store, dataset)
    with pytest.raises(AccessDeniedError, match="AWS_ACCESS_KEY_ID"):
        backend.check()


def _azurite_sas(store: Store, bucket: str, expiry: dt.datetime) -> str:
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    from tests.support.servers import AZURITE_ACCOUNT, AZURITE_KEY

    return generate_container_sas(
        AZURITE_ACCOUNT,
        bucket,
        account_key=AZURITE_KEY,
        permission=ContainerSasPermissions(read=True, list=True),
        expiry=expiry,
    )


@pytest.mark.parametrize("store", ["azure"], indirect=True)
def test_azure_sas_token_lists_and_expired_sas_is_denied(store: Store, dataset: str) -> None:
    endpoint = store.endpoint_url  # type: ignore[attr-defined]
    now = dt.datetime.now(dt.UTC)
    good = _azurite_sas(store, dataset, now + dt.timedelta(hours=1))
    backend = open_backend(
        parse_uri(store.uri(dataset, PREFIX)),
        BackendOptions(endpoint_url=endpoint, page_size=PAGE, extra={"sas_token": good}),
    )
    assert len(_listing(backend)) == len(FILES)

    expired = _azurite_sas(store, dataset, now - dt.timedelta(hours=1))
    backend = open_backend(
        parse_uri(store.uri(dataset, PREFIX)),
        BackendOptions(endpoint_url=endpoint, max_attempts=1, extra={"sas_token": expired}),
    )
    with pytest.raises(AccessDeniedError):
        backend.check()


@pytest.mark.parametrize("store", ["azure"], indirect=True)
def test_azure_account_key_env_and_bare_emulator_endpoint(
    store: Store, dataset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.support.servers import AZURITE_KEY

    # An endpoint without the account path gets it appended for an IP host (Azurite).
    bare = store.endpoint_url.rsplit("/", 1)[0]  # type: ignore[attr-defined]
    monkeypatch.setenv("AZURE_STORAGE_BLOB_ENDPOINT", bare)
    monkeypatch.setenv("AZURE_STORAGE_KEY", AZURITE_KEY)
    backend = open_backend(parse_uri(store.uri(dataset, PREFIX)), BackendOptions())
    assert len(_listing(backend)) == len(FILES)


def test_azure_without_credentials_is_fast_access_denied(monkeypatch: pytest.MonkeyPatch) -> None:
    clean_env(monkeypatch)
    backend = open_backend(parse_uri("az://someaccount/container/p/"), BackendOptions())
    started = time.monotonic()
    with pytest.raises(AccessDeniedError, match="AZURE_STORAGE_CONNECTION_STRING"):
        backend.check()
    assert time.monotonic() - started < 1


def test_azure_connection_string_for_another_account_is_usage_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clean_env(monkeypatch)
    key = base64.b64encode(b"k" * 32).decode()
    conn = f"DefaultEndpointsProtocol=https;AccountName=other;AccountKey={key}"
    with pytest.raises(UsageError, match="other"):
        open_backend(
            parse_uri("az://mine/container/"), BackendOptions(extra={"connection_string": conn})
        )


def _no_google_env(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    clean_env(monkeypatch)
    for name in ("GCE_METADATA_HOST", "GCE_METADATA_IP", "CLOUDSDK_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(home))


def test_gcs_key_file_that_is_not_json_is_access_denied_naming_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _no_google_env(monkeypatch, tmp_path)
    key = tmp_path / "key.json"
    key.write_text("this is not json")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
    backend = open_backend(parse_uri("gs://some-bucket/p/"), BackendOptions())
    with pytest.raises(AccessDeniedError) as err:
        backend.check()
    assert str(key) in str(err.value)
    assert "\n" not in str(err.value)


def test_gcs_without_credentials_is_fast_access_denied(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _no_google_env(monkeypatch, tmp_path)
    if Path("/sys/class/dmi/id/product_name").is_file() and Path(
        "/sys/class/dmi/id/product_name"
    ).read_text().startswith("Google"):
        pytest.skip("running on GCE: the metadata server is a legitimate credential source")
    backend = open_backend(parse_uri("gs://some-bucket/p/"), BackendOptions())
    started = time.monotonic()
    with pytest.raises(AccessDeniedError, match="GOOGLE_APPLICATION_CREDENTIALS"):
        backend.check()
    assert time.monotonic() - started < 1


@pytest.mark.parametrize("store", ["gcs"], indirect=True)
def test_gcs_emulator_host_env_means_anonymous(
    store: Store, dataset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = store.endpoint_url.removeprefix("http://")  # type: ignore[attr-defined]
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", host)
    backend = open_backend(parse_uri(store.uri(dataset, PREFIX)), BackendOptions(page_size=PAGE))
    assert len(_listing(backend)) == len(FILES)


def test_local_names_that_are_not_utf8_are_skipped_not_fatal(tmp_path) -> None:
    import os

    (tmp_path / "good.bin").write_bytes(b"y")
    with open(os.path.join(bytes(tmp_path), b"bad\xff.bin"), "wb") as f:
        f.write(b"x")
    keys = [o.key for o in open_backend(parse_uri(str(tmp_path)), BackendOptions()).list()]
    assert keys == ["good.bin"]
