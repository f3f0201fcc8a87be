"""The clustered warm's walk (node/warm.py _walk_cluster) with an in-process cluster: a
home whose warm ask fails is asked again, and what still fails is counted, not hidden."""

from __future__ import annotations

import types
from typing import Any

import pytest
import trio

from silofs.cache.format import ChunkRef
from silofs.node import warm
from silofs.node.warm import WarmState, _walk_cluster

CHUNK = 1024


def _refs(n: int) -> list[ChunkRef]:
    return [ChunkRef(None, CHUNK, i, b"k%d" % i, CHUNK, b"c") for i in range(n)]  # type: ignore[arg-type]


class _Member:
    def __init__(self, address: str) -> None:
        self.address, self.is_self, self.up = address, False, True


class _Cluster:
    """Two remote members; `fails[address]` asks fail at first, then each is admitted."""

    def __init__(self, fails: dict[str, int]) -> None:
        self.members = [_Member("a"), _Member("b")]
        self.fails = dict(fails)
        self.asked: list[tuple[str, bytes]] = []
        home = lambda key: self.members[key[-1] % 2]  # noqa: E731
        self.membership = types.SimpleNamespace(
            members={m.address: m for m in self.members}, home=home, placed=home
        )

    async def recheck(self, addresses: set[str]) -> None:
        pass

    async def warm_ask(
        self, member: _Member, ds: Any, limiter: Any, job: str, ref: ChunkRef
    ) -> str:
        self.asked.append((member.address, ref.key))
        if self.fails.get(member.address, 0) > 0:
            self.fails[member.address] -= 1
            return "failed"
        return "admitted"


def _walk(cluster: _Cluster, refs: list[ChunkRef]) -> WarmState:
    w = WarmState(job="prep", paths=[], chunk_size=CHUNK, uid=0)
    d = types.SimpleNamespace(cluster=cluster)
    ds = types.SimpleNamespace(uri=types.SimpleNamespace(canonical="s3://b/ds/"))

    async def main() -> None:
        await _walk_cluster(d, ds, w, refs, None, None, trio.Semaphore(4), [])  # type: ignore[arg-type]

    trio.run(main)
    return w


@pytest.fixture(autouse=True)
def _no_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(warm, "WARM_RETRY_PAUSE", 0.0)


def test_a_failed_warm_ask_is_asked_again_and_the_share_filled() -> None:
    cluster = _Cluster({"b": 3})
    w = _walk(cluster, _refs(10))
    assert w.chunks_done == 10 and w.fetched_bytes == 10 * CHUNK
    assert w.failed_chunks == 0
    assert len(cluster.asked) == 13


def test_chunks_whose_home_keeps_failing_are_counted_not_hidden() -> None:
    cluster = _Cluster({"b": 1000})
    w = _walk(cluster, _refs(10))
    assert w.chunks_done == 5
    assert w.failed_chunks == 5 and w.view()["failed_chunks"] == 5
    # Asked once and then once per retry round, no more.
    assert len([a for a in cluster.asked if a[0] == "b"]) == 5 * (1 + warm.WARM_RETRIES)
