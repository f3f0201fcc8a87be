"""The Azure backend's own List Blobs parser (silofs/node/backends/azurelist.py) against
Azurite, side by side with the SDK's deserializer.

Owns: every page the lean path lists (flat and by delimiter, across markers) gives the
same blobs, prefixes and next marker as the SDK lists for the same request, for names
with XML's special characters, unicode, '+' and '%', blobs with and without a
Content-MD5, and a hierarchical-namespace folder blob; the backend's listing takes no
SDK fallback for them; and an error answer is classified as the SDK's would be. The
backend's behaviour itself is pinned by test_backend_conformance.py, which runs through
this path unchanged.
"""

from __future__ import annotations

import pytest
from azure.storage.blob import ContentSettings

from silofs.errors import AccessDeniedError, NotFoundError
from silofs.node.backends import azurelist
from silofs.node.backends.azure import AzureBackend
from silofs.node.backends.base import BackendOptions
from silofs.uri import parse_uri
from tests.support.servers import AZURITE_KEY, AzuriteServer, connection_string

pytestmark = pytest.mark.servers

NAMES = [
    "ds/plain.bin",
    "ds/a & b <c> 'd' \"e\".bin",
    "ds/日本/ü+%20.bin",
    "ds/sub/deeper/x.bin",
    "ds/sub/y.bin",
    "ds/z.bin",
]


@pytest.fixture(scope="module")
def container(azurite_server: AzuriteServer) -> str:
    name = "lean-list"
    c = azurite_server.service().create_container(name)
    for i, key in enumerate(NAMES):
        c.upload_blob(key, b"x" * (10 + i), overwrite=True)
    # No MD5 (as blobs uploaded in blocks without one), and a folder blob.
    c.upload_blob("ds/nomd5.bin", b"y" * 5, content_settings=ContentSettings(content_md5=None))
    c.get_blob_client("ds/nomd5.bin").set_http_headers(ContentSettings())
    c.upload_blob("ds/folder", b"", metadata={"hdi_isfolder": "true"})
    return name


def _backend(server: AzuriteServer, container: str, **opts: object) -> AzureBackend:
    extra = {"connection_string": server.connection_string}
    return AzureBackend(
        parse_uri(f"az://{server.account}/{container}/ds/"), BackendOptions(extra=extra, **opts)
    )


def _pages(fn, prefix: str, delimiter: str | None) -> list[tuple]:  # noqa: ANN001
    out, token = [], None
    while True:
        page = fn(prefix, token, 2, delimiter)
        out.append(page)
        token = page[2]
        if token is None:
            return out


@pytest.mark.parametrize("delimiter", [None, "/"])
@pytest.mark.parametrize("prefix", ["ds/", "ds/sub/", "ds/日本/"])
def test_every_page_equals_the_sdks(
    azurite_server: AzuriteServer, container: str, prefix: str, delimiter: str | None
) -> None:
    backend = _backend(azurite_server, container)
    client = backend._container()
    lean = _pages(lambda *a: azurelist.list_page(client, *a), prefix, delimiter)
    sdk = _pages(lambda *a: backend._list_sdk(client, *a), prefix, delimiter)
    assert lean == sdk
    blobs = {b.name: b for page in lean for b in page[0]}
    if prefix == "ds/" and delimiter is None:
        assert blobs["ds/nomd5.bin"].md5 is None
        assert blobs["ds/plain.bin"].md5 is not None
        assert blobs["ds/folder"].folder and not blobs["ds/plain.bin"].folder
        assert set(blobs) == {*NAMES, "ds/nomd5.bin", "ds/folder"}


def test_the_listing_takes_no_fallback(azurite_server: AzuriteServer, container: str) -> None:
    for workers in (1, 4):
        backend = _backend(azurite_server, container, page_size=2, list_workers=workers)
        keys = sorted(i.key for i in backend.list())
        assert keys == sorted([n[3:] for n in NAMES] + ["nomd5.bin"])  # the folder is no file
        assert backend.counters.lean_fallbacks == 0


def test_errors_are_classified_as_the_sdks(azurite_server: AzuriteServer) -> None:
    missing = _backend(azurite_server, "no-such-container")
    with pytest.raises(NotFoundError, match="does not exist"):
        missing._list_raw("ds/", None, 1, None)
    wrong_key = AZURITE_KEY[:-4] + "AAA="
    extra = {"connection_string": connection_string(azurite_server.endpoint_url, wrong_key)}
    denied = AzureBackend(
        parse_uri(f"az://{azurite_server.account}/lean-list/ds/"), BackendOptions(extra=extra)
    )
    with pytest.raises(AccessDeniedError, match="denied"):
        denied._list_raw("ds/", None, 1, None)


def test_a_blob_without_an_md5_is_not_read_under_a_digests_name(
    azurite_server: AzuriteServer, container: str
) -> None:
    """A cluster member may name a blob by any digest-shaped content id (identifies()
    cannot tell it from the version): the GET must refuse one the blob does not have,
    or a blob without an MD5 could be cached under another blob's digest and size."""
    import dataclasses

    from silofs.errors import ObjectChangedError

    backend = _backend(azurite_server, container)
    listed = {i.key: i for i in backend.list()}
    nomd5, plain = listed["nomd5.bin"], listed["plain.bin"]
    assert not nomd5.content_id.startswith("az-md5:")
    assert backend.get_range(nomd5, 0, 5) == b"y" * 5
    scope = nomd5.content_id.rsplit(":", 1)[1]  # nomd5.bin's own
    plain_md5 = plain.content_id.split(":")[1]
    for forged_id in (azurelist.md5_content_id("AAAAAAAAAAAAAAAAAAAAAA==", nomd5.size, scope),
                      azurelist.md5_content_id(plain_md5, nomd5.size, scope)):  # fmt: skip
        forged = dataclasses.replace(nomd5, content_id=forged_id)
        assert backend.identifies(forged)
        with pytest.raises(ObjectChangedError):
            backend.get_range(forged, 0, 5)
