"""Amazon S3 (and S3-compatible stores) through boto3.

Owns: listing a bucket prefix with ListObjectsV2, ranged GETs pinned to the listed ETag
(If-Match), both first on the lean request path (s3lean.py) and redone by botocore where
that path declines (counted in counters.lean_fallbacks); a page botocore fetches is
parsed by s3lean's parser in a before-parse hook, not by botocore's shape parser; and
turning botocore's exceptions into typed BackendErrors whose messages name the bucket or
endpoint and say what to do. Credentials and region come from
boto3's normal chain (env, profile, ~/.aws, SSO, container/instance role), or none (extra
anonymous=true: unsigned requests); extra profile/region/requester_pays per dataset; the
endpoint from opts.endpoint_url or AWS_ENDPOINT_URL.

Never retries inside botocore (retry policy lives in base.retry_call, one place), never does
I/O at construction (the client, and with it the credential chain that may query the
instance metadata service, is built on first use), never writes to the bucket.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import xml.etree.ElementTree as ET
from typing import Any

import boto3
import botocore.credentials
import botocore.exceptions as bx
import botocore.loaders
import botocore.session
from botocore import UNSIGNED
from botocore.config import Config

from silofs.errors import (
    AccessDeniedError,
    BackendError,
    ChecksumMismatchError,
    NotFoundError,
    ObjectChangedError,
    TransientError,
    UnreachableError,
)
from silofs.node.backends.base import (
    FIXED,
    BackendOptions,
    RetryingBackend,
    busy,
    join_prefix,
    pool_size,
    relative_key,
    truthy,
)
from silofs.node.backends.s3lean import TIMEOUTS, Fallback, LeanS3
from silofs.node.backends.s3lean import Item as _Item
from silofs.node.backends.s3lean import ListPage as _ListPage
from silofs.node.backends.s3lean import etag as _etag
from silofs.records import ObjectInfo
from silofs.uri import DatasetURI, store_endpoint

log = logging.getLogger(__name__)

# One loader of botocore's service models for every dataset's session: a session of its
# own loads and parses S3's models again (~12 MB each, measured with 20 sessions: 247 MiB
# against 24 with the loader shared). Each dataset keeps its own session, so credentials
# are still resolved per dataset (a profile, a fixed credentials file, a rebuilt client).
_LOADER = botocore.loaders.create_loader()
_SESSION_LOCK = threading.Lock()  # sessions, the loader and client creation are not thread-safe


def _session(profile: str | None, region: str | None) -> boto3.session.Session:
    core = botocore.session.Session()
    core.register_component("data_loader", _LOADER)
    session = boto3.session.Session(botocore_session=core, profile_name=profile, region_name=region)
    # boto3 appends its data directory to the loader's search paths at every session:
    # one loader for all would search a list growing by one per client built. Only that
    # last entry is dropped, so a thread walking the list meanwhile misses nothing.
    paths = _LOADER.search_paths
    while len(paths) > 1 and paths[-1] in paths[:-1]:
        paths.pop()
    return session


_DENIED = {
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
    "ExpiredTokenException", "TokenRefreshRequired", "InvalidToken", "AllAccessDisabled",
    "AccountProblem", "RequestTimeTooSkewed", "InvalidSecurity", "401", "403",
}  # fmt: skip
_TRANSIENT = {
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException",
    "RequestThrottled", "RequestLimitExceeded", "TooManyRequests", "TooManyRequestsException",
    "RequestTimeout", "RequestTimeoutException", "InternalError", "ServiceUnavailable",
    "OperationAborted", "429",
}  # fmt: skip
# Connection broke during a request or a body read: worth another try.
_BROKEN_OFF = (
    bx.ReadTimeoutError, bx.ConnectionClosedError, bx.ResponseStreamingError,
    bx.IncompleteReadError,
)  # fmt: skip
_CHANGED = {"PreconditionFailed", "412", "NoSuchKey", "404", "InvalidRange", "416"}
_CREDS_HINT = (
    "boto3 takes credentials from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, "
    "~/.aws/credentials or ~/.aws/config, or an instance/container role"
)


def _code(exc: bx.ClientError) -> tuple[str, int]:
    err = exc.response.get("Error", {})
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return str(err.get("Code", status)), int(status or 0)


def _request_payer(params: dict, **_kwargs: Any) -> None:
    params.setdefault("RequestPayer", "requester")


_MD5_ETAG = re.compile(r"[0-9a-f]{32}")


def _check_md5_etag(resp: dict[str, Any], data: bytes, what: str) -> None:
    """A whole single-part object's ETag is the MD5 of its bytes, unless it is encrypted
    with SSE-KMS or SSE-C (then it is not): check it where it is. Multipart ETags carry a
    '-N' suffix and are not an MD5 of the bytes; those are not checked."""
    etag = _etag(resp.get("ETag", "")).lower()
    if not _MD5_ETAG.fullmatch(etag):
        return
    if resp.get("SSECustomerAlgorithm") or resp.get("ServerSideEncryption", "AES256") not in (
        "AES256",
        "",
    ):
        return
    got = hashlib.md5(data, usedforsecurity=False).hexdigest()
    if got != etag:
        raise ChecksumMismatchError(f"{what}: body MD5 {got} does not match its ETag {etag}")


# What botocore's own parser is left with once a page is parsed here: an empty result.
_EMPTY_PAGE = b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"/>'
_PAGE_KEY = "SilofsPage"  # where the hook leaves its result in the parsed response


def _page_from_parsed(page: dict[str, Any]) -> _ListPage:
    """A page botocore parsed (the hook declined it: see _parse_list_page)."""
    if _PAGE_KEY in page:
        return page[_PAGE_KEY]
    items = [
        (o["Key"], int(o["Size"]), _etag(o.get("ETag", "")), o["LastModified"].timestamp())
        for o in page.get("Contents", []) or []
    ]
    prefixes = [p["Prefix"] for p in page.get("CommonPrefixes", []) or []]
    return _ListPage(
        items, prefixes, bool(page.get("IsTruncated")), page.get("NextContinuationToken")
    )


def _parse_list_page(response_dict: dict, customized_response_dict: dict, **_kw: Any) -> None:
    """before-parse hook of ListObjectsV2: parse a 200 page here and hand botocore an
    empty one. Anything else (an error status, XML this parser does not expect) is left
    to botocore, so errors keep their codes and an odd store still lists."""
    if response_dict.get("status_code") != 200:
        return
    body = response_dict.get("body")
    if not isinstance(body, bytes):
        return
    try:
        page = _ListPage.from_bytes(body)
    except (ET.ParseError, ValueError) as exc:
        log.debug("ListObjectsV2 page left to botocore's parser: %s", exc)
        return
    customized_response_dict[_PAGE_KEY] = page
    response_dict["body"] = _EMPTY_PAGE


class S3Backend(RetryingBackend):
    """A read-only view of s3://bucket/prefix/; safe to share between threads."""

    def __init__(self, uri: DatasetURI, opts: BackendOptions) -> None:
        self.bucket = uri.bucket
        self.prefix = uri.prefix
        self.uri = uri.canonical
        self.opts = opts
        self.where = f"bucket {self.bucket}"
        self.endpoint_url = store_endpoint(uri, opts.endpoint_url or None)
        self._client: Any = None
        self._cred_source = "none found"
        # Check a whole single-part object's MD5 ETag (off for stores whose ETags are not
        # MD5s even without SSE-KMS, e.g. some S3-compatible stores with encryption).
        # S3 Express One Zone (directory buckets, "--x-s3" names) has no MD5 ETags.
        self._md5_etag = opts.extra.get("verify_etag_md5", "true").lower() not in (
            "0",
            "false",
        ) and not self.bucket.endswith("--x-s3")
        self._lock = threading.Lock()
        # The lean request path (s3lean.py) for list pages and GETs; off with extra
        # lean=false, for S3 Express (its session auth is botocore's), and where the
        # client has no credentials to sign with (botocore then raises the right error).
        self._lean_wanted = truthy(opts.extra.get("lean", "true")) and not self.bucket.endswith(
            "--x-s3"
        )
        self._lean: LeanS3 | None = None
        self._relearn = False  # set by a fallback: resolve the lean endpoint again
        self._creds: Any = None  # what the client signs with (botocore Credentials)

    # -- client ---------------------------------------------------------------------

    def _endpoint_name(self) -> str:
        return self.endpoint_url or "the AWS S3 endpoint"

    def _config(self) -> Config:
        extra = self.opts.extra
        style = extra.get("addressing_style")  # path | virtual | auto (botocore's choice)
        s3_cfg = {"addressing_style": style} if style else {}
        # anonymous (--no-sign-request): unsigned requests, for public buckets.
        unsigned = {"signature_version": UNSIGNED} if truthy(extra.get("anonymous")) else {}
        return Config(
            **unsigned,
            connect_timeout=self.opts.connect_timeout,
            read_timeout=self.opts.read_timeout,
            # One try per call: base.retry_call owns retries and backoff.
            retries={"total_max_attempts": 1, "mode": "standard"},
            max_pool_connections=pool_size(self.opts),
            s3=s3_cfg,
        )

    def client(self) -> Any:
        """The shared boto3 client, built on first use (the credential chain may do I/O)."""
        with self._lock:
            if self._client is None:
                with _SESSION_LOCK:
                    session = _session(
                        self.opts.extra.get("profile"), self.opts.extra.get("region")
                    )
                    self._client = session.client(
                        "s3", endpoint_url=self.endpoint_url, config=self._config()
                    )
                self._client.meta.events.register("before-parse.s3.ListObjectsV2", _parse_list_page)
                if truthy(self.opts.extra.get("requester_pays")):
                    # The requester (we) pays for requests and transfer: S3 wants the
                    # x-amz-request-payer header on every read of such a bucket.
                    for op in ("ListObjectsV2", "GetObject", "HeadObject"):
                        self._client.meta.events.register(
                            f"before-parameter-build.s3.{op}", _request_payer
                        )
                creds = session.get_credentials()
                self._creds = creds
                self._cred_source = getattr(creds, "method", None) or "none found"
                anonymous = truthy(self.opts.extra.get("anonymous"))
                if anonymous:
                    self._cred_source = "none: unsigned requests (anonymous)"
                if self._lean_wanted and (anonymous or creds is not None):
                    self._lean = self._make_lean(None if anonymous else creds)
            return self._client

    def _make_lean(self, creds: Any) -> LeanS3 | None:
        try:
            lean = LeanS3(
                self._client, creds, self.bucket, truthy(self.opts.extra.get("requester_pays"))
            )
        except (AttributeError, KeyError, bx.BotoCoreError) as exc:  # a botocore we do not know
            log.warning("S3 %s: lean request path off, botocore serves all: %s", self.uri, exc)
            return None
        try:
            lean.resolve()  # no I/O: see LeanS3.resolve
        except (bx.BotoCoreError, bx.ClientError) as exc:
            self._relearn = True  # the first lean request falls back, botocore says why
            log.debug("S3 %s: lean endpoint not resolved yet: %s", self.uri, exc)
        return lean

    def close(self) -> None:
        with self._lock:
            self._lean = None  # it holds the client: drop both (built again on next use)
        super().close()

    # -- credentials renewal (RetryingBackend._renew) ---------------------------------
    # boto3 reads a credentials file or config only when a client is made: a key rotated
    # in ~/.aws/credentials (the old one revoked), or session credentials a tool renews
    # there, were refused until the daemon restarted. Credentials botocore refreshes
    # itself (roles, SSO, credential_process, the instance's) and anonymous requests are
    # left alone.

    def _credentials_held(self) -> Any:
        if truthy(self.opts.extra.get("anonymous")):
            return FIXED
        if isinstance(self._creds, botocore.credentials.RefreshableCredentials):
            return FIXED
        return self._creds  # None when the chain found none: any found later are new

    def _credentials_changed(self, held: Any) -> str | None:
        """The credentials the chain finds now, if they are not `held`."""
        try:
            with _SESSION_LOCK:
                session = _session(self.opts.extra.get("profile"), self.opts.extra.get("region"))
            found = session.get_credentials()
            current = None if found is None else found.get_frozen_credentials()
        except (bx.BotoCoreError, bx.ClientError) as exc:
            log.debug("S3 %s: credentials not resolved again: %s", self.uri, exc)
            return None
        before = None if held is None else held.get_frozen_credentials()
        if current is None or current == before:
            return None
        source = getattr(found, "method", None) or "unknown source"
        return (
            f"S3 {self.uri}: the store refused the AWS credentials the daemon had and the AWS "
            f"credentials changed since ({source}, key {current.access_key[:8]}...): "
            "signing with the new ones"
        )

    def _drop_client(self) -> None:
        self._client, self._lean = None, None  # the lean path holds the client too

    def _lean_path(self) -> LeanS3 | None:
        self._client_or_raise()
        lean = self._lean
        if lean is not None and self._relearn:
            # A request fell back since: botocore may have followed a region redirect
            # and cached the bucket's region; ask the client again where the bucket is.
            self._relearn = False
            try:
                lean.resolve()
            except (bx.BotoCoreError, bx.ClientError) as exc:
                log.debug("S3 %s: lean endpoint not resolved again: %s", self.uri, exc)
        return lean

    def _fell_back(self, what: str, exc: Fallback) -> None:
        """Count a request the lean path hands to botocore, which then redoes it."""
        self.counters.lean_fallbacks += 1
        self._relearn = True
        log.debug("S3 %s: redone through botocore: %s", what, exc)

    def _call(self, what: str, fn: Any, **kwargs: Any) -> Any:
        """One S3 request with botocore errors translated; `what` names the target."""
        try:
            return fn(**kwargs)
        except (bx.ClientError, bx.BotoCoreError) as exc:
            raise self._classify(exc, what) from exc

    # -- Backend protocol -------------------------------------------------------------

    def _any_object(self) -> bool:
        client = self._client_or_raise()
        self._call(self.where, client.head_bucket, Bucket=self.bucket)
        return bool(self._list_raw(None, max_keys=1).items)

    # -- internals --------------------------------------------------------------------

    def _client_or_raise(self) -> Any:
        try:
            return self.client()
        except (bx.BotoCoreError, bx.ClientError) as exc:
            raise self._classify(exc, f"bucket {self.bucket}") from exc

    def _list_page(self, token: str | None) -> tuple[list[_Item], str | None]:
        page = self._list_raw(token)
        return page.items, (page.truncated and page.token) or None

    def _lists_by_prefix(self) -> bool:
        return True

    def _list_dir_page(
        self, prefix: str, token: str | None
    ) -> tuple[list[_Item], list[str], str | None]:
        page = self._list_raw(token, prefix=prefix, delimiter="/")
        return page.items, page.prefixes, (page.truncated and page.token) or None

    def _list_raw(
        self,
        token: str | None,
        max_keys: int | None = None,
        prefix: str | None = None,
        delimiter: str | None = None,
    ) -> _ListPage:
        kwargs: dict[str, Any] = {
            "Bucket": self.bucket,
            "Prefix": self.prefix if prefix is None else prefix,
            "MaxKeys": max_keys or self.opts.page_size,
        }
        if delimiter:
            kwargs["Delimiter"] = delimiter
        if token:
            kwargs["ContinuationToken"] = token
        lean = self._lean_path()
        if lean is not None:
            query = {"prefix": kwargs["Prefix"], "max-keys": str(kwargs["MaxKeys"])}
            if delimiter:
                query["delimiter"] = delimiter
            if token:
                query["continuation-token"] = token
            try:
                return lean.list_page(query)
            except (bx.ClientError, *TIMEOUTS) as exc:  # 429/5xx (s3lean._busy), silence
                raise self._classify(exc, f"bucket {self.bucket}") from exc
            except Fallback as exc:
                self._fell_back(f"a list page of {self.bucket}", exc)
        client = self._client_or_raise()
        page = self._call(f"bucket {self.bucket}", client.list_objects_v2, **kwargs)
        return _page_from_parsed(page)

    def _info(self, item: _Item) -> ObjectInfo | None:
        store_key, size, etag, mtime = item
        key = relative_key(self.prefix, store_key)
        if key is None:
            return None
        # Positional: a listing makes one per object (key, size, mtime, version, content_id).
        return ObjectInfo(key, size, mtime, etag, _content_id(etag, size))

    def identifies(self, info: ObjectInfo) -> bool:
        # The GET is pinned to the ETag (If-Match), and the content id is made of it.
        return info.content_id == _content_id(info.version, info.size)

    def _streams_ranges(self) -> bool:
        return True

    def _open_once(self, info: ObjectInfo, start: int, end: int) -> Any:
        # A range: S3 sends no checksum for it (docs/SEMANTICS.md), as in _get_once.
        store_key = join_prefix(self.prefix, info.key)
        what = f"s3://{self.bucket}/{store_key}"
        lean = self._lean_path()
        if lean is not None:
            headers = {"If-Match": f'"{info.version}"', "Range": f"bytes={start}-{end - 1}"}
            try:
                got, body = lean.get(store_key, headers, (206,), checksum=False)
            except (bx.ClientError, *TIMEOUTS) as exc:  # 429/5xx (s3lean._busy), silence
                raise self._get_error(exc, what) from exc
            except Fallback as exc:
                self._fell_back(what, exc)
            else:
                if _etag(got.get("etag", "")) not in ("", info.version):
                    body.close()
                    raise ObjectChangedError(f"{what} changed since listing (new ETag)")
                return body
        client = self._client_or_raise()
        try:
            resp = client.get_object(
                Bucket=self.bucket,
                Key=store_key,
                IfMatch=f'"{info.version}"',
                Range=f"bytes={start}-{end - 1}",
            )
        except (bx.ClientError, bx.BotoCoreError) as exc:
            raise self._get_error(exc, what) from exc
        if _etag(resp.get("ETag", "")) not in ("", info.version):
            resp["Body"].close()
            raise ObjectChangedError(f"{what} changed since listing (new ETag)")
        return resp["Body"]

    def _get_once(self, info: ObjectInfo, start: int, end: int) -> bytes:
        store_key = join_prefix(self.prefix, info.key)
        what = f"s3://{self.bucket}/{store_key}"
        client = self._client_or_raise()
        whole = start == 0 and end == info.size
        kwargs: dict[str, Any] = {
            "Bucket": self.bucket,
            "Key": store_key,
            "IfMatch": f'"{info.version}"',
            # The object's full-object checksum (CRC32/CRC64NVME/SHA, when it has one) comes
            # only with a GET of the whole object; botocore then verifies the body while
            # reading it and raises FlexibleChecksumError on a mismatch.
            "ChecksumMode": "ENABLED",
        }
        if not whole:  # S3 sends no checksum for a range: see docs/SEMANTICS.md
            kwargs["Range"] = f"bytes={start}-{end - 1}"
        lean = self._lean_path()
        if lean is not None:
            try:
                resp, data = self._get_lean(lean, store_key, info, kwargs.get("Range"), what)
            except (bx.ClientError, *TIMEOUTS) as exc:  # 429/5xx (s3lean._busy), silence
                raise self._get_error(exc, what) from exc
            except Fallback as exc:
                self._fell_back(what, exc)
            else:
                if whole and self._md5_etag and len(data) == end - start:
                    _check_md5_etag(resp, data, what)
                return data
        try:
            resp = client.get_object(**kwargs)
            # Some S3-compatible stores ignore If-Match: check the ETag ourselves as well.
            if _etag(resp.get("ETag", "")) not in ("", info.version):
                resp["Body"].close()
                raise ObjectChangedError(f"{what} changed since listing (new ETag)")
            data = resp["Body"].read()
        except bx.FlexibleChecksumError as exc:
            raise ChecksumMismatchError(f"{what}: body does not match its checksum: {exc}") from exc
        except (bx.ClientError, bx.BotoCoreError) as exc:
            raise self._get_error(exc, what) from exc
        if whole and self._md5_etag and len(data) == end - start:
            _check_md5_etag(resp, data, what)
        return data

    def _get_lean(
        self, lean: LeanS3, store_key: str, info: ObjectInfo, rng: str | None, what: str
    ) -> tuple[dict[str, str], bytes]:
        """_get_once's GET on the lean path: (the response fields _check_md5_etag reads,
        the body). Checks what botocore's GET checks: the ETag, the x-amz-checksum-* header
        botocore would verify (ChecksumMode=ENABLED is sent as it is), the length."""
        headers = {"If-Match": f'"{info.version}"'}
        if rng:
            headers["Range"] = rng
        got, body = lean.get(store_key, headers, (206,) if rng else (200, 206), checksum=True)
        if _etag(got.get("etag", "")) not in ("", info.version):
            body.close()
            raise ObjectChangedError(f"{what} changed since listing (new ETag)")
        try:
            data = body.read()
        except bx.FlexibleChecksumError as exc:
            raise ChecksumMismatchError(f"{what}: body does not match its checksum: {exc}") from exc
        except TIMEOUTS:
            body.close()
            raise  # the store went silent mid-body: an attempt's end, not a redo
        except _BROKEN_OFF as exc:
            body.close()
            raise Fallback(f"body broke off: {exc}") from exc
        fields = {"ETag": got.get("etag", "")}
        for name, header in (
            ("SSECustomerAlgorithm", "x-amz-server-side-encryption-customer-algorithm"),
            ("ServerSideEncryption", "x-amz-server-side-encryption"),
        ):
            if header in got:
                fields[name] = got[header]
        return fields, data

    def _get_error(self, exc: Exception, what: str) -> BackendError:
        """A failed GET of a listed version: the object changed or went (If-Match failed,
        404, or a range past its new end), or whatever _classify says."""
        if isinstance(exc, bx.ClientError):
            code, status = _code(exc)
            if code in _CHANGED or status in (404, 412, 416):
                return ObjectChangedError(f"{what} changed or was deleted since listing ({code})")
        return self._classify(exc, what)

    def _classify(self, exc: Exception, what: str) -> BackendError:
        """Map a botocore exception to a typed error naming `what` and the remedy."""
        ep = self._endpoint_name()
        if isinstance(exc, bx.ClientError):
            return self._classify_client_error(exc, what)
        if isinstance(exc, (bx.NoCredentialsError, bx.PartialCredentialsError)):
            return AccessDeniedError(f"no usable AWS credentials for {self.uri}; {_CREDS_HINT}")
        if isinstance(exc, (bx.CredentialRetrievalError, bx.ProfileNotFound)):
            return AccessDeniedError(f"cannot load AWS credentials for {self.uri}: {exc}")
        if isinstance(exc, _BROKEN_OFF):
            return TransientError(f"S3 request for {what} at {ep} broke off: {exc}")
        if isinstance(exc, (bx.EndpointConnectionError, bx.ConnectionError, bx.SSLError)):
            return UnreachableError(
                f"cannot reach S3 endpoint {ep} for {self.uri}: {exc}; "
                "check the endpoint URL, DNS and network"
            )
        return BackendError(f"S3 request for {what} failed: {exc}")

    def _classify_client_error(self, exc: bx.ClientError, what: str) -> BackendError:
        code, status = _code(exc)
        if code in ("NoSuchBucket",) or (code == "404" and what.startswith("bucket ")):
            return NotFoundError(
                f"bucket {self.bucket} does not exist at {self._endpoint_name()}; "
                "check the bucket name and endpoint"
            )
        if code in _DENIED or status in (401, 403):
            return AccessDeniedError(
                f"access to {what} denied ({code}); credentials source: {self._cred_source}; "
                f"{_CREDS_HINT}, and need s3:ListBucket and s3:GetObject"
            )
        if code in _TRANSIENT or status == 429 or status >= 500:
            headers = exc.response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
            return busy(
                f"S3 busy or failing for {what} ({code}, HTTP {status})",
                headers.get("retry-after"),
            )
        if code == "InvalidObjectState":
            return BackendError(f"{what} is archived (e.g. Glacier); restore it before reading")
        return BackendError(f"S3 refused a request for {what} ({code}, HTTP {status})")


def _content_id(etag: str, size: int) -> str:
    return f"s3:{etag}:{size}"
