"""Azure Blob Storage through azure-storage-blob.

Owns: choosing credentials (connection string, account key or SAS token, from opts.extra
or the environment, or a SAS token file, read again when the store refuses the token the
client has) and the blob endpoint (opts.endpoint_url, AZURE_STORAGE_BLOB_ENDPOINT,
the connection string's BlobEndpoint, or the public cloud), listing a container prefix
page by page (pages parsed by azurelist.py, the SDK's deserializer only for a page that
parser declines), ranged downloads pinned to the listed ETag (If-Match), and turning
azure-core's exceptions into typed BackendErrors naming the container and what to do.

Never retries inside the SDK (retry_total=0; base.retry_call owns retries), never does
network I/O at construction (a sas_token_file is read then), never writes to the
container, never decompresses blob content (ranges address the stored bytes).
"""

from __future__ import annotations

import binascii
import ipaddress
import logging
import os
import threading
from base64 import b64decode
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import requests
from azure.core import MatchConditions
from azure.core import exceptions as ax
from azure.core.credentials import AzureNamedKeyCredential, AzureSasCredential, TokenCredential

from silofs.errors import (
    AccessDeniedError,
    BackendError,
    ChecksumMismatchError,
    NotFoundError,
    ObjectChangedError,
    TransientError,
    UnreachableError,
    UsageError,
)
from silofs.node.backends import azurelist
from silofs.node.backends.azurelist import ListedBlob
from silofs.node.backends.base import (
    BackendOptions,
    DelimitedListing,
    KeyFile,
    busy,
    connection_reason,
    join_prefix,
    md5_b64,
    note_requests,
    pooled_session,
    relative_key,
    truthy,
)
from silofs.records import ObjectInfo
from silofs.uri import DatasetURI, check_endpoint

log = logging.getLogger(__name__)

MD5_RANGE_MAX = 4 << 20  # the longest range Azure sends an MD5 for
_CRED_KEYS = ("connection_string", "account_key", "sas_token", "sas_token_file")
_CREDS_HINT = (
    "set AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_KEY or AZURE_STORAGE_SAS_TOKEN "
    "(or the connection_string/account_key/sas_token/sas_token_file options)"
)
_DENIED = {
    "AuthenticationFailed", "AuthorizationFailure", "AuthorizationPermissionMismatch",
    "AuthorizationSourceIPMismatch", "AuthorizationProtocolMismatch",
    "InsufficientAccountPermissions", "NoAuthenticationInformation", "AccountIsDisabled",
    "InvalidAuthenticationInfo",
}  # fmt: skip
_TRANSIENT = {"ServerBusy", "OperationTimedOut", "InternalError", "IncompleteBody"}
_CHANGED = {"ConditionNotMet", "BlobNotFound", "InvalidRange", "ContainerNotFound"}
# The development emulator's account and key (public, documented; not a secret).
_DEV_ACCOUNT = "devstoreaccount1"
_DEV_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


@dataclass(frozen=True)
class AzureAuth:
    """Where to connect and with what; resolved without I/O."""

    account_url: str
    credential: AzureNamedKeyCredential | AzureSasCredential | TokenCredential | None
    source: str  # e.g. "account key from AZURE_STORAGE_KEY", for error messages
    anonymous: bool = False
    key: KeyFile | None = None  # the SAS token file it was read from (sas_token_file)


def parse_connection_string(conn: str) -> dict[str, str]:
    """Name=Value;... pairs with lower-cased names (values may contain '=')."""
    fields: dict[str, str] = {}
    for part in conn.split(";"):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        if not sep:
            raise UsageError("malformed Azure connection string: expected Name=Value;... pairs")
        fields[name.strip().lower()] = value.strip()
    if fields.get("usedevelopmentstorage", "").lower() == "true":
        fields.setdefault("accountname", _DEV_ACCOUNT)
        fields.setdefault("accountkey", _DEV_KEY)
        fields.setdefault("blobendpoint", f"http://127.0.0.1:10000/{_DEV_ACCOUNT}")
    return fields


def _is_path_style_host(host: str) -> bool:
    """Emulators (Azurite) put the account in the path: an IP or localhost host."""
    if host in ("localhost", "host.docker.internal"):
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _normalise_endpoint(endpoint: str, account: str) -> str:
    check_endpoint(endpoint, "the Azure blob endpoint")  # a SAS after '?' goes elsewhere
    endpoint = endpoint.rstrip("/")
    parts = urlsplit(endpoint)
    if not parts.scheme or not parts.hostname:
        raise UsageError(f"Azure blob endpoint must be a URL like https://HOST, not {endpoint!r}")
    if _is_path_style_host(parts.hostname) and parts.path in ("", "/"):
        endpoint = f"{endpoint}/{account}"
    return endpoint


def _credential_settings(opts: BackendOptions) -> tuple[dict[str, str], str]:
    """The credential settings and where they came from: opts.extra wins as a whole."""
    if any(k in opts.extra for k in _CRED_KEYS):
        return {k: opts.extra[k] for k in _CRED_KEYS if opts.extra.get(k)}, "options"
    env = os.environ
    found = {
        "connection_string": env.get("AZURE_STORAGE_CONNECTION_STRING", ""),
        "account_key": env.get("AZURE_STORAGE_KEY") or env.get("AZURE_STORAGE_ACCOUNT_KEY", ""),
        "sas_token": env.get("AZURE_STORAGE_SAS_TOKEN", ""),
    }
    return {k: v for k, v in found.items() if v}, "environment"


def _key_credential(account: str, key: str, source: str) -> AzureNamedKeyCredential:
    try:
        b64decode(key, validate=True)
    except (binascii.Error, ValueError):
        raise UsageError(f"Azure account key from {source} is not valid base64") from None
    return AzureNamedKeyCredential(account, key)


def resolve_auth(uri: DatasetURI, opts: BackendOptions) -> AzureAuth:
    """Pick endpoint and credential for `uri` (no I/O; raises UsageError on bad config)."""
    settings, origin = _credential_settings(opts)
    account = uri.account
    conn_str = settings.get("connection_string")
    conn = parse_connection_string(conn_str) if conn_str else {}
    if conn.get("accountname") and conn["accountname"] != account:
        raise UsageError(
            f"the Azure connection string ({origin}) is for account {conn['accountname']!r} "
            f"but the dataset URI names account {account!r}"
        )
    endpoint = (
        opts.endpoint_url
        or os.environ.get("AZURE_STORAGE_BLOB_ENDPOINT")
        or conn.get("blobendpoint")
        or "{}://{}.blob.{}".format(
            conn.get("defaultendpointsprotocol", "https"),
            account,
            conn.get("endpointsuffix", uri.blob_suffix or "core.windows.net"),
        )
    )
    url = _normalise_endpoint(endpoint, account)
    # The first secret given wins, in this order: (the secret, whether it is a SAS token
    # rather than an account key, where it came from).
    for secret, is_sas, src in (
        (conn.get("accountkey"), False, f"connection string from {origin}"),
        (conn.get("sharedaccesssignature"), True, f"SAS in connection string from {origin}"),
        (settings.get("account_key"), False, f"account key from {origin}"),
        (settings.get("sas_token"), True, f"SAS token from {origin}"),
    ):
        if secret:
            if is_sas:
                return AzureAuth(url, AzureSasCredential(secret.lstrip("?")), src)
            return AzureAuth(url, _key_credential(account, secret, src), src)
    if path := settings.get("sas_token_file"):
        # A file a tool rewrites with a new SAS before the old one expires: read again
        # when the store refuses the one the client has (RetryingBackend._renew).
        try:
            raw, key = KeyFile.read(path)
        except OSError as exc:
            raise UsageError(f"Azure SAS token file {path}: {exc.strerror or exc}") from None
        token = raw.decode("utf-8", "replace").strip().lstrip("?")
        if not token:
            raise UsageError(f"Azure SAS token file {path} is empty")
        return AzureAuth(url, AzureSasCredential(token), f"SAS token file {path}", key=key)
    anonymous = truthy(opts.extra.get("anonymous"))
    if not anonymous and _wants_identity(opts):
        return AzureAuth(url, _default_credential(), _IDENTITY_SOURCE)
    return AzureAuth(url, None, "anonymous access" if anonymous else "none", anonymous)


_IDENTITY_SOURCE = (
    "azure-identity's DefaultAzureCredential (workload identity, AZURE_CLIENT_* service "
    "principal, managed identity, az login)"
)


def _wants_identity(opts: BackendOptions) -> bool:
    """Use Entra ID (DefaultAzureCredential) when asked for (`credential = "default"`,
    `silofs mount --azure-identity`) or when the environment clearly sets it up: AKS
    workload identity's token file, or a service principal. Not by default otherwise:
    on a machine without a managed identity it spends seconds probing IMDS before the
    "no credentials" answer."""
    if opts.extra.get("credential", "").lower() in ("default", "identity"):
        return True
    env = os.environ
    return bool(
        env.get("AZURE_FEDERATED_TOKEN_FILE")
        or (
            env.get("AZURE_CLIENT_ID")
            and env.get("AZURE_TENANT_ID")
            and env.get("AZURE_CLIENT_SECRET")
        )
    )


def _default_credential() -> TokenCredential:
    try:
        from azure.identity import DefaultAzureCredential
    except ImportError:
        raise UsageError(
            "Azure identity (DefaultAzureCredential) needs the azure-identity package: "
            "pip install azure-identity"
        ) from None
    # Constructing it does no I/O; tokens are fetched on the first request.
    return DefaultAzureCredential(exclude_interactive_browser_credential=True)


def _error_code(exc: ax.HttpResponseError) -> str:
    code = getattr(exc, "error_code", None)
    return str(getattr(code, "value", code) or "")


class AzureBackend(DelimitedListing):
    """A read-only view of az://account/container/prefix/; safe to share between threads."""

    item_noun = "blobs"
    # The form of the content ids it lists: 2, each names its blob (azurelist.blob_scope).
    # A dataset listed with another form is listed again (node/datasets.py).
    content_ids = 2

    def __init__(self, uri: DatasetURI, opts: BackendOptions) -> None:
        self.account = uri.account
        self.container_name = uri.bucket
        self.prefix = uri.prefix
        self.uri = uri.canonical
        self.opts = opts
        self.where = f"container {self.container_name}"
        self._parsed = uri
        self.auth = resolve_auth(uri, opts)
        self._client: Any = None  # the ContainerClient
        self._lock = threading.Lock()
        self._reread = False  # the SAS token file changed: read it again (_container)

    # -- client ---------------------------------------------------------------------

    def _container(self) -> Any:
        """The shared ContainerClient, built on first use; fast error if no credentials."""
        if self.auth.credential is None and not self.auth.anonymous:
            raise AccessDeniedError(
                f"no Azure credentials for {self.uri}: {_CREDS_HINT}; "
                "or set anonymous=true for a public container"
            )
        with self._lock:
            if self._client is None:
                from azure.storage.blob import BlobServiceClient

                if self._reread:
                    try:
                        self.auth = resolve_auth(self._parsed, self.opts)
                    except UsageError as exc:  # the file gone or emptied since
                        raise AccessDeniedError(f"{self.uri}: {exc}") from None
                    self._reread = False
                self._key = self.auth.key

                session = pooled_session(requests.Session(), self.opts)
                service = BlobServiceClient(
                    self.auth.account_url,
                    credential=self.auth.credential,
                    retry_total=0,  # base.retry_call owns retries
                    connection_timeout=self.opts.connect_timeout,
                    read_timeout=self.opts.read_timeout,
                    session=session,
                )
                self._client = service.get_container_client(self.container_name)
            return self._client

    # -- credentials renewal (RetryingBackend._renew) ---------------------------------
    # A SAS token in the environment or the config is fixed until the daemon restarts;
    # one in a file (sas_token_file) a tool rewrites before the old one expires is read
    # again when the store refuses the one the client has.

    _key_holds = "the SAS token"

    def _drop_client(self) -> None:
        self._client, self._reread = None, True

    # -- internals --------------------------------------------------------------------

    def _list_raw(
        self, prefix: str, token: str | None, page_size: int | None, delimiter: str | None
    ) -> tuple[list[ListedBlob], list[str], str | None]:
        """One page, parsed here (azurelist.py); through the SDK where that parser
        declines a page (counted in lean_fallbacks)."""
        container = self._container()
        size = page_size or self.opts.page_size
        try:
            try:
                return azurelist.list_page(container, prefix, token, size, delimiter)
            except azurelist.LeanDeclined as exc:
                self.counters.lean_fallbacks += 1
                # Once per backend: without the SDK's pipeline every page declines.
                if self.counters.lean_fallbacks == 1:
                    log.info("%s: list pages left to the SDK (counted): %s", self.uri, exc)
            return self._list_sdk(container, prefix, token, size, delimiter)
        except ax.AzureError as exc:
            raise self._classify(exc, f"container {self.container_name}") from exc

    @staticmethod
    def _list_sdk(
        container: Any, prefix: str, token: str | None, size: int, delimiter: str | None
    ) -> tuple[list[ListedBlob], list[str], str | None]:
        from azure.storage.blob import BlobPrefix  # imported with the client, lazily

        # include=metadata so hierarchical-namespace directory blobs can be skipped.
        args = {"name_starts_with": prefix or None, "include": ["metadata"]}
        if delimiter:
            blobs = container.walk_blobs(**args, delimiter=delimiter, results_per_page=size)
        else:
            blobs = container.list_blobs(**args, results_per_page=size)
        pager = blobs.by_page(continuation_token=token)
        items, subs = [], []
        for item in next(pager, []):
            if isinstance(item, BlobPrefix):
                subs.append(item.name)
            else:
                items.append(azurelist.from_properties(item))
        return items, subs, pager.continuation_token or None

    def _info(self, blob: ListedBlob) -> ObjectInfo | None:
        key = relative_key(self.prefix, blob.name)
        if key is None or blob.folder:  # a folder: a directory in a hierarchical namespace
            return None
        scope = self._scope(blob.name)
        return ObjectInfo(key, blob.size, blob.mtime, blob.etag, azurelist.content_id(blob, scope))

    def _scope(self, name: str) -> str:
        return azurelist.blob_scope(self.account, self.container_name, name)

    def identifies(self, info: ObjectInfo) -> bool:
        # A blob without an MD5 is named by its ETag (the GET's condition); one with an
        # MD5 by that digest, which every GET's answer names and _get_part checks. Both
        # end with the blob's own scope (a content id of another blob, or one listed
        # before ids had a scope, is refused).
        cid = info.content_id
        scope = self._scope(join_prefix(self.prefix, info.key))
        return cid == azurelist.etag_content_id(info.version, info.size, scope) or (
            cid.startswith("az-md5:") and cid.endswith(f":{info.size}:{scope}")
        )

    # Each GET is counted as its response arrives (keep_md5): a long range is several.
    _counts_own_requests = True

    def _get_once(self, info: ObjectInfo, start: int, end: int) -> bytes:
        # Azure sends a range's MD5 only for ranges up to 4 MiB: a longer read is several
        # GETs, each checked (all pinned to the listed ETag, so never mixed versions), and
        # each counted (status's remote_requests counts requests, not ranges read).
        parts = [self._get_part(info, pos, min(end, pos + MD5_RANGE_MAX))
                 for pos in range(start, end, MD5_RANGE_MAX)]  # fmt: skip
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _get_part(self, info: ObjectInfo, start: int, end: int) -> bytes:
        store_key = join_prefix(self.prefix, info.key)
        what = f"{self.uri}{info.key}"
        blob = self._container().get_blob_client(store_key)
        md5s: list[str] = []
        blob_md5s: list[str] = []

        def keep_md5(response: Any) -> None:
            note_requests()  # once per response: the SDK's own retries included
            headers = response.http_response.headers
            md5s.append(headers.get("content-md5", ""))
            blob_md5s.append(headers.get("x-ms-blob-content-md5", ""))

        try:
            # Not validate_content=True: with decompress=False the SDK (12.31) then returns
            # an empty body. The header and the check are done here instead.
            downloader = blob.download_blob(
                offset=start,
                length=end - start,
                etag=info.version,
                match_condition=MatchConditions.IfNotModified,
                max_concurrency=1,
                decompress=False,
                headers={"x-ms-range-get-content-md5": "true"},
                raw_response_hook=keep_md5,
            )
            data = downloader.readall()
        except ax.HttpResponseError as exc:
            code = _error_code(exc)
            changed = isinstance(exc, ax.ResourceModifiedError) or code in _CHANGED
            if changed or exc.status_code in (404, 412, 416):
                raise ObjectChangedError(
                    f"{what} changed or was deleted since listing ({code or exc.status_code})"
                ) from exc
            raise self._classify(exc, what) from exc
        except ax.AzureError as exc:
            raise self._classify(exc, what) from exc
        # The SDK retries a failed GET or body read itself, calling the hook once per
        # response: the bytes returned are the last response's, so its MD5 is checked
        # (a body the SDK resumed from the middle then mismatches and is retried whole).
        # A short body is base's to retry.
        if md5s and md5s[-1] and len(data) == end - start:
            if md5_b64(data) != md5s[-1]:
                raise ChecksumMismatchError(
                    f"{what}: bytes {start}-{end - 1} do not match their Content-MD5"
                )
        # A range's answer names the whole blob's MD5 if it has one: the content id of a
        # blob named by a digest must be that digest (identifies() lets any such id pass,
        # so this is the check). No MD5 in the answer is a mismatch too: else a member
        # could name a blob without one by another blob's digest and size.
        blob_md5 = blob_md5s[-1] if blob_md5s else ""
        if info.content_id.startswith("az-md5:"):
            scope = self._scope(store_key)
            if azurelist.md5_content_id(blob_md5, info.size, scope) != info.content_id:
                raise ObjectChangedError(f"{what}: its MD5 is not the one listed")
        return data

    def _classify(self, exc: Exception, what: str) -> BackendError:
        """Map an azure-core exception to a typed error naming `what` and the remedy."""
        ep = self.auth.account_url
        if isinstance(exc, ax.HttpResponseError):
            return self._classify_http(exc, what)
        if isinstance(exc, ax.ServiceRequestError):  # never reached the service
            return UnreachableError(
                f"cannot reach Azure blob endpoint {ep} for {self.uri}: {connection_reason(exc)}; "
                "check the account name, endpoint and network"
            )
        if isinstance(exc, (ax.ServiceResponseError, ax.IncompleteReadError, ax.DecodeError)):
            return TransientError(f"Azure response for {what} from {ep} broke off: {exc.message}")
        return BackendError(f"Azure request for {what} at {ep} failed: {exc}")

    def _classify_http(self, exc: ax.HttpResponseError, what: str) -> BackendError:
        code = _error_code(exc)
        status = exc.status_code or 0
        if code == "ContainerNotFound" or (status == 404 and what.startswith("container ")):
            hint = "" if self.auth.credential else " (or it is private and no credentials were set)"
            return NotFoundError(
                f"container {self.container_name} does not exist in account {self.account} "
                f"at {self.auth.account_url}{hint}; check the URI"
            )
        if code in _DENIED or status in (401, 403) or isinstance(exc, ax.ClientAuthenticationError):
            return AccessDeniedError(
                f"access to {what} denied ({code or status}) using {self.auth.source}; "
                f"check the key or SAS (expiry, permissions r+l); {_CREDS_HINT}"
            )
        if code in _TRANSIENT or status in (408, 429) or status >= 500:
            headers = exc.response.headers if exc.response is not None else {}
            return busy(
                f"Azure busy or failing for {what} ({code}, HTTP {status})",
                headers.get("retry-after"),
            )
        return BackendError(f"Azure refused a request for {what} ({code}, HTTP {status})")
