"""One source address cannot lock the others out of the mutual-TLS listener: a client
opening connections as fast as it can (no TLS at all), or holding silent ones, gets at
most SOURCE_SHARE of the handshake rate and of the slots; a member or controller from
another address still connects. (127.0.0.2 is another source on the loopback.)"""

from __future__ import annotations

import socket
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

from silofs.control.client import ControlError
from silofs.control.server import SOURCE_SHARE
from tests.support.poll import DEADLINE, wait_for
from tests.unit.test_control_tls import assert_served, pki, tls_server  # noqa: F401

FLOOD = ("127.0.0.2", 0)


def _served(port: int, pki: dict[str, Path]) -> bool:  # noqa: F811
    try:
        assert_served(port, pki)
        return True
    except ControlError:
        return False


# A client of its own (no GIL shared with the listener's thread): connections opened
# and closed as fast as it can, from 127.0.0.2, no TLS at all.
_FLOOD = """
import socket, sys
port = int(sys.argv[1])
while True:
    try:
        socket.create_connection(("127.0.0.1", port), 2, ("127.0.0.2", 0)).close()
    except OSError:
        pass
"""


def test_a_connection_flood_from_one_address_leaves_the_others_room(
    pki: dict[str, Path],  # noqa: F811
) -> None:
    with tls_server(pki, handshakes_per_second=20) as (port, acc):
        flood = subprocess.Popen([sys.executable, "-c", _FLOOD, str(port)])
        try:
            wait_for(lambda: acc.refused >= 200, DEADLINE, "the flood to be refused")
            ok = 0
            for _ in range(5):
                # The tokens the flood leaves (a quarter of the rate) accrue for the
                # others (it once took every one as it came)...
                wait_for(lambda: acc.tokens >= 3, DEADLINE, "tokens left by the flood")
                # ...so another address gets in, though the flood may win a race for
                # one of them on a loaded host.
                ok += _served(port, pki)
            assert ok >= 3, ok
        finally:
            flood.kill()
            flood.wait()


def test_silent_connections_from_one_address_hold_only_its_share_of_the_slots(
    pki: dict[str, Path],  # noqa: F811
) -> None:
    limit = 8
    with tls_server(pki, max_connections=limit, handshake_seconds=30) as (port, acc):
        with ExitStack() as held:
            for _ in range(limit):
                s = socket.create_connection(("127.0.0.1", port), DEADLINE, FLOOD)
                held.enter_context(s)
            share = int(limit * SOURCE_SHARE)
            wait_for(lambda: acc.open == share and acc.refused == limit - share, DEADLINE,
                     "one address's share held, the rest refused")  # fmt: skip
            assert_served(port, pki)  # another address gets in while they wait
