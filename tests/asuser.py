"""Run a function as another local user: fork, drop to its uid, gid and groups, call.

Owns the one fork+setuid helper the tests and benches share (tests/integration/
test_security.py, tests/reliability/test_fuzz_control.py, bench/authz_flood.py): the
daemon then sees the child through SO_PEERCRED exactly as it sees any local user. The
child is forked, not exec'ed, because this host's Python lives under /root, which other
users cannot enter. Never runs as root in the child (it refuses uid 0, which would test
nothing) and never returns into the caller's stack from the child: the child always
leaves with os._exit, so pytest's or main()'s cleanup runs only in the parent.
Needs root in the parent (setuid). Standard library only: bench scripts import it too.
"""

from __future__ import annotations

import logging
import os
import pickle
import pwd
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

NOBODY = 65534  # a local user with no rights (Debian's nobody/nogroup)


@dataclass(frozen=True)
class Identity:
    """Who the child becomes: uid, primary gid, supplementary groups."""

    uid: int
    gid: int
    groups: tuple[int, ...] = field(default=())
    name: str = ""

    @classmethod
    def of(cls, name: str) -> Identity:
        """A user from the password database, with its groups from the group database
        (what a login would give it)."""
        p = pwd.getpwnam(name)
        return cls(p.pw_uid, p.pw_gid, tuple(os.getgrouplist(name, p.pw_gid)), name)

    @classmethod
    def nobody(cls, uid: int = NOBODY) -> Identity:
        """uid and gid `uid`, no supplementary groups."""
        return cls(uid, uid, (), f"uid {uid}")


class AsUserError(AssertionError):
    """The function raised in the child (its type and message), or the child died."""


class Child:
    """A forked child running fn as another user; result() waits for what it returned."""

    def __init__(self, who: Identity, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        if who.uid == 0:
            raise ValueError("as_user is for unprivileged users, not root")
        self.who = who
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into the caller
            code = 1
            try:
                os.close(r)
                try:
                    os.setgroups(list(who.groups))
                    os.setgid(who.gid)
                    os.setuid(who.uid)
                    out: tuple[str, Any] = ("ok", fn(*args))
                except BaseException as exc:  # noqa: BLE001 - reported to the parent
                    out = ("error", f"{type(exc).__name__}: {exc}")
                try:
                    data = pickle.dumps(out)
                except Exception as exc:  # noqa: BLE001 - an unpicklable result
                    data = pickle.dumps(("error", f"unpicklable result: {exc}"))
                view = memoryview(data)
                while view:
                    view = view[os.write(w, view) :]
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        self.pid = pid
        self._r = r

    def result(self) -> Any:
        """What fn returned; AsUserError if it raised or the child died."""
        with os.fdopen(self._r, "rb") as f:
            data = f.read()
        _, status = os.waitpid(self.pid, 0)
        if not data:
            raise AsUserError(f"as {self.who.name or self.who.uid}: child died (status {status})")
        kind, value = pickle.loads(data)
        if kind != "ok":
            raise AsUserError(f"as {self.who.name or self.who.uid}: {value}")
        return value


def start_as(who: Identity, fn: Callable[..., Any], *args: Any) -> Child:
    """fn(*args) in a forked child running as `who`, while the caller goes on (the
    child inherits the caller's file descriptors: pipes to signal it through)."""
    return Child(who, fn, args)


def as_user(who: Identity, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) in a forked child running as `who`; its return value (picklable)."""
    return Child(who, fn, args).result()


__all__ = ["NOBODY", "AsUserError", "Child", "Identity", "as_user", "start_as"]
