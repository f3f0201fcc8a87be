"""The controller's side of one node daemon: the three calls it makes, over the socket.

Owns: the NodeClient interface (what the controller needs from a daemon), NodeError (a
node unreachable, or refusing one request), and SocketNode, its implementation over
silofs/control/client.py. Never: decides what to ask for, retries, or lets a failure
escape as anything but NodeError.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from .controller_config import ControllerConfig, NodeConfig

log = logging.getLogger(__name__)


class NodeClient(Protocol):
    """What the controller needs from one node daemon (silofs/control/client.py)."""

    def status(self) -> dict: ...

    def put_cache(self, dataset: str, nbytes: int) -> None: ...

    def put_io(self, job: str, rate: int | None) -> None: ...


class NodeError(Exception):
    """A node did not answer (unreachable) or refused one request; one line."""

    def __init__(self, message: str, unreachable: bool = True) -> None:
        super().__init__(message)
        self.unreachable = unreachable


class SocketNode:
    """NodeClient over a daemon's Unix control socket."""

    def __init__(self, socket_path: str, timeout: float) -> None:
        from silofs.control.client import ControlClient

        self.client = ControlClient(socket_path, timeout=timeout)

    def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        from silofs.control.client import ControlError

        try:
            return self.client.request(method, path, body)
        except ControlError as exc:
            raise NodeError(str(exc), unreachable=exc.status is None) from None

    def status(self) -> dict:
        answer = self._call("GET", "/v1/status")
        if not isinstance(answer, dict):
            raise NodeError("GET /v1/status did not return a JSON object")
        return answer

    def put_cache(self, dataset: str, nbytes: int) -> None:
        from silofs.control.client import quote_segment

        self._call("PUT", f"/v1/datasets/{quote_segment(dataset)}/cache", {"bytes": nbytes})

    def put_io(self, job: str, rate: int | None) -> None:
        from silofs.control.client import quote_segment

        self._call("PUT", f"/v1/jobs/{quote_segment(job)}/io", {"bytes_per_s": rate})

    def close(self) -> None:
        self.client.close()


ClientFactory = Callable[[NodeConfig], NodeClient]


def socket_clients(config: ControllerConfig) -> ClientFactory:
    return lambda node: SocketNode(node.socket, config.timeout)
