"""`silofs-ctl forget DATASET|JOB`: remove a dataset's or a job's row and allocation.

Owns the command that undoes a mistyped `allocate-io`/`allocate-cache` or clears the row
a failed mount left: DELETE /v1/datasets/NAME, else DELETE /v1/jobs/NAME. Never touches
cached chunks (the daemon keeps them) and never acts while a mount uses the name.
"""

from __future__ import annotations

import click

from silofs.config import default_socket
from silofs.control.client import ControlError, quote_segment

from .node_cmds import dataset_arg
from .nodes import SOCKET_HELP, one_node_client


@click.command()
@click.argument("name")
@click.option("--socket", default=None, envvar="SILOFS_SOCKET", help=SOCKET_HELP)
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
    paths = []
    if kind in ("any", "dataset"):
        paths.append(f"/v1/datasets/{quote_segment(dataset_arg(name))}")
    if kind in ("any", "job"):
        paths.append(f"/v1/jobs/{quote_segment(name)}")
    try:
        with one_node_client(socket or default_socket()) as client:
            for path in paths:
                try:
                    ans = client.request("DELETE", path)
                except ControlError as exc:
                    if exc.status == 404 and path is not paths[-1]:
                        continue
                    raise
                what = ans["forgot"]
                click.echo(f"forgot {what} {ans[what]}")
                return
    except ControlError as exc:
        if exc.status == 404:
            raise click.ClickException(f"no dataset or job named {name!r} on this node") from None
        raise click.ClickException(str(exc)) from None
