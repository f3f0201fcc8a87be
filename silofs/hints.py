"""Telling the node daemon what a mount's reader will read next (prefetch by hint).

Owns the client side of POST /v1/mounts/{id}/hints for code that runs where the mount
is (a training script): finding the mount's id from its mountpoint, turning file paths
into paths in the mount, and sending a long order in requests the daemon accepts
(at most MAX_PATHS paths and MAX_BODY bytes each; the first replaces the mount's hint,
the rest append to it). The daemon decides what to fetch and when (node/prefetch.py).
Never imports the node or mount side and never reads files; every failure is one
HintError (PrefetchSampler catches it: a hint is advice, never a reason to stop).

    from silofs import hints
    hints.send("/mnt/imagenet", ["train/n01/x.jpg", ...])
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
from collections.abc import Iterable, Iterator
from typing import Any

from silofs.config import default_socket
from silofs.control.client import ControlClient, ControlError, quote_segment

log = logging.getLogger(__name__)

# The daemon's limits (node/prefetch.py MAX_HINT_PATHS, the control server's 1 MiB
# body): one request stays within both.
MAX_PATHS = 65_536
MAX_BODY = 900 << 10


class HintError(Exception):
    """A hint could not be sent: no such mount, the daemon refused it, or is away.
    ``status`` is the daemon's HTTP status, None when it did not answer."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def mount_key(mountpoint: str, path: str | os.PathLike[str]) -> str:
    """`path` as the object key the mount shows it under: relative to the mountpoint
    (an absolute path must be inside it), '/'-separated, normalised. A pathlib path is
    a path too; bytes or a non-path are a HintError (a relative pathlib.Path reached
    str.replace as Path.replace and raised TypeError, which stopped a PrefetchSampler's
    epoch instead of its hints)."""
    try:
        path = os.fspath(path)
    except TypeError:
        raise HintError(f"{path!r} is not a file path") from None
    if not isinstance(path, str):
        raise HintError(f"{path!r} is not a file path (bytes: decode it with os.fsdecode)")
    if os.path.isabs(path):
        rel = os.path.relpath(path, mountpoint)
        if rel == os.curdir or rel.startswith(os.pardir + os.sep) or rel == os.pardir:
            raise HintError(f"{path} is not a file in the mount at {mountpoint}")
        path = rel
    key = posixpath.normpath(path.replace(os.sep, "/")).lstrip("/")
    if key in ("", ".") or key.startswith("../"):
        raise HintError(f"{path!r} is not a path in the mount")
    return key


def pieces(
    keys: list[str], max_paths: int = MAX_PATHS, max_body: int = MAX_BODY
) -> Iterator[list[str]]:
    """`keys` cut into lists a request carries: at most max_paths each, and a JSON body
    of at most about max_body bytes."""
    piece: list[str] = []
    size = 0
    for key in keys:
        cost = len(json.dumps(key)) + 1
        if piece and (len(piece) >= max_paths or size + cost > max_body):
            yield piece
            piece, size = [], 0
        piece.append(key)
        size += cost
    if piece:
        yield piece


class Hinter:
    """Hints for the mount at `mountpoint`, through the daemon at `socket` (default: the
    one `silofs mount` uses). `window`: bytes the daemon may fetch ahead of the reader
    (at most the node's prefetch_window; None: that)."""

    def __init__(
        self,
        mountpoint: str,
        *,
        socket: str | None = None,
        window: int | str | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.mountpoint = os.path.abspath(mountpoint)
        self.socket = socket or default_socket()
        self.window = window
        self.timeout = timeout
        self._mount_id: str | None = None

    def mount_id(self, refresh: bool = False) -> str:
        """The id of the mount at the mountpoint, from the daemon's status."""
        if self._mount_id is None or refresh:
            status = self._request("GET", "/v1/status")
            ids = [
                m["id"]
                for m in status.get("mounts", [])
                if m.get("mountpoint") in (self.mountpoint, os.path.realpath(self.mountpoint))
            ]
            if not ids:
                raise HintError(f"no silofs mount at {self.mountpoint} on {self.socket}")
            self._mount_id = ids[-1]
        return self._mount_id

    def send(
        self, paths: Iterable[str | os.PathLike[str]], *, append: bool = False
    ) -> dict[str, Any]:
        """Send paths in reading order (file paths, absolute or relative to the mount):
        the mount's new hint, or with `append` more of the current one. The daemon's
        view of the hint after the last request."""
        keys = [mount_key(self.mountpoint, p) for p in paths]
        view: dict[str, Any] = {}
        if not keys and not append:
            keys_pieces: Iterable[list[str]] = [[]]
        else:
            keys_pieces = pieces(keys)
        for i, piece in enumerate(keys_pieces):
            body: dict[str, Any] = {"paths": piece, "append": append or i > 0}
            if self.window is not None:
                body["window"] = self.window
            view = self._post(body)
        return view

    def status(self) -> dict[str, Any] | None:
        """The daemon's view of the mount's hint (None: it has none)."""
        try:
            return self._request("GET", f"/v1/mounts/{quote_segment(self.mount_id())}/hints")
        except HintError as exc:
            if exc.status == 404 and "has sent no hint" in str(exc):
                return None
            raise

    def cancel(self) -> None:
        try:
            self._request("DELETE", f"/v1/mounts/{quote_segment(self.mount_id())}/hints")
        except HintError as exc:
            if exc.status != 404 or "has sent no hint" not in str(exc):
                raise

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        path = f"/v1/mounts/{quote_segment(self.mount_id())}/hints"
        try:
            return self._request("POST", path, body)
        except HintError as exc:
            if exc.status != 404 or "no mount" not in str(exc):
                raise
        # The mount re-registered (a daemon restart keeps its id; a remount does not).
        path = f"/v1/mounts/{quote_segment(self.mount_id(refresh=True))}/hints"
        return self._request("POST", path, body)

    def _request(self, method: str, path: str, body: dict | None = None) -> Any:
        try:
            with ControlClient(self.socket, timeout=self.timeout) as c:
                return c.request(method, path, body)
        except ControlError as exc:
            raise HintError(str(exc), exc.status) from None


def send(
    mountpoint: str,
    paths: Iterable[str],
    *,
    window: int | str | None = None,
    socket: str | None = None,
) -> dict[str, Any]:
    """Tell the daemon the mount's reader will read `paths`, in that order (replacing
    any earlier hint of that mount). Returns the daemon's view of the hint; HintError
    if it could not be sent."""
    return Hinter(mountpoint, socket=socket, window=window).send(paths)


__all__ = ["MAX_BODY", "MAX_PATHS", "HintError", "Hinter", "mount_key", "pieces", "send"]
