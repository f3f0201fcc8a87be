"""Who is at the other end of a control connection, and what they may change.

Owns SO_PEERCRED credentials, the peer's groups (primary plus supplementary, from the
group database) and the admin check (root, or a member of admin_group), both ways: the
daemon judging a client, and a client (`silofs`, a mount process, silofs-ctl) judging
the daemon behind a Unix socket (``check_daemon_peer``). Never trusts anything a peer
says about itself: only the kernel's credentials and the databases.
"""

from __future__ import annotations

import os
import pwd
import socket
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from silofs.units import is_digits

_UCRED = struct.Struct("iII")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}
# NSS lookups can be slow (LDAP) and misses ask for groups on every request: remember
# them a little while. A group change takes effect within _GROUPS_TTL seconds.
_GROUPS_TTL = 30.0
_GROUPS_MAX = 4096
_groups_cache: dict[tuple[int, int], tuple[float, frozenset[int]]] = {}


@dataclass
class Peer:
    """Credentials of the process at the other end of a connection (SO_PEERCRED), or
    of a remote controller on the TLS listener: then ``remote`` is the name from its
    client certificate and uid/gid are REMOTE_UID, which is no local uid (``-1`` is
    what chown(2) reads as "unchanged", never an owner), so no uid-based rule (root,
    the daemon's own uid, a job's or mount's owner) ever matches a remote peer."""

    pid: int
    uid: int
    gid: int
    remote: str | None = None
    # A remote peer's certificate: its DNS and IP names (sorted: a peer stays plain,
    # JSON-able data), and whether it carries the node role (a cluster member's
    # certificate, control/tls.py NODE_ROLE_URI).
    names: tuple[str, ...] = ()
    node: bool = False


# uid and gid of a remote (TLS) peer: matches no local user, root or the daemon's uid.
REMOTE_UID = -1


def remote_peer(name: str, names: Iterable[str] = (), node: bool = False) -> Peer:
    """The Peer of a client that proved ``name`` (and ``names``) with a certificate: a
    controller, or with the node role a cluster member."""
    return Peer(
        pid=0, uid=REMOTE_UID, gid=REMOTE_UID, remote=name, names=tuple(sorted(names)), node=node
    )


def peer_credentials(sock: Any) -> Peer:
    """SO_PEERCRED of a connected Unix socket (stdlib or trio socket)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return Peer(pid=pid, uid=uid, gid=gid)


def peer_groups(peer: Peer) -> frozenset[int]:
    """The gids a peer reads files with: its gid from SO_PEERCRED plus the supplementary
    groups of its uid in the group database.

    SO_PEERCRED does not carry supplementary groups. The database is what the user gets
    at every login, so it is what the user could read with on this host anyway; a process
    that dropped groups gains nothing it could not get back by logging in again.
    """
    now = time.monotonic()
    hit = _groups_cache.get((peer.uid, peer.gid))
    if hit is not None and now - hit[0] < _GROUPS_TTL:
        return hit[1]
    groups = {peer.gid}
    try:
        user = pwd.getpwuid(peer.uid)
        groups.update(os.getgrouplist(user.pw_name, user.pw_gid))
    except (KeyError, OSError):  # a uid without a passwd entry has no other groups
        pass
    if len(_groups_cache) >= _GROUPS_MAX:
        _groups_cache.clear()
    _groups_cache[(peer.uid, peer.gid)] = (now, frozenset(groups))
    return frozenset(groups)


def peer_may_change(peer: Peer, admin_gid: int | None) -> bool:
    """Whether a peer is trusted: root, the daemon's own uid (a user's own daemon holds
    only that user's credentials and files), or a member of admin_gid (supplementary
    groups included). Trusted peers may change allocations, name store options, open any
    dataset, act on any job, and are exempt from per-uid limits (docs/SECURITY.md).
    A remote peer (TLS, client certificate checked) has the admin role and nothing else:
    it finds only the routes whose entry names a remote controller (node/routes.py), and
    no uid-based rule matches it."""
    if peer.remote is not None:
        return not peer.node  # a member's certificate is no admin
    if peer.uid in (0, os.geteuid()):
        return True
    if admin_gid is None:
        return False
    return admin_gid in peer_groups(peer)


# A client's view of the daemon: who may serve a control socket. Root (the system
# daemon) and the client's own uid (the daemon `silofs mount` starts for its user) always;
# a daemon run as a service user only when the client is told so by this variable (a user
# name or a uid), as it is told the socket's path by SILOFS_SOCKET.
DAEMON_USER_ENV = "SILOFS_DAEMON_USER"


class UntrustedDaemonError(Exception):
    """The process serving a control socket is not a daemon this client trusts."""


def trusted_daemon_uids() -> frozenset[int]:
    """uids a client accepts at the other end of a control socket (docs/SECURITY.md
    "The daemon, as seen by a client"); UntrustedDaemonError if SILOFS_DAEMON_USER names
    no user."""
    uids = {0, os.geteuid()}
    name = os.environ.get(DAEMON_USER_ENV, "").strip()
    if name:
        if is_digits(name):
            uids.add(int(name))
        else:
            try:
                uids.add(pwd.getpwnam(name).pw_uid)
            except KeyError:
                raise UntrustedDaemonError(
                    f"{DAEMON_USER_ENV}={name!r} names no user of this host"
                ) from None
    return frozenset(uids)


def check_daemon_peer(sock: Any, address: str) -> Peer:
    """The credentials of the process serving ``sock`` (a connected Unix socket), if it
    is a daemon this client trusts; UntrustedDaemonError with one line otherwise.

    Checked right after connect, before a byte is sent: a request carries a mount's
    dataset, job and paths, and an answer is served to the mount's readers as the
    dataset's bytes. SO_PEERCRED names the process that called listen() on the socket,
    whatever the socket file's owner or the path's directories say."""
    peer = peer_credentials(sock)
    trusted = trusted_daemon_uids()
    if peer.uid not in trusted:
        allowed = " or ".join(f"uid {u}" for u in sorted(trusted))
        raise UntrustedDaemonError(
            f"refusing the control socket {address}: it is served by uid {peer.uid} "
            f"(pid {peer.pid}), not {allowed} (set {DAEMON_USER_ENV} to trust a daemon "
            "run as another user)"
        )
    return peer
