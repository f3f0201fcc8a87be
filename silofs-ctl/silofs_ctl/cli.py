"""`silofs-ctl`: the controller side's command line.

Owns the click group and which commands it has; each command lives in its own module
and is registered here with one `main.add_command(...)` line. Never: holds a command's
logic, or lets an exception reach the user as a traceback.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any, NoReturn

import click

from silofs.control.client import ANSWER_ERRORS, ANSWERED, ControlError, unreadable_answer
from silofs.errors import SilofsError, UsageError
from silofs.logsetup import TextFormatter
from silofs.output import end_on_output_error, output_error
from silofs.records import shown

from .certs_cmd import certs
from .cluster_cmd import cluster
from .controller_cmd import controller
from .forget_cmd import forget
from .job_cmd import job
from .node_cmds import admission, allocate_cache, allocate_io, refresh, status

log = logging.getLogger(__name__)

PROG = "silofs-ctl"


def fail(message: str, code: int = 1) -> NoReturn:
    """One line on stderr, as `silofs` prints them: `silofs-ctl: error: ...`."""
    click.echo(f"{PROG}: error: {shown(' '.join(message.split()))}", err=True)
    sys.exit(code)


# Commands whose module is imported only when the command runs (or --help lists it):
# `simulate` loads numpy (the simulator's arrays, ~0.1 s), which no other command needs.
LAZY_COMMANDS = {"simulate": ("silofs_ctl.simulate_cmd", "simulate_cmd")}


class OneLineGroup(click.Group):
    """click, with every error in silofs's one style: `silofs-ctl: error: ...` on one
    line; exit 2 for what was typed wrong (usage errors, as click's own), 1 otherwise,
    130 when interrupted. click's own rendering ("Usage: ... Try ... Error: ...") is
    three lines with another prefix; scripts and people grep for one."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in LAZY_COMMANDS and cmd_name not in self.commands:
            module, attr = LAZY_COMMANDS[cmd_name]
            self.add_command(getattr(importlib.import_module(module), attr), cmd_name)
        return super().get_command(ctx, cmd_name)

    def main(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        kwargs["standalone_mode"] = False
        ANSWERED.set(None)
        try:
            rc = super().main(*args, **kwargs)
        except (click.exceptions.Abort, KeyboardInterrupt):
            fail("interrupted", 130)
        except click.ClickException as exc:
            no_args = getattr(click.exceptions, "NoArgsIsHelpError", ())
            if isinstance(exc, no_args) and exc.ctx is not None:  # bare `silofs-ctl`: help
                click.echo(exc.ctx.get_help(), err=True)
                sys.exit(exc.exit_code)
            message = exc.format_message()
            ctx = getattr(exc, "ctx", None)
            if isinstance(exc, click.UsageError) and ctx is not None:
                message += f" (see `{ctx.command_path} --help`)"
            fail(message, exc.exit_code)
        except UsageError as exc:
            fail(str(exc), 2)
        except (SilofsError, ControlError) as exc:
            fail(str(exc))
        except OSError as exc:
            # stdout to a full disk, or a pipe whose reader left: one line, not a
            # traceback; any other OSError is a bug and stays one.
            if (failed := output_error(exc)) is None:
                raise
            end_on_output_error(failed, PROG)
        except ANSWER_ERRORS as exc:
            # A node's answer this version cannot read (a field missing, another type):
            # one line naming the node; anything else stays a traceback (a bug).
            line = unreadable_answer(exc, PROG)
            if line is None:
                raise
            log.debug("reading the answer failed", exc_info=True)
            fail(line)
        sys.exit(rc if isinstance(rc, int) else 0)


@click.group(
    cls=OneLineGroup,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Exit status: 0 done; 1 the node or the work failed, or refused (a daemon "
    "not answering, a name the node does not know, an allocation over the cache); 2 what "
    "was typed is wrong (an option, a size, a rate, a name's form: nothing was asked); "
    "130 interrupted.",
)
@click.version_option(package_name="silofs", message="silofs-ctl %(version)s")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def main(verbose: int) -> None:
    """SiloD's controller: allocate cache and remote IO across silofs nodes, or simulate."""
    level = logging.WARNING - 10 * min(verbose, 2)
    # Messages shown() as the daemon's are (silofs/logsetup.py): the controller logs
    # names the nodes and Slurm send it (dataset URIs, job names, errors).
    handler = logging.StreamHandler()
    handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])


main.add_command(controller)
main.add_command(status)
main.add_command(allocate_cache)
main.add_command(allocate_io)
main.add_command(admission)
main.add_command(refresh)
main.add_command(forget)
main.add_command(certs)
main.add_command(cluster)
main.add_command(job)
