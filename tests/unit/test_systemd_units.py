"""The unit files in systemd/: their commands are ones silofs takes, and a mount unit
neither dies with the node daemon's restart nor starts a daemon of its own."""

from __future__ import annotations

import configparser
import shlex
from pathlib import Path

import click
import pytest

from silofs.cli import main

UNITS = Path(__file__).resolve().parents[2] / "systemd"


def unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string((UNITS / name).read_text())
    return parser


def test_a_mount_unit_outlives_a_daemon_restart() -> None:
    # Requires= (or BindsTo=) would stop and restart every mount, busy files and all,
    # on `systemctl restart silofs`; a mount survives a daemon restart by design.
    u = unit("silofs-mount@.service")["Unit"]
    assert "silofs.service" not in u.get("Requires", "") + u.get("BindsTo", "")
    assert "silofs.service" in u["Wants"] and "silofs.service" in u["After"]


def test_a_mount_units_commands_are_ones_silofs_takes() -> None:
    service = unit("silofs-mount@.service")["Service"]
    env = {
        "%i": "imagenet",
        "$SILOFS_MOUNT_ARGS": "--io-limit 200MB/s",
        "${SILOFS_URI}": "s3://datasets/imagenet/train/",
        "${SILOFS_MOUNTPOINT}": "/mnt/imagenet",
    }
    for key in ("ExecStart", "ExecStop"):
        line = service[key]
        for name, value in env.items():
            line = line.replace(name, value)
        argv = shlex.split(line)
        assert argv[0] == "/usr/local/bin/silofs"
        with main.make_context("silofs", argv[1:], resilient_parsing=False) as ctx:
            sub = main.get_command(ctx, argv[1])
            assert isinstance(sub, click.Command), argv
            sub.make_context(argv[1], argv[2:], parent=ctx)  # raises on a wrong flag
    start = shlex.split(service["ExecStart"])
    # With silofs.service down, fail and retry: never a daemon of this unit's own.
    assert "--no-start-daemon" in start and "--foreground" in start


REPO = UNITS.parent


def _readme_install_block(heading: str = "### As services") -> list[str]:
    """The commands of the first ```sh block under README's `heading`."""
    text = (REPO / "README.md").read_text()
    section = text[text.index(heading) :]
    section = section[: section.index("\n### ", 1)]
    block = section[section.index("```sh\n") + 6 :]
    block = block[: block.index("```")]
    lines = [line.split(" #", 1)[0].strip() for line in block.splitlines()]
    return [part.strip() for line in lines if line and not line.startswith("#")
            for part in line.split("&&")]  # fmt: skip


def _installed(commands: list[str]) -> set[str]:
    """The absolute paths the block's `install` and `ln -s` commands make (every source
    of an `install` must exist in the checkout, globs expanded as the shell would)."""
    made: set[str] = set()
    for command in commands:
        argv = shlex.split(command)
        if argv[:2] == ["ln", "-s"]:
            *sources, target = argv[2:]
            made.update(target.rstrip("/") + "/" + Path(s).name for s in sources)
        elif argv[0] == "install" and "-d" not in argv:
            args = [a for i, a in enumerate(argv[1:], 1) if not a.startswith("-")
                    and argv[i - 1] not in ("-m", "-t")]  # fmt: skip
            target = argv[argv.index("-t") + 1] if "-t" in argv else args.pop()
            sources = [p for a in args for p in sorted(REPO.glob(a))]
            assert sources and all(p.is_file() for p in sources), command
            if "-t" in argv or target.endswith("/"):
                made.update(target.rstrip("/") + "/" + p.name for p in sources)
            else:
                made.add(target)
    return made


def test_the_documented_install_makes_every_path_the_units_name() -> None:
    """What a unit runs, the config it reads and its Documentation= are all made by the
    README's "As services" commands: a unit that names /usr/local/bin/silofs while the
    README installs it nowhere fails with 203/EXEC on the first start."""
    commands = _readme_install_block()
    made = _installed(commands)
    assert any("-m venv /opt/silofs" in c for c in commands), commands
    for name in ("silofs.service", "silofs-mount@.service", "silofs-controller.service"):
        u = unit(name)
        needed: list[str] = []
        for key in ("ExecStart", "ExecStop", "ExecStartPre"):
            if key in u["Service"]:
                argv = shlex.split(u["Service"][key].lstrip("-@+!"))
                if not argv[0].startswith(("/bin/", "/usr/bin/")):  # the system's own
                    needed.append(argv[0])
                if "--config" in argv:
                    needed.append(argv[argv.index("--config") + 1])
        needed += [
            d.removeprefix("file://")
            for d in u["Unit"].get("Documentation", "").split()
            if d.startswith("file://")
        ]
        missing = [p for p in needed if p not in made]
        assert not missing, f"{name} names {missing}, which README's install never makes"


@pytest.mark.parametrize("heading", ["### As services", "### Under Slurm"])
def test_the_system_venv_is_made_from_the_systems_python(heading: str) -> None:
    """The venv every user's mounts run (the units', the Slurm prolog's) is made from
    Debian's /usr/bin/python3, the one the block's apt-get line gives python3-venv to:
    `python3` is whatever root's PATH names first, e.g. a pyenv under /root, which no
    job user may run; a venv of it failed every job's mount with "Permission denied"."""
    venvs = [c for c in _readme_install_block(heading) if "-m venv /opt/silofs" in c]
    assert venvs and all(c.split()[0] == "/usr/bin/python3" for c in venvs), venvs
