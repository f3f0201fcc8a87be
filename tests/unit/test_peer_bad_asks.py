"""What a member's chunk request naming a dataset the home has not open leaves behind:
a 404 asking to introduce it, counted for the member, and no per-dataset row (a member
could otherwise grow the daemon's memory by a row per name it makes up)."""

from __future__ import annotations

import trio

from silofs.control.peer import remote_peer
from silofs.control.router import Request
from silofs.node.api import peer as peer_api
from silofs.node.daemon import Daemon
from silofs.node.peer_wire import CLUSTER_HEADER, UNKNOWN_DATASET_HEADER
from tests.unit.inprocess import running
from tests.unit.test_peer_serve import CHUNK, home  # noqa: F401 (a fixture)


def test_asks_of_made_up_datasets_leave_no_row_per_name(home: Daemon) -> None:  # noqa: F811
    member = remote_peer("n1", ["127.0.0.1"], node=True)

    async def main() -> None:
        async with running(home) as d:
            for i in range(50):
                query = {"ds": f"s3://made-up-{i}/", "key": "a", "cid": "s3:e:10", "size": "10",
                         "version": "e", "cs": str(CHUNK), "i": "0", "job": "j"}  # fmt: skip
                req = Request("GET", "/v1/peer/chunk", query, {CLUSTER_HEADER: "c"}, b"", member)
                resp = await peer_api.get_chunk(d, req)
                assert resp.status == 404 and resp.headers[UNKNOWN_DATASET_HEADER] == "1"
            assert d.cluster.datasets == {}
            assert d.cluster.incoming["n1"].requests_in == 50

    trio.run(main)
