"""Routing of control requests: route records, the request and response records, and
the router that matches one to the other.

Owns the Route record (method, path pattern, handler, who may call it, body limit),
matching ``/v1/x/{param}`` patterns, the decision a route's entry makes before a body
is read (is the route there for this peer, may it call it, how large a body it may
send), percent-decoding request targets, the ``Request``/``Response`` records handlers
see, and the one-line ``{"error": ...}`` body of every failure. Never reads a socket
(control/server.py does), never decides which roles a peer holds (the daemon does,
node/authz.py), and never holds silofs business logic (node/routes.py is the daemon's
table).
"""

from __future__ import annotations

import enum
import functools
import json
import logging
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

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
    # The connection can carry a descriptor with the answer's head (a Unix socket's, on
    # the loop or in a thread of its own); Response.fd is sent only then.
    passes_fds: bool = False
    # Whether the client has closed its connection: asked by an inline answer that waits
    # on something else (a member), between its waits, so a client that left frees the
    # thread and the work it started. Never on the loop (its handlers are cancelled).
    gone: Callable[[], bool] = field(default=lambda: False, compare=False, repr=False)
    # The connection's hand-off region (silofs/sealed.py Region) where one is to be had:
    # a Unix connection served by a thread of its own, one request at a time. An inline
    # answer may name its data there (REGION_HEADER) instead of sending its bytes.
    region: Any = field(default=None, compare=False, repr=False)

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
    # Called once the answer is sent or given up (the body is not read after it): for
    # a body that lends bytes only while something stays open, as a held chunk's LMDB
    # read txn. Only an inline answer (Route.inline, control/thread_conn.py) has one.
    release: Callable[[], None] | None = None
    # A file whose descriptor goes with the head (SCM_RIGHTS), on a connection whose
    # Request.passes_fds: anything with fileno(), referenced here until it is sent.
    fd: Any = None


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


class Caller(enum.Flag):
    """Who may call a route: the roles a peer may hold. A local peer (SO_PEERCRED) is
    LOCAL, plus ADMIN and ROOT as the daemon judges it; a peer on the mutual-TLS listener
    holds only the role its certificate proves. A route names the roles that may call it;
    a role that needs more than the route's entry (a mount's owner, a file the peer can
    read) is the handler's check."""

    LOCAL = enum.auto()  # any local process; the handler's per-uid rules apply
    ADMIN = enum.auto()  # root, the daemon's own uid, or a member of admin_group
    ROOT = enum.auto()  # root or the daemon's own uid: who could write the cache itself
    CONTROLLER = enum.auto()  # a remote controller, by its client certificate
    PEER = enum.auto()  # a member of this node's cluster, by its node certificate


LOCAL_ROLES = Caller.LOCAL | Caller.ADMIN | Caller.ROOT
REMOTE_ROLES = Caller.CONTROLLER | Caller.PEER
EVERYONE = LOCAL_ROLES | Caller.CONTROLLER


def _local_or_controller(peer: Peer) -> Caller:
    """The roles a router assumes without a judge: every local peer holds all local
    roles, a remote peer is a controller (with the node role: a member)."""
    if peer.remote is None:
        return LOCAL_ROLES
    return Caller.PEER if peer.node else Caller.CONTROLLER


def _plain_refusal(route: Route, peer: Peer) -> str:
    return f"uid {peer.uid} may not {route.doc or f'call {route.method} {route.path}'}"


@dataclass(frozen=True)
class Route:
    """One entry of a route table: everything the server and the router need to know
    of a route, decided from it before the request's body is read.

    ``handler`` is ``async def handler(req, **params) -> Response``; ``who`` the roles
    that may call it (any one will do); ``body_limit`` the largest body a caller that
    may call it may send (None: the listener's limit); ``doc`` what it does, as a verb
    phrase ("change a job's remote IO allocation"), for refusals and the docs;
    ``threaded``: a Unix-socket connection that calls it is served from a worker thread
    from then on (control/thread_conn.py), for routes called many times a second with
    chunk-sized answers. Who may call what is judged the same either way. ``inline``
    is ``def inline(req, **params) -> Response | None``, called from such a thread (a
    thread-served connection of either kind) once the route's entry admitted the peer:
    the answer, served without a trip through the trio loop, or None for the handler
    to answer on the loop. It may only read the daemon's state (and count under a lock),
    never wait on the loop, and must answer as the handler would."""

    method: str
    path: str
    handler: Handler
    who: Caller
    body_limit: int | None = None
    doc: str = ""
    threaded: bool = False
    inline: Callable[..., Response | None] | None = None

    def __post_init__(self) -> None:
        if self.method != self.method.upper():
            raise ValueError(f"route method must be upper case: {self.method!r}")
        if not self.path.startswith("/"):
            raise ValueError(f"route pattern must start with '/': {self.path!r}")
        for seg in self.segments:
            if seg.startswith("{") != seg.endswith("}") or seg == "{}":
                raise ValueError(f"bad parameter segment {seg!r} in {self.path!r}")

    @functools.cached_property
    def segments(self) -> list[str]:
        """Literal text, or "{name}" for a parameter."""
        return self.path.split("/")[1:]

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


@dataclass
class Match:
    """What the router decided for a request line and a peer, before its body is read:
    the route and its parameters, or the error to answer once the body is read."""

    route: Route | None
    params: dict[str, str]
    error: HTTPError | None = None

    def body_limit(self, default: int) -> int:
        """The largest body to read: the route's own limit if the peer may call it."""
        if self.error is None and self.route is not None and self.route.body_limit is not None:
            return self.route.body_limit
        return default


class Router:
    """A route table, and who may call each route.

    ``roles`` says which roles (Caller) a peer holds; ``refusal`` the one line that
    refuses a peer a route it lacks the roles for (403). A route is there for a peer
    only if it names a role of the peer's kind: a local peer finds every route some
    local role may call (and is refused, 403, those its roles do not reach); a remote
    peer finds every route some remote role (a controller, a member) may call and is
    refused those its own roles do not reach (a controller's certificate on a peer
    route, a member's on an admin route: 403); the local-only routes answer it 404 or
    405 as if they did not exist. The defaults give every local peer every local role."""

    def __init__(
        self,
        routes: Iterable[Route] = (),
        *,
        roles: Callable[[Peer], Caller] = _local_or_controller,
        refusal: Callable[[Route, Peer], str] = _plain_refusal,
    ) -> None:
        self._routes: list[Route] = []
        # Routes without parameters by (method, segments): a request for one needs no
        # scan of the table (the chunk routes are asked thousands of times a second).
        self._literal: dict[tuple[str, tuple[str, ...]], Route] = {}
        self.roles = roles
        self.refusal = refusal
        for route in routes:
            self.add_route(route)

    @property
    def routes(self) -> tuple[Route, ...]:
        return tuple(self._routes)

    def add(
        self,
        method: str,
        pattern: str,
        handler: Handler,
        *,
        who: Caller = EVERYONE,
        body_limit: int | None = None,
        threaded: bool = False,
    ) -> None:
        """Add a route (by default, anyone may call it)."""
        self.add_route(Route(method.upper(), pattern, handler, who, body_limit, threaded=threaded))

    def add_route(self, route: Route) -> None:
        if any(r.method == route.method and r.segments == route.segments for r in self._routes):
            raise ValueError(f"duplicate route {route.method} {route.path}")
        self._routes.append(route)
        if not any(seg.startswith("{") for seg in route.segments):
            self._literal[(route.method, tuple(route.segments))] = route

    def match(self, method: str, parts: list[str], peer: Peer) -> Match:
        """The route for decoded path segments and this peer, or the error to answer."""
        roles = self.roles(peer).value  # ints: a Flag operation costs a microsecond
        reach = LOCAL_ROLES.value if peer.remote is None else REMOTE_ROLES.value
        # A route of this method with exactly these literal segments is the most specific
        # match there can be: the scan below would find it too.
        route = self._literal.get((method, tuple(parts)))
        if route is not None and route.who.value & reach:
            if not route.who.value & roles:
                return Match(route, {}, HTTPError(403, self.refusal(route, peer)))
            return Match(route, {})
        matches = [
            (r, p)
            for r in self._routes
            if (p := r.match(parts)) is not None and r.who.value & reach
        ]
        if not matches:
            return Match(None, {}, HTTPError(404, f"no such endpoint: /{'/'.join(parts)}"))
        wanted = [method, "GET"] if method == "HEAD" else [method]
        for want in wanted:
            found = [(r, p) for r, p in matches if r.method == want]
            if found:
                route, params = max(found, key=lambda rp: rp[0].specificity())
                if not route.who.value & roles:
                    return Match(route, params, HTTPError(403, self.refusal(route, peer)))
                return Match(route, params)
        allowed = sorted({r.method for r, _ in matches})
        return Match(None, {}, _MethodNotAllowed(method, allowed))

    async def dispatch(
        self, req: Request, parts: list[str] | None = None, match: Match | None = None
    ) -> Response:
        """Run the matching handler; every failure becomes an error Response.

        ``match`` is what match() decided before the body was read (the server asks it
        first); without it the request is matched here. ``parts`` are the decoded path
        segments from parse_target; without them the decoded path is split, which
        cannot keep an encoded "/" in a param.
        """
        try:
            if match is None:
                if parts is None:
                    parts = req.path.split("/")[1:]
                match = self.match(req.method, parts, req.peer)
            if match.error is not None:
                if match.error.status == 403:  # the route's entry refused this peer
                    log.warning(
                        "refused %s %s from uid %d: %s",
                        req.method,
                        req.path,
                        req.peer.uid,
                        match.error,
                    )
                raise match.error
            assert match.route is not None
            resp = await match.route.handler(req, **match.params)
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
        query = parse_query(raw_query)
    except UnicodeDecodeError:
        raise HTTPError(400, "request target is not valid UTF-8 after percent-decoding") from None
    return path, parts, query


# A run of percent-escapes: decoded together (a UTF-8 character spans several).
_ESCAPES = re.compile(r"(?:%[0-9A-Fa-f]{2})+")


def _decode_escapes(m: re.Match[str]) -> str:
    return bytes.fromhex(m.group().replace("%", "")).decode("utf-8", "strict")


# Escaped texts decoded before: a chunk request carries the same escaped fields (a
# content id's quotes, a dataset URI) as the last; at most _MAX_UNQUOTED of them, each of
# at most _MEMO_CHARS (any peer's request lands here: its memory stays bounded),
# forgotten all at once when full. Only texts that decoded are kept.
_UNQUOTED: dict[str, str] = {}
_MAX_UNQUOTED = 4096
_MEMO_CHARS = 256


def _unquote(text: str) -> str:
    """urllib.parse.unquote(text, errors="strict"), in one regex pass: a chunk request
    carries several escaped fields, and the general decoder costs more than the rest of
    its parsing. UnicodeDecodeError for escapes that are not UTF-8."""
    if "%" not in text:
        return text
    decoded = _UNQUOTED.get(text)
    if decoded is None:
        decoded = _ESCAPES.sub(_decode_escapes, text)
        if len(text) <= _MEMO_CHARS:
            if len(_UNQUOTED) >= _MAX_UNQUOTED:
                _UNQUOTED.clear()
            _UNQUOTED[text] = decoded
    return decoded


def parse_query(raw: str) -> dict[str, str]:
    """dict(urllib.parse.parse_qsl(raw, keep_blank_values=True, errors="strict")): "+"
    is a space, a field without "=" has the empty value, the last of a repeated name
    wins. UnicodeDecodeError for escapes that are not UTF-8."""
    query: dict[str, str] = {}
    plus, escaped = "+" in raw, "%" in raw  # looked for once, not in every field
    for part in raw.split("&"):
        if part:
            name, _, value = part.partition("=")
            if plus:
                name, value = name.replace("+", " "), value.replace("+", " ")
            if escaped:
                name, value = _unquote(name), _unquote(value)
            query[name] = value
    return query
