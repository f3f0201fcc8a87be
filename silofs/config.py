"""Typed settings for the node daemon and for one mount, from TOML and flags.

Owns defaults, the config file grammar (configs/silofs.toml documents every key), and
validation into one-line UsageErrors. Never starts anything and never touches the cache.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import tomllib
from dataclasses import dataclass, field

from silofs.errors import UsageError
from silofs.units import parse_rate, parse_size
from silofs.uri import check_endpoint


def default_socket() -> str:
    if env := os.environ.get("SILOFS_SOCKET"):
        return env
    if os.geteuid() == 0:
        return "/run/silofs/control.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/silofs-{os.geteuid()}"
    return os.path.join(runtime, "silofs", "control.sock")


def socket_arg(value: str | None) -> str | None:
    """A --socket as typed: None (not given: default_socket()), else the address. An
    empty one is a UsageError: `--socket ""` (a variable that was not set) was taken as
    not given, and the command talked to the default daemon, which may be another one.
    An empty SILOFS_SOCKET is not given, as for any unset variable."""
    if value is not None and not value.strip():
        raise UsageError(
            f"--socket is empty: give the daemon's control socket, or leave --socket out "
            f"for the default ({default_socket()})"
        )
    return value


def default_cache_dir() -> str:
    return _per_user_dir("SILOFS_CACHE_DIR", "/var/cache/silofs", "XDG_CACHE_HOME", "~/.cache")


def default_log_dir() -> str:
    """Where background daemons and mounts write their logs."""
    return _per_user_dir("SILOFS_LOG_DIR", "/var/log/silofs", "XDG_STATE_HOME", "~/.local/state")


def _per_user_dir(env: str, for_root: str, xdg: str, xdg_default: str) -> str:
    """$env if set; `for_root` for root; else silofs/ under $xdg (or `xdg_default`)."""
    if value := os.environ.get(env):
        return value
    if os.geteuid() == 0:
        return for_root
    base = os.environ.get(xdg) or os.path.expanduser(xdg_default)
    return os.path.join(base, "silofs")


@dataclass(frozen=True)
class MemberSpec:
    """One member of a cluster: its TLS listener's address, canonical
    ("tls://host:port", host lower-cased), and its cache weight."""

    address: str
    weight: float = 1.0


@dataclass(frozen=True)
class ClusterSettings:
    """[cluster]: this node's cluster (docs/ARCHITECTURE.md "One cache across nodes").
    The member list may be replaced at runtime (PUT /v1/cluster); `version` orders the
    lists (the newest wins): a pushed list carries the pusher's, the file's is its
    modification time (microseconds since the epoch)."""

    name: str
    members: tuple[MemberSpec, ...]
    # This node as the others reach it (one of members); None: the member whose port is
    # tcp_listen's and whose host is one of this node's certificate names.
    address: str | None = None
    version: int = 0
    peer_timeout_seconds: float = 2.0  # connect, TLS handshake, first byte (a 102 counts)
    peer_backoff_seconds: float = 1.0  # a failed member is down this long, doubling to 60 s
    peer_serve_rate: int | None = None  # bytes/s served to peers at most; None: unlimited
    peer_floor_rate: int = 1 << 20  # a peer's body must arrive at least this fast
    keep_peer_copies: bool = False  # also admit peer-served chunks here


@dataclass
class NodeSettings:
    """[daemon] and [backend] sections of silofs.toml."""

    socket: str = field(default_factory=default_socket)
    socket_mode: int = 0o666  # anyone may read status; changes are checked by peer creds
    socket_group: str | None = None  # group owning the socket file
    admin_group: str | None = None  # members may change allocations (root always may)
    cache_dir: str = field(default_factory=default_cache_dir)
    cache_size: int | None = None  # None: 10 GiB, or half the free disk if less
    chunk_size: int = 4 << 20
    # Concurrent remote GETs of one dataset (all its jobs together); the Fetcher keeps a
    # quarter more for the other datasets (node/fetch.py spare_threads). Listings and
    # checks take their threads from the same pool.
    fetch_threads: int = 16
    # Prefetch by hint (node/prefetch.py): bytes fetched ahead of a mount's reader, at
    # most; a hint may ask for less.
    prefetch_window: int = 256 << 20
    writer_batch_bytes: int = 32 << 20
    writer_batch_seconds: float = 0.05
    admission_queue_bytes: int = 256 << 20
    sync_seconds: float = 5.0
    log_level: str = "info"
    log_file: str | None = None  # reopened when logrotate moves it, and on SIGHUP
    log_format: str = "text"  # text | json (one object per line)
    sdk_log_level: str = "warning"  # the store SDKs' loggers (azure, botocore, google, ...)
    # Exit once no mount (nor warm, nor listing) has used the daemon for this long;
    # None: never. `silofs mount` starts its default daemon with 300 s; a daemon run
    # under systemd never exits idle whatever this says (systemd restarts it on failure
    # and would see an idle exit as one).
    idle_exit_seconds: float | None = None
    # Prometheus scrapes over TCP: "127.0.0.1:9464" (or ":9464", localhost). None: only
    # GET /metrics on the control socket.
    metrics_address: str | None = None
    # backend
    endpoint_url: str | None = None
    connect_timeout: float = 10.0
    read_timeout: float = 30.0
    max_attempts: int = 5
    read_deadline: float = 60.0  # no retry of a store read past this (BackendOptions)
    page_size: int = 1000
    list_workers: int = 32  # prefixes listed at once (stores with delimiter listings)
    backend_extra: dict[str, str] = field(default_factory=dict)
    # [limits]: what one non-admin uid may hold at once (docs/SECURITY.md); root and the
    # admin group are exempt. max_connections caps everyone's connections together
    # (root and admins get ADMIN_CONNECTION_RESERVE more, so status still answers).
    max_datasets_per_uid: int = 64
    max_mounts_per_uid: int = 256
    max_jobs_per_uid: int = 256
    max_connections_per_uid: int = 128  # a mount process keeps up to 32
    max_connections: int = 1024
    # A refresh (a new listing of the whole prefix: LIST requests, and the generation
    # before it dropped under other users' open files) asked by a caller other than
    # root or the daemon's uid, of a dataset whose last listing finished less than this
    # many seconds ago, is refused (429); a mount asking it mounts the current listing.
    # 0: no interval.
    min_refresh_seconds: float = 30.0
    # [access]: cloud URI prefix -> groups whose members may open datasets under it
    # ("*": every local user). Root and the admin group may open any dataset.
    access: dict[str, list[str]] = field(default_factory=dict)
    # [control]: the optional TCP listener for remote controllers, mutual TLS only (off
    # unless tcp_listen is set; docs/SECURITY.md "Remote controllers"). A client must
    # present a certificate tls_client_ca issued for client auth; it then has the
    # admin role on the admin routes only, never a local uid.
    tcp_listen: str | None = None  # "0.0.0.0:7470", "[::]:7470", "10.0.0.5:7470"
    tls_cert: str | None = None  # this node's certificate (PEM), chain after it
    tls_key: str | None = None
    tls_client_ca: str | None = None  # the CA whose client certificates are admins
    tls_client_names: list[str] = field(default_factory=list)  # allowed CNs; []: any
    tcp_max_connections: int = 64  # open at once, handshakes included
    tls_handshake_seconds: float = 10.0  # a client that takes longer is closed
    tls_handshakes_per_second: float = 20.0  # new connections beyond: closed at accept
    # [cluster]: one cache across the nodes named there (None: this node stands alone).
    cluster: ClusterSettings | None = None


@dataclass
class MountSettings:
    uri: str
    mountpoint: str
    job: str
    chunk_size: int | None = None  # None: the daemon's default
    allow_other: bool = False
    allow_root: bool = False
    uid: int = field(default_factory=os.getuid)
    gid: int = field(default_factory=os.getgid)
    file_mode: int = 0o444
    dir_mode: int = 0o555
    refresh: bool = False
    # The longest read-ahead span of a sequentially read file (mount/reader.py: the
    # window starts at one chunk and doubles); 0: none.
    readahead_bytes: int = 16 << 20
    # Fetched chunks held in the mount process (not admitted); None: what read-ahead
    # needs (mount/reader.py buffer_bytes_for), not a flat size. SILOFS_BUFFER_BYTES sets
    # it: bench/silod_live.py makes it what a job's readers have in flight, so that it is
    # not a second, private cache that the controller cannot see.
    buffer_bytes: int | None = field(
        default_factory=lambda: (
            parse_size(v) if (v := os.environ.get("SILOFS_BUFFER_BYTES")) else None
        )
    )
    read_ahead_kb: int = 1024  # bdi read-ahead: 1 MiB kernel read requests
    attr_timeout: float = 3600.0  # kernel entry/attr cache when the metadata TTL is indefinite
    # Seconds a listing is trusted before the mount asks the daemon to list again, and
    # the kernel's entry/attr timeouts; None ("indefinite"): only `--refresh` or
    # `silofs-ctl refresh` list again.
    metadata_ttl: float | None = None
    # Mount while the first listing is still being written; lookups of names not listed
    # yet wait for the listing instead of failing.
    list_in_background: bool = False
    io_limit: int | None = None
    endpoint_url: str | None = None
    admission: str | None = None  # None: keep the dataset's mode (default uniform)
    # Per-dataset store options (STORE_OPTIONS), used when the daemon opens the dataset.
    store_options: dict[str, str] = field(default_factory=dict)
    # The dataset `silofs mount` already opened and waited for: the mount process
    # registers against it instead of opening it a second time.
    dataset_id: int | None = None
    # Processes serving the one FUSE connection (mount/forked.py): 1 is one pyfuse3
    # process (the default); N > 1 forks N serving processes after INIT, for many readers.
    serve_processes: int = 1
    # The longest silence the mount accepts from the daemon after a request (seconds).
    # The daemon sends "102 Processing" while it works on one, so only a frozen
    # daemon hits it: an uncached read then fails with EIO. SILOFS_DAEMON_TIMEOUT sets it.
    daemon_timeout: float = field(
        default_factory=lambda: _daemon_timeout(os.environ.get("SILOFS_DAEMON_TIMEOUT", "30"))
    )


# Store options a mount may set for its dataset (POST /v1/datasets "options"); they go
# into the backend's BackendOptions.extra for that dataset only.
STORE_OPTIONS = ("region", "profile", "requester_pays", "anonymous", "credential")

_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_SIZE_KEYS = {
    "cache_size",
    "chunk_size",
    "writer_batch_bytes",
    "admission_queue_bytes",
    "prefetch_window",
}
_SECTIONS = {"daemon", "backend", "limits", "access", "control", "cluster"}
_CONTROL_KEYS = {
    "tcp_listen",
    "tls_cert",
    "tls_key",
    "tls_client_ca",
    "tls_client_names",
    "tcp_max_connections",
    "tls_handshake_seconds",
    "tls_handshakes_per_second",
}
_LIMIT_KEYS = {
    "max_datasets_per_uid",
    "max_mounts_per_uid",
    "max_jobs_per_uid",
    "max_connections_per_uid",
    "max_connections",
    "min_refresh_seconds",
}
_BACKEND_KEYS = {
    "endpoint_url",
    "connect_timeout",
    "read_timeout",
    "max_attempts",
    "read_deadline",
    "page_size",
    "list_workers",
    "backend_extra",
}


def _section_of(key: str) -> str:
    if key in _LIMIT_KEYS:
        return "limits"
    if key in _CONTROL_KEYS:
        return "control"
    return "backend" if key in _BACKEND_KEYS else "daemon"


def _convert(name: str, value: object, kind: type | str) -> object:
    """`value` as the type of setting `name` (declared `kind`), or a UsageError naming it."""
    try:
        return _typed(name, value, str(kind).replace(" | None", ""))
    except UsageError as exc:
        raise UsageError(f"{name}: {exc}") from None


def _typed(name: str, value: object, kind: str) -> object:
    if name in _SIZE_KEYS:
        return parse_size(value)  # type: ignore[arg-type]
    if name == "socket_mode":
        return _mode(value)
    if name == "access":
        if not isinstance(value, dict):
            raise UsageError('must be a table, like { "s3://public/" = ["ml-users"] }')
        return _access(value)
    if name == "tls_client_names":
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise UsageError('must be a list of certificate names, like ["silofs-controller"]')
        return list(value)
    if name == "backend_extra":
        if not isinstance(value, dict):
            raise UsageError('must be a table, like { region = "eu-west-1" }')
        if any(isinstance(v, dict | list) for v in value.values()):
            raise UsageError("values must be strings or numbers")
        return {str(k): str(v) for k, v in value.items()}
    # TOML has its own types; a value of the wrong one would only fail later, in the
    # daemon, as a TypeError. bool is an int in Python, never in a config file.
    if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        raise UsageError(f"must be a whole number, not {value!r}")
    if kind == "float":
        # TOML writes nan and inf: neither is a number of seconds or a rate (a sleep of
        # nan failed the writer's sync loop for good).
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise UsageError(f"must be a number, not {value!r}")
        if not math.isfinite(value):
            raise UsageError(f"must be a finite number, not {value!r}")
        return float(value)
    if kind == "str" and not isinstance(value, str):
        raise UsageError(f"must be a string, not {value!r}")
    return value


def _daemon_timeout(text: str) -> float:
    """SILOFS_DAEMON_TIMEOUT: the silence a mount accepts from the daemon, in seconds."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= 86400:
        raise UsageError(
            f"SILOFS_DAEMON_TIMEOUT must be a number of seconds above 0 (at most 86400), "
            f"not {text!r}"
        )
    return seconds


def _access(table: dict) -> dict[str, list[str]]:
    """[access]: "scheme://bucket/prefix/" = ["group", ...]. Prefixes are matched against
    canonical URIs as text, so each must be one (ending in "/"): "s3://public" would
    also match "s3://public-private/"."""
    from silofs.uri import parse_uri  # config stays importable without the URI grammar

    out: dict[str, list[str]] = {}
    for prefix, groups in table.items():
        if not isinstance(groups, list) or not all(isinstance(g, str) and g for g in groups):
            raise UsageError(f'{prefix!r} must name a list of groups, like ["ml-users"]')
        try:
            uri = parse_uri(prefix)
        except UsageError as exc:
            raise UsageError(f"{prefix!r}: {exc}") from None
        if uri.scheme == "file":
            raise UsageError(
                f"{prefix!r}: local datasets are checked per file as the user, not listed here"
            )
        if uri.canonical != prefix:
            raise UsageError(f"{prefix!r} must be written as its canonical URI {uri.canonical!r}")
        out[prefix] = list(groups)
    return out


_CLUSTER_KEYS = {f.name for f in dataclasses.fields(ClusterSettings)} - {"version"}
# A node's peer settings: a member list pushed without one of them keeps the node's
# value in force (a push names the members; a node's serve cap is its own).
PEER_KEYS = (
    "peer_timeout_seconds",
    "peer_backoff_seconds",
    "peer_serve_rate",
    "peer_floor_rate",
    "keep_peer_copies",
)
# A cluster's name travels in a header (x-silofs-cluster, on every peer request: HTTP
# header values are ASCII, a request with another character cannot be sent) and names it
# in status: short, printable ASCII, no space.
_CLUSTER_NAME_MAX = 64
# What a read may wait on a member that does not answer (docs/SEMANTICS.md "No read
# waits on a dead member"): its first byte at most this long, its body at least this
# fast. A member list pushed with 600 s or 1 B/s would hold reads for minutes or days.
MAX_PEER_TIMEOUT = 30
MIN_PEER_FLOOR_RATE = 64 << 10


def parse_cluster(table: dict, version: int = 0, *, typed: bool = False) -> ClusterSettings:
    """[cluster] (or the body of a member list pushed at runtime) as ClusterSettings;
    UsageError naming the key otherwise. `typed`: written by a person (silofs.toml), whose
    rates need a unit as everywhere people type them ("100" is 100 B/s to us, 100 Mbit/s
    to a JuiceFS user); a pushed body's JSON may carry plain integers (bytes/s)."""
    unknown = sorted(set(table) - _CLUSTER_KEYS)
    if unknown:
        raise UsageError(f"unknown key {unknown[0]!r}")
    for key in ("name", "members"):
        if key not in table:
            raise UsageError(f"{key!r} is missing")
    out: dict[str, object] = {"version": version}
    for key, value in table.items():
        out[key] = _cluster_value(key, value, typed)
    settings = ClusterSettings(**out)  # type: ignore[arg-type]
    if settings.address is not None and settings.address not in member_addresses(settings):
        raise UsageError(f"address {settings.address!r} is not one of the members")
    return settings


def member_addresses(c: ClusterSettings) -> list[str]:
    return [m.address for m in c.members]


def _cluster_value(key: str, value: object, typed: bool = False) -> object:
    if key == "name":
        if (
            not isinstance(value, str)
            or not value
            or len(value) > _CLUSTER_NAME_MAX
            or not value.isascii()
            or not value.isprintable()
            or any(c.isspace() for c in value)
        ):
            raise UsageError(
                f"name must be 1-{_CLUSTER_NAME_MAX} printable ASCII characters without spaces"
            )
        return value
    if key == "members":
        return _members(value)
    if key == "address":
        if not isinstance(value, str):
            raise UsageError('address must be a string like "tls://gpu01:7470"')
        return canonical_member(value)
    if key == "keep_peer_copies":
        if not isinstance(value, bool):
            raise UsageError("keep_peer_copies must be true or false")
        return value
    if key in ("peer_serve_rate", "peer_floor_rate"):
        try:
            rate = parse_rate(value, require_unit=typed)  # type: ignore[arg-type]
        except UsageError as exc:
            raise UsageError(f"{key}: {exc}") from None
        if key == "peer_floor_rate" and (not rate or rate < MIN_PEER_FLOOR_RATE):
            raise UsageError('peer_floor_rate must be a rate of at least 64KiB/s, like "1MiB/s"')
        if key == "peer_serve_rate" and rate == 0:
            raise UsageError('peer_serve_rate must be above 0 (or "unlimited")')
        return rate
    # peer_timeout_seconds, peer_backoff_seconds
    most = MAX_PEER_TIMEOUT if key == "peer_timeout_seconds" else 600
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= most:
        raise UsageError(f"{key} must be a number of seconds above 0 (at most {most})")
    return float(value)


def canonical_member(text: str) -> str:
    """A member address in its canonical form, "tls://host:port"; UsageError otherwise."""
    from silofs.control.tls import parse_tls_url, tls_url

    if not text.startswith("tls://"):
        raise UsageError(f"member {text!r} must be written tls://HOST:PORT")
    try:
        host, port = parse_tls_url(text)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    # 0.0.0.0 and :: are tcp_listen's "every interface", never a node another reaches:
    # connected to, they are the asker's own host, so on every node such a member was
    # that node itself under another name (refused 403 by its own listener, down, yet
    # holding its weight's part of every share, so the cluster cached less).
    try:
        unspecified = ipaddress.ip_address(host).is_unspecified
    except ValueError:
        unspecified = False
    if unspecified:
        raise UsageError(
            f"member {text!r}: {host} is every interface of a listener, not a node's address "
            "(name the node as the others reach it)"
        )
    return tls_url(host, port)


def _members(value: object) -> tuple[MemberSpec, ...]:
    """members = ["tls://a:7470", { address = "tls://b:7470", weight = 2.0 }, ...]."""
    if not isinstance(value, list) or not value:
        raise UsageError('members must be a non-empty list, like ["tls://gpu01:7470", ...]')
    out: list[MemberSpec] = []
    for item in value:
        weight: object = 1.0
        if isinstance(item, dict):
            extra = sorted(set(item) - {"address", "weight"})
            if extra or "address" not in item:
                raise UsageError('a member table is { address = "tls://HOST:PORT", weight = 1.0 }')
            address, weight = item["address"], item.get("weight", 1.0)
        else:
            address = item
        if not isinstance(address, str):
            raise UsageError(f"member {address!r} must be a string tls://HOST:PORT")
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < 1e6:
            raise UsageError(f"the weight of {address} must be a number above 0")
        out.append(MemberSpec(canonical_member(address), float(weight)))
    seen: set[str] = set()
    for m in out:
        if m.address in seen:
            raise UsageError(f"member {m.address} is listed twice")
        seen.add(m.address)
    if len(out) > MAX_MEMBERS:
        raise UsageError(f"a cluster has at most {MAX_MEMBERS} members, not {len(out)}")
    return tuple(out)


MAX_MEMBERS = 1024


def _mtime_us(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns // 1000
    except OSError:
        return 0


def _mode(value: object) -> int:
    """A permission mode: an octal string ("0660"), or a TOML integer (0o660)."""
    mode: int | None = None
    if isinstance(value, str):
        try:
            mode = int(value.strip(), 8)
        except ValueError:
            mode = None
    elif isinstance(value, int) and not isinstance(value, bool):
        mode = value
    # 660 written as a decimal integer is 0o1224: refuse it rather than guess.
    if mode is None or not 0 <= mode <= 0o777:
        raise UsageError(f'must be an octal permission mode like "0660", not {value!r}')
    return mode


def load_node_settings(path: str | None, **overrides: object) -> NodeSettings:
    """Settings from the TOML file at `path` (if any), then non-None overrides."""
    values: dict[str, object] = {}
    if path:
        try:
            with open(path, "rb") as f:
                doc = tomllib.load(f)
        except FileNotFoundError:
            raise UsageError(f"config file {path} does not exist") from None
        except OSError as exc:  # a directory, no permission, an I/O error
            raise UsageError(f"cannot read config file {path}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise UsageError(f"config file {path} is not UTF-8 text ({exc.reason})") from None
        except tomllib.TOMLDecodeError as exc:
            raise UsageError(f"config file {path}: {exc}") from None
        known = {f.name: f.type for f in dataclasses.fields(NodeSettings)}
        for section, table in doc.items():
            if not isinstance(table, dict):
                if section in known:
                    raise UsageError(
                        f"config file {path}: key {section!r} must be in a section: "
                        f"put it under [{_section_of(section)}]"
                    )
                raise UsageError(f"config file {path}: unknown key {section!r} outside a section")
            if section not in _SECTIONS:
                raise UsageError(f"config file {path}: unknown section [{section}]")
            if section == "access":
                try:
                    values["access"] = _access(table)
                except UsageError as exc:
                    raise UsageError(f"config file {path}: [access] {exc}") from None
                continue
            if section == "cluster":
                try:
                    values["cluster"] = parse_cluster(table, version=_mtime_us(path), typed=True)
                except UsageError as exc:
                    raise UsageError(f"config file {path}: [cluster] {exc}") from None
                continue
            for key, value in table.items():
                if key not in known:
                    raise UsageError(f"config file {path}: unknown key {key!r} in [{section}]")
                if _section_of(key) != section:
                    raise UsageError(
                        f"config file {path}: key {key!r} belongs in [{_section_of(key)}], "
                        f"not [{section}]"
                    )
                try:
                    values[key] = _convert(key, value, known[key])
                except UsageError as exc:
                    raise UsageError(f"config file {path}: {exc}") from None
    known = {f.name: f.type for f in dataclasses.fields(NodeSettings)}
    for key, value in overrides.items():
        if value is not None:
            values[key] = _convert(key, value, known.get(key, "object"))
    settings = NodeSettings(**values)  # type: ignore[arg-type]
    _validate(settings)
    return settings


def _validate(s: NodeSettings) -> None:
    if s.endpoint_url:
        check_endpoint(s.endpoint_url, "endpoint_url")
    if s.chunk_size < 64 << 10 or s.chunk_size > 64 << 20:
        raise UsageError("chunk_size must be between 64KiB and 64MiB")
    if s.cache_size is not None and s.cache_size < s.chunk_size:
        raise UsageError("cache_size must be at least one chunk")
    if s.fetch_threads < 1:
        raise UsageError("fetch_threads must be at least 1")
    if s.prefetch_window < 0:
        raise UsageError("prefetch_window must be 0 (no prefetch by hint) or more")
    # A queue smaller than one encoded chunk (data + header) drops every admission.
    if s.admission_queue_bytes < s.chunk_size + (64 << 10):
        raise UsageError("admission_queue_bytes must hold at least one chunk (chunk_size)")
    if s.sync_seconds <= 0:
        raise UsageError("sync_seconds must be more than 0")  # 0: the writer syncs nonstop
    if s.writer_batch_seconds < 0:
        raise UsageError("writer_batch_seconds must not be negative")
    for name in ("log_level", "sdk_log_level"):
        if getattr(s, name).lower() not in _LOG_LEVELS:
            raise UsageError(
                f"{name} must be one of {', '.join(_LOG_LEVELS)}, not {getattr(s, name)!r}"
            )
    if s.log_format not in ("text", "json"):
        raise UsageError(f"log_format must be text or json, not {s.log_format!r}")
    if s.max_attempts < 1:
        raise UsageError("max_attempts must be at least 1")
    if s.page_size < 1:
        raise UsageError("page_size must be at least 1")
    if not 1 <= s.list_workers <= 256:
        raise UsageError("list_workers must be between 1 and 256")
    if s.idle_exit_seconds is not None and s.idle_exit_seconds <= 0:
        raise UsageError("idle_exit_seconds must be more than 0 (leave it out: never)")
    for name in ("connect_timeout", "read_timeout", "read_deadline"):
        if getattr(s, name) <= 0:
            raise UsageError(f"{name} must be more than 0 seconds")
    for name in sorted(_LIMIT_KEYS - {"min_refresh_seconds"}):
        if getattr(s, name) < 1:
            raise UsageError(f"{name} must be at least 1")
    if not 0 <= s.min_refresh_seconds <= 86400:
        raise UsageError("min_refresh_seconds must be between 0 (no interval) and 86400")
    _validate_control(s)
    _validate_cluster(s)


def _validate_cluster(s: NodeSettings) -> None:
    """[cluster] needs the mutual-TLS listener: members reach each other through it."""
    if s.cluster is None:
        return
    missing = [
        k for k in ("tcp_listen", "tls_cert", "tls_key", "tls_client_ca") if not getattr(s, k)
    ]
    if missing:
        raise UsageError(
            f"[cluster] needs {', '.join(missing)} in [control]: members reach each other "
            "over the mutual-TLS listener (`silofs-ctl certs node` makes this node's "
            "certificate)"
        )


def _validate_control(s: NodeSettings) -> None:
    """[control]: TLS files are required with tcp_listen (there is no plaintext TCP)."""
    if s.tcp_max_connections < 1:
        raise UsageError("tcp_max_connections must be at least 1")
    if not s.tls_handshake_seconds > 0:
        raise UsageError("tls_handshake_seconds must be more than 0")
    if not s.tls_handshakes_per_second >= 1:
        raise UsageError("tls_handshakes_per_second must be at least 1")
    if s.tcp_listen is None:
        return
    from silofs.control.tls import parse_tcp_address

    parse_tcp_address(s.tcp_listen)
    missing = [k for k in ("tls_cert", "tls_key", "tls_client_ca") if not getattr(s, k)]
    if missing:
        raise UsageError(
            f"tcp_listen needs {', '.join(missing)} in [control]: the TCP listener is "
            "mutual TLS only (`silofs-ctl certs init` makes a CA and certificates)"
        )


# Environment variables the store SDKs take credentials (or the identity to use) from.
# The daemon reads them once, at start; a mount's environment never reaches it.
CREDENTIAL_ENV = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CONFIG_FILE",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_CLIENT_ID",
    "AZURE_TENANT_ID",
    "AZURE_CLIENT_SECRET",
    "GOOGLE_APPLICATION_CREDENTIALS",
)


def credential_fingerprint(env: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """Which credential variables are set, each with 8 hex digits of its value's hash:
    enough for `silofs mount` to tell that its environment differs from the daemon's,
    and published in status without giving a secret away (32 bits of a hash)."""
    import hashlib

    return {
        name: hashlib.sha256(env[name].encode("utf-8", "surrogateescape")).hexdigest()[:8]
        for name in CREDENTIAL_ENV
        if env.get(name)
    }


def parse_io_limit(text: str | None) -> int | None:
    return None if text is None else parse_rate(text)
