"""GET /v1/status and GET /metrics: the node's state for anyone on the node (and a
remote controller). Never changes anything."""

from __future__ import annotations

from silofs.control.router import Request, Response, json_response
from silofs.node.daemon import Daemon
from silofs.node.metrics import CONTENT_TYPE
from silofs.node.views import status_view


async def status(d: Daemon, req: Request) -> Response:
    return json_response(status_view(d))


async def metrics(d: Daemon, req: Request) -> Response:
    return Response(200, d.metrics.render(), CONTENT_TYPE)
