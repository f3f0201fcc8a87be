"""`silofs-ctl status`, `allocate-cache`, `allocate-io`, `admission`, `refresh`: one node
by hand.

Owns the operator's view of one node daemon through its control socket (SiloD's Table 3
API: allocateCacheSize(dataset, size), allocateRemoteIO(job, rate)). Talks to the daemon
only through the control API; never touches the cache or the mounts directly.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import time
from typing import Any

import click

from silofs.config import default_socket, socket_arg
from silofs.control.client import ControlError, quote_segment
from silofs.errors import UsageError
from silofs.records import job_name_error, not_utf8, shown_all
from silofs.units import (
    count,
    format_duration,
    format_rate,
    format_size,
    parse_rate,
    parse_size,
)

from .nodes import SOCKET_HELP, one_node_client

SLOW_CHUNK_SECONDS = 60  # allocate-io says so when one chunk's miss waits longer

log = logging.getLogger(__name__)


def _socket(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    try:
        return socket_arg(value)
    except UsageError as exc:  # at parse time: click's kind, exit 2 in one line
        raise click.UsageError(str(exc), ctx) from None


# Every command's --socket: an empty one is a usage error (socket_arg), not the default.
socket_option = click.option(
    "--socket",
    default=None,
    envvar="SILOFS_SOCKET",
    help=SOCKET_HELP,
    callback=_socket,
)


def _call(socket: str | None, method: str, path: str, body: dict | None = None) -> Any:
    try:
        with one_node_client(socket or default_socket()) as client:
            return client.request(method, path, body)
    except ControlError as exc:
        raise click.ClickException(str(exc)) from None


def dataset_arg(name: str) -> str:
    """A DATASET argument as the daemon should see it: a URI or short name as typed, a
    local path made absolute here (the daemon does not know our working directory).
    UsageError for a name that is not UTF-8 (a path with bytes a shell passed as they
    are): quoting it for the URL raised UnicodeEncodeError, a traceback; no dataset is
    named so (the daemon takes UTF-8 names only)."""
    if not name:
        # refresh '' asked GET /v1/datasets/ and said "no such endpoint".
        raise UsageError("DATASET is empty: give a dataset's URI, local path or short name")
    if (typed := not_utf8(name)) is not None:
        raise UsageError(f"DATASET '{typed}' is not UTF-8 text: silofs names datasets in UTF-8")
    if "://" in name or not (name.startswith((".", "~")) or "/" in name):
        return name
    return os.path.abspath(os.path.expanduser(name))


def job_arg(name: str) -> str:
    """A JOB argument, checked against the daemon's job name grammar here: the daemon's
    400 would state the rule without saying which argument broke it (`forget data/`
    used to answer only the rule). UsageError naming what was typed otherwise."""
    why = job_name_error(name)
    if why is not None:
        raise UsageError(f"JOB {name!r} is not a job name ({why})")
    return name


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
    return "\n".join(lines)


def render_status(answer: dict) -> str:
    """The status answer as text. Every string in it is shown() first: a dataset URI,
    a mountpoint or an error holding ESC, a newline or a bidi override prints as its
    escape, never as a terminal command or a row of its own."""
    s = shown_all(answer)
    node = s["node"]
    out = [
        f"node: cache {format_size(node['cached_bytes'])} of "
        f"{format_size(node['cache_size'])} in {node['cache_dir']}"
    ]
    if "started_by" in node:
        idle = node.get("idle_exit_seconds")
        out.append(
            f"daemon: pid {node['pid']}, started by {node['started_by']} "
            f"(uid {node.get('started_by_uid')})"
            + (f", exits {idle:g}s after its last mount" if idle else "")
        )
    error = node.get("writer", {}).get("error")
    if error:
        out.append(f"cache: the last admission failed: {error} (see the daemon's log)")
    ds_rows = [
        [
            d["name"],
            d["uri"],
            format_size(d["size"]),
            str(d["objects"]),
            format_size(d["cached_bytes"]),
            "shared" if d["cache_allocation"] is None else format_size(d["cache_allocation"]),
            d.get("admission", "uniform"),
            _pct(d["hit_ratio"]),
        ]
        for d in s["datasets"]
    ]
    out += [
        "",
        "datasets:",
        _table(
            ds_rows,
            ["name", "uri", "size", "objects", "cached", "allocation", "admission", "hit ratio"],
        ),
    ]
    for d in s["datasets"]:
        if d.get("state") == "error" or d.get("error"):
            out.append(f"  {d['name']}: error: {d.get('error') or 'unknown'}")
        elif d.get("state") == "listing":
            # Progress of a listing: objects so far and the rate since it began.
            out.append(
                f"  {d['name']}: listing, "
                f"{count(d.get('listed', 0), 'object', grouped=True)} listed "
                f"({d.get('list_rate') or 0:,.0f}/s)"
            )
        elif d.get("state") not in (None, "ready"):
            out.append(f"  {d['name']}: {d['state']}")
        for key in ("store_errors", "store_retries"):
            if d.get(key):
                out.append(f"  {d['name']}: {key.replace('_', ' ')}: {d[key]}")
        w = d.get("warm")
        if w:
            out.append(
                f"  {d['name']}: warm {w['state']}, {format_size(w['done_bytes'])} of "
                f"{format_size(w['target_bytes'])} (job {w['job']})"
            )
    out += _waiting_allocations(s.get("waiting_allocations") or {})
    job_rows = [
        [
            j["name"],
            format_rate(j["io_allocation"]),
            format_rate(j["throughput"]),
            format_rate(j["remote_bytes_per_s"]),
            _pct(j["hit_ratio"]),
            f"{j['limiter_wait_s']:.1f}s",
            _waiting(j),
            format_size(j["effective_cache"]),
            str(j["epoch"]),
        ]
        for j in s["jobs"]
    ]
    out += [
        "",
        "jobs:",
        _table(
            job_rows,
            [
                "job",
                "io allocation",
                "throughput",
                "remote",
                "hit ratio",
                "limiter wait",
                "waiting",
                "effective cache",
                "epoch",
            ],
        ),
    ]
    m_rows = [
        [
            m["job"],
            m["mountpoint"],
            format_size(m["bytes_read"]),
            *(
                format_size(m.get("served_bytes", {}).get(k, 0))
                for k in ("cache", "buffer", "store")
            ),
            _pct(m["hit_ratio"]),
            format_size(m["remote_bytes"]),
        ]
        for m in s["mounts"]
    ]
    out += [
        "",
        "mounts:",
        _table(
            m_rows,
            [
                "job",
                "mountpoint",
                "read",
                "from cache",
                "from buffer",
                "from store",
                "hit ratio",
                "remote",
            ],
        ),  # fmt: skip
    ]
    if c := s.get("cluster"):
        down = [m["address"] for m in c["members"] if m["state"] == "down"]
        out += [
            "",
            f"cluster {c['name']}: this node {c['address']}, {count(len(c['members']), 'member')}"
            + (f", down: {', '.join(down)}" if down else ", all up")
            + " (silofs-ctl cluster status for more)",
        ]
    if note := node.get("note"):
        out += ["", f"note: {note}"]
    return "\n".join(out)


@click.command()
@socket_option
@click.option("--json", "as_json", is_flag=True, help="The daemon's answer as JSON.")
def status(socket: str | None, as_json: bool) -> None:
    """Datasets, jobs and mounts of a node: sizes, cache, hit ratios, rates."""
    s = _call(socket, "GET", "/v1/status")
    click.echo(json.dumps(s, indent=2) if as_json else render_status(s))


@click.command("allocate-cache")
@click.argument("dataset")
@click.argument("size")
@click.option(
    "--create",
    is_flag=True,
    help="DATASET is not on this node yet (it will be mounted): allocate anyway.",
)
@socket_option
def allocate_cache(dataset: str, size: str, create: bool, socket: str | None) -> None:
    """Give DATASET (its URI or short name) SIZE bytes of cache (e.g. 200G, 1.5GiB, or
    'none' to return it to the shared pool; a bare number is whole bytes).

    DATASET must be one the node knows (opened, or holding an allocation) unless
    --create says it will be mounted, so a mistyped URI is an error rather than an
    allocation that waits forever."""
    try:
        nbytes = None if size.lower() in ("none", "shared") else parse_size(size)
    except UsageError as exc:
        raise click.BadParameter(str(exc), param_hint="SIZE") from None
    name = quote_segment(dataset_arg(dataset))
    if not create:
        _require_known_dataset(socket, name, dataset)
    ans = shown_all(_call(socket, "PUT", f"/v1/datasets/{name}/cache", {"bytes": nbytes}))
    shown = "the shared pool" if ans["bytes"] is None else format_size(ans["bytes"])
    click.echo(f"{ans['dataset']}: cache allocation {shown}")
    if create and ans["bytes"] is not None and not _has_row(socket, name):
        click.echo(
            "  not opened on this node yet: kept for it, and counted in the cache's sum "
            "now (status lists it; `silofs-ctl forget` drops it)"
        )
    for member, why in sorted((ans.get("members_not_reached") or {}).items()):
        click.echo(f"  not yet on member {member} ({why}): it takes the share once reachable")


def _has_row(socket: str | None, quoted: str) -> bool:
    """Whether the node has a row (opened) for the dataset `quoted` names."""
    try:
        _call(socket, "GET", f"/v1/datasets/{quoted}")
    except click.ClickException:
        return False
    return True


def _require_known_dataset(socket: str | None, quoted: str, typed: str) -> None:
    """A ClickException (exit 1) unless the node has the dataset open, or an allocation
    or an admission kept for it (the daemon canonicalizes the name: a URI typed another
    way still matches). What the node knows is the daemon's answer, not what was
    typed: exit 1 as `forget`, `refresh` and `job show` of a name the node does not
    know (it was 2 here only)."""
    try:
        with one_node_client(socket or default_socket()) as client:
            try:
                client.request("GET", f"/v1/datasets/{quoted}")
                return
            except ControlError as exc:
                if exc.status != 404:
                    raise
            try:
                canonical = client.request("GET", f"/v1/datasets/{quoted}/cache")["dataset"]
            except ControlError as exc:
                if exc.status not in (400, 404):
                    raise
                canonical = None
            allocs = client.request("GET", "/v1/allocations")
            # A setting kept for a dataset not opened yet (--create) names it too.
            known = {*allocs["cache"], *(allocs.get("admission") or {})}
            datasets = [d["uri"] for d in client.request("GET", "/v1/status")["datasets"]]
    except ControlError as exc:
        raise click.ClickException(str(exc)) from None
    if canonical is not None and canonical in known:
        return
    close = difflib.get_close_matches(canonical or typed, sorted({*known, *datasets}), n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise click.ClickException(
        f"no dataset {typed!r} on this node: {hint}check the name, or pass --create if "
        "it will be mounted"
    )


@click.command("allocate-io")
@click.argument("job")
@click.argument("rate", required=False)
@click.option(
    "--create",
    is_flag=True,
    help="JOB is not on this node yet (its mounts are coming): allocate anyway.",
)
@click.option("--clear", is_flag=True, help="Remove JOB's allocation (it is unlimited again).")
@socket_option
def allocate_io(job: str, rate: str | None, create: bool, clear: bool, socket: str | None) -> None:
    """Give JOB a remote IO allocation of RATE (200MB/s, 1.5Gbps, 0, unlimited).

    A rate needs a unit, as `silofs mount --io-limit` does: `100` alone is refused (JuiceFS
    users mean Mbps, rclone users KiB/s). JOB must be a job the node knows (one with a
    mount, a warm or an allocation) unless --create says its mounts are coming, so a
    mistyped name is an error rather than an allocation nobody uses. --clear removes the
    allocation; `silofs-ctl forget JOB` removes an unused job's row as well."""
    path = f"/v1/jobs/{quote_segment(job_arg(job))}/io"
    if clear:
        if rate is not None or create:
            raise click.UsageError("--clear takes no RATE and no --create")
        ans = shown_all(_call(socket, "DELETE", path))
        click.echo(f"{ans['job']}: remote IO allocation removed (unlimited)")
        return
    if rate is None:
        raise click.UsageError("missing argument 'RATE' (or pass --clear)")
    try:
        rate_bps = parse_rate(rate, require_unit=True)
    except UsageError as exc:
        raise click.BadParameter(str(exc), param_hint="RATE") from None
    if not create:
        _require_known_job(socket, job)
    ans = shown_all(_call(socket, "PUT", path, {"bytes_per_s": rate_bps}))
    note = ""
    if ans["bytes_per_s"] == 0:  # what a reader of an uncached chunk now meets
        note = " (no remote IO: misses wait for a raise, hits are served)"
    elif ans["bytes_per_s"] is not None:
        note = _slow_note(socket, ans["bytes_per_s"])
    click.echo(f"{ans['job']}: remote IO allocation {format_rate(ans['bytes_per_s'])}{note}")


def _waiting_allocations(waiting: dict[str, dict[str, Any]]) -> list[str]:
    """Lines for the allocations kept for datasets with no row here (they count in the
    cache's sum: a refused allocate-cache is explained by them; `forget URI` drops one)."""
    cache, modes = waiting.get("cache") or {}, waiting.get("admission") or {}
    out = []
    for uri in sorted({*cache, *modes}):
        what = [f"cache allocation {format_size(cache[uri])}"] if uri in cache else []
        what += [f"admission {modes[uri]}"] if uri in modes else []
        out.append(f"  {uri}: not opened on this node; kept for it: {', '.join(what)}")
    return out


def _waiting(j: dict[str, Any]) -> str:
    """Fetches waiting on the job's allocation now, and for how long the oldest has (a
    pause, or a rate too small for its readers, shows here: 2 (1m30s))."""
    n = j.get("limiter_waiting", 0)  # a daemon before it: no such field
    return f"{n} ({format_duration(j.get('limiter_oldest_wait_s', 0))})" if n else "0"


def _slow_note(socket: str | None, rate: int) -> str:
    """A rate so small that a miss of one chunk waits over a minute is allowed (a rate is
    a rate), and said: a typo for a larger unit is found here, not from a silent hang."""
    chunk = _call(socket, "GET", "/v1/status")["node"]["chunk_size"]
    if rate <= 0 or chunk / rate <= SLOW_CHUNK_SECONDS:
        return ""
    return (
        f" (slow: a miss of one {format_size(chunk)} chunk waits about "
        f"{format_duration(chunk / rate)})"
    )


def _require_known_job(socket: str | None, job: str) -> None:
    """A ClickException (exit 1, as _require_known_dataset) unless the node knows `job`
    (status lists every job with a mount, a warm or an allocation, and recently idle
    ones)."""
    known = {j["name"] for j in _call(socket, "GET", "/v1/status")["jobs"]}
    if job in known:
        return
    close = difflib.get_close_matches(job, sorted(known), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise click.ClickException(
        f"no job {job!r} on this node ({len(known)} known): {hint}check the name, or pass "
        "--create if its mounts are coming"
    )


@click.command()
@click.argument("dataset")
@click.argument("mode", type=click.Choice(["uniform", "lru"]))
@click.option(
    "--create",
    is_flag=True,
    help="DATASET is not on this node yet (it will be mounted): set it anyway.",
)
@socket_option
def admission(dataset: str, mode: str, create: bool, socket: str | None) -> None:
    """Set DATASET's cache admission: uniform (epochs) or lru (irregular access).

    DATASET must be one the node knows (opened, or holding an allocation) unless
    --create says it will be mounted, as for allocate-cache: a mistyped URI is an error
    rather than a setting kept for a dataset that never comes."""
    name = quote_segment(dataset_arg(dataset))
    if not create:
        _require_known_dataset(socket, name, dataset)
    ans = shown_all(_call(socket, "PUT", f"/v1/datasets/{name}/admission", {"mode": mode}))
    click.echo(f"{ans['dataset']}: admission {ans['mode']}")
    if create and not _has_row(socket, name):
        click.echo(
            "  not opened on this node yet: kept for it (status lists it; "
            "`silofs-ctl forget` drops it)"
        )


@click.command()
@click.argument("dataset")
@click.option(
    "--wait/--no-wait",
    default=True,
    show_default=True,
    help="Wait until the new listing is served.",
)
@socket_option
def refresh(dataset: str, wait: bool, socket: str | None) -> None:
    """List DATASET again and swap the listing under its mounts, without remounting.

    Files already open keep reading the version they opened; new opens see the new
    listing (within the mounts' --metadata-ttl for names the kernel has cached)."""
    ds = _call(socket, "GET", f"/v1/datasets/{quote_segment(dataset_arg(dataset))}")
    ans = _call(socket, "POST", "/v1/datasets", {"uri": ds["uri"], "refresh": True})
    while wait and ans["state"] in ("checking", "listing"):
        time.sleep(0.2)
        ans = _call(socket, "GET", f"/v1/datasets/{ans['id']}")
    if ans["state"] == "error":
        raise click.ClickException(ans.get("error") or "the listing failed")
    ans = shown_all(ans)
    if wait:
        click.echo(
            f"{ans['name']}: listing generation {ans.get('generation')}, "
            f"{count(ans['objects'], 'object')}, {format_size(ans['size'])}"
        )
    else:
        click.echo(f"{ans['name']}: {ans['state']}")
