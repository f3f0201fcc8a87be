"""A home never caches bytes under a content id the store does not give them: before a
store GET for a member (node/peer_serve.py), the content id the member names (which
makes the chunk key) must be the one the store gives the version it names (the GET's
condition): the backend vouches where the id is made of the version (Backend.identifies),
else this node's listing must name the object so. In-process, no GET is made: a forged
ask is refused before the charge round trip."""

from __future__ import annotations

import dataclasses

import pytest
import trio

from silofs.errors import UsageError
from silofs.node.backends import azurelist, open_backend
from silofs.node.backends.base import BackendOptions
from silofs.node.daemon import Daemon
from silofs.node.peer_serve import ChargeFirst
from silofs.node.peer_wire import ChunkAsk
from silofs.records import ObjectInfo
from silofs.uri import parse_uri
from tests.unit.inprocess import running
from tests.unit.test_peer_serve import CHUNK, home  # noqa: F401 (a fixture)

_AZ_K = azurelist.blob_scope("a", "c", "k")  # blob k of container c, account a


def _info(version: str, size: int, cid: str) -> ObjectInfo:
    return ObjectInfo("k", size, 0.0, version, cid)


@pytest.mark.parametrize(
    ("uri", "good", "forged"),
    [
        ("s3://b/", _info("e1", 10, "s3:e1:10"), _info("e1", 10, "s3:e2:10")),
        ("gs://b/", _info("7", 10, "gs-md5:abc==:10:7"), _info("7", 10, "gs-md5:abc==:10:8")),
        (
            "az://a/c/",
            _info("0x1", 10, f"az-etag:0x1:10:{_AZ_K}"),
            _info("0x1", 10, f"az-etag:0x2:10:{_AZ_K}"),
        ),
    ],
)
def test_a_store_vouches_only_for_the_content_id_of_the_version(
    uri: str, good: ObjectInfo, forged: ObjectInfo
) -> None:
    backend = open_backend(parse_uri(uri), BackendOptions())
    try:
        assert backend.identifies(good)
        assert not backend.identifies(forged)
        assert not backend.identifies(dataclasses.replace(good, size=good.size + 1))
        if uri.startswith("az"):  # a digest, which the GET's answer names (and is checked)
            assert backend.identifies(_info("0x1", 10, f"az-md5:abc==:10:{_AZ_K}"))
            assert not backend.identifies(_info("0x1", 10, f"az-md5:abc==:11:{_AZ_K}"))
            # Another blob's id, or one of the form before ids named their blob.
            other = azurelist.blob_scope("a", "c", "other")
            for cid in (f"az-md5:abc==:10:{other}", "az-md5:abc==:10", "az-etag:0x1:10"):
                assert not backend.identifies(_info("0x1", 10, cid)), cid
    finally:
        backend.close()


def test_a_forged_content_id_of_an_introduced_dataset_is_refused_before_any_get(
    home: Daemon,  # noqa: F811
) -> None:
    async def main() -> None:
        async with running(home) as d:
            await d.cluster.home.introduce("s3://b/", {})
            honest = ChunkAsk("s3://b/", "a", "s3:e1:10", 10, "e1", CHUNK, 0, "j")
            with pytest.raises(ChargeFirst):  # vouched for: the next step is the charge
                await d.cluster.home.serve(honest)
            forged = dataclasses.replace(honest, content_id="s3:e2:10")
            for ask in (forged, dataclasses.replace(forged, charged=True),
                        dataclasses.replace(forged, warm=True, charged=True)):  # fmt: skip
                with pytest.raises(UsageError, match="content id"):
                    await d.cluster.home.serve(ask)

    trio.run(main)


def test_only_the_last_introduced_datasets_fetched_for_keep_their_store_clients(
    home: Daemon,  # noqa: F811
) -> None:
    """A store client costs ~12 MB: a home keeps those of the LIVE_CLIENTS introduced
    datasets it fetched for last, and closes the others' (built again at their next
    GET)."""
    from silofs.node.peer_serve import LIVE_CLIENTS

    closed: list[str] = []

    async def fetch(dsid: int, backend: object, *_a: object, **_k: object) -> tuple[bytes, bool]:
        return b"x" * 10, True

    async def main() -> None:
        async with running(home) as d:
            d.fetcher.fetch = fetch  # type: ignore[method-assign]
            uris = [f"s3://b{i}/" for i in range(LIVE_CLIENTS + 4)]
            for uri in uris:
                ds = await d.cluster.home.introduce(uri, {})
                ds.backend.close = lambda uri=uri: closed.append(uri)  # type: ignore[method-assign]
            # The fifth used again (the most recent now), then the first (its client
            # was closed: built again, and the least recent, the sixth, closed).
            for uri in [*uris, uris[4], uris[0]]:
                ask = ChunkAsk(uri, "a", "s3:e1:10", 10, "e1", CHUNK, 0, "j", charged=True)
                served = await d.cluster.home.serve(ask)
                assert served.value is not None and served.value.endswith(b"x" * 10)
            assert closed == [*uris[:4], uris[5]]

    trio.run(main)
