"""Who is at the other end of a control connection, and what they may change.

Owns SO_PEERCRED credentials and the admin check (root, or a member of admin_group,
supplementary groups included). Never trusts anything a peer says about itself.
"""

from __future__ import annotations

import os
import pwd
import socket
import struct
from dataclasses import dataclass
from typing import Any

_UCRED = struct.Struct("iII")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}


@dataclass
class Peer:
    """Credentials of the process at the other end of a connection (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int


def peer_credentials(sock: Any) -> Peer:
    """SO_PEERCRED of a connected Unix socket (stdlib or trio socket)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return Peer(pid=pid, uid=uid, gid=gid)


def peer_may_change(peer: Peer, admin_gid: int | None) -> bool:
    """Whether a peer may call mutating endpoints: root, or a member of admin_gid.

    Membership counts the primary gid from SO_PEERCRED and the user's
    supplementary groups from the group database (the peer's own process
    groups are not visible through SO_PEERCRED).
    """
    if peer.uid == 0:
        return True
    if admin_gid is None:
        return False
    if peer.gid == admin_gid:
        return True
    try:
        user = pwd.getpwuid(peer.uid)
    except KeyError:  # a uid without a passwd entry has no supplementary groups
        return False
    try:
        return admin_gid in os.getgrouplist(user.pw_name, user.pw_gid)
    except OSError:
        return False
