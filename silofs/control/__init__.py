"""The node daemon's local HTTP/1.1 + JSON transport over a Unix socket.

Owns the wire: ``server.py`` is the trio server (framing, limits, keep-alive),
``router.py`` the route record and the router (which route a request names, whether
its peer may call it, how large a body it may send), ``peer.py`` peer credentials and
the admin check, and ``client.py`` the blocking and trio clients. Carries both the
operator/controller control API and the chunk data path between mount processes
and the daemon.

Never holds silofs business logic (datasets, cache policy): the daemon's route table
(silofs/node/routes.py) is what a Router serves. This package deliberately
re-exports nothing, so that importing the stdlib-only blocking client never pulls in trio.
"""
