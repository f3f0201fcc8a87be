"""Run a function as another local user: fork, drop to its uid, gid and groups, call.

Owns the fork+setuid helpers the tests and benches share (tests/integration/
test_security.py, tests/reliability/test_fuzz_control.py, bench/authz_flood.py): the
daemon then sees the child through SO_PEERCRED exactly as it sees any local user. The
child is forked, not exec'ed, because a Python installed in root's home (pyenv) is one
other users cannot enter. Never runs as root in the child (it refuses uid 0, which would test
nothing) and never returns into the caller's stack from the child: the child always
leaves with os._exit, so pytest's or main()'s cleanup runs only in the parent.
Needs root in the parent (setuid). Standard library only: bench scripts import it too.
"""

from __future__ import annotations

import logging
import os
import pickle
import pwd
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

NOBODY = 65534  # a local user with no rights (Debian's nobody/nogroup)
# The parent's ends of every open Session's pipes. A child forked later inherits them
# and must close them: a copy of a session's write end held elsewhere means that
# session's child never sees EOF, and Session.close() would wait for it forever.
_SESSION_FDS: set[int] = set()


def _drop_inherited() -> None:
    for fd in list(_SESSION_FDS):
        try:
            os.close(fd)
        except OSError:
            pass


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
                _drop_inherited()
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


class Session:
    """A forked child running as `who` that stays alive between calls: what it does is
    done by one live process. The daemon forgets a mount whose registering process has
    exited (its reaper, every 2 s), so a test whose user registers a mount and then
    relies on it must send both through one Session. Functions and results travel as
    pickles (functions by name: module-level ones). close() ends the child."""

    def __init__(self, who: Identity) -> None:
        if who.uid == 0:
            raise ValueError("Session is for unprivileged users, not root")
        self.who = who
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: serve calls until the parent closes its end
            code = 1
            try:
                os.close(self._to_child)
                os.close(self._from_child)
                _drop_inherited()
                os.setgroups(list(who.groups))
                os.setgid(who.gid)
                os.setuid(who.uid)
                with os.fdopen(to_child_r, "rb") as inp, os.fdopen(from_child_w, "wb") as out:
                    while True:
                        try:
                            fn, args = pickle.load(inp)
                        except EOFError:
                            break
                        try:
                            reply: tuple[str, Any] = ("ok", fn(*args))
                        except BaseException as exc:  # noqa: BLE001 - reported to the parent
                            reply = ("error", f"{type(exc).__name__}: {exc}")
                        pickle.dump(reply, out)
                        out.flush()
                code = 0
            finally:
                os._exit(code)
        os.close(to_child_r)
        os.close(from_child_w)
        self.pid = pid
        _SESSION_FDS.update((self._to_child, self._from_child))
        self._out = os.fdopen(self._to_child, "wb")
        self._in = os.fdopen(self._from_child, "rb")

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) in the session's process; its return value, or AsUserError."""
        pickle.dump((fn, args), self._out)
        self._out.flush()
        try:
            kind, value = pickle.load(self._in)
        except EOFError:
            raise AsUserError(f"as {self.who.name or self.who.uid}: the session died") from None
        if kind != "ok":
            raise AsUserError(f"as {self.who.name or self.who.uid}: {value}")
        return value

    def close(self) -> None:
        """End the child: EOF on its input, then SIGKILL if it has not left within 5 s
        (a call still running)."""
        _SESSION_FDS.difference_update((self._to_child, self._from_child))
        self._out.close()  # EOF: the child leaves its loop
        self._in.close()
        deadline = time.monotonic() + 5
        while os.waitpid(self.pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                return
            time.sleep(0.01)


def start_as(who: Identity, fn: Callable[..., Any], *args: Any) -> Child:
    """fn(*args) in a forked child running as `who`, while the caller goes on (the
    child inherits the caller's file descriptors: pipes to signal it through)."""
    return Child(who, fn, args)


def as_user(who: Identity, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) in a forked child running as `who`; its return value (picklable)."""
    return Child(who, fn, args).result()


__all__ = ["NOBODY", "AsUserError", "Child", "Identity", "Session", "as_user", "start_as"]
