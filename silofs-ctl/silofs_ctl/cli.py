"""`silofs-ctl`: the controller side's command line.

Owns the click group and which commands it has; each command lives in its own module
and is registered here with one `main.add_command(...)` line. Never: holds a command's
logic, or lets an exception reach the user as a traceback.
"""

from __future__ import annotations

import logging

import click

from .certs_cmd import certs
from .controller_cmd import controller
from .forget_cmd import forget
from .job_cmd import job
from .node_cmds import admission, allocate_cache, allocate_io, refresh, status
from .simulate_cmd import simulate_cmd

log = logging.getLogger(__name__)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="silofs", message="silofs-ctl %(version)s")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def main(verbose: int) -> None:
    """SiloD's controller: allocate cache and remote IO across silofs nodes, or simulate."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


main.add_command(simulate_cmd)
main.add_command(controller)
main.add_command(status)
main.add_command(allocate_cache)
main.add_command(allocate_io)
main.add_command(admission)
main.add_command(refresh)
main.add_command(forget)
main.add_command(certs)
main.add_command(job)
