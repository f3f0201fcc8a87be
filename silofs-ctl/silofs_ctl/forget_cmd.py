"""`silofs-ctl forget DATASET|JOB`: remove a dataset's or a job's row and allocation.

Owns the command that undoes a mistyped `allocate-io`/`allocate-cache` or clears the row
a failed mount left: DELETE /v1/datasets/NAME, else DELETE /v1/jobs/NAME. Never touches
cached chunks (the daemon keeps them) and never acts while a mount uses the name.
"""

from __future__ import annotations

import click

from silofs.config import default_socket
from silofs.control.client import ControlError, quote_segment
from silofs.records import job_name_error, shown_all

from .node_cmds import dataset_arg, job_arg, socket_option
from .nodes import one_node_client


@click.command()
@click.argument("name")
@socket_option
@click.option(
    "--kind",
    type=click.Choice(["any", "dataset", "job"]),
    default="any",
    show_default=True,
    help="What NAME is; any: a dataset of that name or URI, else a job.",
)
def forget(name: str, socket: str | None, kind: str) -> None:
    """Remove NAME's row and allocation: a dataset (URI or short name) or a job.

    Cached chunks and the saved listing of a dataset stay (a later mount reuses them)."""
    dataset = name if kind == "job" else dataset_arg(name)  # a job's name is checked below
    # A name that breaks the job grammar (`data/`, `a b`) can only be a dataset: asking
    # the daemon for such a job answers the grammar, not "no such dataset".
    not_job = job_name_error(name)
    if kind == "job":
        job_arg(name)
    paths = []
    if kind in ("any", "dataset"):
        paths.append(f"/v1/datasets/{quote_segment(dataset)}")
    if kind == "job" or (kind == "any" and not_job is None):
        paths.append(f"/v1/jobs/{quote_segment(name)}")
    try:
        with one_node_client(socket or default_socket()) as client:
            for path in paths:
                try:
                    ans = shown_all(client.request("DELETE", path))
                except ControlError as exc:
                    if exc.status == 404 and path is not paths[-1]:
                        continue
                    raise
                what = ans["forgot"]
                click.echo(f"forgot {what} {ans[what]}")
                return
    except ControlError as exc:
        if exc.status != 404:
            raise click.ClickException(str(exc)) from None
        raise click.ClickException(_not_found(name, dataset, kind, not_job)) from None


def _not_found(name: str, dataset: str, kind: str, not_job: str | None) -> str:
    """One line: what NAME was looked for as, and that none of it is on the node. A name
    that could be a job keeps the words "no dataset or job named" whatever --kind says:
    the Slurm epilog (configs/slurm/epilog.sh) matches them as "already forgotten"."""
    if not_job is None:
        return f"no dataset or job named {name!r} on this node"
    shown = repr(name) if dataset == name else f"{name!r} ({dataset})"
    if kind == "dataset":
        return f"no dataset {shown} on this node"
    return f"no dataset {shown} on this node, and {name!r} is no job name ({not_job})"
