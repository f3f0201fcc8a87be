"""Dataset URIs: parsing and the canonical name a dataset goes by everywhere.

Owns the grammar of file://, s3://, az://, https://ACCOUNT.blob..., gs:// and bare local
paths, and the canonical URI cache is allocated to. Shared by the CLI, the daemon and
the backends. Never does I/O beyond normalising a local path.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from silofs.errors import UsageError
from silofs.records import not_utf8

_AZURE_HOST = re.compile(
    r"^([a-z0-9]{3,24})\.blob\.core\.(windows\.net|chinacloudapi\.cn|usgovcloudapi\.net)$"
)


@dataclass(frozen=True)
class DatasetURI:
    """A parsed dataset URI. `canonical` names the dataset everywhere."""

    scheme: str  # file | s3 | az | gs
    bucket: str  # bucket / container; for file, the absolute directory
    prefix: str  # '' or ends with '/'
    account: str = ""  # Azure storage account
    # Azure endpoint suffix from an https://ACCOUNT.blob.SUFFIX URL (sovereign clouds);
    # empty: the public cloud unless the credentials or an override say otherwise.
    blob_suffix: str = field(default="", compare=False)

    @property
    def canonical(self) -> str:
        """The name parse_uri maps back to this dataset: parse_uri(canonical) == self.
        A "%" in a path is written "%25" (parsing percent-decodes the path): the CLI
        sends the canonical URI to the daemon, which parses it again, and a local
        directory /data/%41 written as file:///data/%41/ mounted /data/A, an S3 prefix
        x%2541 (the key x%41) the prefix xA, whatever those held, without a word."""
        if self.scheme == "file":
            return "file://" + _pct(self.bucket.rstrip("/")) + "/"
        if self.scheme == "az":
            return f"az://{self.account}/{self.bucket}/{_pct(self.prefix)}"
        return f"{self.scheme}://{self.bucket}/{_pct(self.prefix)}"


def _pct(path: str) -> str:
    return path.replace("%", "%25")


# C0 controls and DEL, raw or percent-encoded: no store takes them in every name (a
# local path ends at NUL), and a name that holds a newline would write lines of its own
# into every log that names the dataset.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def store_endpoint(uri: DatasetURI, given: str | None) -> str | None:
    """The endpoint a dataset's store is reached at: `given` (a flag or [backend]
    endpoint_url), else for s3:// AWS_ENDPOINT_URL (an S3 endpoint: applied to gs:// or
    az:// it would send their requests to the wrong service). One rule for the CLI, the
    S3 backend and the cluster's check that members reach the same store. UsageError
    for one holding credentials (check_endpoint)."""
    if given is None and uri.scheme == "s3":
        env = os.environ.get("AWS_ENDPOINT_URL") or None
        return check_endpoint(env, "AWS_ENDPOINT_URL") if env else None
    return check_endpoint(given, "the endpoint URL") if given else given


def check_endpoint(url: str, what: str = "endpoint_url") -> str:
    """`url` unless it holds credentials: USER:SECRET@ before its host, or a query (an
    Azure SAS token). The endpoint is repeated in the store's errors (the dataset's
    status, which every local user reads, the logs, the clients' error lines): an
    http://KEY:SECRET@minio:9000 put the secret in all of them. The message does not
    repeat the URL."""
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise UsageError(f"{what} is not a URL: {exc}") from None
    if "@" in parts.netloc or parts.query:
        raise UsageError(
            f"{what} holds no credentials (USER:SECRET@ before the host, or a query such "
            "as a SAS token): give them as the store's own settings (environment, "
            "profile, key file)"
        )
    return url


def _no_control(uri: str, *parts: str) -> None:
    if any(_CONTROL.search(p) for p in (uri, *parts)):
        raise UsageError(f"dataset URI {uri!r} holds a control character (%00-%1F or %7F)")


def _path_of(uri: str, netloc: str, scheme: str) -> str:
    """Everything after the bucket (or account) as written: "#" and "?" are characters
    of an object key or a file name (aws s3, gsutil and a shell take them so), not a
    fragment and a query. Read as URL delimiters, s3://b/data#1/ mounted s3://b/data/,
    a wider tree than asked for, without a word. An https:// Azure URL's query is a SAS
    token: refused, as credentials in any URI are."""
    rest = uri[uri.index("://") + 3 + len(netloc) :]
    if scheme == "https" and "?" in rest:
        raise UsageError(
            "an Azure URL holds no credentials (a SAS token after '?'): give the token "
            "as AZURE_STORAGE_SAS_TOKEN or the sas_token option"
        )
    return rest


def _norm_prefix(path: str) -> str:
    path = path.strip("/")
    return path + "/" if path else ""


# The longest canonical URI: it keys the daemon's rows in LMDB ("names", and "cache:" or
# "mode:" + URI in "meta"), whose keys stop at 511 bytes. A longer one (an S3 prefix or
# a local path of 600 bytes: legal) failed the mount, or an allocation, with "internal
# error: BadValsizeError"; now it is refused in one line before anything is sent.
MAX_URI_BYTES = 500


def parse_uri(uri: str) -> DatasetURI:
    """Parse file:///dir, a bare local path, s3://b/p, az://acct/c/p, https://acct.blob..., gs://b/p."""
    parsed = _parse(uri)
    # A local directory whose name holds bytes that are not UTF-8: the mount failed with
    # the daemon's "request body holds text that is not UTF-8".
    if not_utf8(parsed.canonical) is not None:
        raise UsageError(
            f"dataset URI '{not_utf8(uri) or uri}' is not UTF-8 text: silofs names datasets in "
            "UTF-8 (rename the directory, or link to it from a UTF-8 name)"
        )
    size = len(parsed.canonical.encode())
    if size > MAX_URI_BYTES:
        raise UsageError(
            f"dataset URI {parsed.canonical[:60]!r}... is {size} bytes: silofs names a "
            f"dataset in at most {MAX_URI_BYTES} (mount a shorter prefix or a symlink to it)"
        )
    return parsed


def _parse(uri: str) -> DatasetURI:
    if not uri:
        raise UsageError("empty dataset URI")
    _no_control(uri)
    if "://" not in uri:
        return DatasetURI("file", os.path.abspath(os.path.expanduser(uri)), "")
    try:
        parts = urlsplit(uri, allow_fragments=False)
        parts.port  # noqa: B018 - a bad port or IPv6 host raises here, not later
    except ValueError as exc:
        raise UsageError(f"bad dataset URI {uri!r}: {exc}") from None
    scheme = parts.scheme.lower()
    path = unquote(_path_of(uri, parts.netloc, scheme))
    _no_control(uri, path)
    if "@" in parts.netloc:
        # s3://KEY:SECRET@bucket/ was taken as a bucket named so: the dataset's row, its
        # status (every local user reads it), /metrics and the logs then showed the
        # secret. No bucket, container or account name holds "@"; the message does not
        # repeat the URI.
        raise UsageError(
            f"a {scheme or 'dataset'} URI holds no credentials (USER@ or USER:SECRET@ "
            "before the bucket or account): give them as the store's own settings "
            "(environment, profile, key file)"
        )
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise UsageError(f"file URI must be file:///absolute/path, not {uri!r}")
        if not path.startswith("/"):
            raise UsageError(f"file URI needs an absolute path: {uri!r}")
        return DatasetURI("file", os.path.normpath(path), "")
    if scheme in ("s3", "gs"):
        if not parts.netloc:
            raise UsageError(f"{scheme} URI needs a bucket: {scheme}://BUCKET/PREFIX, not {uri!r}")
        return DatasetURI(scheme, parts.netloc, _norm_prefix(path))
    if scheme == "az":
        segs = path.strip("/").split("/", 1)
        if not parts.netloc or not segs[0]:
            raise UsageError(
                f"az URI needs an account and a container: "
                f"az://ACCOUNT/CONTAINER/PREFIX, not {uri!r}"
            )
        return DatasetURI(
            "az", segs[0], _norm_prefix(segs[1] if len(segs) > 1 else ""), account=parts.netloc
        )
    if scheme == "https" and _AZURE_HOST.match(parts.netloc.lower()):
        host = _AZURE_HOST.match(parts.netloc.lower())
        account, suffix = host.group(1), "core." + host.group(2)
        segs = path.strip("/").split("/", 1)
        if not segs[0]:
            raise UsageError(
                f"Azure URL needs a container: "
                f"https://ACCOUNT.blob.core.windows.net/CONTAINER/PREFIX, not {uri!r}"
            )
        return DatasetURI(
            "az",
            segs[0],
            _norm_prefix(segs[1] if len(segs) > 1 else ""),
            account=account,
            blob_suffix=suffix,
        )
    raise UsageError(
        f"unknown URI scheme {parts.scheme!r} in {uri!r} "
        "(use file:///dir, s3://bucket/prefix, az://account/container/prefix "
        "or gs://bucket/prefix)"
    )
