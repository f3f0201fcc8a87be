"""`mount.silofs`: the mount(8) helper, so `mount -t silofs` and fstab lines work.

Owns mount(8)'s helper calling convention (`mount.silofs SOURCE DIR [-sfnv] [-o OPTS]`,
see mount(8) "EXTERNAL HELPERS"), the translation of `-o` options into `silofs mount`
flags, and mount(8)'s exit codes. Never mounts anything itself: it runs `silofs mount`.

    URI  MOUNTPOINT  silofs  job=train,cache_size=500G,allow_other,_netdev,nofail  0 0

mount(8) looks for /sbin/mount.TYPE: install with
`ln -s "$(command -v mount.silofs)" /sbin/mount.silofs`. (Named cli_mount, not
mount_helper: it is command-line side, not part of silofs/mount/.)
"""

from __future__ import annotations

import logging
import sys

from silofs.errors import UsageError
from silofs.records import shown

log = logging.getLogger(__name__)

# -o key=value -> `silofs mount --key-with-dashes value`
VALUE_OPTIONS = {
    "job",
    "socket",
    "cache_dir",
    "cache_size",
    "chunk_size",
    "endpoint_url",
    "io_limit",
    "admission",
    "uid",
    "gid",
    "file_mode",
    "dir_mode",
    "idle_exit",
    "log_level",
    "log_file",
    "log_format",
    "region",
    "profile",
    "metadata_ttl",
    "serve_processes",
}
# -o flag -> `silofs mount --flag`
FLAG_OPTIONS = {
    "allow_other",
    "allow_root",
    "refresh",
    "requester_pays",
    "no_sign_request",
    "azure_identity",
    "debug",
    "list_in_background",
    "no_start_daemon",
}
# Options for mount(8), systemd or the kernel that mean nothing more to silofs, which is
# always read-only, nosuid and nodev. _netdev orders the mount after the network (systemd's
# fstab generator reads it); nofail keeps boot going if it fails; both are accepted here.
IGNORED = {
    "defaults",
    "ro",
    "rw",  # mount(8) adds it unless `ro` is given; the mount is read-only all the same
    "read_only",
    "_netdev",
    "nofail",
    "auto",
    "noauto",
    "user",
    "users",
    "nouser",
    "owner",
    "group",
    "exec",
    "noexec",
    "suid",
    "nosuid",
    "dev",
    "nodev",
    "atime",
    "noatime",
    "relatime",
    "norelatime",
    "strictatime",
    "lazytime",
    "nodiratime",
    "diratime",
    "sync",
    "async",
    "loud",
    "silent",
}
IGNORED_PREFIXES = ("x-", "comment=", "context=")

# mount(8) exit codes
EXIT_USAGE = 1
EXIT_FAILURE = 32
EXIT_INTERRUPTED = 8


def options_to_flags(options: str, sloppy: bool = False) -> list[str]:
    """`-o` options as `silofs mount` flags; UsageError for one silofs does not know
    (ignored with -s, as mount(8) asks of helpers)."""
    flags: list[str] = []
    for opt in (o.strip() for o in options.split(",")):
        if not opt:
            continue
        key, eq, value = opt.partition("=")
        if opt in IGNORED or key in IGNORED or opt.startswith(IGNORED_PREFIXES):
            continue
        if eq and key in VALUE_OPTIONS:
            flags += ["--" + key.replace("_", "-"), value]
        elif not eq and key in FLAG_OPTIONS:
            flags.append("--" + key.replace("_", "-"))
        elif not sloppy:
            known = ", ".join(sorted(VALUE_OPTIONS)) + ", " + ", ".join(sorted(FLAG_OPTIONS))
            raise UsageError(f"unknown mount option {opt!r} (silofs knows {known})")
    return flags


def parse_argv(argv: list[str]) -> tuple[str, str, str, bool, bool, bool]:
    """(source, dir, options, sloppy, fake, verbose) from mount(8)'s helper argv."""
    positional: list[str] = []
    options: list[str] = []
    sloppy = fake = verbose = False
    args = iter(argv)
    for arg in args:
        if arg == "-o":
            options.append(next(args, ""))
        elif arg.startswith("-o"):
            options.append(arg[2:])
        elif arg in ("-t", "-N"):
            next(args, None)  # type (silofs, or silofs.SUBTYPE) and namespace: unused
        elif arg.startswith("-") and len(arg) > 1 and not arg.startswith("--"):
            for c in arg[1:]:
                if c == "s":
                    sloppy = True
                elif c == "f":
                    fake = True
                elif c == "v":
                    verbose = True
                elif c != "n":  # -n: no mtab; there is none to write
                    raise UsageError(f"unknown helper flag -{c}")
        else:
            positional.append(arg)
    if len(positional) != 2:
        raise UsageError("usage: mount.silofs URI MOUNTPOINT [-sfnv] [-o OPTIONS]")
    return positional[0], positional[1], ",".join(options), sloppy, fake, verbose


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["-V"], ["--version"]):  # as mount(8) and its other helpers answer
        from silofs import __version__

        print(f"mount.silofs {__version__}")
        sys.exit(0)
    try:
        source, target, options, sloppy, fake, verbose = parse_argv(argv)
        flags = options_to_flags(options, sloppy)
    except UsageError as exc:
        print(f"mount.silofs: error: {shown(str(exc))}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    cmd = ["mount", source, target, *flags]
    if verbose:
        print("mount.silofs: silofs " + shown(" ".join(cmd)), file=sys.stderr)
    if fake:
        sys.exit(0)
    from silofs.cli import main as silofs_main

    try:
        silofs_main(args=cmd, prog_name="silofs")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        sys.exit({0: 0, 2: EXIT_USAGE, 130: EXIT_INTERRUPTED}.get(code, EXIT_FAILURE))
    sys.exit(0)


if __name__ == "__main__":
    main()
