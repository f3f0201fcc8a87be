"""The node daemon's local HTTP/1.1 + JSON transport over a Unix socket.

Owns the wire: ``server.py`` is the trio server (framing, limits, keep-alive),
``router.py`` maps paths to handlers, ``peer.py`` holds peer credentials and the admin
check, and ``client.py`` the blocking and trio clients. Carries both the
operator/controller control API and the chunk data path between mount processes
and the daemon.

Never holds silofs business logic (routes, datasets, cache policy): the daemon
registers its handlers on a Router (silofs/node/routes.py). This package deliberately
re-exports nothing, so that importing the stdlib-only blocking client never pulls in trio.
"""
