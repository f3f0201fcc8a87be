"""The choice of backend for a dataset URI.

Owns mapping a parsed URI (silofs/uri.py) to the store's backend, importing each store's
SDK lazily so that a node reading only S3 never loads the Azure SDK. Never does I/O.
"""

from __future__ import annotations

from silofs.errors import UsageError
from silofs.node.backends.base import Backend, BackendOptions
from silofs.uri import DatasetURI

__all__ = ["Backend", "BackendOptions", "open_backend"]


def open_backend(uri: DatasetURI, opts: BackendOptions) -> Backend:
    """A backend for `uri`. Creating it does no I/O; call check() for that."""
    if uri.scheme == "file":
        from silofs.node.backends.local import LocalBackend

        return LocalBackend(uri, opts)
    if uri.scheme == "s3":
        from silofs.node.backends.s3 import S3Backend

        return S3Backend(uri, opts)
    if uri.scheme == "az":
        from silofs.node.backends.azure import AzureBackend

        return AzureBackend(uri, opts)
    if uri.scheme == "gs":
        from silofs.node.backends.gcs import GCSBackend

        return GCSBackend(uri, opts)
    raise UsageError(f"no backend for scheme {uri.scheme!r}")
