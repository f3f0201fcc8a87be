"""`silofs-ctl job register JOB` and `job show JOB`: what a cluster scheduler tells a
node daemon about a job.

Owns the command a Slurm prolog (configs/slurm/) runs on each node of a job: PUT
/v1/jobs/JOB with the job's GPUs, f* (ideal_io), epochs, datasets, the scheduler's id
for it, its nodes and its user (--uid: the job's owner), so the controller plans with
them instead of a hand-written jobs.toml. The epilog's `silofs end-job` forgets it after
the unmounts (a prolog that gives up: `silofs-ctl forget --kind job JOB`). Never mounts
anything, and never decides allocations.
"""

from __future__ import annotations

import json

import click

from silofs.config import default_socket
from silofs.control.client import ControlError, quote_segment
from silofs.errors import UsageError
from silofs.records import shown
from silofs.units import parse_rate

from .node_cmds import job_arg, socket_option
from .nodes import one_node_client


@click.group("job")
def job() -> None:
    """Register a scheduler's job with the node daemon (run by a Slurm prolog)."""


@job.command("register")
@click.argument("name")
@click.option("--gpus", type=click.IntRange(0, 1 << 16), required=True, help="GPUs of the job.")
@click.option(
    "--dataset", "datasets", multiple=True, help="A dataset URI it reads (repeat; default: none)."
)
@click.option(
    "--ideal-io",
    default=None,
    help="f*: bytes/s when IO is no bottleneck (1GB/s; default: the controller measures it).",
)
@click.option(
    "--epochs", type=float, default=None, help="Epochs it will run in total (default: unknown)."
)
@click.option("--scheduler", default=None, help="Who scheduled it, e.g. slurm (default: none).")
@click.option("--scheduler-id", default=None, help="The scheduler's id for it (default: none).")
@click.option("--node", "nodes", multiple=True, help="A node of the job (repeat; default: none).")
@click.option(
    "--uid",
    type=click.IntRange(0, (1 << 32) - 2),
    default=None,
    help="The job's user: it owns the job from now on, and a user may mount a slurm-N "
    "job only once it is registered for that user's uid (default: none).",
)
@socket_option
def register(
    name: str,
    gpus: int,
    datasets: tuple[str, ...],
    ideal_io: str | None,
    epochs: float | None,
    scheduler: str | None,
    scheduler_id: str | None,
    nodes: tuple[str, ...],
    uid: int | None,
    socket: str | None,
) -> None:
    """Tell the node daemon JOB's GPUs, datasets, (optionally) f* and epochs, and whose
    job it is (--uid; the Slurm prolog registers before it mounts, docs/SECURITY.md)."""
    job_arg(name)
    if ideal_io is not None:
        # As allocate-io: a bare 100 is a typo for a unit (the daemon's API takes it as
        # 100 B/s, an f* that makes the job look like it needs no IO at all).
        try:
            parse_rate(ideal_io, require_unit=True)
        except UsageError as exc:
            raise click.BadParameter(str(exc), param_hint="--ideal-io") from None
    body: dict = {"gpus": gpus, "datasets": list(datasets), "nodes": list(nodes)}
    for key, value in (
        ("ideal_io", ideal_io),
        ("epochs", epochs),
        ("scheduler", scheduler),
        ("scheduler_id", scheduler_id),
        ("uid", uid),
    ):
        if value is not None:
            body[key] = value
    try:
        with one_node_client(socket or default_socket()) as client:
            ans = client.request("PUT", f"/v1/jobs/{quote_segment(name)}", body)
    except ControlError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"registered job {shown(ans['job'])}: {json.dumps(ans['registration'])}")


@job.command("show")
@click.argument("name")
@socket_option
def show(name: str, socket: str | None) -> None:
    """Print the node's view of JOB (registration, IO allocation, rates) as JSON."""
    job_arg(name)
    try:
        with one_node_client(socket or default_socket()) as client:
            ans = client.request("GET", f"/v1/jobs/{quote_segment(name)}")
    except ControlError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(json.dumps(ans, indent=2))
