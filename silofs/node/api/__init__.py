"""The daemon's API handlers, one module per area (status, datasets, allocations, jobs,
mounts, chunks); node/routes.py is their table. A handler is
``async def handler(d: Daemon, req: Request, **params) -> Response``: it checks what the
request names (fields.py) and what the peer may do beyond its route's entry
(node/authz.py), then calls the Daemon. Never holds state of its own.
"""
