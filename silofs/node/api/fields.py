"""What a request names, checked: body and query fields, job names, sizes and rates, the
dataset a name or URI refers to.

Owns the 400 (or 404) a malformed or unknown name gets, in one line, and turning the
daemon's UsageError into the status a route answers with. Never changes the daemon's
state and never judges who is asking (node/authz.py does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from silofs.control.router import HTTPError, Request
from silofs.errors import UsageError
from silofs.node.daemon import Daemon
from silofs.node.state import DatasetState
from silofs.records import job_name_error
from silofs.uri import parse_uri

MAX_NAME = 1024  # the longest string field (a path, a job, a mountpoint)


def field(body: dict, name: str, kind: type, *, required: bool = True) -> Any:
    """body[name] if it is of `kind` (int, str, bool, dict); None if absent and not
    `required`; HTTPError(400) otherwise. A string is non-empty and at most MAX_NAME."""
    value = body.get(name)
    if value is None:
        if required:
            raise HTTPError(400, f"missing field {name!r}")
        return None
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise HTTPError(400, f"field {name!r} must be an integer")
    if kind is str and (not isinstance(value, str) or len(value) > MAX_NAME or not value):
        raise HTTPError(400, f"field {name!r} must be a non-empty string")
    if kind is bool and not isinstance(value, bool):
        raise HTTPError(400, f"field {name!r} must be true or false")
    if kind is dict and not isinstance(value, dict):
        raise HTTPError(400, f"field {name!r} must be an object")
    return value


def string_list(body: dict, name: str, limit: int) -> list[str]:
    """body[name]: at most `limit` non-empty printable strings ([] if absent)."""
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > limit:
        raise HTTPError(400, f"field {name!r} must be a list of at most {limit} strings")
    for item in value:
        if not isinstance(item, str) or not item or len(item) > MAX_NAME:
            raise HTTPError(400, f"field {name!r} must hold non-empty strings")
        if not item.isprintable():
            raise HTTPError(400, f"field {name!r} holds a string that is not printable")
    return list(value)


def chunk_size(body: dict) -> int | None:
    """body["chunk_size"], if given: 64 KiB to 64 MiB."""
    size = field(body, "chunk_size", int, required=False)
    if size is not None and not (64 << 10) <= size <= (64 << 20):
        raise HTTPError(400, "chunk_size must be between 64KiB and 64MiB")
    return size


def query_int(req: Request, name: str) -> int:
    """An integer query parameter; HTTPError(400) if it is missing or not one."""
    try:
        return int(req.query.get(name, ""))
    except ValueError:
        raise HTTPError(400, f"{name} must be an integer") from None


def amount(
    body: dict, name: str, parse: Callable[[Any], int | None], *, allow_null: bool
) -> int | None:
    """body[name] as a size or rate (an integer, or a string with units, through
    `parse`); null only if `allow_null`."""
    if name not in body:
        raise HTTPError(400, f"missing field {name!r}")
    value = body[name]
    if value is None and allow_null:
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise HTTPError(400, f"field {name!r} must be an integer or a string with units")
    try:
        parsed = parse(value)
    except UsageError as exc:
        raise HTTPError(400, str(exc)) from None
    except ValueError:  # more digits than int() converts (4300)
        raise HTTPError(400, f"field {name!r} is not a number silofs can use") from None
    if parsed is None and not allow_null:
        raise HTTPError(400, f"field {name!r} must be a size")
    return parsed


def job_name(job: str) -> str:
    """`job` if it is a job name (records.job_name_error); HTTPError(400) otherwise."""
    why = job_name_error(job)
    if why is not None:
        raise HTTPError(400, why)
    return job


def dataset(d: Daemon, name: str) -> DatasetState:
    """The dataset `name` names (short name, id or URI); HTTPError(404) if none."""
    ds = d.catalog.find_dataset(name)
    if ds is None:
        raise HTTPError(404, f"no dataset {name!r} on this node")
    return ds


def dataset_uri(d: Daemon, name: str) -> str:
    """Canonical URI for an allocation: a known dataset's name, or any dataset URI (an
    allocation for a dataset not mounted yet is kept until it appears)."""
    ds = d.catalog.find_dataset(name)
    if ds is not None:
        return ds.uri.canonical
    if "://" in name or name.startswith("/"):
        try:
            return parse_uri(name).canonical
        except UsageError as exc:
            raise HTTPError(400, str(exc)) from None
    raise HTTPError(
        404, f"no dataset named {name!r} on this node: use its URI to allocate before it is mounted"
    )


@contextlib.contextmanager
def usage_error_as(status: int) -> Iterator[None]:
    """The daemon's UsageError inside the block, answered as `status` with its line."""
    try:
        yield
    except UsageError as exc:
        raise HTTPError(status, str(exc)) from None
