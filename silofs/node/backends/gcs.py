"""Google Cloud Storage through google-cloud-storage.

Owns: choosing credentials (anonymous, a key file, gcloud's application-default file, or
the GCE metadata server only when this machine is on GCE), the endpoint (opts.endpoint_url
or STORAGE_EMULATOR_HOST), listing a bucket prefix page by page (the JSON items kept as
ListedObject records, no Blob per object), ranged downloads pinned
to the listed generation, and turning google exceptions into typed BackendErrors naming
the bucket and what to do.

Never retries inside the library (retry=None; base.retry_call owns retries), never does
I/O at construction (credentials are resolved on first use), never probes the metadata
server off GCE (that can hang for seconds when no credentials exist: missing credentials
are a fast AccessDeniedError instead), never transcodes (ranges address stored bytes).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import google.auth
import google.auth.exceptions as gax
import requests
import urllib3
from google.api_core import exceptions as gx
from google.auth.credentials import AnonymousCredentials, Credentials
from google.auth.transport.requests import AuthorizedSession
from google.cloud._helpers import _rfc3339_nanos_to_datetime

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
    BackendOptions,
    DelimitedListing,
    KeyFile,
    busy,
    connection_reason,
    join_prefix,
    pooled_session,
    relative_key,
    truthy,
)
from silofs.records import ObjectInfo
from silofs.uri import DatasetURI, check_endpoint

log = logging.getLogger(__name__)

READ_ONLY_SCOPE = "https://www.googleapis.com/auth/devstorage.read_only"
_LIST_FIELDS = "items(name,size,updated,generation,md5Hash,crc32c),nextPageToken"
# What the library raises for a failed request (HTTP status, auth, transport).
_SDK_ERRORS = (gx.GoogleAPICallError, gax.GoogleAuthError, requests.exceptions.RequestException)
_CREDS_HINT = (
    "set GOOGLE_APPLICATION_CREDENTIALS to a key file, run "
    "`gcloud auth application-default login`, or pass anonymous=true for a public bucket"
)


def _emulator_endpoint() -> str | None:
    host = os.environ.get("STORAGE_EMULATOR_HOST")
    if not host:
        return None
    return host if "://" in host else f"http://{host}"


def _adc_file() -> Path:
    """gcloud's application-default credentials file (Linux/macOS location)."""
    config_dir = os.environ.get("CLOUDSDK_CONFIG") or os.path.expanduser("~/.config/gcloud")
    return Path(config_dir) / "application_default_credentials.json"


def _on_gce() -> bool:
    """True on a GCE/GKE VM (DMI says Google) or when a metadata host is configured."""
    if os.environ.get("GCE_METADATA_HOST") or os.environ.get("GCE_METADATA_IP"):
        return True
    try:
        return Path("/sys/class/dmi/id/product_name").read_text().startswith("Google")
    except OSError:
        return False


def _load_key_file(path: str, origin: str) -> tuple[Credentials, str | None]:
    """Credentials from an operator-chosen JSON file; one-line AccessDeniedError if unusable."""
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
    except OSError as exc:
        raise AccessDeniedError(
            f"cannot read Google credentials file {path} (from {origin}): {exc.strerror}"
        ) from None
    except ValueError:
        raise AccessDeniedError(
            f"Google credentials file {path} (from {origin}) is not JSON; "
            "expected a service-account key or an application-default credentials file"
        ) from None
    if not isinstance(info, dict) or "type" not in info:
        raise AccessDeniedError(f"Google credentials file {path} (from {origin}) has no 'type'")
    try:
        return _credentials_from_info(info)
    except (gax.GoogleAuthError, ValueError, KeyError) as exc:
        raise AccessDeniedError(
            f"Google credentials file {path} (from {origin}) is unusable: {exc}"
        ) from None


def _credentials_from_info(info: dict[str, Any]) -> tuple[Credentials, str | None]:
    kind = info["type"]
    if kind == "service_account":
        from google.oauth2 import service_account

        creds = service_account.Credentials.from_service_account_info(
            info, scopes=[READ_ONLY_SCOPE]
        )
        return creds, info.get("project_id")
    if kind == "authorized_user":
        from google.oauth2 import credentials as user_credentials

        creds = user_credentials.Credentials.from_authorized_user_info(
            info, scopes=[READ_ONLY_SCOPE]
        )
        return creds, info.get("quota_project_id")
    # Other types (workload identity federation, impersonation): the generic loader, as
    # google.auth.default() uses for GOOGLE_APPLICATION_CREDENTIALS. Its warning is about
    # configs from untrusted sources; this file is the operator's own setting.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return google.auth.load_credentials_from_dict(info, scopes=[READ_ONLY_SCOPE])


def credentials_file(opts: BackendOptions) -> str | None:
    """The key file resolve_credentials reads for `opts` (same order), if it reads one."""
    if truthy(opts.extra.get("anonymous")):
        return None
    if key_file := opts.extra.get("key_file"):
        return key_file
    if _emulator_endpoint():
        return None
    if key_file := os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):
        return key_file
    adc = _adc_file()
    return str(adc) if adc.is_file() else None


def resolve_credentials(opts: BackendOptions) -> tuple[Credentials, str | None, str]:
    """(credentials, project, source) with no network I/O; AccessDeniedError if none."""
    if truthy(opts.extra.get("anonymous")):
        return AnonymousCredentials(), None, "anonymous access"
    if key_file := opts.extra.get("key_file"):
        creds, project = _load_key_file(key_file, "the key_file option")
        return creds, project, f"key file {key_file}"
    if _emulator_endpoint():
        return AnonymousCredentials(), None, "anonymous access (STORAGE_EMULATOR_HOST)"
    if key_file := os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):
        creds, project = _load_key_file(key_file, "GOOGLE_APPLICATION_CREDENTIALS")
        return creds, project, f"key file {key_file}"
    if (adc := _adc_file()).is_file():
        creds, project = _load_key_file(str(adc), "gcloud application-default login")
        return creds, project, f"application-default credentials {adc}"
    if _on_gce():
        from google.auth import compute_engine

        return compute_engine.Credentials(), None, "the GCE metadata server"
    raise AccessDeniedError(f"no Google credentials found: {_CREDS_HINT}")


@dataclass(frozen=True, slots=True)
class ListedObject:
    """What a listing keeps of one object (objects.list's JSON item, fields as typed)."""

    name: str
    size: int
    mtime: float  # `updated`, truncated to microseconds as the library does
    generation: int
    md5: str | None  # base64, as listed; composite objects have none
    crc32c: str | None


def _raw_lister(client: Any) -> Any:
    """list_blobs' own iterator maker (private to the library, so looked up, not assumed:
    a version without it lists through Blob objects, slower, the same records)."""
    return getattr(client, "_list_resource", None)


def _item_as_is(_iterator: Any, item: dict[str, Any]) -> dict[str, Any]:
    return item


def _page_prefixes(_iterator: Any, page: Any, response: dict[str, Any]) -> None:
    page.prefixes = tuple(response.get("prefixes", ()))


def _listed(items: Iterable[dict[str, Any]]) -> list[ListedObject]:
    times: dict[str, float] = {}  # a page's objects often share one `updated`
    out = []
    for item in items:
        updated = item.get("updated")
        when = times.get(updated) if updated else 0.0
        if when is None:
            when = times[updated] = _rfc3339(updated)
        out.append(
            ListedObject(
                item["name"],
                int(item["size"]),
                when,
                int(item["generation"]),
                item.get("md5Hash"),
                item.get("crc32c"),
            )
        )
    return out


def _from_blob(blob: Any) -> ListedObject:
    mtime = blob.updated.timestamp() if blob.updated else 0.0
    return ListedObject(
        blob.name, int(blob.size), mtime, int(blob.generation), blob.md5_hash, blob.crc32c
    )


def _rfc3339(text: str) -> float:
    """`updated` as the library reads it (fraction truncated to microseconds), by
    fromisoformat: 0.3 us, where the library's regex and strptime take 6.5 us."""
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return _rfc3339_nanos_to_datetime(text).timestamp()


def _content_id(obj: ListedObject) -> str:
    if obj.md5:
        digest = f"md5:{obj.md5}"
    elif obj.crc32c:
        digest = f"crc32c:{obj.crc32c}"  # composite objects have no MD5
    else:
        digest = "none"
    return f"gs-{digest}:{obj.size}:{obj.generation}"


def _refused_connection(exc: requests.exceptions.ConnectionError) -> bool:
    """True if the connection was never made (refused, DNS), not dropped mid-response."""
    text = repr(exc)
    return any(s in text for s in ("NewConnectionError", "NameResolutionError", "ConnectTimeout"))


def _disable_bucket_metadata_fetch(client: Any) -> None:
    """Stop the library's background bucket-metadata GET (for tracing attributes).

    google-cloud-storage >= 3.x fetches bucket metadata in a thread on a bucket's first
    use (unless DISABLE_GCS_PYTHON_CLIENT_OTEL_BUCKET_METADATA is set): an extra request
    that needs storage.buckets.get, which a read-only objectViewer lacks, and that is
    invisible to retry_call. Scoped to this client rather than set in os.environ.
    tests/unit/test_backend_retry.py counts requests, so a rename here shows up there.
    """
    if getattr(client, "_bucket_metadata_cache", None) is not None:
        client._bucket_metadata_cache = None


class GCSBackend(DelimitedListing):
    """A read-only view of gs://bucket/prefix/; safe to share between threads."""

    def __init__(self, uri: DatasetURI, opts: BackendOptions) -> None:
        self.bucket_name = uri.bucket
        self.prefix = uri.prefix
        self.uri = uri.canonical
        self.opts = opts
        self.where = f"bucket {self.bucket_name}"
        self.endpoint_url = opts.endpoint_url or _emulator_endpoint()
        if self.endpoint_url:
            check_endpoint(self.endpoint_url, "the GCS endpoint")
        self.cred_source = "not resolved yet"
        self._client: Any = None
        self._lock = threading.Lock()
        # The key file the client's credentials came from and what it held then (None
        # before a client is made).
        self._key: KeyFile | None = None

    # -- credentials renewal (RetryingBackend._renew) ---------------------------------
    # A key is read once, when the client is made: a service-account key rotated in its
    # file (the old key deleted), or an ADC file written again by `gcloud auth
    # application-default login`, was refused until the daemon restarted. The metadata
    # server's credentials renew themselves.

    _key_holds = "the Google credentials"

    # -- client ---------------------------------------------------------------------

    def _timeout(self) -> tuple[float, float]:
        return (self.opts.connect_timeout, self.opts.read_timeout)

    def client(self) -> Any:
        """The shared storage.Client, built on first use; AccessDeniedError without creds."""
        with self._lock:
            if self._client is None:
                from google.cloud import storage

                key_file = credentials_file(self.opts)
                self._key = KeyFile.of(key_file)
                creds, project, self.cred_source = resolve_credentials(self.opts)
                session = AuthorizedSession(
                    creds, refresh_timeout=self.opts.connect_timeout + self.opts.read_timeout
                )
                pooled_session(session, self.opts)
                options = {"api_endpoint": self.endpoint_url} if self.endpoint_url else None
                # project=None means "no project" (no ADC lookup); reads do not need one.
                client = storage.Client(
                    project=self.opts.extra.get("project") or project,
                    credentials=creds,
                    client_options=options,
                    _http=session,
                )
                _disable_bucket_metadata_fetch(client)
                self._client = client
            return self._client

    def _endpoint_name(self) -> str:
        return self.endpoint_url or "storage.googleapis.com"

    # -- internals --------------------------------------------------------------------

    def _list_raw(
        self, prefix: str, token: str | None, page_size: int | None, delimiter: str | None
    ) -> tuple[list[ListedObject], list[str], str | None]:
        """One page of objects.list: its items kept as the JSON the library parsed (its
        Blob objects, made and read per object, cost 35-60 us each), and its prefixes."""
        what = f"bucket {self.bucket_name}"
        params = {"projection": "noAcl", "fields": _LIST_FIELDS}
        if prefix:
            params["prefix"] = prefix
        if delimiter:
            params["delimiter"] = delimiter
            params["fields"] += ",prefixes"
        client = self.client()
        size = page_size or self.opts.page_size
        try:
            lister = _raw_lister(client)
            if lister is None:  # a library without it: through its Blobs
                return self._list_blobs(client, params, token, size)
            pages = lister(
                f"/b/{self.bucket_name}/o",
                _item_as_is,
                page_token=token,
                extra_params=params,
                page_start=_page_prefixes,
                page_size=size,
                timeout=self._timeout(),
                retry=None,
            )
            page = next(pages.pages, None)
            if page is None:
                return [], [], None
            return _listed(page), list(page.prefixes), pages.next_page_token
        except _SDK_ERRORS as exc:
            raise self._classify(exc, what) from exc

    def _list_blobs(
        self, client: Any, params: dict[str, str], token: str | None, size: int
    ) -> tuple[list[ListedObject], list[str], str | None]:
        pages = client.list_blobs(
            self.bucket_name,
            prefix=params.get("prefix"),
            delimiter=params.get("delimiter"),
            page_size=size,
            page_token=token,
            fields=params["fields"],
            timeout=self._timeout(),
            retry=None,
        )
        page = next(pages.pages, None)
        if page is None:
            return [], [], None
        items = [_from_blob(b) for b in page]
        return items, list(getattr(page, "prefixes", ())), pages.next_page_token

    def _info(self, obj: ListedObject) -> ObjectInfo | None:
        key = relative_key(self.prefix, obj.name)
        if key is None:
            return None
        return ObjectInfo(key, obj.size, obj.mtime, str(obj.generation), _content_id(obj))

    def identifies(self, info: ObjectInfo) -> bool:
        # The GET is pinned to the generation, which ends the content id (after the
        # size); the digest before them is the generation's, whatever it says.
        return info.content_id.startswith("gs-") and info.content_id.endswith(
            f":{info.size}:{info.version}"
        )

    def _get_once(self, info: ObjectInfo, start: int, end: int) -> bytes:
        store_key = join_prefix(self.prefix, info.key)
        what = f"{self.uri}{info.key}"
        client = self.client()
        from google.cloud.storage.exceptions import DataCorruption  # loaded by client()

        # Pinned to the listed generation: an overwrite makes it 404, never other bytes.
        blob = client.bucket(self.bucket_name).blob(store_key, generation=int(info.version))
        # A read of the whole object is checked against the object's crc32c (x-goog-hash);
        # a range has no checksum to check against (docs/SEMANTICS.md).
        whole = start == 0 and end == info.size
        try:
            data = blob.download_as_bytes(
                start=None if whole else start,
                end=None if whole else end - 1,  # inclusive
                raw_download=True,  # stored bytes, even for Content-Encoding: gzip
                checksum="crc32c" if whole else None,
                timeout=self._timeout(),
                retry=None,
            )
        except DataCorruption as exc:
            raise ChecksumMismatchError(f"{what}: body does not match its crc32c") from exc
        except (gx.NotFound, gx.PreconditionFailed, gx.RequestRangeNotSatisfiable) as exc:
            raise ObjectChangedError(
                f"{what} is no longer at generation {info.version} (changed or deleted since "
                f"listing; HTTP {exc.code})"
            ) from exc
        except _SDK_ERRORS as exc:
            raise self._classify(exc, what) from exc
        except urllib3.exceptions.HTTPError as exc:
            # The library reads the body from urllib3 itself: a body cut short (a closed
            # connection, a Content-Length that promised more) arrives unwrapped.
            raise TransientError(f"GCS response for {what} broke off: {exc}") from exc
        return data

    def _classify(self, exc: Exception, what: str) -> BackendError:
        """Map a google/requests exception to a typed error naming `what` and the remedy."""
        ep = self._endpoint_name()
        if isinstance(exc, gx.GoogleAPICallError):
            return self._classify_http(exc, what)
        if isinstance(exc, gax.RefreshError) and exc.retryable:
            # google-auth's own word: the token endpoint (or the metadata server) failed
            # in a way that may pass (5xx, 429, after its own tries). A denial here made
            # every read of the hiccup EIO without a second try.
            return TransientError(
                f"cannot get a Google access token using {self.cred_source} for now: {exc}"
            )
        if isinstance(exc, gax.RefreshError):
            return AccessDeniedError(
                f"cannot get a Google access token using {self.cred_source}: {exc}"
            )
        if isinstance(exc, gax.TransportError):
            return UnreachableError(f"cannot reach the Google token endpoint for {what}: {exc}")
        if isinstance(exc, (requests.exceptions.SSLError, requests.exceptions.ProxyError)):
            return UnreachableError(f"cannot reach GCS endpoint {ep} for {self.uri}: {exc}")
        if isinstance(exc, requests.exceptions.ConnectionError) and _refused_connection(exc):
            return UnreachableError(
                f"cannot reach GCS endpoint {ep} for {self.uri}: {connection_reason(exc)}; "
                "check the endpoint URL and network"
            )
        if isinstance(exc, requests.exceptions.RequestException):
            return TransientError(f"GCS request for {what} at {ep} broke off: {exc}")
        return BackendError(f"GCS request for {what} at {ep} failed: {exc!r}")

    def _classify_http(self, exc: gx.GoogleAPICallError, what: str) -> BackendError:
        status = int(exc.code or 0)
        if status == 404 and what.startswith("bucket "):
            return NotFoundError(
                f"bucket {self.bucket_name} does not exist at {self._endpoint_name()}; "
                "check the bucket name"
            )
        if status in (401, 403):
            return AccessDeniedError(
                f"access to {what} denied (HTTP {status}) using {self.cred_source}; "
                f"the identity needs storage.objects.list and storage.objects.get; {_CREDS_HINT}"
            )
        if status in (408, 429) or status >= 500:
            response = getattr(exc, "response", None)
            headers = getattr(response, "headers", None) or {}
            return busy(
                f"GCS busy or failing for {what} (HTTP {status})", headers.get("retry-after")
            )
        return BackendError(f"GCS refused a request for {what} (HTTP {status}): {exc.message}")
