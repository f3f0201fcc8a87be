"""Azure's List Blobs pages, parsed here instead of by the SDK's deserializer.

Owns: the request for one page of a container listing (sent through the ContainerClient's
own pipeline, so its credential, signing, endpoint, proxies and timeouts are the SDK's),
and the parse of the EnumerationResults XML into ListedBlob records, prefixes and the
next marker. The SDK builds a BlobProperties model per blob through its generic
deserializer, ~0.25 ms of CPU per blob listed: one daemon then lists at most ~4 k Azure
objects per second however far the listing fans out (bench/README.md). ElementTree's
parse of the same page costs a few microseconds per blob.

Never: retries (base.retry_call owns them), follows a page it cannot parse (the caller
lists that page through the SDK instead, LeanDeclined), or keeps anything between pages.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET  # noqa: N817 - the usual name
from base64 import b64decode, b64encode
from dataclasses import dataclass
from email.utils import mktime_tz, parsedate_tz
from hashlib import blake2b
from typing import Any
from urllib.parse import unquote

from azure.core import exceptions as ax
from azure.core.rest import HttpRequest


@dataclass(frozen=True, slots=True)
class ListedBlob:
    """What a listing keeps of one blob (the SDK's BlobProperties carry much more)."""

    name: str
    size: int
    etag: str  # as listed: 0x8D..., no quotes (the SDK's BlobProperties.etag too)
    mtime: float
    md5: bytes | None  # Content-MD5, absent for blobs uploaded in blocks without one
    folder: bool  # a hierarchical-namespace directory (metadata hdi_isfolder=true)


class LeanDeclined(Exception):
    """A 200 page this parser does not read; the caller lists it through the SDK."""


def list_page(
    container: Any, prefix: str, token: str | None, page_size: int, delimiter: str | None
) -> tuple[list[ListedBlob], list[str], str | None]:
    """One List Blobs page: (blobs, prefixes, next marker or None). An error answer
    raises azure-core's HttpResponseError carrying the service's error code, as the
    SDK would; transport errors are the pipeline's own AzureErrors."""
    query = {"restype": "container", "comp": "list", "maxresults": str(page_size)}
    query["include"] = "metadata"  # hdi_isfolder: a directory blob, not a file
    if prefix:
        query["prefix"] = prefix
    if delimiter:
        query["delimiter"] = delimiter
    if token:
        query["marker"] = token
    # params: azure-core formats the query as the SDK's own requests (and signs it so).
    headers = {"x-ms-version": container.api_version}
    request = HttpRequest("GET", container.url, params=query, headers=headers)
    pipeline = getattr(container, "_pipeline", None)  # the SDK's own; a later one may move it
    if pipeline is None:
        raise LeanDeclined("this azure-storage-blob has no ContainerClient._pipeline")
    response = pipeline.run(request).http_response
    if response.status_code != 200:
        raise _http_error(response)
    try:
        return parse_page(response.body())
    except (ET.ParseError, ValueError, TypeError, AttributeError) as exc:
        raise LeanDeclined(f"a List Blobs page not in the expected form: {exc}") from exc


def _http_error(response: Any) -> ax.HttpResponseError:
    cls = {404: ax.ResourceNotFoundError, 401: ax.ClientAuthenticationError}.get(
        response.status_code, ax.HttpResponseError
    )
    exc = cls(response=response)
    exc.error_code = response.headers.get("x-ms-error-code")  # what the SDK's handler sets
    return exc


def parse_page(body: bytes) -> tuple[list[ListedBlob], list[str], str | None]:
    """EnumerationResults: (blobs, prefixes, next marker or None); ValueError (or
    ParseError) for anything else."""
    root = ET.fromstring(body)  # noqa: S314 - expat expands no external entities
    if root.tag != "EnumerationResults":
        raise ValueError(f"a page whose root is {root.tag}")
    blobs: list[ListedBlob] = []
    prefixes: list[str] = []
    times: dict[str, float] = {}  # a page's blobs often share one Last-Modified
    for el in root.iterfind("Blobs/*"):
        if el.tag == "BlobPrefix":
            prefixes.append(_name(el))
        elif el.tag == "Blob":
            blobs.append(_blob(el, times))
    return blobs, prefixes, root.findtext("NextMarker") or None


def _name(el: ET.Element) -> str:
    name = el.find("Name")
    if name is None or name.text is None:
        raise ValueError("an entry without a Name")
    # Names holding characters XML cannot carry come percent-encoded, flagged.
    return unquote(name.text) if name.get("Encoded") == "true" else name.text


def _blob(el: ET.Element, times: dict[str, float]) -> ListedBlob:
    props = el.find("Properties")
    if props is None:
        raise ValueError("a Blob without Properties")
    mod = props.findtext("Last-Modified")
    size, etag = props.findtext("Content-Length"), props.findtext("Etag")
    if mod is None or size is None or etag is None:
        raise ValueError("a Blob without Last-Modified, Content-Length or Etag")
    when = times.get(mod)
    if when is None:
        parsed = parsedate_tz(mod)
        if parsed is None:
            raise ValueError(f"a Last-Modified that is no HTTP date: {mod!r}")
        when = times[mod] = float(mktime_tz(parsed))
    md5 = props.findtext("Content-MD5")
    folder = (el.findtext("Metadata/hdi_isfolder") or "").lower() == "true"
    return ListedBlob(_name(el), int(size), etag, when, b64decode(md5) if md5 else None, folder)


def from_properties(props: Any) -> ListedBlob:
    """The same record from the SDK's BlobProperties (a page it listed)."""
    md5 = props.content_settings.content_md5 if props.content_settings else None
    return ListedBlob(
        props.name,
        int(props.size),
        str(props.etag),
        props.last_modified.timestamp(),
        bytes(md5) if md5 else None,
        (props.metadata or {}).get("hdi_isfolder", "").lower() == "true",
    )


def content_id(blob: ListedBlob, scope: str) -> str:
    """The content id of a listed blob; `scope` is blob_scope() of its account,
    container and name."""
    if blob.md5:
        return md5_content_id(b64encode(blob.md5).decode(), blob.size, scope)
    return etag_content_id(blob.etag, blob.size, scope)


def blob_scope(account: str, container: str, name: str) -> str:
    """What a content id holds of the blob it names (a keyed digest of its account,
    container and full name): chunks are keyed by content id across datasets, and
    neither of a blob's identities binds its bytes by itself. Its Content-MD5 is a
    property the blob's writer sets (Set Blob Properties and Put Block List check it
    against nothing): named by the digest alone, a blob given another blob's MD5 and
    size had its bytes cached under that blob's chunk keys and served to its readers.
    An ETag is the service's, but nothing makes two blobs' differ. So a blob's chunks
    are its own (two datasets of nested prefixes still share them); identical copies in
    two blobs are cached twice."""
    text = f"{account}/{container}/{name}".encode("utf-8", "surrogateescape")
    # 1-2 us a blob on the 2-core test host (timeit), against 24-26 us of CPU a blob
    # listed (bench/README.md, listing.py).
    return blake2b(text, digest_size=12, person=b"silofs-az-blob").hexdigest()


def md5_content_id(md5_b64: str, size: int, scope: str) -> str:
    """The content id of a blob listed with an MD5 (base64, as Azure sends it)."""
    return f"az-md5:{md5_b64}:{size}:{scope}"


def etag_content_id(etag: str, size: int, scope: str) -> str:
    """The content id of a blob listed without an MD5."""
    return f"az-etag:{etag}:{size}:{scope}"
