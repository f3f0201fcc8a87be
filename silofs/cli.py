"""`silofs daemon|mount|unmount|end-job|end-dead-mounts`: the node-side command line.

Owns flags, their translation into settings, starting a default daemon when none runs,
the readiness handshake with a background mount process, and turning every error into
one line on stderr with a non-zero exit. Never serves FUSE or talks to a store itself.
"""

from __future__ import annotations

import faulthandler
import functools
import hashlib
import json
import logging
import os
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click

from silofs.config import (
    MountSettings,
    NodeSettings,
    credential_fingerprint,
    default_log_dir,
    default_socket,
    load_node_settings,
    socket_arg,
)
from silofs.control.client import (
    ANSWER_ERRORS,
    ANSWERED,
    ControlClient,
    ControlError,
    DaemonNotTrusted,
    unreadable_answer,
)
from silofs.errors import SilofsError, UsageError, first_leaf
from silofs.logsetup import LOG_FORMATS, setup_logging
from silofs.mountinfo import fuse_device_refusal, silofs_mounts
from silofs.output import end_on_output_error, output_error
from silofs.pids import pid_alive
from silofs.records import (
    JOB_NAME_MAX_BYTES,
    is_slurm_job_name,
    job_name_char,
    not_utf8,
    shown,
)
from silofs.units import count, format_rate, format_size, parse_rate, parse_size

log = logging.getLogger(__name__)

DAEMON_START_TIMEOUT = 30.0


def fail(message: str, code: int = 1) -> None:
    # shown(): a message may quote what others named (a mountpoint, a daemon's answer)
    click.echo(f"silofs: error: {shown(message)}", err=True)
    sys.exit(code)


def say(line: str, *, back: bool = False, nl: bool = True, err: bool = True) -> None:
    """An informational line (on stderr unless `err` is False), escaped as fail()'s are:
    it names a URI, a mountpoint or a socket the user typed or another user made (a
    name may hold a terminal escape or a newline). `back`: it starts with a carriage
    return, over the progress line before it."""
    click.echo(("\r" if back else "") + shown(line), nl=nl, err=err)


def one_line_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Errors we expect become one line on stderr; the traceback goes to the log only."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ANSWERED.set(None)
        try:
            return fn(*args, **kwargs)
        except UsageError as exc:  # what was typed is wrong: 2, as for click's own
            fail(str(exc), 2)
        except (SilofsError, ControlError) as exc:
            fail(str(exc))
        except ANSWER_ERRORS as exc:
            # A daemon's answer this version cannot read: one line naming the daemon;
            # with no answer behind it, a traceback (a bug).
            line = unreadable_answer(exc, "silofs")
            if line is None:
                raise
            log.debug("reading the answer failed", exc_info=True)
            fail(line)
        except KeyboardInterrupt:
            fail("interrupted", 130)
        except BaseExceptionGroup as group:
            # trio reports a task's failure inside a nursery as a group: one expected
            # error is still one line, anything else stays a traceback (a bug).
            expected = group.subgroup((SilofsError, ControlError))
            if expected is None or group.split((SilofsError, ControlError))[1] is not None:
                raise
            fail(str(first_leaf(expected)))

    return wrapper


def _size(_ctx: click.Context, _param: click.Parameter, value: str | None) -> int | None:
    try:
        return None if value is None else parse_size(value)
    except UsageError as exc:
        raise click.BadParameter(str(exc)) from None


def _rate(_ctx: click.Context, _param: click.Parameter, value: str | None) -> int | None:
    try:
        return None if value is None else parse_rate(value, require_unit=True)
    except UsageError as exc:
        raise click.BadParameter(str(exc)) from None


# A file's owner or group as the kernel takes it: (uid_t)-1 means "no owner" to chown.
_ID = click.IntRange(0, 2**32 - 2)


def _octal(_ctx: click.Context, _param: click.Parameter, value: str) -> int:
    """Permission bits, 0 to 7777 in octal. A mode outside them mounted and failed every
    lookup: -1 cannot be a mode_t (EIO, a traceback per name), and 17777 set a bit of
    the file type (S_IFREG | 010000 is no type: EIO)."""
    try:
        mode = int(value, 8)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not an octal mode like 0444") from None
    if not 0 <= mode <= 0o7777:
        raise click.BadParameter(f"{value!r} is not a mode: modes are 0 to 7777 (octal)")
    return mode


class OneLineGroup(click.Group):
    """click, with its usage errors in our one style: `silofs: error: ...`, exit 2.

    click's own rendering ("Usage: ... Try ... Error: ...") is three lines with another
    prefix; scripts and people grep for one."""

    def main(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        kwargs["standalone_mode"] = False
        try:
            rc = super().main(*args, **kwargs)
        except click.exceptions.Abort:
            fail("interrupted", 130)
        except click.ClickException as exc:
            no_args = getattr(click.exceptions, "NoArgsIsHelpError", ())
            if isinstance(exc, no_args) and exc.ctx is not None:  # bare `silofs`: the help
                click.echo(exc.ctx.get_help(), err=True)
                sys.exit(exc.exit_code)
            message = exc.format_message()
            ctx = getattr(exc, "ctx", None)
            if isinstance(exc, click.UsageError) and ctx is not None:
                message += f" (see `{ctx.command_path} --help`)"
            fail(message.replace("\n", " "), exc.exit_code)
        except OSError as exc:
            # stdout to a full disk, or a pipe whose reader left: one line, not a
            # traceback; any other OSError is a bug and stays one.
            if (failed := output_error(exc)) is None:
                raise
            end_on_output_error(failed, "silofs")
        sys.exit(rc if isinstance(rc, int) else 0)


@click.group(
    cls=OneLineGroup,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Exit status: 0 done; 1 what was asked failed; 2 what was typed is wrong (an "
    "option, a size, a rate, a URI's form); 130 interrupted.",
)
@click.version_option(package_name="silofs", message="silofs %(version)s")
def main() -> None:
    """silofs: mount a bucket read-only, served from a local-SSD cache."""


def _socket(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    try:
        return socket_arg(value)
    except UsageError as exc:  # at parse time: click's kind, exit 2 in one line
        raise click.UsageError(str(exc), ctx) from None


# An empty --socket is a usage error (socket_arg), not the default daemon's socket.
socket_option = click.option(
    "--socket",
    default=None,
    envvar="SILOFS_SOCKET",
    help="Control socket of the node daemon (default: $SILOFS_SOCKET, else root's "
    "/run/silofs/control.sock, a user's $XDG_RUNTIME_DIR/silofs/control.sock or "
    "/tmp/silofs-UID/silofs/control.sock).",
    callback=_socket,
)


# -- daemon ----------------------------------------------------------------------------
@main.group(invoke_without_command=True)
@click.option(
    "--config",
    "config_file",
    type=click.Path(),
    help="TOML settings (configs/silofs.toml; default: none, built-in settings).",
)
@socket_option
@click.option(
    "--cache-dir",
    default=None,
    help="Directory of the LMDB cache (default: /var/cache/silofs for root, else ~/.cache/silofs).",
)
@click.option(
    "--cache-size",
    default=None,
    callback=_size,
    help="Cache budget, e.g. 500G (default: 10G, or half the free disk if less).",
)
@click.option("--chunk-size", default=None, callback=_size, help="Default chunk size (default 4M).")
@click.option("--endpoint-url", default=None, help="Default store endpoint.")
@click.option("--log-level", default=None, help="debug, info, warning, error (default: info).")
@click.option("--debug", is_flag=True, help="Same as --log-level debug.")
@click.option(
    "--log-file",
    default=None,
    help="Log here, reopened after logrotate/SIGHUP (default: stderr; a daemon `silofs "
    "mount` started: syslog, else ~/.local/state/silofs, root's /var/log/silofs).",
)
@click.option(
    "--log-format", type=click.Choice(LOG_FORMATS), default=None, help="text (default) or json."
)
@click.option(
    "--idle-exit",
    type=float,
    help="Exit SECONDS after the last mount (not under systemd; default: never).",
)
@click.option(
    "--metrics-address",
    help="Also serve GET /metrics over TCP, e.g. 127.0.0.1:9464 (default: off).",
)
@click.option("--started-by", type=click.Choice(["manual", "auto"]), default="manual", hidden=True)
@click.pass_context
@one_line_errors
def daemon(
    ctx: click.Context,
    config_file: str | None,
    socket: str | None,
    cache_dir: str | None,
    cache_size: int | None,
    chunk_size: int | None,
    endpoint_url: str | None,
    log_level: str | None,
    debug: bool,
    log_file: str | None,
    log_format: str | None,
    idle_exit: float | None,
    metrics_address: str | None,
    started_by: str,
) -> None:
    """Run the node daemon in the foreground (systemd Type=notify); `daemon stop` stops it."""
    if ctx.invoked_subcommand is not None:
        return
    from silofs.node.service import run_daemon

    settings = load_node_settings(
        config_file,
        socket=socket,
        cache_dir=cache_dir,
        cache_size=cache_size,
        chunk_size=chunk_size,
        endpoint_url=endpoint_url,
        log_level="debug" if debug else log_level,
        log_file=log_file,
        log_format=log_format,
        idle_exit_seconds=idle_exit or None,
        metrics_address=metrics_address,
    )
    # A daemon `silofs mount` started runs in the background: syslog (the journal),
    # as mountpoint-s3 does, unless a log file is set; otherwise stderr (under systemd,
    # the journal again).
    setup_logging(
        settings.log_level,
        settings.log_file,
        fmt=settings.log_format,
        syslog_ident="silofs-daemon" if started_by == "auto" else None,
        sdk_level=settings.sdk_log_level,
    )
    # A fatal signal (SIGSEGV/SIGBUS in a C extension: LMDB on a damaged page) would
    # otherwise end the process without a word; this puts each thread's stack on stderr.
    faulthandler.enable()
    run_daemon(settings, started_by)


@daemon.command("stop")
@socket_option
@click.option("--force", is_flag=True, help="Stop it even while mounts use it.")
@click.option("--timeout", default=30.0, show_default=True, help="Seconds to wait for it.")
@one_line_errors
def daemon_stop(socket: str | None, force: bool, timeout: float) -> None:
    """Stop the node daemon answering on the socket (SIGTERM, then wait until it is gone)."""
    socket = socket or default_socket()
    try:
        with ControlClient(socket, timeout=5) as client:
            status = client.request("GET", "/v1/status")
    except ControlError as exc:
        # A frozen daemon (it accepted and said nothing) is named as such, not as none.
        if exc.status is not None or exc.timed_out or isinstance(exc, DaemonNotTrusted):
            raise
        raise SilofsError(f"no silofs daemon answers on {socket}") from None
    pid = int(status["node"]["pid"])
    mounts = status.get("mounts", [])
    if mounts and not force:
        raise UsageError(
            f"the daemon still serves {count(len(mounts), 'mount')} (e.g. "
            f"{mounts[0]['mountpoint']}): unmount first, or pass --force (a mount keeps "
            "serving cached bytes; its misses fail until a daemon runs again)"
        )
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    except PermissionError:
        raise SilofsError(
            f"not allowed to stop the daemon (pid {pid}, uid "
            f"{status['node'].get('started_by_uid', '?')}): run as root, or "
            "`systemctl stop silofs` if it is a service"
        ) from None
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() > deadline:
            raise SilofsError(f"the daemon (pid {pid}) did not exit within {timeout:.0f}s")
        time.sleep(0.05)
    say(f"silofs: stopped the daemon (pid {pid}) on {socket}")


# -- mount -----------------------------------------------------------------------------
def _check_mountpoint(path: str) -> str:
    path = os.path.abspath(path)
    # The daemon's API takes UTF-8 only: the mount failed with its "request body holds
    # text that is not UTF-8".
    if (shown_path := not_utf8(path)) is not None:
        raise UsageError(
            f"mountpoint {shown_path} is not UTF-8 text: silofs mounts at UTF-8 paths only"
        )
    try:
        st = os.stat(path)  # isdir() would hide ENOTCONN, the sign of a dead mount
    except FileNotFoundError:
        raise UsageError(f"mountpoint {path} does not exist: create it first") from None
    except OSError as exc:
        raise UsageError(
            f"mountpoint {path} is unusable ({exc.strerror}): if it is a dead "
            f"mount, run `silofs unmount {path}`"
        ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"mountpoint {path} is not a directory")
    if os.path.realpath(path) in silofs_mounts():
        raise UsageError(
            f"mountpoint {path} is busy: a silofs mount is there (perhaps one "
            f"whose process died): run `silofs unmount {path}` first"
        )
    if os.path.ismount(path):
        raise UsageError(f"mountpoint {path} is busy: something is already mounted there")
    if (entry := _first_entry(path)) is not None:
        # FUSE 3 mounts over a non-empty directory (fuse 2 refused without -o nonempty):
        # allowed, as mount(8) allows it, but said, since its files vanish from view
        # (a job's output directory mounted over by mistake looked emptied).
        say(
            f"silofs: note: mountpoint {path} is not empty: what is in it ({entry!r}, ...) "
            "is hidden while the mount is there"
        )
    return path


def _lock_mountpoint(path: str) -> int | None:
    """An exclusive flock on the directory `path`, waited for: two `silofs mount` at one
    mountpoint at once both passed the checks and stacked two mounts, each "mounted".
    The descriptor (close-on-exec: no mount process inherits it) keeps the directory
    that was there, so a second mount waits for the first, then its checks find the
    first's mount. None when `path` cannot be opened: the checks say why."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        say(f"silofs: another silofs mount at {path} is under way: waiting for it")
        fcntl.flock(fd, fcntl.LOCK_EX)  # Ctrl-C ends the wait
    except OSError:  # a file system without flock: no lock, as before
        pass
    return fd


def _first_entry(path: str) -> str | None:
    """One name in the directory `path`, or None if it is empty or cannot be listed."""
    try:
        with os.scandir(path) as it:
            return next((e.name for e in it), None)
    except OSError:
        return None


AUTO_IDLE_EXIT = 300.0  # seconds a daemon `silofs mount` started outlives its last mount


@dataclass
class DaemonWish:
    """What a mount asks of the daemon it may start; checked against a running one."""

    socket: str
    cache_dir: str | None = None
    cache_size: int | None = None
    endpoint_url: str | None = None
    idle_exit: float = AUTO_IDLE_EXIT
    # The mount names its own credentials (--profile, --no-sign-request, ...): the
    # daemon's environment does not decide them.
    own_credentials: bool = False
    # False (--no-start-daemon): a daemon that does not answer is an error, not started.
    start: bool = True


def _start_daemon(wish: DaemonWish) -> None:
    """Start a default node daemon in the background and wait until it answers."""
    socket = wish.socket
    log_path = _log_file("daemon.log")
    args = [sys.executable, "-m", "silofs", "daemon", "--socket", socket, "--started-by", "auto"]
    for flag, value in (
        ("--cache-dir", wish.cache_dir),
        ("--cache-size", wish.cache_size),
        ("--endpoint-url", wish.endpoint_url),
        ("--idle-exit", wish.idle_exit or None),
    ):
        if value is not None:
            args += [flag, str(value)]
    with open(log_path, "ab") as logf:
        logf.write(f"--- starting: {' '.join(args)}\n".encode())
        logf.flush()
        # Not the unit's notify socket: a mount run by a Type=notify unit must not have
        # its READY=1 sent by the daemon it happened to start.
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "INVOCATION_ID")}
        proc = _spawn(
            args,
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=logf,
            env=env,
            start_new_session=True,
        )
    deadline = time.monotonic() + DAEMON_START_TIMEOUT
    with ControlClient(socket, timeout=2) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SilofsError(
                    _last_error(log_path)
                    or f"the silofs daemon exited; see {log_path} and `journalctl -t silofs-daemon`"
                )
            try:
                client.request("GET", "/v1/status")
                return
            except DaemonNotTrusted:
                proc.kill()  # another user's process holds the socket path: ours never will
                raise
            except ControlError:
                time.sleep(0.05)
    proc.kill()
    raise SilofsError(
        f"the silofs daemon did not start within {DAEMON_START_TIMEOUT:.0f}s; see {log_path}"
    )


def _log_file(name: str) -> str:
    """`name` in the log dir (made if missing), where a background daemon or mount
    writes what it says before its own logging is set up; SilofsError, one line, when
    the dir cannot be made or written (a HOME that is not writable, a file in its
    place): never a traceback."""
    where = default_log_dir()
    path = os.path.join(where, name)
    try:
        os.makedirs(where, exist_ok=True)
        open(path, "ab").close()
    except OSError as exc:
        raise SilofsError(
            f"cannot write logs in {where}: {exc.strerror or exc}; set SILOFS_LOG_DIR "
            "(or XDG_STATE_HOME) to a directory you can write"
        ) from None
    return path


def mount_log_name(job: str) -> str:
    """The file name of a background mount's stderr log: "mount-JOB.log" where that fits
    NAME_MAX (255 bytes), else the job name cut short plus a hash of all of it. A job name
    may be 255 bytes (records.job_name_error): "mount-" and ".log" around one made the
    mount fail with "cannot write logs ...: File name too long; set SILOFS_LOG_DIR", which
    no log dir fixes."""
    name = f"mount-{job}.log"
    if len(name.encode()) <= 255:
        return name
    digest = hashlib.sha256(job.encode()).hexdigest()[:12]
    head = job.encode()[:200].decode(errors="ignore")  # whole characters only
    return f"mount-{head}-{digest}.log"


def _spawn(args: list[str], **kwargs: Any) -> subprocess.Popen:
    """subprocess.Popen, its OSError (the interpreter not executable, out of
    processes) one line."""
    try:
        return subprocess.Popen(args, **kwargs)
    except OSError as exc:
        raise SilofsError(f"cannot start {' '.join(args[:4])}: {exc.strerror or exc}") from None


def _last_error(log_path: str) -> str | None:
    with open(log_path, errors="replace") as f:
        lines = [ln.strip() for ln in f.read().splitlines()[-20:]]
    for line in reversed(lines):
        if line.startswith("silofs: error: "):
            return line[len("silofs: error: ") :]
    return None


def _ensure_daemon(wish: DaemonWish) -> None:
    try:
        with ControlClient(wish.socket, timeout=5) as client:
            node = client.request("GET", "/v1/status")["node"]
    except ControlError as exc:
        # A socket served by an untrusted uid is no missing daemon, and neither is one
        # that accepted the request and then said nothing (frozen or overloaded): say
        # so, start nothing (another daemon would find the socket taken).
        if exc.status is not None or exc.timed_out or isinstance(exc, DaemonNotTrusted):
            raise
        if not wish.start:
            raise SilofsError(f"{exc} (--no-start-daemon: not starting one)") from None
        _start_daemon(wish)
        return
    _check_daemon_fits(wish, node)


def _check_daemon_fits(wish: DaemonWish, node: dict) -> None:
    """A running daemon keeps its cache and its credentials: flags or an environment
    that ask for others would be ignored, so say so instead of mounting anyway."""
    cache = f"cache {node['cache_dir']} ({format_size(node['cache_size'])})"
    remedy = "stop it with `silofs daemon stop`"
    if wish.cache_dir and os.path.abspath(wish.cache_dir) != os.path.abspath(node["cache_dir"]):
        raise UsageError(
            f"a daemon is already running with {cache}; --cache-dir {wish.cache_dir} would be "
            f"ignored: {remedy} or drop the flag"
        )
    if wish.cache_size is not None and wish.cache_size != node["cache_size"]:
        raise UsageError(
            f"a daemon is already running with {cache}; --cache-size "
            f"{format_size(wish.cache_size)} would be ignored: {remedy} or drop the flag"
        )
    theirs = node.get("credentials_env")
    if theirs is None or wish.own_credentials:  # an older daemon does not say
        return
    ours = credential_fingerprint(os.environ)
    differ = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
    if not differ:
        return
    names = ", ".join(differ[:3]) + (" ..." if len(differ) > 3 else "")
    if node.get("started_by") == "auto" and node.get("started_by_uid") == os.getuid():
        raise UsageError(
            f"the running daemon reads store credentials from its own environment, which "
            f"differs from yours in {names}: {remedy} and mount again to use yours "
            "(or name them for this mount: --profile, --no-sign-request, --azure-identity)"
        )
    say(
        f"silofs: note: the daemon ({node.get('started_by', 'manual')}) uses its own "
        f"store credentials, which differ from your environment's in {names}: yours are "
        "not used"
    )


def _wait_listing(
    socket: str,
    uri: str,
    refresh: bool,
    endpoint_url: str | None,
    background: bool = False,
    options: dict[str, str] | None = None,
) -> dict:
    """Open the dataset in the daemon, with a progress line on a terminal. In the
    background mode, only until the daemon has begun writing the listing."""
    tty = sys.stderr.isatty()
    body: dict[str, Any] = {"uri": uri, "refresh": refresh, "endpoint_url": endpoint_url}
    if options:
        body["options"] = options
    with ControlClient(socket, timeout=30) as client:
        try:
            ds = client.request("POST", "/v1/datasets", body)
        except ControlError as exc:
            # A refresh the daemon refuses (429: the dataset was listed less than its
            # min_refresh_seconds ago) does not fail the mount: it mounts the current
            # listing and says so. Any other refusal stands (asked again, it recurs).
            if not refresh or exc.status != 429:
                raise
            ds = client.request("POST", "/v1/datasets", {**body, "refresh": False})
            say(f"silofs: note: {uri} not refreshed, mounting its current listing: {exc}")
        # No time limit: the listing of a huge prefix takes what it takes; the daemon
        # reports its progress, shown here on a terminal.
        while ds["state"] in ("checking", "listing"):
            if background and ds.get("building_gen") is not None:
                if tty:
                    say(
                        f"listing {ds['uri']} in the background "
                        f"({count(ds['listed'], 'object')} so far); `silofs-ctl status` shows "
                        "its progress"
                    )
                return ds
            if tty and ds["state"] == "listing":
                rate = ds.get("list_rate") or 0
                say(
                    f"listing {ds['uri']}: {count(ds['listed'], 'object')} ({rate:,.0f}/s)",
                    back=True,
                    nl=False,
                )
            time.sleep(0.1)
            ds = client.request("GET", f"/v1/datasets/{ds['id']}")
    if tty and ds.get("listed"):
        say(f"listed {ds['uri']}: {count(ds['listed'], 'object')}", back=True)
    if ds["state"] != "ready":
        raise SilofsError(ds.get("error") or f"listing {uri} did not finish")
    return ds


def _ttl(_ctx: click.Context, _param: click.Parameter, value: str) -> float | None:
    if value in ("indefinite", "inf", "-1"):
        return None
    try:
        ttl = float(value)
    except ValueError:
        raise click.BadParameter("a number of seconds or 'indefinite'") from None
    if not 0 <= ttl < 10**9:
        raise click.BadParameter("a number of seconds or 'indefinite'")
    return ttl


@main.command()
@click.argument("uri")
@click.argument("mountpoint")
@click.option(
    "--job",
    default=None,
    help="Job name (remote IO is allocated per job). Default: the mountpoint's name "
    "and a short hash of its absolute path, e.g. data-1a2b3c.",
)
@socket_option
@click.option(
    "--cache-dir",
    default=None,
    help="Cache dir, if this starts the daemon (default: /var/cache/silofs for root, "
    "else ~/.cache/silofs).",
)
@click.option(
    "--cache-size",
    default=None,
    callback=_size,
    help="Cache budget, if this starts the daemon, e.g. 100G (default: 10G, or half the "
    "free disk if less).",
)
@click.option("--chunk-size", default=None, callback=_size, help="Chunk size (default 4M).")
@click.option(
    "--endpoint-url",
    default=None,
    help="Store endpoint; for s3:// mounts AWS_ENDPOINT_URL is the default.",
)
@click.option(
    "--io-limit",
    default=None,
    callback=_rate,
    help="Initial remote IO allocation of the job, e.g. 200MB/s (default: the job's "
    "allocation, unlimited when it has none).",
)
@click.option(
    "--admission",
    type=click.Choice(["uniform", "lru"]),
    default=None,
    help="Cache admission of the dataset: uniform (training epochs; default) or "
    "lru (irregular access, e.g. curriculum learning).",
)
@click.option(
    "--idle-exit",
    type=float,
    default=AUTO_IDLE_EXIT,
    show_default=True,
    help="If this starts the daemon: it exits SECONDS after its last mount (0: never).",
)
@click.option(
    "--no-start-daemon",
    is_flag=True,
    help="Fail if no daemon answers on the socket rather than start one (a node whose "
    "daemon systemd runs: the Slurm prolog).",
)
@click.option("--refresh", is_flag=True, help="List the bucket again.")
@click.option(
    "--metadata-ttl",
    default="indefinite",
    callback=_ttl,
    help="Seconds a listing is trusted before the mount lists again (and the kernel's "
    "name/attribute cache), or 'indefinite' (default: list only on --refresh or "
    "`silofs-ctl refresh`).",
)
@click.option(
    "--list-in-background",
    is_flag=True,
    help="Mount as soon as listing starts; a lookup of a name not listed yet waits for the "
    "listing rather than failing.",
)
@click.option(
    "--serve-processes",
    type=click.IntRange(1, 16),
    default=1,
    show_default=True,
    help="Processes serving the mount (experimental: N > 1 forks N pyfuse3 processes on "
    "one FUSE connection; on a 2-core host it cost more CPU per file than it gained, and "
    "sequential cold reads lose read-ahead; see docs/ARCHITECTURE.md).",
)
@click.option("--foreground", "-f", is_flag=True, help="Serve in this process.")
@click.option(
    "--allow-other",
    is_flag=True,
    help="Let other users read the mount: every file, by --file-mode, whatever its mode in "
    "a local directory (docs/SECURITY.md).",
)
@click.option("--allow-root", is_flag=True, help="Let root read the mount (FUSE allow_root).")
@click.option("--read-only", is_flag=True, help="Accepted: silofs mounts are always read-only.")
@click.option("--region", default=None, help="S3 region of the bucket (this dataset only).")
@click.option("--profile", default=None, help="AWS profile for the bucket (this dataset only).")
@click.option(
    "--requester-pays", is_flag=True, help="S3 requester-pays bucket: you pay for the reads."
)
@click.option(
    "--no-sign-request",
    is_flag=True,
    help="Anonymous access to a public bucket (unsigned S3 requests; anonymous GCS/Azure).",
)
@click.option(
    "--azure-identity",
    is_flag=True,
    help="az:// with Entra ID: managed or workload identity, az login (DefaultAzureCredential).",
)
@click.option("--debug", is_flag=True, help="Debug logging (same as --log-level debug).")
@click.option(
    "--log-file",
    default=None,
    help="Log file of the mount process (default: syslog/the journal when there is one).",
)
@click.option("--log-format", type=click.Choice(LOG_FORMATS), default="text", show_default=True,
              help="text or json.")  # fmt: skip
@click.option("--uid", type=_ID, default=None, help="Owner of files (default: you).")
@click.option("--gid", type=_ID, default=None, help="Group of files (default: yours).")
@click.option(
    "--file-mode",
    default="0444",
    show_default=True,
    callback=_octal,
    help="Mode of files (octal, 0-7777).",
)
@click.option(
    "--dir-mode",
    default="0555",
    show_default=True,
    callback=_octal,
    help="Mode of directories (octal, 0-7777).",
)
@click.option("--log-level", default="info", show_default=True, help="debug, info, warning, error.")
@one_line_errors
def mount(
    uri: str,
    mountpoint: str,
    job: str | None,
    socket: str | None,
    cache_dir: str | None,
    cache_size: int | None,
    chunk_size: int | None,
    endpoint_url: str | None,
    io_limit: int | None,
    admission: str | None,
    idle_exit: float,
    no_start_daemon: bool,
    refresh: bool,
    metadata_ttl: float | None,
    list_in_background: bool,
    serve_processes: int,
    foreground: bool,
    allow_other: bool,
    allow_root: bool,
    read_only: bool,
    region: str | None,
    profile: str | None,
    requester_pays: bool,
    no_sign_request: bool,
    azure_identity: bool,
    debug: bool,
    log_file: str | None,
    log_format: str,
    uid: int | None,
    gid: int | None,
    file_mode: int,
    dir_mode: int,
    log_level: str,
) -> None:
    """Mount the bucket prefix URI read-only at MOUNTPOINT.

    URI: file:///abs/dir (or a local path), s3://bucket/prefix, az://account/container/prefix,
    gs://bucket/prefix. Returns once the mount is ready.
    """
    from silofs.uri import parse_uri, store_endpoint

    socket = socket or default_socket()
    parsed = parse_uri(_check_source(uri))
    canonical = parsed.canonical
    endpoint_url = store_endpoint(parsed, endpoint_url)
    # Held until the mount is ready (this process's exit, or the foreground mount's
    # ready): a second `silofs mount` at this mountpoint waits, then finds it busy.
    lock = _lock_mountpoint(os.path.abspath(mountpoint))
    mountpoint = _check_mountpoint(mountpoint)
    if chunk_size is not None and not (64 << 10) <= chunk_size <= (64 << 20):
        raise UsageError("--chunk-size must be between 64KiB and 64MiB")
    if allow_other and allow_root:
        raise UsageError("--allow-other already lets root read: drop --allow-root")
    store_options = _store_options(
        parsed.scheme, region, profile, requester_pays, no_sign_request, azure_identity
    )
    if debug:
        log_level = "debug"
    own = bool({"profile", "anonymous", "credential"} & store_options.keys())
    # Before a daemon is started and the bucket listed for a mount that cannot happen:
    # a user the FUSE device refuses (a 0600 /dev/fuse) is told so at once, and no idle
    # daemon of its own is left behind.
    if (refusal := fuse_device_refusal(mountpoint)) is not None:
        raise SilofsError(refusal)
    _ensure_daemon(
        DaemonWish(socket, cache_dir, cache_size, endpoint_url, idle_exit, own, not no_start_daemon)
    )
    ds = _wait_listing(socket, canonical, refresh, endpoint_url, list_in_background, store_options)
    settings = MountSettings(
        uri=canonical,
        mountpoint=mountpoint,
        job=job or default_job(mountpoint),
        chunk_size=chunk_size,
        allow_other=allow_other,
        allow_root=allow_root,
        store_options=store_options,
        uid=os.getuid() if uid is None else uid,
        gid=os.getgid() if gid is None else gid,
        file_mode=file_mode,
        dir_mode=dir_mode,
        refresh=False,
        io_limit=io_limit,
        endpoint_url=endpoint_url,
        admission=admission,
        dataset_id=ds["id"],
        metadata_ttl=metadata_ttl,
        list_in_background=list_in_background,
        serve_processes=serve_processes,
    )
    if foreground:
        _mount_foreground(settings, socket, log_level, log_file, log_format, lock)
    else:
        _mount_background(settings, socket, log_level, log_file, log_format)
        say(f"silofs: {canonical} mounted at {mountpoint} (job {settings.job})")


def _store_options(
    scheme: str,
    region: str | None,
    profile: str | None,
    requester_pays: bool,
    no_sign_request: bool,
    azure_identity: bool = False,
) -> dict[str, str]:
    """Per-dataset store options from flags (config.STORE_OPTIONS), checked for the store."""
    options: dict[str, str] = {}
    s3_only = {"--region": region, "--profile": profile, "--requester-pays": requester_pays}
    for flag, value in s3_only.items():
        if value and scheme != "s3":
            raise UsageError(f"{flag} is for s3:// datasets, not {scheme}://")
    if region:
        options["region"] = region
    if profile:
        options["profile"] = profile
    if requester_pays:
        options["requester_pays"] = "true"
    if no_sign_request:
        if scheme == "file":
            raise UsageError("--no-sign-request is for buckets, not local directories")
        if profile:
            raise UsageError("--no-sign-request sends no credentials: drop --profile")
        options["anonymous"] = "true"
    if azure_identity:
        if scheme != "az":
            raise UsageError(f"--azure-identity is for az:// datasets, not {scheme}://")
        if no_sign_request:
            raise UsageError("--no-sign-request sends no credentials: drop --azure-identity")
        options["credential"] = "default"
    return options


_SCHEME_TYPO = re.compile(r"^(s3|gs|gcs|az|file)(:/?|//)(?!/)(.*)$", re.I)
_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$")


def _check_source(uri: str) -> str:
    """A source that is neither a URI nor an existing local path is most often a bucket
    name typed as mountpoint-s3 and gcsfuse take it, or a mistyped scheme: say which URI
    was meant rather than "directory does not exist"."""
    if "://" in uri or os.path.exists(os.path.expanduser(uri)):
        return uri
    if m := _SCHEME_TYPO.match(uri):
        scheme = m.group(1).lower().replace("gcs", "gs")
        rest = m.group(3).lstrip("/")
        if scheme == "file":
            rest = "/" + rest  # file:///absolute/path
        raise UsageError(f"{uri!r} is not a dataset URI: did you mean {scheme}://{rest}?")
    if _BUCKET_NAME.match(uri) and "/" not in uri:
        raise UsageError(
            f"{uri!r} is neither a local directory nor a URI: for a bucket write "
            f"s3://{uri}/ (or gs://{uri}/, az://ACCOUNT/{uri}/)"
        )
    return uri


def default_job(mountpoint: str) -> str:
    """The mountpoint's name plus a short hash of its absolute path: two unrelated
    ~/data mounts (different users or directories) must not share one job's remote IO
    allocation and figures. Pass --job to name the job (and share it on purpose)."""
    path = os.path.abspath(mountpoint)
    digest = hashlib.sha256(path.encode("utf-8", "surrogateescape")).hexdigest()[:6]
    base = os.path.basename(path.rstrip("/")) or "root"
    # Whatever the directory's name, the default is a job name (records.job_name_error):
    # a character a job name may not hold becomes '_', and the name is cut to 200
    # characters and 248 bytes (255 with "-" and the digest). Only whitespace and '/'
    # were replaced: a mountpoint named with a '\\', a '"', DEL or 85 three-byte
    # characters failed to mount, refused for a job name nobody had given.
    base = "".join(c if job_name_char(c) else "_" for c in base[:200])
    base = base.encode()[: JOB_NAME_MAX_BYTES - 7].decode(errors="ignore")
    if is_slurm_job_name(f"{base}-{digest}"):
        # A mountpoint named "slurm" whose digest is all digits: "slurm-123456" is a
        # name of the Slurm prolog's, refused to a user it is not registered for
        # (docs/SECURITY.md "Jobs").
        return f"{base}_{digest}"
    return f"{base}-{digest}"


def _mount_foreground(
    settings: MountSettings,
    socket: str,
    log_level: str,
    log_file: str | None,
    log_format: str,
    lock: int | None = None,
) -> None:
    from silofs.mount.process import run_mount

    setup_logging(log_level, log_file, fmt=log_format)
    faulthandler.enable()  # as a background mount's (mount_process)
    errors: list[str] = []

    def ready(error: str | None) -> None:
        if lock is not None:  # this process serves on: another mount may now try
            os.close(lock)
        if error:
            errors.append(error)
        else:
            say(f"silofs: {settings.uri} mounted at {settings.mountpoint}")

    run_mount(settings, socket, ready)
    if errors:
        raise SilofsError(errors[0])


def _mount_background(
    settings: MountSettings, socket: str, log_level: str, log_file: str | None, log_format: str
) -> None:
    # Records go to --log-file, else to syslog (the journal) when there is one; stderr
    # (a crash, or records when there is no syslog) to a file in the state dir.
    err_path = _log_file(mount_log_name(settings.job))
    log_path = os.path.abspath(log_file) if log_file else err_path
    if log_file:
        try:  # here, where the error reaches the user: the mount process's goes to a file
            open(log_path, "a").close()
        except OSError as exc:
            raise UsageError(f"cannot open --log-file {log_file}: {exc.strerror}") from None
    read_fd, write_fd = os.pipe()
    args = [
        sys.executable,
        "-m",
        "silofs",
        "mount-process",
        "--ready-fd",
        str(write_fd),
        "--socket",
        socket,
        "--log-level",
        log_level,
        "--log-format",
        log_format,
        *(["--log-file", log_path] if log_file else ["--background"]),
        json.dumps(vars(settings)),
    ]
    try:
        with open(err_path, "ab") as errf:
            proc = _spawn(
                args,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=errf,
                pass_fds=(write_fd,),
                start_new_session=True,
            )
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        answer = pipe.readline().strip()  # EOF if the child dies before it answers
    if answer == "ok":
        return
    if proc.poll() is None and not answer:
        proc.kill()
    raise SilofsError(
        answer.removeprefix("error: ")
        or f"the mount process exited before the mount was ready; see {log_path}"
        + ("" if log_file else " and `journalctl -t silofs-mount`")
    )


@main.command("mount-process", hidden=True)
@click.option("--ready-fd", type=int, required=True)
@click.option("--socket", required=True)
@click.option("--log-level", default="info")
@click.option("--log-file", default=None)
@click.option("--log-format", default="text")
@click.option("--background", is_flag=True, help="Log to syslog when there is one.")
@click.argument("settings_json")
def mount_process(
    ready_fd: int,
    socket: str,
    log_level: str,
    log_file: str | None,
    log_format: str,
    background: bool,
    settings_json: str,
) -> None:
    """Internal: the background mount process started by `silofs mount`."""
    from silofs.mount.process import run_mount

    setup_logging(
        log_level,
        log_file,
        fmt=log_format,
        syslog_ident="silofs-mount" if background else None,
    )
    faulthandler.enable()  # stderr: the state dir's mount-JOB.log (see the daemon's)
    settings = MountSettings(**json.loads(settings_json))
    pipe = os.fdopen(ready_fd, "w")

    def ready(error: str | None) -> None:
        pipe.write("ok\n" if error is None else f"error: {error}\n")
        pipe.close()

    try:
        run_mount(settings, socket, ready)
    except BaseException as exc:
        log.exception("mount process failed")
        if not pipe.closed:
            ready(f"mount process failed: {exc}")
        raise SystemExit(1) from None


# -- unmount ---------------------------------------------------------------------------
@main.command()
@click.argument("mountpoint")
@socket_option
@click.option("--lazy", "-z", is_flag=True, help="Detach now, finish when no longer busy.")
@one_line_errors
def unmount(mountpoint: str, socket: str | None, lazy: bool) -> None:
    """Unmount a silofs mount and wait (at most 10 s) for its process to finish."""
    from silofs import unmount as um

    outcome = um.unmount(mountpoint, socket or default_socket(), lazy)
    say(f"silofs: {um.outcome_line(outcome, lazy)}")


@main.command("end-job")
@click.argument("job")
@click.option(
    "--dir",
    "directory",
    default=None,
    help="The job's mount directory: every mount at or under it is the job's (default: "
    "none; only the daemon's mounts of JOB).",
)
@socket_option
@one_line_errors
def end_job(job: str, directory: str | None, socket: str | None) -> None:
    """End a finished batch job on this node (a scheduler's epilog, as root).

    Unmounts every mount at or under --dir and the daemon's silofs mounts of JOB (lazily
    where a reader holds files open), waits a few seconds for their mount processes
    (then SIGTERM, then SIGKILL), removes --dir and forgets JOB on the daemon. One line
    per step on stdout; exit 1, naming it, if anything of the job is left."""
    from silofs.jobend import end_job as end
    from silofs.records import job_name_error

    if (why := job_name_error(job)) is not None:
        raise UsageError(f"bad job name {job!r}: {why}")
    if os.geteuid() != 0:
        raise UsageError("end-job unmounts other users' mounts: run it as root")
    # Its lines name other users' mountpoints: escaped.
    left = end(job, directory, socket or default_socket(), functools.partial(say, err=False))
    if left:
        fail(f"left of job {job}: {'; '.join(left)}")


@main.command("end-dead-mounts")
@click.option("--uid", type=click.IntRange(min=0), required=True, help="The job's user.")
@one_line_errors
def end_dead_mounts(uid: int) -> None:
    """Detach the dead silofs mounts of a user (a scheduler's epilog, as root).

    A mount is dead when its mount process is gone (a job killed with the mount its
    script made): the kernel answers ENOTCONN. Live mounts (other jobs of the user),
    mounts that do not answer within 2 s (a stopped process) and other users' mounts
    are left. One line per mount detached or left on stdout; exit 1, naming it, if a
    dead mount could not be detached."""
    from silofs.deadmounts import end_dead_mounts as end

    if os.geteuid() != 0:
        raise UsageError("end-dead-mounts probes as another user and unmounts: run it as root")
    left = end(uid, functools.partial(say, err=False))
    if left:
        fail(f"dead mounts of uid {uid} left: {'; '.join(left)}")


# -- warm ------------------------------------------------------------------------------
@main.command()
@click.argument("target")
@click.option(
    "--paths",
    multiple=True,
    help="Only objects whose key matches this glob (repeatable; `*` also matches /; "
    "`[...]` is a set, `[[]` a literal '['; default: every object).",
)
@click.option(
    "--job",
    default=None,
    help="Job whose remote IO allocation pays (default: the mount's job; for a URI: warm).",
)
@click.option(
    "--chunk-size", default=None, callback=_size, help="For a URI: chunk size (default 4M)."
)
@socket_option
@one_line_errors
def warm(
    target: str, paths: tuple[str, ...], job: str | None, chunk_size: int | None, socket: str | None
) -> None:
    """Fill the cache with TARGET's data (a URI or a silofs mountpoint), up to its cache
    share: a uniform random sample when the share is smaller than the dataset. Resumes
    where a stopped warm ended; Ctrl-C stops it."""
    socket = socket or default_socket()
    path = os.path.realpath(target) if os.path.exists(target) else None
    if path is not None and path in silofs_mounts():
        with ControlClient(socket, timeout=10) as client:
            status = client.request("GET", "/v1/status")
        m = next((m for m in status["mounts"] if m["mountpoint"] == path), None)
        if m is None:
            raise SilofsError(f"{path} is a silofs mount the daemon on {socket} does not know")
        dsid = next(d["id"] for d in status["datasets"] if d["uri"] == m["dataset"])
        job = job or m["job"]
        chunk_size = chunk_size or m["chunk_size"]
    else:
        from silofs.uri import parse_uri

        canonical = parse_uri(_check_source(target)).canonical
        _ensure_daemon(DaemonWish(socket))
        dsid = _wait_listing(socket, canonical, False, None)["id"]
        job = job or "warm"
    body = {"job": job, "paths": list(paths), "chunk_size": chunk_size}
    with ControlClient(socket, timeout=30) as client:
        w = client.request("POST", f"/v1/datasets/{dsid}/warm", body)
        try:
            w = _follow_warm(client, dsid, w)
        except KeyboardInterrupt:
            w = client.request("DELETE", f"/v1/datasets/{dsid}/warm")
            _progress_end()
            fail(
                f"warm stopped at {format_size(w['done_bytes'])} of "
                f"{format_size(w['target_bytes'])}: run it again to resume",
                130,
            )
    _progress_end()
    if w["state"] == "error":
        raise SilofsError(f"warm of {w['dataset']} stopped: {w['error']}")
    if w["state"] != "done":
        raise SilofsError(f"warm of {w['dataset']} was {w['state']}")
    if paths and w.get("matched_objects") == 0:
        # A typo or a directory's name: "warmed ...: 0B cached of 0B", exit 0, and the
        # epoch it was for read cold.
        raise SilofsError(
            f"no object of {w['dataset']} matches --paths {' '.join(map(repr, paths))}: a "
            "glob matches whole keys from the dataset's root (`*` also matches /; "
            "'train/*' for the objects under train/"
            + (
                "; `[...]` is a set: `[[]` matches a literal '['"
                if any("[" in p for p in paths)
                else ""
            )
            + ")"
        )
    say(
        f"silofs: warmed {w['dataset']}: {format_size(w['done_bytes'])} cached of "
        f"{format_size(w['matched_bytes'])} ({format_size(w['fetched_bytes'])} fetched, "
        f"{format_size(w['skipped_bytes'])} already cached) in {w['elapsed_s']:.1f}s"
        + (
            f"; left out {count(w['denied_objects'], 'file')} you may not read"
            if w.get("denied_objects")
            else ""
        )
    )
    if w.get("failed_chunks"):
        say(
            f"silofs: warning: {count(w['failed_chunks'], 'chunk')} could not be placed at their "
            "homes (members slow, down or refusing them: `silofs-ctl cluster status --nodes "
            "SOCKET` shows each member's errors); run the warm again to fill them"
        )


_progress_shown = False


def _follow_warm(client: ControlClient, dsid: int, w: dict) -> dict:
    """Poll the warm until it ends; a progress bar (bytes, rate, ETA) on a terminal. A
    pause (the job's allocation set to 0: promise 2) is said once, on a line of its own
    whether or not on a terminal, and so is the resume: a warm never hangs silently."""
    global _progress_shown
    tty = sys.stderr.isatty()
    paused = False
    while w["state"] == "running":
        if (w.get("io_allocation") == 0) != paused:
            paused = not paused
            _progress_end()
            job = w["job"]
            say(
                f"silofs: warm paused: job {job}'s remote IO allocation is 0; it goes on "
                f"once raised (silofs-ctl allocate-io {job} RATE); Ctrl-C stops it"
                if paused
                else f"silofs: warm resumed: job {job}'s remote IO allocation is "
                f"{format_rate(w.get('io_allocation'))}",
                err=True,
            )
        if tty:
            click.echo("\r" + _progress_line(w, paused), nl=False, err=True)
            _progress_shown = True
        time.sleep(0.2)  # the poll's period
        w = client.request("GET", f"/v1/datasets/{dsid}/warm")
    return w


def _progress_line(w: dict, paused: bool = False) -> str:
    total, done, rate = w["target_bytes"], w["done_bytes"], w["bytes_per_s"]
    frac = done / total if total else 0.0
    bar = "#" * int(frac * 24)
    eta = f"{(total - done) / rate:.0f}s" if rate > 0 and total > done else "--"
    return f"warm [{bar:<24}] {frac:4.0%} {format_size(done)}/{format_size(total)} " + (
        "paused   " if paused else f"{format_rate(rate)} ETA {eta}   "
    )


def _progress_end() -> None:
    global _progress_shown
    if _progress_shown:
        click.echo("", err=True)
        _progress_shown = False


@main.command()
@click.option(
    "--dir",
    "root",
    default=None,
    help="Where the sample data, cache and mount go (default: /var/tmp/silofs-demo-USER).",
)
@click.option("--epochs", default=2, show_default=True, help="How many passes to read.")
@click.option("--files", default=500, hidden=True)
@click.option("--big-mb", default=64, hidden=True)
@one_line_errors
def demo(root: str | None, epochs: int, files: int, big_mb: int) -> None:
    """Mount a local sample dataset, read it twice, show the cache at work."""
    from pathlib import Path

    from silofs.demo import default_dir, run_demo

    run_demo(Path(root) if root else default_dir(), epochs, files, big_mb << 20)


__all__ = ["main", "NodeSettings"]
