"""The GCS backend's listing keeps objects.list's JSON items instead of the library's Blob
objects (silofs/node/backends/gcs.py ListedObject), against fake-gcs-server.

Owns: the ObjectInfos a listing makes (key, size, mtime, version, content id) equal those
made from the library's own Blob objects for the same bucket, flat and by delimiter,
across page tokens, for awkward names, composed objects (no MD5) and objects of the same
second; and the prefixes equal list_blobs' own. A content id that changed would make
every cached chunk of a GCS dataset unreachable after an upgrade.
"""

from __future__ import annotations

import pytest

from silofs.node.backends import gcs
from silofs.node.backends.base import relative_key
from silofs.node.backends.gcs import GCSBackend
from silofs.records import ObjectInfo
from silofs.uri import parse_uri
from tests.support.servers import GCSServer

pytestmark = pytest.mark.servers

NAMES = ["ds/plain.bin", "ds/a & b <c> 'd'.bin", "ds/日本/ü+%20.bin", "ds/sub/x.bin", "ds/z"]


@pytest.fixture(scope="module")
def bucket(gcs_server: GCSServer) -> str:
    name = "lean-list"
    b = gcs_server.client().create_bucket(name)
    for i, key in enumerate(NAMES):
        b.blob(key).upload_from_string(b"x" * (10 + i))
    parts = [b.blob(k) for k in NAMES[:2]]
    b.blob("ds/composed.bin").compose(parts)  # a composite object: crc32c, no MD5
    return name


def _sdk_info(prefix: str, blob) -> ObjectInfo | None:  # noqa: ANN001 - the library's Blob
    """What the listing made from a Blob before it kept the JSON items."""
    key = relative_key(prefix, blob.name)
    if key is None:
        return None
    if blob.md5_hash:
        digest = f"md5:{blob.md5_hash}"
    elif blob.crc32c:
        digest = f"crc32c:{blob.crc32c}"
    else:
        digest = "none"
    mtime = blob.updated.timestamp() if blob.updated else 0.0
    cid = f"gs-{digest}:{blob.size}:{blob.generation}"
    return ObjectInfo(key, int(blob.size), mtime, str(blob.generation), cid)


@pytest.mark.parametrize("workers", [1, 4])
def test_listing_equals_the_librarys_blobs(
    gcs_server: GCSServer, bucket: str, workers: int
) -> None:
    opts = gcs_server.options(page_size=2, list_workers=workers)
    backend = GCSBackend(parse_uri(f"gs://{bucket}/ds/"), opts)
    got = sorted(backend.list(), key=lambda i: i.key)
    sdk = gcs_server.client().list_blobs(bucket, prefix="ds/")
    want = sorted(filter(None, (_sdk_info("ds/", b) for b in sdk)), key=lambda i: i.key)
    assert got == want


def test_prefixes_equal_the_librarys(gcs_server: GCSServer, bucket: str) -> None:
    backend = GCSBackend(parse_uri(f"gs://{bucket}/ds/"), gcs_server.options(page_size=2))
    prefixes, token = [], None
    while True:
        _, subs, token = backend._list_dir_page("ds/", token)
        prefixes += subs
        if token is None:
            break
    it = gcs_server.client().list_blobs(bucket, prefix="ds/", delimiter="/")
    list(it)
    # Pages may repeat a prefix (fake-gcs-server does); list_blobs keeps them as a set.
    assert sorted(set(prefixes)) == sorted(it.prefixes) == ["ds/sub/", "ds/日本/"]


def test_a_library_without_its_iterator_lists_through_its_blobs(
    gcs_server: GCSServer, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    opts = gcs_server.options(page_size=2, list_workers=4)
    want = sorted(GCSBackend(parse_uri(f"gs://{bucket}/ds/"), opts).list(), key=lambda i: i.key)
    monkeypatch.setattr(gcs, "_raw_lister", lambda _client: None)
    got = sorted(GCSBackend(parse_uri(f"gs://{bucket}/ds/"), opts).list(), key=lambda i: i.key)
    assert got == want and len(got) == len(NAMES) + 1
