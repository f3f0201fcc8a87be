"""Routing of control requests: the request and response records and the path router.

Owns matching ``/v1/x/{param}`` patterns to async handlers, percent-decoding request
targets, the ``Request``/``Response`` records handlers see, and the one-line
``{"error": ...}`` body of every failure. Never reads a socket (control/server.py does)
and never holds silofs business logic (the daemon registers routes).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from silofs.control.peer import Peer

log = logging.getLogger(__name__)


class HTTPError(Exception):
    """Raise from a handler to answer ``status`` with body ``{"error": message}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def __str__(self) -> str:
        return self.message


@dataclass
class Request:
    method: str
    path: str  # percent-decoded, without the query string
    query: dict[str, str]
    headers: dict[str, str]  # names lower-cased; repeated headers joined with ", "
    body: bytes
    peer: Peer

    def json(self) -> Any:
        """The body as a JSON object; HTTPError(400) if it is not one, nests deeper than
        MAX_JSON_DEPTH, or holds a string that is not UTF-8 encodable (a lone surrogate
        escape like "\\ud800" is valid JSON and would fail later, in a log line or
        /metrics)."""
        try:
            obj = json.loads(self.body)
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, >4300 digits
            raise HTTPError(400, f"request body is not valid JSON: {one_line(exc)}") from None
        except RecursionError:
            raise HTTPError(400, "request body nests too deeply") from None
        if not isinstance(obj, dict):
            raise HTTPError(400, f"request body must be a JSON object, not {type(obj).__name__}")
        _check_json(obj)
        return obj


MAX_JSON_DEPTH = 32


def _check_json(obj: Any) -> None:
    """HTTPError(400) for nesting deeper than MAX_JSON_DEPTH or unencodable text."""
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise HTTPError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(value, dict):
            for k, v in value.items():
                stack.append((k, depth))
                stack.append((v, depth + 1))
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
        elif isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError:
                raise HTTPError(
                    400, "request body holds text that is not UTF-8 (a lone surrogate?)"
                ) from None


@dataclass
class Response:
    status: int = 200
    body: bytes | bytearray | memoryview = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


def json_response(obj: Any, status: int = 200) -> Response:
    """Compact JSON plus a newline, so curl output ends cleanly."""
    text = json.dumps(obj, separators=(",", ":")) + "\n"
    return Response(status=status, body=text.encode())


def text_response(text: str, content_type: str = "text/plain; version=0.0.4") -> Response:
    """Plain text; the default content type is Prometheus' exposition format."""
    return Response(body=text.encode(), content_type=content_type)


def error_response(status: int, message: str) -> Response:
    return json_response({"error": message}, status)


def one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


Handler = Callable[..., Awaitable[Response]]


@dataclass
class _Route:
    method: str
    pattern: str
    segments: list[str]  # literal text, or "{name}" for a parameter
    handler: Handler

    def match(self, parts: list[str]) -> dict[str, str] | None:
        if len(parts) != len(self.segments):
            return None
        params: dict[str, str] = {}
        for seg, part in zip(self.segments, parts, strict=True):
            if seg.startswith("{"):
                if not part:  # a parameter never matches an empty segment
                    return None
                params[seg[1:-1]] = part
            elif seg != part:
                return None
        return params

    def specificity(self) -> tuple[bool, ...]:
        # Literal segments beat parameters position by position, so
        # "/v1/datasets/stats" wins over "/v1/datasets/{name}".
        return tuple(not s.startswith("{") for s in self.segments)


class Router:
    """Maps (method, path pattern) to ``async def handler(req, **params) -> Response``."""

    def __init__(self) -> None:
        self._routes: list[_Route] = []

    def add(self, method: str, pattern: str, handler: Handler) -> None:
        if not pattern.startswith("/"):
            raise ValueError(f"route pattern must start with '/': {pattern!r}")
        method = method.upper()
        segments = pattern.split("/")[1:]
        for seg in segments:
            if seg.startswith("{") != seg.endswith("}") or seg == "{}":
                raise ValueError(f"bad parameter segment {seg!r} in {pattern!r}")
        if any(r.method == method and r.segments == segments for r in self._routes):
            raise ValueError(f"duplicate route {method} {pattern}")
        self._routes.append(_Route(method, pattern, segments, handler))

    def only(self, allowed: set[tuple[str, str]]) -> Router:
        """A router with only the routes named as (method, pattern): the TLS listener's
        (remote controllers get the admin routes, never mounts, chunks or offers).
        ValueError for a name that is not a route here, so a renamed route cannot
        silently drop out of the list."""
        sub = Router()
        for method, pattern in sorted(allowed):
            found = [r for r in self._routes if (r.method, r.pattern) == (method, pattern)]
            if not found:
                raise ValueError(f"no route {method} {pattern} to allow")
            sub._routes.append(found[0])
        return sub

    def resolve(self, method: str, parts: list[str]) -> tuple[Handler, dict[str, str]]:
        """The handler and params for decoded path segments, or HTTPError 404/405."""
        matches = [(r, p) for r in self._routes if (p := r.match(parts)) is not None]
        if not matches:
            raise HTTPError(404, f"no such endpoint: /{'/'.join(parts)}")
        wanted = [method, "GET"] if method == "HEAD" else [method]
        for want in wanted:
            found = [(r, p) for r, p in matches if r.method == want]
            if found:
                route, params = max(found, key=lambda rp: rp[0].specificity())
                return route.handler, params
        allowed = sorted({r.method for r, _ in matches})
        raise _MethodNotAllowed(method, allowed)

    async def dispatch(self, req: Request, parts: list[str] | None = None) -> Response:
        """Run the matching handler; every failure becomes an error Response.

        ``parts`` are the decoded path segments from parse_target; without them
        the decoded path is split, which cannot keep an encoded "/" in a param.
        """
        try:
            if parts is None:
                parts = req.path.split("/")[1:]
            handler, params = self.resolve(req.method, parts)
            resp = await handler(req, **params)
            if not isinstance(resp, Response):
                raise TypeError(f"handler returned {type(resp).__name__}, not Response")
            return resp
        except _MethodNotAllowed as exc:
            resp = error_response(405, str(exc))
            resp.headers["allow"] = ", ".join(exc.allowed)
            return resp
        except HTTPError as exc:
            return error_response(exc.status, exc.message)
        except Exception as exc:
            log.exception("handler for %s %s failed", req.method, req.path)
            return error_response(500, f"internal error: {type(exc).__name__}: {one_line(exc)}")


class _MethodNotAllowed(HTTPError):
    def __init__(self, method: str, allowed: list[str]) -> None:
        super().__init__(405, f"method {method} not allowed here; use {', '.join(allowed)}")
        self.allowed = allowed


def parse_target(target: bytes) -> tuple[str, list[str], dict[str, str]]:
    """Request target -> (decoded path, decoded segments, query). HTTPError 400 if bad.

    Segments are split before percent-decoding, so an encoded "/" (%2F) stays
    inside its segment: that is how a whole dataset URI travels as one param.
    """
    try:
        text = target.decode("ascii")
    except UnicodeDecodeError:
        raise HTTPError(400, "request target is not ASCII; percent-encode it") from None
    if not text.startswith("/"):
        split = urlsplit(text)  # absolute-form, e.g. "http://x/v1/status"
        if split.scheme not in ("http", "https") or not split.path.startswith("/"):
            raise HTTPError(400, f"bad request target {text[:100]!r}")
        text = split.path + (f"?{split.query}" if split.query else "")
    raw_path, _, raw_query = text.partition("?")
    try:
        path = unquote(raw_path, errors="strict")
        parts = [unquote(p, errors="strict") for p in raw_path.split("/")[1:]]
        query = dict(parse_qsl(raw_query, keep_blank_values=True, errors="strict"))
    except UnicodeDecodeError:
        raise HTTPError(400, "request target is not valid UTF-8 after percent-decoding") from None
    return path, parts, query
