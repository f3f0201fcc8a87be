"""azurelist.py's List Blobs parser on pages Azurite cannot send: percent-encoded names
(Encoded="true", for characters XML cannot carry), whitespace between elements, an
empty NextMarker; and what it refuses (another root, a blob without its properties, an
MD5 that is no base64), which the backend then lists through the SDK. Azurite's own
pages, side by side with the SDK's, are in tests/integration/test_azure_lean.py."""

from __future__ import annotations

from base64 import b64encode
from types import SimpleNamespace
from typing import Any

import pytest
from azure.core import exceptions as ax

from silofs.node.backends import azurelist

MD5 = bytes(range(16))


def _blob(name: str, encoded: bool = False, md5: str | None = None, meta: str = "") -> str:
    attr = ' Encoded="true"' if encoded else ""
    md5_el = f"<Content-MD5>{md5}</Content-MD5>" if md5 is not None else "<Content-MD5 />"
    return (
        f"<Blob>\n  <Name{attr}>{name}</Name>\n  <Properties>\n"
        "    <Creation-Time>Mon, 02 Feb 2026 10:20:30 GMT</Creation-Time>\n"
        "    <Last-Modified>Tue, 03 Feb 2026 10:20:30 GMT</Last-Modified>\n"
        "    <Etag>0x8DC0FFEE</Etag>\n    <Content-Length>42</Content-Length>\n"
        f"    {md5_el}\n  </Properties>\n  {meta}\n</Blob>\n"
    )


def _page(entries: str, marker: str = "") -> bytes:
    return (
        '<?xml version="1.0" encoding="utf-8"?>\n'
        '<EnumerationResults ServiceEndpoint="https://a.blob.core.windows.net/" '
        'ContainerName="c">\n  <Prefix>ds/</Prefix>\n  <MaxResults>2</MaxResults>\n'
        f"  <Blobs>\n{entries}  </Blobs>\n"
        + (f"  <NextMarker>{marker}</NextMarker>\n" if marker else "  <NextMarker />\n")
        + "</EnumerationResults>"
    ).encode()


def test_names_entities_md5_folders_and_the_marker() -> None:
    entries = (
        _blob("ds/a &amp; b &lt;c&gt;.bin", md5=b64encode(MD5).decode())
        + _blob("ds/ctl%01char%20x.bin", encoded=True)
        + _blob("ds/dir", meta="<Metadata><hdi_isfolder>TRUE</hdi_isfolder></Metadata>")
        + "<BlobPrefix><Name>ds/sub/</Name></BlobPrefix>\n"
        + '<BlobPrefix><Name Encoded="true">ds/%02odd/</Name></BlobPrefix>\n'
    )
    blobs, prefixes, token = azurelist.parse_page(_page(entries, marker="2!16!abc"))
    assert [b.name for b in blobs] == ["ds/a & b <c>.bin", "ds/ctl\x01char x.bin", "ds/dir"]
    assert prefixes == ["ds/sub/", "ds/\x02odd/"]
    assert token == "2!16!abc"
    first, second, third = blobs
    assert (first.size, first.etag, first.md5, first.folder) == (42, "0x8DC0FFEE", MD5, False)
    assert first.mtime == 1770114030.0  # Tue, 03 Feb 2026 10:20:30 GMT
    assert second.md5 is None and not second.folder
    assert third.folder
    scope = azurelist.blob_scope("acct", "c", first.name)
    assert azurelist.content_id(first, scope) == f"az-md5:{b64encode(MD5).decode()}:42:{scope}"
    assert azurelist.content_id(second, "s") == "az-etag:0x8DC0FFEE:42:s"
    # A blob's scope is its own: another name, container or account is another scope.
    others = {
        azurelist.blob_scope(*where)
        for where in (("acct", "c", "ds/x"), ("acct", "d", first.name), ("b", "c", first.name))
    }
    assert scope not in others and len(others) == 3 and len(scope) == 24
    assert azurelist.parse_page(_page(""))[2] is None  # <NextMarker />: the last page


@pytest.mark.parametrize(
    "body",
    [
        b"<Error><Code>InternalError</Code></Error>",
        _page("<Blob><Name>ds/x</Name></Blob>"),  # no Properties
        _page(_blob("ds/x", md5="not base64!")),
        _page(_blob("ds/x").replace("Tue, 03 Feb 2026 10:20:30 GMT", "yesterday")),
        b"<EnumerationResults><Blobs><Blob>",  # cut off
    ],
)
def test_a_page_out_of_form_is_declined(body: bytes) -> None:
    container = _container(200, body)
    with pytest.raises(azurelist.LeanDeclined):
        azurelist.list_page(container, "ds/", None, 2, "/")


def test_an_error_answer_carries_the_services_code() -> None:
    container = _container(404, b"", {"x-ms-error-code": "ContainerNotFound"})
    with pytest.raises(ax.ResourceNotFoundError) as caught:
        azurelist.list_page(container, "ds/", None, 2, None)
    assert caught.value.error_code == "ContainerNotFound"
    assert caught.value.status_code == 404


def _container(status: int, body: bytes, headers: dict[str, str] | None = None) -> Any:
    """A ContainerClient's parts that list_page uses, answering one request."""

    def run(request: Any) -> Any:
        assert request.method == "GET" and "comp=list" in request.url
        response = SimpleNamespace(
            status_code=status,
            headers=headers or {},
            body=lambda: body,
            reason="Not Found" if status == 404 else "OK",
            text=lambda encoding=None: body.decode(),
            content_type="application/xml",
            request=request,
        )
        return SimpleNamespace(http_response=response)

    return SimpleNamespace(
        url="https://a.blob.core.windows.net/c",
        api_version="2025-11-05",
        _pipeline=SimpleNamespace(run=run),
    )


def test_an_sdk_without_the_pipeline_leaves_the_page_to_the_sdk() -> None:
    # A later azure-storage-blob may move ContainerClient._pipeline: then every page is
    # listed through the SDK's own calls, never an AttributeError out of a listing.
    container = SimpleNamespace(url="https://a.blob.core.windows.net/c", api_version="x")
    with pytest.raises(azurelist.LeanDeclined, match="_pipeline"):
        azurelist.list_page(container, "ds/", None, 2, "/")
