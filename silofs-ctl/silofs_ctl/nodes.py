"""The controller's side of one node daemon: the three calls it makes, over its Unix
socket or its mutual-TLS listener (tls://HOST:PORT).

Owns: the NodeClient interface (what the controller needs from a daemon), NodeError (a
node unreachable, or refusing one request), and SocketNode, its implementation over
silofs/control/client.py (one TLS context, from [tls], for every remote node). Never:
decides what to ask for, retries, or lets a failure escape as anything but NodeError.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, Protocol

from .controller_config import ControllerConfig, NodeConfig
from .tomlcheck import ConfigError

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
    """NodeClient over a daemon's Unix control socket, or tls://HOST:PORT."""

    def __init__(self, socket_path: str, timeout: float, tls: Any = None) -> None:
        from silofs.control.client import ControlClient

        self.client = ControlClient(socket_path, timeout=timeout, tls=tls)

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

# For the one-node commands (status, allocate-*, forget, job): a directory holding
# controller.pem, controller.key and ca.pem (`silofs-ctl certs init`), used when
# --socket is a tls:// address.
TLS_DIR_ENV = "SILOFS_CTL_TLS"
SOCKET_HELP = (
    "The node daemon's control socket, or tls://HOST:PORT (certs: $SILOFS_CTL_TLS); default: "
    "$SILOFS_SOCKET, else root's /run/silofs/control.sock, a user's "
    "$XDG_RUNTIME_DIR/silofs/control.sock or /tmp/silofs-UID/silofs/control.sock."
)


def one_node_client(address: str, timeout: float = 10.0) -> Any:
    """A ControlClient for `--socket ADDRESS`: a Unix socket, or tls://HOST:PORT with
    the certificates in $SILOFS_CTL_TLS. ControlError (one line, as for a node that
    does not answer) if those are missing or cannot be loaded."""
    import os
    import ssl

    from silofs.control.client import (
        TLS_PREFIX,
        ControlClient,
        ControlError,
        client_tls_context,
        own_certificate_problem,
        tls_files_problem,
    )

    context = None
    if address.startswith(TLS_PREFIX):
        directory = os.environ.get(TLS_DIR_ENV)
        if not directory:
            raise ControlError(
                f"{address} needs a client certificate: set {TLS_DIR_ENV} to a directory "
                "with controller.pem, controller.key and ca.pem (`silofs-ctl certs init`)"
            )
        files = [os.path.join(directory, n) for n in ("controller.pem", "controller.key", "ca.pem")]
        try:
            context = client_tls_context(*files)
        except (OSError, ssl.SSLError) as exc:
            reason = tls_files_problem(*files, exc)
            raise ControlError(f"{TLS_DIR_ENV}: cannot load {', '.join(files)}: {reason}") from None
        if problem := own_certificate_problem(files[0], files[1]):
            raise ControlError(f"{TLS_DIR_ENV}: {problem}")
    return ControlClient(address, timeout=timeout, tls=context)


def socket_clients(config: ControllerConfig) -> ClientFactory:
    """Clients for every node; the [tls] files are loaded once, here, so a bad one stops
    the controller with one line (ConfigError) instead of failing every poll."""
    context = None
    if config.tls is not None:
        import ssl

        from silofs.control.client import (
            client_tls_context,
            own_certificate_problem,
            tls_files_problem,
        )

        try:
            context = client_tls_context(config.tls.cert, config.tls.key, config.tls.ca)
        except (OSError, ssl.SSLError) as exc:
            reason = tls_files_problem(config.tls.cert, config.tls.key, config.tls.ca, exc)
            if isinstance(exc, FileNotFoundError):
                # Not made yet (the shipped controller.toml names pki/ files): say how.
                made_by = os.path.dirname(config.tls.cert) or "."
                reason += f" (make them with `silofs-ctl certs init {made_by}`)"
            raise ConfigError(
                f"[tls]: cannot load {config.tls.cert}, {config.tls.key} or {config.tls.ca}: "
                f"{reason}"
            ) from None
        if problem := own_certificate_problem(config.tls.cert, config.tls.key):
            raise ConfigError(f"[tls]: {problem}")
    return lambda node: SocketNode(node.socket, config.timeout, context)
