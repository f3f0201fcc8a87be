"""The lean S3 request path: ListObjectsV2 pages and GetObject as signed HTTP requests.

Owns the happy path of the two calls a listing and a miss make thousands of times: a
request built here (the URL from the boto3 client's own endpoint resolution, SigV4 with
botocore's signer and the session's credentials frozen per request), sent through the
client's own HTTP session (its connection pool, proxies, CA bundle and timeouts), and a
ListObjectsV2 page parsed by a strict regex over the grammar S3 sends (ElementTree for
any page that grammar does not cover). Per 1000-key page this costs a few ms of Python
where botocore's request path, signing and parse cost ~15-20 ms under the GIL, which
bounded a fanned-out listing (bench/listing.py); per small-file GET it saves most of the
daemon's ~3-6 ms of botocore CPU (bench/cold.py).

Never maps an error itself: any answer but the expected 2xx (bar 429 and 5xx), any
transport error but a timeout (raised as botocore's, TIMEOUTS) and any page this module
cannot parse raises Fallback, and the caller (s3.py) redoes the request through
botocore, whose retries-off client, region redirects and error mapping are unchanged.
That is safe because both calls are GETs (idempotent; a GetObject is pinned to the
listed ETag by If-Match, so the redo reads the same version or fails as botocore says).
A 429 or 5xx is raised as the ClientError botocore would raise for it (see _busy), for
s3.py's one mapping, not redone. Never retries, never reads credentials from anywhere
but the boto3 session, never writes to the bucket.
"""

from __future__ import annotations

import http.client
import logging
import re
import threading
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from urllib.parse import unquote, urlsplit

import botocore.exceptions as bx
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest, AWSResponse
from botocore.httpchecksum import handle_checksum_body, resolve_response_checksum_algorithms
from botocore.response import StreamingBody
from botocore.utils import percent_encode, percent_encode_sequence

log = logging.getLogger(__name__)

# One listed object as the page parsers return it: key (store key), size, ETag
# (unquoted), LastModified (epoch seconds).
Item = tuple[str, int, str, float]
_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"


class _Body(StreamingBody):
    """botocore's StreamingBody, plus a readinto that receives straight into the
    caller's buffer (a cold read's chunk value: node/fetch.py): urllib3 2's readinto
    reads a bytes object and copies it, a second copy of every byte. It reads from the
    http.client response under urllib3 while urllib3 has nothing to decode and nothing
    of the body buffered, and through read() otherwise; a body read this way is read so
    to its end or closed, never read by urllib3 after it."""

    def readinto(self, buf: memoryview) -> int:
        raw = self._raw_stream
        fp = getattr(raw, "_fp", None)
        buffered = getattr(raw, "_decoded_buffer", None)
        if (
            isinstance(fp, http.client.HTTPResponse)
            and not raw.headers.get("content-encoding")
            and buffered is not None
            and not len(buffered)
        ):
            n = fp.readinto(buf)
            self._amount_read += n
            return n
        piece = self.read(len(buf))  # counted there
        buf[: len(piece)] = piece
        return len(piece)


# A request the store did not answer in time is raised as botocore raises it, never
# redone through botocore: that would wait the same timeout again for the same store.
TIMEOUTS = (bx.ReadTimeoutError, bx.ConnectTimeoutError)


class Fallback(Exception):
    """The lean path did not get the answer it handles: redo the request via botocore."""


_ERROR_CODE = re.compile(rb"<Code>([^<]{1,100})</Code>")
_ERROR_MESSAGE = re.compile(rb"<Message>([^<]{0,500})</Message>")


def _busy(resp: AWSResponse, op: str) -> bx.ClientError:
    """The ClientError botocore raises for a 429 or 5xx answer (its retries are off, and
    it follows no redirect for these): code and message from the error body, else the
    status, as botocore's parser takes them. Not redone: a redo would double the
    requests of a store that is already throttling, behind retry_call's backoff."""
    try:
        body = resp.raw.read(64 << 10) or resp.content  # a listing's is read already
    except Exception:  # noqa: BLE001 - the body is only for the message
        body = b""
    finally:
        resp.raw.close()
    code = _ERROR_CODE.search(body)
    message = _ERROR_MESSAGE.search(body)
    error = {
        "Code": code.group(1).decode(errors="replace") if code else str(resp.status_code),
        "Message": message.group(1).decode(errors="replace") if message else "",
    }
    meta: dict[str, Any] = {"HTTPStatusCode": resp.status_code}
    if (wait := resp.headers.get("retry-after")) is not None:
        meta["HTTPHeaders"] = {"retry-after": wait}  # as botocore's lowercased headers
    return bx.ClientError({"Error": error, "ResponseMetadata": meta}, op)


def etag(raw: str) -> str:
    return raw.strip('"')


def timestamp(text: str) -> float:
    # ISO 8601 as S3 writes it ("2024-01-01T00:00:00.000Z"); fromisoformat takes the Z
    # since Python 3.11.
    return datetime.fromisoformat(text).timestamp()


@dataclass
class ListPage:
    """One ListObjectsV2 page, parsed.

    Why not botocore's parser: it walks the output shape per element and parses every
    LastModified with dateutil, ~80-100 ms of CPU per 1000-key page under the GIL, which
    capped a fanned-out listing near 12 k objects/s whatever the number of workers
    (bench/listing.py). from_bytes (a regex) takes ~2 ms, from_xml (ElementTree) ~7 ms.
    """

    items: list[Item] = field(default_factory=list)
    prefixes: list[str] = field(default_factory=list)
    truncated: bool = False
    token: str | None = None

    @classmethod
    def from_bytes(cls, body: bytes) -> ListPage:
        """The regex parser where the page is in its grammar, else ElementTree's."""
        page = _parse_fast(body)
        return page if page is not None else cls.from_xml(body)

    @classmethod
    def from_xml(cls, body: bytes) -> ListPage:
        root = ET.fromstring(body)  # noqa: S314 - expat expands no external entities
        if root.tag != _NS + "ListBucketResult":
            raise ValueError(f"a page whose root is {root.tag}")  # e.g. a 200 <Error>
        url = root.findtext(_NS + "EncodingType") == "url"
        dec = unquote if url else str
        items = []
        for c in root.iterfind(_NS + "Contents"):
            key, size, tag, mod = (
                c.findtext(_NS + "Key"),
                c.findtext(_NS + "Size"),
                c.findtext(_NS + "ETag"),
                c.findtext(_NS + "LastModified"),
            )
            if key is None or size is None or mod is None:
                raise ValueError("a Contents element without Key, Size or LastModified")
            items.append((dec(key), int(size), etag(tag or ""), timestamp(mod)))
        prefixes = [
            dec(p.findtext(_NS + "Prefix") or "") for p in root.iterfind(_NS + "CommonPrefixes")
        ]
        return cls(
            items,
            prefixes,
            root.findtext(_NS + "IsTruncated") == "true",
            root.findtext(_NS + "NextContinuationToken"),
        )


# -- the regex page parser ---------------------------------------------------------
#
# The grammar: what S3 (and moto, s3rver, MinIO) send, elements in the order of S3's
# schema, no attributes or namespace prefixes on the elements read here, optional
# whitespace between elements. A Contents is Key, LastModified, ETag, any Checksum*
# elements, Size (the rest of it, Owner and StorageClass, is not read). Anything else
# (another order, a CDATA section, a comment, a carriage return, which XML would
# normalise, an encoding other than UTF-8, an entity this unescaper does not know)
# leaves the page to ElementTree: every element this parser reads must be matched by
# it, or it declines (the counts of "<Contents" and "<CommonPrefixes" are checked).
_PROLOG = re.compile(r"\s*(?:<\?xml[^>]*\?>\s*)?<ListBucketResult[\s>]")
_ENCODING = re.compile(r'<\?xml[^>]*encoding=["\']([^"\']*)["\']')
_CONTENTS = re.compile(
    r"<Contents>\s*<Key>([^<]*)</Key>\s*<LastModified>([^<]*)</LastModified>\s*"
    r"<ETag>([^<]*)</ETag>\s*(?:<Checksum\w*>[^<]*</Checksum\w*>\s*)*<Size>([0-9]+)</Size>"
)
_PREFIXES = re.compile(r"<CommonPrefixes>\s*<Prefix>([^<]*)</Prefix>\s*</CommonPrefixes>")
_TRUNCATED = re.compile(r"<IsTruncated>\s*(true|false)\s*</IsTruncated>")
_TOKEN = re.compile(r"<NextContinuationToken>([^<]*)</NextContinuationToken>")
_ENCODING_TYPE = re.compile(r"<EncodingType>([^<]*)</EncodingType>")
_ENTITY = re.compile(r"&(#[0-9]+|#x[0-9a-fA-F]+|[a-z]+);")
_NAMED = {"amp": "&", "lt": "<", "gt": ">", "quot": '"', "apos": "'"}


def _entity(m: re.Match[str]) -> str:
    name = m.group(1)
    if name[0] != "#":
        return _NAMED[name]  # KeyError: an entity XML does not predefine
    code = int(name[2:], 16) if name[1] == "x" else int(name[1:])
    if code in (0x9, 0xA, 0xD) or 0x20 <= code <= 0xD7FF or 0xE000 <= code <= 0x10FFFF:
        if not 0xFFFE <= code <= 0xFFFF:
            return chr(code)
    raise ValueError(f"character reference &{name}; is not an XML character")


def xml_text(text: str) -> str:
    """The text of an element as XML defines it (the five predefined entities and
    character references); ValueError for anything an XML parser would refuse."""
    if "&" not in text:
        return text
    out = _ENTITY.sub(_entity, text)
    if "&" in _ENTITY.sub("", text):
        raise ValueError("a bare '&' in element text")
    return out


def _parse_fast(body: bytes) -> ListPage | None:
    """The page, or None where it is not in the grammar above (ElementTree then)."""
    try:
        doc = body.decode()
    except UnicodeDecodeError:
        return None
    if not _PROLOG.match(doc) or "\r" in doc or "<!" in doc:
        return None
    enc = _ENCODING.match(doc.lstrip())
    if enc and enc.group(1).lower() not in ("utf-8", "utf8"):
        return None
    # S3 writes every ETag as &quot;hex&quot;: one replace for the page, so that a page
    # without other references needs no unescaping per field. Only element text is read
    # below, where '"' needs no escape; "&amp;quot;" holds no "&quot;", so stays intact.
    doc = doc.replace("&quot;", '"')
    # A regex search scans the page from its start (~0.1 us per object each): the
    # elements a page may lack are looked for with str's faster scan first, and the
    # token, last in S3's schema, from the end.
    contents = _CONTENTS.findall(doc)
    n_prefixes = doc.count("<CommonPrefixes")
    prefixes = _PREFIXES.findall(doc) if n_prefixes else []
    if len(contents) != doc.count("<Contents") or len(prefixes) != n_prefixes:
        return None
    truncated = _TRUNCATED.search(doc)
    if truncated is None:
        return None
    token_at = doc.rfind("<NextContinuationToken>")
    token = _TOKEN.match(doc, token_at) if token_at >= 0 else None
    if token_at >= 0 and token is None:
        return None
    text = xml_text if "&" in doc else str
    try:
        enc_type = _ENCODING_TYPE.search(doc) if "<EncodingType>" in doc else None
        url = enc_type is not None and text(enc_type.group(1)) == "url"
        times: dict[str, float] = {}  # a page's objects often share one LastModified
        items: list[Item] = []
        append = items.append
        for key, mod, tag, size in contents:
            when = times.get(mod)
            if when is None:
                when = times[mod] = timestamp(text(mod))
            name = text(key)
            append((unquote(name) if url else name, int(size), text(tag).strip('"'), when))
        names = [text(p) for p in prefixes]
        return ListPage(
            items,
            [unquote(p) for p in names] if url else names,
            truncated.group(1) == "true",
            text(token.group(1)) if token else None,
        )
    except (KeyError, ValueError) as exc:
        log.debug("a ListObjectsV2 page left to ElementTree: %s", exc)
        return None


# -- the request path --------------------------------------------------------------

# The credential scope of a SigV4 Authorization header: key/date/REGION/service.
_SCOPE = re.compile(r"Credential=[^/,]+/[0-9]{8}/([^/,]+)/")
# An empty page: what resolve()'s call is answered with.
_EMPTY_PAGE = b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"/>'


class _Canned:
    """The raw body of a response that was never sent (AWSResponse reads stream())."""

    def __init__(self, body: bytes) -> None:
        self._body = body

    def stream(self, **_kw: Any) -> Any:
        yield self._body


@dataclass(frozen=True)
class _Endpoint:
    """Where and how botocore would send this bucket's requests, as it resolved them."""

    base: str  # scheme://host[/bucket]: path-style or virtual-hosted, as botocore chose
    list_url: str  # the URL (no query) of a ListObjectsV2 of the bucket
    region: str  # the SigV4 signing region


class LeanS3:
    """Signed ListObjectsV2 and GetObject requests for one bucket, through a boto3
    client's HTTP session. Thread-safe; resolve() is cheap and may be called again (after
    botocore followed a region redirect, its cache resolves the bucket's own region)."""

    def __init__(self, client: Any, credentials: Any, bucket: str, requester_pays: bool) -> None:
        self._client = client
        self._credentials = credentials  # None: unsigned requests (anonymous)
        self._bucket = bucket
        self._payer = {"x-amz-request-payer": "requester"} if requester_pays else {}
        self._http = client._endpoint.http_session  # noqa: SLF001 - see ARCHITECTURE
        self._events = client.meta.events
        self._lock = threading.Lock()
        self._endpoint: _Endpoint | None = None
        self._dry = threading.local()  # resolve()'s call, answered by _capture
        self._events.register(
            "before-send.s3.ListObjectsV2", self._capture, unique_id=f"silofs-lean-{id(self)}"
        )
        # What botocore validates in a GetObject with ChecksumMode=ENABLED, in its order.
        ctx: dict[str, Any] = {"context": {}}
        self._get_model = client.meta.service_model.operation_model("GetObject")
        resolve_response_checksum_algorithms(ctx, self._get_model, {"ChecksumMode": "ENABLED"})
        self._checksum_ctx = ctx["context"].get("checksum", {})

    def _capture(self, request: Any, **_kw: Any) -> AWSResponse | None:
        """before-send hook: in resolve()'s thread, keep the request botocore built and
        answer it with an empty page instead of sending it; elsewhere, nothing."""
        if not getattr(self._dry, "on", False):
            return None
        self._dry.request = request
        return AWSResponse(request.url, 200, {}, _Canned(_EMPTY_PAGE))

    def resolve(self) -> _Endpoint:
        """Ask the client where a ListObjectsV2 of the bucket goes: a call that botocore
        resolves (endpoint rules, addressing style, the region-redirect cache) and signs
        like any other, answered by _capture before it is sent (no I/O but the
        credential chain's). Presigning would not do: it uses the global endpoint."""
        self._dry.on = True
        try:
            self._client.list_objects_v2(Bucket=self._bucket, MaxKeys=0)
        finally:
            self._dry.on = False
        request = self._dry.request
        parts = urlsplit(request.url)
        auth = request.headers.get("Authorization") or b""
        scope = _SCOPE.search(auth.decode() if isinstance(auth, bytes) else auth)
        region = scope.group(1) if scope else self._client.meta.region_name or "us-east-1"
        list_url = f"{parts.scheme}://{parts.netloc}{parts.path}"
        endpoint = _Endpoint(list_url.rstrip("/"), list_url, region)
        with self._lock:
            if endpoint != self._endpoint:
                log.debug("lean S3 path for %s: %s, region %s", self._bucket, list_url, region)
            self._endpoint = endpoint
        return endpoint

    def _where(self) -> _Endpoint:
        endpoint = self._endpoint
        if endpoint is not None:
            return endpoint
        try:
            return self.resolve()
        except (bx.BotoCoreError, bx.ClientError) as exc:  # e.g. the credential chain
            raise Fallback(f"no endpoint: {type(exc).__name__}: {exc}") from exc

    def _send(self, op: str, url: str, headers: dict[str, str], stream: bool) -> AWSResponse:
        endpoint = self._where()
        request = AWSRequest(method="GET", url=url, headers={**headers, **self._payer})
        try:
            if self._credentials is not None:
                frozen = self._credentials.get_frozen_credentials()  # refreshes when due
                S3SigV4Auth(frozen, "s3", endpoint.region).add_auth(request)
            for name, value in request.headers.items():  # as botocore's Endpoint does
                if isinstance(value, str):
                    request.headers[name] = value.encode()
            prepared = request.prepare()
            prepared.stream_output = stream
            # The event botocore emits before it sends, so whatever watches the client's
            # requests (tests, debugging hooks) sees these too; a handler that answers
            # instead (botocore's Stubber) is botocore's business.
            answers = self._events.emit(f"before-send.s3.{op}", request=prepared)
            if any(answer is not None for _, answer in answers):
                raise Fallback("a before-send handler answered")
            return self._http.send(prepared)
        except TIMEOUTS:
            raise  # the store said nothing: botocore would wait as long again for it
        except bx.BotoCoreError as exc:  # transport, or the credentials' refresh
            raise Fallback(f"{type(exc).__name__}: {exc}") from exc

    def list_page(self, params: dict[str, str]) -> ListPage:
        """One ListObjectsV2 page; params are its query (prefix, max-keys, ...)."""
        endpoint = self._where()
        query = percent_encode_sequence({"list-type": "2", "encoding-type": "url", **params})
        resp = self._send("ListObjectsV2", f"{endpoint.list_url}?{query}", {}, stream=False)
        if resp.status_code == 429 or resp.status_code >= 500:
            raise _busy(resp, "ListObjectsV2")
        if resp.status_code != 200:
            raise Fallback(f"HTTP {resp.status_code}")
        try:
            return ListPage.from_bytes(resp.content)
        except (ET.ParseError, ValueError) as exc:
            raise Fallback(f"a page neither parser takes: {exc}") from exc

    def get(
        self, key: str, headers: dict[str, str], status: tuple[int, ...], checksum: bool
    ) -> Any:
        """An open GetObject of `key` answered with one of `status` (a range: 206 only, a
        200 would be a store that ignored the Range):
        (headers, body) where body reads as botocore's does (content length checked, and
        with `checksum` the x-amz-checksum-* header botocore would verify, verified)."""
        endpoint = self._where()
        if checksum:
            headers = {**headers, "x-amz-checksum-mode": "ENABLED"}
        url = f"{endpoint.base}/{percent_encode(key, safe='/~')}"
        resp = self._send("GetObject", url, headers, stream=True)
        if resp.status_code == 429 or resp.status_code >= 500:
            raise _busy(resp, "GetObject")
        if resp.status_code not in status:
            resp.raw.close()
            raise Fallback(f"HTTP {resp.status_code}")
        got = resp.headers
        response: dict[str, Any] = {"headers": got, "context": {}, "body": None}
        if checksum:
            handle_checksum_body(resp, response, {"checksum": self._checksum_ctx}, self._get_model)
        length = got.get("content-length")
        body = response["body"] or _Body(resp.raw, int(length) if length else None)
        return got, body
