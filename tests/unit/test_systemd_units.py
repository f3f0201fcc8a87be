"""The unit files in systemd/: their commands are ones silofs takes, and a mount unit
neither dies with the node daemon's restart nor starts a daemon of its own."""

from __future__ import annotations

import configparser
import shlex
from pathlib import Path

import click

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
