"""Every option of every `silofs` and `silofs-ctl` command says what it is and, when it
takes a value, what happens without it: a newcomer reads --help, not the source.

Walks the click command trees, so an option added later without help or a stated default
fails here. Flags (on/off) need only their help; an option the command requires needs no
default; `--socket` names the default socket (SILOFS_SOCKET, root's, a user's)."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner
from silofs_ctl.cli import main as ctl_main

from silofs.cli import main as silofs_main


def _commands(group: click.Command, path: tuple[str, ...] = ()):
    yield path, group
    if isinstance(group, click.Group):
        for name, cmd in group.commands.items():
            if not cmd.hidden:
                yield from _commands(cmd, (*path, name))


def _options(root: click.Command, prog: str):
    for path, cmd in _commands(root):
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.hidden and p.name != "help":
                yield " ".join((prog, *path)), p


ALL = list(_options(silofs_main, "silofs")) + list(_options(ctl_main, "silofs-ctl"))
# Without these the store SDK's own chain decides (boto3: AWS_REGION, AWS_PROFILE, ~/.aws),
# as the README's table of stores says.
SDK_DECIDES = {"silofs mount --region", "silofs mount --profile"}
IDS = [f"{cmd} {opt.opts[0]}" for cmd, opt in ALL]


@pytest.mark.parametrize(("cmd", "opt"), ALL, ids=IDS)
def test_every_option_has_help(cmd: str, opt: click.Option) -> None:
    assert opt.help and opt.help.strip(), f"{cmd} {opt.opts[0]} has no help text"


@pytest.mark.parametrize(("cmd", "opt"), ALL, ids=IDS)
def test_every_value_option_states_its_default(cmd: str, opt: click.Option) -> None:
    if opt.is_flag and not opt.secondary_opts or opt.count or opt.required:
        return  # an on/off flag is off without it; a required one has no default
    if f"{cmd} {opt.opts[0]}" in SDK_DECIDES:
        return
    stated = opt.show_default or "default" in (opt.help or "").lower()
    assert stated, f"{cmd} {opt.opts[0]}: --help does not say what happens without it"


def test_socket_help_names_the_defaults() -> None:
    for root in (silofs_main, ctl_main):
        out = CliRunner().invoke(root, ["status" if root is ctl_main else "unmount", "-h"])
        text = " ".join(out.output.split())
        assert "SILOFS_SOCKET" in text and "/run/silofs/control.sock" in text, text


def test_silofs_help_states_exit_status() -> None:
    out = CliRunner().invoke(silofs_main, ["--help"])
    assert "Exit status" in out.output and "130" in out.output


def test_simulate_help_example_names_a_shipped_scenario() -> None:
    """The example a newcomer copies from `silofs-ctl simulate --help` exists."""
    import re
    from pathlib import Path

    out = CliRunner().invoke(ctl_main, ["simulate", "--help"]).output
    (example,) = re.findall(r"configs/scenarios/[\w.-]+\.toml", out)
    assert (Path(__file__).resolve().parents[2] / example).is_file(), example
