"""Dataset URIs and the choice of backend for them.

Owns URI parsing and canonical dataset names (the name cache is allocated to). Imports
each store's SDK lazily so that a node reading only S3 never loads the Azure SDK.
Never does I/O itself.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from ..errors import UsageError
from .base import Backend, BackendOptions, ObjectInfo

__all__ = ["Backend", "BackendOptions", "ObjectInfo", "DatasetURI", "parse_uri", "open_backend"]

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
        if self.scheme == "file":
            return "file://" + self.bucket.rstrip("/") + "/"
        if self.scheme == "az":
            return f"az://{self.account}/{self.bucket}/{self.prefix}"
        return f"{self.scheme}://{self.bucket}/{self.prefix}"


def _norm_prefix(path: str) -> str:
    path = path.strip("/")
    return path + "/" if path else ""


def parse_uri(uri: str) -> DatasetURI:
    """Parse file:///dir, a bare local path, s3://b/p, az://acct/c/p, https://acct.blob..., gs://b/p."""
    if not uri:
        raise UsageError("empty dataset URI")
    if "://" not in uri:
        return DatasetURI("file", os.path.abspath(os.path.expanduser(uri)), "")
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    path = unquote(parts.path)
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


def open_backend(uri: DatasetURI, opts: BackendOptions) -> Backend:
    """A backend for `uri`. Creating it does no I/O; call check() for that."""
    if uri.scheme == "file":
        from .local import LocalBackend

        return LocalBackend(uri, opts)
    if uri.scheme == "s3":
        from .s3 import S3Backend

        return S3Backend(uri, opts)
    if uri.scheme == "az":
        from .azure import AzureBackend

        return AzureBackend(uri, opts)
    if uri.scheme == "gs":
        from .gcs import GCSBackend

        return GCSBackend(uri, opts)
    raise UsageError(f"no backend for scheme {uri.scheme!r}")
