"""`silofs-ctl cluster set` and `cluster status`: a cluster's member list, pushed to every
node at once, and what each node says of it.

Owns the operator's side of PUT and GET /v1/cluster: the member list (given, or the
nodes Slurm reports: `scontrol show nodes --json`, else `sinfo -N -h -o %N`), one version
for every node (so the newest list wins everywhere alike), the push to each node over
its Unix socket or its mutual-TLS listener (with the controller's certificate, as
`controller run` reaches nodes: $SILOFS_CTL_TLS), and a table of the members each node
sees up or down. Never: starts or stops daemons, or writes a node's silofs.toml (a pushed
list is persisted by the daemon itself).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import click

from silofs.config import canonical_member, parse_cluster
from silofs.control.client import ControlError
from silofs.errors import UsageError
from silofs.records import shown, shown_all
from silofs.units import count, format_size

from .nodes import one_node_client
from .slurm import SlurmError, expand_hostlist, run_bounded

DEFAULT_PORT = 7470
_SLURM_TIMEOUT = 30.0
_SLURM_LIMIT = 64 << 20


def _split(values: Sequence[str]) -> list[str]:
    """Repeatable options that also take comma-separated lists."""
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


def slurm_nodes(
    scontrol: str = "scontrol", sinfo: str = "sinfo", partitions: Sequence[str] = ()
) -> list[str]:
    """The node names Slurm reports: `scontrol show nodes --json` (Slurm 21.08+), else
    `sinfo -N -h -o %N`; with `partitions`, only the nodes of those (every node of a
    Slurm cluster, its CPU and login partitions too, made members that run no silofs:
    down for ever, each holding its part of every share). SlurmError (one line) if
    neither answers, or no node is in the partitions."""
    wanted = set(partitions)
    nodes: list[dict] = []
    try:
        doc = json.loads(
            run_bounded([scontrol, "show", "nodes", "--json"], _SLURM_TIMEOUT, _SLURM_LIMIT)
        )
        nodes = [n for n in doc.get("nodes", []) if isinstance(n, dict) and n.get("name")]
    except (SlurmError, ValueError, KeyError, TypeError, AttributeError):
        pass
    if nodes:
        names = sorted(
            str(n["name"])
            for n in nodes
            if not wanted or wanted & {str(p) for p in _listed(n.get("partitions"))}
        )
        if not names:
            raise SlurmError(f"scontrol: no node in partition {', '.join(sorted(wanted))}")
        return sorted(set(names))
    argv = [sinfo, "-N", "-h", "-o", "%N"]
    if wanted:
        argv += ["-p", ",".join(sorted(wanted))]
    text = run_bounded(argv, _SLURM_TIMEOUT, _SLURM_LIMIT)
    names = sorted({h for line in text.splitlines() for h in expand_hostlist(line)})
    if not names:
        where = f" in partition {', '.join(sorted(wanted))}" if wanted else ""
        raise SlurmError(f"sinfo: no nodes{where}")
    return names


def _listed(value: object) -> list:
    return value if isinstance(value, list) else []


def members_body(
    name: str, members: list[str], weights: dict[str, float], version: int
) -> dict[str, Any]:
    """The body of PUT /v1/cluster."""
    return {
        "name": name,
        "version": version,
        "members": [{"address": m, "weight": weights[m]} if m in weights else m for m in members],
    }


def _weights(values: Sequence[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for value in values:
        address, sep, weight = value.rpartition("=")
        try:
            out[address] = float(weight)
        except ValueError:
            raise click.BadParameter(
                f"{value!r}: want ADDRESS=WEIGHT", param_hint="--weight"
            ) from None
        if not sep:
            raise click.BadParameter(f"{value!r}: want ADDRESS=WEIGHT", param_hint="--weight")
    return out


@click.group("cluster")
def cluster() -> None:
    """One cache across nodes: the member list of a cluster (docs/ARCHITECTURE.md)."""


@cluster.command("set")
@click.option("--nodes", "nodes", multiple=True,
              help="A node to push to (a Unix socket or tls://HOST:PORT; repeatable or "
              "comma-separated). Default: every member, over TLS with the controller's "
              "certificate in $SILOFS_CTL_TLS.")  # fmt: skip
@click.option("--members", "members", multiple=True,
              help="A member, tls://HOST:PORT (repeatable or comma-separated; "
                   "default: none, give it or --from-slurm).")  # fmt: skip
@click.option("--from-slurm", is_flag=True, help="The members are the nodes Slurm reports.")
@click.option("--port", default=DEFAULT_PORT, show_default=True, type=click.IntRange(1, 65535),
              help="With --from-slurm: the members' TLS port.")  # fmt: skip
@click.option("--partition", "partitions", multiple=True,
              help="With --from-slurm: only the nodes of this Slurm partition (repeatable "
              "or comma-separated; default: every node Slurm reports).")  # fmt: skip
@click.option("--name", default=None, help="The cluster's name (default: the nodes' current).")
@click.option(
    "--weight", "weights", multiple=True, help="ADDRESS=WEIGHT (repeatable; default: 1 each)."
)
@click.option("--version", "version", type=click.IntRange(0), default=None,
              help="The list's version (default: now, in microseconds).")  # fmt: skip
def set_cmd(
    nodes: tuple[str, ...],
    members: tuple[str, ...],
    from_slurm: bool,
    port: int,
    partitions: tuple[str, ...],
    name: str | None,
    weights: tuple[str, ...],
    version: int | None,
) -> None:
    """Push a member list to every node; each puts it in force without a restart
    (keeping its own peer_* settings)."""
    listed = _split(members)
    if from_slurm == bool(listed):
        raise click.UsageError("give the members with --members or --from-slurm (one of them)")
    if partitions and not from_slurm:
        raise click.UsageError("--partition goes with --from-slurm")
    if from_slurm:
        try:
            listed = [f"tls://{host}:{port}" for host in slurm_nodes(partitions=_split(partitions))]
        except SlurmError as exc:
            raise click.ClickException(str(exc)) from None
    listed, weighted = _canonical(listed, _weights(weights))
    targets = _split(nodes) or listed
    views = _views(targets)
    name = name or _current_name(targets, views)
    if version is None:
        # The clock's, but newer than every list in force on the nodes that answered: a
        # clock stepped back since the last push (NTP, `date -s`) must not leave every
        # list refused as "not newer" for as long as the step.
        answered = [v for v in views.values() if isinstance(v, dict)]
        newest = max((int(v.get("version") or 0) for v in answered), default=-1)
        version = max(time.time_ns() // 1000, newest + 1)
    body = members_body(name, listed, weighted, version)
    try:  # as every node will judge it: one line here, and no node takes a list others refuse
        parse_cluster({k: v for k, v in body.items() if k != "version"})
    except UsageError as exc:
        raise click.UsageError(str(exc)) from None
    refused = _refusals(targets, body)
    if refused:
        raise click.ClickException(
            f"{refused} of {count(len(targets), 'node')} refused the list (above); no node was "
            "changed"
        )
    failed = 0
    for target in targets:
        try:
            with one_node_client(target) as client:
                got = shown_all(client.request("PUT", "/v1/cluster", body))
            click.echo(f"{target}: cluster {got['name']}, version {got['version']}, "
                       f"{count(got['members'], 'member')}")  # fmt: skip
        except ControlError as exc:
            failed += 1
            click.echo(f"{target}: {shown(str(exc))}", err=True)
    if failed:
        raise click.ClickException(
            f"{failed} of {count(len(targets), 'node')} did not take the list"
        )
    if nodes and len(targets) < len(listed):
        # The members it did not reach place chunks by their old list until it reaches
        # them (each node warns of members whose list differs, and status shows it).
        click.echo(
            f"note: pushed to {count(len(targets), 'node')} of {count(len(listed), 'member')}: "
            "the others keep their list until it is pushed to them (leave out --nodes "
            "to push to every member)",
            err=True,
        )


def _refusals(targets: list[str], body: dict) -> int:
    """How many nodes refuse the list (each named on stderr), asked before any is changed:
    a list one node refuses (not newer, not naming it, naming it twice) must not change
    the others. A node that cannot be reached refuses nothing (a dead node must not
    block a list that leaves it out): the push that follows names it."""
    refused = 0
    for target in targets:
        try:
            with one_node_client(target) as client:
                client.request("PUT", "/v1/cluster?check=1", body)
        except ControlError as exc:
            if exc.status is not None:
                refused += 1
                click.echo(f"{target}: {shown(str(exc))}", err=True)
    return refused


def _canonical(members: list[str], weights: dict[str, float]) -> tuple[list[str], dict[str, float]]:
    """Members and weights by canonical address (as the nodes compare them: a weight
    written tls://GPU01:7470 is gpu01's); a weight must name a member."""
    try:
        listed = [canonical_member(m) for m in members]
        weighted = {canonical_member(a): w for a, w in weights.items()}
    except UsageError as exc:
        raise click.UsageError(str(exc)) from None
    for address in weights:
        if canonical_member(address) not in listed:
            raise click.BadParameter(f"{address} is not one of the members", param_hint="--weight")
    return listed, weighted


def _views(targets: list[str]) -> dict[str, dict | str]:
    """Each target's GET /v1/cluster (a dict), or the one line of why it did not answer
    (a str naming its node), in the targets' order."""
    views: dict[str, dict | str] = {}
    for target in targets:
        try:
            with one_node_client(target) as client:
                view = client.request("GET", "/v1/cluster")
        except ControlError as exc:
            views[target] = shown(str(exc))  # names its node
            continue
        views[target] = view if isinstance(view, dict) else {}
    return views


def _current_name(targets: list[str], views: dict[str, dict | str]) -> str:
    """The name the first node that answers is in. When none answers, the first
    node's error is the message (a missing $SILOFS_CTL_TLS, a node down): "no node is
    in a cluster yet" would send the user after a --name that changes nothing."""
    unreached = [v for v in views.values() if isinstance(v, str)]
    for view in views.values():
        if isinstance(view, dict) and view.get("name"):
            return str(view["name"])
    if unreached and len(unreached) == len(targets):
        raise click.ClickException(f"no node answered: {unreached[0]}")
    raise click.UsageError("no node is in a cluster yet: give the cluster's --name")


@cluster.command("status")
@click.option("--nodes", "nodes", multiple=True, required=True,
              help="A node to ask (a Unix socket or tls://HOST:PORT; repeatable).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Each node's view as JSON, one per line.")
def status_cmd(nodes: tuple[str, ...], as_json: bool) -> None:
    """What each node says of its cluster: members up or down, peer traffic."""
    failed = 0
    for target in _split(nodes):
        try:
            with one_node_client(target) as client:
                view = client.request("GET", "/v1/cluster")
        except ControlError as exc:
            failed += 1
            click.echo(f"{target}: {shown(str(exc))}", err=True)
            continue
        if as_json:
            click.echo(json.dumps({"node": target, "cluster": view}))
        else:
            click.echo(render(target, view))
    if failed:
        raise click.ClickException(f"{count(failed, 'node')} did not answer")


def render(target: str, answer: dict) -> str:
    view = shown_all(answer)  # names and errors from the nodes: escapes, never commands
    if not view.get("name"):
        return f"{target}: in no cluster"
    out = [f"{target}: cluster {view['name']} (version {view['version']}), this node "
           f"{view['address']}"]  # fmt: skip
    for m in view["members"]:
        errors = ", ".join(f"{k} {v}" for k, v in sorted(m["errors"].items())) or "-"
        state = "self" if m["self"] else m["state"]
        if m["state"] == "down":
            state += f" ({m['down_for_s']:g}s: {m['last_error']})"
        other = m.get("other_list")
        if isinstance(other, dict):  # it places chunks by another list than this node
            state += (
                f" (another member list: version {other.get('version')}, "
                f"{other.get('members')} members)"
            )
        out.append(
            f"  {m['address']} weight {m['weight']:g} {state}: asked {m['requests_out']}, "
            f"received {format_size(m['bytes_in'])}, fallbacks {m['store_fallbacks']}, "
            f"errors {errors}"
        )
    for d in view.get("datasets", []):
        share = "-" if d["share"] is None else format_size(d["share"])
        part = "-" if d["part"] is None else format_size(d["part"])
        out.append(
            f"  {d['uri']}: share {share}, part {part}, in {format_size(d['bytes_in'])}, "
            f"out {format_size(d['bytes_out'])}"
        )
    return "\n".join(out)
