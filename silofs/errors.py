"""Typed errors shared by the node side.

Owns the error vocabulary that crosses module boundaries. Every error here carries a
one-line message fit for a user; callers at the boundary (CLI, fs.py, control API) turn
them into an exit status, an errno or a JSON error body. Never holds a traceback for
the user and never decides how an error is shown.
"""

from __future__ import annotations


class SilofsError(Exception):
    """An error with a one-line message meant for a person."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class UsageError(SilofsError):
    """Bad input from a user: a malformed URI, size, flag or config value."""


class RefreshTooSoonError(SilofsError):
    """A refresh asked of a dataset listed less than min_refresh_seconds ago, by a caller
    the interval applies to. `wait`: seconds until a refresh would be accepted."""

    def __init__(self, message: str, wait: float) -> None:
        super().__init__(message)
        self.wait = wait


class BackendError(SilofsError):
    """A store could not do what was asked. Subclasses say whether to retry."""

    retryable: bool = False
    # The object key of the GET that failed, set where a chunk fetch shares its outcome
    # (node/fetch.py): objects with the same bytes share chunk keys, and one object's
    # failure (changed, deleted, denied) says nothing of another's.
    object_key: str | None = None


class NotFoundError(BackendError):
    """The bucket, container, prefix or object does not exist."""


class AccessDeniedError(BackendError):
    """Credentials are missing, wrong, expired, or lack permission."""


class UnreachableError(BackendError):
    """The endpoint could not be reached (DNS, refused connection, TLS)."""

    retryable = True


class TransientError(BackendError):
    """Throttling, 5xx, timeouts: worth retrying with backoff. `retry_after`: seconds
    the store asked to wait before the next request (its Retry-After header), if any."""

    retryable = True
    retry_after: float | None = None


class ObjectChangedError(BackendError):
    """The object's content identity differs from the listing: never mix bytes."""


class ChecksumMismatchError(TransientError):
    """A store's body did not match the checksum the store sent with it: retried."""


class VersionMismatchError(SilofsError):
    """A mount asked for a version of an object other than the one now listed."""


def first_leaf(exc: BaseException) -> BaseException:
    """The first exception inside `exc`'s ExceptionGroups (trio reports a failed task
    inside one per nursery); `exc` itself if it is not a group."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
