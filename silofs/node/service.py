"""The node daemon process: its socket, its tasks, its signals and systemd.

Owns the life of `silofs daemon`: starting the Daemon's background tasks (writer,
mount reaper, enforcer), serving the control API on the Unix socket (and, when
[control] tcp_listen is set, to mutual-TLS clients, who find only the routes the table
gives a remote controller), telling systemd READY=1/STOPPING=1, a clean stop (flush,
sync) on SIGTERM/SIGINT, and SIGHUP (reopen the log file, if any; never an exit). The
state and its operations live in node/daemon.py, the API in node/routes.py. Never
handles a request itself.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import resource
import signal
import socket
import ssl
import time

import trio

from silofs import __version__, heap, sealed
from silofs.config import ClusterSettings, NodeSettings
from silofs.control.peer import peer_may_change
from silofs.control.server import (
    ConnectionLimits,
    TLSLimits,
    bind_tcp,
    bind_unix,
    serve_tls,
    serve_unix,
)
from silofs.logsetup import reopen_log_files, survive_sighup
from silofs.node.daemon import Daemon
from silofs.node.metrics import open_metrics, serve_tcp
from silofs.node.routes import build_router
from silofs.node.supervise import run_forever
from silofs.node.views import status_view
from silofs.units import count, format_size

log = logging.getLogger(__name__)


async def serve(daemon: Daemon, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
    """Run the daemon until SIGTERM/SIGINT; task_status.started() once it answers."""
    settings = daemon.settings
    router = build_router(daemon)
    daemon.metrics.watch(lambda: status_view(daemon))
    for job in [*daemon.allocs.io, *daemon.allocs.registrations]:
        daemon.job(job)  # persisted allocations are listed before their jobs mount
    # Bound before any task starts: a busy socket is one AddressInUseError, not a failure
    # inside a nursery (which trio reports as an ExceptionGroup).
    remote = bind_remote(settings)  # first: a refusal leaves no socket file behind
    metrics = await open_metrics(settings.metrics_address) if settings.metrics_address else None
    bound = bind_unix(settings.socket, mode=settings.socket_mode, uid=None, gid=daemon.socket_gid)
    # The signal handler is in place before READY=1: a SIGTERM right after systemd hears
    # READY still gets STOPPING=1, a flush and a final sync. SIGHUP reopens the log file
    # (logrotate) and never ends the daemon, with or without a log file.
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async with trio.open_nursery() as nursery:
            daemon.nursery = nursery
            # Every background loop is supervised (node/supervise.py): a failure is one
            # ERROR line and the loop restarts after a backoff; the daemon goes on. The
            # writer restarts too: offers queued meanwhile wait (or are dropped, counted,
            # when the queue is full); a failure that persists (a full disk) is one ERROR
            # line, then DEBUG per restart (backoff up to a minute) and an ERROR summary
            # every 10 minutes until a batch commits again; status says it meanwhile.
            nursery.start_soon(
                functools.partial(
                    run_forever, "the writer", daemon.writer.run,
                    progress=lambda: daemon.writer.stats.batches,
                )
            )  # fmt: skip
            for what, loop in (
                ("the writer's sync loop", daemon.writer.sync_loop),
                ("the mount reaper", daemon.reap_mounts),
                ("the enforcer", daemon.enforce_loop),
                ("the cache dir's watch", daemon.watch_cache_dir),
                ("the cluster's prober", daemon.cluster.probe_loop),
            ):
                nursery.start_soon(run_forever, what, loop)
            # Fitted to the fd limit now and again whenever a member list is put in force.
            connections = connection_limits(daemon)
            daemon.cluster.applied = functools.partial(refit_connections, connections, daemon)
            await nursery.start(
                lambda task_status: serve_unix(
                    settings.socket,
                    router,
                    mode=settings.socket_mode,
                    gid=daemon.socket_gid,
                    max_body=1 << 20,
                    connections=connections,
                    bound=bound,
                    task_status=task_status,
                )
            )
            if remote is not None:
                sock, context = remote
                await nursery.start(
                    lambda task_status: serve_tls(
                        sock,
                        router,
                        context,
                        tls_limits=TLSLimits(
                            max_connections=settings.tcp_max_connections,
                            handshake_seconds=settings.tls_handshake_seconds,
                            handshakes_per_second=settings.tls_handshakes_per_second,
                            allowed_names=frozenset(settings.tls_client_names),
                            **member_bounds(settings),
                            member_bounds=functools.partial(member_bounds_in_force, daemon),
                        ),
                        task_status=task_status,
                    )
                )
            if metrics is not None:
                await nursery.start(serve_tcp, metrics, daemon.metrics.render)
            log.info(
                "silofs %s daemon ready: socket %s, cache %s (%s)",
                __version__,
                settings.socket,
                settings.cache_dir,
                format_size(daemon.cache_size),
            )
            sd_notify("READY=1")
            task_status.started()
            stop = trio.Event()

            async def on_signal() -> None:
                async for signum in signals:
                    if signum == signal.SIGHUP:
                        files = reopen_log_files()
                        log.info(
                            "received SIGHUP: %s",
                            f"reopened {', '.join(files)}"
                            if files
                            else "no log file to reopen; ignored",
                        )
                        continue
                    log.info("received %s; shutting down", signal.Signals(signum).name)
                    stop.set()
                    return

            nursery.start_soon(on_signal)
            idle = daemon.origin.get("idle_exit_seconds")
            if idle:
                nursery.start_soon(idle_exit, daemon, stop, float(idle))
            await stop.wait()
            sd_notify("STOPPING=1")
            try:
                await daemon.writer.flush()
            except Exception as exc:  # noqa: BLE001
                # A damaged env: those chunks are lost, not the exit. Not only lmdb.Error:
                # on damaged pages py-lmdb's Cursor.delete raises SystemError, and a
                # flipped byte in a row can fail an unpack (test_byteflips.py's long
                # form); the supervisor restarts the writer for those while serving,
                # and here the exit must still end in one line and a sync.
                log.error("the last admissions failed: %s: %s", type(exc).__name__, exc)
            nursery.cancel_scope.cancel()
    await trio.to_thread.run_sync(daemon.store.sync)


def bind_remote(settings: NodeSettings) -> tuple[socket.socket, ssl.SSLContext] | None:
    """[control] tcp_listen: the bound TCP socket and the mutual-TLS context, or None when
    it is off (the default). Loaded before any task starts, so a bad certificate or a
    busy port stops the start with one line."""
    if settings.tcp_listen is None:
        return None
    from silofs.control.tls import parse_tcp_address, server_context

    assert settings.tls_cert and settings.tls_key and settings.tls_client_ca  # _validate
    context = server_context(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
    host, port = parse_tcp_address(settings.tcp_listen)
    return bind_tcp(host, port), context


# File descriptors kept for everything but connections to the control socket: LMDB,
# logs, the metrics listener's connections (METRICS_CONNECTIONS), and below, per fetch
# thread, the store client's connections.
_FD_HEADROOM = 256
_FDS_PER_FETCH_THREAD = 4


def raise_nofile() -> int:
    """Raise RLIMIT_NOFILE's soft limit to its hard limit (a daemon holds a connection
    per client, store and peer: the default soft limit of 1024 is small); the soft
    limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:  # nr_open below an infinite hard limit
            log.warning("cannot raise the open-files limit from %d: %s", soft, exc)
    return soft


def fd_budget(s: NodeSettings, members: int) -> int:
    """File descriptors kept for everything but the control socket's connections: the
    TLS listener's connections, peer clients (`members`: the member list in force),
    store clients, LMDB, logs, metrics."""
    from silofs.node.peer_client import PEER_POOL  # what each member's pool may open

    return (
        _FD_HEADROOM
        # A member's connection holds its socket and an eventfd (control/thread_conn.py),
        # and so does a mount's connection served from a thread (its socket is counted
        # among the control socket's).
        + 2 * s.tcp_max_connections
        + ConnectionLimits.threads
        + members * PEER_POOL
        + s.fetch_threads * _FDS_PER_FETCH_THREAD
        + sealed.fds_held()
    )


def member_bounds(s: NodeSettings) -> dict[str, float]:
    """The peer bounds a member's connection is held to on this node's listener: what
    an asking member waits for a request to be answered (docs/SEMANTICS.md), and how
    long it may sit idle (just past its own pool's close: peer_client.py; also when
    the member list is pushed only later)."""
    from silofs.node.peer_client import LISTENER_IDLE_SECONDS

    idle = {"member_idle_seconds": LISTENER_IDLE_SECONDS}
    if s.cluster is None:
        return idle
    return {
        "member_request_seconds": s.cluster.peer_timeout_seconds,
        "member_floor_rate": float(s.cluster.peer_floor_rate),
        **idle,
    }


def member_bounds_in_force(daemon: Daemon) -> tuple[float, float]:
    """The peer bounds of the member list in force (a pushed list's peer_timeout_seconds
    and peer_floor_rate, or silofs.toml's; the defaults before any list): what members'
    requests and answers on this node's listener are held to, as each asking member
    holds its own asks (peer_client.Bounds)."""
    config = daemon.cluster.config or daemon.settings.cluster or ClusterSettings("", ())
    return config.peer_timeout_seconds, float(config.peer_floor_rate)


def members_in_force(daemon: Daemon) -> int:
    """The members of the list in force (silofs.toml's, or one pushed later, at start
    or since), 0 outside a cluster."""
    config = daemon.cluster.config
    return len(config.members) if config is not None else 0


def connection_limits(daemon: Daemon) -> ConnectionLimits:
    """The configured limits, with the total lowered to fit RLIMIT_NOFILE minus every
    other kind of connection's cap (fd_budget): running out of fds fails misses,
    listings and peers, so each kind of connection must hit its own limit first.
    Fitted again to every member list put in force later (refit_connections)."""
    s = daemon.settings
    limits = ConnectionLimits(
        per_uid=s.max_connections_per_uid,
        total=s.max_connections,
        reserve=64,
        trusted=lambda peer: peer_may_change(peer, daemon.admin_gid),
    )
    refit_connections(limits, daemon)
    return limits


def refit_connections(limits: ConnectionLimits, daemon: Daemon) -> None:
    """Set `limits`' total and reserve for the member list in force: each member's pool
    may hold PEER_POOL connections, so a list pushed with many more members than at
    start must take its room from the control socket's connections, never from the fds
    kept for mounts' misses, store fetches and peers. The listener reads them at each
    accept; connections already open stay (they close or are evicted as usual)."""
    s = daemon.settings
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    total, reserve = s.max_connections, 64
    members = members_in_force(daemon)
    headroom = fd_budget(s, members)
    if soft != resource.RLIM_INFINITY and total + reserve > soft - headroom:
        room = max(64, soft - headroom)
        total = max(16, room * 3 // 4)
        reserve = max(4, room // 4)
        if (total, reserve) != (limits.total, limits.reserve):
            # Below the floor of 64 the connections it sets do not fit either: say that
            # the limit is too low, not that they fit (accept absorbs EMFILE meanwhile).
            short = soft - headroom < 64
            log.warning(
                "max_connections %d does not fit the fd limit %d (%s in the cluster): "
                "using %d (+%d for admins)%s",
                s.max_connections,
                soft,
                count(members, "member"),
                total,
                reserve,
                f", more than the limit leaves ({max(0, soft - headroom)}): raise it "
                "(LimitNOFILE=, ulimit -n)"
                if short
                else "",
            )
    elif (total, reserve) != (limits.total, limits.reserve):
        log.info("max_connections %d (+%d for admins) fits the fd limit %d again", total,
                 reserve, soft)  # fmt: skip
    limits.total, limits.reserve = total, reserve


def under_systemd() -> bool:
    """Started by systemd (a unit sets INVOCATION_ID; Type=notify sets NOTIFY_SOCKET)."""
    return bool(os.environ.get("INVOCATION_ID") or os.environ.get("NOTIFY_SOCKET"))


async def idle_exit(daemon: Daemon, stop: trio.Event, seconds: float) -> None:
    """Set `stop` once nothing has used the daemon for `seconds`: no mount registered,
    no dataset being listed, no warm running. Status requests do not count as use."""
    idle_since = time.monotonic()
    while not stop.is_set():
        await trio.sleep(min(1.0, seconds / 4))
        now = time.monotonic()
        if daemon.busy():
            idle_since = now
        elif now - max(idle_since, daemon.last_used) >= seconds:
            log.info("nothing used the daemon for %.0fs (idle_exit_seconds): exiting", seconds)
            stop.set()


def sd_notify(message: str) -> None:
    """Tell systemd (Type=notify) about our state; a no-op outside systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(message.encode(), addr)
    except OSError as exc:
        log.warning("sd_notify failed: %s", exc)


# Allocations of tracked objects between two young collections of the cyclic GC
# (CPython's default: 700). A fanned-out first listing makes several per object and
# keeps 2 x list_workers pages in flight, so at 700 many survive young collections, are
# promoted, and the promotions set off full collections over the whole heap: 0.2 s of
# CPU per 100 k objects listed, a third of the listing's (bench/README.md).
GC_YOUNG = 10_000


def tune_gc() -> None:
    """The daemon's GC thresholds (GC_YOUNG; the older generations' as they were)."""
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG, older, oldest)


def run_daemon(settings: NodeSettings, started_by: str = "manual") -> None:
    """Run the daemon in the foreground until SIGTERM/SIGINT (or idle exit). Raises
    SilofsError. `started_by` is "auto" when `silofs mount` started it."""
    tune_gc()
    # Admission holds up to its queue's bound of chunk buffers, and as much again while
    # a write runs: that much freed heap is kept for the next cold read (silofs/heap.py).
    heap.keep_freed(2 * settings.admission_queue_bytes)
    nofile = raise_nofile()
    log.debug("open-files limit: %d", nofile)
    sealed.limit_live(nofile)
    # Before anything slow (opening the cache, moving a damaged one aside): a SIGHUP
    # while starting or stopping must not end the daemon either. serve() handles it
    # itself while it runs.
    survive_sighup()
    daemon = Daemon(settings)
    # A daemon `silofs mount` started is never the service, even when that mount runs
    # inside a unit (silofs-mount@.service): it is an auto daemon with an idle exit.
    service = under_systemd() and started_by != "auto"
    idle = settings.idle_exit_seconds
    if idle and service:
        log.info("under systemd: idle_exit_seconds=%s is not applied", idle)
        idle = None
    daemon.origin = {
        "started_by": "service" if service else started_by,
        "pid": os.getpid(),
        "parent_pid": os.getppid(),
        "uid": os.getuid(),
        "idle_exit_seconds": idle,
    }
    try:
        trio.run(serve, daemon)
    finally:
        daemon.cluster.close()
        daemon.writer.close()
        daemon.store.close()
        os.close(daemon.lock_fd)


__all__ = ["run_daemon", "serve", "sd_notify", "tune_gc"]
