"""What a member's chunk request naming a dataset the home has not open leaves behind:
a 404 asking to introduce it, counted for the member, and no per-dataset row (a member
could otherwise grow the daemon's memory by a row per name it makes up); and what its
introductions of made-up datasets leave: at most MAX_INTRODUCED of them."""

from __future__ import annotations

import pytest
import trio

from silofs.control.peer import remote_peer
from silofs.control.router import Request
from silofs.node import peer_serve
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


def test_introductions_of_made_up_datasets_keep_the_last_few_and_those_with_shares(
    home: Daemon,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A member introducing made-up datasets one after another: the home keeps the
    MAX_INTRODUCED last introduced or served (each was a DatasetState and a row of every
    quota pass, for good: 5,000 grew it 17 MB), and any the cluster's share table names
    however old. One forgotten is asked to be introduced again when next named."""
    monkeypatch.setattr(peer_serve, "MAX_INTRODUCED", 20, raising=False)
    member = remote_peer("n1", ["127.0.0.1"], node=True)

    async def introduce(d: Daemon, uri: str) -> None:
        body = b'{"uri": "%s", "options": {}}' % uri.encode()
        req = Request("PUT", "/v1/peer/datasets", {}, {CLUSTER_HEADER: "c"}, body, member)
        assert (await peer_api.put_dataset(d, req)).status == 200

    async def named(d: Daemon, uri: str) -> int:
        query = {"ds": uri, "key": "a", "cid": "s3:e:10", "size": "10", "version": "e",
                 "cs": str(CHUNK), "i": "0", "job": "j", "warm": "1"}  # fmt: skip
        req = Request("GET", "/v1/peer/chunk", query, {CLUSTER_HEADER: "c"}, b"", member)
        return (await peer_api.get_chunk(d, req)).status

    async def main() -> None:
        async with running(home) as d:
            await d.cluster.shares.accept({"s3://shared-0/": 1 << 20}, {"s3://shared-0/": 1})
            await introduce(d, "s3://shared-0/")
            await introduce(d, "s3://made-up-0/")
            for i in range(1, 60):
                await introduce(d, f"s3://made-up-{i}/")
                assert await named(d, f"s3://made-up-{i}/") == 428  # a peer counters row
                if i % 10 == 0:
                    # made-up-0 served: among the last used, so kept
                    assert await named(d, "s3://made-up-0/") != 404
            kept = set(d.cluster.home.datasets)
            assert len(kept) == 20, sorted(kept)  # the cap, the one with a share among them
            assert {"s3://shared-0/", "s3://made-up-0/", "s3://made-up-59/"} <= kept
            assert "s3://made-up-1/" not in kept
            assert set(d.cluster.datasets) <= kept  # the counters of those it asked, only
            assert await named(d, "s3://made-up-1/") == 404  # forgotten: introduce it again
            await introduce(d, "s3://made-up-1/")
            assert "s3://made-up-1/" in d.cluster.home.datasets

    trio.run(main)
